// SPDX-License-Identifier: Apache-2.0
/* cuma compaction: moving live blocks, with their owner's help, out of pages they alone keep
 * mapped.
 *
 * A heap maps a page while any live byte overlaps it, so a few small blocks that outlive the
 * large ones around them keep whole pages mapped: the stranded bytes of cuma_stats. cuma cannot
 * move memory it does not own, but its owner can. cuma_compact picks the pages whose live bytes
 * are few (at most half a page) and whose every block may move, gives each block on them a new
 * place (in the free gaps of pages that stay in use, else in fresh pages next to each other,
 * never on a page being emptied), and calls the owner's mover for each: it copies the block on
 * the block's stream and updates every reference to it, or returns false to keep the block where
 * it is. The old place is then freed as cuma_free(old, stream) would (stream-ordered: the copy
 * that stream still runs finishes before another stream reuses it); a refused move frees the new
 * place the same way and keeps the old.
 *
 * Blocks that never move: blocks larger than half a page, blocks cuma_record_stream gave other
 * streams (the mover copies on one), fixed-size pools' carves (cuma/pool.h: the pool owns them),
 * blocks freed into thread caches or waiting on record_stream fences.
 *
 * Page mode only: in segment mode (no VMM, backend:managed) a segment goes back only when all of
 * it is free, and cuma_compact is CUMA_ERR_UNSUPPORTED; so it is under policy:buddy, which
 * cannot place a block at a chosen address.
 *
 * Thread safety: the mover runs with no heap lock held (it may allocate, free, take the GIL),
 * on the thread that called cuma_compact (or whose allocation ran out of memory), and one
 * compaction of a heap runs at a time. Other threads may use the heap meanwhile, but not the
 * blocks being moved: a block the program frees while its move is under way is not moved (its
 * new place is freed, and it counts as refused). A compaction, or an out-of-memory compaction,
 * started from inside a mover does nothing (cuma_compact: CUMA_ERR_INVALID).
 */
#ifndef CUMA_COMPACT_H
#define CUMA_COMPACT_H

#include "cuma.h"

#include <stdbool.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Copies `size` bytes (the block's requested bytes) from old_ptr to new_ptr on `stream` (the
 * stream the block was allocated on) and points the owner's references at new_ptr; true when it
 * did, false to keep the block at old_ptr (then it must have changed nothing). A mover must
 * return false for a pointer it does not know: every live allocation of the heap may be
 * offered, also those other code on the heap made (a pool being created, a library's). */
typedef bool (*cuma_move_fn)(void *user, void *old_ptr, void *new_ptr, size_t size,
                             cuma_stream stream);

/* What one compaction did. pages_emptied: pages whose last live bytes the moves took away (they
 * idle in the cache, reusable at once); pages_released: pages given back to the device at its
 * end: cuma_compact gives back the oldest idle pages until the cache holds no more than it did
 * before (those whose stream work is still running stay for the release policy); the
 * out-of-memory rung keeps them for the allocation that ran out. */
typedef struct cuma_compact_result {
    uint64_t blocks_moved;
    uint64_t bytes_moved; /* requested bytes the movers copied */
    uint64_t blocks_refused;
    uint64_t pages_emptied;
    uint64_t pages_released;
} cuma_compact_result;

/* Compacts every arena of the heap now with `move` (whatever the fragmentation). out may be
 * NULL. CUMA_ERR_UNSUPPORTED in segment mode or under policy:buddy; CUMA_ERR_INVALID from
 * inside a mover. Counted in cuma_stats (compactions, compact_moved_bytes,
 * compact_freed_pages). */
cuma_status cuma_compact(cuma_heap *heap, cuma_move_fn move, void *user, cuma_compact_result *out);

/* Registers the heap's mover for the automatic compactions (move NULL: none): at
 * cuma_compact_if_needed and, before the OOM callbacks, when an allocation ran out of memory
 * even after the cache went back. Both compact only while the stranded share of the memory in
 * use (cuma_stats.fragmentation) is over the fragmentation_threshold setting. */
cuma_status cuma_set_mover(cuma_heap *heap, cuma_move_fn move, void *user);

/* Compacts with the registered mover if one is set and the fragmentation is over the threshold
 * (a step boundary the program marks); otherwise does nothing (*out zeroed). out may be NULL. */
cuma_status cuma_compact_if_needed(cuma_heap *heap, cuma_compact_result *out);

#ifdef __cplusplus
}
#endif
#endif
