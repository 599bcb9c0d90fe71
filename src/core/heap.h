/* The heap: placement policy + pages + streams + release policy behind one lock.
 * Internal; the public surface is include/cuma/cuma.h. */
#ifndef CUMA_CORE_HEAP_H
#define CUMA_CORE_HEAP_H

#include "backend/backend.h"
#include "config.h"
#include "hashmap.h"
#include "pages.h"
#include "policy.h"
#include "segments.h"
#include "streams.h"
#include "tcache.h"

#include <pthread.h>
#include <stdatomic.h>

#define CUMA_MAX_OOM_CALLBACKS 16

typedef struct cuma_oom_slot {
    cuma_oom_fn fn;
    void *user;
    int id;
} cuma_oom_slot;

/* Counters kept under the heap lock; cuma_get_stats copies them out. */
typedef struct cuma_counters {
    uint64_t requested, peak_requested, allocated, peak_allocated, peak_reserved;
    uint64_t managed, active, allocs, frees, failed, retries, ooms, oom_calls, managed_fallbacks,
        trims;
} cuma_counters;

/* Invariants (cuma_heap_check, under lock): every live block is in `live` under its address
 * base + off and in no free list; the page reference counts equal the number of live and
 * deferred blocks whose requested bytes overlap each page; counters.requested is the sum of
 * the live blocks' requests; the policy, pages and streams hold their own invariants. */
struct cuma_heap {
    pthread_mutex_t lock; /* guards everything below unless a field says otherwise */
    uint64_t id;          /* registry id (tcache.c); constant */
    cuma_settings set;    /* constant after creation, except limit fields (under lock) */
    cuma_backend *be;     /* constant after creation */
    uint64_t base;        /* address of offset 0 of the virtual range; constant */
    uint64_t va_size;     /* constant */
    cuma_policy *pol;
    cuma_streams streams;
    bool vmm;              /* page mode (pages) or segment mode (segs); constant */
    bool backend_fallback; /* no backend named, no driver: on the simulated device; constant */
    cuma_pages pages;
    cuma_segs segs;
    cuma_map live;    /* address -> cuma_block of every live allocation */
    cuma_map managed; /* address -> size (as a pointer-sized integer) of managed fallbacks */
    uint64_t last_fence_tick; /* gseq of the last periodic fence poll */
    cuma_block *deferred;     /* freed blocks waiting on record_stream fences (linked by fnext) */
    uint64_t limit_bytes;     /* effective limit on reserved bytes */
    int64_t release_delay_ns;
    uint64_t max_cached_bytes;
    cuma_counters c;
    cuma_oom_slot oom[CUMA_MAX_OOM_CALLBACKS];
    int noom, next_oom_id;
    int in_oom; /* an OOM callback is running: no recursion into callbacks */
    /* Thread caches (tcache.h): settings constant after creation; the list under the lock. */
    bool tc_on;
    uint64_t tc_bytes, tc_max;
    int64_t tc_age_ns;
    uint64_t tc_due; /* no thread-cache block is due to go back before this (coarse time) */
    cuma_tcache *tcaches;
    _Atomic uint64_t manual_now; /* sim_clock:manual: the time cuma_sim_set_time set */
    _Atomic uint64_t coarse_now; /* the clock as of the last slow path (fast paths stamp with it) */
    _Atomic int64_t req_global;  /* c.requested, for the fast path's peak check */
    _Atomic uint64_t peak_req;   /* peak requested bytes (fast and slow paths) */
    /* Background release thread. */
    pthread_t thread;
    pthread_cond_t wake;
    bool thread_running, stopping;
    uint64_t thread_wake_at; /* when the release thread plans to wake (heap clock) */
};

/* The physical layer, whichever mode: bytes held from the device, idle in the cache, in use. */
static inline uint64_t cuma_heap_reserved(const cuma_heap *h) {
    return h->vmm ? h->pages.nreserved * h->pages.page_size : h->segs.reserved;
}
static inline uint64_t cuma_heap_cached(const cuma_heap *h) {
    return h->vmm ? h->pages.ncached * h->pages.page_size : h->segs.idle_bytes;
}
static inline uint64_t cuma_heap_oldest_idle(const cuma_heap *h) {
    return h->vmm ? cuma_pages_oldest_idle(&h->pages) : cuma_segs_oldest_idle(&h->segs);
}
/* Gives back idle memory: older than delay_ns (< 0: none by age) while more than age_keep_bytes
 * idle, then the oldest while more than max_cached_bytes idle. */
void cuma_heap_release(cuma_heap *h, uint64_t now, int64_t delay_ns, uint64_t max_cached_bytes,
                       uint64_t age_keep_bytes, bool wait);

/* The heap's clock: the backend's, or with sim_clock:manual (any backend) the time that
 * cuma_sim_set_time last set, so a replay drives the release policy with trace time. */
static inline uint64_t cuma_heap_now(cuma_heap *h) {
    return h->set.sim_clock_manual ? atomic_load_explicit(&h->manual_now, memory_order_relaxed)
                                   : h->be->ops->now_ns(h->be);
}

/* Takes back a block a thread cache held (heap lock held). */
void cuma_heap_give_cached(cuma_heap *h, cuma_block *b);

/* Flushes every thread cache (heap lock held). */
void cuma_heap_flush_tcaches(cuma_heap *h);

/* Locked helpers shared by heap.c and heap_api.c. */
void cuma_heap_refresh_limit(cuma_heap *h);
void cuma_heap_release_policy(cuma_heap *h, uint64_t now);
cuma_status cuma_heap_check(cuma_heap *h);

#endif
