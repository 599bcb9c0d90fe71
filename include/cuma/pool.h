// SPDX-License-Identifier: Apache-2.0
/* cuma fixed-size pools: N blocks of one size, carved from a heap once and reused.
 *
 * For intermediate results whose size never changes (batch-norm statistics, per-step scratch),
 * a pool takes one allocation of count * stride bytes from its heap at creation (cuma_alloc on
 * the pool's stream; stride is the size rounded up to CUMA_POOL_ALIGN) and hands its blocks out
 * from a stack of free block indices: cuma_pool_alloc and cuma_pool_free take constant time
 * whatever the pool's size, touch neither the heap's lock nor the device, and never fail for
 * want of device memory once the pool exists. The carve stays allocated (and its pages mapped)
 * until cuma_pool_destroy: the heap's release policy, cuma_trim and out-of-memory recovery
 * never take it back. One carve rather than a cuma_alloc per block: one live allocation in the
 * heap's tables instead of N, no per-block rounding, and blocks packed side by side.
 *
 * A freed block is handed out again by the next cuma_pool_alloc at once, with no stream fence:
 * use the blocks on the pool's stream, or order other streams' work before the free yourself.
 *
 * The heap counts its pools in cuma_stats (pools, pool_bytes, pool_blocks, pool_blocks_in_use)
 * and in the stats JSON. The carve is one live allocation of the heap (in allocated_bytes and
 * active_allocs); the blocks handed out of a pool are not counted as allocations.
 *
 * Thread safety: cuma_pool_alloc, cuma_pool_free, cuma_pool_info and cuma_pool_validate may be
 * called on one pool from any threads concurrently (one mutex per pool). cuma_pool_destroy must
 * not race with other calls on the same pool. cuma_heap_destroy frees the pools still left on
 * the heap: their handles, like its pointers, become invalid.
 */
#ifndef CUMA_POOL_H
#define CUMA_POOL_H

#include "cuma.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Every block starts on a multiple of this (the heap's own alignment). */
#define CUMA_POOL_ALIGN 256

/* Opaque pool handle. */
typedef struct cuma_pool cuma_pool;

/* Creates a pool of `count` blocks of `size` bytes on `heap`, carved at once as one allocation
 * usable on `stream`. size 0, count 0, count over UINT32_MAX, and a stride * count that does not
 * fit in size_t are CUMA_ERR_INVALID; a carve the heap cannot serve fails as cuma_alloc does
 * (CUMA_ERR_OOM, CUMA_ERR_LIMIT), naming the pool's size. */
cuma_status cuma_pool_create(cuma_heap *heap, size_t size, size_t count, cuma_stream stream,
                             cuma_pool **out);

/* Destroys a pool, giving its carve back to the heap (cuma_free on the pool's stream). Refused
 * with CUMA_ERR_INVALID, naming how many blocks are still out, while any is: the pool stays as
 * it was and usable. NULL is a no-op. */
cuma_status cuma_pool_destroy(cuma_pool *pool);

/* Hands out one free block (CUMA_POOL_ALIGN-aligned, at least the pool's size). CUMA_ERR_OOM
 * when every block is out; the pool does not grow. */
cuma_status cuma_pool_alloc(cuma_pool *pool, void **ptr);

/* Gives a block back. A pointer outside the pool (another pool's, the heap's), one inside a
 * block rather than at its start, and a block that is already free are CUMA_ERR_BAD_POINTER
 * and change nothing. NULL is a no-op. */
cuma_status cuma_pool_free(cuma_pool *pool, void *ptr);

/* The pool's block stride (its size rounded up to CUMA_POOL_ALIGN), block count and blocks
 * handed out now; any of the outputs may be NULL. */
cuma_status cuma_pool_info(cuma_pool *pool, size_t *block_size, size_t *count, size_t *in_use);

/* Checks the pool's invariants (see pool.c): CUMA_OK, or CUMA_ERR_CORRUPT naming the one
 * broken. Walks every block: O(count). */
cuma_status cuma_pool_validate(cuma_pool *pool);

#ifdef __cplusplus
}
#endif
#endif
