// SPDX-License-Identifier: Apache-2.0
/* Placement policies: where in the address space a block goes. A policy only manages offsets
 * and sizes inside the ranges it is given; it never touches memory or pages.
 *
 * Not thread-safe: the heap lock protects a policy.
 */
#ifndef CUMA_PLACE_POLICY_H
#define CUMA_PLACE_POLICY_H

#include "place/block.h"
#include "cuma/cuma.h"
#include "place/streams.h"

#include <stdbool.h>
#include <stdint.h>

#define CUMA_GRANULE 512u

typedef struct cuma_policy cuma_policy;

typedef struct cuma_policy_ops {
    const char *name;
    unsigned flags; /* CUMA_POLICY_NEEDS_RANGE, CUMA_POLICY_GRANULE_ROUND */
    /* Rounds a request to the size the policy will hand out (0 on overflow). */
    uint64_t (*round)(uint64_t size);
    /* flags: CUMA_POLICY_KEEP_TOP_CLEAN (one large range whose untouched top should stay
     * usable by every stream). */
    cuma_status (*create)(cuma_policy **out, cuma_streams *ss, unsigned flags);
    void (*destroy)(cuma_policy *p);
    /* Adds a range of free address space [off, off+size). The buddy needs a power-of-two
     * size and alignment. */
    cuma_status (*add_range)(cuma_policy *p, uint64_t off, uint64_t size);
    /* Finds a free block of at least `size` (already rounded) that stream index `stream`
     * may use now (its fence is the stream's own or known complete), splits it and returns
     * it marked live. NULL when none fits. */
    cuma_block *(*alloc)(cuma_policy *p, uint64_t size, unsigned stream);
    /* Returns a live block, tagged with the fence of its free; merges with free neighbours
     * whose fences allow it. Returns the (possibly merged) free block. */
    cuma_block *(*free)(cuma_policy *p, cuma_block *b, uint16_t fence_stream, uint64_t fence_seq);
    /* Removes a range that is entirely one free block (segments). */
    void (*remove_range)(cuma_policy *p, cuma_block *whole);
    /* Merges free neighbours that fences now allow to merge (they complete after the free);
     * calls fn for every free block that then spans a whole range. */
    void (*coalesce)(cuma_policy *p, void (*fn)(void *ctx, cuma_block *whole), void *ctx);
    /* Compaction (compact.c); NULL in a policy that cannot place at a chosen address (the
     * buddy places by order). first: the first block of the first range, whose blocks follow
     * by `next` (to the one marked range_end). carve: takes [off, off+size) out of free block
     * `f` (which holds it), marked live with req 0; what is left of f on either side stays
     * free with f's fence, unmerged (the neighbours are then the returned block's prev and
     * next). NULL when no descriptor could be had; f is then unchanged. */
    cuma_block *(*first)(cuma_policy *p);
    cuma_block *(*carve)(cuma_policy *p, cuma_block *f, uint64_t off, uint64_t size);
    /* Largest free block (bytes), for stats. */
    uint64_t (*largest_free)(cuma_policy *p);
    bool (*validate)(cuma_policy *p, const char **why, uint64_t *free_bytes, uint64_t *live_bytes);
} cuma_policy_ops;

#define CUMA_POLICY_KEEP_TOP_CLEAN 1u

/* ops->flags. NEEDS_RANGE: it places in one virtual range only, not in segments (the buddy's
 * power-of-two ranges). GRANULE_ROUND: round() is to a multiple of CUMA_GRANULE, which the heap
 * then does inline on its fast path (and thread-cache size classes may stand for it). */
#define CUMA_POLICY_NEEDS_RANGE   1u
#define CUMA_POLICY_GRANULE_ROUND 2u

/* The policy of that name (settings/policies.h lists them), or NULL. */
const cuma_policy_ops *cuma_policy_find(const char *name);

/* Which units of the range hold memory in use, for a policy that can choose among blocks by
 * it: used[u] != 0 while bytes [u << shift, (u + 1) << shift) of the policy's offsets are under
 * a live block, so that a block placed there needs no unit of memory it does not have already
 * (the heap sets it from its physical layer; used == NULL: no hint). The policy only reads it,
 * at alloc; it changes outside the policy's calls. */
typedef struct cuma_place_hint {
    const uint32_t *used;
    uint32_t n; /* units in used[] */
    unsigned shift;
} cuma_place_hint;

struct cuma_policy {
    const cuma_policy_ops *ops;
    cuma_place_hint hint;
};

extern const cuma_policy_ops cuma_tlsf_ops;
extern const cuma_policy_ops cuma_buddy_ops;

/* Pool of block descriptors shared by the policies' implementations. */
typedef struct cuma_blockpool {
    cuma_block *free_list;
    void **chunks;
    size_t nchunks, capchunks;
    uint64_t live;
} cuma_blockpool;

void cuma_blockpool_init(cuma_blockpool *bp);
void cuma_blockpool_destroy(cuma_blockpool *bp);
cuma_block *cuma_block_new(cuma_blockpool *bp);
void cuma_block_delete(cuma_blockpool *bp, cuma_block *b);

#endif
