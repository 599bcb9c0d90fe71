// SPDX-License-Identifier: Apache-2.0
/* Helpers of the CUDA backend tests. They run against the fake driver (tests/fakecuda): its
 * "device" memory is host memory, so a test writes and reads cuma's pointers directly, and its
 * controls (fakecuda_*) count driver calls and live objects. The executables link the fake as
 * well, and CUMA_CUDA_LIBRARY names the same file, so cuma's dlopen returns that copy. */
#ifndef CUMA_TESTS_CUDA_TEST_H
#define CUMA_TESTS_CUDA_TEST_H

#include "check.h"
#include "fakecuda.h"

#include <cuda.h>
#include <signal.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#define MB (1024ull * 1024)

#define CHECK_CU(expr) CHECK((expr) == CUDA_SUCCESS)

/* The stream a test uses where a program would use its default one: the legacy stream (NULL),
 * or with CUMA_TEST_PER_THREAD_STREAM=1 (the _ptds variants) the per-thread default stream,
 * as in a program built with --default-stream per-thread. */
static inline CUstream default_stream(void) {
    const char *e = getenv("CUMA_TEST_PER_THREAD_STREAM");
    return e && e[0] == '1' ? CU_STREAM_PER_THREAD : NULL;
}
#define DS default_stream()

/* The test thread's own view of device 0, as a CUDA program has: the primary context current
 * (cuma must neither need nor disturb it) and streams it created. */
typedef struct test_ctx {
    CUdevice dev;
    CUcontext ctx;
} test_ctx;

static inline test_ctx test_ctx_open(int ordinal) {
    test_ctx t;
    CHECK_CU(cuInit(0));
    CHECK_CU(cuDeviceGet(&t.dev, ordinal));
    CHECK_CU(cuDevicePrimaryCtxRetain(&t.ctx, t.dev));
    CHECK_CU(cuCtxSetCurrent(t.ctx));
    return t;
}

static inline void test_ctx_close(test_ctx *t) {
    CHECK_CU(cuCtxSetCurrent(NULL));
    CHECK_CU(cuDevicePrimaryCtxRelease(t->dev));
}

static inline CUstream stream_new(void) {
    CUstream s = NULL;
    CHECK_CU(cuStreamCreate(&s, CU_STREAM_NON_BLOCKING));
    return s;
}

/* Fills a block with a pattern derived from its id; pattern_ok checks it. */
static inline void pattern_fill(void *p, size_t n, unsigned id) {
    unsigned char v = (unsigned char)(id * 37u + 1u);
    if (!v) v = 1;
    memset(p, v, n);
}

static inline int pattern_ok(const void *p, size_t n, unsigned id) {
    unsigned char v = (unsigned char)(id * 37u + 1u);
    if (!v) v = 1;
    const unsigned char *c = p;
    for (size_t i = 0; i < n; i++)
        if (c[i] != v) return 0;
    return 1;
}

/* A random churn of allocations that carry patterns: live blocks are checked when freed and
 * by churn_check; every 100 operations the heap is validated, every trim_every (0: never) it
 * is trimmed to trim_keep. One in big_one_in requests is up to big_max bytes, the others up to
 * small_max. */
enum { CHURN_MAX = 64 };
typedef struct churn {
    unsigned n;
    void *p[CHURN_MAX];
    size_t sz[CHURN_MAX];
    unsigned id[CHURN_MAX];
} churn;

static inline void churn_run(cuma_heap *h, churn *c, unsigned n, unsigned ops, unsigned big_one_in,
                             size_t big_max, size_t small_max, unsigned trim_every,
                             size_t trim_keep) {
    memset(c, 0, sizeof *c);
    c->n = n;
    unsigned long long seed = test_seed();
    for (unsigned op = 0; op < ops; op++) {
        unsigned i = (unsigned)(rnd(&seed) % n);
        if (c->p[i]) {
            CHECK(pattern_ok(c->p[i], c->sz[i], c->id[i]));
            CHECK_OK(cuma_free(h, c->p[i], NULL));
            c->p[i] = NULL;
        } else {
            unsigned long long r = rnd(&seed);
            c->sz[i] = (size_t)(r % big_one_in == 0 ? r % big_max + 1 : r % small_max + 1);
            c->id[i] = op;
            CHECK_OK(cuma_alloc(h, c->sz[i], NULL, &c->p[i]));
            pattern_fill(c->p[i], c->sz[i], c->id[i]);
        }
        if (op % 100 == 0) CHECK_OK(cuma_validate(h));
        if (trim_every && op % trim_every == trim_every - 1) CHECK_OK(cuma_trim(h, trim_keep));
    }
}

static inline void churn_check(const churn *c) {
    for (unsigned i = 0; i < c->n; i++)
        if (c->p[i]) CHECK(pattern_ok(c->p[i], c->sz[i], c->id[i]));
}

static inline void churn_free(cuma_heap *h, churn *c) {
    for (unsigned i = 0; i < c->n; i++) {
        if (!c->p[i]) continue;
        CHECK_OK(cuma_free(h, c->p[i], NULL));
        c->p[i] = NULL;
    }
}

/* A watchdog: a cuma call that never returns (a deadlock, a thread spinning with the heap
 * lock) aborts the test with a message instead of running into the ctest timeout. */
static const char *watchdog_what = "";

static inline void watchdog_fired(int sig) {
    (void)sig;
    static const char msg[] = "watchdog: blocked too long in: ";
    if (write(2, msg, sizeof msg - 1) < 0 || write(2, watchdog_what, strlen(watchdog_what)) < 0 ||
        write(2, "\n", 1) < 0) {
    }
    abort();
}

/* Arms the watchdog for `seconds` (0 disarms). */
static inline void watchdog(unsigned seconds, const char *what) {
    watchdog_what = what;
    signal(SIGALRM, watchdog_fired);
    alarm(seconds);
}

/* Nothing the heap obtained from the driver is left. */
static inline void check_no_driver_objects(void) {
    static const char *kinds[] = {"handles", "mappings", "reservations",
                                  "allocs",  "managed",  "events"};
    for (size_t i = 0; i < sizeof kinds / sizeof kinds[0]; i++) {
        long n = fakecuda_live(kinds[i]);
        if (n != 0) {
            fprintf(stderr, "leak: fakecuda_live(\"%s\") == %ld\n", kinds[i], n);
            abort();
        }
    }
}

#endif
