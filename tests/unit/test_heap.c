// SPDX-License-Identifier: Apache-2.0
/* The heap through its public API on the simulated device: placement, pages, cache, release
 * policy, OOM ladder, bad input. */
#include "check.h"
#include "cuma/sim.h"

#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdint.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#define MB (1024ull * 1024)

/* On the simulated device (also where a GPU is), thread caches off: these tests check the
 * heap's own accounting step by step (test_tcache.c covers the caches). */
static cuma_heap *make(const char *conf) {
    char full[512];
    snprintf(full, sizeof full, "backend:sim,tcache:off,%s", conf);
    return heap_make(full);
}

static void test_basic(const char *policy) {
    char conf[128];
    snprintf(conf, sizeof conf,
             "capacity:64M,page_size:2M,sim_clock:manual,host_backing:on,policy:%s", policy);
    cuma_heap *h = make(conf);
    void *a, *b, *c;
    CHECK_OK(cuma_alloc(h, 1000, NULL, &a));
    CHECK_OK(cuma_alloc(h, 3 * MB, NULL, &b));
    CHECK_OK(cuma_alloc(h, 1, NULL, &c));
    CHECK(((uintptr_t)a & 511) == 0 && ((uintptr_t)b & 511) == 0 && ((uintptr_t)c & 511) == 0);
    memset(a, 0xA5, 1000);
    memset(b, 0x5A, 3 * MB);
    ((char *)c)[0] = 7;
    cuma_stats s = heap_stats(h);
    CHECK(s.requested_bytes == 1000 + 3 * MB + 1);
    CHECK(s.active_allocs == 3);
    CHECK(s.reserved_bytes >= s.requested_bytes);
    CHECK(s.reserved_bytes <= 8 * MB);
    size_t bs;
    CHECK_OK(cuma_block_size(h, b, &bs));
    CHECK(bs >= 3 * MB);
    CHECK_OK(cuma_validate(h));
    CHECK(((unsigned char *)a)[999] == 0xA5 && ((unsigned char *)b)[3 * MB - 1] == 0x5A);
    CHECK_OK(cuma_free(h, b, NULL));
    CHECK_OK(cuma_free(h, a, NULL));
    CHECK_OK(cuma_free(h, c, NULL));
    s = heap_stats(h);
    CHECK(s.requested_bytes == 0 && s.mapped_bytes == 0 && s.active_allocs == 0);
    CHECK(s.cached_bytes == s.reserved_bytes && s.reserved_bytes > 0);
    CHECK_OK(cuma_validate(h));
    CHECK_OK(cuma_trim(h, 0));
    s = heap_stats(h);
    CHECK(s.reserved_bytes == 0 && s.page_releases == s.page_creates);
    CHECK_OK(cuma_validate(h));
    cuma_heap_destroy(h);
}

static void test_bad_input(void) {
    cuma_heap *h = make("capacity:64M,sim_clock:manual");
    void *p, *q;
    CHECK_ST(cuma_alloc(h, 0, NULL, &p), CUMA_ERR_INVALID);
    /* Past any device: out of memory, as the driver says of it (not a bad argument). */
    CHECK_ST(cuma_alloc(h, SIZE_MAX, NULL, &p), CUMA_ERR_OOM);
    CHECK(strstr(cuma_last_error(), "past any device"));
    CHECK_ST(cuma_alloc(h, SIZE_MAX - 100, NULL, &p), CUMA_ERR_OOM);
    CHECK_ST(cuma_alloc(h, (size_t)1 << 50, NULL, &p), CUMA_ERR_OOM);
    CHECK_ST(cuma_alloc(h, 16, NULL, NULL), CUMA_ERR_INVALID);
    CHECK_ST(cuma_alloc(NULL, 16, NULL, &p), CUMA_ERR_INVALID);
    CHECK_OK(cuma_alloc(h, 4096, NULL, &p));
    CHECK_ST(cuma_free(h, (char *)p + 512, NULL), CUMA_ERR_BAD_POINTER);
    CHECK(strstr(cuma_last_error(), "inside the heap"));
    CHECK_ST(cuma_free(h, (void *)(uintptr_t)0x1234, NULL), CUMA_ERR_BAD_POINTER);
    CHECK(strstr(cuma_last_error(), "not allocated by this heap"));
    CHECK_OK(cuma_validate(h));
    CHECK_OK(cuma_free(h, p, NULL));
    CHECK_ST(cuma_free(h, p, NULL), CUMA_ERR_BAD_POINTER); /* double free */
    CHECK_OK(cuma_free(h, NULL, NULL));
    CHECK_OK(cuma_validate(h));
    /* More than the device: a clear OOM, the heap still valid. */
    CHECK_ST(cuma_alloc(h, 65 * MB, NULL, &q), CUMA_ERR_OOM);
    CHECK(strstr(cuma_last_error(), "out of memory"));
    CHECK_OK(cuma_validate(h));
    cuma_stats s = heap_stats(h);
    CHECK(s.failed_allocs == 1 && s.active_allocs == 0 && s.mapped_bytes == 0);
    /* More than the virtual range could ever hold: out of memory too (as PyTorch says of a
     * request larger than the GPU), so that callers recovering from OOM recover from it. */
    CHECK_ST(cuma_alloc(h, (size_t)1 << 40, NULL, &q), CUMA_ERR_OOM);
    CHECK(strstr(cuma_last_error(), "can ever hold"));
    CHECK(heap_stats(h).failed_allocs == 2);
    CHECK_ST(cuma_record_stream(h, (void *)(uintptr_t)0x1234, NULL), CUMA_ERR_BAD_POINTER);
    cuma_heap_destroy(h);
    cuma_config bad = {.conf = "capacity:64M,bogus:1", .flags = CUMA_CONFIG_NO_ENV};
    CHECK_ST(cuma_heap_create(&bad, &h), CUMA_ERR_CONFIG);
    CHECK(strstr(cuma_last_error(), "bogus"));
    /* A fraction of the device smaller than a page: refused, naming it, as a limit under a page
     * is (it truncated to 0, no limit at all, through the call; to a limit nothing fits in the
     * setting). */
    cuma_config tiny = {.conf = "backend:sim,capacity:64M,memory_fraction:1e-12",
                        .flags = CUMA_CONFIG_NO_ENV};
    CHECK_ST(cuma_heap_create(&tiny, &h), CUMA_ERR_CONFIG);
    CHECK(strstr(cuma_last_error(), "memory_fraction 1e-12") && strstr(cuma_last_error(), "page"));
    h = make("capacity:64M,sim_clock:manual,limit:32M");
    CHECK_ST(cuma_set_memory_fraction(h, 1e-12), CUMA_ERR_INVALID);
    CHECK(strstr(cuma_last_error(), "less than one page"));
    CHECK(heap_stats(h).limit_bytes == 32 * MB); /* unchanged */
    CHECK_OK(cuma_set_memory_fraction(h, 0.25));
    CHECK(heap_stats(h).limit_bytes == 16 * MB);
    cuma_heap_destroy(h);
}

static void test_release_delay(void) {
    cuma_heap *h = make("capacity:64M,sim_clock:manual,release_delay_ms:100");
    void *p;
    CHECK_OK(cuma_alloc(h, 8 * MB, NULL, &p));
    CHECK_OK(cuma_free(h, p, NULL));
    CHECK(heap_stats(h).cached_bytes == 8 * MB);
    CHECK_OK(cuma_sim_set_time(h, 99 * 1000000ull));
    CHECK_OK(cuma_poll(h));
    CHECK(heap_stats(h).cached_bytes == 8 * MB); /* not yet idle long enough */
    CHECK_OK(cuma_sim_set_time(h, 100 * 1000000ull));
    CHECK_OK(cuma_poll(h));
    CHECK(heap_stats(h).reserved_bytes == 0);
    /* Reuse from the cache costs no new page. */
    CHECK_OK(cuma_alloc(h, 4 * MB, NULL, &p));
    CHECK_OK(cuma_free(h, p, NULL));
    uint64_t creates = heap_stats(h).page_creates;
    CHECK_OK(cuma_alloc(h, 4 * MB, NULL, &p));
    CHECK(heap_stats(h).page_creates == creates);
    CHECK_OK(cuma_free(h, p, NULL));
    CHECK_OK(cuma_validate(h));
    cuma_heap_destroy(h);
}

static void test_limit_and_max_cached(void) {
    cuma_heap *h = make("capacity:64M,sim_clock:manual,limit:8M,max_cached:2M");
    void *p, *q;
    CHECK_OK(cuma_alloc(h, 6 * MB, NULL, &p));
    CHECK_ST(cuma_alloc(h, 4 * MB, NULL, &q), CUMA_ERR_LIMIT);
    CHECK(strstr(cuma_last_error(), "limit"));
    /* Counted as an out-of-memory though no callback is registered (what autoscalers watch). */
    CHECK(heap_stats(h).ooms == 1 && heap_stats(h).failed_allocs == 1);
    CHECK_OK(cuma_free(h, p, NULL));
    CHECK(heap_stats(h).cached_bytes == 2 * MB); /* the cap released the rest at once */
    CHECK_OK(cuma_alloc(h, 8 * MB, NULL, &q));
    CHECK_OK(cuma_free(h, q, NULL));
    /* Seven 1 MiB blocks, each alone in its own page: 7 MiB stranded, and a 2 MiB request
     * finds no room. The message says how much was free but unusable. */
    void *small[8];
    for (int i = 0; i < 8; i++) CHECK_OK(cuma_alloc(h, 1 * MB, NULL, &small[i]));
    for (int i = 1; i < 8; i += 2) CHECK_OK(cuma_free(h, small[i], NULL));
    cuma_stats s = heap_stats(h);
    CHECK(s.mapped_bytes == 8 * MB && s.requested_bytes == 4 * MB);
    CHECK(s.stranded_bytes == 4 * MB && s.fragmentation == 0.5);
    CHECK_ST(cuma_alloc(h, 2 * MB + 1, NULL, &q), CUMA_ERR_LIMIT);
    CHECK(strstr(cuma_last_error(), "; 4194304 bytes free but stranded"));
    for (int i = 0; i < 8; i += 2) CHECK_OK(cuma_free(h, small[i], NULL));
    CHECK_OK(cuma_set_limit(h, 4 * MB));
    CHECK(heap_stats(h).reserved_bytes <= 4 * MB);
    CHECK_OK(cuma_validate(h));
    cuma_heap_destroy(h);
}

typedef struct oomctx {
    void *victim;
    int calls;
} oomctx;

static int oom_free_victim(void *user, cuma_heap *h, size_t size, cuma_stream s) {
    (void)size, (void)s;
    oomctx *o = user;
    o->calls++;
    if (!o->victim) return CUMA_OOM_PASS;
    CHECK_OK(cuma_free(h, o->victim, NULL));
    o->victim = NULL;
    return CUMA_OOM_RETRY;
}

static int oom_pass(void *user, cuma_heap *h, size_t size, cuma_stream s) {
    (void)h, (void)size, (void)s;
    (*(int *)user)++;
    return CUMA_OOM_PASS;
}

/* Two threads out of memory at once: thread 1 runs out while thread 0's callback is still
 * freeing. It must wait for that callback (not skip the callbacks and fail), then get the memory
 * freed. Within the callback, an allocation on the same heap fails without calling it again. */
typedef struct crowd {
    cuma_heap *h;
    void *victim;
    _Atomic int calls, started, done;
    cuma_status second; /* thread 1's allocation, once done */
    void *second_p;
} crowd;

static void *second_thread(void *arg) {
    crowd *c = arg;
    atomic_store(&c->started, 1);
    c->second = cuma_alloc(c->h, 8 * MB, NULL, &c->second_p);
    atomic_store(&c->done, 1);
    return NULL;
}

static int oom_slow_free(void *user, cuma_heap *h, size_t size, cuma_stream s) {
    (void)size, (void)s;
    crowd *c = user;
    if (atomic_fetch_add(&c->calls, 1) > 0) return CUMA_OOM_PASS; /* nothing left to free */
    void *nested;
    CHECK_ST(cuma_alloc(h, 8 * MB, NULL, &nested), CUMA_ERR_OOM); /* no recursion */
    CHECK(atomic_load(&c->calls) == 1);
    pthread_t t;
    CHECK(pthread_create(&t, NULL, second_thread, c) == 0);
    CHECK(pthread_detach(t) == 0);
    while (!atomic_load(&c->started)) sched_yield();
    struct timespec ts = {0, 30 * 1000000};
    nanosleep(&ts, NULL); /* thread 1 runs out meanwhile */
    CHECK_OK(cuma_free(h, c->victim, NULL));
    return CUMA_OOM_RETRY;
}

static void test_oom_crowd(void) {
    crowd c = {.h = make("capacity:16M,sim_clock:manual")};
    CHECK_OK(cuma_add_oom_callback(c.h, oom_slow_free, &c, NULL));
    CHECK_OK(cuma_alloc(c.h, 16 * MB, NULL, &c.victim));
    void *p;
    CHECK_OK(cuma_alloc(c.h, 8 * MB, NULL, &p));
    while (!atomic_load(&c.done)) {
        struct timespec ts = {0, 1000000};
        nanosleep(&ts, NULL);
    }
    CHECK_OK(c.second);
    CHECK(c.second_p != NULL && atomic_load(&c.calls) == 1);
    CHECK_OK(cuma_free(c.h, p, NULL));
    CHECK_OK(cuma_free(c.h, c.second_p, NULL));
    CHECK_OK(cuma_validate(c.h));
    cuma_heap_destroy(c.h);
}

/* Two heaps, both full, whose callbacks allocate on the other heap, run out on two threads at
 * once: each thread, inside its own heap's callbacks, finds the other's running and must not wait
 * for them (each would wait for the other for good). Both allocations fail, as nothing was
 * freed. */
typedef struct pair_ctx {
    cuma_heap *other;
    pthread_barrier_t *both_inside;
    _Atomic int calls;
    cuma_status inner;
} pair_ctx;

static int oom_alloc_other(void *user, cuma_heap *h, size_t size, cuma_stream s) {
    (void)h, (void)size, (void)s;
    pair_ctx *c = user;
    /* The first run waits until both threads are inside their heap's callbacks. (A thread can
     * run the other heap's callback too, once the other thread has left it.) */
    if (atomic_fetch_add(&c->calls, 1) == 0) pthread_barrier_wait(c->both_inside);
    void *p = NULL;
    c->inner = cuma_alloc(c->other, 8 * MB, NULL, &p);
    if (p) CHECK_OK(cuma_free(c->other, p, NULL));
    return CUMA_OOM_PASS;
}

typedef struct pair_thread {
    cuma_heap *h;
    cuma_status st;
} pair_thread;

static void *alloc_8m(void *arg) {
    pair_thread *t = arg;
    void *p = NULL;
    t->st = cuma_alloc(t->h, 8 * MB, NULL, &p);
    return NULL;
}

static void test_oom_cross_heaps(void) {
    cuma_heap *a = make("capacity:16M,sim_clock:manual"),
              *b = make("capacity:16M,sim_clock:manual");
    pthread_barrier_t bar;
    CHECK(pthread_barrier_init(&bar, NULL, 2) == 0);
    pair_ctx ca = {b, &bar, 0, CUMA_OK}, cb = {a, &bar, 0, CUMA_OK};
    CHECK_OK(cuma_add_oom_callback(a, oom_alloc_other, &ca, NULL));
    CHECK_OK(cuma_add_oom_callback(b, oom_alloc_other, &cb, NULL));
    void *fa, *fb;
    CHECK_OK(cuma_alloc(a, 16 * MB, NULL, &fa));
    CHECK_OK(cuma_alloc(b, 16 * MB, NULL, &fb));
    alarm(30); /* a deadlock ends the test with SIGALRM rather than at ctest's timeout */
    pair_thread ta = {a, CUMA_OK}, tb = {b, CUMA_OK};
    pthread_t t1, t2;
    CHECK(pthread_create(&t1, NULL, alloc_8m, &ta) == 0);
    CHECK(pthread_create(&t2, NULL, alloc_8m, &tb) == 0);
    pthread_join(t1, NULL);
    pthread_join(t2, NULL);
    alarm(0);
    CHECK(ta.st == CUMA_ERR_OOM && tb.st == CUMA_ERR_OOM);
    CHECK(ca.inner == CUMA_ERR_OOM && cb.inner == CUMA_ERR_OOM);
    pthread_barrier_destroy(&bar);
    CHECK_OK(cuma_free(a, fa, NULL));
    CHECK_OK(cuma_free(b, fb, NULL));
    cuma_heap_destroy(a);
    cuma_heap_destroy(b);
}

/* A thread that runs out while it holds something the running callback needs (a C extension
 * holding Python's GIL) waits for the callbacks a bounded time, then fails, and the callback
 * goes on. */
typedef struct held_ctx {
    pthread_mutex_t outer; /* the "GIL" */
    _Atomic int holding, inside, calls;
    cuma_heap *h;
    cuma_status second;
} held_ctx;

static int oom_needs_outer(void *user, cuma_heap *h, size_t size, cuma_stream s) {
    (void)h, (void)size, (void)s;
    held_ctx *c = user;
    if (atomic_fetch_add(&c->calls, 1) > 0) return CUMA_OOM_PASS; /* the other thread's turn */
    atomic_store(&c->inside, 1);
    pthread_mutex_lock(&c->outer); /* held by the other thread while it allocates */
    pthread_mutex_unlock(&c->outer);
    return CUMA_OOM_PASS;
}

static void *alloc_holding_outer(void *arg) {
    held_ctx *c = arg;
    pthread_mutex_lock(&c->outer);
    atomic_store(&c->holding, 1);
    while (!atomic_load(&c->inside)) sched_yield();
    void *p = NULL;
    c->second = cuma_alloc(c->h, 8 * MB, NULL, &p);
    pthread_mutex_unlock(&c->outer);
    return NULL;
}

static void test_oom_wait_is_bounded(void) {
    held_ctx c = {.outer = PTHREAD_MUTEX_INITIALIZER, .h = make("capacity:16M,sim_clock:manual")};
    CHECK_OK(cuma_add_oom_callback(c.h, oom_needs_outer, &c, NULL));
    void *full;
    CHECK_OK(cuma_alloc(c.h, 16 * MB, NULL, &full));
    pthread_t t;
    CHECK(pthread_create(&t, NULL, alloc_holding_outer, &c) == 0);
    while (!atomic_load(&c.holding)) sched_yield();
    alarm(30);
    void *p = NULL;
    CHECK_ST(cuma_alloc(c.h, 8 * MB, NULL, &p), CUMA_ERR_OOM); /* its callback waits for outer */
    pthread_join(t, NULL);
    alarm(0);
    CHECK(c.second == CUMA_ERR_OOM && atomic_load(&c.calls) == 1);
    CHECK_OK(cuma_free(c.h, full, NULL));
    CHECK_OK(cuma_validate(c.h));
    cuma_heap_destroy(c.h);
}

/* A removal from outside the callbacks returns only once no run that copied the list before it
 * can still call the removed callback: the caller may free its `user` then. Thread A runs out of
 * memory and sits in the first callback; thread B removes the second and marks it removed when
 * the removal returns. The first callback waits (up to 1 s) for that mark: before the fix the
 * removal returned at once and the second callback then ran, removed. */
typedef struct {
    cuma_heap *h;
    int id2;
    atomic_int entered, removed, late_calls, calls2;
} remove_ctx;

static int oom_waits_for_removal(void *user, cuma_heap *h, size_t size, cuma_stream s) {
    (void)h, (void)size, (void)s;
    remove_ctx *c = user;
    atomic_store(&c->entered, 1);
    for (int i = 0; i < 1000 && !atomic_load(&c->removed); i++) usleep(1000);
    return CUMA_OOM_PASS;
}

static int oom_removed_one(void *user, cuma_heap *h, size_t size, cuma_stream s) {
    (void)h, (void)size, (void)s;
    remove_ctx *c = user;
    atomic_fetch_add(&c->calls2, 1);
    if (atomic_load(&c->removed)) atomic_fetch_add(&c->late_calls, 1);
    return CUMA_OOM_PASS;
}

static void *alloc_too_much(void *arg) {
    remove_ctx *c = arg;
    void *p = NULL;
    CHECK_ST(cuma_alloc(c->h, 8 * MB, NULL, &p), CUMA_ERR_OOM);
    return NULL;
}

static void *remove_second(void *arg) {
    remove_ctx *c = arg;
    CHECK_OK(cuma_remove_oom_callback(c->h, c->id2));
    atomic_store(&c->removed, 1);
    return NULL;
}

static void test_oom_remove_waits_for_a_run(void) {
    remove_ctx c = {.h = make("capacity:16M,sim_clock:manual")};
    CHECK_OK(cuma_add_oom_callback(c.h, oom_waits_for_removal, &c, NULL));
    CHECK_OK(cuma_add_oom_callback(c.h, oom_removed_one, &c, &c.id2));
    void *full;
    CHECK_OK(cuma_alloc(c.h, 16 * MB, NULL, &full));
    alarm(30);
    pthread_t a, b;
    CHECK(pthread_create(&a, NULL, alloc_too_much, &c) == 0);
    while (!atomic_load(&c.entered)) sched_yield();
    CHECK(pthread_create(&b, NULL, remove_second, &c) == 0);
    pthread_join(a, NULL);
    pthread_join(b, NULL);
    alarm(0);
    CHECK(atomic_load(&c.late_calls) == 0); /* never called once its removal had returned */
    CHECK(atomic_load(&c.calls2) == 1);     /* the run in progress still called it */
    /* Removed: a later run does not call it. */
    atomic_store(&c.removed, 0);
    void *p = NULL;
    CHECK_ST(cuma_alloc(c.h, 8 * MB, NULL, &p), CUMA_ERR_OOM);
    CHECK(atomic_load(&c.calls2) == 1);
    CHECK_OK(cuma_free(c.h, full, NULL));
    CHECK_OK(cuma_validate(c.h));
    cuma_heap_destroy(c.h);
}

static int oom_removes_itself(void *user, cuma_heap *h, size_t size, cuma_stream s) {
    (void)size, (void)s;
    int *id = user;
    CHECK_OK(cuma_remove_oom_callback(h, *id)); /* returns: no wait for its own run */
    return CUMA_OOM_PASS;
}

static void test_oom_callback_removes_itself(void) {
    cuma_heap *h = make("capacity:16M,sim_clock:manual");
    int id;
    CHECK_OK(cuma_add_oom_callback(h, oom_removes_itself, &id, &id));
    void *full, *p = NULL;
    CHECK_OK(cuma_alloc(h, 16 * MB, NULL, &full));
    alarm(30);
    CHECK_ST(cuma_alloc(h, 8 * MB, NULL, &p), CUMA_ERR_OOM);
    CHECK_ST(cuma_remove_oom_callback(h, id), CUMA_ERR_INVALID); /* gone */
    alarm(0);
    CHECK_OK(cuma_free(h, full, NULL));
    cuma_heap_destroy(h);
}

static void test_oom_ladder(void) {
    cuma_heap *h = make("capacity:16M,sim_clock:manual");
    int passes = 0;
    oomctx o = {0};
    int id1, id2;
    CHECK_OK(cuma_add_oom_callback(h, oom_pass, &passes, &id1));
    CHECK_OK(cuma_add_oom_callback(h, oom_free_victim, &o, &id2));
    CHECK_OK(cuma_alloc(h, 12 * MB, NULL, &o.victim));
    void *p;
    CHECK_OK(cuma_alloc(h, 8 * MB, NULL, &p)); /* callbacks free the victim, then it fits */
    CHECK(passes == 1 && o.calls == 1 && o.victim == NULL);
    cuma_stats s = heap_stats(h);
    CHECK(s.ooms == 1 && s.oom_callbacks == 2 && s.alloc_retries == 1);
    CHECK_ST(cuma_alloc(h, 12 * MB, NULL, &o.victim), CUMA_ERR_OOM); /* nobody can help */
    CHECK(passes == 2 && o.calls == 2);
    CHECK_OK(cuma_remove_oom_callback(h, id1));
    CHECK_ST(cuma_remove_oom_callback(h, id1), CUMA_ERR_INVALID);
    CHECK_OK(cuma_validate(h));
    CHECK_OK(cuma_free(h, p, NULL));
    cuma_heap_destroy(h);

    /* Another program holds a quarter of the device: the heap's growth is refused part-way,
     * once the device's free pages are gone. The pages the failed attempts made go back with the
     * failure, not a release delay later. */
    h = make("capacity:16M,sim_clock:manual,tcache:off");
    CHECK_OK(cuma_sim_take_memory(h, 4 * MB));
    CHECK_OK(cuma_alloc(h, 4 * MB, NULL, &p));
    void *q;
    CHECK_ST(cuma_alloc(h, 10 * MB, NULL, &q), CUMA_ERR_OOM);
    s = heap_stats(h);
    CHECK(s.cached_bytes == 0 && s.reserved_bytes == 4 * MB);
    CHECK(s.peak_reserved_bytes == 12 * MB); /* what the refused growth held for a moment */
    CHECK_OK(cuma_validate(h));
    CHECK_OK(cuma_free(h, p, NULL));
    cuma_heap_destroy(h);

    /* Managed fallback when the device is full. */
    h = make("capacity:16M,sim_clock:manual,managed_fallback:on");
    void *big;
    CHECK_OK(cuma_alloc(h, 32 * MB, NULL, &big));
    s = heap_stats(h);
    CHECK(s.managed_fallbacks == 1 && s.managed_bytes == 32 * MB && s.reserved_bytes == 0);
    CHECK_OK(cuma_free(h, big, NULL));
    CHECK(heap_stats(h).managed_bytes == 0);
    /* Past the virtual range too: managed memory can hold what the device never could. */
    CHECK_OK(cuma_alloc(h, (size_t)1 << 30, NULL, &big));
    CHECK(heap_stats(h).managed_fallbacks == 2 && heap_stats(h).managed_bytes == 1u << 30);
    CHECK_OK(cuma_free(h, big, NULL));
    CHECK_OK(cuma_validate(h));
    cuma_heap_destroy(h);
}

static void test_streams(void) {
    cuma_heap *h = make("capacity:64M,sim_clock:manual,release_delay_ms:0");
    cuma_stream s1 = (cuma_stream)(uintptr_t)0x1000, s2 = (cuma_stream)(uintptr_t)0x2000;
    void *a, *b;
    CHECK_OK(cuma_alloc(h, 4 * MB, s1, &a));
    CHECK_OK(cuma_sim_hold_stream(h, s1));
    CHECK_OK(cuma_free(h, a, s1));
    /* Same stream: reused at once. */
    CHECK_OK(cuma_alloc(h, 4 * MB, s1, &b));
    CHECK(b == a);
    CHECK_OK(cuma_free(h, b, s1));
    /* Another stream: not while s1 is busy, and the pages stay. */
    CHECK_OK(cuma_alloc(h, 4 * MB, s2, &b));
    CHECK(b != a);
    CHECK_OK(cuma_free(h, b, s2));
    CHECK_OK(cuma_trim(h, 0));
    cuma_stats st = heap_stats(h);
    CHECK(st.reserved_bytes >= 4 * MB); /* a's pages wait for s1 */
    CHECK_OK(cuma_sim_release_stream(h, s1));
    CHECK_OK(cuma_trim(h, 0));
    CHECK(heap_stats(h).reserved_bytes == 0);
    CHECK_OK(cuma_alloc(h, 4 * MB, s2, &b));
    CHECK_OK(cuma_validate(h));
    /* record_stream: not reusable even by its own stream until the other stream is done. */
    CHECK_OK(cuma_record_stream(h, b, s1));
    CHECK_OK(cuma_sim_hold_stream(h, s1));
    CHECK_OK(cuma_free(h, b, NULL));
    void *c;
    CHECK_OK(cuma_alloc(h, 4 * MB, s2, &c));
    CHECK(c != b);
    CHECK_OK(cuma_validate(h));
    CHECK_OK(cuma_sim_release_stream(h, s1));
    CHECK_OK(cuma_free(h, c, NULL));
    CHECK_OK(cuma_poll(h));
    CHECK(heap_stats(h).active_allocs == 0);
    CHECK_OK(cuma_validate(h));
    cuma_heap_destroy(h);
}

/* A page remapped early for stream a (its own page, a's work on it still pending at the old
 * address, a ghost) is partly covered by a's new block; the placement hands the rest of that
 * virtual page, clean space, to stream b. Those bytes are the ones a's pending work may touch at
 * the ghost's address (host backing shows the alias), so b gets them only once the host waited
 * for that work (remap_waits; with stream_order, b is ordered after it on the device instead:
 * test_pages). */
static void test_ghost_page_other_stream(void) {
    cuma_heap *h = make("capacity:64M,page_size:2M,sim_clock:manual,host_backing:on,sim_lag_ms:5,"
                        "release_delay_ms:100000");
    cuma_stream sa = (cuma_stream)(uintptr_t)0xA000, sb = (cuma_stream)(uintptr_t)0xB000;
    char *x1, *y, *x2, *x3;
    CHECK_OK(cuma_alloc(h, 2 * MB, sa, (void **)&x1));
    CHECK_OK(cuma_alloc(h, MB, sa, (void **)&y)); /* so that [x1, x1 + 2 MiB) stays a hole */
    CHECK(y == x1 + 2 * MB && ((uintptr_t)x1 & (2 * MB - 1)) == 0);
    x1[MB + 4096] = 0x77; /* a's work on its block, still queued when a frees it */
    CHECK_OK(cuma_free(h, x1, sa));
    /* Too big for the hole: after y, its second page backed early with x1's page. */
    CHECK_OK(cuma_alloc(h, 2 * MB + 4096, sa, (void **)&x2));
    CHECK(x2 == x1 + 3 * MB && heap_stats(h).early_remaps == 1);
    CHECK(heap_stats(h).remap_waits == 0);
    /* b gets the clean rest of that page: the bytes under x1 + 1 MiB + 4 KiB. */
    CHECK_OK(cuma_alloc(h, 512 * 1024, sb, (void **)&x3));
    CHECK(x3 == x2 + 2 * MB + 4096 && x3[0] == 0x77);
    CHECK(heap_stats(h).remap_waits == 1); /* a's work done before b got them */
    CHECK_OK(cuma_validate(h));
    CHECK_OK(cuma_free(h, x3, sb));
    CHECK_OK(cuma_free(h, x2, sa));
    CHECK_OK(cuma_free(h, y, sa));
    CHECK_OK(cuma_validate(h));
    cuma_heap_destroy(h);
}

/* cuma_stream_retire: a destroyed stream's handle, given to a new stream by the driver, must not
 * get memory the old stream's work still uses, from the heap or from a thread cache (whose map of
 * handles to stream slots goes stale); memory allocated on the old stream and freed after it died
 * waits for its work; and a stream per request does not fill the table. Thread caches on. */
static void test_stream_retire(void) {
    /* A delay, so that the thread caches are on (at 0 they hold nothing); the manual clock never
     * reaches it. */
    cuma_heap *h = heap_make("backend:sim,capacity:64M,sim_clock:manual,release_delay_ms:1000");
    cuma_stream A = (cuma_stream)(uintptr_t)0x1000, B = (cuma_stream)(uintptr_t)0x2000;
    void *a, *b, *keep;
    CHECK_OK(cuma_alloc(h, 4096, A, &a));
    CHECK_OK(cuma_alloc(h, 8192, A, &keep));
    CHECK_OK(cuma_sim_hold_stream(h, A));
    CHECK_OK(cuma_free(h, a, A)); /* into this thread's cache */
    CHECK_OK(cuma_alloc(h, 4096, A, &b));
    CHECK(b == a); /* the cache hands it back on its own stream */
    CHECK_OK(cuma_free(h, b, A));
    CHECK_OK(cuma_stream_retire(h, A));
    CHECK_OK(cuma_stream_retire(h, (cuma_stream)(uintptr_t)0x9999)); /* never seen: no-op */
    CHECK(cuma_stream_retire(h, NULL) == CUMA_ERR_INVALID);
    /* A new stream with the old handle: the old work still runs on a. */
    CHECK_OK(cuma_alloc(h, 4096, A, &b));
    CHECK(b != a);
    CHECK_OK(cuma_free(h, b, A));
    /* Allocated on the dead stream, freed after: B waits for the dead stream's work too. */
    CHECK_OK(cuma_free(h, keep, NULL));
    CHECK_OK(cuma_alloc(h, 8192, B, &b));
    CHECK(b != keep);
    CHECK_OK(cuma_free(h, b, B));
    CHECK_OK(cuma_validate(h));
    CHECK_OK(cuma_sim_release_stream(h, A));
    /* 1000 streams one after another: every allocation is served. */
    for (int i = 0; i < 1000; i++) {
        cuma_stream s = (cuma_stream)(uintptr_t)(0x10000 + i * 16);
        CHECK_OK(cuma_alloc(h, 4096, s, &b));
        CHECK_OK(cuma_free(h, b, s));
        CHECK_OK(cuma_stream_retire(h, s));
    }
    CHECK_OK(cuma_validate(h));
    cuma_heap_destroy(h);
}

static void test_json(void) {
    cuma_heap *h = make("capacity:64M,sim_clock:manual");
    char buf[4096];
    size_t need;
    CHECK_OK(cuma_stats_json(h, buf, sizeof buf, &need));
    CHECK(need == strlen(buf) && buf[0] == '{' && buf[need - 1] == '}');
    CHECK(strstr(buf, "\"reserved_bytes\":0") && strstr(buf, "\"release_delay_ms\":1000"));
    CHECK_ST(cuma_stats_json(h, buf, 10, &need), CUMA_ERR_INVALID);
    cuma_heap_destroy(h);
}

/* Idle memory goes back on time without any allocator call (the release thread). */
static void test_release_thread(void) {
    cuma_heap *h = make("capacity:64M,release_delay_ms:30");
    void *p;
    CHECK_OK(cuma_alloc(h, 8 * MB, NULL, &p));
    CHECK_OK(cuma_free(h, p, NULL));
    CHECK(heap_stats(h).cached_bytes == 8 * MB);
    uint64_t due;
    CHECK_OK(cuma_next_release(h, &due));
    CHECK(due != UINT64_MAX);
    for (int i = 0; i < 2000 && heap_stats(h).reserved_bytes; i++) { /* 20 s at most */
        struct timespec ts = {0, 10 * 1000 * 1000};
        nanosleep(&ts, NULL);
    }
    CHECK(heap_stats(h).reserved_bytes == 0);
    CHECK_OK(cuma_next_release(h, &due));
    CHECK(due == UINT64_MAX);
    cuma_heap_destroy(h);
    /* release_thread:off keeps it until a call runs the policy. */
    h = make("capacity:64M,release_delay_ms:1,release_thread:off");
    CHECK_OK(cuma_alloc(h, 8 * MB, NULL, &p));
    CHECK_OK(cuma_free(h, p, NULL));
    struct timespec ts = {0, 50 * 1000 * 1000};
    nanosleep(&ts, NULL);
    CHECK(heap_stats(h).cached_bytes == 8 * MB);
    CHECK_OK(cuma_poll(h));
    CHECK(heap_stats(h).reserved_bytes == 0);
    cuma_heap_destroy(h);
}

/* Segment mode: whole segments, given back only when entirely free. */
static void test_segments(void) {
    cuma_heap *h = make("capacity:256M,sim_clock:manual,sim_segments:on,host_backing:on,release_"
                        "delay_ms:10,tcache:off");
    void *small[8], *big;
    for (int i = 0; i < 8; i++) {
        CHECK_OK(cuma_alloc(h, 1000, NULL, &small[i]));
        memset(small[i], i, 1000);
    }
    CHECK(heap_stats(h).reserved_bytes == 2 * MB); /* small requests share one 2 MiB segment */
    CHECK_OK(cuma_alloc(h, 5 * MB, NULL, &big));
    CHECK(heap_stats(h).reserved_bytes == 22 * MB); /* mid-size requests get a 20 MiB segment */
    for (int i = 0; i < 7; i++) CHECK_OK(cuma_free(h, small[i], NULL));
    CHECK(((unsigned char *)small[7])[999] == 7);
    CHECK_OK(cuma_trim(h, 0));
    CHECK(heap_stats(h).reserved_bytes == 22 * MB); /* the small segment still has a live block */
    CHECK_OK(cuma_free(h, small[7], NULL));
    CHECK_OK(cuma_sim_set_time(h, 10 * 1000000ull));
    CHECK_OK(cuma_poll(h));
    CHECK(heap_stats(h).reserved_bytes == 20 * MB); /* idle past the delay: given back */
    CHECK_OK(cuma_validate(h));
    CHECK_OK(cuma_free(h, big, NULL));
    CHECK_OK(cuma_trim(h, 0));
    cuma_stats s = heap_stats(h);
    CHECK(s.reserved_bytes == 0 && s.page_creates == 2 && s.page_releases == 2);
    CHECK_OK(cuma_validate(h));
    cuma_heap_destroy(h);
    cuma_config bad = {.conf = "backend:sim,sim_segments:on,policy:buddy",
                       .flags = CUMA_CONFIG_NO_ENV};
    CHECK_ST(cuma_heap_create(&bad, &h), CUMA_ERR_CONFIG);
    CHECK(strstr(cuma_last_error(), "buddy"));
}

/* fragmentation_threshold: a cache of at most that share of the memory in use stays past the
 * delay; more than that, or a heap with nothing in use, goes back. */
static void test_fragmentation_threshold(void) {
    cuma_heap *h =
        make("capacity:256M,sim_clock:manual,release_delay_ms:10,fragmentation_threshold:0.1");
    void *live, *idle;
    CHECK_OK(cuma_alloc(h, 80 * MB, NULL, &live));
    CHECK_OK(cuma_alloc(h, 8 * MB, NULL, &idle));
    CHECK_OK(cuma_free(h, idle, NULL));
    uint64_t due;
    CHECK_OK(cuma_next_release(h, &due));
    CHECK(due == UINT64_MAX); /* 8 MiB idle <= 10% of 80 MiB in use: nothing due */
    CHECK_OK(cuma_sim_set_time(h, 50 * 1000000ull));
    CHECK_OK(cuma_poll(h));
    CHECK(heap_stats(h).cached_bytes == 8 * MB);
    CHECK_OK(cuma_alloc(h, 16 * MB, NULL, &idle));
    CHECK_OK(cuma_free(h, idle, NULL)); /* 16 MiB idle: over 10%, due after the delay */
    CHECK_OK(cuma_next_release(h, &due));
    CHECK(due == 60 * 1000000ull);
    CHECK_OK(cuma_sim_set_time(h, due));
    CHECK_OK(cuma_poll(h));
    CHECK(heap_stats(h).cached_bytes == 8 * MB); /* down to the threshold, oldest first */
    CHECK_OK(cuma_free(h, live, NULL));          /* nothing in use: all of it goes */
    CHECK_OK(cuma_sim_set_time(h, 100 * 1000000ull));
    CHECK_OK(cuma_poll(h));
    CHECK(heap_stats(h).reserved_bytes == 0);
    CHECK_OK(cuma_validate(h));
    cuma_heap_destroy(h);
}

/* preallocate: memory taken at creation and kept; growth:off stays within it. */
static void test_preallocate(const char *mode) {
    char conf[160];
    snprintf(conf, sizeof conf, "capacity:256M,sim_clock:manual,preallocate:32M,growth:off,%s",
             mode);
    cuma_heap *h = make(conf);
    CHECK(heap_stats(h).reserved_bytes == 32 * MB);
    void *p, *q;
    CHECK_OK(cuma_alloc(h, 24 * MB, NULL, &p));
    CHECK_ST(cuma_alloc(h, 16 * MB, NULL, &q), CUMA_ERR_LIMIT);
    CHECK_OK(cuma_free(h, p, NULL));
    CHECK_OK(cuma_trim(h, 0));
    CHECK(heap_stats(h).reserved_bytes == 32 * MB); /* never given back */
    CHECK_OK(cuma_validate(h));
    cuma_heap_destroy(h);
}

/* A block whose record the policy hands out again must not inherit the streams record_stream
 * added to the block that had it before: its free would wait for them (found by fuzz_heap). */
static void test_record_stream_not_inherited(const char *policy) {
    char conf[160];
    snprintf(conf, sizeof conf,
             "capacity:64M,page_size:64K,sim_clock:manual,tcache:off,arenas:1,policy:%s", policy);
    cuma_heap *h = make(conf);
    cuma_stream s1 = (cuma_stream)0x100, s2 = (cuma_stream)0x200;
    void *a, *b;
    CHECK_OK(cuma_alloc(h, 196609, s2, &a));
    CHECK_OK(cuma_record_stream(h, a, s1));
    CHECK_OK(cuma_free(h, a, s2));
    CHECK_OK(cuma_trim(h, 0));
    CHECK_OK(cuma_alloc(h, 196609, NULL, &b));
    CHECK(b == a); /* the same place, and (here) the same record */
    CHECK_OK(cuma_sim_hold_stream(h, s1));
    CHECK_OK(cuma_free(h, b, NULL)); /* never recorded on s1: done at once */
    cuma_stats s = heap_stats(h);
    CHECK(s.requested_bytes == 0 && s.active_allocs == 0);
    CHECK_OK(cuma_sim_release_stream(h, s1));
    CHECK_OK(cuma_validate(h));
    cuma_heap_destroy(h);
}

/* cuma_free_device_wide: the default stream's work issued so far must be done before anyone,
 * the block's own (default) stream included, gets the memory; a plain free is reusable at once
 * by its stream. The figures count the block as live until then, as after cuma_record_stream. */
static void test_free_device_wide(const char *policy) {
    char conf[160];
    snprintf(conf, sizeof conf, "capacity:64M,page_size:64K,sim_clock:manual,tcache:%s,policy:%s",
             strcmp(policy, "tlsf") ? "off" : "on", policy);
    cuma_heap *h = make(conf);
    void *p, *q, *r;
    CHECK_OK(cuma_alloc(h, 4096, NULL, &p));
    CHECK_OK(cuma_sim_hold_stream(h, NULL)); /* work on p still running */
    CHECK_OK(cuma_free_device_wide(h, p));
    CHECK(heap_stats(h).active_allocs == 1);
    CHECK_OK(cuma_alloc(h, 4096, NULL, &q));
    CHECK(q != p);
    CHECK_OK(cuma_free(h, q, NULL)); /* plain: its stream may take it at once */
    CHECK_OK(cuma_alloc(h, 4096, NULL, &r));
    CHECK(r == q);
    CHECK_ST(cuma_free_device_wide(h, p), CUMA_ERR_BAD_POINTER); /* a second free */
    CHECK_OK(cuma_sim_release_stream(h, NULL));
    CHECK_OK(cuma_poll(h));
    cuma_stats s = heap_stats(h);
    CHECK(s.active_allocs == 1 && s.num_frees == 2);
    CHECK_OK(cuma_free_device_wide(h, r));
    CHECK_OK(cuma_poll(h));
    CHECK(heap_stats(h).active_allocs == 0);
    CHECK_OK(cuma_validate(h));
    cuma_heap_destroy(h);
}

/* A device-wide free of a block whose allocation stream was retired: its place in the table may
 * be handed to the default stream by the very lookup the free makes, and the free must still wait
 * for the default stream's work (found in review: the block came back at once). */
static void test_free_device_wide_retired(const char *policy) {
    char conf[160];
    snprintf(conf, sizeof conf,
             "capacity:64M,page_size:64K,sim_clock:manual,tcache:off,arenas:1,policy:%s", policy);
    cuma_heap *h = make(conf);
    cuma_stream s1 = (cuma_stream)0x100;
    void *p, *q;
    CHECK_OK(cuma_alloc(h, 4096, s1, &p));   /* the default stream has no place in the table yet */
    CHECK_OK(cuma_stream_retire(h, s1));     /* its work done: the place is free for another */
    CHECK_OK(cuma_sim_hold_stream(h, NULL)); /* work on p still running on the default stream */
    CHECK_OK(cuma_free_device_wide(h, p));
    CHECK(heap_stats(h).active_allocs == 1);
    CHECK_OK(cuma_alloc(h, 4096, NULL, &q));
    CHECK(q != p); /* not before the default stream's work */
    CHECK_OK(cuma_sim_release_stream(h, NULL));
    CHECK_OK(cuma_poll(h));
    CHECK(heap_stats(h).active_allocs == 1);
    CHECK_OK(cuma_free(h, q, NULL));
    CHECK_OK(cuma_validate(h));
    cuma_heap_destroy(h);
}

int main(void) {
    test_free_device_wide("tlsf");
    test_free_device_wide_retired("tlsf");
    test_free_device_wide_retired("buddy");
    test_free_device_wide("buddy");
    test_record_stream_not_inherited("tlsf");
    test_record_stream_not_inherited("buddy");
    test_preallocate("policy:tlsf");
    test_preallocate("sim_segments:on");
    test_fragmentation_threshold();
    test_segments();
    test_release_thread();
    test_basic("tlsf");
    test_basic("buddy");
    test_bad_input();
    test_release_delay();
    test_limit_and_max_cached();
    test_oom_ladder();
    test_oom_crowd();
    test_oom_cross_heaps();
    test_oom_wait_is_bounded();
    test_oom_remove_waits_for_a_run();
    test_oom_callback_removes_itself();
    test_streams();
    test_ghost_page_other_stream();
    test_stream_retire();
    test_json();
    printf("test_heap: all passed\n");
    return 0;
}
