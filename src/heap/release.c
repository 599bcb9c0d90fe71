// SPDX-License-Identifier: Apache-2.0
/* The release policy: idle memory back to the device by age, cache size and fragmentation,
 * thread caches by age, trim and poll, and the thread that does it while the program makes no
 * call. */
#include "util/error.h"
#include "heap/heap.h"
#include "util/marks.h"

#include <assert.h>
#include <time.h>

struct timespec cuma_deadline(clockid_t clock, uint64_t ns) {
    struct timespec ts;
    clock_gettime(clock, &ts);
    uint64_t at = (uint64_t)ts.tv_nsec + ns;
    ts.tv_sec += (time_t)(at / 1000000000ull);
    ts.tv_nsec = (long)(at % 1000000000ull);
    return ts;
}

/* Blocks idle in thread caches longer than tcache_age_ms go back. Walking every cache is not
 * free, so it runs only when something is due: after a walk, the oldest block left (or any
 * block pushed later, stamped later) is due no earlier than tc_due. */
static void age_tcaches(cuma_arena *a, uint64_t t) {
    atomic_store_explicit(&a->coarse_now, t, memory_order_relaxed);
    if (!a->tcaches || a->tc_age_ns == INT64_MAX || t < a->tc_due) return;
    if (t >= (uint64_t)a->tc_age_ns)
        cuma_tcache_flush_all(a, t - (uint64_t)a->tc_age_ns + 1, cuma_arena_give_cached);
    uint64_t oldest = cuma_tcache_oldest(a);
    a->tc_due = (oldest < t ? oldest : t) + (uint64_t)a->tc_age_ns;
}

void cuma_arena_release(cuma_arena *a, uint64_t t, int64_t delay_ns, uint64_t max_cached_bytes,
                        uint64_t age_keep_bytes, bool wait) {
    cuma_mark_push(a->heap->set.nvtx, CUMA_MARK_RELEASE);
    a->phys.ops->release(a, t, delay_ns, max_cached_bytes, age_keep_bytes, wait);
    assert(cuma_arena_cached(a) <= cuma_arena_reserved(a));
    /* Every release (trim, OOM ladder, limit) publishes what is left idle: max_cached and the
     * cross-process ledger read it. */
    atomic_store_explicit(&a->pub[CUMA_PUB_CACHED], (int64_t)cuma_arena_cached(a),
                          memory_order_relaxed);
    cuma_mark_pop(a->heap->set.nvtx);
}

/* fragmentation_threshold: idle memory past its delay stays while it is at most this share of
 * the memory in use (mapped under live bytes). A cache of a few percent of a busy heap costs
 * little and saves the next step the churn of creating and mapping pages again; an idle heap
 * (nothing in use) keeps nothing. */
static uint64_t age_keep(const cuma_arena *a) {
    uint64_t in_use = cuma_arena_reserved(a) - cuma_arena_cached(a);
    return (uint64_t)(a->heap->set.fragmentation_threshold * (double)in_use);
}

/* When the release policy will next act by age: UINT64_MAX when nothing is due. */
static uint64_t next_age_due(const cuma_arena *a) {
    uint64_t oldest = cuma_arena_oldest_idle(a);
    if (a->release_delay_ns < 0 || oldest == UINT64_MAX || cuma_arena_cached(a) <= age_keep(a))
        return UINT64_MAX;
    return oldest + (uint64_t)a->release_delay_ns;
}

/* Merges free blocks whose fences completed since they were freed; with segments that is how
 * one freed by several streams becomes whole again and can go back (the layer's `whole`). */
void cuma_arena_coalesce(cuma_arena *a, bool wait) {
    if (a->streams.n <= 1) return;
    for (unsigned i = 0; i < a->streams.n; i++)
        cuma_fence_poll(&a->streams, i, a->streams.slot[i].last, wait);
    a->pol->ops->coalesce(a->pol, a->phys.ops->whole, a);
}

void cuma_arena_release_policy(cuma_arena *a, uint64_t t) {
    cuma_streams_tick(&a->streams, t);
    if (a->deferred) cuma_arena_process_deferred(a, false);
    age_tcaches(a, t);
    /* max_cached is the heap's: this arena keeps what the others' caches leave of it. */
    uint64_t cap = a->max_cached_bytes;
    if (cap != UINT64_MAX) {
        uint64_t others = (uint64_t)(cuma_heap_total(a->heap, CUMA_PUB_CACHED) -
                                     atomic_load(&a->pub[CUMA_PUB_CACHED]));
        cap = others >= cap ? 0 : cap - others;
    }
    if (t >= next_age_due(a) || cuma_arena_cached(a) > cap)
        cuma_arena_release(a, t, a->release_delay_ns, cap, age_keep(a), false); /* reaps too */
    else if (*a->phys.nlagging)
        a->phys.ops->reap(a, false); /* old mappings whose work is done go all the same */
    atomic_store_explicit(&a->pub[CUMA_PUB_CACHED], (int64_t)cuma_arena_cached(a),
                          memory_order_relaxed);
}

void cuma_arena_release_idle(cuma_arena *a, uint64_t keep_bytes) {
    cuma_streams_tick(&a->streams, cuma_arena_now(a));
    cuma_arena_flush_tcaches(a);
    cuma_arena_process_deferred(a, true);
    cuma_arena_coalesce(a, true);
    cuma_arena_release(a, cuma_arena_now(a), -1, keep_bytes, 0, true);
}

void cuma_heap_release_all(cuma_heap *h, uint64_t keep_bytes, bool count_trim) {
    unsigned n = atomic_load_explicit(&h->narenas, memory_order_acquire);
    for (unsigned i = 0; i < n; i++) {
        cuma_arena *a = h->arenas[i];
        cuma_mutex_lock(&a->lock, CUMA_RANK_ARENA);
        if (!i && count_trim) a->c.trims++;
        /* keep_bytes is the heap's: the first arena keeps them, the others keep nothing. */
        cuma_arena_release_idle(a, i ? 0 : keep_bytes);
        cuma_mutex_unlock(&a->lock);
    }
}

cuma_status cuma_trim(cuma_heap *h, size_t keep_bytes) {
    if (!h) return cuma_fail(CUMA_ERR_INVALID, "cuma_trim: heap is NULL");
    if (atomic_load(&h->inherited)) return cuma_heap_inherited(h, "cuma_trim");
    cuma_mark_push(h->set.nvtx, CUMA_MARK_TRIM);
    cuma_heap_release_all(h, keep_bytes, true);
    cuma_mark_pop(h->set.nvtx);
    return CUMA_OK;
}

cuma_status cuma_poll(cuma_heap *h) {
    if (!h) return cuma_fail(CUMA_ERR_INVALID, "cuma_poll: heap is NULL");
    if (atomic_load(&h->inherited)) return cuma_heap_inherited(h, "cuma_poll");
    unsigned n = atomic_load_explicit(&h->narenas, memory_order_acquire);
    for (unsigned i = 0; i < n; i++) {
        cuma_arena *a = h->arenas[i];
        cuma_mutex_lock(&a->lock, CUMA_RANK_ARENA);
        cuma_arena_release_policy(a, cuma_arena_now(a));
        cuma_mutex_unlock(&a->lock);
    }
    return CUMA_OK;
}

static uint64_t next_release_of(cuma_arena *a) {
    uint64_t ns = next_age_due(a);
    if (a->tcaches && a->tc_age_ns != INT64_MAX) {
        /* A cache block is due at tc_due at the earliest; whether one is there is only known
         * by walking the caches, so report tc_due only when some cache holds a block. */
        uint64_t oldest = cuma_tcache_oldest(a);
        uint64_t due = oldest == UINT64_MAX ? UINT64_MAX : oldest + (uint64_t)a->tc_age_ns;
        if (due != UINT64_MAX && due < a->tc_due) due = a->tc_due;
        if (due < ns) ns = due;
    }
    return ns;
}

cuma_status cuma_next_release(cuma_heap *h, uint64_t *ns) {
    if (!h || !ns) return cuma_fail(CUMA_ERR_INVALID, "cuma_next_release: NULL argument");
    *ns = UINT64_MAX;
    unsigned n = atomic_load_explicit(&h->narenas, memory_order_acquire);
    for (unsigned i = 0; i < n; i++) {
        cuma_arena *a = h->arenas[i];
        cuma_mutex_lock(&a->lock, CUMA_RANK_ARENA);
        uint64_t due = next_release_of(a);
        cuma_mutex_unlock(&a->lock);
        if (due < *ns) *ns = due;
    }
    return CUMA_OK;
}

/* How often the first arena's release thread looks at the device's free memory when
 * free_watermark is set (a driver call of a few microseconds, made only while the heap holds idle
 * pages). */
#define WATERMARK_POLL_NS 10000000ull

static bool watches_device(const cuma_arena *a) {
    return a == &a->heap->first && a->heap->set.free_watermark;
}

/* The heap's idle bytes: exact for arena a (its lock held), as last published for the others. */
static uint64_t idle_bytes(cuma_arena *a) {
    int64_t others = cuma_heap_total(a->heap, CUMA_PUB_CACHED) -
                     atomic_load_explicit(&a->pub[CUMA_PUB_CACHED], memory_order_relaxed);
    return cuma_arena_cached(a) + (others > 0 ? (uint64_t)others : 0);
}

/* Device pressure (free_watermark): while the device's free memory is under the watermark, the
 * idle pages that make up the difference go back, oldest first, whatever their age, from every
 * arena in turn. First arena's release thread, its lock held on entry and exit; the driver is
 * asked with no lock held (it may be slow, and needs no heap state). */
static void watermark_poll(cuma_arena *a) {
    /* The thread may pass by more often (the ledger's looks, a due page still busy). */
    uint64_t t = cuma_arena_now(a);
    cuma_heap *h = a->heap;
    if (t < h->watermark_due) return;
    h->watermark_due = t + WATERMARK_POLL_NS;
    if (!idle_bytes(a)) return;
    cuma_mutex_unlock(&a->lock);
    uint64_t fr = 0, total = 0;
    if (a->be->ops->mem_info(a->be, &fr, &total) == CUMA_OK && fr < h->set.free_watermark) {
        uint64_t deficit = h->set.free_watermark - fr;
        unsigned n = atomic_load_explicit(&h->narenas, memory_order_acquire);
        for (unsigned i = 0; i < n && deficit; i++) {
            cuma_arena *o = h->arenas[i];
            cuma_mutex_lock(&o->lock, CUMA_RANK_ARENA);
            cuma_streams_tick(&o->streams, cuma_arena_now(o));
            /* Preallocated pages among the idle ones stay (the release skips them): at worst a
             * look every 10 ms walks the cache for nothing. */
            uint64_t cached = cuma_arena_cached(o);
            uint64_t go = deficit < cached ? deficit : cached;
            if (go) {
                /* No age limit (-1), a cap of what may stay: the oldest pages above it go. */
                cuma_arena_release(o, cuma_arena_now(o), -1, cached - go, 0, false);
                uint64_t gone = cached - cuma_arena_cached(o);
                o->c.watermark_bytes += gone;
                deficit = gone < deficit ? deficit - gone : 0;
            }
            cuma_mutex_unlock(&o->lock);
        }
    }
    cuma_mutex_lock(&a->lock, CUMA_RANK_ARENA);
}

#define SECOND_NS 1000000000ull
/* At least 1 ms a sleep: a due page whose fence is still pending stays due, and the thread must
 * not spin on the lock while the stream works. */
#define MIN_SLEEP_NS 1000000ull

uint64_t cuma_release_sleep(const cuma_sleep_in *in, uint64_t *policy_at) {
    uint64_t t = in->now;
    /* Nothing due: a look a second, or at half the thread caches' age (a block pushed into one
     * since the last walk goes back within 1.5 ages). */
    uint64_t plan = SECOND_NS;
    if (in->tc_age_ns != INT64_MAX && (uint64_t)in->tc_age_ns / 2 + 1 < plan)
        plan = (uint64_t)in->tc_age_ns / 2 + 1;
    if (in->age_due <= t)
        plan = 0;
    else if (in->age_due != UINT64_MAX && in->age_due - t < plan)
        plan = in->age_due - t;
    if (plan < MIN_SLEEP_NS) plan = MIN_SLEEP_NS;
    /* The plan made at an earlier look stands unless this one is earlier. */
    if (t + plan < *policy_at) *policy_at = t + plan;
    uint64_t wait_ns = *policy_at > t ? *policy_at - t : 0;
    if (wait_ns < MIN_SLEEP_NS) wait_ns = MIN_SLEEP_NS;
    /* Other processes' pressure requests are answered within a few ms, the device's free memory
     * watched every 10 ms; the policy still runs at *policy_at, not at every look. */
    if (in->ledger && wait_ns > CUMA_LEDGER_POLL_NS) wait_ns = CUMA_LEDGER_POLL_NS;
    if (in->watermark && wait_ns > WATERMARK_POLL_NS) wait_ns = WATERMARK_POLL_NS;
    return wait_ns;
}

/* Gives idle memory back while the program runs, even when it makes no allocator call: sleeps
 * until the oldest idle page's delay ends (or a page goes idle in an empty cache). */
void *cuma_arena_release_thread(void *arg) {
    cuma_arena *a = arg;
    /* When the release policy runs next: kept across the short looks of the ledger and the
     * watermark (a plan made anew at every look would always lie ahead, and the policy, thread
     * caches' ageing included, would run only when woken), brought forward when a look finds
     * something due earlier, and made afresh once the policy ran. */
    uint64_t policy_at = UINT64_MAX;
    /* The first arena's thread answers the peers for the heap. */
    cuma_heap *h = a->heap;
    bool peers = a == &h->first && h->peers.ops;
    cuma_mutex_lock(&a->lock, CUMA_RANK_ARENA);
    while (!a->stopping) {
        cuma_sleep_in in = {
            .now = cuma_arena_now(a),
            .age_due = next_age_due(a),
            .tc_age_ns = a->tcaches ? a->tc_age_ns : INT64_MAX,
            .ledger = peers,
            .watermark = watches_device(a),
        };
        uint64_t wait_ns = cuma_release_sleep(&in, &policy_at);
        assert(policy_at != UINT64_MAX && wait_ns >= MIN_SLEEP_NS);
        a->thread_wake_at = policy_at; /* a free whose page is due earlier wakes the thread */
        bool woken;
        {
            /* A little late, never early. */
            struct timespec ts = cuma_deadline(CLOCK_MONOTONIC, wait_ns + 100000);
            woken = pthread_cond_timedwait(&a->wake, &a->lock, &ts) == 0;
        }
        uint64_t now = cuma_arena_now(a);
        if (!a->stopping && (woken || now >= policy_at)) {
            /* The pass holds the heap lock: a timeline shows it against the program's calls. */
            cuma_mark_push(h->set.nvtx, CUMA_MARK_RELEASE_PASS);
            cuma_arena_release_policy(a, now);
            cuma_mark_pop(h->set.nvtx);
            policy_at = UINT64_MAX;
        }
        if (!a->stopping && peers) h->peers.ops->poll(h->peers.ctx, h);
        if (!a->stopping && watches_device(a)) watermark_poll(a);
    }
    cuma_mutex_unlock(&a->lock);
    return NULL;
}
