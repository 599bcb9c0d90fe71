// SPDX-License-Identifier: Apache-2.0
/* The seed's placement policy: a binary buddy system.
 *
 * Every block is 512 << order bytes at an offset aligned to its size. A request takes the
 * smallest order that holds it, splitting a larger free block in halves as needed; a freed
 * block merges with its buddy (off ^ size) while the buddy is free and whole, so split and
 * merge cost O(log n). Free blocks are found by offset through a hash map, since the buddy's
 * descriptor must be found from an address alone.
 *
 * Internal fragmentation is the price (a request of 1.1 MiB holds 2 MiB of address space), but
 * the heap maps pages only under requested bytes, so the rounding costs virtual space, not
 * device memory, except where a half-used page is shared.
 */
#include "util/error.h"
#include "util/hashmap.h"
#include "place/policy.h"

#include <stdlib.h>

#define MAX_ORDER 40 /* 512 B << 39 = 256 TiB */
#define SCAN      16

/* Invariants (buddy_validate): a free block of order k is on list k and in `byoff`; its size is
 * 512 << k and its offset a multiple of its size, inside a range; no live block is on a list. */
typedef struct buddy {
    cuma_policy base;
    cuma_streams *ss;
    cuma_block *lists[MAX_ORDER];
    cuma_map byoff; /* free blocks by offset */
    cuma_blockpool pool;
    struct {
        uint64_t off, size;
    } ranges[64];
    unsigned nranges;
    uint64_t live_bytes, free_bytes;
} buddy;

static uint64_t order_size(unsigned k) {
    return (uint64_t)CUMA_GRANULE << k;
}

static unsigned order_of(uint64_t size) {
    unsigned k = 0;
    while (order_size(k) < size) k++;
    return k;
}

static void push(buddy *b, cuma_block *x, unsigned k) {
    x->bin_or_order = (uint8_t)k;
    x->fprev = NULL;
    x->fnext = b->lists[k];
    if (x->fnext) x->fnext->fprev = x;
    b->lists[k] = x;
    cuma_map_put(&b->byoff, x->off, x);
    b->free_bytes += x->size;
}

static void pull(buddy *b, cuma_block *x) {
    if (x->fprev)
        x->fprev->fnext = x->fnext;
    else
        b->lists[x->bin_or_order] = x->fnext;
    if (x->fnext) x->fnext->fprev = x->fprev;
    x->fprev = x->fnext = NULL;
    cuma_map_remove(&b->byoff, x->off);
    b->free_bytes -= x->size;
}

static bool usable(const buddy *b, const cuma_block *x, unsigned stream) {
    return x->fence_seq == 0 || x->fence_stream == stream ||
           cuma_fence_known_done(b->ss, x->fence_stream, x->fence_seq);
}

static bool merge_ok(const buddy *b, const cuma_block *x, const cuma_block *y);

static uint64_t buddy_round(uint64_t size) {
    if (size > (1ull << 46)) return 0;
    return order_size(order_of(size ? size : 1));
}

static cuma_block *buddy_alloc(cuma_policy *p, uint64_t size, unsigned stream) {
    buddy *b = (buddy *)p;
    unsigned k = order_of(size);
    cuma_block *x = NULL;
    unsigned j = k;
    for (; j < MAX_ORDER && !x; j++) {
        int n = 0;
        for (cuma_block *c = b->lists[j]; c && n < SCAN; c = c->fnext, n++) {
            if (!usable(b, c, stream)) continue;
            /* Lowest address first keeps live blocks packed into few pages. */
            if (!x || c->off < x->off) x = c;
        }
        /* The usable blocks of this order may all sit past the first SCAN. */
        for (cuma_block *c = b->lists[j]; c && !x; c = c->fnext)
            if (usable(b, c, stream)) x = c;
    }
    if (!x) return NULL;
    j--;
    pull(b, x);
    while (j > k) {
        cuma_block *hi = cuma_block_new(&b->pool);
        if (!hi) {
            push(b, x, j);
            return NULL;
        }
        j--;
        x->size = order_size(j);
        hi->off = x->off + x->size;
        hi->size = x->size;
        hi->is_free = 1;
        hi->fence_stream = x->fence_stream, hi->fence_seq = x->fence_seq;
        push(b, hi, j);
    }
    x->bin_or_order = (uint8_t)k;
    x->is_free = 0;
    x->fence_seq = 0;
    x->req = 0;
    b->live_bytes += x->size;
    return x;
}

static bool in_one_range(const buddy *b, uint64_t off, uint64_t size) {
    for (unsigned i = 0; i < b->nranges; i++)
        if (off >= b->ranges[i].off && off + size <= b->ranges[i].off + b->ranges[i].size)
            return true;
    return false;
}

static cuma_block *buddy_free(cuma_policy *p, cuma_block *x, uint16_t fstream, uint64_t fseq) {
    buddy *b = (buddy *)p;
    b->live_bytes -= x->size;
    x->is_free = 1;
    x->req = 0;
    x->fence_stream = fstream, x->fence_seq = fseq;
    unsigned k = x->bin_or_order;
    while (k + 1 < MAX_ORDER) {
        uint64_t boff = x->off ^ x->size;
        if (!in_one_range(b, x->off < boff ? x->off : boff, x->size * 2)) break;
        cuma_block *y = cuma_map_get(&b->byoff, boff);
        if (!y || y->bin_or_order != k) break;
        /* As in tlsf.c: merge equally reusable memory only, any memory with one stream. */
        if (!merge_ok(b, x, y)) break;
        pull(b, y);
        cuma_fence_join(b->ss, &x->fence_stream, &x->fence_seq, y->fence_stream, y->fence_seq);
        if (y->off < x->off) x->off = y->off;
        x->size *= 2;
        k++;
        cuma_block_delete(&b->pool, y);
    }
    push(b, x, k);
    return x;
}

static cuma_status buddy_add_range(cuma_policy *p, uint64_t off, uint64_t size) {
    buddy *b = (buddy *)p;
    if (size < CUMA_GRANULE || (size & (size - 1)) || off % size)
        return cuma_fail(CUMA_ERR_INVALID,
                         "buddy range [%llu, +%llu) is not a power of two aligned to its size",
                         (unsigned long long)off, (unsigned long long)size);
    if (b->nranges == 64) return cuma_fail(CUMA_ERR_UNSUPPORTED, "buddy: more than 64 ranges");
    unsigned k = order_of(size);
    if (k >= MAX_ORDER) return cuma_fail(CUMA_ERR_INVALID, "buddy range too large");
    cuma_block *x = cuma_block_new(&b->pool);
    if (!x) return cuma_fail(CUMA_ERR_OOM, "no host memory for a block descriptor");
    x->off = off, x->size = size, x->is_free = 1, x->range_end = 1;
    b->ranges[b->nranges].off = off, b->ranges[b->nranges].size = size;
    b->nranges++;
    push(b, x, k);
    return CUMA_OK;
}

static void buddy_remove_range(cuma_policy *p, cuma_block *whole) {
    buddy *b = (buddy *)p;
    for (unsigned i = 0; i < b->nranges; i++) {
        if (b->ranges[i].off != whole->off || b->ranges[i].size != whole->size) continue;
        pull(b, whole);
        b->ranges[i] = b->ranges[--b->nranges];
        cuma_block_delete(&b->pool, whole);
        return;
    }
}

static bool merge_ok(const buddy *b, const cuma_block *x, const cuma_block *y) {
    bool xd = cuma_fence_known_done(b->ss, x->fence_stream, x->fence_seq);
    bool yd = cuma_fence_known_done(b->ss, y->fence_stream, y->fence_seq);
    return b->ss->n <= 1 || ((xd || yd) ? xd && yd : x->fence_stream == y->fence_stream);
}

/* Merges free buddies that were kept apart by fences that have completed since. */
static void buddy_coalesce(cuma_policy *p, void (*fn)(void *, cuma_block *), void *ctx) {
    buddy *b = (buddy *)p;
    for (unsigned k = 0; k + 1 < MAX_ORDER; k++) {
        for (cuma_block *x = b->lists[k], *nx; x; x = nx) {
            nx = x->fnext;
            uint64_t boff = x->off ^ x->size;
            cuma_block *y = cuma_map_get(&b->byoff, boff);
            if (!y || y->bin_or_order != k ||
                !in_one_range(b, x->off < boff ? x->off : boff, x->size * 2) || !merge_ok(b, x, y))
                continue;
            if (nx == y) nx = y->fnext;
            pull(b, x);
            pull(b, y);
            cuma_fence_join(b->ss, &x->fence_stream, &x->fence_seq, y->fence_stream, y->fence_seq);
            if (y->off < x->off) x->off = y->off;
            x->size *= 2;
            cuma_block_delete(&b->pool, y);
            push(b, x, k + 1); /* met again when order k+1 is walked */
        }
    }
    if (!fn) return;
    for (unsigned i = 0; i < b->nranges; i++) {
        cuma_block *w = cuma_map_get(&b->byoff, b->ranges[i].off);
        if (w && w->size == b->ranges[i].size) fn(ctx, w);
    }
}

static uint64_t buddy_largest_free(cuma_policy *p) {
    buddy *b = (buddy *)p;
    for (int k = MAX_ORDER - 1; k >= 0; k--)
        if (b->lists[k]) return order_size((unsigned)k);
    return 0;
}

static bool buddy_validate(cuma_policy *p, const char **why, uint64_t *free_bytes,
                           uint64_t *live_bytes) {
    buddy *b = (buddy *)p;
    uint64_t nfree = 0, fb = 0;
    for (unsigned k = 0; k < MAX_ORDER; k++) {
        for (cuma_block *x = b->lists[k]; x; x = x->fnext) {
            if (x->size != order_size(k) || x->off % x->size)
                return *why = "buddy: free block size or alignment wrong", false;
            if (!x->is_free) return *why = "buddy: live block on a free list", false;
            if (cuma_map_get(&b->byoff, x->off) != x)
                return *why = "buddy: free block missing from the offset map", false;
            if (!in_one_range(b, x->off, x->size))
                return *why = "buddy: free block outside every range", false;
            if (x->fnext && x->fnext->fprev != x)
                return *why = "buddy: free list links broken", false;
            cuma_block *y = cuma_map_get(&b->byoff, x->off ^ x->size);
            if (y && y->bin_or_order == k && !x->fence_seq && !y->fence_seq &&
                in_one_range(b, x->off & ~x->size, x->size * 2))
                return *why = "buddy: two clean free buddies left unmerged", false;
            nfree++;
            fb += x->size;
        }
    }
    if (nfree != b->byoff.count) return *why = "buddy: offset map and free lists disagree", false;
    if (fb != b->free_bytes) return *why = "buddy: free byte count wrong", false;
    uint64_t total = 0;
    for (unsigned i = 0; i < b->nranges; i++) total += b->ranges[i].size;
    if (fb + b->live_bytes != total)
        return *why = "buddy: free + live bytes differ from the ranges", false;
    const char *mwhy;
    if (!cuma_map_validate(&b->byoff, &mwhy)) return *why = mwhy, false;
    *free_bytes = fb, *live_bytes = b->live_bytes;
    return true;
}

static cuma_status buddy_create(cuma_policy **out, cuma_streams *ss, unsigned flags) {
    (void)flags;
    buddy *b = calloc(1, sizeof *b);
    if (!b) return cuma_fail(CUMA_ERR_OOM, "no host memory for the buddy index");
    b->base.ops = &cuma_buddy_ops;
    b->ss = ss;
    cuma_map_init(&b->byoff);
    cuma_blockpool_init(&b->pool);
    *out = &b->base;
    return CUMA_OK;
}

static void buddy_destroy(cuma_policy *p) {
    buddy *b = (buddy *)p;
    if (!b) return;
    cuma_map_destroy(&b->byoff);
    cuma_blockpool_destroy(&b->pool);
    free(b);
}

const cuma_policy_ops cuma_buddy_ops = {
    .name = "buddy",
    .flags = CUMA_POLICY_NEEDS_RANGE,
    .round = buddy_round,
    .create = buddy_create,
    .destroy = buddy_destroy,
    .add_range = buddy_add_range,
    .alloc = buddy_alloc,
    .free = buddy_free,
    .remove_range = buddy_remove_range,
    .coalesce = buddy_coalesce,
    .largest_free = buddy_largest_free,
    .validate = buddy_validate,
};
