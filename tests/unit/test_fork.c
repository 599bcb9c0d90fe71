// SPDX-License-Identifier: Apache-2.0
/* Heaps across fork(): a child inherits every heap while other threads of the parent allocate,
 * free and release on them (and their release threads wait on their condition variables). The
 * child must be able to allocate, validate and destroy the heaps it got; the parent's heaps must
 * go on as before. Each child runs under alarm(): a lock it inherited held, or a condition
 * variable still waiting for the parent's release thread, shows as SIGALRM, not as a hang.
 *
 * usage: test_fork [SEED]  (the seed is printed) */
#include "check.h"
#include "cuma/ledger.h"

#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#define FORKS   40
#define WORKERS 2

static atomic_bool stop;
#define HEAPS 3
static cuma_heap *heaps[HEAPS];
static unsigned seed;

/* Allocates and frees at random on both heaps, with trims and stats calls among them, so that
 * at any fork some lock is likely held by this thread. */
static void *worker(void *arg) {
    unsigned r = seed + (unsigned)(uintptr_t)arg * 7919u;
    void *live[33] = {0};
    while (!atomic_load(&stop)) {
        cuma_heap *h = heaps[rand_r(&r) % HEAPS];
        unsigned k = (unsigned)rand_r(&r) % 33;
        cuma_heap *owner = heaps[k % HEAPS];
        if (live[k]) {
            CHECK_OK(cuma_free(owner, live[k], 0));
            live[k] = NULL;
        } else {
            size_t size =
                (size_t)(rand_r(&r) % 3 ? 1 + rand_r(&r) % 65536 : 1 + rand_r(&r) % (4 << 20));
            CHECK_OK(cuma_alloc(owner, size, 0, &live[k]));
        }
        unsigned op = (unsigned)rand_r(&r) % 64;
        if (op == 0) CHECK_OK(cuma_trim(h, 0));
        if (op == 1) {
            cuma_stats s;
            CHECK_OK(cuma_get_stats(h, &s));
        }
    }
    for (unsigned k = 0; k < 33; k++)
        if (live[k]) CHECK_OK(cuma_free(heaps[k % HEAPS], live[k], 0));
    return NULL;
}

/* The child: a few allocations on each inherited heap, a check of those without thread caches,
 * then all destroyed. A heap in a ledger serves a child from its cache only: the ledger's slot is
 * the parent's, so growing is refused (CUMA_ERR_UNSUPPORTED, saying so). The heap with thread
 * caches is not checked: a parent's thread caught inside a lock-free fast path at the fork never
 * finishes it in the child (a block, or its counters, stay half moved: cuma.h says so). */
static void child(unsigned r) {
    alarm(60); /* a hang, not a speed: the child takes well under a second unloaded */
    for (int i = 0; i < HEAPS; i++) {
        void *p[8] = {0};
        for (int k = 0; k < 8; k++) {
            cuma_status st = cuma_alloc(heaps[i], 1 + rand_r(&r) % (1 << 20), 0, &p[k]);
            if (i == 1 && st == CUMA_ERR_UNSUPPORTED && strstr(cuma_last_error(), "through fork"))
                continue;
            CHECK_OK(st);
        }
        for (int k = 0; k < 8; k++)
            if (p[k]) CHECK_OK(cuma_free(heaps[i], p[k], 0));
        if (i < 2) CHECK_OK(cuma_validate(heaps[i]));
    }
    for (int i = 0; i < HEAPS; i++) cuma_heap_destroy(heaps[i]);
    _exit(0);
}

int main(int argc, char **argv) {
    seed = argc > 1 ? (unsigned)strtoul(argv[1], NULL, 0) : (unsigned)time(NULL);
    printf("test_fork: seed %u\n", seed);
    fflush(stdout);
    char ledger[64], conf[192];
    snprintf(ledger, sizeof ledger, "test-fork-%d", (int)getpid());
    /* One heap with several arenas and a short release delay (its release thread busy), one in a
     * named ledger (its release thread polls every 5 ms, and a child must not touch its slot),
     * both without thread caches so that every call takes the locks a fork must hold; one with
     * thread caches. */
    heaps[0] = heap_make("backend:sim,capacity:2G,arenas:3,release_delay_ms:2,tcache:off");
    snprintf(conf, sizeof conf, "backend:sim,capacity:2G,release_delay_ms:5,tcache:off,ledger:%s",
             ledger);
    heaps[1] = heap_make(conf);
    heaps[2] = heap_make("backend:sim,capacity:2G,release_delay_ms:2,tcache_age_ms:1");
    pthread_t t[WORKERS];
    for (uintptr_t i = 0; i < WORKERS; i++) CHECK(!pthread_create(&t[i], NULL, worker, (void *)i));
    unsigned r = seed;
    for (int f = 0; f < FORKS; f++) {
        struct timespec ts = {0, (long)(rand_r(&r) % 3000000)};
        nanosleep(&ts, NULL);
        fflush(stdout);
        pid_t pid = fork();
        CHECK(pid >= 0);
        if (!pid) child(r);
        int ws;
        CHECK(waitpid(pid, &ws, 0) == pid);
        if (!WIFEXITED(ws) || WEXITSTATUS(ws)) {
            fprintf(stderr, "test_fork: child %d of fork %d %s %d (seed %u)\n", (int)pid, f,
                    WIFSIGNALED(ws) ? "died of signal" : "exited with",
                    WIFSIGNALED(ws) ? WTERMSIG(ws) : WEXITSTATUS(ws), seed);
            return 1;
        }
    }
    atomic_store(&stop, true);
    for (int i = 0; i < WORKERS; i++) pthread_join(t[i], NULL);
    for (int i = 0; i < HEAPS; i++) CHECK_OK(cuma_validate(heaps[i]));
    /* The parent's slot survived its children's destroys. */
    cuma_ledger_entry e[4];
    size_t n = 0;
    CHECK_OK(cuma_ledger_snapshot(ledger, e, 4, &n));
    CHECK(n == 1 && e[0].pid == (int)getpid());
    /* Its release threads still run: idle pages go back without a call into the heap. */
    CHECK_OK(cuma_trim(heaps[0], 0));
    void *p;
    CHECK_OK(cuma_alloc(heaps[0], 8 << 20, 0, &p));
    CHECK_OK(cuma_free(heaps[0], p, 0));
    cuma_stats s;
    for (int i = 0; i < 20000; i++) { /* 20 s at least: a bound on a hang, not on speed */
        CHECK_OK(cuma_get_stats(heaps[0], &s));
        if (!s.cached_bytes) break;
        usleep(1000);
    }
    CHECK(s.cached_bytes == 0);
    char path[128];
    CHECK_OK(cuma_ledger_path(ledger, path, sizeof path));
    for (int i = 0; i < HEAPS; i++) cuma_heap_destroy(heaps[i]);
    unlink(path);
    printf("test_fork: %d forks, every child allocated, validated and destroyed its heaps\n",
           FORKS);
    return 0;
}
