// SPDX-License-Identifier: Apache-2.0
#include "phys/pages.h"
#include "util/error.h"
#include "util/marks.h"

#include <assert.h>
#include <stdlib.h>
#include <string.h>

/* Idle pages examined for one to move, oldest first: the address freed longest ago is the one
 * least likely to be wanted again soon. Taking the newest instead moved 12-29 % more pages in
 * the replays (the transformer trace: 133 000 maps, 117 600 oldest first), as a block freed a
 * moment ago is often followed by one placed in its own hole. On a device that runs behind the
 * host the newest pages are still pending; skipping one costs a compare (the stream was asked
 * once this operation: streams.h), so the scan may go deep. */
#define STEAL_SCAN 1024

cuma_status cuma_pages_init(cuma_pages *pp, cuma_backend *be, cuma_streams *ss, uint64_t base,
                            uint64_t va_size) {
    memset(pp, 0, sizeof *pp);
    pp->be = be, pp->ss = ss, pp->base = base;
    pp->page_size = be->page_size;
    pp->shift = (unsigned)__builtin_ctzll(be->page_size);
    uint64_t nva = va_size >> pp->shift;
    if (nva >= CUMA_NIL)
        return cuma_fail(CUMA_ERR_CONFIG, "virtual range of %llu pages is too large",
                         (unsigned long long)nva);
    pp->nva = (uint32_t)nva;
    pp->live = calloc(nva, sizeof *pp->live);
    pp->phys_of = calloc(nva, sizeof *pp->phys_of);
    if (!pp->live || !pp->phys_of) {
        free(pp->live), free(pp->phys_of);
        return cuma_fail(CUMA_ERR_OOM, "no host memory for a page table of %llu pages",
                         (unsigned long long)nva);
    }
    pp->head = pp->tail = pp->free_slot = CUMA_NIL;
    pp->limit_pages = UINT64_MAX;
    pp->shared = &pp->own_reserved;
    return CUMA_OK;
}

static void cache_remove(cuma_pages *pp, uint32_t i) {
    cuma_phys *p = &pp->phys[i];
    if (p->prev != CUMA_NIL)
        pp->phys[p->prev].next = p->next;
    else
        pp->head = p->next;
    if (p->next != CUMA_NIL)
        pp->phys[p->next].prev = p->prev;
    else
        pp->tail = p->prev;
    p->prev = p->next = CUMA_NIL;
    p->cached = 0;
    pp->ncached--;
}

static uint64_t *age_at(const cuma_pages *pp, uint64_t k) { /* k-th oldest */
    /* age_lo < capslots and k <= capslots: one subtraction, not a division (every push and take
     * of an idle page comes here). */
    uint64_t at = pp->age_lo + k;
    return &pp->ages[at >= pp->capslots ? at - pp->capslots : at];
}

/* Takes idle page i out of the cache for reuse: the newest age goes with it (see `ages`), so
 * memory used again and again within the release delay does not keep an old peak's pages
 * young. Pinned pages never go back, so they hold no age. */
static void cache_take(cuma_pages *pp, uint32_t i) {
    if (!pp->phys[i].pinned) pp->nages--;
    cache_remove(pp, i);
}

/* Takes idle page i (not pinned) out of the cache to give it back: the oldest age goes. */
static void cache_drop_oldest(cuma_pages *pp, uint32_t i) {
    assert(!pp->phys[i].pinned && pp->nages);
    cache_remove(pp, i);
    pp->age_lo = (pp->age_lo + 1) % pp->capslots;
    pp->nages--;
}

/* since: when the memory went idle (at most now; earlier for a block that sat in a thread cache,
 * where it was idle already). Its age goes in order among the others, so the oldest still goes
 * first; the cache list keeps the order of the pushes. */
/* Inlined into both callers: a freed block's pages come here one by one. */
__attribute__((always_inline)) static inline void cache_push_aged(cuma_pages *pp, uint32_t i,
                                                                  uint64_t now, uint64_t since) {
    cuma_phys *p = &pp->phys[i];
    /* The list is newest first: every caller reads its clock after the steps that push before
     * it (alloc_slow reads it after the drains and after the out-of-memory ladder). Debug
     * builds check it here, where a break would be made, not at the next cuma_validate. */
    assert(pp->head == CUMA_NIL || now >= pp->phys[pp->head].idle_since);
    p->idle_since = now;
    if (!p->pinned) { /* room: nages < nslots <= capslots */
        uint64_t k = pp->nages++;
        uint64_t *at = age_at(pp, k);
        if (k && *age_at(pp, k - 1) > since) { /* older than the newest: in order among them */
            for (; k && *age_at(pp, k - 1) > since; k--) *age_at(pp, k) = *age_at(pp, k - 1);
            at = age_at(pp, k);
        }
        *at = since;
    }
    p->prev = CUMA_NIL;
    p->next = pp->head;
    if (pp->head != CUMA_NIL)
        pp->phys[pp->head].prev = i;
    else
        pp->tail = i;
    pp->head = i;
    p->cached = 1;
    pp->ncached++;
}

static void cache_push(cuma_pages *pp, uint32_t i, uint64_t now) {
    cache_push_aged(pp, i, now, now);
}

static uint64_t va_addr(const cuma_pages *pp, uint32_t v) {
    return pp->base + ((uint64_t)v << pp->shift);
}

void cuma_pages_policy(cuma_pages *pp, double remap_threshold, double budget, bool timed) {
    pp->remap_threshold = remap_threshold;
    pp->budget = timed ? budget : 0;
    pp->timed = timed;
}

/* ---- the backend's page calls, timed -------------------------------------------------------- */

static uint64_t call_start(const cuma_pages *pp, enum cuma_mark m) {
    cuma_mark_push(pp->marks, m);
    return pp->timed ? pp->be->ops->now_ns(pp->be) : 0;
}

static void call_end(cuma_pages *pp, uint64_t t0) {
    if (pp->timed) pp->call_ns += pp->be->ops->now_ns(pp->be) - t0;
    cuma_mark_pop(pp->marks);
}

static cuma_status be_unmap(cuma_pages *pp, uint32_t v, uint32_t n) {
    uint64_t t0 = call_start(pp, CUMA_MARK_PAGE_UNMAP);
    cuma_status st = pp->be->ops->unmap(pp->be, va_addr(pp, v), n);
    call_end(pp, t0);
    return st;
}

static cuma_status be_map(cuma_pages *pp, uint32_t v, const uint64_t *handles, uint32_t n) {
    uint64_t t0 = call_start(pp, CUMA_MARK_PAGE_MAP);
    cuma_status st = pp->be->ops->map(pp->be, va_addr(pp, v), handles, n);
    call_end(pp, t0);
    return st;
}

static cuma_status be_create(cuma_pages *pp, uint64_t *handle) {
    uint64_t t0 = call_start(pp, CUMA_MARK_PAGE_CREATE);
    cuma_status st = pp->be->ops->page_create(pp->be, handle);
    call_end(pp, t0);
    return st;
}

static void be_release(cuma_pages *pp, uint64_t handle) {
    uint64_t t0 = call_start(pp, CUMA_MARK_PAGE_RELEASE);
    pp->be->ops->page_release(pp->be, handle);
    call_end(pp, t0);
}

/* Once a window: page calls over budget double the idle share kept in place (from 2 %), calls
 * under a quarter of it take a quarter off (to 0 below 2 %): a share that keeps the calls low
 * is left slowly, so it does not swing back and forth. A window of 250 ms holds a few training
 * steps; from nothing to the most kept takes about a second. */
#define PACE_WINDOW_NS 250000000ull
#define PACE_MAX_KEEP  0.25
static void pace(cuma_pages *pp) {
    uint64_t t = pp->be->ops->now_ns(pp->be);
    if (!pp->win_start || t < pp->win_start) {
        pp->win_start = t, pp->win_call_ns = pp->call_ns;
        return;
    }
    uint64_t el = t - pp->win_start;
    if (el < PACE_WINDOW_NS) return;
    double frac = (double)(pp->call_ns - pp->win_call_ns) / (double)el;
    if (frac > pp->budget)
        pp->keep = pp->keep < 0.02                ? 0.02
                   : pp->keep * 2 > PACE_MAX_KEEP ? PACE_MAX_KEEP
                                                  : pp->keep * 2;
    else if (frac < pp->budget / 4)
        pp->keep = pp->keep * 0.75 < 0.02 ? 0 : pp->keep * 0.75;
    pp->win_start = t, pp->win_call_ns = pp->call_ns;
}

static cuma_status new_slot(cuma_pages *pp, uint32_t *out) {
    *out = CUMA_NIL;
    if (pp->free_slot != CUMA_NIL) {
        *out = pp->free_slot;
        pp->free_slot = pp->phys[*out].next;
    } else {
        if (pp->nslots == pp->capslots) {
            uint32_t nc = pp->capslots ? pp->capslots * 2 : 256;
            cuma_phys *n = realloc(pp->phys, (size_t)nc * sizeof *n);
            if (!n) return cuma_fail(CUMA_ERR_OOM, "no host memory for the physical page table");
            pp->phys = n;
            uint64_t *ages = malloc((size_t)nc * sizeof *ages);
            if (!ages) return cuma_fail(CUMA_ERR_OOM, "no host memory for the page cache");
            for (uint64_t k = 0; k < pp->nages; k++) ages[k] = *age_at(pp, k);
            free(pp->ages);
            pp->ages = ages, pp->age_lo = 0, pp->capslots = nc;
        }
        *out = pp->nslots++;
    }
    cuma_phys *p = &pp->phys[*out];
    memset(p, 0, sizeof *p);
    p->va = p->prev = p->next = CUMA_NIL;
    p->used = 1;
    return CUMA_OK;
}

static void drop_slot(cuma_pages *pp, uint32_t i) {
    pp->phys[i].used = 0;
    pp->phys[i].next = pp->free_slot;
    pp->free_slot = i;
}

/* A new physical page, not mapped and not cached. */
static cuma_status create_page(cuma_pages *pp, uint32_t *out) {
    *out = CUMA_NIL;
    /* The limit counts the pages of every arena of the heap: claim one before creating it. */
    uint64_t held = atomic_load_explicit(pp->shared, memory_order_relaxed);
    do {
        if (held >= pp->limit_pages)
            return cuma_fail(pp->limit_is_device ? CUMA_ERR_OOM : CUMA_ERR_LIMIT,
                             "limit of %llu pages reached", (unsigned long long)pp->limit_pages);
    } while (!atomic_compare_exchange_weak_explicit(pp->shared, &held, held + 1,
                                                    memory_order_relaxed, memory_order_relaxed));
    uint32_t i = CUMA_NIL;
    cuma_status st = new_slot(pp, &i);
    if (!st) st = be_create(pp, &pp->phys[i].handle);
    if (st) {
        if (i != CUMA_NIL) drop_slot(pp, i);
        atomic_fetch_sub_explicit(pp->shared, 1, memory_order_relaxed);
        return st;
    }
    pp->nreserved++;
    pp->creates++;
    *out = i;
    return CUMA_OK;
}

static void release_page(cuma_pages *pp, uint32_t i) {
    be_release(pp, pp->phys[i].handle);
    drop_slot(pp, i);
    pp->nreserved--;
    atomic_fetch_sub_explicit(pp->shared, 1, memory_order_relaxed);
    pp->releases++;
}

/* ---- ghosts ---------------------------------------------------------------------------------- */

static cuma_status ghost_add(cuma_pages *pp, uint32_t va, uint32_t phys, uint16_t fstream,
                             uint64_t fseq) {
    if (pp->nghosts == pp->capghosts) {
        uint32_t nc = pp->capghosts ? pp->capghosts * 2 : 64;
        cuma_ghost *n = realloc(pp->ghosts, (size_t)nc * sizeof *n);
        if (!n) return cuma_fail(CUMA_ERR_OOM, "no host memory for the ghost table");
        pp->ghosts = n, pp->capghosts = nc;
    }
    pp->ghosts[pp->nghosts] = (cuma_ghost){fseq, va, phys, fstream};
    pp->phys_of[va] = CUMA_GHOST | pp->nghosts++;
    pp->phys[phys].nghost++;
    return CUMA_OK;
}

/* Unmaps ghost gi (its work is complete) and forgets it; the last ghost takes its index. */
static cuma_status ghost_drop(cuma_pages *pp, uint32_t gi) {
    cuma_ghost *g = &pp->ghosts[gi];
    cuma_status st = be_unmap(pp, g->va, 1);
    if (st) return st;
    pp->unmaps++;
    pp->phys_of[g->va] = 0;
    pp->phys[g->phys].nghost--;
    *g = pp->ghosts[--pp->nghosts];
    if (gi < pp->nghosts) pp->phys_of[g->va] = CUMA_GHOST | gi;
    return CUMA_OK;
}

/* Unmaps the ghosts whose work completed (one device query per stream: streams.h), waiting for
 * it where the backend can with `wait`. */
void cuma_pages_reap(cuma_pages *pp, bool wait) {
    for (uint32_t gi = 0; gi < pp->nghosts;) {
        const cuma_ghost *g = &pp->ghosts[gi];
        if (cuma_fence_poll(pp->ss, g->fstream, g->fseq, wait) && ghost_drop(pp, gi) == CUMA_OK)
            continue; /* another ghost now sits at gi */
        gi++;
    }
}

/* Virtual page v, about to be backed, holds ghost gi: unmap it if its work is done; else, when
 * its page idles elsewhere with only this stream's work pending (and outside [v, last], which
 * this call backs), take the page back to v (no driver call; its other place becomes the ghost);
 * else wait for the device. */
static cuma_status ghost_clear(cuma_pages *pp, uint32_t v, uint32_t last, int stream) {
    uint32_t gi = pp->phys_of[v] & ~CUMA_GHOST;
    cuma_ghost *g = &pp->ghosts[gi];
    if (cuma_fence_poll(pp->ss, g->fstream, g->fseq, false)) return ghost_drop(pp, gi);
    cuma_phys *p = &pp->phys[g->phys];
    if (stream == (int)g->fstream && p->cached && p->va != CUMA_NIL &&
        (p->va < v || p->va > last) && p->fence_stream == g->fstream) {
        uint32_t y = p->va;
        g->va = y;
        if (p->fence_seq > g->fseq) g->fseq = p->fence_seq;
        pp->phys_of[y] = CUMA_GHOST | gi;
        pp->phys_of[v] = g->phys + 1;
        p->va = v;
        return CUMA_OK; /* v now idles in place on its old page */
    }
    pp->remap_waits++;
    if (cuma_fence_poll(pp->ss, g->fstream, g->fseq, true)) return ghost_drop(pp, gi);
    return cuma_fail(CUMA_ERR_BACKEND,
                     "virtual page at 0x%llx is still mapped for work the device has not finished",
                     (unsigned long long)va_addr(pp, v));
}

/* Physical page i, mapped at a virtual page whose bytes are handed out again (live already, or
 * idle in place), may still be touched at its ghosts' old addresses by the work of their fences'
 * streams: placement's tags speak of virtual bytes only, so a block of another stream there
 * would run beside that work (the rest of a page remapped early, its other half freed).
 * That stream is ordered after the work on the device where it may be (stream_order), else the
 * host waits for it. The ghost's own stream runs it first anyway, and so does the stream of the
 * page's fence, which covers its ghosts' (joined with them, or a tag of work after them). */
static cuma_status order_after_ghosts(cuma_pages *pp, uint32_t i, int stream) {
    if (stream >= 0 && (unsigned)stream == pp->phys[i].fence_stream) return CUMA_OK;
    for (uint32_t gi = 0; gi < pp->nghosts; gi++) {
        const cuma_ghost *g = &pp->ghosts[gi];
        if (g->phys != i || (stream >= 0 && (unsigned)stream == g->fstream) ||
            cuma_fence_poll(pp->ss, g->fstream, g->fseq, false))
            continue;
        if (pp->order && stream >= 0 &&
            cuma_fence_order(pp->ss, (unsigned)stream, g->fstream, g->fseq) == CUMA_OK)
            continue;
        pp->remap_waits++;
        if (!cuma_fence_poll(pp->ss, g->fstream, g->fseq, true))
            return cuma_fail(CUMA_ERR_BACKEND,
                             "page at 0x%llx is still mapped elsewhere for work the device has "
                             "not finished",
                             (unsigned long long)va_addr(pp, g->va));
    }
    return CUMA_OK;
}

/* ---- backing a virtual page ------------------------------------------------------------------ */

enum { STOLE_NONE, STOLE_MOVED, STOLE_SHARED };

/* Pages chosen for consecutive virtual pages first..first+n-1 of one cuma_pages_ref call, mapped
 * together (one access call for the run) before the call returns, and the old places of pages
 * moved, unmapped together. Until then a chosen page is
 * out of the cache and not in the page table: created, moved (unmapped) or shared (still mapped
 * at its old place, which becomes a ghost once the run is mapped). */
#define RUN_MAX 128
typedef struct run {
    uint32_t first, n;
    bool dropped; /* run_map failed and gave the pages back */
    /* Old virtual pages of the pages moved, unmapped at the end of the cuma_pages_ref call (or
     * when full) in runs of adjacent ones, one call a run. */
    uint32_t un_n;
    uint32_t un_va[RUN_MAX];
    uint32_t slot[RUN_MAX];
    uint8_t kind[RUN_MAX]; /* STOLE_* */
} run;

static int cmp_u32(const void *a, const void *b) {
    uint32_t x = *(const uint32_t *)a, y = *(const uint32_t *)b;
    return (x > y) - (x < y);
}

static void unmap_flush(cuma_pages *pp, run *r) {
    if (!r->un_n) return;
    qsort(r->un_va, r->un_n, sizeof r->un_va[0], cmp_u32);
    for (uint32_t k = 0, n; k < r->un_n; k += n) {
        for (n = 1; k + n < r->un_n && r->un_va[k + n] == r->un_va[k] + n; n++) {
        }
        be_unmap(pp, r->un_va[k], n); /* a failure leaves mappings the backend retries */
        pp->unmap_runs++;
    }
    r->un_n = 0;
}

/* Takes idle page i off its virtual page now; the driver unmaps it with the others at the end.
 * The old virtual page is outside the range being backed: nothing maps there before. */
static void unmap_later(cuma_pages *pp, run *r, uint32_t i) {
    cuma_phys *p = &pp->phys[i];
    if (p->va == CUMA_NIL) return;
    if (r->un_n == RUN_MAX) unmap_flush(pp, r);
    r->un_va[r->un_n++] = p->va;
    pp->phys_of[p->va] = 0;
    p->va = CUMA_NIL;
    pp->unmaps++;
}

/* An idle page for another virtual page; never one idling inside [keep_first, keep_last], the
 * range being backed, which reuses those in place. STOLE_MOVED: one whose fence is complete,
 * taken off the cache and its old place (unmapped with the run's others: unmap_later).
 * STOLE_SHARED: this one's pending work is all on `stream`: still cached and mapped, to become a
 * ghost where it is; with one stream only when no page is done, with several before those. */
static int steal(cuma_pages *pp, uint32_t *out, uint32_t keep_first, uint32_t keep_last, int stream,
                 run *r) {
    uint32_t shared = CUMA_NIL, done = CUMA_NIL, other = CUMA_NIL;
    int n = 0;
    for (uint32_t i = pp->tail; i != CUMA_NIL && n < STEAL_SCAN; n++) {
        cuma_phys *p = &pp->phys[i];
        uint32_t next = p->prev;
        bool own = p->va != CUMA_NIL && p->va >= keep_first && p->va <= keep_last;
        if (own) {
        } else if (cuma_fence_poll(pp->ss, p->fence_stream, p->fence_seq, false)) {
            /* With several streams, a page whose work is done can go to any stream, one with
             * work pending only to its own: the stream that has its own takes that (an early
             * remap) and leaves the done ones to streams that cannot (the offloading trace,
             * 20 ms behind: 2.67x the requested bytes with done pages first, 2.22x). */
            if (pp->ss->n < 2 || stream < 0) {
                unmap_later(pp, r, i);
                cache_take(pp, i);
                *out = i;
                return STOLE_MOVED;
            }
            if (done == CUMA_NIL) done = i;
        } else if (stream == (int)p->fence_stream && p->va != CUMA_NIL &&
                   (shared == CUMA_NIL || p->fence_seq < pp->phys[shared].fence_seq)) {
            shared = i;
        } else if (other == CUMA_NIL && pp->order && stream >= 0 && p->va != CUMA_NIL &&
                   p->fence_stream != CUMA_FENCE_MULTI) {
            other = i; /* the oldest of another stream's */
        }
        i = next;
    }
    if (shared == CUMA_NIL && done != CUMA_NIL) {
        unmap_later(pp, r, done);
        cache_take(pp, done);
        *out = done;
        return STOLE_MOVED;
    }
    /* None done and none of its own: another stream's pending page, once this stream waits on
     * the device for that work. The page stays mapped where it was until the work completes
     * (a ghost with the other stream's fence), as for an early remap of its own. Without this,
     * memory freed by one stream within the lag could not serve another (a copy stream
     * prefetching weights the main stream freed), and pages were created instead. */
    if (shared == CUMA_NIL && other != CUMA_NIL &&
        cuma_fence_order(pp->ss, (unsigned)stream, pp->phys[other].fence_stream,
                         pp->phys[other].fence_seq) == CUMA_OK) {
        pp->ordered++;
        shared = other;
    }
    *out = shared;
    return shared == CUMA_NIL ? STOLE_NONE : STOLE_SHARED;
}

/* Puts a run's pages back in the cache when it cannot be mapped: created and moved ones
 * unmapped, shared ones still where they were. */
static void run_drop(cuma_pages *pp, run *r, uint64_t now) {
    for (uint32_t k = 0; k < r->n; k++) cache_push(pp, r->slot[k], now);
}

/* Maps the run and enters it in the page table. On failure the pages are given back (run_drop:
 * r->dropped) and r->n stays, for the caller to undo the references of those virtual pages. */
static cuma_status run_map(cuma_pages *pp, run *r, uint64_t now) {
    uint64_t handles[RUN_MAX];
    uint32_t shared = 0;
    for (uint32_t k = 0; k < r->n; k++) {
        handles[k] = pp->phys[r->slot[k]].handle;
        shared += r->kind[k] == STOLE_SHARED;
    }
    cuma_status st = CUMA_OK;
    if (pp->nghosts + shared > pp->capghosts) { /* room first: after the map nothing may fail */
        uint32_t nc = pp->capghosts ? pp->capghosts : 64;
        while (nc < pp->nghosts + shared) nc *= 2;
        cuma_ghost *n = realloc(pp->ghosts, (size_t)nc * sizeof *n);
        if (n)
            pp->ghosts = n, pp->capghosts = nc;
        else
            st = cuma_fail(CUMA_ERR_OOM, "no host memory for the ghost table");
    }
    if (!st) st = be_map(pp, r->first, handles, r->n);
    if (!st) pp->map_runs++;
    if (st) {
        run_drop(pp, r, now);
        r->dropped = true;
        return st;
    }
    for (uint32_t k = 0; k < r->n; k++) {
        uint32_t i = r->slot[k], v = r->first + k;
        cuma_phys *p = &pp->phys[i];
        if (r->kind[k] == STOLE_SHARED) {
            ghost_add(pp, p->va, i, p->fence_stream, p->fence_seq); /* keeps its fence */
            pp->early_remaps++;
        } else {
            p->fence_seq = 0; /* new, or moved after its work completed */
        }
        p->va = v;
        pp->phys_of[v] = i + 1;
        pp->nmapped++;
        pp->maps++;
    }
    r->n = 0;
    return CUMA_OK;
}

/* Backs virtual page v, whose live count just went from 0 to 1: in place, or with a page chosen
 * into the run (mapped with it). */
static cuma_status acquire(cuma_pages *pp, uint32_t v, uint64_t now, uint32_t last, int stream,
                           run *r) {
    uint32_t i = CUMA_NIL;
    if (pp->phys_of[v] & CUMA_GHOST) {
        cuma_status st = ghost_clear(pp, v, last, stream);
        if (st) return st;
    }
    if (pp->phys_of[v]) { /* idle in place: no driver call */
        /* Reused where it is: a fence of this stream's own is covered by its later work, as for
         * an early remap; another stream's may not be. */
        cuma_phys *q = &pp->phys[pp->phys_of[v] - 1];
        q->covered = stream >= 0 && q->fence_stream == (unsigned)stream;
        cache_take(pp, pp->phys_of[v] - 1);
        pp->nmapped++;
        return CUMA_OK;
    }
    if (r->n && (v != r->first + r->n || r->n == RUN_MAX)) {
        cuma_status st = run_map(pp, r, now);
        if (st) return st;
    }
    /* Idle pages within remap_threshold (or what pacing keeps) of the memory in use stay where
     * they are, unless no page can be created (the limit, a full device). */
    double keep = pp->keep > pp->remap_threshold ? pp->keep : pp->remap_threshold;
    bool stay = (double)pp->ncached <= keep * (double)pp->nmapped;
    int stole = stay ? STOLE_NONE : steal(pp, &i, v, last, stream, r);
    if (stole == STOLE_NONE) {
        cuma_status st = create_page(pp, &i);
        if (st && stay && (stole = steal(pp, &i, v, last, stream, r)) != STOLE_NONE) st = CUMA_OK;
        if (st) return st;
    }
    if (stole == STOLE_SHARED) {
        cache_take(pp, i);
        pp->phys[i].covered = 1; /* its own pending work, or ordered after another's */
    } else {
        pp->phys[i].covered = 0; /* created, or moved with its work done: fence_seq is 0 */
    }
    if (!r->n) r->first = v;
    r->slot[r->n] = i;
    r->kind[r->n] = (uint8_t)stole;
    r->n++;
    return CUMA_OK;
}

cuma_status cuma_pages_ref(cuma_pages *pp, uint64_t off, uint64_t len, uint64_t now, int stream) {
    uint32_t first = (uint32_t)(off >> pp->shift), last = (uint32_t)((off + len - 1) >> pp->shift);
    uint64_t need = 0;
    for (uint32_t v = first; v <= last; v++) need += !pp->live[v];
    cuma_streams_tick(pp->ss, now); /* one query per lagging stream for all the pages it steals */
    if (pp->budget > 0) pace(pp);
    if (pp->nghosts) cuma_pages_reap(pp, false);
    /* Pages mapped already (live, or idle in place) keep their ghosts through this call: the
     * pages it moves early become ghosts of this stream's or of work it is ordered after. */
    for (uint32_t v = first; pp->nghosts && v <= last; v++) {
        uint32_t i = pp->phys_of[v];
        if (i && !(i & CUMA_GHOST) && pp->phys[i - 1].nghost) {
            cuma_status st = order_after_ghosts(pp, i - 1, stream);
            if (st) return st;
        }
    }
    /* A request that cannot fit even with every idle page reused fails before touching any. */
    if (pp->nmapped + need > pp->limit_pages)
        return cuma_fail(pp->limit_is_device ? CUMA_ERR_OOM : CUMA_ERR_LIMIT,
                         "%llu more pages needed, %llu of a %llu-page limit in use",
                         (unsigned long long)need, (unsigned long long)pp->nmapped,
                         (unsigned long long)pp->limit_pages);
    run r;
    r.n = 0, r.dropped = false, r.un_n = 0;
    cuma_status st = CUMA_OK;
    uint32_t v;
    for (v = first; v <= last; v++) {
        if (pp->live[v]++) continue;
        st = acquire(pp, v, now, last, stream, &r);
        if (st) {
            pp->live[v]--;
            break;
        }
    }
    if (!st && r.n) st = run_map(pp, &r, now);
    unmap_flush(pp, &r); /* moved pages leave their old places either way */
    if (!st) return CUMA_OK;
    /* Undo this call's references: the run's pages were given back unmapped (or are still to
     * be), the others go back to the cache as fresh. */
    uint32_t rend = v;
    if (r.n) {
        if (!r.dropped) run_drop(pp, &r, now); /* failed before mapping its run */
        for (uint32_t k = 0; k < r.n; k++) pp->live[r.first + k]--;
        rend = r.first + r.n;
        if (r.first > first)
            cuma_pages_unref(pp, off, ((uint64_t)r.first << pp->shift) - off, now, 0, 0);
    } else {
        rend = first;
    }
    if (v > rend)
        cuma_pages_unref(pp, (uint64_t)rend << pp->shift, ((uint64_t)v - rend) << pp->shift, now, 0,
                         0);
    return st;
}

void cuma_pages_unref(cuma_pages *pp, uint64_t off, uint64_t len, uint64_t now, uint16_t fstream,
                      uint64_t fseq) {
    cuma_pages_unref_aged(pp, off, len, now, now, fstream, fseq);
}

void cuma_pages_unref_aged(cuma_pages *pp, uint64_t off, uint64_t len, uint64_t now, uint64_t since,
                           uint16_t fstream, uint64_t fseq) {
    if (since > now) since = now;
    uint32_t first = (uint32_t)(off >> pp->shift), last = (uint32_t)((off + len - 1) >> pp->shift);
    for (uint32_t v = first; v <= last; v++) {
        cuma_phys *p = &pp->phys[pp->phys_of[v] - 1];
        if (fseq && p->covered && pp->live[v] == 1)
            p->fence_stream = fstream, p->fence_seq = fseq; /* runs after the page's fence */
        else if (fseq)
            cuma_fence_join(pp->ss, &p->fence_stream, &p->fence_seq, fstream, fseq);
        if (fseq) p->covered = 0; /* a later tag joins this one */
        if (--pp->live[v]) continue;
        pp->nmapped--;
        cache_push_aged(pp, pp->phys_of[v] - 1, now, since);
    }
}

/* Pages cuma_pages_release took out of the cache, still mapped where they were: their mappings
 * go in runs of adjacent virtual pages, one backend call a run (a freed block's pages idle side
 * by side, so a trim of it is one unmap instead of one a page), then the pages themselves. A run
 * whose unmap fails is left to the backend, which keeps what it could not unmap and retries it,
 * as for the old places of moved pages. */
#define RELEASE_BATCH 128
typedef struct release_batch {
    uint32_t n;
    uint64_t key[RELEASE_BATCH]; /* virtual page << 32 | physical slot, sorted before the calls */
} release_batch;

static int cmp_u64(const void *a, const void *b) {
    uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
    return (x > y) - (x < y);
}

static uint64_t release_flush(cuma_pages *pp, release_batch *rb) {
    qsort(rb->key, rb->n, sizeof rb->key[0], cmp_u64);
    for (uint32_t k = 0, n; k < rb->n; k += n) {
        uint32_t va = (uint32_t)(rb->key[k] >> 32);
        for (n = 1; k + n < rb->n && (uint32_t)(rb->key[k + n] >> 32) == va + n; n++) {
        }
        be_unmap(pp, va, n);
        pp->unmap_runs++;
        for (uint32_t j = k; j < k + n; j++) {
            uint32_t i = (uint32_t)rb->key[j];
            pp->phys_of[pp->phys[i].va] = 0;
            pp->phys[i].va = CUMA_NIL;
            pp->unmaps++;
            release_page(pp, i);
        }
    }
    uint64_t released = rb->n;
    rb->n = 0;
    return released;
}

uint64_t cuma_pages_release(cuma_pages *pp, uint64_t now, int64_t delay_ns, uint64_t max_cached,
                            uint64_t age_keep, bool wait) {
    uint64_t released = 0;
    release_batch rb;
    rb.n = 0;
    uint32_t i = pp->tail;
    cuma_streams_tick(pp->ss, now);
    /* A page with ghosts stays until they go: waiting (a trim) waits for their work too. */
    if (pp->nghosts) cuma_pages_reap(pp, wait);
    while (i != CUMA_NIL) {
        cuma_phys *p = &pp->phys[i];
        uint32_t prev = p->prev;
        /* By the age of the memory (the ring), not of this page: see `ages`. */
        uint64_t age = pp->nages ? *age_at(pp, 0) : UINT64_MAX;
        bool old = delay_ns >= 0 && now >= age && now - age >= (uint64_t)delay_ns &&
                   pp->ncached > age_keep;
        bool over = pp->ncached > max_cached;
        if (!old && !over) break; /* newer pages are younger still */
        /* A page with ghosts has work pending (its fence covers theirs): it stays. */
        if (!p->pinned && !p->nghost &&
            cuma_fence_poll(pp->ss, p->fence_stream, p->fence_seq, wait)) {
            cache_drop_oldest(pp, i);
            if (p->va == CUMA_NIL) {
                release_page(pp, i);
                released++;
            } else {
                rb.key[rb.n++] = (uint64_t)p->va << 32 | i;
                if (rb.n == RELEASE_BATCH) released += release_flush(pp, &rb);
            }
        }
        i = prev;
    }
    if (rb.n) released += release_flush(pp, &rb);
    return released;
}

cuma_status cuma_pages_prefill(cuma_pages *pp, uint64_t n, uint64_t now) {
    for (uint64_t k = 0; k < n; k++) {
        uint32_t i;
        cuma_status st = create_page(pp, &i);
        if (st) return st;
        pp->phys[i].pinned = 1;
        pp->npinned++;
        cache_push(pp, i, now);
    }
    return CUMA_OK;
}

uint64_t cuma_pages_oldest_idle(const cuma_pages *pp) {
    return pp->nages ? *age_at(pp, 0) : UINT64_MAX;
}

void cuma_pages_destroy(cuma_pages *pp) {
    for (uint32_t gi = 0; gi < pp->nghosts; gi++)
        pp->be->ops->unmap(pp->be, va_addr(pp, pp->ghosts[gi].va), 1);
    free(pp->ghosts);
    for (uint32_t i = 0; i < pp->nslots; i++) {
        if (!pp->phys[i].used) continue;
        if (pp->phys[i].va != CUMA_NIL) pp->be->ops->unmap(pp->be, va_addr(pp, pp->phys[i].va), 1);
        pp->be->ops->page_release(pp->be, pp->phys[i].handle);
    }
    free(pp->phys), free(pp->live), free(pp->phys_of), free(pp->ages);
    memset(pp, 0, sizeof *pp);
}

bool cuma_pages_validate(const cuma_pages *pp, const char **why) {
    uint64_t used = 0, cached = 0, mapped_live = 0, ghosts = 0;
    for (uint32_t i = 0; i < pp->nslots; i++) {
        const cuma_phys *p = &pp->phys[i];
        if (!p->used) continue;
        used++;
        ghosts += p->nghost;
        if (p->va != CUMA_NIL && pp->phys_of[p->va] != i + 1)
            return *why = "pages: physical page and page table disagree", false;
        bool idle = p->va == CUMA_NIL || pp->live[p->va] == 0;
        if (idle != !!p->cached)
            return *why = "pages: a page is cached iff it has no live byte", false;
        cached += p->cached;
        if (!idle) mapped_live++;
    }
    if (used != pp->nreserved) return *why = "pages: reserved count differs from pages held", false;
    if (cached != pp->ncached || mapped_live != pp->nmapped)
        return *why = "pages: cached/mapped counts wrong", false;
    uint64_t n = 0, prev_t = UINT64_MAX;
    for (uint32_t i = pp->head; i != CUMA_NIL; i = pp->phys[i].next) {
        if (++n > cached) return *why = "pages: cache list has a cycle", false;
        if (pp->phys[i].idle_since > prev_t)
            return *why = "pages: cache list not ordered newest first", false;
        prev_t = pp->phys[i].idle_since;
        if (pp->phys[i].next != CUMA_NIL && pp->phys[pp->phys[i].next].prev != i)
            return *why = "pages: cache links broken", false;
    }
    if (n != cached) return *why = "pages: cache list misses cached pages", false;
    uint64_t unpinned = 0;
    for (uint32_t i = pp->head; i != CUMA_NIL; i = pp->phys[i].next)
        unpinned += !pp->phys[i].pinned;
    if (pp->nages != unpinned) return *why = "pages: one age per idle page that may go back", false;
    for (uint64_t k = 1; k < pp->nages; k++)
        if (*age_at(pp, k) < *age_at(pp, k - 1))
            return *why = "pages: ages of the idle memory out of order", false;
    if (ghosts != pp->nghosts) return *why = "pages: ghost counts of the pages differ", false;
    for (uint32_t gi = 0; gi < pp->nghosts; gi++) {
        const cuma_ghost *g = &pp->ghosts[gi];
        if (g->va >= pp->nva || pp->phys_of[g->va] != (CUMA_GHOST | gi) || pp->live[g->va] ||
            g->phys >= pp->nslots || !pp->phys[g->phys].used || g->fstream == CUMA_FENCE_MULTI)
            return *why = "pages: a ghost and the page table disagree", false;
    }
    for (uint32_t v = 0; v < pp->nva; v++) {
        if (pp->live[v] && (!pp->phys_of[v] || (pp->phys_of[v] & CUMA_GHOST)))
            return *why = "pages: live bytes on an unmapped page", false;
        if (pp->phys_of[v] & CUMA_GHOST) {
            if ((pp->phys_of[v] & ~CUMA_GHOST) >= pp->nghosts)
                return *why = "pages: page table points at a missing ghost", false;
        } else if (pp->phys_of[v] &&
                   (pp->phys_of[v] > pp->nslots || !pp->phys[pp->phys_of[v] - 1].used ||
                    pp->phys[pp->phys_of[v] - 1].va != v))
            return *why = "pages: page table points at a wrong physical page", false;
    }
    return true;
}
