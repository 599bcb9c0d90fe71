// SPDX-License-Identifier: Apache-2.0
/* Shared internals of the CUDA backends (cuda_backend.c, cuda_vmm.c, cuda_segment.c).
 *
 * vmm: cuMemCreate/cuMemMap pages in a cuMemAddressReserve range. segment: whole cuMemAlloc
 * segments. managed: whole cuMemAllocManaged segments. All three use the driver that
 * cuda_driver.c loads at run time, and share contexts, events and the stuck list below.
 *
 * Contexts: every op works in the device's primary context, the one the CUDA runtime uses, so
 * memory from cuma is valid in the program's kernels. The core calls from any thread, and the
 * program may have another context current there (another device, its own context): an op
 * makes ours current only when it is not already (one cuCtxGetCurrent, a thread-local read in
 * the driver) and puts the caller's back before returning, so cuma never changes which device
 * a program's next launch goes to.
 *
 * Stream capture (CUDA graphs): while a stream captures, CUDA forbids "potentially unsafe" calls
 * (synchronous allocation, queries) in the default capture mode, and a record on the legacy
 * stream would break a blocking stream's capture. Every op therefore runs in the relaxed capture
 * mode (cuThreadExchangeStreamCaptureMode around it, as PyTorch's allocator does), and a fence is
 * never recorded on a capturing stream, nor on the legacy stream while a blocking stream captures
 * (cuma_cudabe_event_record refuses; the core then asks again later).
 *
 * Failed releases: a cleanup call that fails (cuMemRelease, cuMemUnmap, cuMemAddressFree,
 * cuMemFree) cannot report to the core, which has already forgotten the object. The backend
 * keeps such objects on a `stuck` list and retries them at the next related call and in
 * destroy, so a transient driver failure leaks nothing. A persistent failure (a context broken
 * by a faulting kernel) cannot be repaired by anyone; the list is then dropped at destroy.
 *
 * Thread safety: the core calls ops under its heap lock, one heap per backend, so the mutable
 * state (events, stuck list) needs no lock. now_ns and mem_info (cuma_get_stats calls it
 * without the heap lock) touch no mutable state.
 */
#ifndef CUMA_BACKEND_CUDA_INTERNAL_H
#define CUMA_BACKEND_CUDA_INTERNAL_H

#include "backend.h"
#include "cuda_driver.h"

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

/* A driver object whose release failed, waiting for a retry. */
typedef enum cudabe_stuck_kind {
    STUCK_MAPPING, /* page mapped at `a` whose cuMemUnmap failed */
    STUCK_HANDLE,  /* cuMemRelease(a) failed */
    STUCK_RANGE,   /* cuMemAddressFree(a, size) failed */
    STUCK_MEM,     /* cuMemFree(a) failed (segment or managed memory) */
} cudabe_stuck_kind;

typedef struct cudabe_stuck {
    cudabe_stuck_kind kind;
    uint64_t a, size;
} cudabe_stuck;

/* How the driver takes one call over a run of several pages. Zero (what calloc gives) is the
 * range call, the way every driver the probe saw so far works. */
typedef enum cudabe_run_way {
    RUN_RANGE,    /* one call for the run */
    RUN_PER_PAGE, /* the driver refused the range: one call a page */
    /* The probe could not ask (the device was full): one call a page, except that the first run
     * of several pages tries the range call once, by doing, and keeps whichever way works. */
    RUN_UNTRIED,
} cudabe_run_way;

/* A pooled event: created on first need with CU_EVENT_DISABLE_TIMING (cheaper to record and
 * query), reused for every later fence, destroyed only with the backend. An event can be
 * recorded only on a stream of its own context, so each event belongs to one: the device's
 * primary context, or the context of a stream of another device that the program named
 * (cuma_record_stream with that stream). */
typedef struct cudabe_event {
    CUevent ev;
    CUcontext ctx;
    uint32_t next; /* free list */
} cudabe_event;

/* Invariants: an event index is on the free list or held by the core, never both; stuck
 * entries name objects the core no longer references. Everything is constant after creation
 * except events and stuck, which the heap lock guards. */
typedef struct cuda_be {
    cuma_backend be;
    const cuma_cuda_api *cu;
    CUdevice dev;
    int ordinal;
    CUcontext ctx; /* the retained primary context, NULL until retained */
    CUmemAllocationProp prop;
    CUmemAccessDesc *access; /* owner first, then every peer that can access this device */
    size_t naccess;
    /* What the vmm probe found this driver does with cuMemSetAccess and with cuMemUnmap over a
     * run of several mappings (cuda_vmm.c). Only the caller of the backend (one at a time) reads
     * or writes these. */
    cudabe_run_way access_way, unmap_way;
    cudabe_event *events;
    uint32_t nevents, capevents, free_event;
    cudabe_stuck *stuck;
    size_t nstuck, capstuck;
} cuda_be;

/* ---- context ------------------------------------------------------------------------------ */

typedef struct cudabe_ctx_guard {
    CUcontext prev;
    int switched;
    CUstreamCaptureMode mode; /* the caller's capture mode, while relaxed is set */
    int relaxed;
} cudabe_ctx_guard;

/* Makes the primary context current for one op, in the relaxed capture mode; cudabe_ctx_leave
 * restores the caller's context and mode. On failure nothing is left changed. Sets no message:
 * void ops and destroy run on failure paths whose message must survive. */
static inline CUresult cudabe_ctx_switch(const cuda_be *b, cudabe_ctx_guard *g) {
    CUcontext cur = NULL;
    g->switched = 0;
    g->mode = CU_STREAM_CAPTURE_MODE_RELAXED;
    g->relaxed = b->cu->ThreadExchangeStreamCaptureMode(&g->mode) == CUDA_SUCCESS;
    CUresult r = b->cu->CtxGetCurrent(&cur);
    if (r == CUDA_SUCCESS && cur != b->ctx) {
        r = b->cu->CtxSetCurrent(b->ctx);
        if (r == CUDA_SUCCESS) g->prev = cur, g->switched = 1;
    }
    if (r != CUDA_SUCCESS && g->relaxed) {
        b->cu->ThreadExchangeStreamCaptureMode(&g->mode);
        g->relaxed = 0;
    }
    return r;
}

static inline cuma_status cudabe_ctx_enter(const cuda_be *b, cudabe_ctx_guard *g) {
    CUresult r = cudabe_ctx_switch(b, g);
    return r == CUDA_SUCCESS ? CUMA_OK : cuma_cuda_check(r, "making the primary context current");
}

static inline void cudabe_ctx_leave(const cuda_be *b, cudabe_ctx_guard *g) {
    /* A failure leaves our context current: harmless to cuma, and nothing better to do. */
    if (g->switched) b->cu->CtxSetCurrent(g->prev);
    if (g->relaxed) b->cu->ThreadExchangeStreamCaptureMode(&g->mode);
}

/* "what: CUDA_ERROR_... (...)" with a formatted `what`, built only on failure. */
cuma_status cuma_cudabe_check(CUresult r, const char *fmt, ...)
    __attribute__((format(printf, 2, 3)));

/* ---- stuck objects (call with the context current) ---------------------------------------- */

void cuma_cudabe_stuck_add(cuda_be *b, cudabe_stuck_kind kind, uint64_t a, uint64_t size);
/* Retries the entries of one kind with lo <= a < hi; keeps those that fail again. */
void cuma_cudabe_stuck_retry(cuda_be *b, cudabe_stuck_kind kind, uint64_t lo, uint64_t hi);
/* Drops the entry of this kind at a: the object went after all. */
void cuma_cudabe_stuck_forget(cuda_be *b, cudabe_stuck_kind kind, uint64_t a);

/* ---- ops every CUDA backend shares (cuda_backend.c) --------------------------------------- */

cuma_status cuma_cudabe_mem_info(cuma_backend *be, uint64_t *free_bytes, uint64_t *total_bytes);
cuma_status cuma_cudabe_event_record(cuma_backend *be, cuma_stream stream, uint64_t *event);
int cuma_cudabe_event_query(cuma_backend *be, uint64_t event);
cuma_status cuma_cudabe_event_wait(cuma_backend *be, uint64_t event);
void cuma_cudabe_event_release(cuma_backend *be, uint64_t event);
cuma_status cuma_cudabe_stream_wait(cuma_backend *be, cuma_stream stream, uint64_t event);
bool cuma_cudabe_stream_capturing(cuma_backend *be, cuma_stream stream);
uint64_t cuma_cudabe_now(cuma_backend *be);
void cuma_cudabe_destroy(cuma_backend *be);
/* Whole allocations (cuda_segment.c): cuMemAlloc segments, and managed memory, the managed
 * fallback of every backend; both go back with cuMemFree. */
cuma_status cuma_cudabe_seg_alloc(cuma_backend *be, uint64_t size, uint64_t *addr);
cuma_status cuma_cudabe_managed_alloc(cuma_backend *be, uint64_t size, uint64_t *addr);
void cuma_cudabe_mem_free(cuma_backend *be, uint64_t addr, uint64_t size);

#define CUMA_CUDABE_COMMON_OPS                                                                     \
    .managed_alloc = cuma_cudabe_managed_alloc, .managed_free = cuma_cudabe_mem_free,              \
    .mem_info = cuma_cudabe_mem_info, .event_record = cuma_cudabe_event_record,                    \
    .event_query = cuma_cudabe_event_query, .event_wait = cuma_cudabe_event_wait,                  \
    .event_release = cuma_cudabe_event_release, .now_ns = cuma_cudabe_now,                         \
    .destroy = cuma_cudabe_destroy, .stream_wait = cuma_cudabe_stream_wait,                        \
    .stream_capturing = cuma_cudabe_stream_capturing

/* ---- the kinds (ops, name, caps, page size; the device is open) --------------------------- */

cuma_status cuma_cudabe_init_vmm(cuda_be *b, const cuma_settings *s);
void cuma_cudabe_init_segments(cuda_be *b, bool managed);

#endif
