// SPDX-License-Identifier: Apache-2.0
/* A backend whose device memory is admitted by the cross-process ledger: every page or segment
 * is counted in the heap's slot before it is taken from the device and uncounted after it went
 * back, so the ledger's figures are exact and no heap grows into memory another one holds or is
 * guaranteed. Everything else passes straight through. Managed memory is not device memory the
 * ledger shares (it oversubscribes, and the driver moves it to the host when the device is
 * needed), so it is not counted: neither the managed fallbacks nor the segments of an
 * oversubscribing backend (backend:managed). */
#include "backend/backend.h"
#include "util/error.h"
#include "ledger_backend.h"

#include <stdatomic.h>
#include <stdlib.h>

/* Constant after creation but `held`, which the calls change (one caller at a time, see
 * backend.h) and validation reads (atomic). */
typedef struct ledger_be {
    cuma_backend base; /* first: a cuma_backend * is a ledger_be * */
    cuma_backend *inner;
    cuma_ledger *ledger;
    _Atomic uint64_t held; /* bytes admitted: pages and segments held from the device */
} ledger_be;

static const cuma_backend_ops ledger_ops;

static ledger_be *as_lb(cuma_backend *be) {
    return (ledger_be *)be;
}

static cuma_status admit(ledger_be *l, uint64_t bytes) {
    cuma_status st = cuma_ledger_admit(l->ledger, bytes);
    if (!st) atomic_fetch_add(&l->held, bytes);
    return st;
}

static void give_back(ledger_be *l, uint64_t bytes) {
    atomic_fetch_sub(&l->held, bytes);
    cuma_ledger_unadmit(l->ledger, bytes);
}

static cuma_status lb_reserve(cuma_backend *be, uint64_t size, uint64_t align, uint64_t *addr) {
    cuma_backend *in = as_lb(be)->inner;
    return in->ops->reserve(in, size, align, addr);
}
static void lb_unreserve(cuma_backend *be, uint64_t addr, uint64_t size) {
    cuma_backend *in = as_lb(be)->inner;
    in->ops->unreserve(in, addr, size);
}
static cuma_status lb_page_create(cuma_backend *be, uint64_t *handle) {
    ledger_be *l = as_lb(be);
    cuma_status st = admit(l, be->page_size);
    if (st) return st;
    st = l->inner->ops->page_create(l->inner, handle);
    if (st) give_back(l, be->page_size);
    return st;
}
static void lb_page_release(cuma_backend *be, uint64_t handle) {
    ledger_be *l = as_lb(be);
    l->inner->ops->page_release(l->inner, handle);
    give_back(l, be->page_size);
}
static cuma_status lb_map(cuma_backend *be, uint64_t addr, const uint64_t *handles, uint32_t n) {
    cuma_backend *in = as_lb(be)->inner;
    return in->ops->map(in, addr, handles, n);
}
static cuma_status lb_unmap(cuma_backend *be, uint64_t addr, uint32_t n) {
    cuma_backend *in = as_lb(be)->inner;
    return in->ops->unmap(in, addr, n);
}
static cuma_status lb_seg_alloc(cuma_backend *be, uint64_t size, uint64_t *addr) {
    ledger_be *l = as_lb(be);
    if (be->caps & CUMA_CAP_OVERSUBSCRIBE) return l->inner->ops->seg_alloc(l->inner, size, addr);
    cuma_status st = admit(l, size);
    if (st) return st;
    st = l->inner->ops->seg_alloc(l->inner, size, addr);
    if (st) give_back(l, size);
    return st;
}
static void lb_seg_free(cuma_backend *be, uint64_t addr, uint64_t size) {
    ledger_be *l = as_lb(be);
    l->inner->ops->seg_free(l->inner, addr, size);
    if (!(be->caps & CUMA_CAP_OVERSUBSCRIBE)) give_back(l, size);
}
static cuma_status lb_managed_alloc(cuma_backend *be, uint64_t size, uint64_t *addr) {
    cuma_backend *in = as_lb(be)->inner;
    return in->ops->managed_alloc(in, size, addr);
}
static void lb_managed_free(cuma_backend *be, uint64_t addr, uint64_t size) {
    cuma_backend *in = as_lb(be)->inner;
    in->ops->managed_free(in, addr, size);
}
static cuma_status lb_mem_info(cuma_backend *be, uint64_t *fr, uint64_t *total) {
    cuma_backend *in = as_lb(be)->inner;
    return in->ops->mem_info(in, fr, total);
}
static cuma_status lb_event_record(cuma_backend *be, cuma_stream stream, uint64_t *event) {
    cuma_backend *in = as_lb(be)->inner;
    return in->ops->event_record(in, stream, event);
}
static int lb_event_query(cuma_backend *be, uint64_t event) {
    cuma_backend *in = as_lb(be)->inner;
    return in->ops->event_query(in, event);
}
static cuma_status lb_event_wait(cuma_backend *be, uint64_t event) {
    cuma_backend *in = as_lb(be)->inner;
    return in->ops->event_wait(in, event);
}
static void lb_event_release(cuma_backend *be, uint64_t event) {
    cuma_backend *in = as_lb(be)->inner;
    in->ops->event_release(in, event);
}
static uint64_t lb_now_ns(cuma_backend *be) {
    cuma_backend *in = as_lb(be)->inner;
    return in->ops->now_ns(in);
}
static void lb_destroy(cuma_backend *be) {
    ledger_be *l = as_lb(be);
    l->inner->ops->destroy(l->inner);
    /* The device has everything back: the slot goes. */
    cuma_ledger_leave(l->ledger);
    free(l);
}

static cuma_status lb_stream_wait(cuma_backend *be, cuma_stream stream, uint64_t event) {
    cuma_backend *in = as_lb(be)->inner;
    return in->ops->stream_wait(in, stream, event);
}

static bool lb_stream_capturing(cuma_backend *be, cuma_stream stream) {
    cuma_backend *in = as_lb(be)->inner;
    return in->ops->stream_capturing && in->ops->stream_capturing(in, stream);
}

static const cuma_backend_ops ledger_ops = {
    lb_reserve,  lb_unreserve,    lb_page_create, lb_page_release,     lb_map,
    lb_unmap,    lb_seg_alloc,    lb_seg_free,    lb_managed_alloc,    lb_managed_free,
    lb_mem_info, lb_event_record, lb_event_query, lb_event_wait,       lb_event_release,
    lb_now_ns,   lb_destroy,      lb_stream_wait, lb_stream_capturing,
};

cuma_status cuma_backend_ledger(cuma_backend *inner, cuma_ledger *ledger, cuma_backend **out) {
    ledger_be *l = calloc(1, sizeof *l);
    if (!l) return cuma_fail(CUMA_ERR_OOM, "no host memory for a ledger backend");
    l->base = *inner;
    l->base.ops = &ledger_ops;
    l->base.inner = inner;
    l->inner = inner;
    l->ledger = ledger;
    *out = &l->base;
    return CUMA_OK;
}

uint64_t cuma_backend_ledger_held(cuma_backend *be) {
    for (; be; be = be->inner)
        if (be->ops == &ledger_ops) return atomic_load(&as_lb(be)->held);
    return 0;
}
