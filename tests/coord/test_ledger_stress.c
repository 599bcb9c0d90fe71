// SPDX-License-Identifier: Apache-2.0
/* Several processes share one simulated device through the ledger at random: each allocates and
 * frees blocks of random sizes, priorities differ, the lowest has a guarantee, pressure callbacks
 * free half of a process's blocks, one process is killed in the middle. The parent samples the
 * ledger all along: the heaps never hold more than the device together, nor does one hold more
 * than what the others' guarantees leave it. Every child validates its heap (which checks its
 * slot against its pages). Prints the seed (CUMA_TEST_SEED replays it) and what each did.
 * usage: test_ledger_stress [OPS_PER_PROCESS] */
#include "check.h"
#include "cuma/ledger.h"

#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <signal.h>
#include <stdio.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#define MB       (1024ull * 1024ull)
#define CAPACITY (128 * MB)
#define NPROC    5
#define MAXLIVE  64

static const int prio[NPROC] = {-2, 0, 0, 5, 1};
static const uint64_t guarantee[NPROC] = {16 * MB, 0, 0, 0, 0};
static char ledger_name[64];
static char ledger_shm[128]; /* its shm_open name: a failed check removes it (abort handler) */
static pid_t main_pid;

static void on_abort(int sig) {
    if (getpid() == main_pid) shm_unlink(ledger_shm);
    signal(sig, SIG_DFL);
    raise(sig);
}

/* What a child reports through shared memory. */
typedef struct report {
    uint64_t allocs, ooms, frees_by_callback, calls;
    _Atomic int joined, done;
} report;

/* A child's live blocks: its main thread and its pressure callback (release thread) both free
 * them, under `lock`. */
typedef struct child {
    cuma_heap *h;
    pthread_mutex_t lock;
    void *p[MAXLIVE];
    int n;
    report *rep;
} child;

static uint64_t next(uint64_t *s) {
    *s ^= *s << 13;
    *s ^= *s >> 7;
    *s ^= *s << 17;
    return *s;
}

static void on_pressure(void *user, cuma_heap *h, uint64_t bytes) {
    child *c = user;
    (void)bytes;
    pthread_mutex_lock(&c->lock);
    c->rep->calls++;
    for (int k = c->n / 2; k > 0; k--) {
        CHECK_OK(cuma_free(h, c->p[--c->n], NULL));
        c->rep->frees_by_callback++;
    }
    pthread_mutex_unlock(&c->lock);
}

static void run_child(int id, uint64_t seed, int ops, report *rep, report *first) {
    char conf[320];
    snprintf(conf, sizeof conf,
             "backend:sim,capacity:128M,ledger:%s,priority:%d,guarantee:%llu,"
             "pressure_timeout_ms:50,release_delay_ms:%d,tcache:off,arenas:%d",
             ledger_name, prio[id], (unsigned long long)guarantee[id], 5 + 10 * id,
             id == 1 ? 2 : 1);
    /* The guarantee is in the ledger before anyone takes memory: then no admission can ever
     * count on memory guaranteed to another, which the parent checks. */
    while (id && !atomic_load(&first->joined)) usleep(100);
    child c = {.h = heap_make(conf), .rep = rep};
    atomic_store(&rep->joined, 1);
    pthread_mutex_init(&c.lock, NULL);
    CHECK_OK(cuma_add_pressure_callback(c.h, on_pressure, &c, NULL));
    uint64_t s = seed ^ (0x9E3779B97F4A7C15ull * (uint64_t)(id + 1));
    for (int i = 0; i < ops; i++) {
        uint64_t r = next(&s);
        pthread_mutex_lock(&c.lock);
        bool do_alloc = c.n == 0 || (c.n < MAXLIVE && r % 100 < 55);
        if (do_alloc) {
            size_t size = (size_t)(64 * 1024 + (next(&s) % (12 * MB)));
            pthread_mutex_unlock(&c.lock);
            void *p = NULL;
            cuma_status st = cuma_alloc(c.h, size, NULL, &p);
            CHECK(st == CUMA_OK || st == CUMA_ERR_OOM);
            pthread_mutex_lock(&c.lock);
            if (st == CUMA_OK) {
                rep->allocs++;
                if (c.n < MAXLIVE)
                    c.p[c.n++] = p;
                else
                    CHECK_OK(cuma_free(c.h, p, NULL));
            } else {
                rep->ooms++;
            }
        } else {
            int k = (int)(next(&s) % (uint64_t)c.n);
            CHECK_OK(cuma_free(c.h, c.p[k], NULL));
            c.p[k] = c.p[--c.n];
        }
        pthread_mutex_unlock(&c.lock);
        if (i % 500 == 499) CHECK_OK(cuma_validate(c.h));
        if (i % 64 == 0) usleep(200); /* let the others and the release threads run */
    }
    pthread_mutex_lock(&c.lock);
    while (c.n) CHECK_OK(cuma_free(c.h, c.p[--c.n], NULL));
    pthread_mutex_unlock(&c.lock);
    CHECK_OK(cuma_validate(c.h));
    cuma_heap_destroy(c.h);
    rep->done = 1;
}

int main(int argc, char **argv) {
    int ops = argc > 1 ? atoi(argv[1]) : 4000;
    uint64_t seed = test_seed();
    snprintf(ledger_name, sizeof ledger_name, "stress-%d", (int)getpid());
    main_pid = getpid();
    {
        char path[128];
        CHECK_OK(cuma_ledger_path(ledger_name, path, sizeof path));
        snprintf(ledger_shm, sizeof ledger_shm, "%s", path + strlen("/dev/shm"));
    }
    signal(SIGABRT, on_abort);
    report *reps = mmap(NULL, sizeof(report) * NPROC, PROT_READ | PROT_WRITE,
                        MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    CHECK(reps != MAP_FAILED);
    memset(reps, 0, sizeof(report) * NPROC);
    pid_t pid[NPROC];
    for (int i = 0; i < NPROC; i++) {
        pid[i] = fork();
        CHECK(pid[i] >= 0);
        if (!pid[i]) {
            /* The one killed midway works longest, so that it is surely still at work. */
            run_child(i, seed, i == 2 ? 3 * ops : ops, &reps[i], &reps[0]);
            _exit(0);
        }
    }
    /* Sample the ledger until every child is done; kill child 2 halfway through its work. */
    int left = NPROC, samples = 0, max_heaps = 0;
    uint64_t max_total = 0;
    bool killed = false;
    while (left) {
        cuma_ledger_entry e[16];
        size_t n = 0;
        cuma_status st = cuma_ledger_snapshot(ledger_name, e, 16, &n);
        CHECK(st == CUMA_OK || st == CUMA_ERR_IO); /* IO: not made yet, or gone */
        if (!st) {
            /* What they hold, and what they hold or are guaranteed (an unused guarantee is
             * memory nobody else may take): neither more than the device. */
            uint64_t total = 0, claimed = 0;
            for (size_t i = 0; i < n; i++) {
                CHECK(e[i].reserved <= CAPACITY);
                total += e[i].reserved;
                claimed += e[i].reserved > e[i].guarantee ? e[i].reserved : e[i].guarantee;
            }
            if (claimed > CAPACITY) {
                fprintf(stderr, "the heaps hold %llu bytes and claim %llu of a %llu-byte device\n",
                        (unsigned long long)total, (unsigned long long)claimed,
                        (unsigned long long)CAPACITY);
                CHECK(!"the ledger admitted memory that is not there or guaranteed to another");
            }
            if (total > max_total) max_total = total;
            if ((int)n > max_heaps) max_heaps = (int)n;
            samples++;
        }
        if (!killed && reps[2].allocs > (uint64_t)ops / 4) {
            kill(pid[2], SIGKILL);
            killed = true;
        }
        int status;
        pid_t w;
        while ((w = waitpid(-1, &status, WNOHANG)) > 0) {
            left--;
            int i = 0;
            while (i < NPROC && pid[i] != w) i++;
            CHECK(i < NPROC);
            if (i == 2 && killed) continue;
            if (!WIFEXITED(status) || WEXITSTATUS(status)) {
                fprintf(stderr, "child %d (pid %d) failed\n", i, (int)w);
                CHECK(!"a child failed");
            }
        }
        usleep(1000);
    }
    for (int i = 0; i < NPROC; i++)
        fprintf(stderr,
                "process %d (priority %d, guarantee %lluM): %llu allocations, %llu out of memory, "
                "%llu pressure callbacks freeing %llu blocks%s\n",
                i, prio[i], (unsigned long long)(guarantee[i] / MB),
                (unsigned long long)reps[i].allocs, (unsigned long long)reps[i].ooms,
                (unsigned long long)reps[i].calls, (unsigned long long)reps[i].frees_by_callback,
                i == 2 ? " (killed)" : "");
    fprintf(stderr, "%d ledger samples, at most %d heaps holding %.1f of %llu MiB together\n",
            samples, max_heaps, (double)max_total / (double)MB,
            (unsigned long long)(CAPACITY / MB));
    CHECK(killed && samples > 10);
    for (int i = 0; i < NPROC; i++) CHECK(i == 2 || (reps[i].done && reps[i].allocs > 0));
    /* The dead process's slot too is gone once someone looks. */
    size_t n = 0;
    CHECK_OK(cuma_ledger_snapshot(ledger_name, NULL, 0, &n));
    CHECK(n == 0);
    char path[128];
    CHECK_OK(cuma_ledger_path(ledger_name, path, sizeof path));
    shm_unlink(path + strlen("/dev/shm"));
    printf("test_ledger_stress: ok\n");
    return 0;
}
