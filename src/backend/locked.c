// SPDX-License-Identifier: Apache-2.0
/* A backend shared by several arenas of one heap: every call that changes backend state runs
 * under one mutex, because each arena calls it under its own lock only (backend.h promises a
 * backend a single caller at a time). now_ns and mem_info pass straight through: backends
 * already allow those from any thread. */
#include "backend.h"
#include "util/error.h"
#include "util/lockrank.h"

#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdlib.h>
#include <string.h>

/* Fields constant after creation, except what `lock` guards inside `inner`, and `shared`. */
typedef struct locked {
    cuma_backend base; /* first: a cuma_backend * is a locked * */
    cuma_backend *inner;
    pthread_mutex_t lock;
    /* Set (once) by cuma_backend_share when a second arena is made, under the first arena's
     * lock; until then every call comes from the first arena under its lock, and the mutex
     * (a lock and an unlock per page mapped) would buy nothing. */
    _Atomic bool shared;
} locked;

static const cuma_backend_ops locked_ops;

static locked *as_locked(cuma_backend *be) {
    return (locked *)be;
}

#define CALL(be, expr)                                                                             \
    do {                                                                                           \
        locked *l_ = as_locked(be);                                                                \
        bool on_ = atomic_load_explicit(&l_->shared, memory_order_relaxed);                        \
        if (on_) cuma_mutex_lock(&l_->lock, CUMA_RANK_BACKEND);                                    \
        expr;                                                                                      \
        if (on_) cuma_mutex_unlock(&l_->lock);                                                     \
    } while (0)

static cuma_status l_reserve(cuma_backend *be, uint64_t size, uint64_t align, uint64_t *addr) {
    cuma_status st;
    CALL(be, st = l_->inner->ops->reserve(l_->inner, size, align, addr));
    return st;
}
static void l_unreserve(cuma_backend *be, uint64_t addr, uint64_t size) {
    CALL(be, l_->inner->ops->unreserve(l_->inner, addr, size));
}
static cuma_status l_page_create(cuma_backend *be, uint64_t *handle) {
    cuma_status st;
    CALL(be, st = l_->inner->ops->page_create(l_->inner, handle));
    return st;
}
static void l_page_release(cuma_backend *be, uint64_t handle) {
    CALL(be, l_->inner->ops->page_release(l_->inner, handle));
}
static cuma_status l_map(cuma_backend *be, uint64_t addr, const uint64_t *handles, uint32_t n) {
    cuma_status st;
    CALL(be, st = l_->inner->ops->map(l_->inner, addr, handles, n));
    return st;
}
static cuma_status l_unmap(cuma_backend *be, uint64_t addr, uint32_t n) {
    cuma_status st;
    CALL(be, st = l_->inner->ops->unmap(l_->inner, addr, n));
    return st;
}
static cuma_status l_seg_alloc(cuma_backend *be, uint64_t size, uint64_t *addr) {
    cuma_status st;
    CALL(be, st = l_->inner->ops->seg_alloc(l_->inner, size, addr));
    return st;
}
static void l_seg_free(cuma_backend *be, uint64_t addr, uint64_t size) {
    CALL(be, l_->inner->ops->seg_free(l_->inner, addr, size));
}
static cuma_status l_managed_alloc(cuma_backend *be, uint64_t size, uint64_t *addr) {
    cuma_status st;
    CALL(be, st = l_->inner->ops->managed_alloc(l_->inner, size, addr));
    return st;
}
static void l_managed_free(cuma_backend *be, uint64_t addr, uint64_t size) {
    CALL(be, l_->inner->ops->managed_free(l_->inner, addr, size));
}
static cuma_status l_mem_info(cuma_backend *be, uint64_t *fr, uint64_t *total) {
    cuma_backend *in = as_locked(be)->inner;
    return in->ops->mem_info(in, fr, total);
}
static cuma_status l_event_record(cuma_backend *be, cuma_stream stream, uint64_t *event) {
    cuma_status st;
    CALL(be, st = l_->inner->ops->event_record(l_->inner, stream, event));
    return st;
}
static int l_event_query(cuma_backend *be, uint64_t event) {
    int r;
    CALL(be, r = l_->inner->ops->event_query(l_->inner, event));
    return r;
}
static cuma_status l_event_wait(cuma_backend *be, uint64_t event) {
    /* Under the mutex too: backends look events up in pools that another arena's record may
     * grow. Waits happen only on the out-of-memory and trim paths, which are slow anyway. */
    cuma_status st;
    CALL(be, st = l_->inner->ops->event_wait(l_->inner, event));
    return st;
}
static void l_event_release(cuma_backend *be, uint64_t event) {
    CALL(be, l_->inner->ops->event_release(l_->inner, event));
}
static uint64_t l_now_ns(cuma_backend *be) {
    cuma_backend *in = as_locked(be)->inner;
    return in->ops->now_ns(in);
}
static void l_destroy(cuma_backend *be) {
    locked *l = as_locked(be);
    l->inner->ops->destroy(l->inner);
    pthread_mutex_destroy(&l->lock);
    free(l);
}

static cuma_status l_stream_wait(cuma_backend *be, cuma_stream stream, uint64_t event) {
    cuma_status st;
    CALL(be, st = l_->inner->ops->stream_wait(l_->inner, stream, event));
    return st;
}

/* No lock: the answer is the driver's, about the stream, and touches no pool of the backend. */
static bool l_stream_capturing(cuma_backend *be, cuma_stream stream) {
    cuma_backend *in = as_locked(be)->inner;
    return in->ops->stream_capturing && in->ops->stream_capturing(in, stream);
}

static const cuma_backend_ops locked_ops = {
    l_reserve,  l_unreserve,    l_page_create, l_page_release,     l_map,
    l_unmap,    l_seg_alloc,    l_seg_free,    l_managed_alloc,    l_managed_free,
    l_mem_info, l_event_record, l_event_query, l_event_wait,       l_event_release,
    l_now_ns,   l_destroy,      l_stream_wait, l_stream_capturing,
};

cuma_status cuma_backend_locked(cuma_backend *inner, cuma_backend **out) {
    locked *l = calloc(1, sizeof *l);
    if (!l) return cuma_fail(CUMA_ERR_OOM, "no host memory for a shared backend");
    l->base = *inner;
    l->base.ops = &locked_ops;
    l->base.inner = inner;
    l->inner = inner;
    pthread_mutex_init(&l->lock, NULL);
    *out = &l->base;
    return CUMA_OK;
}

cuma_backend *cuma_backend_unwrap(cuma_backend *be) {
    while (be && be->inner) be = be->inner;
    return be;
}

void cuma_backend_share(cuma_backend *be) {
    if (be->ops == &locked_ops) atomic_store(&as_locked(be)->shared, true);
}

void cuma_backend_lock(cuma_backend *be) {
    if (be->ops == &locked_ops) cuma_mutex_lock(&as_locked(be)->lock, CUMA_RANK_BACKEND);
}

void cuma_backend_unlock(cuma_backend *be) {
    if (be->ops == &locked_ops) cuma_mutex_unlock(&as_locked(be)->lock);
}
