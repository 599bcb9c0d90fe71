// SPDX-License-Identifier: Apache-2.0
/* The lock-rank checker of debug builds (lockrank.h): each thread's held mutexes, checked at
 * every blocking take. */
#include "util/lockrank.h"

#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>

static const char *const names[CUMA_RANK_N] = {
    [CUMA_RANK_OOM_RUN] = "oom_run",
    [CUMA_RANK_COMPACT_RUN] = "compact_run",
    [CUMA_RANK_PRELOAD_RETIRE] = "the preload shim's retire_lock",
    [CUMA_RANK_DEFAULT_CREATE] = "the default heaps' create_lock",
    [CUMA_RANK_DEFAULT_SETTINGS] = "the default heaps' settings_lock",
    [CUMA_RANK_FORK] = "fork_lock",
    [CUMA_RANK_ARENAS] = "arena_lock",
    [CUMA_RANK_TCACHE_REG] = "the thread caches' registry lock",
    [CUMA_RANK_ARENA] = "an arena's lock",
    [CUMA_RANK_OOM] = "oom_lock",
    [CUMA_RANK_MANAGED] = "managed_lock",
    [CUMA_RANK_POOL_LIST] = "pool_lock",
    [CUMA_RANK_POOL] = "a pool's lock",
    [CUMA_RANK_BACKEND] = "the shared backend's lock",
    [CUMA_RANK_LEDGER_LIST] = "the ledger's files lock",
    [CUMA_RANK_LEDGER] = "a ledger file's lock",
    [CUMA_RANK_TRACE_LIST] = "the trace writers' list lock",
    [CUMA_RANK_TRACE] = "a trace writer's lock",
    [CUMA_RANK_PRELOAD_OWNED] = "the preload shim's owned_lock",
};

/* More than any thread holds: every arena lock and a handful of others. */
#define MAX_HELD 32

typedef struct held {
    pthread_mutex_t *m;
    cuma_rank r;
} held;

/* The calling thread's held mutexes, in the order taken: allocated at its first take, so that
 * a build that never checks keeps only a pointer in each thread's static TLS. A library loaded
 * with dlopen (libcuma into Python, beside PyTorch's libraries) gets its thread-local block from
 * a small reserve that glibc keeps, and one whose block does not fit fails to load ("cannot
 * allocate memory in static TLS block"). */
static _Thread_local held *stack;
static _Thread_local unsigned depth;
static _Thread_local bool suspended;
static pthread_key_t stack_key;
static pthread_once_t key_once = PTHREAD_ONCE_INIT;

static void stack_free(void *v) {
    free(v);
    stack = NULL; /* a later destructor that takes a lock allocates it again */
    depth = 0;
}

static void key_make(void) {
    if (pthread_key_create(&stack_key, stack_free) != 0) abort();
}

static const char *name(cuma_rank r) {
    return r > 0 && r < CUMA_RANK_N && names[r] ? names[r] : "an unranked lock";
}

static void push(pthread_mutex_t *m, cuma_rank r) {
    if (!stack) {
        pthread_once(&key_once, key_make);
        if (!(stack = calloc(MAX_HELD, sizeof *stack))) {
            fprintf(stderr, "cuma: lock order: no host memory for the held-lock stack\n");
            abort();
        }
        pthread_setspecific(stack_key, stack);
    }
    if (depth == MAX_HELD) {
        fprintf(stderr, "cuma: lock order: more than %d locks held taking %s\n", MAX_HELD, name(r));
        abort();
    }
    stack[depth++] = (held){m, r};
}

void cuma_rank_take(pthread_mutex_t *m, cuma_rank r) {
    if (suspended) return;
    for (unsigned i = 0; i < depth; i++) {
        cuma_rank h = stack[i].r;
        if (h < r || (h == r && r == CUMA_RANK_ARENA && stack[i].m != m)) continue;
        fprintf(stderr,
                "cuma: lock order violated: taking %s (rank %d) while holding %s (rank %d); "
                "see docs/DESIGN.md, lock order\n",
                name(r), (int)r, name(h), (int)h);
        abort();
    }
    push(m, r);
}

void cuma_rank_took(pthread_mutex_t *m, cuma_rank r) {
    if (!suspended) push(m, r);
}

void cuma_rank_drop(pthread_mutex_t *m) {
    if (suspended) return;
    /* The latest take of m: locks are not always given back in the reverse order. */
    for (unsigned i = depth; i-- > 0;) {
        if (stack[i].m != m) continue;
        for (unsigned j = i + 1; j < depth; j++) stack[j - 1] = stack[j];
        depth--;
        return;
    }
}

void cuma_rank_set_suspended(bool on) {
    suspended = on;
}
