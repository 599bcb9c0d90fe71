// SPDX-License-Identifier: Apache-2.0
/* Randomized multi-threaded stress test against a shadow model.
 *
 * Threads allocate and free (also each other's blocks, handed over through a shared exchange)
 * on a few streams, on a small host-backed simulated device so that pages are created, cached,
 * stolen and released all the time. Every allocation carries tags written into its memory (one
 * per page it touches); a tag found changed means two live allocations shared memory. After each
 * phase the live set is checked for overlaps and cuma_validate walks every structure.
 *
 * With a second argument `spread`, thread t allocates from arena t from the start (the heap's
 * arenas are otherwise made only when threads keep colliding), so blocks are freed across arenas
 * and the out-of-memory path empties other arenas' caches.
 *
 * CUMA_STRESS_OPS (default 1200000) sets the total operation count; CUMA_TEST_SEED replays a run.
 */
#include "check.h"
#include "heap/heap.h"

#include <pthread.h>
#include <stdint.h>
#include <string.h>

#define THREADS  3
#define PHASES   4
#define SLOTS    512
#define EXCHANGE 64

typedef struct live {
    uint64_t *p;
    size_t size;
    uint64_t tag;
} live;

static cuma_heap *heap;
static size_t page_size;
static live exchange[EXCHANGE];
static pthread_mutex_t exchange_lock = PTHREAD_MUTEX_INITIALIZER;
static unsigned long long base_seed;
static bool spread;
static long ops_per_thread_phase;
static live slots[THREADS][SLOTS];

static cuma_stream stream_of(unsigned long long r) {
    return (cuma_stream)(uintptr_t)(r % 3 ? (r % 3) * 0x100 : 0);
}

/* Tags at the start, at every page boundary inside, and at the end. */
static void for_each_tag_spot(const live *l, void (*fn)(uint64_t *, uint64_t)) {
    char *base = (char *)l->p;
    fn((uint64_t *)base, l->tag);
    uintptr_t a = (uintptr_t)base, end = a + ((l->size - 8) & ~(size_t)7); /* the end tag's spot */
    for (uintptr_t pg = (a / page_size + 1) * page_size; pg < end; pg += page_size)
        fn((uint64_t *)pg, l->tag ^ pg);
    if (end > a) fn((uint64_t *)end, ~l->tag);
}

static void put_tag(uint64_t *w, uint64_t v) {
    *w = v;
}
static _Thread_local int bad_tags;
static void check_tag(uint64_t *w, uint64_t v) {
    bad_tags += *w != v;
}

static void write_tags(live *l) {
    if (l->size >= 8) for_each_tag_spot(l, put_tag);
}

static void verify_and_free(live *l, cuma_stream s) {
    if (l->size >= 8) {
        bad_tags = 0;
        for_each_tag_spot(l, check_tag);
        if (bad_tags) {
            fprintf(stderr, "allocation %p (%zu bytes) was overwritten: %d tags changed\n",
                    (void *)l->p, l->size, bad_tags);
            abort();
        }
    }
    CHECK_OK(cuma_free(heap, l->p, s));
    l->p = NULL;
}

static size_t pick_size(unsigned long long *r) {
    unsigned k = rnd(r) % 100;
    if (k < 50) return 1 + rnd(r) % 1024;                /* scalars, small tensors */
    if (k < 85) return 1024 + rnd(r) % (256 * 1024);     /* activations */
    if (k < 98) return 256 * 1024 + rnd(r) % (4u << 20); /* big activations */
    return (4u << 20) + rnd(r) % (12u << 20);            /* weights, buffers */
}

static void *worker(void *arg) {
    int id = (int)(intptr_t)arg;
    static _Atomic int phase_seen;
    (void)phase_seen;
    unsigned long long r = base_seed ^ (0x9E3779B97F4A7C15ull * (unsigned long long)(id + 1));
    live *mine = slots[id];
    if (spread) CHECK_OK(cuma_arena_use(heap, (unsigned)id));
    for (long i = 0; i < ops_per_thread_phase; i++) {
        unsigned long long x = rnd(&r);
        live *l = &mine[x % SLOTS];
        cuma_stream s = stream_of(x >> 20);
        if (l->p) {
            if ((x >> 40) % 8 == 0) { /* hand it to another thread to free */
                pthread_mutex_lock(&exchange_lock);
                live *e = &exchange[(x >> 44) % EXCHANGE];
                live old = *e;
                *e = *l;
                pthread_mutex_unlock(&exchange_lock);
                l->p = NULL;
                if (old.p) verify_and_free(&old, NULL);
            } else {
                verify_and_free(l, (x >> 50) % 4 ? NULL : s);
            }
            continue;
        }
        size_t size = pick_size(&r);
        void *p;
        cuma_status st = cuma_alloc(heap, size, s, &p);
        if (st == CUMA_ERR_OOM || st == CUMA_ERR_LIMIT)
            continue; /* the device is small on purpose */
        CHECK_OK(st);
        CHECK(((uintptr_t)p & 511) == 0);
        *l = (live){p, size, rnd(&r) | 1};
        write_tags(l);
        if ((x >> 56) % 64 == 0) CHECK_OK(cuma_record_stream(heap, p, stream_of(x >> 30)));
    }
    return NULL;
}

static int cmp_live(const void *a, const void *b) {
    uintptr_t x = (uintptr_t)((const live *)a)->p, y = (uintptr_t)((const live *)b)->p;
    return x < y ? -1 : x > y;
}

/* No two live allocations overlap, and the heap's own walk agrees. */
static void check_phase(int phase) {
    static live all[THREADS * SLOTS + EXCHANGE];
    size_t n = 0;
    uint64_t req = 0;
    for (int t = 0; t < THREADS; t++)
        for (int i = 0; i < SLOTS; i++)
            if (slots[t][i].p) all[n++] = slots[t][i];
    for (int i = 0; i < EXCHANGE; i++)
        if (exchange[i].p) all[n++] = exchange[i];
    qsort(all, n, sizeof *all, cmp_live);
    for (size_t i = 0; i < n; i++) {
        req += all[i].size;
        size_t bs;
        CHECK_OK(cuma_block_size(heap, all[i].p, &bs));
        CHECK(bs >= all[i].size);
        if (i + 1 < n) CHECK((uintptr_t)all[i].p + bs <= (uintptr_t)all[i + 1].p);
    }
    cuma_stats s;
    CHECK_OK(cuma_get_stats(heap, &s));
    CHECK_OK(cuma_validate(heap));
    fprintf(stderr,
            "phase %d: %zu live, %llu requested, %llu reserved, %llu creates, %llu releases, %llu "
            "maps, %llu arenas\n",
            phase, n, (unsigned long long)req, (unsigned long long)s.reserved_bytes,
            (unsigned long long)s.page_creates, (unsigned long long)s.page_releases,
            (unsigned long long)s.maps, (unsigned long long)s.arenas);
    if (spread) CHECK(s.arenas == THREADS);
}

static void *trimmer(void *arg) {
    (void)arg;
    for (int i = 0; i < 200; i++) {
        CHECK_OK(cuma_poll(heap));
        if (i % 10 == 0) CHECK_OK(cuma_trim(heap, (size_t)(i % 3) << 22));
        struct timespec ts = {0, 500000};
        nanosleep(&ts, NULL);
    }
    return NULL;
}

static void run(const char *conf) {
    cuma_config cfg = {.conf = conf, .flags = CUMA_CONFIG_NO_ENV};
    CHECK_OK(cuma_heap_create(&cfg, &heap));
    cuma_stats s;
    CHECK_OK(cuma_get_stats(heap, &s));
    page_size = s.page_size;
    fprintf(stderr, "conf: %s\n", conf);
    for (int phase = 0; phase < PHASES; phase++) {
        pthread_t th[THREADS], tr;
        for (int t = 0; t < THREADS; t++)
            CHECK(!pthread_create(&th[t], NULL, worker, (void *)(intptr_t)t));
        CHECK(!pthread_create(&tr, NULL, trimmer, NULL));
        for (int t = 0; t < THREADS; t++) pthread_join(th[t], NULL);
        pthread_join(tr, NULL);
        check_phase(phase);
        base_seed = base_seed * 6364136223846793005ull + 1442695040888963407ull;
    }
    for (int t = 0; t < THREADS; t++)
        for (int i = 0; i < SLOTS; i++)
            if (slots[t][i].p) verify_and_free(&slots[t][i], NULL);
    for (int i = 0; i < EXCHANGE; i++)
        if (exchange[i].p) verify_and_free(&exchange[i], NULL);
    CHECK_OK(cuma_trim(heap, 0));
    CHECK_OK(cuma_get_stats(heap, &s));
    CHECK(s.active_allocs == 0 && s.requested_bytes == 0 && s.reserved_bytes == 0);
    CHECK_OK(cuma_validate(heap));
    cuma_heap_destroy(heap);
}

int main(int argc, char **argv) {
    base_seed = test_seed();
    const char *e = getenv("CUMA_STRESS_OPS");
    long total = e ? atol(e) : 1200000;
    ops_per_thread_phase = total / (THREADS * PHASES);
    const char *extra = argc > 1 ? argv[1] : "";
    spread = argc > 2 && !strcmp(argv[2], "spread");
    char conf[256];
    snprintf(conf, sizeof conf,
             "backend:sim,capacity:1G,page_size:2M,host_backing:on,release_delay_ms:2,max_cached:"
             "64M%s%s",
             *extra ? "," : "", extra);
    run(conf);
    printf("test_stress: %ld operations passed\n", ops_per_thread_phase * THREADS * PHASES);
    return 0;
}
