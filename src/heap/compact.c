// SPDX-License-Identifier: Apache-2.0
/* Compaction (include/cuma/compact.a): live blocks move, by their owner's mover, out of the
 * pages that only they keep mapped.
 *
 * One arena at a time: under its lock a plan picks the pages to empty and places every block on
 * them anew (the new places are mapped and sit on the arena's `moving` list, counted nowhere
 * else); the lock is dropped while the mover copies; under the lock again each move commits
 * (the new place takes the old one's entry in the live table, the old place is freed on the
 * block's stream) or is undone (the new place is freed the same way). */
#include "cuma/compact.h"

#include "util/error.h"
#include "heap/heap.h"
#include "heap/pools.h"
#include "trace/writer.h"

#include <stdlib.h>
#include <string.h>

/* Set while this thread runs a mover: compactions started from inside one do nothing. */
static __thread bool in_mover;

enum { PAGE_PINNED = 1, PAGE_VICTIM = 2 };

typedef struct move {
    cuma_block *old, *nb;
    uint64_t gen; /* old's generation when planned: changed means the program freed it */
    uint64_t old_addr, new_addr, size;
    cuma_stream stream;
    uint16_t si;
    bool ok;
} move;

/* One arena's plan. Invariants while placing: fill[v] is the requested bytes of live blocks on
 * virtual page v as of the plan; mark[v] has PAGE_VICTIM for the pages to empty; cand[] holds
 * free blocks of the policy (none twice); mv[0..nmv) the blocks to move, mv[i].nb their new
 * places once placed. */
typedef struct plan {
    cuma_arena *a;
    uint64_t ps;
    unsigned sh;
    uint64_t *fill;
    uint8_t *mark;
    cuma_block **cand;
    size_t ncand;
    move *mv;
    size_t nmv;
    uint32_t nvictims;
    uint64_t cached_before, releases_before;
} plan;

static uint32_t page_of(const plan *p, uint64_t off) {
    return (uint32_t)(off >> p->sh);
}

/* May block b move? Small, the program's, on one stream, not a pool's carve. */
static bool movable(cuma_arena *a, cuma_block *b, uint64_t ps) {
    if (b->mapped_len > ps / 2 || b->extra[0] != CUMA_NO_STREAM || b->extra_all) return false;
    if (cuma_map_get(&a->live, a->base + b->off) != b) return false; /* deferred or moving */
    if (!(atomic_load_explicit(&b->gen, memory_order_acquire) & 1)) return false; /* cached */
    return !cuma_pools_owns(a->heap, a->base + b->off);
}

#define FOR_BLOCKS(a, b)                                                                           \
    for (cuma_block *b = (a)->pol->ops->first((a)->pol); b; b = b->range_end ? NULL : b->next)

static void count_fill(plan *p) {
    cuma_arena *a = p->a;
    FOR_BLOCKS(a, b) {
        if (b->is_free || !b->mapped_len) continue;
        bool mov = movable(a, b, p->ps);
        uint64_t end = b->off + b->mapped_len;
        for (uint32_t v = page_of(p, b->off); v <= page_of(p, end - 1); v++) {
            uint64_t lo = (uint64_t)v << p->sh, hi = lo + p->ps;
            p->fill[v] += (end < hi ? end : hi) - (b->off > lo ? b->off : lo);
            if (!mov) p->mark[v] |= PAGE_PINNED;
        }
    }
}

typedef struct page_fill {
    uint64_t fill;
    uint32_t v;
} page_fill;

static int by_fill(const void *a, const void *b) {
    const page_fill *x = a, *y = b;
    if (x->fill != y->fill) return x->fill < y->fill ? -1 : 1;
    return (x->v > y->v) - (x->v < y->v);
}

/* Fresh pages needed for `moved` bytes once `dense` free bytes of pages in use took what fits. */
static uint64_t fresh_needed(const plan *p, uint64_t moved, uint64_t dense) {
    return moved > dense ? (moved - dense + p->ps - 1) / p->ps : 0;
}

/* The pages to empty: the sparsest first (at most half a page live, no block that cannot
 * move), while what they hold fits into the free bytes of the pages that stay in use plus the
 * fresh pages the limit allows, and only while emptying them frees more pages than the moves
 * take anew. */
static cuma_status pick_victims(plan *p) {
    cuma_arena *a = p->a;
    cuma_pages *pp = &a->pages;
    page_fill *c = malloc((size_t)pp->nva * sizeof *c);
    if (!c) return cuma_fail(CUMA_ERR_OOM, "cuma_compact: no host memory for the page list");
    uint32_t nc = 0;
    uint64_t dense = 0;
    for (uint32_t v = 0; v < pp->nva; v++) {
        if (!pp->live[v]) continue;
        dense += p->fill[v] < p->ps ? p->ps - p->fill[v] : 0;
        if (!(p->mark[v] & PAGE_PINNED) && p->fill[v] <= p->ps / 2)
            c[nc++] = (page_fill){p->fill[v], v};
    }
    qsort(c, nc, sizeof *c, by_fill);
    uint64_t held = atomic_load_explicit(pp->shared, memory_order_relaxed);
    uint64_t fresh = (pp->limit_pages > held ? pp->limit_pages - held : 0) + pp->ncached;
    if (fresh > pp->nva) fresh = pp->nva;
    uint64_t moved = 0;
    uint32_t n = 0;
    for (; n < nc; n++) {
        uint64_t after = dense - (p->ps - c[n].fill);
        if (moved + c[n].fill > after + fresh * p->ps) break;
        moved += c[n].fill, dense = after;
    }
    while (n && fresh_needed(p, moved, dense) >= n) {
        n--;
        moved -= c[n].fill, dense += p->ps - c[n].fill;
    }
    for (uint32_t k = 0; k < n; k++) p->mark[c[k].v] |= PAGE_VICTIM;
    p->nvictims = n;
    free(c);
    return CUMA_OK;
}

static int by_size_desc(const void *a, const void *b) {
    const move *x = a, *y = b;
    if (x->size != y->size) return x->size > y->size ? -1 : 1;
    return (x->old_addr > y->old_addr) - (x->old_addr < y->old_addr);
}

/* The blocks on the pages to empty, and the free blocks where they may go. */
static cuma_status collect(plan *p) {
    cuma_arena *a = p->a;
    size_t nmv = 0, nfree = 0;
    FOR_BLOCKS(a, b) {
        if (b->is_free)
            nfree++;
        else
            nmv++;
    }
    p->mv = calloc(nmv ? nmv : 1, sizeof *p->mv);
    p->cand = malloc((nfree + nmv + 1) * sizeof *p->cand); /* each carve adds at most one */
    if (!p->mv || !p->cand)
        return cuma_fail(CUMA_ERR_OOM, "cuma_compact: no host memory for the block lists");
    FOR_BLOCKS(a, b) {
        if (b->is_free) {
            p->cand[p->ncand++] = b;
            continue;
        }
        if (!b->mapped_len || !movable(a, b, p->ps)) continue;
        bool on_victim = false;
        for (uint32_t v = page_of(p, b->off); v <= page_of(p, b->off + b->mapped_len - 1); v++)
            on_victim |= (p->mark[v] & PAGE_VICTIM) != 0;
        if (!on_victim) continue;
        move *m = &p->mv[p->nmv++];
        m->old = b;
        m->gen = atomic_load_explicit(&b->gen, memory_order_acquire);
        m->old_addr = a->base + b->off;
        m->size = b->req;
        m->si = b->stream;
        m->stream = cuma_streams_usable(&a->streams, b->stream); /* the mover runs here */
    }
    qsort(p->mv, p->nmv, sizeof *p->mv, by_size_desc); /* large first: they need the room */
    return CUMA_OK;
}

/* The last page of [off, off+len) to be emptied, or UINT32_MAX. */
static uint32_t last_victim(const plan *p, uint64_t off, uint64_t len) {
    for (uint32_t v = page_of(p, off + len - 1);; v--) {
        if (p->mark[v] & PAGE_VICTIM) return v;
        if (v == page_of(p, off)) return UINT32_MAX;
    }
}

static uint64_t new_pages(const plan *p, uint64_t off, uint64_t len) {
    uint64_t n = 0;
    for (uint32_t v = page_of(p, off); v <= page_of(p, off + len - 1); v++)
        n += !p->a->pages.live[v];
    return n;
}

typedef struct spot {
    size_t k; /* cand index */
    uint64_t pos, fresh, fsize;
} spot;

static bool better(const spot *a, const spot *b) {
    if (a->fresh != b->fresh) return a->fresh < b->fresh;
    if (a->fsize != b->fsize) return a->fsize < b->fsize;
    return a->pos < b->pos;
}

static void consider(const plan *p, size_t k, uint64_t pos, uint64_t n, uint64_t r, spot *best) {
    const cuma_block *f = p->cand[k];
    if (pos < f->off || pos + n > f->off + f->size) return;
    if (last_victim(p, pos, r) != UINT32_MAX) return;
    spot s = {k, pos, new_pages(p, pos, r), f->size};
    if (best->k == SIZE_MAX || better(&s, best)) *best = s;
}

/* Where a block of n bytes (r of them mapped) for stream si goes: in a free block the stream may
 * use, off the pages to empty, taking as few pages that hold nothing as it can (a gap in a page
 * in use takes none; a fresh page next to the blocks placed before takes none after the first),
 * then the smallest free block. Tried per free block: its start, its end, and the first place
 * past the pages to empty. */
static spot find_spot(const plan *p, uint64_t n, uint64_t r, uint16_t si) {
    spot best = {SIZE_MAX, 0, 0, 0};
    for (size_t k = 0; k < p->ncand; k++) {
        const cuma_block *f = p->cand[k];
        if (f->size < n) continue;
        if (f->fence_seq && f->fence_stream != si &&
            !cuma_fence_known_done(&p->a->streams, f->fence_stream, f->fence_seq))
            continue;
        uint64_t end = f->off + f->size;
        consider(p, k, end - n, n, r, &best);
        for (uint64_t pos = f->off; pos + n <= end;) {
            uint32_t v = last_victim(p, pos, r);
            if (v == UINT32_MAX) {
                consider(p, k, pos, n, r, &best);
                break;
            }
            pos = (uint64_t)(v + 1) << p->sh;
        }
        if (best.k != SIZE_MAX && !best.fresh && best.fsize == n) break; /* cannot do better */
    }
    return best;
}

/* Places the blocks of the plan; stops at the first that cannot be mapped. The placed ones are
 * mv[0..nmv) afterwards. */
static void place(plan *p) {
    cuma_arena *a = p->a;
    uint64_t t = cuma_arena_now(a);
    size_t placed = 0;
    for (size_t i = 0; i < p->nmv; i++) {
        move m = p->mv[i];
        uint64_t n = m.old->size, r = m.size;
        spot s = find_spot(p, n, r, m.si);
        if (s.k == SIZE_MAX) continue; /* nowhere: it stays */
        cuma_block *f = p->cand[s.k];
        uint64_t foff = f->off, fend = f->off + f->size, fseq = f->fence_seq;
        uint16_t fst = f->fence_stream;
        cuma_block *nb = a->pol->ops->carve(a->pol, f, s.pos, n);
        if (!nb) break;
        if (s.pos + n < fend)
            p->cand[s.k] = nb->next;
        else
            p->cand[s.k] = p->cand[--p->ncand];
        if (s.pos > foff) p->cand[p->ncand++] = nb->prev;
        cuma_status st = cuma_pages_ref(&a->pages, nb->off, r, t,
                                        a->heap->set.early_remap && (a->be->caps & CUMA_CAP_ALIAS)
                                            ? (int)m.si
                                            : CUMA_PAGES_NO_STREAM);
        if (st) {
            a->pol->ops->free(a->pol, nb, fst, fseq); /* merges: the free list is stale now */
            break;
        }
        nb->req = r;
        nb->mapped_len = r;
        nb->stream = m.si;
        nb->extra[0] = nb->extra[1] = CUMA_NO_STREAM;
        nb->extra_all = 0;
        nb->fnext = a->moving;
        a->moving = nb;
        m.nb = nb;
        m.new_addr = a->base + nb->off;
        p->mv[placed++] = m;
    }
    p->nmv = placed;
}

static void plan_free(plan *p) {
    free(p->fill), free(p->mark), free(p->cand), free(p->mv);
}

/* The plan of arena a (its lock held): victims chosen, blocks placed. */
static cuma_status plan_make(cuma_arena *a, plan *p) {
    memset(p, 0, sizeof *p);
    p->a = a;
    p->ps = a->pages.page_size;
    p->sh = a->pages.shift;
    cuma_streams_tick(&a->streams, cuma_arena_now(a));
    cuma_arena_flush_tcaches(a);
    if (a->deferred) cuma_arena_process_deferred(a, false);
    p->cached_before = cuma_arena_cached(a);
    p->releases_before = a->pages.releases;
    p->fill = calloc(a->pages.nva, sizeof *p->fill);
    p->mark = calloc(a->pages.nva, 1);
    if (!p->fill || !p->mark)
        return cuma_fail(CUMA_ERR_OOM, "cuma_compact: no host memory for a page table of %u pages",
                         a->pages.nva);
    count_fill(p);
    cuma_status st = pick_victims(p);
    if (!st && p->nvictims) st = collect(p);
    if (!st && p->nmv) place(p);
    return st;
}

/* Commits or undoes the moves (a's lock held again) and adds what they did to r. */
static void plan_commit(plan *p, bool release, cuma_compact_result *r) {
    cuma_arena *a = p->a;
    cuma_heap *h = a->heap;
    a->moving = NULL; /* one compaction at a time: every block on it is this plan's */
    cuma_streams_tick(&a->streams, cuma_arena_now(a));
    uint64_t t = cuma_arena_now(a);
    for (size_t i = 0; i < p->nmv; i++) {
        move *m = &p->mv[i];
        uint64_t g = m->gen;
        /* Claimed as a free claims it: a free of the old pointer racing with this fails. */
        bool ok = m->ok && atomic_compare_exchange_strong(&m->old->gen, &g, g + 1);
        uint64_t seq = cuma_streams_note_free(&a->streams, m->si);
        if (!ok) {
            cuma_arena_release_block(a, m->nb, m->si, seq, t, false);
            r->blocks_refused++;
            continue;
        }
        /* One entry out, one in: the table never grows here, so the put cannot fail. */
        cuma_map_remove(&a->live, m->old_addr);
        cuma_map_put(&a->live, m->new_addr, m->nb);
        atomic_store_explicit(&m->nb->gen,
                              atomic_load_explicit(&m->nb->gen, memory_order_relaxed) + 1,
                              memory_order_release);
        if (h->tw) {
            uint64_t shown = (uint64_t)(uintptr_t)cuma_streams_shown(&a->streams, m->si);
            cuma_trace_writer_event(h->tw, CUMA_TRACE_FREE, m->old_addr, m->size, shown);
            cuma_trace_writer_event(h->tw, CUMA_TRACE_ALLOC, m->new_addr, m->size, shown);
        }
        /* Stream-ordered, as cuma_free(old, stream): the copy queued there runs first. */
        cuma_arena_release_block(a, m->old, m->si, seq, t, false);
        r->blocks_moved++;
        r->bytes_moved += m->size;
    }
    uint64_t emptied = 0;
    for (uint32_t v = 0; v < a->pages.nva; v++)
        emptied += (p->mark[v] & PAGE_VICTIM) && !a->pages.live[v];
    r->pages_emptied += emptied;
    atomic_fetch_add(&h->compact_freed, emptied);
    if (release && cuma_arena_cached(a) > p->cached_before)
        cuma_arena_release(a, t, -1, p->cached_before, 0, false);
    r->pages_released += a->pages.releases - p->releases_before;
    cuma_arena_release_policy(a, t);
}

/* Every arena in turn: plan (lock held), move (no lock), commit (lock held). compact_run held. */
static cuma_status compact_all(cuma_heap *h, cuma_move_fn fn, void *user, bool release,
                               cuma_compact_result *r) {
    memset(r, 0, sizeof *r);
    cuma_status st = CUMA_OK;
    unsigned n = atomic_load_explicit(&h->narenas, memory_order_acquire);
    for (unsigned i = 0; i < n && !st; i++) {
        cuma_arena *a = h->arenas[i];
        plan p;
        cuma_mutex_lock(&a->lock, CUMA_RANK_ARENA);
        st = plan_make(a, &p);
        cuma_mutex_unlock(&a->lock);
        in_mover = true;
        for (size_t k = 0; k < p.nmv; k++) {
            move *m = &p.mv[k];
            m->ok = fn(user, (void *)(uintptr_t)m->old_addr, (void *)(uintptr_t)m->new_addr,
                       (size_t)m->size, m->stream);
        }
        in_mover = false;
        cuma_mutex_lock(&a->lock, CUMA_RANK_ARENA);
        plan_commit(&p, release, r);
        cuma_mutex_unlock(&a->lock);
        plan_free(&p);
    }
    atomic_fetch_add(&h->compactions, 1);
    atomic_fetch_add(&h->compact_moved, r->bytes_moved);
    return st;
}

static cuma_status can_compact(cuma_heap *h, const char *who) {
    if (!(h->first.phys.ops->caps & CUMA_PHYS_MOVABLE))
        return cuma_fail(CUMA_ERR_UNSUPPORTED,
                         "%s: the heap is in segment mode (backend %s), where a segment goes back "
                         "only when all of it is free; compaction moves blocks between pages "
                         "(page mode only)",
                         who, h->be->name);
    if (!h->first.pol->ops->carve)
        return cuma_fail(CUMA_ERR_UNSUPPORTED,
                         "%s: policy:%s cannot place a block at a chosen address (use tlsf)", who,
                         h->first.pol->ops->name);
    return CUMA_OK;
}

static cuma_status enter(cuma_heap *h, const char *who) {
    if (!h) return cuma_fail(CUMA_ERR_INVALID, "%s: heap is NULL", who);
    if (atomic_load(&h->inherited)) return cuma_heap_inherited(h, who);
    if (in_mover) return cuma_fail(CUMA_ERR_INVALID, "%s: called from inside a move callback", who);
    return can_compact(h, who);
}

cuma_status cuma_compact(cuma_heap *h, cuma_move_fn move, void *user, cuma_compact_result *out) {
    cuma_compact_result r;
    memset(&r, 0, sizeof r);
    if (out) *out = r;
    cuma_status st = enter(h, "cuma_compact");
    if (st) return st;
    if (!move) return cuma_fail(CUMA_ERR_INVALID, "cuma_compact: move is NULL");
    cuma_mutex_lock(&h->compact_run, CUMA_RANK_COMPACT_RUN);
    st = compact_all(h, move, user, true, &r);
    cuma_mutex_unlock(&h->compact_run);
    if (out) *out = r;
    return st;
}

cuma_status cuma_set_mover(cuma_heap *h, cuma_move_fn move, void *user) {
    if (!h) return cuma_fail(CUMA_ERR_INVALID, "cuma_set_mover: heap is NULL");
    if (move) {
        cuma_status st = can_compact(h, "cuma_set_mover");
        if (st) return st;
    }
    cuma_mutex_lock(&h->oom_lock, CUMA_RANK_OOM);
    h->mover = (cuma_any_fn)move;
    h->mover_user = user;
    cuma_mutex_unlock(&h->oom_lock);
    return CUMA_OK;
}

/* The registered mover, if the heap's fragmentation is over its threshold (no lock held). */
static cuma_move_fn mover_if_needed(cuma_heap *h, void **user) {
    cuma_mutex_lock(&h->oom_lock, CUMA_RANK_OOM);
    cuma_move_fn fn = (cuma_move_fn)h->mover;
    *user = h->mover_user;
    cuma_mutex_unlock(&h->oom_lock);
    if (!fn) return NULL;
    cuma_stats s;
    cuma_heap_snapshot(h, &s);
    return s.fragmentation > h->set.fragmentation_threshold ? fn : NULL;
}

cuma_status cuma_compact_if_needed(cuma_heap *h, cuma_compact_result *out) {
    cuma_compact_result r;
    memset(&r, 0, sizeof r);
    if (out) *out = r;
    if (!h) return cuma_fail(CUMA_ERR_INVALID, "cuma_compact_if_needed: heap is NULL");
    if (in_mover)
        return cuma_fail(CUMA_ERR_INVALID,
                         "cuma_compact_if_needed: called from inside a move callback");
    if (atomic_load(&h->inherited)) return cuma_heap_inherited(h, "cuma_compact_if_needed");
    void *user;
    if (!mover_if_needed(h, &user)) return CUMA_OK;
    cuma_mutex_lock(&h->compact_run, CUMA_RANK_COMPACT_RUN);
    cuma_move_fn fn = mover_if_needed(h, &user); /* again: another compaction may have run */
    cuma_status st = fn ? compact_all(h, fn, user, true, &r) : CUMA_OK;
    cuma_mutex_unlock(&h->compact_run);
    if (out) *out = r;
    return st;
}

bool cuma_arena_compact_rung(cuma_arena *a) {
    cuma_heap *h = a->heap;
    /* A mover that allocates and runs out does not compact again; a compaction running on
     * another thread is not waited for (its mover may need what this thread holds). */
    if (in_mover || !(a->phys.ops->caps & CUMA_PHYS_MOVABLE) || !a->pol->ops->carve) return false;
    cuma_mutex_lock(&h->oom_lock, CUMA_RANK_OOM);
    bool any = h->mover != NULL;
    cuma_mutex_unlock(&h->oom_lock);
    if (!any || cuma_mutex_trylock(&h->compact_run, CUMA_RANK_COMPACT_RUN) != 0) return false;
    cuma_mutex_unlock(&a->lock);
    void *user;
    cuma_move_fn fn = mover_if_needed(h, &user);
    cuma_compact_result r;
    memset(&r, 0, sizeof r);
    if (fn) compact_all(h, fn, user, false, &r);
    cuma_mutex_unlock(&h->compact_run);
    cuma_mutex_lock(&a->lock, CUMA_RANK_ARENA);
    return r.blocks_moved > 0;
}
