// SPDX-License-Identifier: Apache-2.0
/* The heap and its arenas: each arena a placement policy, a physical layer, streams and a
 * release policy behind one lock; the heap what they share. Internal; the public surface is
 * include/cuma/cuma.h. */
#ifndef CUMA_HEAP_HEAP_H
#define CUMA_HEAP_HEAP_H

#include "backend/backend.h"
#include "settings/config.h"
#include "util/hashmap.h"
#include "util/lockrank.h"
#include "phys/pages.h"
#include "heap/phys.h"
#include "heap/peers.h"
#include "place/policy.h"
#include "phys/segments.h"
#include "place/streams.h"
#include "heap/tcache.h"

#include <pthread.h>
#include <time.h>
#include <stdatomic.h>

#define CUMA_MAX_OOM_CALLBACKS 16

typedef struct cuma_arena cuma_arena;

/* The figures an arena publishes (cuma_arena.pub). CACHED: idle pages (the release policy's);
 * TCACHED: bytes of the pages only blocks in thread caches hold, as last counted
 * (cuma_arena_memory; lowered by each block given back from a cache until the next count); TREQ:
 * the thread caches' requested shares not yet in REQUESTED (negative after their frees), as last
 * counted (less what slow calls moved into REQUESTED since). */
enum {
    CUMA_PUB_REQUESTED,
    CUMA_PUB_ALLOCATED,
    CUMA_PUB_CACHED,
    CUMA_PUB_TCACHED,
    CUMA_PUB_TREQ,
    CUMA_PUB_N
};

/* A list of callbacks of one type (OOM, pressure), under the heap's oom_lock. `fn` is
 * stored as a generic function pointer and cast back to the list's type before it is called.
 * Invariant: 0 <= n <= CUMA_MAX_OOM_CALLBACKS; ids are distinct and below next_id. */
typedef void (*cuma_any_fn)(void);
typedef struct cuma_cb_slot {
    cuma_any_fn fn;
    void *user;
    int id;
} cuma_cb_slot;
typedef struct cuma_cb_list {
    cuma_cb_slot s[CUMA_MAX_OOM_CALLBACKS];
    int n, next_id;
} cuma_cb_list;

/* Adds or removes a callback of heap h's list l (`who` names the public call in messages). A
 * removal made outside h's callbacks returns once no run of h's callbacks that may still call
 * the removed one is in progress (so its `user` may be freed); one made from inside a callback
 * of h does not wait (its own run, or another thread's, may still call it once). */
cuma_status cuma_cb_add(cuma_heap *h, cuma_cb_list *l, cuma_any_fn fn, void *user, int *id,
                        const char *who);
cuma_status cuma_cb_remove(cuma_heap *h, cuma_cb_list *l, int id, const char *who);

/* A run of one of a heap's callback lists, on the running thread's stack: begin copies the list
 * into out (returns its length) and counts the run in h->cb_runs until end. */
typedef struct cuma_cb_run {
    const cuma_heap *heap;
    struct cuma_cb_run *up;
} cuma_cb_run;
int cuma_cb_run_begin(cuma_heap *h, const cuma_cb_list *l, cuma_cb_slot *out, cuma_cb_run *run);
void cuma_cb_run_end(cuma_heap *h, cuma_cb_run *run);

/* Counters kept under an arena's lock; cuma_get_stats sums them. */
typedef struct cuma_counters {
    uint64_t requested, allocated;
    uint64_t active, allocs, frees, failed, retries, ooms, oom_calls, trims;
    uint64_t watermark_bytes; /* idle bytes given back under device pressure (free_watermark) */
} cuma_counters;

/* An arena: a lock and everything it guards (placement policy, physical layer over its own
 * virtual range, streams, live table, deferred and moving blocks, thread caches, counters) and
 * a release thread. Internal: the program holds the heap (cuma_heap below), whose first arena
 * is embedded in it; arena.c makes more when threads keep colliding on a lock.
 *
 * Invariants (cuma_heap_check, under lock): every live block is in `live` under its address
 * base + off and in no free list; the page reference counts equal the number of live and
 * deferred blocks whose requested bytes overlap each page; c.requested is the sum of the live
 * blocks' requests, and pub[] holds c.requested / allocated; the policy, the physical layer
 * and the streams hold their own invariants. */
struct cuma_arena {
    /* Read by the threads of every arena on every call, written only while the arena is built:
     * its own cache lines, apart from what the slow path writes (the lock above all), so that
     * a thread in another arena does not miss on them. */
    struct cuma_heap *heap; /* the heap it belongs to; constant */
    uint64_t id;            /* registry id (tcache.c); constant */
    uint64_t base;          /* address of offset 0 of the virtual range; constant */
    uint64_t va_size;       /* constant */
    char pad_shared[64];
    pthread_mutex_t lock; /* guards everything below unless a field says otherwise */
    cuma_backend *be;     /* the heap's backend (heap->be); constant */
    cuma_policy *pol;
    cuma_streams streams;
    cuma_physmem phys;        /* the physical layer (phys.h): pages or segs below; constant */
    cuma_pages pages;         /* the page layer's (cuma_phys_pages) */
    cuma_segs segs;           /* the segment layer's (cuma_phys_segments) */
    cuma_map live;            /* address -> cuma_block of every live allocation */
    uint64_t last_fence_tick; /* gseq of the last periodic fence poll */
    cuma_block *deferred;     /* freed blocks waiting on record_stream fences (linked by fnext) */
    /* New places of blocks a compaction is moving (compact.c), linked by fnext: live in the
     * policy and the pages, in no live table or counter until the move commits. */
    cuma_block *moving;
    uint64_t limit_bytes; /* effective limit on reserved bytes (from heap->set.limit) */
    int64_t release_delay_ns;
    uint64_t max_cached_bytes;
    /* This arena's (the heap's managed fallbacks are the heap's: managed_bytes below). */
    cuma_counters c;
    /* Thread caches (tcache.h): settings constant after creation; the list under the lock. */
    bool tc_on;
    bool granule_round; /* the policy rounds to CUMA_GRANULE: inline in cuma_alloc */
    uint64_t fast_max;  /* requests of 1..fast_max bytes are rounded to size classes and try the
                           thread cache inline (0: caches off, another policy's rounding, or
                           a layer whose slack is memory, CUMA_PHYS_SLACK_FREE: the slow path
                           rounds and tries the cache) */
    uint64_t tc_bytes, tc_max;
    int64_t tc_age_ns;
    uint64_t tc_due; /* no thread-cache block is due to go back before this (coarse time) */
    /* When the block being given back went idle: its push into a thread cache while one is
     * given back from there (cuma_arena_give_cached), else UINT64_MAX (the time of the free). */
    uint64_t idle_since;
    cuma_tcache *tcaches;
    _Atomic uint64_t manual_now; /* sim_clock:manual: the time cuma_sim_set_time set */
    _Atomic uint64_t coarse_now; /* the clock as of the last slow path (fast paths stamp with it) */
    /* Bumped (under the lock) when a stream of this arena is retired: thread caches then forget
     * which stream index their handles had (tcache.h), since a new stream may reuse the handle. */
    _Atomic uint64_t stream_gen;
    /* This arena's c.requested and c.allocated (cuma_arena_publish) and its idle bytes as of its
     * last release policy run, indexed by CUMA_PUB_*: the totals of the whole heap are taken
     * from them without locks (peaks, max_cached). Written under this arena's lock, read by
     * anyone; on a cache line of their own, so that arenas of threads running side by side do
     * not write into the same line. */
    char pad0[64];
    _Atomic int64_t pub[CUMA_PUB_N];
    char pad1[64];
    /* Background release thread. */
    pthread_t thread;
    pthread_cond_t wake;
    bool thread_running, stopping;
    uint64_t thread_wake_at; /* when the release thread plans to wake (heap clock) */
};

/* The heap: its arenas and what they share (the backend, settings and limit, callbacks, managed
 * memory, the ledger slot, peaks, pools, the trace log, fork tracking). The public handle of
 * include/cuma/cuma.h.
 *
 * Invariants: arenas[0] is &first; arenas[i] (i < narenas) are distinct and their virtual
 * ranges do not overlap. Across arenas (all locks held): first.pages.own_reserved is the sum of
 * the arenas' pages.nreserved. Pools (cuma_pools_check, pool locks): pool_count, pool_bytes,
 * pool_blocks and pool_in_use are the sums over the pools on pool_list. */
struct cuma_heap {
    /* arenas[0], at offset 0: the fast paths of a heap with one arena use the heap's address. */
    cuma_arena first;
    char pad_first[64]; /* the release thread writes the arena's last lines */
    /* The arenas. arenas[i] is written before narenas covers it (release) and never changes
     * after; arena_lock serialises making one with changes of settings that every arena must
     * see (set.limit). */
    _Atomic unsigned narenas;
    cuma_arena *arenas[CUMA_MAX_ARENAS];
    /* Constant after creation, except set.limit (written and read under arena_lock). */
    cuma_settings set;
    cuma_backend *be;      /* shared by the arenas (through cuma_backend_locked); constant */
    bool backend_fallback; /* backend_fallback:sim, no driver: on the simulated device; constant */
    struct cuma_trace_writer *tw; /* the `trace` log, or NULL; constant */
    /* Why the `trace` log could not be opened (the heap runs without it; in the stats), ""
     * otherwise; constant. */
    char trace_error[512];
    pthread_mutex_t arena_lock; /* see narenas */
    /* Under oom_lock (a leaf lock): the callbacks, OOM and pressure. */
    pthread_mutex_t oom_lock;
    cuma_cb_list oom, pressure;
    /* Under oom_lock: runs of a copy of either list in progress (cuma_cb_run_begin to _end), and
     * the condition a removal waits on for them to end (signalled when cb_runs falls to 0). */
    unsigned cb_runs;
    pthread_cond_t cb_done;
    /* Held by the thread running the OOM callbacks (one at a time a heap); taken with no arena
     * lock held, or tried with one (heap.c run_oom_callbacks). */
    pthread_mutex_t oom_run;
    /* The other heaps on the device (peers.h; src/coord's ledger fills it in), ops NULL without
     * them; constant. ledger_error: why a ledger the heap was not told to use could not be
     * joined (stats), "" otherwise; constant. */
    cuma_peers peers;
    char ledger_error[160];
    uint64_t stats_due;     /* the first arena's release thread only: next publication of figures */
    uint64_t watermark_due; /* the first arena's release thread only: next look at free memory */
    /* Set once in a forked child (fork.c) when the heap's memory is the parent's (its backend
     * lacks CUMA_CAP_FORK_PRIVATE): every call but destroy is refused. */
    _Atomic bool inherited;
    /* When the oom_dump file was last written (monotonic ns; 0 = never); a writer claims it
     * with a compare-and-swap, so at most one dump in 10 s. */
    _Atomic uint64_t oom_dump_at;
    /* Compaction (compact.c): the mover cuma_set_mover registered (under oom_lock), and
     * compact_run, held by the thread compacting the heap (one at a time; taken with no arena
     * lock held, or tried with one); the compaction figures of cuma_stats. */
    void (*mover)(void);
    void *mover_user;
    pthread_mutex_t compact_run;
    _Atomic uint64_t compactions, compact_moved, compact_freed;
    /* Managed fallbacks, under managed_lock (a leaf lock): address -> size, the bytes of those
     * live and how many were ever made. The heap's, not an arena's: any arena's thread may make
     * or free one, and cuma_heap_snapshot adds them once, after the arenas. */
    pthread_mutex_t managed_lock;
    cuma_map managed;
    uint64_t managed_bytes, managed_fallbacks;
    /* Fixed-size pools (pool.c). pool_lock (a leaf lock, never held with a pool's own lock
     * taken after it except by fork.c) guards the list; the figures are atomic (a pool's calls
     * change pool_in_use under the pool's lock alone) and are the sums over the pools on the
     * list: pools, their carves' bytes, their blocks, their blocks out. */
    pthread_mutex_t pool_lock;
    struct cuma_pool *pool_list;
    _Atomic uint64_t pool_count, pool_bytes, pool_blocks, pool_in_use;
    /* The peaks of the whole heap (requested, allocated, reserved); raised lock-free, read on
     * every allocation, written rarely: a cache line of their own. */
    char pad0[64];
    _Atomic uint64_t peak_req, peak_alloc, peak_res;
    char pad1[64];
    /* Under fork.c's fork_lock: the list of live heaps whose locks a fork takes. */
    struct cuma_heap *fork_next, *fork_prev;
};

/* One published figure (CUMA_PUB_*) summed over the arenas of heap h, lock-free: requested and
 * allocated bytes outside the thread caches, idle bytes. */
static inline int64_t cuma_heap_total(const cuma_heap *h, int what) {
    unsigned n = atomic_load_explicit(&h->narenas, memory_order_acquire);
    int64_t t = 0;
    for (unsigned i = 0; i < n; i++)
        t += atomic_load_explicit(&(i ? h->arenas[i] : &h->first)->pub[what], memory_order_relaxed);
    return t;
}

/* Publishes the arena's requested and allocated bytes (its lock held). */
static inline void cuma_arena_publish(cuma_arena *a) {
    atomic_store_explicit(&a->pub[CUMA_PUB_REQUESTED], (int64_t)a->c.requested,
                          memory_order_relaxed);
    atomic_store_explicit(&a->pub[CUMA_PUB_ALLOCATED], (int64_t)a->c.allocated,
                          memory_order_relaxed);
}

/* Reserved bytes of the whole heap (every arena, read through any): what the limit bounds. */
static inline uint64_t cuma_arena_reserved_all(const cuma_arena *a) {
    return cuma_phys_reserved_all(&a->phys);
}

/* The physical layer of one arena: bytes held from the device, idle in the cache. */
static inline uint64_t cuma_arena_reserved(const cuma_arena *a) {
    return cuma_phys_reserved(&a->phys);
}
static inline uint64_t cuma_arena_cached(const cuma_arena *a) {
    return cuma_phys_cached(&a->phys);
}
static inline uint64_t cuma_arena_oldest_idle(const cuma_arena *a) {
    return a->phys.ops->oldest_idle(a);
}
/* Gives back idle memory: older than delay_ns (< 0: none by age) while more than age_keep_bytes
 * idle, then the oldest while more than max_cached_bytes idle. */
void cuma_arena_release(cuma_arena *a, uint64_t now, int64_t delay_ns, uint64_t max_cached_bytes,
                        uint64_t age_keep_bytes, bool wait);

/* The heap's clock: the backend's, or with sim_clock:manual (any backend) the time that
 * cuma_sim_set_time last set, so a replay drives the release policy with trace time. */
static inline uint64_t cuma_arena_now(cuma_arena *a) {
    return a->heap->set.sim_clock_manual
               ? atomic_load_explicit(&a->manual_now, memory_order_relaxed)
               : a->be->ops->now_ns(a->be);
}

/* Gives a block back to the policy and its pages to the cache with the fence of its free;
 * `counted`: it leaves the live counters (arena lock held). */
void cuma_arena_release_block(cuma_arena *a, cuma_block *b, uint16_t fstream, uint64_t fseq,
                              uint64_t t, bool counted);

/* Compaction (compact.c): the out-of-memory ladder's rung. With a mover registered and the
 * heap's stranded share over fragmentation_threshold, moves blocks (a's lock held on entry and
 * exit, dropped meanwhile); whether anything moved. Never from inside a mover. */
bool cuma_arena_compact_rung(cuma_arena *a);

/* Takes back a block a thread cache held (arena lock held). */
void cuma_arena_give_cached(cuma_arena *a, cuma_block *b, uint64_t since);

/* Flushes every thread cache of the arena (its lock held). */
void cuma_arena_flush_tcaches(cuma_arena *a);

/* Arenas (arena.c). The arena the calling thread allocates from: the first one until its
 * slow paths kept colliding with other threads'. */
cuma_arena *cuma_arena_mine_slow(cuma_heap *h);
static inline cuma_arena *cuma_arena_mine(cuma_heap *h) {
    return atomic_load_explicit(&h->narenas, memory_order_acquire) > 1 ? cuma_arena_mine_slow(h)
                                                                       : &h->first;
}
/* The arena whose virtual range holds addr (the first arena when none does). */
cuma_arena *cuma_arena_of_slow(cuma_heap *h, uint64_t addr);
static inline cuma_arena *cuma_arena_of(cuma_heap *h, uint64_t addr) {
    return addr - h->first.base < h->first.va_size ? &h->first : cuma_arena_of_slow(h, addr);
}
/* Locks arena a of heap h; a collision counts towards moving the thread to another arena. */
void cuma_arena_lock(cuma_heap *h, cuma_arena *a);
/* Makes one more arena; no lock held. */
cuma_status cuma_arena_add(cuma_heap *h, cuma_arena **out);
/* The calling thread allocates from arena `index` from now on, making arenas up to it if
 * needed (tests: arenas without waiting for collisions). */
cuma_status cuma_arena_use(cuma_heap *h, unsigned index);
/* Builds an arena of its heap (a->heap and a->be set; heap_life.c); undoes it. */
cuma_status cuma_arena_build(cuma_arena *a);
void cuma_arena_teardown(cuma_arena *a);

/* Arena helpers (its lock held) shared by heap.c, heap_life.c, release.c and heap_api.c. Deferred
 * frees whose fences completed go back (`wait`: block on the fences where the backend can). */
void cuma_arena_process_deferred(cuma_arena *a, bool wait);
/* Merges free blocks whose fences completed since their free (segments that become whole go
 * back to the segment list). */
void cuma_arena_coalesce(cuma_arena *a, bool wait);
/* Gives back all idle memory but keep_bytes, the oldest first: thread caches, deferred frees
 * and merges whose fences complete (waiting where the device can), the cache. cuma_trim and
 * the out-of-memory ladder. */
void cuma_arena_release_idle(cuma_arena *a, uint64_t keep_bytes);
/* The same for every arena of heap h in turn, one lock at a time (no lock held on entry): the
 * first keeps keep_bytes, the others nothing. count_trim: a trim in the stats (cuma_trim). */
void cuma_heap_release_all(cuma_heap *h, uint64_t keep_bytes, bool count_trim);
/* What the release thread's next sleep depends on (heap clock). */
typedef struct cuma_sleep_in {
    uint64_t now;
    uint64_t age_due;  /* when the release policy next acts by age; UINT64_MAX: nothing due */
    int64_t tc_age_ns; /* the age of the thread caches' blocks that go back; INT64_MAX: none */
    bool ledger;       /* the heap answers other processes' requests (every few ms) */
    bool watermark;    /* the heap watches the device's free memory (every 10 ms) */
} cuma_sleep_in;
/* The release thread's next sleep in ns (at least 1 ms), and when its release policy runs next:
 * *policy_at (UINT64_MAX: no plan yet) is kept across the short looks of the ledger and the
 * watermark and brought forward when something is due earlier (release.c). */
uint64_t cuma_release_sleep(const cuma_sleep_in *in, uint64_t *policy_at);
/* The release thread's body (release.c); started by cuma_arena_build. */
void *cuma_arena_release_thread(void *arg);

/* fork.c: a created heap joins the list whose locks are held across fork(); a heap being
 * destroyed leaves it first (no lock held). */
void cuma_fork_track(cuma_heap *h);
/* (Re)initialises the release thread's condition variable (heap_life.c): at creation, and in a
 * forked child, where the parent's waiter will never leave it. */
void cuma_arena_init_wake(cuma_arena *a);
/* The error of a call on a heap that came through fork with its parent's memory. */
cuma_status cuma_heap_inherited(cuma_heap *h, const char *call);
void cuma_fork_untrack(cuma_heap *h);
/* Calls fn on every live heap, under fork.c's list lock (fn may take arena locks, not create or
 * destroy a heap). */
void cuma_heaps_each(void (*fn)(cuma_heap *h, void *arg), void *arg);

/* thread_streams.c: the calling thread used its per-thread stream: retire it in every heap when
 * the thread exits. */
void cuma_thread_streams_arm(void);
/* The index of `stream` in arena a's table (cuma_streams_index), arming the exit hook for a
 * thread's per-thread stream. Under the arena lock. */
static inline int cuma_arena_stream_index(cuma_arena *a, cuma_stream stream) {
    if (__builtin_expect(stream && stream == a->streams.per_thread, 0)) cuma_thread_streams_arm();
    return cuma_streams_index(&a->streams, stream);
}

/* The whole heap's figures (stats.c): every arena's in turn, one lock at a time (none held on
 * entry); without the ledger's and the driver's (cuma_get_stats adds those). */
void cuma_heap_snapshot(cuma_heap *h, cuma_stats *s);

/* One arena's memory as the figures a user reads count it (its lock held): reserved, cached and
 * mapped bytes, where cached holds the idle pages and the pages only blocks freed into thread
 * caches hold (cuma_tcache_idle_bytes, at most the mapped ones), which mapped then leaves out, so
 * that reserved = mapped + cached. Publishes the thread caches' share (pub[CUMA_PUB_TCACHED]).
 * stats.c and snapshot.c both count with it. */
void cuma_arena_memory(cuma_arena *a, uint64_t *reserved, uint64_t *cached, uint64_t *mapped);

/* The heap's idle bytes for the ledger: every arena's idle pages and thread-cached blocks as last
 * published (lock-free). */
static inline uint64_t cuma_heap_idle_total(const cuma_heap *h) {
    int64_t t = cuma_heap_total(h, CUMA_PUB_CACHED) + cuma_heap_total(h, CUMA_PUB_TCACHED);
    return t > 0 ? (uint64_t)t : 0;
}

/* The heap's requested bytes for the ledger, the thread caches' shares included as last counted
 * (lock-free). */
static inline uint64_t cuma_heap_requested_total(const cuma_heap *h) {
    int64_t t = cuma_heap_total(h, CUMA_PUB_REQUESTED) + cuma_heap_total(h, CUMA_PUB_TREQ);
    return t > 0 ? (uint64_t)t : 0;
}

/* The moment `ns` from now on `clock`, for the timed waits of pthreads (release.c). */
struct timespec cuma_deadline(clockid_t clock, uint64_t ns);

/* The oom_dump setting (snapshot.c): after an allocation of `size` bytes failed for good (no
 * lock held; the thread's error message is the failure's, and stays so), writes the heap's
 * stats and snapshot to the file, unless one was written in the last 10 s. */
void cuma_heap_oom_dump(cuma_heap *h, size_t size);

/* Arena helpers (its lock held) shared by heap.c and heap_api.c: the effective limit from the
 * heap's settings (arena_lock held too), the release policy, the arena's invariants. */
void cuma_arena_refresh_limit(cuma_arena *a);
void cuma_arena_release_policy(cuma_arena *a, uint64_t now);
cuma_status cuma_arena_check(cuma_arena *a);

#endif
