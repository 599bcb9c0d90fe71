// SPDX-License-Identifier: Apache-2.0
/* The lock-rank checker of debug builds (lockrank.h): each thread's held mutexes, checked at
 * every blocking take. */
#include "util/lockrank.h"

#include <pthread.h>
#include <stdatomic.h>
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

/* A thread's held mutexes, in the order taken. Each is taken from a list that only grows (a
 * thread that exits gives its entry back for the next thread), so that a build that never checks
 * keeps only a pointer in each thread's static TLS: a library loaded with dlopen (libcuma into
 * Python, beside PyTorch's libraries) gets its thread-local block from a small reserve that glibc
 * keeps, and one whose block does not fit fails to load ("cannot allocate memory in static TLS
 * block"). Never freed: every entry stays reachable from the list, also in a forked child whose
 * other threads (and their pointers) are gone, where a leak checker would otherwise report it. */
typedef struct rank_stack {
    struct rank_stack *next; /* set before the entry is published; constant after */
    atomic_bool in_use;      /* taken by a thread (a compare-and-swap takes it) */
    held h[MAX_HELD];
} rank_stack;

static _Atomic(rank_stack *) stacks;
static _Thread_local rank_stack *mine;
static _Thread_local unsigned depth;
static _Thread_local bool suspended;
static pthread_key_t stack_key;
static pthread_once_t key_once = PTHREAD_ONCE_INIT;

static void stack_give_back(void *v) {
    rank_stack *s = v;
    mine = NULL; /* a later destructor that takes a lock takes an entry again */
    depth = 0;
    atomic_store(&s->in_use, false);
}

static void key_make(void) {
    if (pthread_key_create(&stack_key, stack_give_back) != 0) abort();
}

static rank_stack *stack_take(void) {
    pthread_once(&key_once, key_make);
    rank_stack *s;
    for (s = atomic_load(&stacks); s; s = s->next) {
        bool no = false;
        if (atomic_compare_exchange_strong(&s->in_use, &no, true)) break;
    }
    if (!s) {
        if (!(s = calloc(1, sizeof *s))) {
            fprintf(stderr, "cuma: lock order: no host memory for the held-lock stack\n");
            abort();
        }
        atomic_init(&s->in_use, true);
        s->next = atomic_load(&stacks);
        while (!atomic_compare_exchange_weak(&stacks, &s->next, s)) {
        }
    }
    pthread_setspecific(stack_key, s);
    return s;
}

static const char *name(cuma_rank r) {
    return r > 0 && r < CUMA_RANK_N && names[r] ? names[r] : "an unranked lock";
}

static void push(pthread_mutex_t *m, cuma_rank r) {
    if (!mine) mine = stack_take();
    if (depth == MAX_HELD) {
        fprintf(stderr, "cuma: lock order: more than %d locks held taking %s\n", MAX_HELD, name(r));
        abort();
    }
    mine->h[depth++] = (held){m, r};
}

void cuma_rank_take(pthread_mutex_t *m, cuma_rank r) {
    if (suspended) return;
    for (unsigned i = 0; i < depth; i++) {
        cuma_rank h = mine->h[i].r;
        if (h < r || (h == r && r == CUMA_RANK_ARENA && mine->h[i].m != m)) continue;
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
        if (mine->h[i].m != m) continue;
        for (unsigned j = i + 1; j < depth; j++) mine->h[j - 1] = mine->h[j];
        depth--;
        return;
    }
}

void cuma_rank_set_suspended(bool on) {
    suspended = on;
}
