// SPDX-License-Identifier: Apache-2.0
/* The vmm backend: physical pages from cuMemCreate, mapped with cuMemMap into one range from
 * cuMemAddressReserve and made accessible with cuMemSetAccess. See cuda_internal.h. */
#include "util/error.h"
#include "cuda_internal.h"

#include <inttypes.h>
#include <stdlib.h>

static cuma_status vmm_reserve(cuma_backend *be, uint64_t size, uint64_t align, uint64_t *addr) {
    cuda_be *b = (cuda_be *)be;
    cudabe_ctx_guard g;
    cuma_status st = cudabe_ctx_enter(b, &g);
    if (st) return st;
    CUdeviceptr p = 0;
    CUresult r = b->cu->MemAddressReserve(&p, (size_t)size, (size_t)align, 0, 0);
    cudabe_ctx_leave(b, &g);
    st = cuma_cudabe_check(r, "cuMemAddressReserve of %" PRIu64 " bytes (alignment %" PRIu64 ")",
                           size, align);
    if (st == CUMA_OK) *addr = (uint64_t)p;
    return st;
}

static void vmm_unreserve(cuma_backend *be, uint64_t addr, uint64_t size) {
    cuda_be *b = (cuda_be *)be;
    cudabe_ctx_guard g;
    if (cudabe_ctx_switch(b, &g) != CUDA_SUCCESS) {
        cuma_cudabe_stuck_add(b, STUCK_RANGE, addr, size);
        return;
    }
    /* A mapping whose unmap failed would make the free fail: the core is done with the
     * range, so unmap what is left in it first. */
    if (b->nstuck) cuma_cudabe_stuck_retry(b, STUCK_MAPPING, addr, addr + size);
    if (b->cu->MemAddressFree((CUdeviceptr)addr, (size_t)size) != CUDA_SUCCESS)
        cuma_cudabe_stuck_add(b, STUCK_RANGE, addr, size);
    cudabe_ctx_leave(b, &g);
}

static cuma_status vmm_page_create(cuma_backend *be, uint64_t *handle) {
    cuda_be *b = (cuda_be *)be;
    cudabe_ctx_guard g;
    cuma_status st = cudabe_ctx_enter(b, &g);
    if (st) return st;
    /* Stuck handles still hold device memory: give it back before asking for more. */
    if (b->nstuck) cuma_cudabe_stuck_retry(b, STUCK_HANDLE, 0, UINT64_MAX);
    CUmemGenericAllocationHandle h = 0;
    CUresult r = b->cu->MemCreate(&h, (size_t)be->page_size, &b->prop, 0);
    cudabe_ctx_leave(b, &g);
    st = cuma_cudabe_check(r, "cuMemCreate of %" PRIu64 " bytes on device %d", be->page_size,
                           b->ordinal);
    if (st == CUMA_OK) *handle = (uint64_t)h;
    return st;
}

static void vmm_page_release(cuma_backend *be, uint64_t handle) {
    cuda_be *b = (cuda_be *)be;
    cudabe_ctx_guard g;
    if (cudabe_ctx_switch(b, &g) != CUDA_SUCCESS) {
        cuma_cudabe_stuck_add(b, STUCK_HANDLE, handle, 0);
        return;
    }
    if (b->cu->MemRelease((CUmemGenericAllocationHandle)handle) != CUDA_SUCCESS)
        cuma_cudabe_stuck_add(b, STUCK_HANDLE, handle, 0);
    else if (b->nstuck)
        cuma_cudabe_stuck_retry(b, STUCK_HANDLE, 0, UINT64_MAX);
    cudabe_ctx_leave(b, &g);
}

/* Undoes the first n mappings of a run (the core believes none of it mapped). */
static void unmap_run(cuda_be *b, uint64_t addr, uint32_t n) {
    size_t ps = (size_t)b->be.page_size;
    for (uint32_t k = 0; k < n; k++) {
        uint64_t at = addr + (uint64_t)k * ps;
        if (b->cu->MemUnmap((CUdeviceptr)at, ps) != CUDA_SUCCESS)
            cuma_cudabe_stuck_add(b, STUCK_MAPPING, at, ps);
    }
}

static cuma_status vmm_map(cuma_backend *be, uint64_t addr, const uint64_t *handles, uint32_t n) {
    cuda_be *b = (cuda_be *)be;
    size_t ps = (size_t)be->page_size;
    cudabe_ctx_guard g;
    cuma_status st = cudabe_ctx_enter(b, &g);
    if (st) return st;
    /* A failed rollback below may have left pages here that the core believes gone. */
    if (b->nstuck) cuma_cudabe_stuck_retry(b, STUCK_MAPPING, addr, addr + (uint64_t)n * ps);
    for (uint32_t k = 0; k < n; k++) {
        uint64_t at = addr + (uint64_t)k * ps;
        CUresult r =
            b->cu->MemMap((CUdeviceptr)at, ps, 0, (CUmemGenericAllocationHandle)handles[k], 0);
        if (r != CUDA_SUCCESS) {
            st = cuma_cudabe_check(r, "cuMemMap at 0x%" PRIx64, at);
            unmap_run(b, addr, k);
            cudabe_ctx_leave(b, &g);
            return st;
        }
    }
    /* One call for the run: each mapping is one handle, but access is set on a range (where the
     * probe found the driver takes one). */
    CUresult r = CUDA_SUCCESS;
    bool asked = b->access_way == RUN_UNTRIED && n > 1;
    if (b->access_way == RUN_RANGE || asked)
        r = b->cu->MemSetAccess((CUdeviceptr)addr, (size_t)n * ps, b->access, b->naccess);
    if (asked) {
        /* Started on a full device: the probe's question, answered by this call. Refused over
         * a range: a page at a time, now and from now on. */
        b->access_way = r == CUDA_SUCCESS ? RUN_RANGE : RUN_PER_PAGE;
        r = CUDA_SUCCESS;
    }
    bool per_page = b->access_way != RUN_RANGE;
    for (uint32_t k = 0; per_page && k < n && r == CUDA_SUCCESS; k++)
        r = b->cu->MemSetAccess((CUdeviceptr)(addr + (uint64_t)k * ps), ps, b->access, b->naccess);
    if (r != CUDA_SUCCESS) {
        /* An inaccessible mapping is useless and the core will not unmap what it thinks
         * failed to map: undo it here. */
        st = cuma_cudabe_check(r, "cuMemSetAccess at 0x%" PRIx64 " (%u pages) for %zu device(s)",
                               addr, n, b->naccess);
        unmap_run(b, addr, n);
        /* A page at a time failed too: the range's refusal said nothing about ranges. */
        if (asked) b->access_way = RUN_UNTRIED;
    }
    cudabe_ctx_leave(b, &g);
    return st;
}

/* One range for n pages (the driver unmaps every whole mapping in a range); on failure page by
 * page, and a page that still fails is remembered until an unmap at its address succeeds or the
 * range is freed: the core does not retry it, nor does destroy without the list. */
static cuma_status vmm_unmap(cuma_backend *be, uint64_t addr, uint32_t n) {
    cuda_be *b = (cuda_be *)be;
    uint64_t ps = be->page_size;
    cudabe_ctx_guard g;
    cuma_status st = cudabe_ctx_enter(b, &g);
    if (st) {
        /* The core takes the pages as unmapped either way: what could not even be tried is
         * remembered like any mapping that failed, and retried. */
        for (uint32_t k = 0; k < n; k++) cuma_cudabe_stuck_add(b, STUCK_MAPPING, addr + k * ps, ps);
        return st;
    }
    bool ask = b->unmap_way == RUN_UNTRIED && n > 1; /* started on a full device: ask, by doing */
    CUresult r = b->unmap_way == RUN_PER_PAGE && n > 1
                     ? CUDA_ERROR_NOT_SUPPORTED
                     : b->cu->MemUnmap((CUdeviceptr)addr, (size_t)(n * ps));
    if (ask) b->unmap_way = r == CUDA_SUCCESS ? RUN_RANGE : RUN_PER_PAGE;
    uint64_t bad = addr;
    if (r != CUDA_SUCCESS && n > 1) {
        r = CUDA_SUCCESS;
        for (uint32_t k = 0; k < n; k++) {
            uint64_t at = addr + k * ps;
            CUresult rk = b->cu->MemUnmap((CUdeviceptr)at, (size_t)ps);
            if (rk != CUDA_SUCCESS) {
                cuma_cudabe_stuck_add(b, STUCK_MAPPING, at, ps);
                if (r == CUDA_SUCCESS) r = rk, bad = at;
            } else if (b->nstuck) {
                cuma_cudabe_stuck_forget(b, STUCK_MAPPING, at);
            }
        }
        /* Pages failed one at a time too: the range's refusal said nothing about ranges. */
        if (ask && r != CUDA_SUCCESS) b->unmap_way = RUN_UNTRIED;
    } else if (r != CUDA_SUCCESS) {
        cuma_cudabe_stuck_add(b, STUCK_MAPPING, addr, ps);
    } else if (b->nstuck) {
        for (uint32_t k = 0; k < n; k++) cuma_cudabe_stuck_forget(b, STUCK_MAPPING, addr + k * ps);
    }
    cudabe_ctx_leave(b, &g);
    return cuma_cudabe_check(r, "cuMemUnmap at 0x%" PRIx64 " (of %u pages)", bad, n);
}

static const cuma_backend_ops vmm_ops = {
    .reserve = vmm_reserve,
    .unreserve = vmm_unreserve,
    .page_create = vmm_page_create,
    .page_release = vmm_page_release,
    .map = vmm_map,
    .unmap = vmm_unmap,
    .seg_alloc = cuma_cudabe_seg_alloc, /* whole segments work on a VMM device too */
    .seg_free = cuma_cudabe_mem_free,
    CUMA_CUDABE_COMMON_OPS,
};

/* The owner and every device that can reach this one's memory get read-write access, so a
 * tensor can be read by a peer without remapping (one descriptor list for every map). */
static cuma_status build_access(cuda_be *b) {
    int n = 0;
    cuma_status st = cuma_cudabe_check(b->cu->DeviceGetCount(&n), "cuDeviceGetCount");
    if (st) return st;
    b->access = calloc((size_t)(n > 0 ? n : 1), sizeof *b->access);
    if (!b->access) return cuma_fail(CUMA_ERR_OOM, "no host memory for %d access descriptors", n);
    CUmemAccessDesc own = {.location = {.type = CU_MEM_LOCATION_TYPE_DEVICE, .id = b->dev},
                           .flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE};
    b->access[b->naccess++] = own;
    for (int i = 0; i < n; i++) {
        CUdevice peer;
        int can = 0;
        if (b->cu->DeviceGet(&peer, i) != CUDA_SUCCESS || peer == b->dev) continue;
        /* Can contexts on `peer` access memory of our device? */
        if (b->cu->DeviceCanAccessPeer(&can, peer, b->dev) != CUDA_SUCCESS || !can) continue;
        CUmemAccessDesc d = own;
        d.location.id = peer;
        b->access[b->naccess++] = d;
    }
    return CUMA_OK;
}

/* What this driver does with virtual memory, tried once at creation on two pages in a range of
 * three (some vGPU and sandboxed drivers report VMM and refuse parts of it): a run mapped with
 * one cuMemSetAccess (else one a page), a page mapped at a second address (else no early
 * remaps: CUMA_CAP_ALIAS), a run unmapped with one cuMemUnmap (else one a page). A driver that
 * cannot map and make accessible one page at all fails the backend (auto then takes segments);
 * a device too full for the two pages gets the conservative answers to all three.
 * Everything it made is gone again on every path. */
static cuma_status probe(cuda_be *b) {
    uint64_t ps = b->be.page_size, va = 0, h[2] = {0, 0};
    cuma_status st = vmm_reserve(&b->be, 3 * ps, ps, &va);
    if (st) return st;
    int made = 0;
    for (; made < 2 && !st; made++) st = vmm_page_create(&b->be, &h[made]);
    if (st) made--;
    /* No room for two pages now (another program holds the device): virtual memory works, it
     * just cannot be tried. Segments for the heap's whole life would be the wrong answer to a
     * moment's shortage, so the backend takes the ways every driver accepts (access and unmap
     * a page at a time, no second mappings: no early remaps), and the first map and unmap of
     * several pages ask the range questions by doing. */
    if (st == CUMA_ERR_OOM) {
        while (made-- > 0) vmm_page_release(&b->be, h[made]);
        vmm_unreserve(&b->be, va, 3 * ps);
        b->access_way = b->unmap_way = RUN_UNTRIED;
        cuma_clear_error();
        return CUMA_OK;
    }
    if (!st) {
        st = vmm_map(&b->be, va, h, 2);
        if (st) { /* one access call a page, then? */
            b->access_way = RUN_PER_PAGE;
            st = vmm_map(&b->be, va, h, 2);
        }
    }
    if (!st) {
        if (vmm_map(&b->be, va + 2 * ps, &h[0], 1) == CUMA_OK) {
            b->be.caps |= CUMA_CAP_ALIAS;
            vmm_unmap(&b->be, va + 2 * ps, 1);
        }
        cudabe_ctx_guard g;
        if (cudabe_ctx_enter(b, &g) == CUMA_OK) {
            if (b->cu->MemUnmap((CUdeviceptr)va, (size_t)(2 * ps)) != CUDA_SUCCESS) {
                b->unmap_way = RUN_PER_PAGE;
                cudabe_ctx_leave(b, &g);
                vmm_unmap(&b->be, va, 2); /* one a page; what fails is retried later */
            } else {
                cudabe_ctx_leave(b, &g);
            }
        } else {
            vmm_unmap(&b->be, va, 2);
        }
    }
    while (made-- > 0) vmm_page_release(&b->be, h[made]);
    vmm_unreserve(&b->be, va, 3 * ps);
    if (!st) cuma_clear_error(); /* what failed on the way was tried and answered */
    return st;
}

cuma_status cuma_cudabe_init_vmm(cuda_be *b, const cuma_settings *s) {
    b->be.ops = &vmm_ops;
    b->be.kind = CUMA_BACKEND_VMM;
    b->be.name = cuma_backend_kind_name(CUMA_BACKEND_VMM);
    b->be.caps |= CUMA_CAP_VMM;
    b->prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
    b->prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    b->prop.location.id = b->dev;
    /* Pages that NCCL, NVSHMEM or an InfiniBand adapter can register (GPUDirect RDMA), where the
     * device allows asking for it; a driver that does not know the attribute says no. */
    int rdma = 0;
    if (b->cu->DeviceGetAttribute(&rdma,
                                  CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WITH_CUDA_VMM_SUPPORTED,
                                  b->dev) == CUDA_SUCCESS &&
        rdma)
        b->prop.allocFlags.gpuDirectRDMACapable = 1;
    size_t gran = 0;
    cuma_status st = cuma_cudabe_check(
        b->cu->MemGetAllocationGranularity(&gran, &b->prop, CU_MEM_ALLOC_GRANULARITY_RECOMMENDED),
        "cuMemGetAllocationGranularity on device %d", b->ordinal);
    if (st) return st;
    if (!gran || (gran & (gran - 1)))
        return cuma_fail(CUMA_ERR_UNSUPPORTED,
                         "device %d: allocation granularity %zu is not a power of two", b->ordinal,
                         gran);
    /* The device's recommended granularity (2 MiB today), unless the settings ask for larger
     * pages that it divides: fewer driver calls per byte, at the price of coarser release. A
     * page_size the granularity does not divide cannot be mapped and is ignored. */
    b->be.page_size = gran;
    if (s->page_size > gran && s->page_size % gran == 0) b->be.page_size = s->page_size;
    st = build_access(b);
    return st ? st : probe(b);
}
