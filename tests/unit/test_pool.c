// SPDX-License-Identifier: Apache-2.0
/* Fixed-size pools (cuma/pool.h) on the simulated device: blocks and reuse, constant work per
 * call (counted), misuse, the heap's figures, threads sharing a pool, fork, heap destruction. */
#include "check.h"
#include "heap/heap.h"
#include "heap/pools.h"
#include "cuma/pool.h"
#include "cuma/sim.h"

#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#define MB (1024ull * 1024)

/* Thread caches off: the heap's figures move call by call. */
static cuma_heap *make(const char *more) {
    char conf[256];
    snprintf(conf, sizeof conf, "backend:sim,tcache:off,capacity:256M,sim_clock:manual%s", more);
    return heap_make(conf);
}

static void expect_json(cuma_heap *h, const char *want) {
    char js[16384];
    CHECK_OK(cuma_stats_json(h, js, sizeof js, NULL));
    if (!strstr(js, want)) {
        fprintf(stderr, "stats JSON lacks %s:\n%s\n", want, js);
        abort();
    }
}

static void test_blocks_and_stats(void) {
    cuma_heap *h = make(",host_backing:on");
    cuma_stats s0 = heap_stats(h);
    cuma_pool *p;
    CHECK_OK(cuma_pool_create(h, 100, 8, NULL, &p));
    size_t bs, n, used;
    CHECK_OK(cuma_pool_info(p, &bs, &n, &used));
    CHECK(bs == 256 && n == 8 && used == 0);
    cuma_stats s = heap_stats(h);
    CHECK(s.pools == 1 && s.pool_bytes == 8 * 256 && s.pool_blocks == 8);
    CHECK(s.pool_blocks_in_use == 0);
    CHECK(s.num_allocs == s0.num_allocs + 1 && s.active_allocs == 1); /* one carve */
    CHECK(s.allocated_bytes >= s.pool_bytes);
    void *b[8], *extra;
    for (int i = 0; i < 8; i++) {
        CHECK_OK(cuma_pool_alloc(p, &b[i]));
        CHECK((uintptr_t)b[i] % CUMA_POOL_ALIGN == 0);
        if (i) CHECK((char *)b[i] == (char *)b[0] + 256 * i); /* side by side, in order */
        memset(b[i], 0x10 + i, 100);
    }
    CHECK_ST(cuma_pool_alloc(p, &extra), CUMA_ERR_OOM);
    CHECK(strstr(cuma_last_error(), "all 8 blocks of 100 bytes"));
    for (int i = 0; i < 8; i++) CHECK(((unsigned char *)b[i])[99] == 0x10 + i);
    s = heap_stats(h);
    CHECK(s.pool_blocks_in_use == 8 && s.num_allocs == s0.num_allocs + 1);
    CHECK(s.active_allocs == 1 && s.failed_allocs == s0.failed_allocs);
    expect_json(h, "\"pools\":1,\"pool_bytes\":2048,\"pool_blocks\":8,\"pool_blocks_in_use\":8");
    CHECK_OK(cuma_pool_info(p, NULL, NULL, &used));
    CHECK(used == 8);
    /* Last freed, first handed out again. */
    CHECK_OK(cuma_pool_free(p, b[3]));
    CHECK_OK(cuma_pool_free(p, b[6]));
    CHECK_OK(cuma_pool_alloc(p, &extra));
    CHECK(extra == b[6]);
    CHECK_OK(cuma_pool_alloc(p, &extra));
    CHECK(extra == b[3]);
    CHECK_OK(cuma_pool_validate(p));
    for (int i = 0; i < 8; i++) CHECK_OK(cuma_pool_free(p, b[i]));
    CHECK_OK(cuma_pool_free(p, NULL));
    s = heap_stats(h);
    CHECK(s.pool_blocks_in_use == 0 && s.num_frees == s0.num_frees);
    /* Never given back while the pool exists: not by trim, not by the release policy. */
    CHECK_OK(cuma_trim(h, 0));
    CHECK_OK(cuma_sim_set_time(h, 3600ull * 1000000000));
    CHECK_OK(cuma_poll(h));
    s = heap_stats(h);
    CHECK(s.active_allocs == 1 && s.mapped_bytes > 0);
    CHECK_OK(cuma_block_size(h, b[0], &bs));
    CHECK(bs >= 2048);
    CHECK_OK(cuma_validate(h));
    CHECK_OK(cuma_pool_validate(p));
    CHECK_OK(cuma_pool_destroy(p));
    CHECK_OK(cuma_pool_destroy(NULL));
    s = heap_stats(h);
    CHECK(s.pools == 0 && s.pool_bytes == 0 && s.pool_blocks == 0 && s.pool_blocks_in_use == 0);
    CHECK(s.active_allocs == 0 && s.num_frees == s0.num_frees + 1);
    expect_json(h, "\"pools\":0,\"pool_bytes\":0,\"pool_blocks\":0,\"pool_blocks_in_use\":0");
    CHECK_OK(cuma_validate(h));
    cuma_heap_destroy(h);
}

/* Every call costs one free-stack step, whatever the pool's size, and no heap call: counted. */
static void test_constant_work(void) {
    unsigned long long seed = test_seed();
    cuma_heap *h = make("");
    const size_t sizes[] = {4, 1u << 16};
    for (int t = 0; t < 2; t++) {
        size_t n = sizes[t];
        cuma_pool *p;
        CHECK_OK(cuma_pool_create(h, 64, n, NULL, &p));
        void **b = calloc(n, sizeof *b);
        CHECK(b);
        cuma_stats s0 = heap_stats(h);
        uint64_t steps0 = cuma_pool_steps(p), ops = 0;
        for (int round = 0; round < 3; round++) {
            for (size_t i = 0; i < n; i++, ops++) CHECK_OK(cuma_pool_alloc(p, &b[i]));
            for (size_t i = n; i > 1; i--) { /* shuffled frees */
                size_t j = rnd(&seed) % i;
                void *x = b[j];
                b[j] = b[i - 1], b[i - 1] = x;
            }
            for (size_t i = 0; i < n; i++, ops++) CHECK_OK(cuma_pool_free(p, b[i]));
        }
        CHECK(cuma_pool_steps(p) - steps0 == ops);
        cuma_stats s = heap_stats(h);
        CHECK(s.num_allocs == s0.num_allocs && s.num_frees == s0.num_frees);
        CHECK(s.page_creates == s0.page_creates && s.maps == s0.maps);
        CHECK_OK(cuma_pool_validate(p));
        CHECK_OK(cuma_pool_destroy(p));
        free(b);
    }
    cuma_heap_destroy(h);
}

static void test_misuse(void) {
    cuma_heap *h = make("");
    cuma_pool *p, *q, *bad = (cuma_pool *)(uintptr_t)0x100;
    void *x;
    CHECK_ST(cuma_pool_create(h, 0, 8, NULL, &bad), CUMA_ERR_INVALID);
    CHECK(strstr(cuma_last_error(), "size is 0") && !bad); /* *out cleared */
    CHECK_ST(cuma_pool_create(h, 64, 0, NULL, &bad), CUMA_ERR_INVALID);
    CHECK(strstr(cuma_last_error(), "count is 0"));
    CHECK_ST(cuma_pool_create(h, SIZE_MAX / 2, 4, NULL, &bad), CUMA_ERR_INVALID);
    CHECK(strstr(cuma_last_error(), "overflow"));
    CHECK_ST(cuma_pool_create(h, SIZE_MAX - 10, 1, NULL, &bad), CUMA_ERR_INVALID);
    CHECK(strstr(cuma_last_error(), "overflows"));
#if SIZE_MAX > UINT32_MAX
    CHECK_ST(cuma_pool_create(h, 256, (size_t)UINT32_MAX + 1, NULL, &bad), CUMA_ERR_INVALID);
    CHECK(strstr(cuma_last_error(), "count"));
#endif
    CHECK_ST(cuma_pool_create(NULL, 64, 4, NULL, &bad), CUMA_ERR_INVALID);
    CHECK_ST(cuma_pool_create(h, 64, 4, NULL, NULL), CUMA_ERR_INVALID);
    /* A carve the device cannot hold: the heap's error, naming the pool. */
    CHECK_ST(cuma_pool_create(h, 1 * MB, 512, NULL, &bad), CUMA_ERR_OOM);
    CHECK(strstr(cuma_last_error(), "cuma_pool_create: 512 blocks") &&
          strstr(cuma_last_error(), "out of memory"));
    cuma_stats s = heap_stats(h);
    CHECK(s.pools == 0 && s.pool_bytes == 0 && s.active_allocs == 0);
    CHECK_OK(cuma_pool_create(h, 1000, 8, NULL, &p));
    CHECK_OK(cuma_pool_create(h, 1000, 8, NULL, &q));
    void *a, *b, *c, *qa, *plain;
    CHECK_OK(cuma_pool_alloc(p, &a));
    CHECK_OK(cuma_pool_alloc(p, &b));
    CHECK_OK(cuma_pool_alloc(p, &c));
    CHECK_OK(cuma_pool_alloc(q, &qa));
    CHECK_OK(cuma_alloc(h, 4096, NULL, &plain));
    CHECK_ST(cuma_pool_free(p, qa), CUMA_ERR_BAD_POINTER); /* another pool's block */
    CHECK(strstr(cuma_last_error(), "is not in pool"));
    CHECK_ST(cuma_pool_free(p, plain), CUMA_ERR_BAD_POINTER); /* the heap's own */
    CHECK(strstr(cuma_last_error(), "is not in pool"));
    CHECK_ST(cuma_pool_free(p, (char *)a - 1), CUMA_ERR_BAD_POINTER); /* just below the carve */
    CHECK(strstr(cuma_last_error(), "is not in pool"));
    CHECK_ST(cuma_pool_free(p, (char *)b + 8), CUMA_ERR_BAD_POINTER);
    CHECK(strstr(cuma_last_error(), "8 bytes inside block 1"));
    CHECK_ST(cuma_pool_free(p, (char *)b + 1024 * 8), CUMA_ERR_BAD_POINTER); /* past the end */
    CHECK_ST(cuma_pool_free(NULL, a), CUMA_ERR_INVALID);
    CHECK_ST(cuma_pool_alloc(NULL, &x), CUMA_ERR_INVALID);
    CHECK_ST(cuma_pool_alloc(p, NULL), CUMA_ERR_INVALID);
    CHECK_ST(cuma_pool_info(NULL, NULL, NULL, NULL), CUMA_ERR_INVALID);
    CHECK_ST(cuma_pool_validate(NULL), CUMA_ERR_INVALID);
    CHECK_OK(cuma_pool_free(p, b));
    CHECK_ST(cuma_pool_free(p, b), CUMA_ERR_BAD_POINTER); /* double free */
    CHECK(strstr(cuma_last_error(), "block 1") && strstr(cuma_last_error(), "already free"));
    /* Nothing changed: two blocks out, the figures as they were. */
    size_t used;
    CHECK_OK(cuma_pool_info(p, NULL, NULL, &used));
    CHECK(used == 2 && heap_stats(h).pool_blocks_in_use == 3);
    CHECK_OK(cuma_pool_validate(p));
    CHECK_OK(cuma_validate(h));           /* the heap's pool figures are its two pools' sums */
    atomic_fetch_add(&h->pool_in_use, 1); /* a figure off by one: cuma_validate says so */
    CHECK_ST(cuma_validate(h), CUMA_ERR_CORRUPT);
    CHECK(strstr(cuma_last_error(), "pool figures differ"));
    atomic_fetch_sub(&h->pool_in_use, 1);
    CHECK_OK(cuma_validate(h));
    /* Destroy with blocks out: refused, saying how many, and the pool goes on working. */
    CHECK_ST(cuma_pool_destroy(p), CUMA_ERR_INVALID);
    CHECK(strstr(cuma_last_error(), "2 of the pool's 8 blocks are still allocated"));
    s = heap_stats(h);
    CHECK(s.pools == 2 && s.pool_blocks == 16 && s.pool_blocks_in_use == 3);
    CHECK_OK(cuma_pool_alloc(p, &x));
    CHECK(x == b);
    CHECK_OK(cuma_pool_free(p, x));
    CHECK_OK(cuma_pool_validate(p));
    CHECK_OK(cuma_pool_free(p, a));
    CHECK_ST(cuma_pool_destroy(p), CUMA_ERR_INVALID);
    CHECK(strstr(cuma_last_error(), "1 of the pool's 8 blocks"));
    CHECK_OK(cuma_pool_free(p, c));
    CHECK_OK(cuma_pool_destroy(p));
    CHECK_OK(cuma_pool_free(q, qa));
    CHECK_OK(cuma_pool_destroy(q));
    CHECK_OK(cuma_free(h, plain, NULL));
    s = heap_stats(h);
    CHECK(s.pools == 0 && s.pool_blocks_in_use == 0 && s.active_allocs == 0);
    CHECK_OK(cuma_validate(h));
    cuma_heap_destroy(h);
}

#define THREADS 6
#define HOLD    12
#define ROUNDS  4000

typedef struct shared {
    cuma_pool *p;
    char *base;
    _Atomic int owner[64];
    _Atomic uint64_t ops;
} shared;

typedef struct worker {
    shared *sh;
    int id;
    unsigned long long seed;
} worker;

/* Each thread holds up to HOLD blocks at a time: no block is ever out to two threads at once,
 * and what a thread writes into its block stays there until it frees it. */
static void *work(void *arg) {
    worker *w = arg;
    shared *sh = w->sh;
    void *held[HOLD];
    int n = 0;
    for (int r = 0; r < ROUNDS; r++) {
        bool take = n == 0 || (n < HOLD && rnd(&w->seed) % 2);
        if (take) {
            void *b;
            cuma_status st = cuma_pool_alloc(sh->p, &b);
            if (st == CUMA_ERR_OOM) continue; /* the others hold every block now */
            CHECK_OK(st);
            size_t i = (size_t)((char *)b - sh->base) / 256;
            CHECK(i < 64);
            int free_mark = 0;
            CHECK(atomic_compare_exchange_strong(&sh->owner[i], &free_mark, w->id + 1));
            memset(b, w->id + 1, 256);
            held[n++] = b;
        } else {
            size_t k = rnd(&w->seed) % (unsigned)n;
            void *b = held[k];
            held[k] = held[--n];
            size_t i = (size_t)((char *)b - sh->base) / 256;
            CHECK(atomic_load(&sh->owner[i]) == w->id + 1);
            CHECK(((unsigned char *)b)[0] == w->id + 1 && ((unsigned char *)b)[255] == w->id + 1);
            atomic_store(&sh->owner[i], 0);
            CHECK_OK(cuma_pool_free(sh->p, b));
        }
        atomic_fetch_add(&sh->ops, 1);
    }
    while (n) {
        void *b = held[--n];
        atomic_store(&sh->owner[(size_t)((char *)b - sh->base) / 256], 0);
        CHECK_OK(cuma_pool_free(sh->p, b));
        atomic_fetch_add(&sh->ops, 1);
    }
    return NULL;
}

static void test_threads(void) {
    unsigned long long seed = test_seed();
    cuma_heap *h = make(",host_backing:on");
    shared sh = {0};
    CHECK_OK(cuma_pool_create(h, 200, 64, NULL, &sh.p));
    void *first;
    CHECK_OK(cuma_pool_alloc(sh.p, &first));
    sh.base = first;
    CHECK_OK(cuma_pool_free(sh.p, first));
    uint64_t steps0 = cuma_pool_steps(sh.p);
    pthread_t t[THREADS];
    worker w[THREADS];
    for (int i = 0; i < THREADS; i++) {
        w[i] = (worker){&sh, i, seed + (unsigned long long)i * 0x9E3779B97F4A7C15ull};
        if (!w[i].seed) w[i].seed = 1;
        CHECK(pthread_create(&t[i], NULL, work, &w[i]) == 0);
    }
    for (int i = 0; i < THREADS; i++) pthread_join(t[i], NULL);
    CHECK(cuma_pool_steps(sh.p) - steps0 == atomic_load(&sh.ops));
    size_t used;
    CHECK_OK(cuma_pool_info(sh.p, NULL, NULL, &used));
    CHECK(used == 0 && heap_stats(h).pool_blocks_in_use == 0);
    CHECK_OK(cuma_pool_validate(sh.p));
    CHECK_OK(cuma_pool_destroy(sh.p));
    CHECK_OK(cuma_validate(h));
    cuma_heap_destroy(h);
}

/* A child gets the pool as it was; where the heap's memory is the parent's, it may not use it. */
static void test_fork(void) {
    for (int backing = 0; backing < 2; backing++) {
        cuma_heap *h = make(backing ? ",host_backing:on" : "");
        cuma_pool *p;
        void *a;
        CHECK_OK(cuma_pool_create(h, 512, 4, NULL, &p));
        CHECK_OK(cuma_pool_alloc(p, &a));
        pid_t pid = fork();
        CHECK(pid >= 0);
        if (!pid) {
            void *b;
            cuma_status st = cuma_pool_alloc(p, &b);
            int ok = backing
                         ? st == CUMA_ERR_UNSUPPORTED && cuma_pool_free(p, a) == st &&
                               cuma_pool_destroy(p) == st
                         : st == CUMA_OK && cuma_pool_free(p, b) == CUMA_OK &&
                               cuma_pool_free(p, a) == CUMA_OK && cuma_pool_destroy(p) == CUMA_OK;
            if (!ok) fprintf(stderr, "child (backing %d): %s\n", backing, cuma_last_error());
            cuma_heap_destroy(h);
            _exit(ok ? 0 : 1);
        }
        int status;
        CHECK(waitpid(pid, &status, 0) == pid);
        CHECK(WIFEXITED(status) && WEXITSTATUS(status) == 0);
        CHECK(heap_stats(h).pool_blocks_in_use == 1); /* the parent's pool is its own */
        CHECK_OK(cuma_pool_free(p, a));
        CHECK_OK(cuma_pool_destroy(p));
        cuma_heap_destroy(h);
    }
}

/* The heap takes the pools left on it along (blocks out or not); sanitizer builds see leaks. */
static void test_heap_destroy_frees_pools(void) {
    cuma_heap *h = make("");
    cuma_pool *p, *q;
    void *a;
    CHECK_OK(cuma_pool_create(h, 64, 16, NULL, &p));
    CHECK_OK(cuma_pool_create(h, 4096, 3, NULL, &q));
    CHECK_OK(cuma_pool_alloc(p, &a));
    cuma_stats s = heap_stats(h);
    CHECK(s.pools == 2 && s.pool_blocks == 19 && s.pool_bytes == 16 * 256 + 3 * 4096);
    cuma_heap_destroy(h);
}

int main(void) {
    test_blocks_and_stats();
    test_constant_work();
    test_misuse();
    test_threads();
    test_fork();
    test_heap_destroy_frees_pools();
    printf("test_pool: ok\n");
    return 0;
}
