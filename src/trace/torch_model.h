// SPDX-License-Identifier: Apache-2.0
/* A model of PyTorch's CUDA caching allocator (its native backend, with or without expandable
 * segments),
 * for `cuma replay --policy pytorch`: it takes a trace's alloc/free events and tells what
 * PyTorch would have reserved from the driver. It is no allocator: no memory is touched, the
 * "device" is a counter of reserved bytes that hands out made-up addresses. The rules it follows
 * (written from PyTorch's documentation and source, docs/PYTORCH_MODEL.md):
 *
 *  - sizes are rounded up to 512 bytes (or to a power-of-two division, roundup_power2_divisions);
 *  - requests of 1 MiB or less go to the small pool, carved from 2 MiB segments; larger ones to
 *    the large pool: 20 MiB segments under 10 MiB, else the size rounded up to 2 MiB;
 *  - a request takes the free block of its pool and stream that is smallest by (size, address)
 *    among those at least its size; a request under max_split_size never takes a block of
 *    max_split_size or more, a larger one none of max_non_split_rounding more than its size;
 *  - a block is split when the rest is 512 bytes or more (small pool), or more than 1 MiB and
 *    the request is under max_split_size (large pool); freed blocks merge with free neighbours
 *    of their segment;
 *  - when a new segment does not fit the capacity: free the cached oversize blocks of the stream
 *    (max_split_size set) and retry, then free every whole cached segment and retry, then fail;
 *  - garbage_collection_threshold (with a capacity and per_process_memory_fraction, as PyTorch
 *    has it only with a fraction set): before a new segment, while reserved is over threshold x
 *    fraction x capacity, free whole cached large segments that are the oldest on average;
 *  - expandable_segments:True: each (stream, pool) maps 2 MiB (small) or 20 MiB (large) pages
 *    of one virtual range as needed; a request that no free block fits takes the free and
 *    unmapped room at the range's end, blocks split whenever the rest is 512 bytes or more, and
 *    releasing the cache unmaps the pages wholly inside free blocks;
 *  - a block used on other streams than its allocation's (record_stream) is not cached at its
 *    free: events are recorded on those streams, and the block joins its pool (and merges) at
 *    the first malloc that finds them complete, lag_us after the free on a device that runs
 *    that far behind; freeing the cache (empty_cache, the retry after a failed segment) waits
 *    for every such event first. A block freed with no other stream's use is cached at once.
 *
 * Thread safety: none; a model belongs to one thread. */
#ifndef CUMA_TRACE_TORCH_MODEL_H
#define CUMA_TRACE_TORCH_MODEL_H

#include <stddef.h>
#include <stdint.h>

#include "trace.h"

#define CUMA_TM_MIN_BLOCK      512u
#define CUMA_TM_SMALL_SIZE     ((uint64_t)1 << 20)  /* largest small-pool request */
#define CUMA_TM_SMALL_BUFFER   ((uint64_t)2 << 20)  /* small-pool segment */
#define CUMA_TM_LARGE_BUFFER   ((uint64_t)20 << 20) /* segment for requests under 10 MiB */
#define CUMA_TM_MIN_LARGE      ((uint64_t)10 << 20)
#define CUMA_TM_ROUND_LARGE    ((uint64_t)2 << 20)
#define CUMA_TM_DIV_INTERVALS  16 /* roundup_power2_divisions: 1 MiB, 2 MiB, ... 32 GiB and up */
#define CUMA_TM_NO_SPLIT_LIMIT UINT64_MAX
#define CUMA_TM_MAX_REQUEST    ((uint64_t)1 << 62) /* larger requests fail (no overflow) */

/* The allocator's settings (PYTORCH_CUDA_ALLOC_CONF, cuma_tm_conf_parse). */
typedef struct cuma_tm_conf {
    uint64_t max_split_size;         /* bytes; CUMA_TM_NO_SPLIT_LIMIT: every block may split */
    uint64_t max_non_split_rounding; /* bytes (default 20 MiB) */
    double gc_threshold;             /* 0: off; else in (0, 1) */
    double memory_fraction;          /* per_process_memory_fraction; 0: not set */
    uint32_t divisions[CUMA_TM_DIV_INTERVALS]; /* 0 or 1: round to 512 bytes */
    uint64_t capacity;                         /* device bytes; 0: unlimited */
    uint64_t lag_us; /* the device runs this far behind the host: an event recorded at a free
                      * completes lag_us later (cuma_tm_replay; sim_lag_ms); 0: at once */
    int expandable;  /* expandable_segments:True */
} cuma_tm_conf;

/* The defaults: PyTorch's with an unlimited device. */
void cuma_tm_conf_default(cuma_tm_conf *c);

/* Applies PYTORCH_CUDA_ALLOC_CONF-style text ("max_split_size_mb:128,garbage_collection_
 * threshold:0.6,roundup_power2_divisions:[256:1,>:4]") on top of *c. CUMA_ERR_CONFIG names the
 * option and what is wrong (unknown key, bad value, expandable_segments:True, a backend other
 * than native); *c is unchanged then. pinned_* options are accepted and ignored (they are for
 * host memory). */
cuma_status cuma_tm_conf_parse(cuma_tm_conf *c, const char *text);

/* One block: a piece of a segment, allocated or free (then in its pool).
 * Invariants (cuma_tm_validate): the blocks of a segment (or expandable range) tile it in
 * address order through prev/next; a free mapped block is in the pool its segment belongs to,
 * an unmapped one in its unmapped set, an allocated one (always mapped) in none; no two
 * neighbours are both free with the same mapping; sizes are multiples of 512; reserved is the
 * sum of mapped blocks. A pending block (freed, its streams' events not yet seen complete) is
 * mapped, in no pool, merges with nothing and is in the pending queue once. */
typedef struct cuma_tm_block {
    uint64_t addr, size;
    uint64_t requested; /* the caller's size (allocated blocks) */
    uint64_t stream;
    int32_t prev, next; /* neighbours in the segment; -1 at its ends */
    uint32_t gc_count;  /* get_free_block calls on its pool while it sat free (gc age) */
    uint64_t gc_base;   /* while free: the pool's call count minus gc_count */
    uint8_t large;      /* its pool */
    uint8_t allocated;
    uint8_t mapped;     /* backed by device memory (always, outside expandable segments) */
    uint8_t expandable; /* part of an expandable segment's range */
    uint8_t in_use;     /* the slot holds a block (else on the spare list) */
    uint8_t pending;    /* freed, waiting for events on the streams that used it */
} cuma_tm_block;

/* A pool's free blocks sorted by (stream, size, address). */
typedef struct cuma_tm_pool {
    int32_t *ids;
    size_t n, cap;
    uint64_t calls; /* get_free_block calls (the gc clock) */
} cuma_tm_pool;

typedef struct cuma_tm_stats {
    uint64_t reserved, peak_reserved;
    uint64_t allocated, peak_allocated; /* rounded block bytes handed out */
    uint64_t requested, peak_requested; /* callers' bytes */
    uint64_t segments_created, segments_released;
    uint64_t allocs, frees, failed_allocs;
    uint64_t oversize_releases; /* retries after freeing oversize blocks */
    uint64_t full_releases;     /* retries after freeing every cached segment */
    uint64_t gc_releases;       /* segments freed by garbage collection */
    uint64_t segments_seeded;   /* segments the model started with (cuma_tm_seed) */
    uint64_t blocks_placed;     /* blocks from before put where they were (cuma_tm_seed) */
    uint64_t deferred_frees;    /* frees that waited for other streams' events */
} cuma_tm_stats;

/* A pending block and the time its events complete. */
typedef struct cuma_tm_pending {
    int32_t id;
    uint64_t due_us;
} cuma_tm_pending;

typedef struct cuma_tm {
    cuma_tm_conf conf;
    cuma_tm_block *b;
    size_t nb, capb;
    int32_t spare;            /* first free slot (chained through next), -1: none */
    cuma_tm_pool pool[2];     /* [0] small, [1] large: free mapped blocks */
    cuma_tm_pool unmapped[2]; /* expandable ranges' unmapped blocks, by (stream, address) */
    uint64_t next_addr;
    cuma_tm_pending *pend; /* pending blocks by due time: [pend_head, npend) */
    size_t pend_head, npend, cappend;
    cuma_tm_stats st;
} cuma_tm;

/* A model with settings *c (copied). CUMA_ERR_OOM. */
cuma_status cuma_tm_init(cuma_tm *m, const cuma_tm_conf *c);
void cuma_tm_destroy(cuma_tm *m);

/* The size PyTorch rounds a request of `size` bytes to. */
uint64_t cuma_tm_round_size(const cuma_tm_conf *c, uint64_t size);
/* The size of the segment made for a rounded request. */
uint64_t cuma_tm_segment_size(uint64_t rounded);

/* Allocates `size` (> 0) bytes on `stream`: *id is the block (its addr and size in m->b[*id]).
 * CUMA_ERR_OOM: the capacity cannot hold it even after freeing the cache, or it is over
 * CUMA_TM_MAX_REQUEST (counted in failed_allocs; *id is -1). CUMA_ERR_INVALID: size 0. */
cuma_status cuma_tm_malloc(cuma_tm *m, uint64_t size, uint64_t stream, int32_t *id);
/* Frees block id (from cuma_tm_malloc). CUMA_ERR_BAD_POINTER for an id that is no allocated
 * block (nothing changes). */
cuma_status cuma_tm_free(cuma_tm *m, int32_t id);
/* Frees block id, which was used on other streams than its allocation's (record_stream): its
 * bytes stop counting as allocated now, but it stays out of its pool until cuma_tm_process_events
 * sees time due_us (the events recorded on those streams complete then). Errors as
 * cuma_tm_free. */
cuma_status cuma_tm_free_after(cuma_tm *m, int32_t id, uint64_t due_us);
/* What PyTorch does at the start of each malloc: the pending blocks whose events are complete
 * at time now_us (due_us <= now_us) join their pools. CUMA_ERR_OOM (host memory: the rest stay
 * pending). */
cuma_status cuma_tm_process_events(cuma_tm *m, uint64_t now_us);
/* Waits for every pending block's events (they join their pools), then frees every whole
 * cached segment (torch.cuda.empty_cache()). */
void cuma_tm_empty_cache(cuma_tm *m);

/* Starts a fresh model with the segments a trace says PyTorch reserved before recording
 * (cuma_trace.preseg: sorted, disjoint), so their free room is cache from time 0: each is a
 * segment of the small pool when 2 MiB or less, as PyTorch carves only those from it, else of
 * the large pool. Then allocates the `n` blocks from before (ALLOC events, ptr and size) where
 * they were: ids[k] is event k's block, or -1 for one that lies in no seeded segment, overlaps
 * another or is not 512-byte aligned in it (the caller gives those to cuma_tm_malloc). Segments
 * whose size is no multiple of 512 are left out. CUMA_ERR_INVALID: not a fresh model, or one
 * with expandable segments (whose ranges are mapped page by page, not seeded). CUMA_ERR_OOM. */
cuma_status cuma_tm_seed(cuma_tm *m, const cuma_trace_segment *seg, size_t nseg,
                         const cuma_trace_event *ev, size_t n, int32_t *ids);

/* Checks the invariants above and the byte counts; CUMA_ERR_CORRUPT names the first broken. */
cuma_status cuma_tm_validate(const cuma_tm *m);

/* What a replay of a trace on the model measured. Integrals are in byte-microseconds. */
typedef struct cuma_tm_result {
    cuma_tm_stats st;
    uint64_t zero_allocs, unmatched_frees, orphan_frees, trace_failures;
    uint64_t end_reserved;
    double int_reserved, int_requested;
    uint64_t span_us;
} cuma_tm_result;

/* Replays t's events on a fresh model with settings *c, seeded with t's segments from before
 * recording (cuma_tm_seed) unless *c has expandable segments. A free whose stream is another
 * than its allocation's (the stream of the memory's last use, in an RMM log) is a block that
 * was record_stream'ed on it: with c->lag_us it is cuma_tm_free_after the free's time plus the
 * lag, and the events are processed before each allocation at its time. CUMA_ERR_OOM (host memory),
 * or CUMA_ERR_CORRUPT if the model breaks an invariant (a bug). */
cuma_status cuma_tm_replay(const cuma_trace *t, const cuma_tm_conf *c, cuma_tm_result *out);

#endif
