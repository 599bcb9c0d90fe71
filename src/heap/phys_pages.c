// SPDX-License-Identifier: Apache-2.0
/* The physical layer of pages under live bytes (phys.h): an arena's virtual range and the
 * pages (pages.h) that back its requested bytes. */
#include "util/error.h"
#include "heap/heap.h"

#include <assert.h>
#include <inttypes.h>

static uint64_t round_pow2(uint64_t x) {
    uint64_t p = 1;
    while (p < x) p <<= 1;
    return p;
}

static void set_figures(cuma_arena *a) {
    cuma_pages *pp = &a->pages;
    assert(pp->page_size == 1ull << pp->shift); /* figures are units << shift */
    a->phys.shift = pp->shift;
    a->phys.nreserved = &pp->nreserved;
    a->phys.ncached = &pp->ncached;
    a->phys.nall = pp->shared;
    a->phys.nlagging = &pp->nghosts;
    a->phys.refs = pp->live;
    a->phys.nrefs = pp->nva;
}

static cuma_status pages_init(cuma_arena *a) {
    a->va_size = a->heap->set.virtual_size ? a->heap->set.virtual_size : 4 * a->be->capacity;
    a->va_size = round_pow2(a->va_size);
    if (a->va_size < a->be->page_size) a->va_size = a->be->page_size;
    /* Aligned to its size, the buddy's orders line up with real addresses and pages. */
    uint64_t align = a->va_size < (1ull << 30) ? a->va_size : (1ull << 30);
    cuma_status st = a->be->ops->reserve(a->be, a->va_size, align, &a->base);
    if (st) return st;
    st = cuma_pages_init(&a->pages, a->be, &a->streams, a->base, a->va_size);
    if (st) goto fail_reserve;
    /* On a manual clock the page calls are timed only where they move the backend's clock (the
     * sim with sim_call_us): pacing on real time would make replays depend on the machine. */
    cuma_pages_policy(&a->pages, a->heap->set.remap_threshold, a->heap->set.page_call_budget,
                      !a->heap->set.sim_clock_manual || cuma_simbe_costed_clock(a->be));
    a->pages.shared = &a->heap->first.pages.own_reserved;
    a->pages.marks = a->heap->set.nvtx;
    a->pages.order = a->heap->set.stream_order && a->be->ops->stream_wait;
    st = a->pol->ops->add_range(a->pol, 0, a->va_size);
    if (st) goto fail_pages;
    set_figures(a);
    return CUMA_OK;
fail_pages:
    cuma_pages_destroy(&a->pages);
fail_reserve:
    a->be->ops->unreserve(a->be, a->base, a->va_size);
    return st;
}

static void pages_destroy(cuma_arena *a) {
    cuma_pages_destroy(&a->pages);
    a->be->ops->unreserve(a->be, a->base, a->va_size);
}

static void pages_set_limit(cuma_arena *a, uint64_t bytes, bool is_device) {
    a->pages.limit_pages = bytes / a->pages.page_size;
    a->pages.limit_is_device = is_device;
}

static cuma_status pages_prefill(cuma_arena *a, uint64_t bytes, uint64_t now) {
    uint64_t ps = a->pages.page_size;
    return cuma_pages_prefill(&a->pages, (bytes + ps - 1) / ps, now);
}

static uint64_t pages_max_request(const cuma_arena *a) {
    return a->va_size;
}

static cuma_status pages_back(cuma_arena *a, cuma_block **bp, uint64_t req, uint64_t n,
                              unsigned stream, uint64_t now) {
    cuma_block *b = *bp;
    if (!b)
        return cuma_fail(CUMA_ERR_OOM,
                         "no free block of %" PRIu64 " bytes in the %" PRIu64 "-byte virtual range",
                         n, a->va_size);
    /* Pages with pending work on this very stream may be mapped anew at once (ghosts), where
     * the device can alias a page. */
    int s = a->heap->set.early_remap && (a->be->caps & CUMA_CAP_ALIAS) ? (int)stream
                                                                       : CUMA_PAGES_NO_STREAM;
    cuma_status st = cuma_pages_ref(&a->pages, b->off, req, now, s);
    if (st) {
        a->pol->ops->free(a->pol, b, 0, 0);
        *bp = NULL;
    }
    return st;
}

static void pages_free(cuma_arena *a, cuma_block *b, uint16_t fstream, uint64_t fseq,
                       uint64_t now) {
    assert(!b->is_free && b->mapped_len <= b->size);
    cuma_pages_unref_aged(&a->pages, b->off, b->mapped_len, now, a->idle_since, fstream, fseq);
    a->pol->ops->free(a->pol, b, fstream, fseq);
    assert(a->pages.ncached <= a->pages.nreserved);
}

static uint64_t pages_release(cuma_arena *a, uint64_t now, int64_t delay_ns,
                              uint64_t max_cached_bytes, uint64_t age_keep_bytes, bool wait) {
    uint64_t ps = a->pages.page_size;
    return cuma_pages_release(&a->pages, now, delay_ns,
                              max_cached_bytes == UINT64_MAX ? UINT64_MAX : max_cached_bytes / ps,
                              age_keep_bytes / ps, wait) *
           ps;
}

static void pages_reap(cuma_arena *a, bool wait) {
    cuma_pages_reap(&a->pages, wait);
}

static uint64_t pages_oldest_idle(const cuma_arena *a) {
    return cuma_pages_oldest_idle(&a->pages);
}

static uint64_t pages_growth(const cuma_arena *a, uint64_t n) {
    uint64_t ps = a->pages.page_size;
    return (n + ps - 1) / ps * ps;
}

static uint64_t pages_range_bytes(const cuma_arena *a) {
    return a->va_size;
}

static void pages_counts(const cuma_arena *a, uint64_t *creates, uint64_t *releases) {
    *creates = a->pages.creates;
    *releases = a->pages.releases;
}

static bool pages_validate(const cuma_arena *a, const char **why) {
    return cuma_pages_validate(&a->pages, why);
}

const cuma_phys_ops cuma_phys_pages = {
    .name = "pages",
    .caps = CUMA_PHYS_RANGE | CUMA_PHYS_SLACK_FREE | CUMA_PHYS_MOVABLE,
    .init = pages_init,
    .destroy = pages_destroy,
    .set_limit = pages_set_limit,
    .prefill = pages_prefill,
    .max_request = pages_max_request,
    .back = pages_back,
    .free = pages_free,
    .whole = NULL,
    .release = pages_release,
    .reap = pages_reap,
    .oldest_idle = pages_oldest_idle,
    .growth = pages_growth,
    .range_bytes = pages_range_bytes,
    .counts = pages_counts,
    .validate = pages_validate,
};
