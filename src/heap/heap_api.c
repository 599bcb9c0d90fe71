// SPDX-License-Identifier: Apache-2.0
/* Heap calls around the core paths: limits, callbacks, lookups, validation, sim controls. */
#include "cuma/sim.h"
#include "util/error.h"
#include "heap/heap.h"
#include "heap/pools.h"

#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

cuma_status cuma_set_limit(cuma_heap *h, uint64_t bytes) {
    if (!h) return cuma_fail(CUMA_ERR_INVALID, "cuma_set_limit: heap is NULL");
    if (atomic_load(&h->inherited)) return cuma_heap_inherited(h, "cuma_set_limit");
    /* Every arena gets the new limit (arena_lock: no arena is made meanwhile with the old). */
    cuma_mutex_lock(&h->arena_lock, CUMA_RANK_ARENAS);
    h->set.limit = bytes ? bytes : CUMA_UNLIMITED;
    unsigned n = atomic_load(&h->narenas);
    for (unsigned i = 0; i < n; i++) {
        cuma_arena *a = h->arenas[i];
        cuma_mutex_lock(&a->lock, CUMA_RANK_ARENA);
        cuma_arena_flush_tcaches(a);
        cuma_arena_refresh_limit(a);
        cuma_mutex_unlock(&a->lock);
    }
    /* Over the new limit: the caches go first, arena by arena; live memory stays until freed. */
    for (unsigned i = 0; i < n; i++) {
        cuma_arena *a = h->arenas[i];
        cuma_mutex_lock(&a->lock, CUMA_RANK_ARENA);
        uint64_t reserved = cuma_arena_reserved_all(a), cached = cuma_arena_cached(a);
        if (reserved > a->limit_bytes) {
            uint64_t excess = reserved - a->limit_bytes;
            cuma_arena_release(a, cuma_arena_now(a), -1, cached > excess ? cached - excess : 0, 0,
                               true);
        }
        cuma_mutex_unlock(&a->lock);
    }
    cuma_mutex_unlock(&h->arena_lock);
    return CUMA_OK;
}

cuma_status cuma_set_memory_fraction(cuma_heap *h, double fraction) {
    if (!h) return cuma_fail(CUMA_ERR_INVALID, "cuma_set_memory_fraction: heap is NULL");
    if (!(fraction > 0 && fraction <= 1))
        return cuma_fail(CUMA_ERR_INVALID, "cuma_set_memory_fraction: %g is not in (0, 1]",
                         fraction);
    /* Less than a page would truncate to a limit of 0, which cuma_set_limit reads as none. */
    uint64_t bytes = (uint64_t)(fraction * (double)h->be->capacity);
    if (bytes < h->be->page_size)
        return cuma_fail(CUMA_ERR_INVALID,
                         "cuma_set_memory_fraction: %g of the device's %" PRIu64
                         " bytes is less than one page (%" PRIu64 ")",
                         fraction, h->be->capacity, h->be->page_size);
    return cuma_set_limit(h, bytes);
}

cuma_status cuma_cb_add(cuma_heap *h, cuma_cb_list *l, cuma_any_fn fn, void *user, int *id,
                        const char *who) {
    if (!h || !fn) return cuma_fail(CUMA_ERR_INVALID, "%s: %s is NULL", who, h ? "fn" : "heap");
    cuma_mutex_lock(&h->oom_lock, CUMA_RANK_OOM);
    bool full = l->n == CUMA_MAX_OOM_CALLBACKS;
    if (!full) {
        cuma_cb_slot *s = &l->s[l->n++];
        s->fn = fn, s->user = user, s->id = ++l->next_id;
        if (id) *id = s->id;
    }
    cuma_mutex_unlock(&h->oom_lock);
    if (full)
        return cuma_fail(CUMA_ERR_INVALID, "%s: already %d callbacks", who, CUMA_MAX_OOM_CALLBACKS);
    return CUMA_OK;
}

/* The callback runs this thread is inside, innermost first (frames on the callers' stacks). */
static __thread cuma_cb_run *cb_runs;

static bool in_runs_of(const cuma_heap *h) {
    for (const cuma_cb_run *r = cb_runs; r; r = r->up)
        if (r->heap == h) return true;
    return false;
}

int cuma_cb_run_begin(cuma_heap *h, const cuma_cb_list *l, cuma_cb_slot *out, cuma_cb_run *run) {
    cuma_mutex_lock(&h->oom_lock, CUMA_RANK_OOM);
    int n = l->n;
    memcpy(out, l->s, sizeof l->s);
    h->cb_runs++;
    cuma_mutex_unlock(&h->oom_lock);
    run->heap = h;
    run->up = cb_runs;
    cb_runs = run;
    return n;
}

void cuma_cb_run_end(cuma_heap *h, cuma_cb_run *run) {
    cb_runs = run->up;
    cuma_mutex_lock(&h->oom_lock, CUMA_RANK_OOM);
    if (--h->cb_runs == 0) pthread_cond_broadcast(&h->cb_done);
    cuma_mutex_unlock(&h->oom_lock);
}

cuma_status cuma_cb_remove(cuma_heap *h, cuma_cb_list *l, int id, const char *who) {
    if (!h) return cuma_fail(CUMA_ERR_INVALID, "%s: heap is NULL", who);
    cuma_mutex_lock(&h->oom_lock, CUMA_RANK_OOM);
    bool found = false;
    for (int i = 0; i < l->n && !found; i++) {
        if (l->s[i].id != id) continue;
        for (int j = i + 1; j < l->n; j++) l->s[j - 1] = l->s[j];
        l->n--;
        found = true;
    }
    /* A run that copied the list before the removal may still call the callback: the caller
     * frees its `user` once this returns, so the runs in progress end first. Not from inside one
     * of h's callbacks, which would wait for its own run (or for a run waiting on it). */
    if (found && !in_runs_of(h))
        while (h->cb_runs) pthread_cond_wait(&h->cb_done, &h->oom_lock);
    cuma_mutex_unlock(&h->oom_lock);
    return found ? CUMA_OK : cuma_fail(CUMA_ERR_INVALID, "%s: no callback with id %d", who, id);
}

cuma_status cuma_add_oom_callback(cuma_heap *h, cuma_oom_fn fn, void *user, int *id) {
    return cuma_cb_add(h, h ? &h->oom : NULL, (cuma_any_fn)fn, user, id, "cuma_add_oom_callback");
}

cuma_status cuma_remove_oom_callback(cuma_heap *h, int id) {
    return cuma_cb_remove(h, h ? &h->oom : NULL, id, "cuma_remove_oom_callback");
}

cuma_status cuma_block_size(cuma_heap *h, const void *ptr, size_t *size) {
    if (!h || !ptr || !size) return cuma_fail(CUMA_ERR_INVALID, "cuma_block_size: NULL argument");
    cuma_arena *a = cuma_arena_of(h, (uint64_t)(uintptr_t)ptr);
    cuma_mutex_lock(&a->lock, CUMA_RANK_ARENA);
    cuma_block *b = cuma_map_get(&a->live, (uint64_t)(uintptr_t)ptr);
    if (b && !(atomic_load(&b->gen) & 1)) b = NULL; /* in a thread cache: freed */
    size_t bsize = b ? b->size : 0;
    cuma_mutex_unlock(&a->lock);
    if (!b) {
        cuma_mutex_lock(&h->managed_lock, CUMA_RANK_MANAGED);
        bsize = (size_t)(uintptr_t)cuma_map_get(&h->managed, (uint64_t)(uintptr_t)ptr);
        cuma_mutex_unlock(&h->managed_lock);
    }
    if (!bsize)
        return cuma_fail(CUMA_ERR_BAD_POINTER,
                         "cuma_block_size: pointer %p is not a live allocation", ptr);
    *size = bsize;
    return CUMA_OK;
}

typedef struct walk {
    cuma_arena *a;
    uint32_t *live;
    uint64_t requested, allocated, n, cached, all_sizes;
    const char *why;
} walk;

static void count_pages(walk *w, const cuma_block *b) {
    if (!w->live) return;
    unsigned sh = w->a->phys.shift;
    for (uint64_t v = b->off >> sh; v <= (b->off + b->mapped_len - 1) >> sh; v++) w->live[v]++;
}

static bool check_live(void *ctx, uint64_t key, void *val) {
    walk *w = ctx;
    cuma_block *b = val;
    if (key != w->a->base + b->off)
        return w->why = "live table key differs from the block's address", false;
    if (b->is_free) return w->why = "a live pointer maps to a free block", false;
    if (!b->req || b->req > b->size)
        return w->why = "a live block's request is 0 or over its size", false;
    /* A layer that counts blocks over its units (pages) needs each to map some byte. */
    if (b->mapped_len > b->size || (w->a->phys.refs && !b->mapped_len))
        return w->why = "a live block's mapped length is wrong", false;
    if (b->stream >= w->a->streams.n) return w->why = "a live block names an unknown stream", false;
    w->all_sizes += b->size;
    count_pages(w, b);
    if (!(atomic_load(&b->gen) & 1)) { /* in a thread cache */
        w->cached++;
        return true;
    }
    w->requested += b->req;
    w->allocated += b->size;
    w->n++;
    return true;
}

cuma_status cuma_arena_check(cuma_arena *a) {
    const char *why = NULL;
    uint64_t free_b, live_b;
    if (!a->pol->ops->validate(a->pol, &why, &free_b, &live_b)) goto bad;
    if (!cuma_map_validate(&a->live, &why)) goto bad;
    if (!cuma_streams_validate(&a->streams, &why)) goto bad;
    if (!a->phys.ops->validate(a, &why)) goto bad;
    const uint32_t *refs = a->phys.refs;
    walk w = {a, refs ? calloc(a->phys.nrefs, sizeof(uint32_t)) : NULL, 0, 0, 0, 0, 0, NULL};
    if (refs && !w.live)
        return cuma_fail(CUMA_ERR_OOM, "cuma_validate: no host memory for the page count check");
    cuma_map_each(&a->live, check_live, &w);
    for (cuma_block *b = a->deferred; b && !w.why; b = b->fnext) {
        w.requested += b->req, w.allocated += b->size, w.n++, w.all_sizes += b->size;
        count_pages(&w, b);
    }
    /* A compaction's new places, while its mover runs: placed and mapped, not yet counted. */
    for (cuma_block *b = a->moving; b && !w.why; b = b->fnext) {
        w.all_sizes += b->size;
        count_pages(&w, b);
    }
    int64_t tq, ta, tn;
    uint64_t tallocs, tfrees, slots = 0;
    cuma_tcache_sums(a, &tq, &ta, &tn, &tallocs, &tfrees);
    for (cuma_tcache *tc = a->tcaches; tc; tc = tc->next) {
        for (unsigned i = 0; i < CUMA_TC_BINS; i++)
            for (unsigned k = 0; k < CUMA_TC_DEPTH; k++)
                slots += atomic_load(&tc->bins[i].slot[k]) != NULL;
        for (unsigned k = 0; k < CUMA_TC_PENDING; k++)
            slots += atomic_load(&tc->pending[k]) != NULL;
    }
    if (!w.why && w.requested != a->c.requested + (uint64_t)tq)
        w.why = "requested bytes differ from the live blocks' sum";
    if (!w.why && w.allocated != a->c.allocated + (uint64_t)ta)
        w.why = "allocated bytes differ from the live blocks' sum";
    if (!w.why && w.all_sizes != live_b)
        w.why = "the policy's live bytes differ from the live and cached blocks'";
    if (!w.why && w.n != a->c.active + (uint64_t)tn)
        w.why = "active allocation count differs from the live blocks";
    if (!w.why && w.cached != slots)
        w.why = "blocks marked cached differ from the blocks in thread caches";
    if (!w.why && free_b + live_b != a->phys.ops->range_bytes(a))
        w.why = "free + live bytes differ from the address space the policy manages";
    for (uint32_t v = 0; !w.why && refs && v < a->phys.nrefs; v++)
        if (w.live[v] != refs[v])
            w.why = "a page's reference count differs from the blocks over it";
    free(w.live);
    why = w.why;
    if (!why) return CUMA_OK;
bad:
    return cuma_fail(CUMA_ERR_CORRUPT, "cuma_validate: %s", why);
}

/* What ties the arenas together (every arena's lock held). */
static const char *check_arenas(cuma_heap *h, unsigned n) {
    uint64_t pages = 0;
    if (h->arenas[0] != &h->first) return "the first arena is not the heap's own";
    for (unsigned i = 0; i < n; i++) {
        cuma_arena *a = h->arenas[i];
        if (a->heap != h || (i == 0) != (a == &h->first) || a->be != h->be)
            return "an arena names another heap";
        if (atomic_load(&a->pub[CUMA_PUB_REQUESTED]) != (int64_t)a->c.requested ||
            atomic_load(&a->pub[CUMA_PUB_ALLOCATED]) != (int64_t)a->c.allocated)
            return "an arena's published counters differ from its own";
        pages += *a->phys.nreserved;
        if (a->phys.nall != h->first.phys.nall)
            return "an arena counts its pages apart from the heap's";
        for (unsigned j = 0; j < i; j++) {
            cuma_arena *b = h->arenas[j];
            if (a->base < b->base + b->va_size && b->base < a->base + a->va_size)
                return "two arenas' virtual ranges overlap";
        }
    }
    if (pages != atomic_load(h->first.phys.nall))
        return "reserved pages differ from the arenas' sum";
    if (h->peers.ops) return h->peers.ops->validate(h->peers.ctx, h);
    return NULL;
}

cuma_status cuma_validate(cuma_heap *h) {
    if (!h) return cuma_fail(CUMA_ERR_INVALID, "cuma_validate: heap is NULL");
    /* Every arena at once, in their order (the only place that holds two arena locks). */
    cuma_mutex_lock(&h->arena_lock, CUMA_RANK_ARENAS);
    unsigned n = atomic_load(&h->narenas);
    for (unsigned i = 0; i < n; i++) cuma_mutex_lock(&h->arenas[i]->lock, CUMA_RANK_ARENA);
    cuma_status st = CUMA_OK;
    for (unsigned i = 0; i < n && !st; i++) st = cuma_arena_check(h->arenas[i]);
    const char *why = st ? NULL : check_arenas(h, n);
    if (!st) {
        cuma_mutex_lock(&h->managed_lock, CUMA_RANK_MANAGED);
        if (!why) cuma_map_validate(&h->managed, &why);
        cuma_mutex_unlock(&h->managed_lock);
    }
    for (unsigned i = n; i-- > 0;) cuma_mutex_unlock(&h->arenas[i]->lock);
    cuma_mutex_unlock(&h->arena_lock);
    if (!st && !why) why = cuma_pools_check(h); /* takes the pools' locks: after the arenas' */
    if (why) st = cuma_fail(CUMA_ERR_CORRUPT, "cuma_validate: %s", why);
    return st;
}

cuma_status cuma_sim_set_time(cuma_heap *h, uint64_t ns) {
    if (!h) return cuma_fail(CUMA_ERR_INVALID, "cuma_sim_set_time: heap is NULL");
    if (!h->set.sim_clock_manual)
        return cuma_fail(CUMA_ERR_UNSUPPORTED,
                         "cuma_sim_set_time: the heap needs sim_clock:manual");
    if (ns < atomic_load(&h->first.manual_now))
        return cuma_fail(CUMA_ERR_INVALID, "cuma_sim_set_time: time goes backwards");
    /* Every arena keeps the clock (arena_lock: a new arena starts at the time set last). */
    cuma_mutex_lock(&h->arena_lock, CUMA_RANK_ARENAS);
    unsigned n = atomic_load(&h->narenas);
    for (unsigned i = 0; i < n; i++) {
        cuma_arena *a = h->arenas[i];
        cuma_mutex_lock(&a->lock, CUMA_RANK_ARENA);
        if (ns > atomic_load(&a->manual_now)) {
            atomic_store(&a->manual_now, ns);
            atomic_store_explicit(&a->coarse_now, ns, memory_order_relaxed);
        }
        cuma_mutex_unlock(&a->lock);
    }
    cuma_mutex_unlock(&h->arena_lock);
    return CUMA_OK;
}

cuma_status cuma_sim_get_time(cuma_heap *h, uint64_t *ns) {
    if (!h || !ns) return cuma_fail(CUMA_ERR_INVALID, "cuma_sim_get_time: NULL argument");
    *ns = cuma_arena_now(&h->first);
    return CUMA_OK;
}

/* The simulated stream's state is the backend's: under the first arena's lock (its calls before
 * a second arena exists) and the arenas' shared-backend mutex (theirs after). */
static cuma_status hold(cuma_heap *h, cuma_stream s, bool on) {
    cuma_mutex_lock(&h->first.lock, CUMA_RANK_ARENA);
    cuma_backend_lock(h->be);
    cuma_status st = cuma_simbe_hold(cuma_backend_unwrap(h->be), s, on);
    cuma_backend_unlock(h->be);
    cuma_mutex_unlock(&h->first.lock);
    return st;
}

cuma_status cuma_sim_hold_stream(cuma_heap *h, cuma_stream s) {
    if (!h) return cuma_fail(CUMA_ERR_INVALID, "cuma_sim_hold_stream: heap is NULL");
    return hold(h, s, true);
}

cuma_status cuma_sim_take_memory(cuma_heap *h, uint64_t bytes) {
    if (!h) return cuma_fail(CUMA_ERR_INVALID, "cuma_sim_take_memory: heap is NULL");
    cuma_mutex_lock(&h->first.lock, CUMA_RANK_ARENA);
    cuma_backend_lock(h->be);
    cuma_status st = cuma_simbe_take(cuma_backend_unwrap(h->be), bytes);
    cuma_backend_unlock(h->be);
    cuma_mutex_unlock(&h->first.lock);
    return st;
}

cuma_status cuma_sim_release_stream(cuma_heap *h, cuma_stream s) {
    if (!h) return cuma_fail(CUMA_ERR_INVALID, "cuma_sim_release_stream: heap is NULL");
    return hold(h, s, false);
}
