// SPDX-License-Identifier: Apache-2.0
/* Segment mode: for devices without virtual memory management (old drivers, some vGPUs) and
 * for managed memory. Physical memory comes in whole segments from the driver (cuMemAlloc);
 * the placement policy carves each segment as a range of its own, and a segment goes back to
 * the driver only when it is entirely free, by the same release policy as idle pages (delay,
 * cap, trim, out-of-memory). Segment sizes follow the rule that keeps small requests from
 * pinning big segments: up to 1 MiB in 2 MiB segments, up to 10 MiB in `segment_size` ones,
 * larger requests in a segment of their own rounded to 2 MiB.
 *
 * Not thread-safe: the heap lock protects it.
 */
#ifndef CUMA_PHYS_SEGMENTS_H
#define CUMA_PHYS_SEGMENTS_H

#include "backend/backend.h"
#include "util/hashmap.h"
#include "place/policy.h"
#include "place/streams.h"

#include <stdatomic.h>

/* Invariants: whole != NULL iff the segment is on the idle list iff its one block is free
 * and spans it; idle_bytes is the sum of the idle segments' sizes. */
typedef struct cuma_seg {
    uint64_t addr, size;
    uint64_t idle_since;
    cuma_block *whole;
    struct cuma_seg *prev, *next; /* idle list, newest first */
    bool pinned;                  /* preallocated: never given back */
} cuma_seg;

/* Invariants (cuma_segs_validate): reserved == all_reserved == sum of segment sizes; the idle
 * list is ordered by idle_since, newest first, and holds exactly the segments with `whole` set. */
typedef struct cuma_segs {
    cuma_backend *be;
    cuma_streams *ss;
    cuma_policy *pol;
    cuma_map byaddr; /* addr -> cuma_seg */
    cuma_seg *head, *tail;
    uint64_t reserved, idle_bytes, nidle;
    /* reserved again, for readers without the heap lock (the peak of reserved bytes): a
     * segment heap has one arena, so its reserved bytes are the heap's. */
    _Atomic uint64_t all_reserved;
    uint64_t limit_bytes;
    bool limit_is_device;
    uint64_t small_seg, mid_seg; /* 2 MiB and segment_size */
    uint64_t creates, releases;
    bool marks; /* nvtx:on: segment calls are NVTX ranges (marks.h); constant */
} cuma_segs;

void cuma_segs_init(cuma_segs *sg, cuma_backend *be, cuma_streams *ss, cuma_policy *pol,
                    uint64_t segment_size);
void cuma_segs_destroy(cuma_segs *sg);

/* Adds a segment big enough for a rounded request of n bytes. */
cuma_status cuma_segs_grow(cuma_segs *sg, uint64_t n);

/* Adds one segment of `bytes` (rounded to 2 MiB) that is never given back (preallocate). */
cuma_status cuma_segs_prefill(cuma_segs *sg, uint64_t bytes, uint64_t now);

/* A block was just allocated: if it came from an idle segment, that segment is busy again. */
void cuma_segs_on_alloc(cuma_segs *sg, const cuma_block *b);

/* A free left the (merged) block m: if it spans its segment, the segment idles. */
void cuma_segs_on_free(cuma_segs *sg, cuma_block *m, uint64_t now);

/* Like cuma_pages_release, in bytes. Returns bytes released. */
uint64_t cuma_segs_release(cuma_segs *sg, uint64_t now, int64_t delay_ns, uint64_t max_cached_bytes,
                           uint64_t age_keep_bytes, bool wait);

uint64_t cuma_segs_oldest_idle(const cuma_segs *sg);

bool cuma_segs_validate(const cuma_segs *sg, const char **why);

#endif
