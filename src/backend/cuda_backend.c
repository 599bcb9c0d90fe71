// SPDX-License-Identifier: Apache-2.0
/* What every CUDA backend shares: creation (device, primary context, UUID, which kind), the
 * event pool, device memory info, the clock, the stuck list, destroy. The kinds themselves are
 * in cuda_vmm.c and cuda_segment.c; cuda_internal.h says how they fit together. */
#include "util/error.h"
#include "cuda_internal.h"

#include <inttypes.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define NO_EVENT UINT32_MAX

cuma_status cuma_cudabe_check(CUresult r, const char *fmt, ...) {
    if (r == CUDA_SUCCESS) return CUMA_OK;
    char what[200];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(what, sizeof what, fmt, ap);
    va_end(ap);
    return cuma_cuda_check(r, what);
}

/* ---- stuck objects -------------------------------------------------------------------------- */

void cuma_cudabe_stuck_add(cuda_be *b, cudabe_stuck_kind kind, uint64_t a, uint64_t size) {
    for (size_t i = 0; i < b->nstuck; i++)
        if (b->stuck[i].kind == kind && b->stuck[i].a == a) return;
    if (b->nstuck == b->capstuck) {
        size_t nc = b->capstuck ? b->capstuck * 2 : 8;
        cudabe_stuck *n = realloc(b->stuck, nc * sizeof *n);
        if (!n) return; /* no host memory to remember it: the object leaks */
        b->stuck = n, b->capstuck = nc;
    }
    b->stuck[b->nstuck++] = (cudabe_stuck){kind, a, size};
}

static CUresult stuck_retry_one(cuda_be *b, const cudabe_stuck *s) {
    switch (s->kind) {
    case STUCK_MAPPING:
        return b->cu->MemUnmap((CUdeviceptr)s->a, (size_t)b->be.page_size);
    case STUCK_HANDLE:
        return b->cu->MemRelease((CUmemGenericAllocationHandle)s->a);
    case STUCK_RANGE:
        return b->cu->MemAddressFree((CUdeviceptr)s->a, (size_t)s->size);
    case STUCK_MEM:
        return b->cu->MemFree((CUdeviceptr)s->a);
    }
    return CUDA_ERROR_INVALID_VALUE;
}

void cuma_cudabe_stuck_retry(cuda_be *b, cudabe_stuck_kind kind, uint64_t lo, uint64_t hi) {
    size_t k = 0;
    for (size_t i = 0; i < b->nstuck; i++) {
        cudabe_stuck s = b->stuck[i];
        bool match = s.kind == kind && s.a >= lo && s.a < hi;
        if (!match || stuck_retry_one(b, &s) != CUDA_SUCCESS) b->stuck[k++] = s;
    }
    b->nstuck = k;
}

void cuma_cudabe_stuck_forget(cuda_be *b, cudabe_stuck_kind kind, uint64_t a) {
    for (size_t i = 0; i < b->nstuck; i++)
        if (b->stuck[i].kind == kind && b->stuck[i].a == a) {
            b->stuck[i] = b->stuck[--b->nstuck];
            return;
        }
}

/* ---- device memory, events, clock, destroy --------------------------------------------------- */

cuma_status cuma_cudabe_mem_info(cuma_backend *be, uint64_t *free_bytes, uint64_t *total_bytes) {
    cuda_be *b = (cuda_be *)be;
    cudabe_ctx_guard g;
    cuma_status st = cudabe_ctx_enter(b, &g);
    if (st) return st;
    size_t fr = 0, tot = 0;
    CUresult r = b->cu->MemGetInfo(&fr, &tot);
    cudabe_ctx_leave(b, &g);
    st = cuma_cudabe_check(r, "cuMemGetInfo on device %d", b->ordinal);
    if (st == CUMA_OK) *free_bytes = fr, *total_bytes = tot;
    return st;
}

/* An event of context ctx from the pool, creating one when the pool has none. The primary
 * context current. */
static cuma_status event_take(cuda_be *b, CUcontext ctx, uint32_t *out) {
    for (uint32_t *pi = &b->free_event; *pi != NO_EVENT; pi = &b->events[*pi].next) {
        if (b->events[*pi].ctx != ctx) continue;
        *out = *pi;
        *pi = b->events[*out].next;
        return CUMA_OK;
    }
    if (b->nevents == b->capevents) {
        uint32_t nc = b->capevents ? b->capevents * 2 : 64;
        cudabe_event *n = realloc(b->events, nc * sizeof *n);
        if (!n) return cuma_fail(CUMA_ERR_OOM, "no host memory for the event pool");
        b->events = n, b->capevents = nc;
    }
    CUevent ev = NULL;
    CUresult r = ctx == b->ctx ? CUDA_SUCCESS : b->cu->CtxSetCurrent(ctx);
    if (r == CUDA_SUCCESS) {
        r = b->cu->EventCreate(&ev, CU_EVENT_DISABLE_TIMING);
        if (ctx != b->ctx) b->cu->CtxSetCurrent(b->ctx);
    }
    if (r != CUDA_SUCCESS) return cuma_cudabe_check(r, "cuEventCreate in context %p", (void *)ctx);
    b->events[b->nevents] = (cudabe_event){ev, ctx, NO_EVENT};
    *out = b->nevents++;
    return CUMA_OK;
}

static void event_put(cuda_be *b, uint32_t i) {
    b->events[i].next = b->free_event;
    b->free_event = i;
}

/* Whether work put on `stream` now would go into a graph being captured: NULL if not, else why
 * (the stream captures, or it is the legacy stream while a blocking stream captures). */
static const char *capturing(cuda_be *b, cuma_stream stream) {
    CUstreamCaptureStatus cs = CU_STREAM_CAPTURE_STATUS_NONE;
    CUresult cr = b->cu->StreamIsCapturing((CUstream)stream, &cs);
    if (cr == CUDA_ERROR_STREAM_CAPTURE_IMPLICIT) return "a blocking stream captures";
    if (cr == CUDA_SUCCESS && cs != CU_STREAM_CAPTURE_STATUS_NONE) return "it captures a graph";
    return NULL;
}

cuma_status cuma_cudabe_event_record(cuma_backend *be, cuma_stream stream, uint64_t *event) {
    cuda_be *b = (cuda_be *)be;
    cudabe_ctx_guard g;
    cuma_status st = cudabe_ctx_enter(b, &g);
    if (st) return st;
    /* Not on a capturing stream (the record would be a graph node, its event never complete),
     * nor on the legacy stream while a blocking stream captures (the record would fail and
     * break that capture): the fence waits until the capture is over. */
    const char *why = capturing(b, stream);
    if (why) {
        cudabe_ctx_leave(b, &g);
        return cuma_fail(CUMA_ERR_UNSUPPORTED,
                         "no fence on stream %p while %s: it waits for the capture to end", stream,
                         why);
    }
    /* A stream of another context (another device's) gets an event of its own context. */
    CUcontext sc = b->ctx;
    CUstream cs_ = (CUstream)stream;
    if (cs_ && cs_ != CU_STREAM_LEGACY && cs_ != CU_STREAM_PER_THREAD) {
        CUresult gr = b->cu->StreamGetCtx(cs_, &sc);
        if (gr != CUDA_SUCCESS) {
            cudabe_ctx_leave(b, &g);
            return cuma_cudabe_check(gr, "cuStreamGetCtx of stream %p", stream);
        }
    }
    uint32_t i = NO_EVENT;
    st = event_take(b, sc, &i);
    if (st == CUMA_OK) {
        /* A NULL cuma_stream is the legacy default stream, as a NULL CUstream is. */
        CUresult r = b->cu->EventRecord(b->events[i].ev, (CUstream)stream);
        st = cuma_cudabe_check(r, "cuEventRecord on stream %p", stream);
        if (st)
            event_put(b, i);
        else
            *event = i;
    }
    cudabe_ctx_leave(b, &g);
    return st;
}

int cuma_cudabe_event_query(cuma_backend *be, uint64_t event) {
    cuda_be *b = (cuda_be *)be;
    if (event >= b->nevents) return -1;
    cudabe_ctx_guard g;
    if (cudabe_ctx_switch(b, &g) != CUDA_SUCCESS) return -1;
    CUresult r = b->cu->EventQuery(b->events[event].ev);
    cudabe_ctx_leave(b, &g);
    if (r == CUDA_SUCCESS) return 1;
    if (r == CUDA_ERROR_NOT_READY) return 0;
    return -1;
}

cuma_status cuma_cudabe_event_wait(cuma_backend *be, uint64_t event) {
    cuda_be *b = (cuda_be *)be;
    if (event >= b->nevents)
        return cuma_fail(CUMA_ERR_INVALID, "event %" PRIu64 " is not in the pool", event);
    cudabe_ctx_guard g;
    cuma_status st = cudabe_ctx_enter(b, &g);
    if (st) return st;
    CUresult r = b->cu->EventSynchronize(b->events[event].ev);
    cudabe_ctx_leave(b, &g);
    return cuma_cudabe_check(r, "cuEventSynchronize");
}

cuma_status cuma_cudabe_stream_wait(cuma_backend *be, cuma_stream stream, uint64_t event) {
    cuda_be *b = (cuda_be *)be;
    if (event >= b->nevents)
        return cuma_fail(CUMA_ERR_INVALID, "event %" PRIu64 " is not in the pool", event);
    cudabe_ctx_guard g;
    cuma_status st = cudabe_ctx_enter(b, &g);
    if (st) return st;
    /* Not into a graph being captured: the wait would be one of its nodes, not a dependency of
     * the stream's later work. The caller then takes other memory. */
    const char *why = capturing(b, stream);
    if (why) {
        cudabe_ctx_leave(b, &g);
        return cuma_fail(CUMA_ERR_UNSUPPORTED, "no wait on stream %p while %s", stream, why);
    }
    CUresult r = b->cu->StreamWaitEvent((CUstream)stream, b->events[event].ev, 0);
    cudabe_ctx_leave(b, &g);
    return cuma_cudabe_check(r, "cuStreamWaitEvent on stream %p", stream);
}

bool cuma_cudabe_stream_capturing(cuma_backend *be, cuma_stream stream) {
    cuda_be *b = (cuda_be *)be;
    cudabe_ctx_guard g;
    if (cudabe_ctx_switch(b, &g) != CUDA_SUCCESS) return true; /* cannot tell: as if it did */
    bool c = capturing(b, stream) != NULL;
    cudabe_ctx_leave(b, &g);
    return c;
}

void cuma_cudabe_event_release(cuma_backend *be, uint64_t event) {
    cuda_be *b = (cuda_be *)be;
    if (event < b->nevents) event_put(b, (uint32_t)event);
}

uint64_t cuma_cudabe_now(cuma_backend *be) {
    (void)be;
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

void cuma_cudabe_destroy(cuma_backend *be) {
    cuda_be *b = (cuda_be *)be;
    cudabe_ctx_guard g;
    if (b->ctx && cudabe_ctx_switch(b, &g) == CUDA_SUCCESS) {
        /* Mappings before ranges: a range with a page still mapped cannot be freed. Each kind
         * gets a second try, for a failure that was transient. */
        static const cudabe_stuck_kind order[] = {STUCK_MAPPING, STUCK_HANDLE, STUCK_RANGE,
                                                  STUCK_MEM};
        for (int pass = 0; pass < 2 && b->nstuck; pass++)
            for (size_t k = 0; k < sizeof order / sizeof order[0]; k++)
                cuma_cudabe_stuck_retry(b, order[k], 0, UINT64_MAX);
        for (uint32_t i = 0; i < b->nevents; i++)
            if (b->cu->EventDestroy(b->events[i].ev) != CUDA_SUCCESS)
                b->cu->EventDestroy(b->events[i].ev);
        cudabe_ctx_leave(b, &g);
    }
    if (b->ctx) b->cu->DevicePrimaryCtxRelease(b->dev);
    free(b->events);
    free(b->stuck);
    free(b->access);
    free(b);
}

/* ---- creation ------------------------------------------------------------------------------- */

static cuma_status attribute(cuda_be *b, CUdevice_attribute a, const char *name, int *out) {
    *out = 0;
    return cuma_cudabe_check(b->cu->DeviceGetAttribute(out, a, b->dev),
                             "cuDeviceGetAttribute(%s) on device %d", name, b->ordinal);
}

/* Device, primary context, UUID, size. */
static cuma_status open_device(cuda_be *b, int ordinal) {
    b->ordinal = ordinal;
    CUresult r = b->cu->DeviceGet(&b->dev, ordinal);
    if (r != CUDA_SUCCESS) {
        int n = 0;
        if (b->cu->DeviceGetCount(&n) != CUDA_SUCCESS) n = 0;
        char text[200];
        return cuma_fail(CUMA_ERR_NO_DEVICE,
                         "no CUDA device %d (the driver %s sees %d): cuDeviceGet: %s", ordinal,
                         b->cu->path, n, cuma_cuda_result_text(r, text, sizeof text));
    }
    CUcontext ctx = NULL;
    cuma_status st = cuma_cudabe_check(b->cu->DevicePrimaryCtxRetain(&ctx, b->dev),
                                       "cuDevicePrimaryCtxRetain on device %d", ordinal);
    if (st) return st;
    b->ctx = ctx;
    CUuuid u;
    st = cuma_cudabe_check(b->cu->DeviceGetUuid(&u, b->dev), "cuDeviceGetUuid on device %d",
                           ordinal);
    if (st) return st;
    /* The UUID, not the ordinal, names the device: ordinals change with CUDA_VISIBLE_DEVICES,
     * and each MIG instance has a UUID of its own. nvidia-smi's spelling. */
    const unsigned char *x = (const unsigned char *)u.bytes;
    snprintf(b->be.device_id, sizeof b->be.device_id,
             "GPU-%02x%02x%02x%02x-%02x%02x-%02x%02x-%02x%02x-%02x%02x%02x%02x%02x%02x", x[0], x[1],
             x[2], x[3], x[4], x[5], x[6], x[7], x[8], x[9], x[10], x[11], x[12], x[13], x[14],
             x[15]);
    size_t total = 0;
    st = cuma_cudabe_check(b->cu->DeviceTotalMem(&total, b->dev), "cuDeviceTotalMem on device %d",
                           ordinal);
    if (st) return st;
    b->be.capacity = total;
    int managed = 0;
    st = attribute(b, CU_DEVICE_ATTRIBUTE_MANAGED_MEMORY, "MANAGED_MEMORY", &managed);
    if (st) return st;
    b->be.caps = managed ? CUMA_CAP_MANAGED : 0;
    b->be.per_thread_stream = (cuma_stream)CU_STREAM_PER_THREAD;
    return CUMA_OK;
}

cuma_status cuma_cuda_backend_create(const cuma_settings *s, cuma_backend **out) {
    *out = NULL;
    cuma_backend_kind want = CUMA_BACKEND_VMM;
    bool automatic = !strcmp(s->backend, "auto");
    if (!automatic && (!cuma_backend_kind_find(s->backend, &want) || want == CUMA_BACKEND_SIM))
        return cuma_fail(CUMA_ERR_CONFIG,
                         "backend '%s' is not a CUDA backend (vmm, segment, managed, auto)",
                         s->backend);
    const cuma_cuda_api *cu = NULL;
    cuma_status st = cuma_cuda_load(&cu);
    if (st) return st;
    cuda_be *b = calloc(1, sizeof *b);
    if (!b) return cuma_fail(CUMA_ERR_OOM, "no host memory for a CUDA backend");
    b->cu = cu;
    b->free_event = NO_EVENT;
    st = open_device(b, s->device);
    if (st) goto fail;
    int vmm = 0;
    st = attribute(b, CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED,
                   "VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED", &vmm);
    if (st) goto fail;
    if (automatic) want = vmm ? CUMA_BACKEND_VMM : CUMA_BACKEND_SEGMENT;
    if (want == CUMA_BACKEND_VMM) {
        if (!vmm) {
            st = cuma_fail(
                CUMA_ERR_UNSUPPORTED,
                "backend vmm: device %d (%s) does not support virtual memory management; use "
                "backend:segment or backend:auto",
                b->ordinal, b->be.device_id);
            goto fail;
        }
        st = cuma_cudabe_init_vmm(b, s);
        if (st && automatic) {
            /* A device that reports VMM but cannot set it up (seen on some vGPU setups): auto
             * means the best backend that works, and segments work everywhere. */
            free(b->access);
            b->access = NULL, b->naccess = 0;
            b->be.caps &= ~CUMA_CAP_VMM;
            cuma_cudabe_init_segments(b, false);
            st = CUMA_OK;
        }
    } else if (want == CUMA_BACKEND_MANAGED) {
        if (!(b->be.caps & CUMA_CAP_MANAGED)) {
            st = cuma_fail(CUMA_ERR_UNSUPPORTED,
                           "backend managed: device %d (%s) does not support managed memory",
                           b->ordinal, b->be.device_id);
            goto fail;
        }
        cuma_cudabe_init_segments(b, true);
    } else {
        cuma_cudabe_init_segments(b, false);
    }
    if (st) goto fail;
    *out = &b->be;
    return CUMA_OK;
fail:
    cuma_cudabe_destroy(&b->be);
    return st;
}
