// SPDX-License-Identifier: Apache-2.0
/* Compaction (cuma/compact.h) on the simulated device with host backing, so that the data the
 * movers copy is real: a heap fragmented by small live blocks among freed large ones is
 * compacted, its data found intact at the new places, its stranded share under the threshold;
 * a refusing mover leaves everything in place; the out-of-memory rung makes a failing
 * allocation succeed; cuma_compact_if_needed runs only over the threshold; pools' carves never
 * move; segment mode and the buddy refuse. Randomized sizes print their seed. */
#include "check.h"
#include "heap/heap.h"
#include "cuma/compact.h"
#include "cuma/pool.h"

#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>
#include <string.h>

#define KB     1024ull
#define MB     (1024ull * KB)
#define NSMALL 24
#define NDENSE 16

/* The program's side: the blocks it owns and where they are now. */
typedef struct owner {
    cuma_heap *h;
    void *p[NSMALL];
    size_t n[NSMALL];
    int calls;
    bool refuse, nested; /* refuse every move; try to compact and allocate from inside one */
    bool take_any;       /* also move (copy only) blocks it does not know */
    bool free_first;     /* free the block from inside its move, then claim to have moved it */
    int unknown;         /* such moves */
} owner;

static unsigned char pattern(int i, size_t k) {
    return (unsigned char)(i * 37 + k * 11 + 1);
}

static void fill(owner *o) {
    for (int i = 0; i < NSMALL; i++)
        for (size_t k = 0; k < o->n[i]; k++) ((unsigned char *)o->p[i])[k] = pattern(i, k);
}

static void check_data(const owner *o) {
    for (int i = 0; i < NSMALL; i++)
        for (size_t k = 0; k < o->n[i]; k++) CHECK(((unsigned char *)o->p[i])[k] == pattern(i, k));
}

static bool mover(void *user, void *old_ptr, void *new_ptr, size_t size, cuma_stream stream) {
    owner *o = user;
    (void)stream;
    o->calls++;
    if (o->nested) {
        CHECK_ST(cuma_compact(o->h, mover, o, NULL), CUMA_ERR_INVALID);
        CHECK_ST(cuma_compact_if_needed(o->h, NULL), CUMA_ERR_INVALID);
        void *big = NULL;
        /* Out of memory inside a mover: no second compaction, no wait, just the failure. */
        CHECK_ST(cuma_alloc(o->h, 40 * MB, NULL, &big), CUMA_ERR_OOM);
    }
    if (o->refuse) return false;
    if (o->free_first) {
        /* The program freed it while its move was under way: the move must not commit. */
        CHECK_OK(cuma_free(o->h, old_ptr, NULL));
        for (int i = 0; i < NSMALL; i++)
            if (o->p[i] == old_ptr) o->p[i] = NULL, o->n[i] = 0;
        return true;
    }
    for (int i = 0; i < NSMALL; i++) {
        if (o->p[i] != old_ptr) continue;
        CHECK(size == o->n[i]);
        memcpy(new_ptr, old_ptr, size);
        o->p[i] = new_ptr;
        return true;
    }
    if (!o->take_any) return false; /* not ours */
    memcpy(new_ptr, old_ptr, size);
    o->unknown++;
    return true;
}

static cuma_heap *make(const char *more) {
    char conf[256];
    snprintf(conf, sizeof conf,
             "backend:sim,host_backing:on,tcache:off,capacity:512M,page_size:2M,"
             "sim_clock:manual%s",
             more);
    return heap_make(conf);
}

/* NDENSE live 4 MiB blocks (whole pages), then NSMALL small live blocks each among freed large
 * ones: every small block keeps a page or two mapped for a few KiB. */
static void fragment(owner *o, unsigned long long *seed, void **dense) {
    for (int i = 0; i < NDENSE; i++) CHECK_OK(cuma_alloc(o->h, 4 * MB, NULL, &dense[i]));
    void *big[NSMALL];
    for (int i = 0; i < NSMALL; i++) {
        o->n[i] = (size_t)(4 * KB + rnd(seed) % (44 * KB));
        CHECK_OK(cuma_alloc(o->h, o->n[i], NULL, &o->p[i]));
        CHECK_OK(cuma_alloc(o->h, (size_t)(2 * MB + rnd(seed) % (2 * MB)), NULL, &big[i]));
    }
    for (int i = 0; i < NSMALL; i++) CHECK_OK(cuma_free(o->h, big[i], NULL));
    CHECK_OK(cuma_trim(o->h, 0));
    fill(o);
}

static void test_compacts(unsigned long long *seed, const char *more) {
    owner o = {.h = make(more)};
    void *dense[NDENSE];
    fragment(&o, seed, dense);
    cuma_stats s0 = heap_stats(o.h);
    CHECK(s0.fragmentation > 0.30);
    cuma_compact_result r;
    CHECK_OK(cuma_compact(o.h, mover, &o, &r));
    cuma_stats s1 = heap_stats(o.h);
    size_t want = 0;
    for (int i = 0; i < NSMALL; i++) want += o.n[i];
    CHECK(r.blocks_moved == NSMALL && r.blocks_refused == 0 && r.bytes_moved == want);
    CHECK(o.calls == NSMALL);
    check_data(&o);
    CHECK(s1.fragmentation < 0.05);
    CHECK(r.pages_emptied > 0 && r.pages_released > 0);
    CHECK(s1.reserved_bytes + r.pages_released * s1.page_size ==
          s0.reserved_bytes + (s1.page_creates - s0.page_creates) * s1.page_size);
    CHECK(s1.requested_bytes == s0.requested_bytes && s1.active_allocs == s0.active_allocs);
    CHECK(s1.compactions == 1 && s1.compact_moved_bytes == want &&
          s1.compact_freed_pages == r.pages_emptied);
    char js[16384];
    CHECK_OK(cuma_stats_json(o.h, js, sizeof js, NULL));
    CHECK(strstr(js, "\"compactions\":1,"));
    CHECK_OK(cuma_validate(o.h));
    printf("compaction: %d blocks, %zu bytes copied; %llu pages emptied, %llu released; "
           "fragmentation %.3f -> %.4f; mapped %llu -> %llu MiB; %.1f pages freed per MiB "
           "copied\n",
           NSMALL, want, (unsigned long long)r.pages_emptied, (unsigned long long)r.pages_released,
           s0.fragmentation, s1.fragmentation, (unsigned long long)(s0.mapped_bytes / MB),
           (unsigned long long)(s1.mapped_bytes / MB),
           (double)r.pages_emptied / ((double)want / (double)MB));
    /* The moved blocks are the program's as any other: freed at their new places. */
    for (int i = 0; i < NSMALL; i++) CHECK_OK(cuma_free(o.h, o.p[i], NULL));
    for (int i = 0; i < NDENSE; i++) CHECK_OK(cuma_free(o.h, dense[i], NULL));
    CHECK(heap_stats(o.h).active_allocs == 0);
    CHECK_OK(cuma_validate(o.h));
    cuma_heap_destroy(o.h);
}

static void test_refused(unsigned long long *seed) {
    owner o = {.h = make(""), .refuse = true};
    void *dense[NDENSE];
    fragment(&o, seed, dense);
    void *before[NSMALL];
    memcpy(before, o.p, sizeof before);
    cuma_stats s0 = heap_stats(o.h);
    cuma_compact_result r;
    CHECK_OK(cuma_compact(o.h, mover, &o, &r));
    cuma_stats s1 = heap_stats(o.h);
    CHECK(r.blocks_moved == 0 && r.blocks_refused == NSMALL && r.bytes_moved == 0);
    CHECK(r.pages_emptied == 0);
    CHECK(!memcmp(before, o.p, sizeof before));
    check_data(&o);
    CHECK(s1.mapped_bytes == s0.mapped_bytes && s1.requested_bytes == s0.requested_bytes);
    CHECK(s1.compactions == 1 && s1.compact_moved_bytes == 0);
    CHECK_OK(cuma_validate(o.h));
    for (int i = 0; i < NSMALL; i++) {
        size_t sz;
        CHECK_OK(cuma_block_size(o.h, o.p[i], &sz));
    }
    cuma_heap_destroy(o.h);
}

/* Every block freed by the program while its move runs: the moves are undone, their new places
 * freed, nothing is left live. */
static void test_freed_during_move(unsigned long long *seed) {
    owner o = {.h = make(""), .free_first = true};
    void *dense[NDENSE];
    fragment(&o, seed, dense);
    cuma_compact_result r;
    CHECK_OK(cuma_compact(o.h, mover, &o, &r));
    CHECK(r.blocks_moved == 0 && r.blocks_refused == NSMALL);
    cuma_stats s = heap_stats(o.h);
    CHECK(s.active_allocs == NDENSE && s.requested_bytes == NDENSE * 4 * MB);
    CHECK_OK(cuma_validate(o.h));
    cuma_heap_destroy(o.h);
}

/* The blocks of a second arena move too (each arena compacts under its own lock). */
static void *fragment_in_arena1(void *arg) {
    owner *o = arg;
    CHECK_OK(cuma_arena_use(o->h, 1));
    unsigned long long seed = 7;
    void *dense[NDENSE];
    fragment(o, &seed, dense);
    return NULL;
}

static void test_second_arena(void) {
    owner o = {.h = make(",arenas:2")};
    pthread_t t;
    CHECK(pthread_create(&t, NULL, fragment_in_arena1, &o) == 0);
    CHECK(pthread_join(t, NULL) == 0);
    CHECK(heap_stats(o.h).arenas == 2);
    cuma_compact_result r;
    CHECK_OK(cuma_compact(o.h, mover, &o, &r));
    CHECK(r.blocks_moved == NSMALL && r.pages_emptied > 0);
    check_data(&o);
    CHECK(heap_stats(o.h).fragmentation < 0.05);
    CHECK_OK(cuma_validate(o.h));
    cuma_heap_destroy(o.h);
}

/* Another thread allocates and frees (its blocks the mover does not know, so refuses) while the
 * main thread compacts again and again; run under ThreadSanitizer too. */
typedef struct churn {
    cuma_heap *h;
    _Atomic bool stop;
    unsigned long long seed;
} churn;

static void *churn_run(void *arg) {
    churn *c = arg;
    void *mine[32] = {0};
    while (!atomic_load(&c->stop)) {
        int k = (int)(rnd(&c->seed) % 32);
        if (mine[k]) {
            CHECK_OK(cuma_free(c->h, mine[k], NULL));
            mine[k] = NULL;
        } else {
            size_t n = (size_t)(512 + rnd(&c->seed) % (3 * MB));
            if (cuma_alloc(c->h, n, NULL, &mine[k]) != CUMA_OK) mine[k] = NULL;
        }
    }
    for (int k = 0; k < 32; k++) CHECK_OK(cuma_free(c->h, mine[k], NULL));
    return NULL;
}

static void test_concurrent(unsigned long long *seed) {
    owner o = {.h = make("")};
    void *dense[NDENSE];
    fragment(&o, seed, dense);
    churn c = {.h = o.h, .seed = rnd(seed) | 1};
    atomic_store(&c.stop, false);
    pthread_t t;
    CHECK(pthread_create(&t, NULL, churn_run, &c) == 0);
    for (int i = 0; i < 20; i++) CHECK_OK(cuma_compact(o.h, mover, &o, NULL));
    atomic_store(&c.stop, true);
    CHECK(pthread_join(t, NULL) == 0);
    check_data(&o);
    CHECK_OK(cuma_validate(o.h));
    CHECK(heap_stats(o.h).compactions == 20);
    cuma_heap_destroy(o.h);
}

/* A full device: one small block at the start of each of its 32 pages. An allocation of four
 * pages fails; with a mover registered, the out-of-memory rung moves the small blocks together
 * and the same allocation succeeds. */
static void test_oom_rung(unsigned long long *seed) {
    owner o = {.h = heap_make("backend:sim,host_backing:on,tcache:off,capacity:48M,page_size:2M,"
                              "sim_clock:manual")};
    void *big[NSMALL];
    for (int i = 0; i < NSMALL; i++) {
        o.n[i] = (size_t)(4 * KB + rnd(seed) % (56 * KB)) & ~(size_t)511;
        CHECK_OK(cuma_alloc(o.h, o.n[i], NULL, &o.p[i]));
        CHECK_OK(cuma_alloc(o.h, 2 * MB - o.n[i], NULL, &big[i]));
    }
    for (int i = 0; i < NSMALL; i++) CHECK_OK(cuma_free(o.h, big[i], NULL));
    fill(&o);
    void *x = NULL;
    CHECK_ST(cuma_alloc(o.h, 8 * MB, NULL, &x), CUMA_ERR_OOM);
    CHECK(heap_stats(o.h).compactions == 0);
    o.nested = true; /* the mover tries to compact and to allocate: neither recurses */
    CHECK_OK(cuma_set_mover(o.h, mover, &o));
    CHECK_OK(cuma_alloc(o.h, 8 * MB, NULL, &x));
    cuma_stats s = heap_stats(o.h);
    CHECK(s.compactions == 1 && s.compact_freed_pages >= 4);
    CHECK(o.calls > 0);
    check_data(&o);
    memset(x, 0xab, 8 * MB); /* the new block is real memory */
    check_data(&o);
    CHECK_OK(cuma_validate(o.h));
    /* Unregistered: the next shortage fails again without a compaction. */
    CHECK_OK(cuma_set_mover(o.h, NULL, NULL));
    void *y = NULL;
    CHECK_ST(cuma_alloc(o.h, 40 * MB, NULL, &y), CUMA_ERR_OOM);
    CHECK(heap_stats(o.h).compactions == 1);
    cuma_heap_destroy(o.h);
}

static void test_if_needed(unsigned long long *seed) {
    owner o = {.h = make("")};
    cuma_compact_result r;
    /* Nothing to do on an empty heap, mover or not. */
    CHECK_OK(cuma_compact_if_needed(o.h, &r));
    CHECK(heap_stats(o.h).compactions == 0);
    void *dense[NDENSE];
    fragment(&o, seed, dense);
    CHECK_OK(cuma_compact_if_needed(o.h, &r)); /* no mover */
    CHECK(r.blocks_moved == 0 && heap_stats(o.h).compactions == 0);
    CHECK_OK(cuma_set_mover(o.h, mover, &o));
    CHECK_OK(cuma_compact_if_needed(o.h, &r));
    CHECK(r.blocks_moved == NSMALL && heap_stats(o.h).compactions == 1);
    check_data(&o);
    CHECK(heap_stats(o.h).fragmentation < 0.05);
    /* Under the threshold now: a second call leaves the heap alone. */
    CHECK_OK(cuma_compact_if_needed(o.h, &r));
    CHECK(r.blocks_moved == 0 && heap_stats(o.h).compactions == 1);
    CHECK_OK(cuma_validate(o.h));
    cuma_heap_destroy(o.h);
}

/* A pool's carve on a sparse page is the pool's, not the program's: it is never offered, even
 * to a mover that would take anything (a moved carve would leave the pool pointing at freed
 * memory, which cuma_pool_validate reports). */
static void test_pool_carve_stays(unsigned long long *seed) {
    owner o = {.h = make(""), .take_any = true};
    void *dense[NDENSE];
    fragment(&o, seed, dense);
    cuma_pool *pool;
    CHECK_OK(cuma_pool_create(o.h, 4096, 4, NULL, &pool));
    void *blk;
    CHECK_OK(cuma_pool_alloc(pool, &blk));
    CHECK_OK(cuma_compact(o.h, mover, &o, NULL));
    CHECK(o.unknown == 0);
    check_data(&o);
    void *again;
    CHECK_OK(cuma_pool_free(pool, blk));
    CHECK_OK(cuma_pool_alloc(pool, &again));
    CHECK(again == blk);
    CHECK_OK(cuma_pool_validate(pool));
    CHECK_OK(cuma_validate(o.h));
    CHECK_OK(cuma_pool_free(pool, again));
    CHECK_OK(cuma_pool_destroy(pool));
    cuma_heap_destroy(o.h);
}

static void test_unsupported(void) {
    owner o = {.h = heap_make("backend:sim,sim_segments:on,tcache:off,capacity:64M")};
    CHECK_ST(cuma_compact(o.h, mover, &o, NULL), CUMA_ERR_UNSUPPORTED);
    CHECK(strstr(cuma_last_error(), "segment mode"));
    CHECK_ST(cuma_set_mover(o.h, mover, &o), CUMA_ERR_UNSUPPORTED);
    cuma_heap_destroy(o.h);
    o.h = heap_make("backend:sim,policy:buddy,tcache:off,capacity:64M");
    CHECK_ST(cuma_compact(o.h, mover, &o, NULL), CUMA_ERR_UNSUPPORTED);
    CHECK(strstr(cuma_last_error(), "buddy"));
    cuma_heap_destroy(o.h);
    CHECK_ST(cuma_compact(NULL, mover, NULL, NULL), CUMA_ERR_INVALID);
    o.h = make("");
    CHECK_ST(cuma_compact(o.h, NULL, NULL, NULL), CUMA_ERR_INVALID);
    cuma_heap_destroy(o.h);
}

int main(void) {
    unsigned long long seed = test_seed();
    test_compacts(&seed, "");
    test_compacts(&seed, ",tcache:on"); /* blocks the fast path handed out move too */
    test_refused(&seed);
    test_freed_during_move(&seed);
    test_second_arena();
    test_concurrent(&seed);
    test_oom_rung(&seed);
    test_if_needed(&seed);
    test_pool_carve_stays(&seed);
    test_unsupported();
    printf("test_compact: ok\n");
    return 0;
}
