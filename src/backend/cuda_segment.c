// SPDX-License-Identifier: Apache-2.0
/* The segment backend (whole cuMemAlloc segments, for devices without virtual memory
 * management) and the managed backend (whole cuMemAllocManaged segments, oversubscribable);
 * also the managed-memory fallback every CUDA backend offers. See cuda_internal.h. */
#include "util/error.h"
#include "cuda_internal.h"

#include <inttypes.h>

/* Segment granularity of both backends: cuMemAlloc hands out 2 MiB pages on current GPUs, so
 * a segment of any other multiple would waste the remainder. */
#define SEGMENT_UNIT (2ull << 20)

static cuma_status alloc_memory(cuda_be *b, bool managed, uint64_t size, uint64_t *addr) {
    cudabe_ctx_guard g;
    cuma_status st = cudabe_ctx_enter(b, &g);
    if (st) return st;
    /* Stuck allocations still hold device memory: give it back before asking for more. */
    if (b->nstuck) cuma_cudabe_stuck_retry(b, STUCK_MEM, 0, UINT64_MAX);
    CUdeviceptr p = 0;
    /* ATTACH_GLOBAL: any stream on any device may use it, as with device memory. */
    CUresult r = managed ? b->cu->MemAllocManaged(&p, (size_t)size, CU_MEM_ATTACH_GLOBAL)
                         : b->cu->MemAlloc(&p, (size_t)size);
    cudabe_ctx_leave(b, &g);
    st = cuma_cudabe_check(r, "%s of %" PRIu64 " bytes on device %d",
                           managed ? "cuMemAllocManaged" : "cuMemAlloc", size, b->ordinal);
    if (st == CUMA_OK) *addr = (uint64_t)p;
    return st;
}

cuma_status cuma_cudabe_seg_alloc(cuma_backend *be, uint64_t size, uint64_t *addr) {
    return alloc_memory((cuda_be *)be, false, size, addr);
}

static cuma_status seg_alloc_managed(cuma_backend *be, uint64_t size, uint64_t *addr) {
    return alloc_memory((cuda_be *)be, true, size, addr);
}

cuma_status cuma_cudabe_managed_alloc(cuma_backend *be, uint64_t size, uint64_t *addr) {
    if (!(be->caps & CUMA_CAP_MANAGED))
        return cuma_fail(CUMA_ERR_UNSUPPORTED, "device %d does not support managed memory",
                         ((cuda_be *)be)->ordinal);
    return alloc_memory((cuda_be *)be, true, size, addr);
}

void cuma_cudabe_mem_free(cuma_backend *be, uint64_t addr, uint64_t size) {
    (void)size; /* cuMemFree knows it */
    cuda_be *b = (cuda_be *)be;
    cudabe_ctx_guard g;
    if (cudabe_ctx_switch(b, &g) != CUDA_SUCCESS) {
        cuma_cudabe_stuck_add(b, STUCK_MEM, addr, 0);
        return;
    }
    if (b->cu->MemFree((CUdeviceptr)addr) != CUDA_SUCCESS)
        cuma_cudabe_stuck_add(b, STUCK_MEM, addr, 0);
    else if (b->nstuck)
        cuma_cudabe_stuck_retry(b, STUCK_MEM, 0, UINT64_MAX);
    cudabe_ctx_leave(b, &g);
}

/* Page ops: a segment backend has none; the core never calls them without CUMA_CAP_VMM. */
static cuma_status no_vmm(const cuma_backend *be, const char *op) {
    return cuma_fail(CUMA_ERR_UNSUPPORTED, "backend %s: %s needs backend:vmm", be->name, op);
}

static cuma_status seg_reserve(cuma_backend *be, uint64_t size, uint64_t align, uint64_t *addr) {
    (void)size, (void)align, (void)addr;
    return no_vmm(be, "reserving a virtual range");
}

static void seg_unreserve(cuma_backend *be, uint64_t addr, uint64_t size) {
    (void)be, (void)addr, (void)size;
}

static cuma_status seg_page_create(cuma_backend *be, uint64_t *handle) {
    (void)handle;
    return no_vmm(be, "creating a page");
}

static void seg_page_release(cuma_backend *be, uint64_t handle) {
    (void)be, (void)handle;
}

static cuma_status seg_map(cuma_backend *be, uint64_t addr, const uint64_t *handles, uint32_t n) {
    (void)addr, (void)handles, (void)n;
    return no_vmm(be, "mapping a page");
}

static cuma_status seg_unmap(cuma_backend *be, uint64_t addr, uint32_t n) {
    (void)addr, (void)n;
    return no_vmm(be, "unmapping a page");
}

/* Segment and managed differ only in how a segment is allocated. */
#define SEGMENT_OPS(alloc_fn)                                                                      \
    {                                                                                              \
        .reserve = seg_reserve, .unreserve = seg_unreserve, .page_create = seg_page_create,        \
        .page_release = seg_page_release, .map = seg_map, .unmap = seg_unmap,                      \
        .seg_alloc = alloc_fn, .seg_free = cuma_cudabe_mem_free, CUMA_CUDABE_COMMON_OPS,           \
    }

static const cuma_backend_ops segment_ops = SEGMENT_OPS(cuma_cudabe_seg_alloc);
static const cuma_backend_ops managed_ops = SEGMENT_OPS(seg_alloc_managed);

void cuma_cudabe_init_segments(cuda_be *b, bool managed) {
    b->be.ops = managed ? &managed_ops : &segment_ops;
    b->be.kind = managed ? CUMA_BACKEND_MANAGED : CUMA_BACKEND_SEGMENT;
    b->be.name = cuma_backend_kind_name(b->be.kind);
    b->be.caps |= CUMA_CAP_SEGMENTS | (managed ? CUMA_CAP_OVERSUBSCRIBE : 0);
    b->be.page_size = SEGMENT_UNIT;
}
