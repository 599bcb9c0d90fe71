// SPDX-License-Identifier: Apache-2.0
/* The physical layer of an arena: where the memory under the blocks the placement policy hands
 * out comes from, where it idles and when it goes back. Two implementations, one chosen when an
 * arena is built (cuma_phys_choose, from the backend's capabilities) and constant after:
 *
 *   cuma_phys_pages     pages under live bytes (pages.h, phys_pages.c): the arena reserves one
 *                       virtual range of va_size, which the policy holds from the start; a page
 *                       is mapped while requested bytes of a live block overlap it, and idles
 *                       in a cache when none does.
 *   cuma_phys_segments  whole segments (segments.h, phys_segments.c), for backends without
 *                       virtual memory management: physical memory comes in segments from the
 *                       driver, each a range of the policy's own, idle once all of it is free.
 *
 * The heap reaches the layer only through its cuma_physmem (a->phys): the operations below,
 * the capabilities they report, and the figures the layer keeps current. It never asks which
 * layer it has; what differs between them is said here, once.
 *
 * Contract of every operation:
 * - It takes the arena `a` and runs under a->lock, or while the arena is built or torn down
 *   (no other thread sees it then). It takes no other lock but the backend's own (a shared
 *   backend serialises its calls, cuma_backend_locked) and never drops a->lock.
 * - Sizes are bytes, times the heap's clock (cuma_arena_now). A failed operation leaves the
 *   layer, the policy and the figures as it found them, and says why (cuma_fail).
 * - Memory goes back to the device only once the work of the streams that last used it is
 *   complete (its fence); an idle unit whose fence is pending stays, and stays due.
 * - The figures (cuma_physmem) are exact whenever a->lock is free: every operation leaves them
 *   so. nall is read lock-free (peaks), the others under a->lock.
 */
#ifndef CUMA_HEAP_PHYS_H
#define CUMA_HEAP_PHYS_H

#include "backend/backend.h"
#include "place/block.h"

#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>

typedef struct cuma_arena cuma_arena;

/* Capabilities (cuma_phys_ops.caps): what the heap may do on top of the layer. */
enum {
    /* The arena's addresses are one range of a->va_size at a->base, given to the policy whole
     * when the arena is built: policy:buddy can place in it, its top is kept clean for every
     * stream (CUMA_POLICY_KEEP_TOP_CLEAN), and a heap can have several arenas (each its own
     * range). Without it the policy's ranges come and go with the layer's memory. */
    CUMA_PHYS_RANGE = 1u << 0,
    /* Bytes of a block past its request hold no memory of their own (only requested bytes are
     * backed): rounding requests to size classes, as thread caches do, costs nothing. */
    CUMA_PHYS_SLACK_FREE = 1u << 1,
    /* A block moved elsewhere can empty a unit that then goes back: compaction (compact.c,
     * which then reads a->pages). */
    CUMA_PHYS_MOVABLE = 1u << 2,
};

typedef struct cuma_phys_ops {
    const char *name; /* "pages" or "segments": the stats' "mode" */
    unsigned caps;    /* CUMA_PHYS_* */
    /* Sets the layer up over a->be, a->pol (created, holding no range) and a->streams, and
     * fills a->phys's figures; with CUMA_PHYS_RANGE also sets a->base and a->va_size and gives
     * the range to the policy. On failure nothing is left to undo. */
    cuma_status (*init)(cuma_arena *a);
    /* Gives everything back to the device (the policy is destroyed after). */
    void (*destroy)(cuma_arena *a);
    /* The limit on the arena's memory: `bytes` in all arenas (nall); is_device: reaching it
     * means the device is full (CUMA_ERR_OOM), otherwise CUMA_ERR_LIMIT. */
    void (*set_limit)(cuma_arena *a, uint64_t bytes, bool is_device);
    /* Makes at least `bytes` idle up front (preallocate) that never go back. */
    cuma_status (*prefill)(cuma_arena *a, uint64_t bytes, uint64_t now);
    /* The largest request the layer could ever serve (larger ones are out of memory at once). */
    uint64_t (*max_request)(const cuma_arena *a);
    /* Backs the block the policy placed for a request of `req` bytes rounded to n, used from
     * stream index `stream`: *b, or NULL when the policy had none, in which case the layer may
     * add memory and place again. On success *b is live and backed for its first req bytes; on
     * failure (CUMA_ERR_OOM, CUMA_ERR_LIMIT, CUMA_ERR_BACKEND) a placed block went back to the
     * policy. */
    cuma_status (*back)(cuma_arena *a, cuma_block **b, uint64_t req, uint64_t n, unsigned stream,
                        uint64_t now);
    /* Gives live block b back to the policy (b->mapped_len bytes backed), with the fence of its
     * free; what no live byte holds any more idles from `now`. */
    void (*free)(cuma_arena *a, cuma_block *b, uint16_t fence_stream, uint64_t fence_seq,
                 uint64_t now);
    /* For the policy's coalesce (context: the arena): a range became one free block again and
     * idles. NULL where a merge frees no memory (pages idle by their live bytes alone), so the
     * heap need not merge between releases. */
    void (*whole)(void *a, cuma_block *whole);
    /* Gives back idle memory: what has idled for delay_ns (< 0: none by age) while more than
     * age_keep_bytes idle, then the oldest while more than max_cached_bytes idle; `wait`: block
     * on pending fences where the backend can. Returns the bytes given back. */
    uint64_t (*release)(cuma_arena *a, uint64_t now, int64_t delay_ns, uint64_t max_cached_bytes,
                        uint64_t age_keep_bytes, bool wait);
    /* Drops the old mappings (*nlagging of them) whose work completed. */
    void (*reap)(cuma_arena *a, bool wait);
    /* When the oldest idle memory went idle (UINT64_MAX: none idle). */
    uint64_t (*oldest_idle)(const cuma_arena *a);
    /* Bytes the device must give the arena before a failed request of n bytes could fit: what
     * the heap asks other processes for (pressure.c). */
    uint64_t (*growth)(const cuma_arena *a, uint64_t n);
    /* The bytes of address space the policy holds (free + live blocks). */
    uint64_t (*range_bytes)(const cuma_arena *a);
    /* Units (pages, segments) created from and given back to the device so far. */
    void (*counts)(const cuma_arena *a, uint64_t *creates, uint64_t *releases);
    /* The layer's own invariants. */
    bool (*validate)(const cuma_arena *a, const char **why);
} cuma_phys_ops;

extern const cuma_phys_ops cuma_phys_pages;
extern const cuma_phys_ops cuma_phys_segments;

/* An arena's physical layer as the heap sees it: its operations and the figures it keeps, read
 * without a call on every allocation and free. A unit is 1 << shift bytes (a page, or a byte
 * where the layer counts bytes). Invariants: *ncached <= *nreserved <= *nall; nall is the same
 * counter for every arena of a heap; refs[v] (v < nrefs) counts the live and deferred blocks
 * whose first mapped_len bytes overlap unit v. */
typedef struct cuma_physmem {
    const cuma_phys_ops *ops;
    unsigned shift;
    const uint64_t *nreserved; /* units the arena holds from the device */
    const uint64_t *ncached;   /* of those, the idle ones */
    _Atomic uint64_t *nall;    /* units every arena of the heap holds: what the limit bounds */
    const uint32_t *nlagging;  /* old mappings kept for pending work (reap drops them) */
    const uint32_t *refs;      /* per unit of the range, or NULL: the layer counts no blocks */
    uint32_t nrefs;
} cuma_physmem;

/* The layer for a backend: pages where it maps memory into a virtual range, else segments
 * where it hands out whole allocations; NULL for neither. */
static inline const cuma_phys_ops *cuma_phys_choose(const cuma_backend *be) {
    return (be->caps & CUMA_CAP_VMM)        ? &cuma_phys_pages
           : (be->caps & CUMA_CAP_SEGMENTS) ? &cuma_phys_segments
                                            : NULL;
}

static inline uint64_t cuma_phys_reserved(const cuma_physmem *p) {
    return *p->nreserved << p->shift;
}
static inline uint64_t cuma_phys_cached(const cuma_physmem *p) {
    return *p->ncached << p->shift;
}
static inline uint64_t cuma_phys_reserved_all(const cuma_physmem *p) {
    return atomic_load_explicit(p->nall, memory_order_relaxed) << p->shift;
}

#endif
