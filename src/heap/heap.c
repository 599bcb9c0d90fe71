// SPDX-License-Identifier: Apache-2.0
/* Allocation, free and the out-of-memory ladder (the life cycle is heap_life.c, the release
 * policy release.c). */
#include "heap/heap.h"
#include "trace/stack_log.h"
#include "trace/writer.h"
#include "util/error.h"
#include "util/marks.h"
#include "heap/tcache_fast.h"

#include <assert.h>
#include <errno.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

static uint64_t now(cuma_arena *a) {
    return cuma_arena_now(a);
}

/* Raises a peak of the whole heap to `v` (lock-free: arenas and fast paths race here). */
static void raise_peak(_Atomic uint64_t *peak, uint64_t v) {
    uint64_t cur = atomic_load_explicit(peak, memory_order_relaxed);
    while (v > cur && !atomic_compare_exchange_weak_explicit(peak, &cur, v, memory_order_relaxed,
                                                             memory_order_relaxed)) {
    }
}

static void account_alloc(cuma_arena *a, uint64_t req, uint64_t size, cuma_tcache *tc) {
    cuma_counters *c = &a->c;
    cuma_heap *h = a->heap;
    c->requested += req;
    c->allocated += size;
    c->active++;
    c->allocs++;
    if (tc) {
        /* The calling thread's cache share (what its fast paths handed out minus what they
         * took back) joins the arena's counters, so that what arenas publish is every thread's
         * total as of its last slow call. Published alone, a block freed into a cache would
         * still count, and other threads' peak checks would see more than was ever live. */
        int64_t share = atomic_load_explicit(&tc->requested, memory_order_relaxed);
        c->requested += (uint64_t)share;
        c->allocated += (uint64_t)atomic_load_explicit(&tc->allocated, memory_order_relaxed);
        /* In REQUESTED from now on: the ledger's sum must not count it twice until the next
         * count (cuma_arena_memory). */
        atomic_store_explicit(&a->pub[CUMA_PUB_TREQ],
                              atomic_load_explicit(&a->pub[CUMA_PUB_TREQ], memory_order_relaxed) -
                                  share,
                              memory_order_relaxed);
        atomic_store_explicit(&tc->requested, 0, memory_order_relaxed);
        atomic_store_explicit(&tc->allocated, 0, memory_order_relaxed);
    }
    cuma_arena_publish(a);
    /* Other threads' shares since their last slow calls are not seen (documented in cuma.h). */
    int64_t all_req = cuma_heap_total(h, CUMA_PUB_REQUESTED);
    int64_t all_alloc = cuma_heap_total(h, CUMA_PUB_ALLOCATED);
    if (tc) tc->others_req = all_req - (int64_t)c->requested;
    if (all_req > 0) raise_peak(&h->peak_req, (uint64_t)all_req);
    if (all_alloc > 0) raise_peak(&h->peak_alloc, (uint64_t)all_alloc);
    raise_peak(&h->peak_res, cuma_arena_reserved_all(a));
}

/* Gives a block back to the policy and its pages to the cache. */
void cuma_arena_release_block(cuma_arena *a, cuma_block *b, uint16_t fstream, uint64_t fseq,
                              uint64_t t, bool counted) {
    if (counted) {
        /* The counters are the sums over the live blocks: this one is among them. */
        assert(a->c.requested >= b->req && a->c.allocated >= b->size && a->c.active > 0);
        a->c.requested -= b->req;
        a->c.allocated -= b->size;
        a->c.active--;
        cuma_arena_publish(a);
    }
    bool was_empty = cuma_arena_cached(a) == 0;
    a->phys.ops->free(a, b, fstream, fseq, t);
    /* Wake the release thread only if it would otherwise sleep past this memory's due time:
     * a signal per free costs a context switch each. */
    if (was_empty && cuma_arena_cached(a) && a->thread_running && a->release_delay_ns >= 0 &&
        a->thread_wake_at > t + (uint64_t)a->release_delay_ns)
        pthread_cond_signal(&a->wake);
}

/* Releases deferred blocks whose record_stream fences completed. */
void cuma_arena_process_deferred(cuma_arena *a, bool wait) {
    cuma_block **pp = &a->deferred;
    uint64_t t = now(a);
    while (*pp) {
        cuma_block *b = *pp;
        if (cuma_fence_poll(&a->streams, b->fence_stream, b->fence_seq, wait)) {
            *pp = b->fnext;
            b->fnext = NULL;
            cuma_arena_release_block(a, b, 0, 0, t,
                                     true); /* its work is complete: the memory is clean */
        } else {
            pp = &b->fnext;
        }
    }
}

void cuma_arena_give_cached(cuma_arena *a, cuma_block *b, uint64_t since) {
    cuma_map_remove(&a->live, a->base + b->off);
    /* The thread caches' published share shrinks with it until the next count, so that the
     * ledger does not see it twice once its pages are idle. */
    int64_t tc = atomic_load_explicit(&a->pub[CUMA_PUB_TCACHED], memory_order_relaxed);
    atomic_store_explicit(&a->pub[CUMA_PUB_TCACHED],
                          tc > (int64_t)b->size ? tc - (int64_t)b->size : 0, memory_order_relaxed);
    /* Freed into the cache at some point before now: a fence taken now covers that free. */
    uint64_t seq = cuma_streams_note_free(&a->streams, b->stream), t = now(a);
    cuma_streams_freed(&a->streams, b->stream, t);
    /* Its pages have been idle since the push, not since now: memory a thread cache held past
     * its use ages from then, so the release delay counts from when the program freed it. */
    a->idle_since = since;
    cuma_arena_release_block(a, b, b->stream, seq, t, false);
    a->idle_since = UINT64_MAX;
}

void cuma_arena_flush_tcaches(cuma_arena *a) {
    if (a->tcaches) cuma_tcache_flush_all(a, UINT64_MAX, cuma_arena_give_cached);
}

/* One placement attempt: a block and the pages under it, or a status. */
static cuma_status try_alloc(cuma_arena *a, uint64_t req, uint64_t n, unsigned si, uint64_t t,
                             cuma_block **out) {
    cuma_block *b = a->pol->ops->alloc(a->pol, n, si);
    if (!b && a->streams.n > 1) {
        /* Free blocks of other streams may have become usable: ask the device. */
        for (unsigned i = 0; i < a->streams.n; i++)
            cuma_fence_poll(&a->streams, i, a->streams.slot[i].last, false);
        b = a->pol->ops->alloc(a->pol, n, si);
    }
    /* The layer backs it, or adds memory where the policy had no room. */
    cuma_status st = a->phys.ops->back(a, &b, req, n, si, t);
    if (st) return st;
    assert(b && !b->is_free && b->size >= n && n >= req);
    b->req = req;
    b->mapped_len = req;
    b->stream = (uint16_t)si;
    /* A record the policy hands out again keeps what its last block was: the streams that block's
     * record_stream added must not hold this one's free back. */
    b->extra[0] = b->extra[1] = CUMA_NO_STREAM;
    b->extra_all = 0;
    *out = b;
    return CUMA_OK;
}

/* The message says what was free but unusable: the stranded bytes of this arena's pages in use
 * (gaps between live blocks, none of them large enough), the question users of an allocator ask
 * first after an out-of-memory. a's lock held. */
static cuma_status fail_oom(cuma_arena *a, cuma_status st, size_t size) {
    uint64_t reserved, cached, mapped;
    cuma_arena_memory(a, &reserved, &cached, &mapped);
    int64_t tq, ta, tn;
    uint64_t tallocs, tfrees;
    cuma_tcache_sums(a, &tq, &ta, &tn, &tallocs, &tfrees);
    uint64_t live = a->c.requested + (uint64_t)tq;
    uint64_t stranded = mapped > live ? mapped - live : 0;
    return cuma_fail(st,
                     "out of memory: %zu bytes requested; %" PRIu64 " reserved (%" PRIu64
                     " cached) of a %" PRIu64 "-byte limit, %" PRIu64 " bytes live (%s); %" PRIu64
                     " bytes free but stranded in pages that live blocks keep mapped, in "
                     "gaps too small for this request",
                     size, cuma_arena_reserved_all(a), cuma_arena_cached(a), a->limit_bytes,
                     (uint64_t)cuma_heap_total(a->heap, CUMA_PUB_REQUESTED),
                     st == CUMA_ERR_LIMIT ? "limit reached" : "device full", stranded);
}

/* The idle memory of the heap's other arenas goes back too, so this arena can have it (a's lock
 * held on entry and exit, dropped meanwhile: an arena never waits for another's lock while
 * holding its own). */
static void release_other_arenas(cuma_arena *a) {
    cuma_heap *h = a->heap;
    unsigned n = atomic_load_explicit(&h->narenas, memory_order_acquire);
    if (n < 2) return;
    cuma_mutex_unlock(&a->lock);
    for (unsigned i = 0; i < n; i++) {
        cuma_arena *o = h->arenas[i];
        if (o == a) continue;
        cuma_mutex_lock(&o->lock, CUMA_RANK_ARENA);
        cuma_arena_release_idle(o, 0);
        cuma_mutex_unlock(&o->lock);
    }
    cuma_mutex_lock(&a->lock, CUMA_RANK_ARENA);
}

static bool is_oom(cuma_status st) {
    return st == CUMA_ERR_OOM || st == CUMA_ERR_LIMIT;
}

/* The heaps whose OOM callbacks this thread is running, innermost first (frames on the callers'
 * stacks): an allocation a callback makes on the same heap fails without calling them again. */
typedef struct oom_frame {
    const cuma_heap *heap;
    struct oom_frame *up;
} oom_frame;
static __thread oom_frame *oom_frames;

static bool in_callbacks_of(const cuma_heap *h) {
    for (const oom_frame *f = oom_frames; f; f = f->up)
        if (f->heap == h) return true;
    return false;
}

/* Another try once memory may have been freed (by a callback, or another thread's callbacks):
 * what sits idle in thread caches and in the other arenas goes back first. */
static cuma_status retry_after_frees(cuma_arena *a, size_t size, uint64_t n, unsigned si,
                                     cuma_block **out) {
    cuma_arena_release_idle(a, 0);
    release_other_arenas(a);
    return try_alloc(a, size, n, si, now(a), out);
}

/* How long a thread that runs out waits for another thread's run of the callbacks before it
 * fails as if they had freed nothing: the wait must end even when the running callback needs
 * something the waiting thread holds (Python's GIL, taken by a C extension that allocates). */
#define OOM_WAIT_NS 1000000000ull

/* oom_run, waited for at most OOM_WAIT_NS; whether it is now held. */
static bool wait_oom_run(cuma_heap *h) {
    struct timespec ts = cuma_deadline(CLOCK_REALTIME, OOM_WAIT_NS); /* timedlock's clock */
    int r;
    while ((r = cuma_mutex_timedlock(&h->oom_run, &ts, CUMA_RANK_OOM_RUN)) == EINTR) {
    }
    return r == 0;
}

static cuma_status call_oom_callbacks(cuma_arena *a, cuma_status st, size_t size, uint64_t n,
                                      unsigned si, cuma_stream stream, cuma_block **out);

/* The callbacks' rung (arena lock held on entry and exit, dropped meanwhile). They run on one
 * thread at a time per heap, so that a callback needs no locking of its own and several threads
 * out of memory at once do not each shed the program's caches: a thread that finds another
 * running them waits (up to OOM_WAIT_NS), then first tries again with what they freed. A thread
 * already inside some heap's callbacks does not wait (two heaps' callbacks allocating on each
 * other's heap would wait for each other for good): it fails as before the callbacks ran. */
static cuma_status run_oom_callbacks(cuma_arena *a, cuma_status st, size_t size, uint64_t n,
                                     unsigned si, cuma_stream stream, cuma_block **out) {
    cuma_heap *h = a->heap;
    if (in_callbacks_of(h)) return st;
    cuma_mutex_lock(&h->oom_lock, CUMA_RANK_OOM);
    bool any = h->oom.n > 0;
    cuma_mutex_unlock(&h->oom_lock);
    if (!any) return st;
    cuma_mark_push(h->set.nvtx, CUMA_MARK_OOM_CALLBACKS);
    st = call_oom_callbacks(a, st, size, n, si, stream, out);
    cuma_mark_pop(h->set.nvtx);
    return st;
}

/* run_oom_callbacks once some are registered. */
static cuma_status call_oom_callbacks(cuma_arena *a, cuma_status st, size_t size, uint64_t n,
                                      unsigned si, cuma_stream stream, cuma_block **out) {
    cuma_heap *h = a->heap;
    if (cuma_mutex_trylock(&h->oom_run, CUMA_RANK_OOM_RUN) != 0) {
        if (oom_frames) return st;
        cuma_mutex_unlock(&a->lock);
        bool got = wait_oom_run(h);
        cuma_mutex_lock(&a->lock, CUMA_RANK_ARENA);
        st = got ? retry_after_frees(a, size, n, si, out) : try_alloc(a, size, n, si, now(a), out);
        if (!got || !is_oom(st)) {
            if (got) cuma_mutex_unlock(&h->oom_run);
            return st;
        }
    }
    cuma_cb_slot cbs[CUMA_MAX_OOM_CALLBACKS];
    cuma_cb_run run;
    int ncb = cuma_cb_run_begin(h, &h->oom, cbs, &run);
    oom_frame frame = {h, oom_frames};
    oom_frames = &frame;
    for (int i = 0; i < ncb; i++) {
        a->c.oom_calls++;
        cuma_mutex_unlock(&a->lock);
        int r = ((cuma_oom_fn)cbs[i].fn)(cbs[i].user, h, size, stream);
        cuma_mutex_lock(&a->lock, CUMA_RANK_ARENA);
        if (r != CUMA_OOM_RETRY) continue;
        st = retry_after_frees(a, size, n, si, out);
        if (!is_oom(st)) break;
    }
    oom_frames = frame.up;
    cuma_cb_run_end(h, &run);
    cuma_mutex_unlock(&h->oom_run);
    return st;
}

/* The last rung: managed memory, where configured; whether it served the request. */
static bool managed_take(cuma_arena *a, size_t size, uint64_t *managed_addr) {
    cuma_heap *h = a->heap;
    if (!h->set.managed_fallback || !(a->be->caps & CUMA_CAP_MANAGED)) return false;
    uint64_t addr;
    cuma_mark_push(h->set.nvtx, CUMA_MARK_OOM_MANAGED);
    cuma_status st = a->be->ops->managed_alloc(a->be, size, &addr);
    cuma_mark_pop(h->set.nvtx);
    if (st != CUMA_OK) return false;
    cuma_mutex_lock(&h->managed_lock, CUMA_RANK_MANAGED);
    bool put = cuma_map_put(&h->managed, addr, (void *)(uintptr_t)size);
    if (put) {
        h->managed_bytes += size;
        h->managed_fallbacks++;
    }
    cuma_mutex_unlock(&h->managed_lock);
    if (put)
        *managed_addr = addr;
    else
        a->be->ops->managed_free(a->be, addr, size);
    return put;
}

/* The ladder's rung of the other heaps on the device (peers.h): asks them for n bytes as whole
 * pages (or a segment) and waits (a's lock held on entry and exit, dropped meanwhile); true when
 * they now fit. */
static bool ask_peers(cuma_arena *a, uint64_t n) {
    cuma_heap *h = a->heap;
    uint64_t need = a->phys.ops->growth(a, n);
    /* The attempt that failed left the pages it made idle in the cache: they count as held. */
    cuma_arena_release_idle(a, 0);
    cuma_mutex_unlock(&a->lock);
    bool fits = h->peers.ops->ask(h->peers.ctx, h, need);
    cuma_mutex_lock(&a->lock, CUMA_RANK_ARENA);
    return fits;
}

/* The out-of-memory ladder: release the cache (this arena's, then the other arenas') and retry,
 * ask other heaps through the ledger, compact (with a mover registered), call the callbacks and
 * retry, fall back to managed memory, then fail. Called with the arena's
 * lock held; callbacks run without it. With nvtx:on the ladder is one range, each rung taken a
 * range inside it. */
static cuma_status ladder(cuma_arena *a, cuma_status st, size_t size, uint64_t n, unsigned si,
                          cuma_stream stream, cuma_block **out, uint64_t *managed_addr);
static cuma_status recover(cuma_arena *a, cuma_status st, size_t size, uint64_t n, unsigned si,
                           cuma_stream stream, cuma_block **out, uint64_t *managed_addr) {
    if (!is_oom(st)) return st;
    cuma_mark_push(a->heap->set.nvtx, CUMA_MARK_OOM);
    st = ladder(a, st, size, n, si, stream, out, managed_addr);
    cuma_mark_pop(a->heap->set.nvtx);
    return st;
}

static cuma_status ladder(cuma_arena *a, cuma_status st, size_t size, uint64_t n, unsigned si,
                          cuma_stream stream, cuma_block **out, uint64_t *managed_addr) {
    cuma_heap *h = a->heap;
    bool marks = h->set.nvtx;
    /* A growth refused part-way (a limit, a full device, the ledger) held its pages for a
     * moment: the peak says so, before the cache release below gives them back. */
    raise_peak(&h->peak_res, cuma_arena_reserved_all(a));
    a->c.retries++;
    a->c.trims++;
    cuma_mark_push(marks, CUMA_MARK_OOM_CACHE);
    cuma_arena_release_idle(a, 0);
    st = try_alloc(a, size, n, si, now(a), out);
    cuma_mark_pop(marks);
    if (!is_oom(st)) return st;
    if (atomic_load(&h->narenas) > 1) {
        cuma_mark_push(marks, CUMA_MARK_OOM_ARENAS);
        release_other_arenas(a);
        st = try_alloc(a, size, n, si, now(a), out);
        cuma_mark_pop(marks);
        if (!is_oom(st)) return st;
    }
    /* Other processes' heaps on the device may give memory back (not beyond the heap's own
     * limit: nobody can help there). */
    if (st == CUMA_ERR_OOM && h->peers.ops && h->set.pressure_timeout_ms > 0) {
        cuma_mark_push(marks, CUMA_MARK_OOM_LEDGER);
        if (ask_peers(a, n)) st = try_alloc(a, size, n, si, now(a), out);
        cuma_mark_pop(marks);
        if (!is_oom(st)) return st;
    }
    /* Still out of memory: counted whether or not callbacks are registered, so that an
     * autoscaler watching the count sees a job that registered none run out too (one failed
     * 1,841 allocations with a count of 0). */
    if (cuma_arena_compact_rung(a)) {
        st = try_alloc(a, size, n, si, now(a), out);
        if (!is_oom(st)) return st;
    }
    a->c.ooms++;
    st = run_oom_callbacks(a, st, size, n, si, stream, out);
    if (!is_oom(st)) return st;
    /* The ladder released the cache first: what is idle now are the pages the failed attempts made
     * before they ran out. A failed allocation leaves the device as it found it, so they go
     * back now, not a release delay later (another program, or managed memory, may need them). */
    cuma_arena_release_idle(a, 0);
    if (managed_take(a, size, managed_addr)) return CUMA_OK;
    return fail_oom(a, st, size);
}

/* Everything but a thread-cache hit; `tried`: cuma_alloc asked the cache already; `stack`: the
 * caller's own account of the call stack (cuma_alloc_with_stack), NULL for none. Out of line,
 * so that the fast path in cuma_alloc needs no stack frame. */
__attribute__((noinline)) static cuma_status alloc_slow(cuma_heap *h, size_t size,
                                                        cuma_stream stream, void **ptr, bool tried,
                                                        const char *stack) {
    if (!h || !ptr)
        return cuma_fail(CUMA_ERR_INVALID, "cuma_alloc: %s is NULL", h ? "ptr" : "heap");
    *ptr = NULL;
    if (atomic_load_explicit(&h->inherited, memory_order_relaxed))
        return cuma_heap_inherited(h, "cuma_alloc");
    cuma_arena *a = cuma_arena_mine(h);
    if (size == 0) return cuma_fail(CUMA_ERR_INVALID, "cuma_alloc: size 0");
    uint64_t n = !a->granule_round || size > (1ull << 47) ? a->pol->ops->round(size)
                 : size - 1 < a->fast_max
                     ? cuma_tc_round(size)
                     : (size + CUMA_GRANULE - 1) & ~(uint64_t)(CUMA_GRANULE - 1);
    /* A request the range (or the device) could never hold is out of memory, as PyTorch's
     * allocator says of one larger than the GPU: callers that recover from OOM (a smaller
     * batch) recover from it too, and managed memory may still serve it. One past what any
     * policy can round (2^47 bytes and more) is out of memory too, not a bad argument: the
     * CUDA runtime and the frameworks treat only out-of-memory as such (cudaMalloc(2^50) under
     * the shim must say what the driver says). */
    if (!n) return cuma_fail(CUMA_ERR_OOM, "cuma_alloc: size %zu is past any device", size);
    uint64_t room = a->phys.ops->max_request(a);
    cuma_tcache *tc = a->tc_on ? cuma_tcache_get(a, a->id) : NULL;
    if (tc && !tried && cuma_tcache_alloc(tc, size, n, stream, ptr)) return CUMA_OK;
    /* Before the lock: unwinding may take the dynamic loader's lock. A stack the caller gave
     * replaces the native one, which would only show its bindings (ctypes, the interpreter). */
    void *frames[CUMA_STACK_FRAMES];
    if (!h->set.trace_stacks || (stack && !*stack)) stack = NULL;
    int nframes = h->set.trace_stacks && !stack ? cuma_stack_capture(frames) : 0;
    cuma_arena_lock(h, a);
    cuma_status st;
    int si = cuma_arena_stream_index(a, stream);
    if (si < 0) {
        a->c.failed++;
        cuma_mutex_unlock(&a->lock);
        return cuma_fail(CUMA_ERR_UNSUPPORTED, "cuma_alloc: more than %d streams on one heap",
                         CUMA_MAX_STREAMS);
    }
    cuma_streams_tick(&a->streams, cuma_arena_now(a));
    /* This thread's batched frees first: their memory may serve this very request. */
    if (tc && tc->npending) cuma_tcache_drain(a, tc, cuma_arena_give_cached);
    if (a->deferred) cuma_arena_process_deferred(a, false);
    /* Read after the frees above: they stamp what they make idle with the clock, and a failed
     * attempt gives its pages back to the cache stamped t, which must be no older than those
     * (the cache is newest first). Read before them, a request whose mapping failed put pages
     * older than the pending frees' in front of them. */
    uint64_t t = now(a);
    cuma_block *b = NULL;
    uint64_t managed_addr = 0;
    if (size > room) {
        st = managed_take(a, size, &managed_addr)
                 ? CUMA_OK
                 : cuma_fail(CUMA_ERR_OOM,
                             "out of memory: %zu bytes requested, more than the %" PRIu64
                             "-byte %s can ever hold",
                             size, room,
                             a->phys.ops->caps & CUMA_PHYS_RANGE ? "virtual range" : "device");
    } else {
        st = try_alloc(a, size, n, (unsigned)si, t, &b);
        if (st) {
            st = recover(a, st, size, n, (unsigned)si, stream, &b, &managed_addr);
            /* The ladder made memory idle at later times, and may have dropped the lock. */
            t = now(a);
        }
    }
    if (st == CUMA_OK && b) {
        uint64_t addr = a->base + b->off;
        if (!cuma_map_put(&a->live, addr, b)) {
            cuma_arena_release_block(a, b, 0, 0, t, false);
            b = NULL;
            st = cuma_fail(CUMA_ERR_OOM, "no host memory for the pointer table");
        } else {
            atomic_store_explicit(&b->gen, atomic_load_explicit(&b->gen, memory_order_relaxed) + 1,
                                  memory_order_release);
            account_alloc(a, size, b->size, tc);
            if (tc) {
                cuma_tcache_note_stream(tc, stream, (unsigned)si);
                cuma_tcache_note_alloc(tc, b, addr);
            }
            *ptr = (void *)(uintptr_t)addr;
        }
    } else if (st == CUMA_OK) {
        *ptr = (void *)(uintptr_t)managed_addr;
        a->c.allocs++;
    }
    if (st) a->c.failed++;
    /* Under the heap lock: a free of this block, on any thread, is logged after it. */
    if (h->tw)
        cuma_trace_writer_event_stack(h->tw, st ? CUMA_TRACE_ALLOC_FAIL : CUMA_TRACE_ALLOC,
                                      (uint64_t)(uintptr_t)*ptr, size, (uint64_t)(uintptr_t)stream,
                                      frames, nframes, stack);
    cuma_arena_release_policy(a, t);
    cuma_mutex_unlock(&a->lock);
    /* Not for an allocation a callback makes (it fails at once, inside the ladder of another
     * that has not failed yet): it would take the file, and the 10 s, from the real failure. */
    if (is_oom(st) && h->set.oom_dump[0] && !oom_frames) cuma_heap_oom_dump(a->heap, size);
    return st;
}

static cuma_status bad_pointer(cuma_arena *a, const void *ptr, const char *what) {
    uint64_t addr = (uint64_t)(uintptr_t)ptr;
    if (addr >= a->base && addr < a->base + a->va_size)
        return cuma_fail(
            CUMA_ERR_BAD_POINTER,
            "%s: pointer %p is inside the heap but not the start of a live block (freed twice, or "
            "inside a block)",
            what, ptr);
    return cuma_fail(CUMA_ERR_BAD_POINTER, "%s: pointer %p was not allocated by this heap", what,
                     ptr);
}

cuma_status cuma_alloc(cuma_heap *h, size_t size, cuma_stream stream, void **ptr) {
    if (h && ptr) {
        cuma_arena *a = cuma_arena_mine(h);
        /* Sizes a thread cache can hold, with the default policy's rounding. */
        if (size - 1 < a->fast_max) {
            cuma_tcache *tc = cuma_tcache_get(a, a->id);
            uint64_t n = cuma_tc_round(size);
            if (tc && cuma_tcache_alloc(tc, size, n, stream, ptr)) return CUMA_OK;
            return alloc_slow(h, size, stream, ptr, tc != NULL, NULL);
        }
    }
    return alloc_slow(h, size, stream, ptr, false, NULL);
}

cuma_status cuma_alloc_with_stack(cuma_heap *h, size_t size, cuma_stream stream, void **ptr,
                                  const char *stack) {
    return alloc_slow(h, size, stream, ptr, false, stack);
}

/* Everything but a free into the thread cache (`r` says what the cache did with it). wide: the
 * program's last use is on a stream it does not say (cuma_free_device_wide). */
__attribute__((noinline)) static cuma_status free_slow(cuma_heap *h, void *ptr, cuma_stream stream,
                                                       cuma_tcache *tc, cuma_tc_result r,
                                                       bool wide) {
    if (!h) return cuma_fail(CUMA_ERR_INVALID, "cuma_free: heap is NULL");
    if (!ptr) return CUMA_OK;
    if (atomic_load_explicit(&h->inherited, memory_order_relaxed))
        return cuma_heap_inherited(h, "cuma_free");
    uint64_t addr = (uint64_t)(uintptr_t)ptr;
    cuma_arena *a = cuma_arena_of(h, addr);
    cuma_mutex_lock(&a->lock, CUMA_RANK_ARENA);
    if (tc && tc->npending) cuma_tcache_drain(a, tc, cuma_arena_give_cached);
    if (r == CUMA_TC_DRAIN) {
        cuma_arena_release_policy(a, now(a));
        cuma_mutex_unlock(&a->lock);
        return CUMA_OK;
    }
    cuma_block *b = cuma_map_get(&a->live, addr);
    uint64_t g = b ? atomic_load_explicit(&b->gen, memory_order_acquire) : 0;
    if (b && (!(g & 1) || !atomic_compare_exchange_strong(&b->gen, &g, g + 1))) {
        /* Even: it sits in a thread cache, so the program freed it already. A failed exchange:
         * another thread's free of the same pointer won. */
        cuma_status st = bad_pointer(a, ptr, "cuma_free");
        cuma_mutex_unlock(&a->lock);
        return st;
    }
    if (!b) {
        cuma_mutex_lock(&h->managed_lock, CUMA_RANK_MANAGED);
        void *msize = cuma_map_remove(&h->managed, addr);
        if (msize) h->managed_bytes -= (uint64_t)(uintptr_t)msize;
        cuma_mutex_unlock(&h->managed_lock);
        cuma_status st = CUMA_OK;
        if (msize) {
            if (h->tw)
                cuma_trace_writer_event(h->tw, CUMA_TRACE_FREE, addr, (uint64_t)(uintptr_t)msize,
                                        (uint64_t)(uintptr_t)stream);
            a->be->ops->managed_free(a->be, addr, (uint64_t)(uintptr_t)msize);
            a->c.frees++;
        } else {
            st = bad_pointer(a, ptr, "cuma_free");
        }
        cuma_mutex_unlock(&a->lock);
        return st;
    }
    int si = stream ? cuma_arena_stream_index(a, stream) : b->stream;
    /* The thread's next free on this stream can go fast (also after a retirement reset its map). */
    if (tc && stream && si >= 0) cuma_tcache_note_stream(tc, stream, (unsigned)si);
    if (si < 0) si = b->stream; /* table full: the allocation stream still orders this free */
    cuma_map_remove(&a->live, addr);
    a->c.frees++;
    /* NULL frees on the allocation's stream: the log names that stream, as a replay (or a
     * reader that takes 0 for the default stream) must see it. */
    if (h->tw)
        cuma_trace_writer_event(
            h->tw, CUMA_TRACE_FREE, addr, b->req,
            (uint64_t)(uintptr_t)(stream ? stream : cuma_streams_shown(&a->streams, (unsigned)si)));
    /* Looked up before the free's tag: the lookup may give the default stream the place of a
     * retired allocation stream whose work is done (si's), and the tag must then be the default
     * stream's, not the old stream's last. */
    int di = wide ? cuma_arena_stream_index(a, NULL) : -1;
    uint64_t t = now(a);
    uint64_t seq = cuma_streams_note_free(&a->streams, (unsigned)si);
    cuma_streams_freed(&a->streams, (unsigned)si, t);
    if (wide && di < 0) b->extra_all = 1; /* table full: every stream's work, then */
    if (wide || b->extra[0] != CUMA_NO_STREAM || b->extra_all) {
        /* record_stream: nobody may reuse it before the other streams' work is done too. A
         * device-wide free: nor before the default stream's work issued so far (on CUDA the
         * legacy stream, which waits for every blocking stream's), its own stream included. */
        uint16_t fs = (uint16_t)si;
        uint64_t fq = seq;
        if (di >= 0 && di != si)
            cuma_fence_join(&a->streams, &fs, &fq, (uint16_t)di,
                            cuma_streams_note_free(&a->streams, (unsigned)di));
        for (int k = 0; k < 2; k++)
            if (b->extra[k] != CUMA_NO_STREAM)
                cuma_fence_join(&a->streams, &fs, &fq, b->extra[k],
                                cuma_streams_note_free(&a->streams, b->extra[k]));
        if (b->extra_all) fs = CUMA_FENCE_MULTI, fq = ++a->streams.gseq;
        b->fence_stream = fs, b->fence_seq = fq;
        b->fnext = a->deferred;
        a->deferred = b;
        cuma_arena_process_deferred(a, false);
    } else {
        cuma_arena_release_block(a, b, (uint16_t)si, seq, t, true);
    }
    /* With several streams, memory freed on one is reusable by the others only once its fence
     * is known complete: ask every so often, so that it does not wait for a shortage. */
    if (a->streams.n > 1 && seq - a->last_fence_tick >= 256) {
        a->last_fence_tick = seq;
        /* Merging then too only where a merge can free memory (a segment made whole). */
        if (a->phys.ops->whole) {
            cuma_arena_coalesce(a, false);
        } else {
            for (unsigned i = 0; i < a->streams.n; i++)
                cuma_fence_poll(&a->streams, i, a->streams.slot[i].last, false);
        }
    }
    cuma_arena_release_policy(a, t);
    cuma_mutex_unlock(&a->lock);
    return CUMA_OK;
}

cuma_status cuma_free(cuma_heap *h, void *ptr, cuma_stream stream) {
    if (h && ptr) {
        cuma_arena *a = cuma_arena_of(h, (uint64_t)(uintptr_t)ptr);
        cuma_tcache *tc = a->tc_on ? cuma_tcache_get(a, a->id) : NULL;
        if (tc) {
            cuma_tc_result r = cuma_tcache_free(tc, (uint64_t)(uintptr_t)ptr, stream);
            if (r == CUMA_TC_DONE) return CUMA_OK;
            return free_slow(h, ptr, stream, tc, r, false);
        }
    }
    return free_slow(h, ptr, stream, NULL, CUMA_TC_MISS, false);
}

cuma_status cuma_free_device_wide(cuma_heap *h, void *ptr) {
    /* Past the thread cache: a block there is reusable at once by its stream. */
    return free_slow(h, ptr, NULL, NULL, CUMA_TC_MISS, true);
}

/* Whether addr is a live managed fallback of the heap. */
static bool is_managed(cuma_arena *a, uint64_t addr) {
    cuma_heap *h = a->heap;
    cuma_mutex_lock(&h->managed_lock, CUMA_RANK_MANAGED);
    bool m = cuma_map_get(&h->managed, addr) != NULL;
    cuma_mutex_unlock(&h->managed_lock);
    return m;
}

cuma_status cuma_record_stream(cuma_heap *h, void *ptr, cuma_stream stream) {
    if (!h || !ptr)
        return cuma_fail(CUMA_ERR_INVALID, "cuma_record_stream: %s is NULL", h ? "ptr" : "heap");
    if (atomic_load(&h->inherited)) return cuma_heap_inherited(h, "cuma_record_stream");
    cuma_arena *a = cuma_arena_of(h, (uint64_t)(uintptr_t)ptr);
    cuma_mutex_lock(&a->lock, CUMA_RANK_ARENA);
    cuma_status st = CUMA_OK;
    cuma_block *b = cuma_map_get(&a->live, (uint64_t)(uintptr_t)ptr);
    if (b && !(atomic_load(&b->gen) & 1)) b = NULL; /* in a thread cache: freed */
    if (!b) {
        st = is_managed(a, (uint64_t)(uintptr_t)ptr) ? CUMA_OK
                                                     : bad_pointer(a, ptr, "cuma_record_stream");
    } else {
        int si = cuma_arena_stream_index(a, stream);
        if (si < 0)
            b->extra_all = 1;
        else if (si != b->stream && b->extra[0] != si && b->extra[1] != si) {
            if (b->extra[0] == CUMA_NO_STREAM)
                b->extra[0] = (uint16_t)si;
            else if (b->extra[1] == CUMA_NO_STREAM)
                b->extra[1] = (uint16_t)si;
            else
                b->extra_all = 1;
        }
    }
    cuma_mutex_unlock(&a->lock);
    return st;
}

cuma_status cuma_stream_retire(cuma_heap *h, cuma_stream stream) {
    if (!h) return cuma_fail(CUMA_ERR_INVALID, "cuma_stream_retire: heap is NULL");
    if (!stream)
        return cuma_fail(CUMA_ERR_INVALID,
                         "cuma_stream_retire: stream is NULL (the default stream never dies)");
    if (atomic_load(&h->inherited)) return cuma_heap_inherited(h, "cuma_stream_retire");
    cuma_status st = CUMA_OK;
    unsigned n = atomic_load_explicit(&h->narenas, memory_order_acquire);
    for (unsigned i = 0; i < n; i++) {
        cuma_arena *a = h->arenas[i];
        cuma_mutex_lock(&a->lock, CUMA_RANK_ARENA);
        bool found;
        cuma_status r = cuma_streams_retire(&a->streams, stream, &found);
        if (found) atomic_fetch_add_explicit(&a->stream_gen, 1, memory_order_relaxed);
        cuma_mutex_unlock(&a->lock);
        if (r && !st) st = r;
    }
    return st;
}
