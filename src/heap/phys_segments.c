// SPDX-License-Identifier: Apache-2.0
/* The physical layer of whole segments (phys.h): the driver's allocations (segments.h), each a
 * range of the placement policy's own. */
#include "util/error.h"
#include "heap/heap.h"

#include <inttypes.h>

/* Segments count in bytes (a unit of one byte); nothing lags behind a free. */
static const uint32_t no_lagging = 0;

static cuma_status segs_init(cuma_arena *a) {
    cuma_segs_init(&a->segs, a->be, &a->streams, a->pol, a->heap->set.segment_size);
    a->segs.marks = a->heap->set.nvtx;
    a->phys.shift = 0;
    a->phys.nreserved = &a->segs.reserved;
    a->phys.ncached = &a->segs.idle_bytes;
    a->phys.nall = &a->segs.all_reserved;
    a->phys.nlagging = &no_lagging;
    a->phys.refs = NULL;
    a->phys.nrefs = 0;
    return CUMA_OK;
}

static void segs_destroy(cuma_arena *a) {
    cuma_segs_destroy(&a->segs);
}

static void segs_set_limit(cuma_arena *a, uint64_t bytes, bool is_device) {
    a->segs.limit_bytes = bytes;
    a->segs.limit_is_device = is_device;
}

static cuma_status segs_prefill(cuma_arena *a, uint64_t bytes, uint64_t now) {
    return cuma_segs_prefill(&a->segs, bytes, now);
}

static uint64_t segs_max_request(const cuma_arena *a) {
    return a->limit_bytes > a->be->capacity ? a->limit_bytes /* oversubscribed */
                                            : a->be->capacity;
}

static cuma_status segs_back(cuma_arena *a, cuma_block **bp, uint64_t req, uint64_t n,
                             unsigned stream, uint64_t now) {
    (void)req, (void)now;
    if (!*bp) {
        cuma_status st = cuma_segs_grow(&a->segs, n);
        if (st) return st;
        *bp = a->pol->ops->alloc(a->pol, n, stream);
        if (!*bp)
            return cuma_fail(CUMA_ERR_OOM, "a new segment could not hold %" PRIu64 " bytes", n);
    }
    cuma_segs_on_alloc(&a->segs, *bp);
    return CUMA_OK;
}

static void segs_free(cuma_arena *a, cuma_block *b, uint16_t fstream, uint64_t fseq, uint64_t now) {
    cuma_segs_on_free(&a->segs, a->pol->ops->free(a->pol, b, fstream, fseq), now);
}

static void segs_whole(void *ctx, cuma_block *whole) {
    cuma_arena *a = ctx;
    cuma_segs_on_free(&a->segs, whole, cuma_arena_now(a));
}

static uint64_t segs_release(cuma_arena *a, uint64_t now, int64_t delay_ns,
                             uint64_t max_cached_bytes, uint64_t age_keep_bytes, bool wait) {
    return cuma_segs_release(&a->segs, now, delay_ns, max_cached_bytes, age_keep_bytes, wait);
}

static void segs_reap(cuma_arena *a, bool wait) {
    (void)a, (void)wait;
}

static uint64_t segs_oldest_idle(const cuma_arena *a) {
    return cuma_segs_oldest_idle(&a->segs);
}

/* A new segment is at least segment_size: asking for less would not let the request in. */
static uint64_t segs_growth(const cuma_arena *a, uint64_t n) {
    uint64_t ps = a->be->page_size;
    uint64_t need = (n + ps - 1) / ps * ps;
    return need < a->heap->set.segment_size ? a->heap->set.segment_size : need;
}

static uint64_t segs_range_bytes(const cuma_arena *a) {
    return a->segs.reserved;
}

static void segs_counts(const cuma_arena *a, uint64_t *creates, uint64_t *releases) {
    *creates = a->segs.creates;
    *releases = a->segs.releases;
}

static bool segs_validate(const cuma_arena *a, const char **why) {
    return cuma_segs_validate(&a->segs, why);
}

const cuma_phys_ops cuma_phys_segments = {
    .name = "segments",
    .caps = 0,
    .init = segs_init,
    .destroy = segs_destroy,
    .set_limit = segs_set_limit,
    .prefill = segs_prefill,
    .max_request = segs_max_request,
    .back = segs_back,
    .free = segs_free,
    .whole = segs_whole,
    .release = segs_release,
    .reap = segs_reap,
    .oldest_idle = segs_oldest_idle,
    .growth = segs_growth,
    .range_bytes = segs_range_bytes,
    .counts = segs_counts,
    .validate = segs_validate,
};
