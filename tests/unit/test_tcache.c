// SPDX-License-Identifier: Apache-2.0
/* The per-thread caches (fast path): reuse, accounting, double frees, frees from other threads,
 * flushes by trim, age and out-of-memory, thread exit. */
#include "check.h"
#include "heap/heap.h"
#include "coord/pressure.h"
#include "heap/tcache.h"
#include "cuma/ledger.h"
#include "cuma/sim.h"

#include <pthread.h>
#include <sys/mman.h>
#include <unistd.h>
#include <stdint.h>
#include <string.h>

#define MB (1024ull * 1024)

static cuma_heap *make(const char *conf) {
    char full[512];
    snprintf(full, sizeof full, "backend:sim,%s", conf);
    return heap_make(full);
}

static void test_reuse_and_accounting(void) {
    cuma_heap *h = make("capacity:64M,sim_clock:manual,tcache_age_ms:100");
    void *p, *q;
    CHECK_OK(cuma_alloc(h, 1000, NULL, &p));
    CHECK_OK(cuma_free(h, p, NULL));
    cuma_stats s = heap_stats(h);
    CHECK(s.requested_bytes == 0 && s.active_allocs == 0 && s.num_frees == 1);
    CHECK(s.mapped_bytes == 0 && s.cached_bytes == 2 * MB); /* its page: kept, cached */
    CHECK_OK(cuma_validate(h));
    CHECK_OK(cuma_alloc(h, 900, NULL, &q)); /* same rounded size: the same block, no lock */
    CHECK(q == p);
    s = heap_stats(h);
    CHECK(s.requested_bytes == 900 && s.active_allocs == 1 && s.num_allocs == 2);
    CHECK(s.peak_requested_bytes == 1000);
    CHECK_OK(cuma_validate(h));
    /* Double free: the second one is refused, the heap stays valid. */
    CHECK_OK(cuma_free(h, q, NULL));
    CHECK_ST(cuma_free(h, q, NULL), CUMA_ERR_BAD_POINTER);
    size_t bs;
    CHECK_ST(cuma_block_size(h, q, &bs), CUMA_ERR_BAD_POINTER);
    CHECK_ST(cuma_record_stream(h, q, NULL), CUMA_ERR_BAD_POINTER);
    CHECK_OK(cuma_validate(h));
    /* Another stream does not take a block freed on this one from the cache. */
    cuma_stream s2 = (cuma_stream)(uintptr_t)0x77;
    CHECK_OK(cuma_alloc(h, 1000, s2, &q));
    CHECK(q != p);
    CHECK_OK(cuma_free(h, q, s2));
    /* trim empties the caches and gives everything back. */
    CHECK_OK(cuma_trim(h, 0));
    s = heap_stats(h);
    CHECK(s.reserved_bytes == 0 && s.mapped_bytes == 0 && s.requested_bytes == 0);
    CHECK_OK(cuma_validate(h));
    cuma_heap_destroy(h);
}

static void test_age(void) {
    cuma_heap *h =
        make("capacity:64M,sim_clock:manual,tcache_age_ms:50,release_delay_ms:100,tcache_max:8M");
    void *p;
    CHECK_OK(cuma_alloc(h, 4 * MB, NULL, &p));
    CHECK_OK(cuma_free(h, p, NULL));
    CHECK(heap_stats(h).mapped_bytes == 0 && heap_stats(h).cached_bytes == 4 * MB);
    uint64_t due;
    CHECK_OK(cuma_next_release(h, &due));
    CHECK(due == 50 * 1000000ull);
    CHECK_OK(cuma_sim_set_time(h, due));
    CHECK_OK(cuma_poll(h));
    cuma_stats s = heap_stats(h);
    CHECK(s.mapped_bytes == 0 && s.cached_bytes == 4 * MB); /* back in the heap, pages idle */
    /* Idle since the free at 0, not since the flush at 50 ms: the release delay counts from
     * the free, as for memory freed straight to the heap. */
    CHECK_OK(cuma_next_release(h, &due));
    CHECK(due == 100 * 1000000ull);
    CHECK_OK(cuma_sim_set_time(h, due));
    CHECK_OK(cuma_poll(h));
    CHECK(heap_stats(h).reserved_bytes == 0);
    CHECK_OK(cuma_validate(h));
    cuma_heap_destroy(h);
}

/* A thread cache holds idle memory no longer than the release delay, whatever tcache_age_ms
 * says, and the pages go back at the delay after the free. */
static void test_age_capped_by_delay(void) {
    cuma_heap *h =
        make("capacity:64M,sim_clock:manual,tcache_age_ms:500,release_delay_ms:100,tcache_max:8M");
    void *p;
    CHECK_OK(cuma_alloc(h, 4 * MB, NULL, &p));
    CHECK_OK(cuma_free(h, p, NULL));
    CHECK(heap_stats(h).cached_bytes == 4 * MB && heap_stats(h).reserved_bytes == 4 * MB);
    uint64_t due;
    CHECK_OK(cuma_next_release(h, &due));
    CHECK(due == 100 * 1000000ull);
    CHECK_OK(cuma_sim_set_time(h, 99 * 1000000ull));
    CHECK_OK(cuma_poll(h));
    CHECK(heap_stats(h).reserved_bytes == 4 * MB); /* not before the delay */
    CHECK_OK(cuma_sim_set_time(h, 100 * 1000000ull));
    CHECK_OK(cuma_poll(h));
    CHECK(heap_stats(h).reserved_bytes == 0); /* flushed and released in the same pass */
    CHECK_OK(cuma_validate(h));
    cuma_heap_destroy(h);
}

/* release_delay_ms:0 (or tcache_age_ms:0): a block may sit in a cache for no time, so the caches
 * are off and a free gives its pages back at once. With them on, the free went into the cache,
 * its pages stayed reserved, and the release thread polled for it every millisecond. */
static void test_age_zero_is_off(void) {
    const char *confs[] = {"capacity:64M,sim_clock:manual,release_delay_ms:0",
                           "capacity:64M,sim_clock:manual,tcache_age_ms:0,release_delay_ms:0"};
    for (int i = 0; i < 2; i++) {
        cuma_heap *h = make(confs[i]);
        void *p;
        CHECK_OK(cuma_alloc(h, 4096, NULL, &p));
        CHECK(heap_stats(h).reserved_bytes > 0);
        CHECK_OK(cuma_free(h, p, NULL));
        cuma_stats st = heap_stats(h);
        if (st.reserved_bytes != 0)
            fprintf(stderr, "%s: %llu bytes reserved after the free\n", confs[i],
                    (unsigned long long)st.reserved_bytes);
        CHECK(st.reserved_bytes == 0 && st.cached_bytes == 0);
        char json[8192];
        CHECK_OK(cuma_stats_json(h, json, sizeof json, NULL));
        CHECK(strstr(json, "\"tcache\":false") != NULL); /* what the stats say, too */
        CHECK_OK(cuma_validate(h));
        cuma_heap_destroy(h);
    }
    /* An age of 0 alone turns them off too; the page then waits in the heap's own cache. */
    cuma_heap *h = make("capacity:64M,sim_clock:manual,tcache_age_ms:0");
    void *p;
    CHECK_OK(cuma_alloc(h, 4096, NULL, &p));
    CHECK_OK(cuma_free(h, p, NULL));
    char json[8192];
    CHECK_OK(cuma_stats_json(h, json, sizeof json, NULL));
    CHECK(strstr(json, "\"tcache\":false") != NULL);
    CHECK(heap_stats(h).cached_bytes > 0);
    CHECK_OK(cuma_validate(h));
    cuma_heap_destroy(h);
}

/* A block this thread allocated and cached may be freed (after reuse) by another thread. */
typedef struct xfree {
    cuma_heap *h;
    void *p;
    cuma_status st;
} xfree;

static void *free_there(void *arg) {
    xfree *x = arg;
    x->st = cuma_free(x->h, x->p, NULL);
    return NULL;
}

static void *alloc_there(void *arg) {
    xfree *x = arg;
    x->st = cuma_alloc(x->h, 64 * 1024, NULL, &x->p);
    if (x->st == CUMA_OK) x->st = cuma_free(x->h, x->p, NULL); /* into that thread's cache */
    return NULL;
}

static void test_threads(void) {
    cuma_heap *h = make("capacity:64M,sim_clock:manual");
    void *p;
    CHECK_OK(cuma_alloc(h, 64 * 1024, NULL, &p));
    CHECK_OK(cuma_free(h, p, NULL));
    CHECK_OK(cuma_alloc(h, 64 * 1024, NULL, &p)); /* from this thread's cache */
    xfree x = {h, p, CUMA_OK};
    pthread_t t;
    CHECK(!pthread_create(&t, NULL, free_there, &x));
    pthread_join(t, NULL);
    CHECK_OK(x.st);
    CHECK_ST(cuma_free(h, p, NULL), CUMA_ERR_BAD_POINTER); /* stale entry here: refused */
    CHECK(heap_stats(h).active_allocs == 0);
    CHECK_OK(cuma_validate(h));
    /* A thread that ends gives its cache back. */
    xfree y = {h, NULL, CUMA_OK};
    CHECK(!pthread_create(&t, NULL, alloc_there, &y));
    pthread_join(t, NULL);
    CHECK_OK(y.st);
    CHECK_OK(cuma_validate(h));
    CHECK(heap_stats(h).mapped_bytes == 0);
    CHECK_OK(cuma_trim(h, 0));
    CHECK(heap_stats(h).reserved_bytes == 0);
    cuma_heap_destroy(h);
}

static int oom_free(void *user, cuma_heap *h, size_t size, cuma_stream s) {
    (void)size, (void)s;
    void **victim = user;
    if (!*victim) return CUMA_OOM_PASS;
    CHECK_OK(cuma_free(h, *victim, NULL)); /* lands in this thread's cache */
    *victim = NULL;
    return CUMA_OOM_RETRY;
}

static void test_oom_flushes(void) {
    cuma_heap *h = make("capacity:16M,sim_clock:manual,tcache_max:8M");
    void *a, *b, *victim;
    CHECK_OK(cuma_alloc(h, 6 * MB, NULL, &a));
    CHECK_OK(cuma_free(h, a, NULL)); /* cached, pages held */
    CHECK_OK(cuma_alloc(h, 6 * MB, NULL, &victim));
    CHECK(victim == a);
    CHECK_OK(cuma_alloc(h, 4 * MB, NULL, &a));
    CHECK_OK(cuma_free(h, a, NULL)); /* cached: 4 MiB held by the cache */
    CHECK_OK(cuma_add_oom_callback(h, oom_free, &victim, NULL));
    CHECK_OK(cuma_alloc(h, 12 * MB, NULL, &b)); /* needs the cache flushed and the victim freed */
    CHECK(victim == NULL);
    CHECK_OK(cuma_validate(h));
    CHECK_OK(cuma_free(h, b, NULL));
    cuma_heap_destroy(h);
}

/* Frees the bins refuse (here: blocks over tcache_max) are batched and returned under one lock
 * acquisition: at the CUMA_TC_PENDING-th, at the thread's next slow call, or by a flush. */
static void test_pending_frees(void) {
    enum { B = CUMA_TC_PENDING, N = CUMA_TC_PENDING + 9 };
    cuma_heap *h = make("capacity:256M,sim_clock:manual,tcache_max:64K");
    void *p[N];
    for (int i = 0; i < N; i++) CHECK_OK(cuma_alloc(h, 1 * MB, NULL, &p[i]));
    for (int i = 0; i < B - 1; i++) CHECK_OK(cuma_free(h, p[i], NULL));
    cuma_stats s = heap_stats(h);
    CHECK(s.active_allocs == N - (B - 1) && s.requested_bytes == (N - (B - 1)) * MB);
    /* Freed for the program, not yet back in the heap: the pages only they cover are cached. */
    CHECK(s.reserved_bytes >= N * MB && s.cached_bytes >= (B - 2) * MB);
    CHECK(s.reserved_bytes == s.mapped_bytes + s.cached_bytes);
    CHECK_OK(cuma_validate(h));
    CHECK_ST(cuma_free(h, p[3], NULL), CUMA_ERR_BAD_POINTER); /* a second free is refused */
    CHECK_OK(cuma_validate(h));
    /* That call returned them: what stays mapped is under the live blocks (two per page). */
    uint64_t mapped = heap_stats(h).mapped_bytes;
    CHECK(mapped <= (N - (B - 1)) * MB + 2 * MB);
    uint64_t reserved = heap_stats(h).reserved_bytes;
    for (int i = B - 1; i < N - 1; i++) CHECK_OK(cuma_free(h, p[i], NULL));
    /* Fewer than B frees since: all waiting, their pages held and counted cached; in use only
     * the page under the last block. */
    s = heap_stats(h);
    CHECK(s.reserved_bytes == reserved && s.mapped_bytes == 2 * MB);
    CHECK(s.cached_bytes == reserved - 2 * MB);
    CHECK_OK(cuma_trim(h, 0)); /* a flush takes pending frees too */
    s = heap_stats(h);
    CHECK(s.mapped_bytes == 2 * MB && s.cached_bytes == 0); /* one page under the last block */
    CHECK_OK(cuma_free(h, p[N - 1], NULL));
    CHECK_OK(cuma_validate(h));
    cuma_heap_destroy(h);
}

/* The figures a user reads count a block freed into a thread cache as cached, not in use, from
 * the free on: cuma_get_stats, the stats JSON, the snapshot and what the ledger publishes
 * (`cuma ps`, `cuma stats`). A 2 MiB block goes to the pending frees (over tcache_max), a small
 * one to a bin; a page shared with a live block stays in use. */
static void test_cached_figures(void) {
    char ledger[64], conf[160];
    snprintf(ledger, sizeof ledger, "cuma-test-tcache-%d", (int)getpid());
    snprintf(conf, sizeof conf, "capacity:64M,sim_clock:manual,release_thread:off,ledger:%s",
             ledger);
    cuma_heap *h = make(conf);
    void *big, *a, *b;
    CHECK_OK(cuma_alloc(h, 2 * MB, NULL, &big)); /* page 0, whole */
    CHECK_OK(cuma_alloc(h, 1000, NULL, &a));     /* a and b share page 1 */
    CHECK_OK(cuma_alloc(h, 1000, NULL, &b));
    CHECK_OK(cuma_free(h, big, NULL));
    CHECK_OK(cuma_free(h, a, NULL));
    cuma_stats s = heap_stats(h);
    CHECK(s.requested_bytes == 1000 && s.reserved_bytes == 4 * MB);
    CHECK(s.cached_bytes == 2 * MB && s.mapped_bytes == 2 * MB); /* page 1: b is live */
    /* Page 1 is b's and a's gap: stranded; page 0 is cached, not fragmentation. */
    CHECK(s.stranded_bytes == 2 * MB - 1000);
    CHECK(s.fragmentation == (double)(2 * MB - 1000) / (double)(2 * MB));
    char json[16384];
    CHECK_OK(cuma_stats_json(h, json, sizeof json, NULL));
    CHECK(strstr(json, "\"cached_bytes\":2097152") && strstr(json, "\"mapped_bytes\":2097152"));
    CHECK(strstr(json, "\"stranded_bytes\":2096152"));
    CHECK_OK(cuma_snapshot_json(h, json, sizeof json, NULL));
    CHECK(strstr(json, "\"cached_bytes\":2097152") && strstr(json, "\"mapped_bytes\":2097152"));
    /* What the release thread publishes to the ledger (called here: the thread is off). */
    cuma_mutex_lock(&h->first.lock, CUMA_RANK_ARENA);
    cuma_heap_ledger_poll(h);
    cuma_mutex_unlock(&h->first.lock);
    cuma_ledger_entry e[4];
    size_t n = 0;
    CHECK_OK(cuma_ledger_snapshot(ledger, e, 4, &n));
    CHECK(n == 1 && e[0].cached == 2 * MB && e[0].mapped_bytes == 2 * MB && e[0].requested == 1000);
    /* Both blocks of page 1 in the cache: the page is the cache's too. */
    CHECK_OK(cuma_free(h, b, NULL));
    s = heap_stats(h);
    CHECK(s.requested_bytes == 0 && s.cached_bytes == 4 * MB && s.mapped_bytes == 0);
    CHECK(s.fragmentation == 0 && s.stranded_bytes == 0); /* idle, the cache full */
    /* The allocator figures (mapped) go out every CUMA_LEDGER_STATS_NS of the heap's clock. */
    CHECK_OK(cuma_sim_set_time(h, CUMA_LEDGER_STATS_NS));
    cuma_mutex_lock(&h->first.lock, CUMA_RANK_ARENA);
    cuma_heap_ledger_poll(h);
    cuma_mutex_unlock(&h->first.lock);
    CHECK_OK(cuma_ledger_snapshot(ledger, e, 4, &n));
    CHECK(n == 1 && e[0].cached == 4 * MB && e[0].mapped_bytes == 0 && e[0].requested == 0);
    CHECK_OK(cuma_validate(h));
    /* Given back to the heap, the pages are cached as before, counted once. */
    CHECK_OK(cuma_trim(h, 4 * MB));
    s = heap_stats(h);
    CHECK(s.cached_bytes == 4 * MB && s.mapped_bytes == 0 && s.reserved_bytes == 4 * MB);
    /* A slow call moves the cache's share into the arena's counters: counted once. */
    CHECK_OK(cuma_alloc(h, 3 * MB, NULL, &big));
    cuma_mutex_lock(&h->first.lock, CUMA_RANK_ARENA);
    cuma_heap_ledger_poll(h);
    cuma_mutex_unlock(&h->first.lock);
    CHECK_OK(cuma_ledger_snapshot(ledger, e, 4, &n));
    CHECK(n == 1 && e[0].requested == 3 * MB);
    CHECK_OK(cuma_free(h, big, NULL));
    cuma_heap_destroy(h);
    char path[128];
    CHECK_OK(cuma_ledger_path(ledger, path, sizeof path));
    shm_unlink(path + strlen("/dev/shm"));
}

int main(void) {
    test_cached_figures();
    test_pending_frees();
    test_reuse_and_accounting();
    test_age();
    test_age_capped_by_delay();
    test_age_zero_is_off();
    test_threads();
    test_oom_flushes();
    printf("test_tcache: all passed\n");
    return 0;
}
