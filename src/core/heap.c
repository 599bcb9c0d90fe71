/* Heap life cycle, allocation, free and the out-of-memory ladder. */
#include "heap.h"
#include "error.h"
#include "tcache_fast.h"

#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static uint64_t round_pow2(uint64_t x) {
    uint64_t p = 1;
    while (p < x) p <<= 1;
    return p;
}

void cuma_heap_refresh_limit(cuma_heap *h) {
    uint64_t lim = h->be->capacity;
    if (h->set.limit != CUMA_UNLIMITED && h->set.limit < lim) lim = h->set.limit;
    if (h->set.memory_fraction > 0) {
        uint64_t f = (uint64_t)(h->set.memory_fraction * (double)h->be->capacity);
        if (f < lim) lim = f;
    }
    if (!h->set.growth && h->set.preallocate < lim) lim = h->set.preallocate;
    h->limit_bytes = lim;
    if (h->vmm) {
        h->pages.limit_pages = lim / h->pages.page_size;
        h->pages.limit_is_device = lim == h->be->capacity;
    } else {
        h->segs.limit_bytes = lim;
        h->segs.limit_is_device = lim == h->be->capacity;
    }
}

static void *release_thread(void *arg);

/* Everything an arena needs besides its settings, backend and first arena (set by the caller):
 * placement, virtual range and pages (or segments), tables, limits, the first arena's
 * preallocation, the lock and the release thread. On failure nothing is left to undo. */
cuma_status cuma_heap_build(cuma_heap *h) {
    cuma_status st;
    bool first = h->primary == h;
    h->vmm = (h->be->caps & CUMA_CAP_VMM) != 0;
    if (!h->vmm && !(h->be->caps & CUMA_CAP_SEGMENTS))
        return cuma_fail(CUMA_ERR_UNSUPPORTED, "backend %s offers neither pages nor segments",
                         h->be->name);
    bool buddy = !strcmp(h->set.policy, "buddy");
    if (!h->vmm && buddy)
        return cuma_fail(
            CUMA_ERR_CONFIG,
            "policy:buddy needs a virtual range; backend %s has segments only (use policy:tlsf)",
            h->be->name);
    st = cuma_streams_init(&h->streams, h->be);
    if (st) return st;
    const cuma_policy_ops *pol = buddy ? &cuma_buddy_ops : &cuma_tlsf_ops;
    st = pol->create(&h->pol, &h->streams, h->vmm ? CUMA_POLICY_KEEP_TOP_CLEAN : 0);
    if (st) goto fail_streams;
    if (h->vmm) {
        h->va_size = h->set.virtual_size ? h->set.virtual_size : 4 * h->be->capacity;
        h->va_size = round_pow2(h->va_size);
        if (h->va_size < h->be->page_size) h->va_size = h->be->page_size;
        /* Aligned to its size, the buddy's orders line up with real addresses and pages. */
        uint64_t align = h->va_size < (1ull << 30) ? h->va_size : (1ull << 30);
        st = h->be->ops->reserve(h->be, h->va_size, align, &h->base);
        if (st) goto fail_pol;
        st = cuma_pages_init(&h->pages, h->be, &h->streams, h->base, h->va_size);
        if (st) goto fail_reserve;
        h->pages.shared = &h->primary->pages.own_reserved;
        st = h->pol->ops->add_range(h->pol, 0, h->va_size);
        if (st) goto fail_pages;
    } else {
        cuma_segs_init(&h->segs, h->be, &h->streams, h->pol, h->set.segment_size);
    }
    cuma_map_init(&h->live);
    h->release_delay_ns = h->set.release_delay_ms < 0 ? -1 : h->set.release_delay_ms * 1000000;
    h->tc_on = h->set.tcache;
    h->tc_bytes = h->set.tcache_bytes;
    h->tc_max = h->set.tcache_max;
    h->tc_age_ns = h->set.tcache_age_ms < 0 ? INT64_MAX : h->set.tcache_age_ms * 1000000;
    h->tlsf = pol == &cuma_tlsf_ops;
    uint64_t room = h->vmm ? h->va_size : h->be->capacity;
    /* Size classes only where pages are mapped under requested bytes: in segment mode the
     * slack of a class would be memory. */
    h->fast_max = !h->tc_on || !h->tlsf || !h->vmm ? 0 : h->tc_max < room ? h->tc_max : room;
    h->max_cached_bytes = h->set.max_cached == CUMA_UNLIMITED ? UINT64_MAX : h->set.max_cached;
    cuma_heap_refresh_limit(h);
    if (h->set.preallocate && first) {
        st = h->vmm ? cuma_pages_prefill(
                          &h->pages, (h->set.preallocate + h->be->page_size - 1) / h->be->page_size,
                          cuma_heap_now(h))
                    : cuma_segs_prefill(&h->segs, h->set.preallocate, cuma_heap_now(h));
        if (st) goto fail_all;
    }
    /* Adaptive: threads whose slow paths collide spin a little before sleeping, which costs
     * less than a futex sleep and wake for critical sections this short. */
    pthread_mutexattr_t ma;
    pthread_mutexattr_init(&ma);
    pthread_mutexattr_settype(&ma, PTHREAD_MUTEX_ADAPTIVE_NP);
    pthread_mutex_init(&h->lock, &ma);
    pthread_mutexattr_destroy(&ma);
    pthread_condattr_t ca;
    pthread_condattr_init(&ca);
    pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
    pthread_cond_init(&h->wake, &ca);
    pthread_condattr_destroy(&ca);
    if (h->set.release_thread && !h->set.sim_clock_manual && h->release_delay_ns >= 0) {
        if (pthread_create(&h->thread, NULL, release_thread, h)) {
            st = cuma_fail(CUMA_ERR_BACKEND, "could not start the release thread");
            pthread_mutex_destroy(&h->lock);
            pthread_cond_destroy(&h->wake);
            goto fail_all;
        }
        h->thread_running = true;
    }
    atomic_store(&h->coarse_now, cuma_heap_now(h));
    h->id = cuma_tcache_register_heap(h);
    return CUMA_OK;
fail_all:
    cuma_map_destroy(&h->live);
    if (!h->vmm) cuma_segs_destroy(&h->segs);
fail_pages:
    if (h->vmm) cuma_pages_destroy(&h->pages);
fail_reserve:
    if (h->vmm) h->be->ops->unreserve(h->be, h->base, h->va_size);
fail_pol:
    h->pol->ops->destroy(h->pol);
fail_streams:
    cuma_streams_destroy(&h->streams);
    return st;
}

void cuma_heap_teardown(cuma_heap *h) {
    if (h->thread_running) {
        pthread_mutex_lock(&h->lock);
        h->stopping = true;
        pthread_cond_signal(&h->wake);
        pthread_mutex_unlock(&h->lock);
        pthread_join(h->thread, NULL);
    }
    cuma_tcache_unregister_heap(h);
    cuma_tcache_destroy_all(h);
    cuma_map_destroy(&h->live);
    if (h->vmm) {
        cuma_pages_destroy(&h->pages);
        h->be->ops->unreserve(h->be, h->base, h->va_size);
    } else {
        cuma_segs_destroy(&h->segs);
    }
    h->pol->ops->destroy(h->pol);
    cuma_streams_destroy(&h->streams);
    pthread_mutex_destroy(&h->lock);
    pthread_cond_destroy(&h->wake);
}

cuma_status cuma_heap_create(const cuma_config *cfg, cuma_heap **out) {
    cuma_clear_error();
    if (!out) return cuma_fail(CUMA_ERR_INVALID, "cuma_heap_create: out is NULL");
    *out = NULL;
    cuma_heap *h = calloc(1, sizeof *h);
    if (!h) return cuma_fail(CUMA_ERR_OOM, "no host memory for a heap");
    cuma_status st = cuma_settings_from_config(&h->set, cfg);
    if (st) goto fail_free;
    st = cuma_backend_create(&h->set, &h->be);
    if (st == CUMA_ERR_NO_DEVICE && !h->set.backend_named) {
        /* No backend named and no CUDA driver: the simulated device, said in the stats
         * ("backend_fallback"). A named backend gets exactly that backend or the error. */
        snprintf(h->set.backend, sizeof h->set.backend, "sim");
        h->backend_fallback = true;
        st = cuma_backend_create(&h->set, &h->be);
    }
    if (st) goto fail_free;
    /* Preallocated pages are the first arena's and never move: another arena could not
     * create a page within the limit they take. Such a heap keeps one arena. */
    if (h->set.preallocate) h->set.arenas = 1;
    if (h->set.arenas > 1 && (h->be->caps & CUMA_CAP_VMM)) {
        /* Arenas share the backend: its calls go through one mutex from the start. */
        cuma_backend *shared;
        st = cuma_backend_locked(h->be, &shared);
        if (st) goto fail_be;
        h->be = shared;
    }
    h->primary = h;
    h->owns_be = true;
    h->arenas[0] = h;
    atomic_store(&h->narenas, 1);
    cuma_map_init(&h->managed);
    pthread_mutex_init(&h->arena_lock, NULL);
    pthread_mutex_init(&h->oom_lock, NULL);
    pthread_mutex_init(&h->managed_lock, NULL);
    st = cuma_heap_build(h);
    if (st) {
        pthread_mutex_destroy(&h->arena_lock);
        pthread_mutex_destroy(&h->oom_lock);
        pthread_mutex_destroy(&h->managed_lock);
        cuma_map_destroy(&h->managed);
        goto fail_be;
    }
    *out = h;
    return CUMA_OK;
fail_be:
    h->be->ops->destroy(h->be);
fail_free:
    free(h);
    return st;
}

static bool free_managed(void *ctx, uint64_t key, void *val) {
    cuma_heap *h = ctx;
    h->be->ops->managed_free(h->be, key, (uint64_t)(uintptr_t)val);
    return true;
}

void cuma_heap_destroy(cuma_heap *h) {
    if (!h) return;
    /* The other arenas first: their pages count against the first arena's page counter. */
    for (unsigned i = atomic_load(&h->narenas); i-- > 1;) {
        cuma_heap_teardown(h->arenas[i]);
        free(h->arenas[i]);
    }
    cuma_map_each(&h->managed, free_managed, h);
    cuma_map_destroy(&h->managed);
    cuma_heap_teardown(h);
    h->be->ops->destroy(h->be);
    pthread_mutex_destroy(&h->arena_lock);
    pthread_mutex_destroy(&h->oom_lock);
    pthread_mutex_destroy(&h->managed_lock);
    free(h);
}

static uint64_t now(cuma_heap *h) {
    return cuma_heap_now(h);
}

/* Raises a peak of the whole heap to `v` (lock-free: arenas and fast paths race here). */
static void raise_peak(_Atomic uint64_t *peak, uint64_t v) {
    uint64_t p = atomic_load_explicit(peak, memory_order_relaxed);
    while (v > p && !atomic_compare_exchange_weak_explicit(peak, &p, v, memory_order_relaxed,
                                                           memory_order_relaxed)) {
    }
}

/* Publishes this arena's counters for the lock-free totals (arena lock held). */
static void publish(cuma_heap *h) {
    atomic_store_explicit(&h->pub_req, (int64_t)h->c.requested, memory_order_relaxed);
    atomic_store_explicit(&h->pub_alloc, (int64_t)h->c.allocated, memory_order_relaxed);
}

static void account_alloc(cuma_heap *h, uint64_t req, uint64_t size, cuma_tcache *tc) {
    cuma_counters *c = &h->c;
    cuma_heap *p = h->primary;
    c->requested += req;
    c->allocated += size;
    c->active++;
    c->allocs++;
    publish(h);
    /* The peaks count the calling thread's cache; other threads' caches move them only when
     * those threads allocate (documented in cuma.h). */
    int64_t mine = tc ? atomic_load_explicit(&tc->requested, memory_order_relaxed) : 0;
    int64_t mine_a = tc ? atomic_load_explicit(&tc->allocated, memory_order_relaxed) : 0;
    int64_t total = cuma_heap_total(p, false);
    if (tc) tc->others_req = total - (int64_t)c->requested;
    int64_t all_req = total + mine, all_alloc = cuma_heap_total(p, true) + mine_a;
    if (all_req > 0) raise_peak(&p->peak_req, (uint64_t)all_req);
    if (all_alloc > 0) raise_peak(&p->peak_alloc, (uint64_t)all_alloc);
    raise_peak(&p->peak_res, cuma_heap_reserved_all(h));
}

/* Gives a block back to the policy and its pages to the cache. */
static void release_block(cuma_heap *h, cuma_block *b, uint16_t fstream, uint64_t fseq, uint64_t t,
                          bool counted) {
    if (counted) {
        h->c.requested -= b->req;
        h->c.allocated -= b->size;
        h->c.active--;
        publish(h);
    }
    bool was_empty = cuma_heap_cached(h) == 0;
    if (h->vmm) cuma_pages_unref(&h->pages, b->off, b->mapped_len, t, fstream, fseq);
    cuma_block *m = h->pol->ops->free(h->pol, b, fstream, fseq);
    if (!h->vmm) cuma_segs_on_free(&h->segs, m, t);
    /* Wake the release thread only if it would otherwise sleep past this memory's due time:
     * a signal per free costs a context switch each. */
    if (was_empty && cuma_heap_cached(h) && h->thread_running && h->release_delay_ns >= 0 &&
        h->thread_wake_at > t + (uint64_t)h->release_delay_ns)
        pthread_cond_signal(&h->wake);
}

/* Releases deferred blocks whose record_stream fences completed. */
static void process_deferred(cuma_heap *h, bool wait) {
    cuma_block **pp = &h->deferred;
    uint64_t t = now(h);
    while (*pp) {
        cuma_block *b = *pp;
        if (cuma_fence_poll(&h->streams, b->fence_stream, b->fence_seq, wait)) {
            *pp = b->fnext;
            b->fnext = NULL;
            release_block(h, b, 0, 0, t, true); /* its work is complete: the memory is clean */
        } else {
            pp = &b->fnext;
        }
    }
}

void cuma_heap_give_cached(cuma_heap *h, cuma_block *b) {
    cuma_map_remove(&h->live, h->base + b->off);
    /* Freed into the cache at some point before now: a fence taken now covers that free. */
    uint64_t seq = cuma_streams_note_free(&h->streams, b->stream);
    release_block(h, b, b->stream, seq, now(h), false);
}

void cuma_heap_flush_tcaches(cuma_heap *h) {
    if (h->tcaches) cuma_tcache_flush_all(h, UINT64_MAX, cuma_heap_give_cached);
}

/* Blocks idle in thread caches longer than tcache_age_ms go back. Walking every cache is not
 * free, so it runs only when something is due: after a walk, the oldest block left (or any
 * block pushed later, stamped later) is due no earlier than tc_due. */
static void age_tcaches(cuma_heap *h, uint64_t t) {
    atomic_store_explicit(&h->coarse_now, t, memory_order_relaxed);
    if (!h->tcaches || h->tc_age_ns == INT64_MAX || t < h->tc_due) return;
    if (t >= (uint64_t)h->tc_age_ns)
        cuma_tcache_flush_all(h, t - (uint64_t)h->tc_age_ns + 1, cuma_heap_give_cached);
    uint64_t oldest = cuma_tcache_oldest(h);
    h->tc_due = (oldest < t ? oldest : t) + (uint64_t)h->tc_age_ns;
}

void cuma_heap_release(cuma_heap *h, uint64_t t, int64_t delay_ns, uint64_t max_cached_bytes,
                       uint64_t age_keep_bytes, bool wait) {
    if (h->vmm) {
        uint64_t ps = h->pages.page_size;
        cuma_pages_release(&h->pages, t, delay_ns,
                           max_cached_bytes == UINT64_MAX ? UINT64_MAX : max_cached_bytes / ps,
                           age_keep_bytes / ps, wait);
    } else {
        cuma_segs_release(&h->segs, t, delay_ns, max_cached_bytes, age_keep_bytes, wait);
    }
}

/* fragmentation_threshold: idle memory past its delay stays while it is at most this share of
 * the memory in use (mapped under live bytes). A cache of a few percent of a busy heap costs
 * little and saves the next step the churn of creating and mapping pages again; an idle heap
 * (nothing in use) keeps nothing. */
static uint64_t age_keep(const cuma_heap *h) {
    uint64_t in_use = cuma_heap_reserved(h) - cuma_heap_cached(h);
    return (uint64_t)(h->set.fragmentation_threshold * (double)in_use);
}

/* When the release policy will next act by age: UINT64_MAX when nothing is due. */
static uint64_t next_age_due(const cuma_heap *h) {
    uint64_t oldest = cuma_heap_oldest_idle(h);
    if (h->release_delay_ns < 0 || oldest == UINT64_MAX || cuma_heap_cached(h) <= age_keep(h))
        return UINT64_MAX;
    return oldest + (uint64_t)h->release_delay_ns;
}

static void on_whole_segment(void *ctx, cuma_block *whole) {
    cuma_heap *h = ctx;
    cuma_segs_on_free(&h->segs, whole, now(h));
}

/* Merges free blocks whose fences completed since they were freed; in segment mode that is
 * how a segment freed by several streams becomes whole again and can go back. */
static void coalesce(cuma_heap *h, bool wait) {
    if (h->streams.n <= 1) return;
    for (unsigned i = 0; i < h->streams.n; i++)
        cuma_fence_poll(&h->streams, i, h->streams.slot[i].last, wait);
    h->pol->ops->coalesce(h->pol, h->vmm ? NULL : on_whole_segment, h);
}

void cuma_heap_release_policy(cuma_heap *h, uint64_t t) {
    if (h->deferred) process_deferred(h, false);
    age_tcaches(h, t);
    /* max_cached is the heap's: this arena keeps what the others' caches leave of it. */
    uint64_t cap = h->max_cached_bytes;
    if (cap != UINT64_MAX) {
        uint64_t others = cuma_heap_total_cached(h->primary) - atomic_load(&h->pub_cached);
        cap = others >= cap ? 0 : cap - others;
    }
    if (t >= next_age_due(h) || cuma_heap_cached(h) > cap)
        cuma_heap_release(h, t, h->release_delay_ns, cap, age_keep(h), false);
    atomic_store_explicit(&h->pub_cached, cuma_heap_cached(h), memory_order_relaxed);
}

/* One placement attempt: a block and the pages under it, or a status. */
static cuma_status try_alloc(cuma_heap *h, uint64_t req, uint64_t n, unsigned si, uint64_t t,
                             cuma_block **out) {
    cuma_block *b = h->pol->ops->alloc(h->pol, n, si);
    if (!b && h->streams.n > 1) {
        /* Free blocks of other streams may have become usable: ask the device. */
        for (unsigned i = 0; i < h->streams.n; i++)
            cuma_fence_poll(&h->streams, i, h->streams.slot[i].last, false);
        b = h->pol->ops->alloc(h->pol, n, si);
    }
    if (!h->vmm) {
        if (!b) {
            cuma_status st = cuma_segs_grow(&h->segs, n);
            if (st) return st;
            b = h->pol->ops->alloc(h->pol, n, si);
            if (!b)
                return cuma_fail(CUMA_ERR_OOM, "a new segment could not hold %" PRIu64 " bytes", n);
        }
        cuma_segs_on_alloc(&h->segs, b);
    } else if (!b) {
        return cuma_fail(CUMA_ERR_OOM,
                         "no free block of %" PRIu64 " bytes in the %" PRIu64 "-byte virtual range",
                         n, h->va_size);
    } else {
        cuma_status st = cuma_pages_ref(&h->pages, b->off, req, t);
        if (st) {
            h->pol->ops->free(h->pol, b, 0, 0);
            return st;
        }
    }
    b->req = req;
    b->mapped_len = req;
    b->stream = (uint16_t)si;
    *out = b;
    return CUMA_OK;
}

static cuma_status fail_oom(cuma_heap *h, cuma_status st, size_t size) {
    return cuma_fail(st,
                     "out of memory: %zu bytes requested; %" PRIu64 " reserved (%" PRIu64
                     " cached) of a %" PRIu64 "-byte limit, %" PRIu64 " bytes live (%s)",
                     size, cuma_heap_reserved_all(h), cuma_heap_cached(h), h->limit_bytes,
                     (uint64_t)cuma_heap_total(h->primary, false),
                     st == CUMA_ERR_LIMIT ? "limit reached" : "device full");
}

/* The out-of-memory ladder: release the cache and retry, call the callbacks and retry, fall
 * back to managed memory, then fail. Called with the lock held; callbacks run without it. */
/* Everything idle goes back: thread caches, deferred frees whose work is done, the page cache
 * (arena lock held). */
static void release_all(cuma_heap *h) {
    cuma_heap_flush_tcaches(h);
    process_deferred(h, true);
    coalesce(h, true);
    cuma_heap_release(h, now(h), 0, 0, 0, true);
}

/* The idle memory of the heap's other arenas goes back too, so this arena can have it (h's lock
 * held on entry and exit, dropped meanwhile: an arena never waits for another's lock while
 * holding its own). */
static void release_other_arenas(cuma_heap *h) {
    cuma_heap *p = h->primary;
    unsigned n = atomic_load_explicit(&p->narenas, memory_order_acquire);
    if (n < 2) return;
    pthread_mutex_unlock(&h->lock);
    for (unsigned i = 0; i < n; i++) {
        cuma_heap *o = p->arenas[i];
        if (o == h) continue;
        pthread_mutex_lock(&o->lock);
        release_all(o);
        pthread_mutex_unlock(&o->lock);
    }
    pthread_mutex_lock(&h->lock);
}

static bool is_oom(cuma_status st) {
    return st == CUMA_ERR_OOM || st == CUMA_ERR_LIMIT;
}

/* The out-of-memory ladder: release the cache (this arena's, then the other arenas') and retry,
 * call the callbacks and retry, fall back to managed memory, then fail. Called with the arena's
 * lock held; callbacks run without it. */
static cuma_status recover(cuma_heap *h, cuma_status st, size_t size, uint64_t n, unsigned si,
                           cuma_stream stream, cuma_block **out, uint64_t *managed_addr) {
    if (!is_oom(st)) return st;
    cuma_heap *p = h->primary;
    h->c.retries++;
    h->c.trims++;
    release_all(h);
    st = try_alloc(h, size, n, si, now(h), out);
    if (!is_oom(st)) return st;
    if (atomic_load(&p->narenas) > 1) {
        release_other_arenas(h);
        st = try_alloc(h, size, n, si, now(h), out);
        if (!is_oom(st)) return st;
    }
    pthread_mutex_lock(&p->oom_lock);
    cuma_oom_slot cbs[CUMA_MAX_OOM_CALLBACKS];
    int ncb = atomic_load(&p->in_oom) ? 0 : p->noom;
    memcpy(cbs, p->oom, sizeof cbs);
    pthread_mutex_unlock(&p->oom_lock);
    if (ncb) {
        h->c.ooms++;
        for (int i = 0; i < ncb; i++) {
            atomic_fetch_add(&p->in_oom, 1);
            h->c.oom_calls++;
            pthread_mutex_unlock(&h->lock);
            int r = cbs[i].fn(cbs[i].user, p, size, stream);
            pthread_mutex_lock(&h->lock);
            atomic_fetch_sub(&p->in_oom, 1);
            if (r != CUMA_OOM_RETRY) continue;
            release_all(h); /* what the callback freed may sit in its thread's cache */
            release_other_arenas(h);
            st = try_alloc(h, size, n, si, now(h), out);
            if (!is_oom(st)) return st;
        }
    }
    if (h->set.managed_fallback && (h->be->caps & CUMA_CAP_MANAGED)) {
        uint64_t addr;
        if (h->be->ops->managed_alloc(h->be, size, &addr) == CUMA_OK) {
            pthread_mutex_lock(&p->managed_lock);
            bool put = cuma_map_put(&p->managed, addr, (void *)(uintptr_t)size);
            if (put) {
                p->c.managed += size;
                p->c.managed_fallbacks++;
            }
            pthread_mutex_unlock(&p->managed_lock);
            if (put) {
                *managed_addr = addr;
                return CUMA_OK;
            }
            h->be->ops->managed_free(h->be, addr, size);
        }
    }
    return fail_oom(h, st, size);
}

/* Everything but a thread-cache hit; `tried`: cuma_alloc asked the cache already. Out of line,
 * so that the fast path in cuma_alloc needs no stack frame. */
__attribute__((noinline)) static cuma_status
alloc_slow(cuma_heap *heap, size_t size, cuma_stream stream, void **ptr, bool tried) {
    if (!heap || !ptr)
        return cuma_fail(CUMA_ERR_INVALID, "cuma_alloc: %s is NULL", heap ? "ptr" : "heap");
    *ptr = NULL;
    cuma_heap *h = cuma_arena_mine(heap);
    if (size == 0) return cuma_fail(CUMA_ERR_INVALID, "cuma_alloc: size 0");
    uint64_t n = !h->tlsf || size > (1ull << 47) ? h->pol->ops->round(size)
                 : size - 1 < h->fast_max
                     ? cuma_tc_round(size)
                     : (size + CUMA_GRANULE - 1) & ~(uint64_t)(CUMA_GRANULE - 1);
    uint64_t room = h->vmm ? h->va_size : h->be->capacity;
    if (!n || size > room)
        return cuma_fail(CUMA_ERR_INVALID,
                         "cuma_alloc: size %zu is larger than the %" PRIu64 "-byte %s", size, room,
                         h->vmm ? "virtual range" : "device");
    cuma_tcache *tc = h->tc_on ? cuma_tcache_get(h, h->id) : NULL;
    if (tc && !tried && cuma_tcache_alloc(tc, size, n, stream, ptr)) return CUMA_OK;
    cuma_arena_lock(heap, h);
    cuma_status st;
    int si = cuma_streams_index(&h->streams, stream);
    if (si < 0) {
        h->c.failed++;
        pthread_mutex_unlock(&h->lock);
        return cuma_fail(CUMA_ERR_UNSUPPORTED, "cuma_alloc: more than %d streams on one heap",
                         CUMA_MAX_STREAMS);
    }
    uint64_t t = now(h);
    /* This thread's batched frees first: their memory may serve this very request. */
    if (tc && tc->npending) cuma_tcache_drain(h, tc, cuma_heap_give_cached);
    if (h->deferred) process_deferred(h, false);
    cuma_block *b = NULL;
    uint64_t managed_addr = 0;
    st = try_alloc(h, size, n, (unsigned)si, t, &b);
    if (st) st = recover(h, st, size, n, (unsigned)si, stream, &b, &managed_addr);
    if (st == CUMA_OK && b) {
        uint64_t addr = h->base + b->off;
        if (!cuma_map_put(&h->live, addr, b)) {
            release_block(h, b, 0, 0, t, false);
            b = NULL;
            st = cuma_fail(CUMA_ERR_OOM, "no host memory for the pointer table");
        } else {
            atomic_store_explicit(&b->gen, atomic_load_explicit(&b->gen, memory_order_relaxed) + 1,
                                  memory_order_release);
            account_alloc(h, size, b->size, tc);
            if (tc) {
                cuma_tcache_note_stream(tc, stream, (unsigned)si);
                cuma_tcache_note_alloc(tc, b, addr);
            }
            *ptr = (void *)(uintptr_t)addr;
        }
    } else if (st == CUMA_OK) {
        *ptr = (void *)(uintptr_t)managed_addr;
        h->c.allocs++;
    }
    if (st) h->c.failed++;
    cuma_heap_release_policy(h, t);
    pthread_mutex_unlock(&h->lock);
    return st;
}

static cuma_status bad_pointer(cuma_heap *h, const void *ptr, const char *what) {
    uint64_t a = (uint64_t)(uintptr_t)ptr;
    if (a >= h->base && a < h->base + h->va_size)
        return cuma_fail(
            CUMA_ERR_BAD_POINTER,
            "%s: pointer %p is inside the heap but not the start of a live block (freed twice, or "
            "inside a block)",
            what, ptr);
    return cuma_fail(CUMA_ERR_BAD_POINTER, "%s: pointer %p was not allocated by this heap", what,
                     ptr);
}

cuma_status cuma_alloc(cuma_heap *heap, size_t size, cuma_stream stream, void **ptr) {
    if (heap && ptr) {
        cuma_heap *h = cuma_arena_mine(heap);
        /* Sizes a thread cache can hold, with the default policy's rounding. */
        if (size - 1 < h->fast_max) {
            cuma_tcache *tc = cuma_tcache_get(h, h->id);
            uint64_t n = cuma_tc_round(size);
            if (tc && cuma_tcache_alloc(tc, size, n, stream, ptr)) return CUMA_OK;
            return alloc_slow(heap, size, stream, ptr, tc != NULL);
        }
    }
    return alloc_slow(heap, size, stream, ptr, false);
}

/* Everything but a free into the thread cache (`r` says what the cache did with it). */
__attribute__((noinline)) static cuma_status
free_slow(cuma_heap *heap, void *ptr, cuma_stream stream, cuma_tcache *tc, cuma_tc_result r) {
    if (!heap) return cuma_fail(CUMA_ERR_INVALID, "cuma_free: heap is NULL");
    if (!ptr) return CUMA_OK;
    uint64_t a = (uint64_t)(uintptr_t)ptr;
    cuma_heap *h = cuma_arena_of(heap, a);
    pthread_mutex_lock(&h->lock);
    if (tc && tc->npending) cuma_tcache_drain(h, tc, cuma_heap_give_cached);
    if (r == CUMA_TC_DRAIN) {
        cuma_heap_release_policy(h, now(h));
        pthread_mutex_unlock(&h->lock);
        return CUMA_OK;
    }
    cuma_block *b = cuma_map_get(&h->live, a);
    uint64_t g = b ? atomic_load_explicit(&b->gen, memory_order_acquire) : 0;
    if (b && (!(g & 1) || !atomic_compare_exchange_strong(&b->gen, &g, g + 1))) {
        /* Even: it sits in a thread cache, so the program freed it already. A failed exchange:
         * another thread's free of the same pointer won. */
        cuma_status st = bad_pointer(h, ptr, "cuma_free");
        pthread_mutex_unlock(&h->lock);
        return st;
    }
    if (!b) {
        cuma_heap *p = h->primary;
        pthread_mutex_lock(&p->managed_lock);
        void *msize = cuma_map_remove(&p->managed, a);
        if (msize) p->c.managed -= (uint64_t)(uintptr_t)msize;
        pthread_mutex_unlock(&p->managed_lock);
        cuma_status st = CUMA_OK;
        if (msize) {
            h->be->ops->managed_free(h->be, a, (uint64_t)(uintptr_t)msize);
            h->c.frees++;
        } else {
            st = bad_pointer(h, ptr, "cuma_free");
        }
        pthread_mutex_unlock(&h->lock);
        return st;
    }
    int si = stream ? cuma_streams_index(&h->streams, stream) : b->stream;
    if (si < 0) si = b->stream; /* table full: the allocation stream still orders this free */
    cuma_map_remove(&h->live, a);
    h->c.frees++;
    uint64_t t = now(h);
    uint64_t seq = cuma_streams_note_free(&h->streams, (unsigned)si);
    if (b->extra[0] != CUMA_NO_STREAM || b->extra_all) {
        /* record_stream: nobody may reuse it before the other streams' work is done too. */
        uint16_t fs = (uint16_t)si;
        uint64_t fq = seq;
        for (int k = 0; k < 2; k++)
            if (b->extra[k] != CUMA_NO_STREAM)
                cuma_fence_join(&h->streams, &fs, &fq, b->extra[k],
                                cuma_streams_note_free(&h->streams, b->extra[k]));
        if (b->extra_all) fs = CUMA_FENCE_MULTI, fq = ++h->streams.gseq;
        b->fence_stream = fs, b->fence_seq = fq;
        b->fnext = h->deferred;
        h->deferred = b;
        process_deferred(h, false);
    } else {
        release_block(h, b, (uint16_t)si, seq, t, true);
    }
    /* With several streams, memory freed on one is reusable by the others only once its fence
     * is known complete: ask every so often, so that it does not wait for a shortage. */
    if (h->streams.n > 1 && seq - h->last_fence_tick >= 256) {
        h->last_fence_tick = seq;
        if (h->vmm) {
            for (unsigned i = 0; i < h->streams.n; i++)
                cuma_fence_poll(&h->streams, i, h->streams.slot[i].last, false);
        } else {
            coalesce(h, false);
        }
    }
    cuma_heap_release_policy(h, t);
    pthread_mutex_unlock(&h->lock);
    return CUMA_OK;
}

cuma_status cuma_free(cuma_heap *heap, void *ptr, cuma_stream stream) {
    if (heap && ptr) {
        cuma_heap *h = cuma_arena_of(heap, (uint64_t)(uintptr_t)ptr);
        cuma_tcache *tc = h->tc_on ? cuma_tcache_get(h, h->id) : NULL;
        if (tc) {
            cuma_tc_result r = cuma_tcache_free(tc, (uint64_t)(uintptr_t)ptr, stream);
            if (r == CUMA_TC_DONE) return CUMA_OK;
            return free_slow(heap, ptr, stream, tc, r);
        }
    }
    return free_slow(heap, ptr, stream, NULL, CUMA_TC_MISS);
}

/* Whether addr is a live managed fallback of the heap. */
static bool is_managed(cuma_heap *h, uint64_t addr) {
    cuma_heap *p = h->primary;
    pthread_mutex_lock(&p->managed_lock);
    bool m = cuma_map_get(&p->managed, addr) != NULL;
    pthread_mutex_unlock(&p->managed_lock);
    return m;
}

cuma_status cuma_record_stream(cuma_heap *heap, void *ptr, cuma_stream stream) {
    if (!heap || !ptr)
        return cuma_fail(CUMA_ERR_INVALID, "cuma_record_stream: %s is NULL", heap ? "ptr" : "heap");
    cuma_heap *h = cuma_arena_of(heap, (uint64_t)(uintptr_t)ptr);
    pthread_mutex_lock(&h->lock);
    cuma_status st = CUMA_OK;
    cuma_block *b = cuma_map_get(&h->live, (uint64_t)(uintptr_t)ptr);
    if (b && !(atomic_load(&b->gen) & 1)) b = NULL; /* in a thread cache: freed */
    if (!b) {
        st = is_managed(h, (uint64_t)(uintptr_t)ptr) ? CUMA_OK
                                                     : bad_pointer(h, ptr, "cuma_record_stream");
    } else {
        int si = cuma_streams_index(&h->streams, stream);
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
    pthread_mutex_unlock(&h->lock);
    return st;
}

cuma_status cuma_trim(cuma_heap *h, size_t keep_bytes) {
    if (!h) return cuma_fail(CUMA_ERR_INVALID, "cuma_trim: heap is NULL");
    unsigned n = atomic_load_explicit(&h->narenas, memory_order_acquire);
    for (unsigned i = 0; i < n; i++) {
        cuma_heap *a = h->arenas[i];
        pthread_mutex_lock(&a->lock);
        if (!i) a->c.trims++;
        cuma_heap_flush_tcaches(a);
        process_deferred(a, true);
        coalesce(a, true);
        /* keep_bytes is the heap's: the first arena keeps them, the others keep nothing. */
        cuma_heap_release(a, now(a), -1, i ? 0 : keep_bytes, 0, true);
        pthread_mutex_unlock(&a->lock);
    }
    return CUMA_OK;
}

cuma_status cuma_poll(cuma_heap *h) {
    if (!h) return cuma_fail(CUMA_ERR_INVALID, "cuma_poll: heap is NULL");
    unsigned n = atomic_load_explicit(&h->narenas, memory_order_acquire);
    for (unsigned i = 0; i < n; i++) {
        cuma_heap *a = h->arenas[i];
        pthread_mutex_lock(&a->lock);
        cuma_heap_release_policy(a, now(a));
        pthread_mutex_unlock(&a->lock);
    }
    return CUMA_OK;
}

static uint64_t next_release_of(cuma_heap *h) {
    uint64_t ns = next_age_due(h);
    if (h->tcaches && h->tc_age_ns != INT64_MAX) {
        /* A cache block is due at tc_due at the earliest; whether one is there is only known
         * by walking the caches, so report tc_due only when some cache holds a block. */
        uint64_t oldest = cuma_tcache_oldest(h);
        uint64_t due = oldest == UINT64_MAX ? UINT64_MAX : oldest + (uint64_t)h->tc_age_ns;
        if (due != UINT64_MAX && due < h->tc_due) due = h->tc_due;
        if (due < ns) ns = due;
    }
    return ns;
}

cuma_status cuma_next_release(cuma_heap *h, uint64_t *ns) {
    if (!h || !ns) return cuma_fail(CUMA_ERR_INVALID, "cuma_next_release: NULL argument");
    *ns = UINT64_MAX;
    unsigned n = atomic_load_explicit(&h->narenas, memory_order_acquire);
    for (unsigned i = 0; i < n; i++) {
        cuma_heap *a = h->arenas[i];
        pthread_mutex_lock(&a->lock);
        uint64_t due = next_release_of(a);
        pthread_mutex_unlock(&a->lock);
        if (due < *ns) *ns = due;
    }
    return CUMA_OK;
}

/* Gives idle memory back while the program runs, even when it makes no allocator call: sleeps
 * until the oldest idle page's delay ends (or a page goes idle in an empty cache). */
static void *release_thread(void *arg) {
    cuma_heap *h = arg;
    pthread_mutex_lock(&h->lock);
    while (!h->stopping) {
        uint64_t t = now(h), due = next_age_due(h), wait_ns = 1000000000ull;
        if (h->tcaches && h->tc_age_ns != INT64_MAX) wait_ns = (uint64_t)h->tc_age_ns / 2 + 1;
        if (wait_ns > 1000000000ull) wait_ns = 1000000000ull;
        if (due != UINT64_MAX) {
            if (due <= t)
                wait_ns = 0;
            else if (due - t < wait_ns)
                wait_ns = due - t;
        }
        /* At least 1 ms: a due page whose fence is still pending stays due, and the thread must
         * not spin on the lock while the stream works. */
        if (wait_ns < 1000000) wait_ns = 1000000;
        h->thread_wake_at = t + wait_ns;
        {
            struct timespec ts;
            clock_gettime(CLOCK_MONOTONIC, &ts);
            uint64_t ns = (uint64_t)ts.tv_nsec + wait_ns + 100000; /* a little late, never early */
            ts.tv_sec += (time_t)(ns / 1000000000ull);
            ts.tv_nsec = (long)(ns % 1000000000ull);
            pthread_cond_timedwait(&h->wake, &h->lock, &ts);
        }
        if (!h->stopping) cuma_heap_release_policy(h, now(h));
    }
    pthread_mutex_unlock(&h->lock);
    return NULL;
}
