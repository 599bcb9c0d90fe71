// SPDX-License-Identifier: Apache-2.0
/* Good-fit placement: a two-level segregated fit (TLSF) index over free blocks, with a short
 * best-fit scan inside the bins it lands on.
 *
 * Free blocks sit in bins by size: the first level is the power of two, the second splits it
 * into 32 sub-bins (about 3% apart), and two bitmaps find the first non-empty bin above a size
 * in O(1). Plain TLSF takes the head of the first bin whose every block is big enough; that
 * wastes up to 3% and ignores the smaller fitting blocks of the request's own bin. Here the
 * request's own bin is scanned first for the smallest fitting block, and the first bins above
 * are scanned for the smallest block (a few entries each), which keeps placement within a
 * hair of exact best fit at a bounded cost. Offsets are in 512-byte granules.
 */
#include "util/error.h"
#include "place/policy.h"

#include <stdlib.h>
#include <string.h>

#define SL_LOG   5
#define SL_COUNT (1u << SL_LOG)
#define FL_COUNT 40
#define SCAN     16 /* blocks examined per bin: bounded work, near-best fit */

/* Invariants (tlsf_validate): bit (fl) of fl_map is set iff sl_map[fl] != 0; bit sl of
 * sl_map[fl] is set iff bins[fl][sl] is non-empty; every free block is in the bin its size
 * maps to; ranges[] lists the first block of every range, and the blocks of a range tile it. */
typedef struct tlsf {
    cuma_policy base;
    cuma_streams *ss;
    unsigned flags;
    uint64_t fl_map;
    uint32_t sl_map[FL_COUNT];
    cuma_block *bins[FL_COUNT][SL_COUNT];
    cuma_blockpool pool;
    cuma_block **ranges;
    size_t nranges, capranges;
} tlsf;

static unsigned msb64(uint64_t x) {
    return 63u - (unsigned)__builtin_clzll(x);
}

static void mapping(uint64_t size, unsigned *fl, unsigned *sl) {
    uint64_t g = size / CUMA_GRANULE;
    if (g < SL_COUNT) {
        *fl = 0, *sl = (unsigned)g;
        return;
    }
    unsigned f = msb64(g);
    *fl = f - SL_LOG + 1;
    *sl = (unsigned)(g >> (f - SL_LOG)) & (SL_COUNT - 1);
}

static void insert(tlsf *t, cuma_block *b) {
    unsigned fl, sl;
    mapping(b->size, &fl, &sl);
    b->fprev = NULL;
    b->fnext = t->bins[fl][sl];
    if (b->fnext) b->fnext->fprev = b;
    t->bins[fl][sl] = b;
    t->fl_map |= 1ull << fl;
    t->sl_map[fl] |= 1u << sl;
    b->bin_or_order = (uint8_t)fl;
}

static void unlink_free(tlsf *t, cuma_block *b) {
    unsigned fl, sl;
    mapping(b->size, &fl, &sl);
    if (b->fprev)
        b->fprev->fnext = b->fnext;
    else
        t->bins[fl][sl] = b->fnext;
    if (b->fnext) b->fnext->fprev = b->fprev;
    b->fprev = b->fnext = NULL;
    if (!t->bins[fl][sl]) {
        t->sl_map[fl] &= ~(1u << sl);
        if (!t->sl_map[fl]) t->fl_map &= ~(1ull << fl);
    }
}

static bool usable(const tlsf *t, const cuma_block *b, unsigned stream) {
    return b->fence_seq == 0 || b->fence_stream == stream ||
           cuma_fence_known_done(t->ss, b->fence_stream, b->fence_seq);
}

static bool better(const cuma_block *b, const cuma_block *best) {
    return !best || b->size < best->size || (b->size == best->size && b->off < best->off);
}

/* The smallest usable block of at least `size` among the first `limit` of a bin. */
static cuma_block *scan_bin(tlsf *t, cuma_block *head, uint64_t size, unsigned stream,
                            uint64_t limit) {
    cuma_block *best = NULL;
    uint64_t n = 0;
    for (cuma_block *b = head; b && n < limit; b = b->fnext, n++) {
        if (b->size < size || !better(b, best) || !usable(t, b, stream)) continue;
        best = b;
        if (b->size == size) break;
    }
    return best;
}

/* The non-empty bins from (fl, sl) up, in order of size, by the bitmaps: the first level's bin
 * and what is left of its second-level mask are held, so that each step costs a bit scan, not
 * a look-up of both maps again. */
typedef struct bin_walk {
    unsigned fl;
    uint32_t sm; /* sl_map[fl]'s bins not yet visited */
} bin_walk;

static bin_walk walk_from(const tlsf *t, unsigned fl, unsigned sl) {
    return (bin_walk){fl, sl < SL_COUNT ? t->sl_map[fl] & (~0u << sl) : 0};
}

/* The next non-empty bin's head, or NULL when none is left. Inlined: called out of line, the
 * walk cost the packing's loop 4 more instructions per replayed operation (bench/profile.sh,
 * lstm_phases x16). */
__attribute__((always_inline)) static inline cuma_block *walk_next(const tlsf *t, bin_walk *w) {
    if (!w->sm) {
        uint64_t fm = w->fl + 1 < FL_COUNT ? t->fl_map & (~0ull << (w->fl + 1)) : 0;
        if (!fm) return NULL;
        w->fl = (unsigned)__builtin_ctzll(fm);
        w->sm = t->sl_map[w->fl];
    }
    unsigned sl = (unsigned)__builtin_ctz(w->sm);
    w->sm &= w->sm - 1;
    return t->bins[w->fl][sl];
}

/* Free neighbours merge when their memory is equally reusable: both complete, or both waiting
 * on the same stream. Merging pending memory into complete memory would make the complete part
 * unusable for other streams until the fence completes; with a single stream there are no other
 * streams, so it merges, except into the range's last block (the untouched top of the range),
 * which stays clean so that a stream that appears later finds space at once. */
static bool mergeable(const tlsf *t, const cuma_block *a, const cuma_block *b) {
    bool ad = cuma_fence_known_done(t->ss, a->fence_stream, a->fence_seq);
    bool bd = cuma_fence_known_done(t->ss, b->fence_stream, b->fence_seq);
    if (ad && bd) return true;
    if (!ad && !bd) return a->fence_stream == b->fence_stream;
    if (t->ss->n > 1) return false;
    return !((t->flags & CUMA_POLICY_KEEP_TOP_CLEAN) && (ad ? a : b)->range_end);
}

/* Absorbs `n` (the next block, free and unlinked) into `b`. */
static void absorb(tlsf *t, cuma_block *b, cuma_block *n) {
    cuma_fence_join(t->ss, &b->fence_stream, &b->fence_seq, n->fence_stream, n->fence_seq);
    b->size += n->size;
    b->next = n->next;
    if (b->next) b->next->prev = b;
    b->range_end = n->range_end;
    cuma_block_delete(&t->pool, n);
}

/* A free block of [off, off+size) split off f's side at `at` (after: the part from at on). */
static cuma_block *split_free(tlsf *t, cuma_block *f, uint64_t at) {
    cuma_block *r = cuma_block_new(&t->pool);
    if (!r) return NULL;
    r->off = at;
    r->size = f->off + f->size - at;
    r->prev = f, r->next = f->next;
    if (r->next) r->next->prev = r;
    f->next = r;
    r->is_free = 1;
    r->fence_seq = f->fence_seq, r->fence_stream = f->fence_stream;
    r->range_end = f->range_end, f->range_end = 0;
    f->size = at - f->off;
    return r;
}

/* Units a block at [off, off + size) would need that hold nothing in use yet: all it spans but
 * its first and last where live memory is there already (a unit wholly inside a free block holds
 * none, so only the ends can be shared). */
static uint64_t fresh_units(const cuma_place_hint *h, uint64_t off, uint64_t size) {
    uint64_t lo = off >> h->shift, hi = (off + size - 1) >> h->shift, n = hi - lo + 1;
    if (hi >= h->n) return n;
    if (h->used[lo]) n--;
    if (hi != lo && h->used[hi]) n--;
    return n;
}

/* *at: the end of free block f where a block of `size` needs the fewer fresh units: its start,
 * or its top where a live block holds the unit there and not the start's (a hole that ends
 * inside a page in use). Never the top of a range's last block, which stays untouched. */
static void place_end(const cuma_place_hint *h, const cuma_block *f, uint64_t size, uint64_t *at) {
    uint64_t c = fresh_units(h, f->off, size);
    *at = f->off;
    if (c && f->size > size && !f->range_end) {
        uint64_t top = f->off + f->size - size;
        if (fresh_units(h, top, size) < c) *at = top;
    }
}

/* Fitting blocks looked at beyond the best fit, by size from the request's bin up (8 find
 * what an unbounded search finds on the traces of bench/workloads), and blocks visited at most,
 * fitting or not (the request's own bin may hold many that are too small). */
#define HINT_SCAN  8
#define HINT_VISIT 32

/* Placement of a block smaller than a unit where the units are known (the hint): the lowest
 * address among the best fit and the next fitting blocks, at the end of it that needs fewer
 * fresh units. Small blocks of mixed lifetimes (activations saved for the backward pass among
 * temporaries) then pack from the bottom of the range: the holes the short-lived ones leave are
 * refilled before a unit higher up is touched, and the units above empty out, where best fit
 * scatters them over units that all stay in use (docs/WORKLOADS.md). Blocks under 1/32 of a
 * unit keep the best fit: their holes strand little, and they are most of the calls. */
static cuma_block *hint_choose(tlsf *t, cuma_block *best, uint64_t size, unsigned stream,
                               uint64_t *at) {
    unsigned fl, sl, n = 0, seen = 0;
    mapping(size, &fl, &sl);
    bin_walk w = walk_from(t, fl, sl);
    cuma_block *pick = best, *head;
    while (n < HINT_SCAN && seen < HINT_VISIT && (head = walk_next(t, &w))) {
        for (cuma_block *b = head; b && n < HINT_SCAN && seen < HINT_VISIT; b = b->fnext, seen++) {
            if (b == best || b->size < size || !usable(t, b, stream)) continue;
            n++;
            if (b->off < pick->off) pick = b;
        }
    }
    place_end(&t->base.hint, pick, size, at);
    return pick;
}

static cuma_block *tlsf_alloc(cuma_policy *p, uint64_t size, unsigned stream) {
    tlsf *t = (tlsf *)p;
    unsigned fl, sl;
    mapping(size, &fl, &sl);
    cuma_block *best = scan_bin(t, t->bins[fl][sl], size, stream, SCAN);
    /* Every block of a higher bin fits; the first bin with a usable block holds the
     * smallest ones. A bin's usable blocks may all sit past the first SCAN (behind blocks
     * still fenced by another stream), so a bin that yields none is walked whole. */
    if (!best) {
        bin_walk w = walk_from(t, fl, sl + 1);
        for (cuma_block *head; !best && (head = walk_next(t, &w));) {
            best = scan_bin(t, head, size, stream, SCAN);
            if (!best) best = scan_bin(t, head, size, stream, UINT64_MAX);
        }
    }
    /* Last resort: the request's own bin, whole (its first blocks may all be too small). */
    if (!best) best = scan_bin(t, t->bins[fl][sl], size, stream, UINT64_MAX);
    if (!best) return NULL;
    uint64_t at = best->off;
    const cuma_place_hint *h = &t->base.hint;
    if (h->used && size < (1ull << h->shift) && size >= (1ull << h->shift) >> 5)
        best = hint_choose(t, best, size, stream, &at);
    unlink_free(t, best);
    /* Fences complete after blocks were freed: neighbours left apart then may merge now, and
     * the remainder of the split below is larger for it. */
    for (cuma_block *n;
         (n = best->range_end ? NULL : best->next) && n->is_free && mergeable(t, best, n);) {
        unlink_free(t, n);
        absorb(t, best, n);
    }
    for (cuma_block *pv; (pv = best->prev) && pv->is_free && mergeable(t, pv, best);) {
        unlink_free(t, pv);
        absorb(t, pv, best);
        best = pv;
    }
    /* Placed above the block's start (hint_choose): what lies below stays free. */
    if (at > best->off) {
        cuma_block *hi = split_free(t, best, at);
        if (hi) {
            insert(t, best);
            best = hi;
        }
    }
    if (best->size - size >= CUMA_GRANULE) {
        cuma_block *r = cuma_block_new(&t->pool);
        if (r) {
            r->off = best->off + size;
            r->size = best->size - size;
            r->prev = best, r->next = best->next;
            if (r->next) r->next->prev = r;
            best->next = r;
            r->is_free = 1;
            r->fence_seq = best->fence_seq, r->fence_stream = best->fence_stream;
            r->range_end = best->range_end, best->range_end = 0;
            best->size = size;
            insert(t, r);
        }
    }
    best->is_free = 0;
    best->fence_seq = 0;
    best->req = 0;
    return best;
}

static cuma_block *tlsf_free(cuma_policy *p, cuma_block *b, uint16_t fstream, uint64_t fseq) {
    tlsf *t = (tlsf *)p;
    b->is_free = 1;
    b->req = 0;
    b->fence_stream = fstream, b->fence_seq = fseq;
    cuma_block *n = b->range_end ? NULL : b->next;
    if (n && n->is_free && mergeable(t, b, n)) {
        unlink_free(t, n);
        absorb(t, b, n);
    }
    cuma_block *pv = b->prev;
    if (pv && pv->is_free && !pv->range_end && mergeable(t, pv, b)) {
        unlink_free(t, pv);
        absorb(t, pv, b);
        b = pv;
    }
    insert(t, b);
    return b;
}

static cuma_status tlsf_add_range(cuma_policy *p, uint64_t off, uint64_t size) {
    tlsf *t = (tlsf *)p;
    if (!size || off % CUMA_GRANULE || size % CUMA_GRANULE)
        return cuma_fail(CUMA_ERR_INVALID, "range [%llu, +%llu) not in whole granules",
                         (unsigned long long)off, (unsigned long long)size);
    if (t->nranges == t->capranges) {
        size_t nc = t->capranges ? t->capranges * 2 : 8;
        cuma_block **nr = realloc(t->ranges, nc * sizeof *nr);
        if (!nr) return cuma_fail(CUMA_ERR_OOM, "no host memory for the range table");
        t->ranges = nr, t->capranges = nc;
    }
    cuma_block *b = cuma_block_new(&t->pool);
    if (!b) return cuma_fail(CUMA_ERR_OOM, "no host memory for a block descriptor");
    b->off = off, b->size = size, b->is_free = 1, b->range_end = 1;
    t->ranges[t->nranges++] = b;
    insert(t, b);
    return CUMA_OK;
}

static void tlsf_remove_range(cuma_policy *p, cuma_block *whole) {
    tlsf *t = (tlsf *)p;
    for (size_t i = 0; i < t->nranges; i++) {
        if (t->ranges[i] != whole) continue;
        unlink_free(t, whole);
        t->ranges[i] = t->ranges[--t->nranges];
        cuma_block_delete(&t->pool, whole);
        return;
    }
}

static uint64_t tlsf_largest_free(cuma_policy *p) {
    tlsf *t = (tlsf *)p;
    if (!t->fl_map) return 0;
    unsigned fl = msb64(t->fl_map), sl = 31u - (unsigned)__builtin_clz(t->sl_map[fl]);
    uint64_t m = 0;
    for (cuma_block *b = t->bins[fl][sl]; b; b = b->fnext)
        if (b->size > m) m = b->size;
    return m;
}

static void tlsf_coalesce(cuma_policy *p, void (*fn)(void *, cuma_block *), void *ctx) {
    tlsf *t = (tlsf *)p;
    for (size_t r = 0; r < t->nranges; r++) {
        for (cuma_block *b = t->ranges[r]; b; b = b->range_end ? NULL : b->next) {
            if (!b->is_free) continue;
            bool merged = false;
            for (cuma_block *n;
                 (n = b->range_end ? NULL : b->next) && n->is_free && mergeable(t, b, n);) {
                if (!merged) unlink_free(t, b);
                merged = true;
                unlink_free(t, n);
                absorb(t, b, n);
            }
            if (merged) insert(t, b);
            if (!b->prev && b->range_end && fn) fn(ctx, b);
        }
    }
}

static cuma_block *tlsf_first(cuma_policy *p) {
    tlsf *t = (tlsf *)p;
    return t->nranges ? t->ranges[0] : NULL;
}

static cuma_block *tlsf_carve(cuma_policy *p, cuma_block *f, uint64_t off, uint64_t size) {
    tlsf *t = (tlsf *)p;
    bool lead = off > f->off, trail = off + size < f->off + f->size;
    /* Both descriptors first, so that a failure leaves f as it was. */
    cuma_block *a = lead ? cuma_block_new(&t->pool) : NULL;
    cuma_block *z = trail ? cuma_block_new(&t->pool) : NULL;
    if ((lead && !a) || (trail && !z)) {
        if (a) cuma_block_delete(&t->pool, a);
        if (z) cuma_block_delete(&t->pool, z);
        return NULL;
    }
    if (a) cuma_block_delete(&t->pool, a), a = NULL;
    if (z) cuma_block_delete(&t->pool, z), z = NULL;
    unlink_free(t, f);
    cuma_block *b = f;
    if (lead) {
        b = split_free(t, f, off); /* f keeps the leading part */
        insert(t, f);
    }
    if (trail) insert(t, split_free(t, b, off + size));
    b->is_free = 0;
    b->fence_seq = 0;
    b->fence_stream = 0;
    b->req = 0;
    return b;
}

static uint64_t tlsf_round(uint64_t size) {
    if (size > (1ull << 47)) return 0;
    if (size == 0) size = 1;
    return (size + CUMA_GRANULE - 1) & ~(uint64_t)(CUMA_GRANULE - 1);
}

static bool tlsf_validate(cuma_policy *p, const char **why, uint64_t *free_bytes,
                          uint64_t *live_bytes) {
    tlsf *t = (tlsf *)p;
    uint64_t nfree_walk = 0, nfree_lists = 0;
    *free_bytes = *live_bytes = 0;
    for (size_t r = 0; r < t->nranges; r++) {
        cuma_block *b = t->ranges[r];
        if (b->prev) return *why = "tlsf: range head has a predecessor", false;
        for (; b; b = b->range_end ? NULL : b->next) {
            if (!b->size || b->size % CUMA_GRANULE || b->off % CUMA_GRANULE)
                return *why = "tlsf: block not in whole granules", false;
            if (!b->range_end &&
                (!b->next || b->next->off != b->off + b->size || b->next->prev != b))
                return *why = "tlsf: blocks of a range do not tile it", false;
            if (b->is_free) {
                nfree_walk++;
                *free_bytes += b->size;
                if (b->req) return *why = "tlsf: free block has requested bytes", false;
            } else {
                *live_bytes += b->size;
                if (b->req > b->size)
                    return *why = "tlsf: live block smaller than its request", false;
            }
        }
    }
    for (unsigned fl = 0; fl < FL_COUNT; fl++) {
        if (!!(t->fl_map & (1ull << fl)) != !!t->sl_map[fl])
            return *why = "tlsf: first-level bitmap wrong", false;
        for (unsigned sl = 0; sl < SL_COUNT; sl++) {
            if (!!(t->sl_map[fl] & (1u << sl)) != !!t->bins[fl][sl])
                return *why = "tlsf: second-level bitmap wrong", false;
            for (cuma_block *b = t->bins[fl][sl]; b; b = b->fnext) {
                unsigned f2, s2;
                mapping(b->size, &f2, &s2);
                if (f2 != fl || s2 != sl) return *why = "tlsf: free block in the wrong bin", false;
                if (!b->is_free) return *why = "tlsf: live block on a free list", false;
                if (b->fnext && b->fnext->fprev != b)
                    return *why = "tlsf: free list links broken", false;
                if (++nfree_lists > nfree_walk)
                    return *why = "tlsf: more blocks on free lists than free", false;
            }
        }
    }
    if (nfree_lists != nfree_walk) return *why = "tlsf: a free block is on no free list", false;
    return true;
}

static cuma_status tlsf_create(cuma_policy **out, cuma_streams *ss, unsigned flags) {
    tlsf *t = calloc(1, sizeof *t);
    if (!t) return cuma_fail(CUMA_ERR_OOM, "no host memory for the tlsf index");
    t->base.ops = &cuma_tlsf_ops;
    t->ss = ss;
    t->flags = flags;
    cuma_blockpool_init(&t->pool);
    *out = &t->base;
    return CUMA_OK;
}

static void tlsf_destroy(cuma_policy *p) {
    tlsf *t = (tlsf *)p;
    if (!t) return;
    cuma_blockpool_destroy(&t->pool);
    free(t->ranges);
    free(t);
}

const cuma_policy_ops cuma_tlsf_ops = {
    .name = "tlsf",
    .flags = CUMA_POLICY_GRANULE_ROUND,
    .round = tlsf_round,
    .create = tlsf_create,
    .destroy = tlsf_destroy,
    .add_range = tlsf_add_range,
    .alloc = tlsf_alloc,
    .free = tlsf_free,
    .remove_range = tlsf_remove_range,
    .coalesce = tlsf_coalesce,
    .first = tlsf_first,
    .carve = tlsf_carve,
    .largest_free = tlsf_largest_free,
    .validate = tlsf_validate,
};

/* Block descriptors come from chunks of 1024, recycled through a free list: the heap's hot
 * path never calls malloc for metadata once warm. */
#define CHUNK 1024

void cuma_blockpool_init(cuma_blockpool *bp) {
    memset(bp, 0, sizeof *bp);
}

void cuma_blockpool_destroy(cuma_blockpool *bp) {
    for (size_t i = 0; i < bp->nchunks; i++) free(bp->chunks[i]);
    free(bp->chunks);
    memset(bp, 0, sizeof *bp);
}

cuma_block *cuma_block_new(cuma_blockpool *bp) {
    if (!bp->free_list) {
        if (bp->nchunks == bp->capchunks) {
            size_t nc = bp->capchunks ? bp->capchunks * 2 : 16;
            void **n = realloc(bp->chunks, nc * sizeof *n);
            if (!n) return NULL;
            bp->chunks = n, bp->capchunks = nc;
        }
        /* At the type's alignment, which calloc does not give a chunk this large (an mmap'd
         * chunk starts 16 bytes into its page): descriptors that share a line with their
         * neighbours make two threads' fast paths, each writing its own block, miss on it. */
        cuma_block *c = aligned_alloc(_Alignof(cuma_block), CHUNK * sizeof *c);
        if (!c) return NULL;
        memset(c, 0, CHUNK * sizeof *c);
        bp->chunks[bp->nchunks++] = c;
        for (int i = CHUNK - 1; i >= 0; i--) c[i].fnext = bp->free_list, bp->free_list = &c[i];
    }
    cuma_block *b = bp->free_list;
    bp->free_list = b->fnext;
    /* The generation only grows, also across recycling, so a stale reference never matches. */
    uint64_t gen = atomic_load_explicit(&b->gen, memory_order_relaxed);
    memset(b, 0, sizeof *b);
    atomic_store_explicit(&b->gen, (gen + 2) & ~1ull, memory_order_relaxed);
    b->extra[0] = b->extra[1] = CUMA_NO_STREAM;
    bp->live++;
    return b;
}

void cuma_block_delete(cuma_blockpool *bp, cuma_block *b) {
    b->fnext = bp->free_list;
    bp->free_list = b;
    bp->live--;
}
