// SPDX-License-Identifier: Apache-2.0
/*
 * test_fakecuda.c - self test of the fake CUDA driver (tests/fakecuda):
 * main, initialisation, devices, contexts and memory (VMM, capacity,
 * cuMemAlloc/managed, fault injection, a reset of the primary context). Streams, events, threads,
 * exports and the environment modes are in test_fakecuda_streams.c; the shared check macros and
 * helpers in test_fakecuda.h.
 *
 * Runs with FAKECUDA_DEVICES=2, FAKECUDA_CAPACITY=64M, FAKECUDA_GRANULARITY=2M
 * (set below, before the library reads its configuration). Every check
 * aborts with the section, line and failed expression. Some checks fork a
 * child that must die (SIGSEGV on an inaccessible page, SIGABRT on a
 * synchronize that waits for held work); some re-execute this binary with a
 * different environment ("no-vmm", "no-device", "bad-env" modes).
 */
#include "test_fakecuda.h"

const char *g_section = "init";
CUcontext g_ctx0, g_ctx1;

void fail(int line, const char *what, const char *detail) {
    fprintf(stderr, "test_fakecuda: [%s] line %d: check failed: %s%s%s\n", g_section, line, what,
            detail ? " -- " : "", detail ? detail : "");
    abort();
}

/* ---- sections ------------------------------------------------------------- */

static void test_preinit(void) {
    g_section = "preinit";
    int v = 0, n = 0;
    OK(cuDriverGetVersion(&v));
    CHECK(v == 13000);
    CUdeviceptr p;
    size_t a, b;
    CHECK_RC(cuDeviceGetCount(&n), CUDA_ERROR_NOT_INITIALIZED); /* call #1 */
    CHECK_RC(cuMemAlloc(&p, 16), CUDA_ERROR_NOT_INITIALIZED);
    CHECK_RC(cuMemGetInfo(&a, &b), CUDA_ERROR_NOT_INITIALIZED);
    CHECK_RC(cuMemAddressReserve(&p, GRAN, 0, 0, 0), CUDA_ERROR_NOT_INITIALIZED);
    CHECK_RC(cuStreamQuery(NULL), CUDA_ERROR_NOT_INITIALIZED);
    const char *s = NULL;
    OK(cuGetErrorName(CUDA_ERROR_OUT_OF_MEMORY, &s));
    CHECK(s && strcmp(s, "CUDA_ERROR_OUT_OF_MEMORY") == 0);
    OK(cuGetErrorString(CUDA_ERROR_INVALID_VALUE, &s));
    CHECK(s && strlen(s) > 0);
    CHECK_RC(cuGetErrorString((CUresult)12345, &s), CUDA_ERROR_INVALID_VALUE);
    CHECK(s == NULL);
    void *fn = NULL;
    CUdriverProcAddressQueryResult st = CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND;
    OK(cuGetProcAddress("cuInit", &fn, 13000, 0, &st)); /* works before cuInit */
    CHECK(fn == (void *)cuInit && st == CU_GET_PROC_ADDRESS_SUCCESS);
    CHECK(fakecuda_calls("cuDeviceGetCount") == 1);
    CHECK_RC(cuInit(1), CUDA_ERROR_INVALID_VALUE);
    OK(cuInit(0));
    OK(cuInit(0));
}

static void test_env_fail(void) {
    g_section = "FAKECUDA_FAIL";
    int n = 0;
    CHECK_RC(cuDeviceGetCount(&n), CUDA_ERROR_OUT_OF_MEMORY); /* call #2 */
    CHECK(n == 0);                                            /* no side effect */
    OK(cuDeviceGetCount(&n));
    CHECK(n == 2);
    CHECK(fakecuda_calls("cuDeviceGetCount") == 3);
}

static void test_devices(void) {
    g_section = "devices";
    CUdevice d;
    OK(cuDeviceGet(&d, 1));
    CHECK(d == 1);
    CHECK_RC(cuDeviceGet(&d, 2), CUDA_ERROR_INVALID_DEVICE);
    CHECK_RC(cuDeviceGet(&d, -1), CUDA_ERROR_INVALID_DEVICE);
    CHECK_RC(cuDeviceGet(NULL, 0), CUDA_ERROR_INVALID_VALUE);
    char name[64];
    OK(cuDeviceGetName(name, sizeof name, 1));
    CHECK(strcmp(name, "cuma fake device 1") == 0);
    OK(cuDeviceGetName(name, 5, 0));
    CHECK(strcmp(name, "cuma") == 0);
    CHECK_RC(cuDeviceGetName(name, 0, 0), CUDA_ERROR_INVALID_VALUE);
    CHECK_RC(cuDeviceGetName(name, 64, 2), CUDA_ERROR_INVALID_DEVICE);

    CUuuid u0, u0b, u1;
    OK(cuDeviceGetUuid(&u0, 0));
    OK(cuDeviceGetUuid(&u0b, 0));
    OK(cuDeviceGetUuid(&u1, 1));
    CHECK(memcmp(&u0, &u0b, sizeof u0) == 0);
    CHECK(memcmp(&u0, &u1, sizeof u0) != 0);
    CHECK_RC(cuDeviceGetUuid(&u0, 9), CUDA_ERROR_INVALID_DEVICE);

    static const struct {
        CUdevice_attribute a;
        int want;
    } attrs[] = {
        {CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED, 1},
        {CU_DEVICE_ATTRIBUTE_MANAGED_MEMORY, 1},
        {CU_DEVICE_ATTRIBUTE_UNIFIED_ADDRESSING, 1},
        {CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, 9},
        {CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, 0},
        {CU_DEVICE_ATTRIBUTE_MAX_PITCH, 0}, /* unknown to the fake -> 0 */
    };
    for (size_t i = 0; i < sizeof attrs / sizeof attrs[0]; i++) {
        int v = -1;
        OK(cuDeviceGetAttribute(&v, attrs[i].a, 0));
        CHECK(v == attrs[i].want);
    }
    int bus0, bus1, v;
    OK(cuDeviceGetAttribute(&bus0, CU_DEVICE_ATTRIBUTE_PCI_BUS_ID, 0));
    OK(cuDeviceGetAttribute(&bus1, CU_DEVICE_ATTRIBUTE_PCI_BUS_ID, 1));
    CHECK(bus0 != bus1);
    OK(cuDeviceGetAttribute(&v, CU_DEVICE_ATTRIBUTE_PCI_DEVICE_ID, 1));
    CHECK_RC(cuDeviceGetAttribute(&v, CU_DEVICE_ATTRIBUTE_MAX, 0), CUDA_ERROR_INVALID_VALUE);
    CHECK_RC(cuDeviceGetAttribute(&v, CU_DEVICE_ATTRIBUTE_WARP_SIZE, 2), CUDA_ERROR_INVALID_DEVICE);

    size_t total = 0;
    OK(cuDeviceTotalMem(&total, 1));
    CHECK(total == CAP);
    int can = -1;
    OK(cuDeviceCanAccessPeer(&can, 0, 1));
    CHECK(can == 1);
    OK(cuDeviceCanAccessPeer(&can, 1, 1));
    CHECK(can == 0);
}

static void *thread_get_ctx(void *arg) {
    CUcontext c = (CUcontext)arg;
    if (cuCtxGetCurrent(&c) != CUDA_SUCCESS) return (void *)1;
    return c; /* must be NULL: the current context is per thread */
}

static void test_contexts(void) {
    g_section = "contexts";
    CUcontext c = (CUcontext)1;
    CUdevice d;
    CUdeviceptr p;
    size_t fr, tot;
    CUstream s;
    OK(cuCtxGetCurrent(&c));
    CHECK(c == NULL);
    CHECK_RC(cuCtxGetDevice(&d), CUDA_ERROR_INVALID_CONTEXT);
    CHECK_RC(cuMemAlloc(&p, 16), CUDA_ERROR_INVALID_CONTEXT);
    CHECK_RC(cuMemGetInfo(&fr, &tot), CUDA_ERROR_INVALID_CONTEXT);
    CHECK_RC(cuStreamCreate(&s, 0), CUDA_ERROR_INVALID_CONTEXT);
    CHECK_RC(cuDevicePrimaryCtxRelease(1), CUDA_ERROR_INVALID_CONTEXT); /* not retained */
    int junk;
    CHECK_RC(cuCtxSetCurrent((CUcontext)&junk), CUDA_ERROR_INVALID_CONTEXT);
    OK(cuDevicePrimaryCtxRetain(&g_ctx0, 0));
    OK(cuDevicePrimaryCtxRetain(&g_ctx1, 1));
    CHECK(g_ctx0 && g_ctx1 && g_ctx0 != g_ctx1);
    CHECK_RC(cuDevicePrimaryCtxRetain(&c, 3), CUDA_ERROR_INVALID_DEVICE);
    OK(cuCtxSetCurrent(g_ctx1));
    OK(cuCtxGetDevice(&d));
    CHECK(d == 1);
    OK(cuCtxSetCurrent(g_ctx0));
    OK(cuCtxGetCurrent(&c));
    CHECK(c == g_ctx0);
    OK(cuCtxGetDevice(&d));
    CHECK(d == 0);
    pthread_t t;
    void *res = (void *)1;
    CHECK(pthread_create(&t, NULL, thread_get_ctx, g_ctx0) == 0);
    CHECK(pthread_join(t, &res) == 0);
    CHECK(res == NULL);
}

static void test_vmm(void) {
    g_section = "vmm";
    CUmemAllocationProp prop = prop_for(0);
    size_t g = 0;
    OK(cuMemGetAllocationGranularity(&g, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM));
    CHECK(g == GRAN);
    OK(cuMemGetAllocationGranularity(&g, &prop, CU_MEM_ALLOC_GRANULARITY_RECOMMENDED));
    CHECK(g == GRAN);
    CHECK_RC(cuMemGetAllocationGranularity(&g, &prop, (CUmemAllocationGranularity_flags)7),
             CUDA_ERROR_INVALID_VALUE);
    CUmemAllocationProp bad = prop_for(5);
    CHECK_RC(cuMemGetAllocationGranularity(&g, &bad, 0), CUDA_ERROR_INVALID_DEVICE);

    CUdeviceptr r = 0;
    CHECK_RC(cuMemAddressReserve(&r, GRAN + 4096, 0, 0, 0), CUDA_ERROR_INVALID_VALUE);
    CHECK_RC(cuMemAddressReserve(&r, GRAN, 3 * GRAN, 0, 0), CUDA_ERROR_INVALID_VALUE);
    CHECK_RC(cuMemAddressReserve(&r, GRAN, 0, 0, 1), CUDA_ERROR_INVALID_VALUE);
    OK(cuMemAddressReserve(&r, GRAN, 64 * MiB, 0, 0));
    CHECK(r % (64 * MiB) == 0);
    OK(cuMemAddressFree(r, GRAN));
    CHECK_RC(cuMemAddressFree(r, GRAN), CUDA_ERROR_INVALID_VALUE);
    CUdeviceptr r2 = 0;
    OK(cuMemAddressReserve(&r2, 2 * GRAN, 0, r, 0)); /* the hint is free: honoured */
    CHECK(r2 == r);
    OK(cuMemAddressFree(r2, 2 * GRAN));

    CUmemGenericAllocationHandle h = 0, h2;
    CHECK_RC(cuMemCreate(&h, 3 * MiB, &prop, 0), CUDA_ERROR_INVALID_VALUE);
    CHECK_RC(cuMemCreate(&h, GRAN, &prop, 1), CUDA_ERROR_INVALID_VALUE);
    CHECK_RC(cuMemCreate(&h, GRAN, &bad, 0), CUDA_ERROR_INVALID_DEVICE);
    bad = prop_for(0);
    bad.type = CU_MEM_ALLOCATION_TYPE_MANAGED;
    CHECK_RC(cuMemCreate(&h, GRAN, &bad, 0), CUDA_ERROR_INVALID_VALUE);
    CHECK(h == 0);

    const size_t RS = 32 * MiB;
    CUdeviceptr base = reserve(RS);
    h = create(0, 2 * GRAN);
    h2 = create(0, 2 * GRAN);
    CHECK(fakecuda_live("handles") == 2 && fakecuda_live("reservations") == 1);
    /* argument checks */
    CHECK_RC(cuMemMap(base + 4096, GRAN, 0, h, 0), CUDA_ERROR_INVALID_VALUE);
    CHECK_RC(cuMemMap(base, GRAN, 4096, h, 0), CUDA_ERROR_INVALID_VALUE);
    CHECK_RC(cuMemMap(base, 3 * GRAN, 0, h, 0), CUDA_ERROR_INVALID_VALUE);
    CHECK_RC(cuMemMap(base, 2 * GRAN, GRAN, h, 0), CUDA_ERROR_INVALID_VALUE);
    CHECK_RC(cuMemMap(base, GRAN, 0, h ^ 0x40000000ull, 0), CUDA_ERROR_INVALID_VALUE);
    CHECK_RC(cuMemMap(base, GRAN, 0, h, 1), CUDA_ERROR_INVALID_VALUE);
    /* outside the reservation: straddling its end, and not reserved at all */
    CHECK_RC(cuMemMap(base + RS - GRAN, 2 * GRAN, 0, h, 0), CUDA_ERROR_INVALID_VALUE);
    CHECK_RC(cuMemMap(base + RS, GRAN, 0, h, 0), CUDA_ERROR_INVALID_VALUE);
    CHECK(fakecuda_live("mappings") == 0);

    OK(cuMemMap(base, 2 * GRAN, 0, h, 0));
    CHECK_RC(cuMemMap(base + GRAN, 2 * GRAN, 0, h2, 0), CUDA_ERROR_INVALID_VALUE); /* overlap */
    CHECK_RC(cuMemMap(base, GRAN, 0, h2, 0), CUDA_ERROR_INVALID_VALUE);            /* overlap */
    OK(cuMemMap(base + 2 * GRAN, 2 * GRAN, 0, h2, 0));                             /* adjacent */
    CHECK(fakecuda_live("mappings") == 2);

    /* inaccessible until cuMemSetAccess */
    CHECK_FAULTS(base, 0);
    OK(set_access(base, 2 * GRAN, 0, CU_MEM_ACCESS_FLAGS_PROT_READWRITE));
    fill(base, 2 * GRAN, 7);
    CHECK(check_fill(base, 2 * GRAN, 7));
    CHECK_FAULTS(base + 2 * GRAN, 0); /* h2's mapping still inaccessible */
    /* SetAccess needs a fully mapped range and valid descriptors */
    CHECK_RC(set_access(base, 6 * GRAN, 0, CU_MEM_ACCESS_FLAGS_PROT_READWRITE),
             CUDA_ERROR_INVALID_VALUE);
    CHECK_RC(set_access(base + 8 * GRAN, GRAN, 0, CU_MEM_ACCESS_FLAGS_PROT_READWRITE),
             CUDA_ERROR_INVALID_VALUE);
    CHECK_RC(set_access(base, GRAN, 7, CU_MEM_ACCESS_FLAGS_PROT_READWRITE),
             CUDA_ERROR_INVALID_DEVICE);
    CHECK_RC(set_access(base, GRAN, 0, (CUmemAccess_flags)2), CUDA_ERROR_INVALID_VALUE);
    CUmemAccessDesc hostdesc = {{CU_MEM_LOCATION_TYPE_HOST, 0}, CU_MEM_ACCESS_FLAGS_PROT_READ};
    CHECK_RC(cuMemSetAccess(base, GRAN, &hostdesc, 1), CUDA_ERROR_INVALID_VALUE);
    CHECK_RC(cuMemSetAccess(base, GRAN, &hostdesc, 0), CUDA_ERROR_INVALID_VALUE);
    /* one call spanning two mappings; read-only faults on write */
    OK(set_access(base, 4 * GRAN, 0, CU_MEM_ACCESS_FLAGS_PROT_READ));
    CHECK_FAULTS(base + 3 * GRAN, 1);
    CHECK_FAULTS(base, 1);
    CHECK_NO_FAULT(base, 0);
    CHECK(check_fill(base, 2 * GRAN, 7));
    /* the CPU gets the access of the device owning the memory (device 0) */
    CUmemAccessDesc two[2] = {
        {{CU_MEM_LOCATION_TYPE_DEVICE, 0}, CU_MEM_ACCESS_FLAGS_PROT_READWRITE},
        {{CU_MEM_LOCATION_TYPE_DEVICE, 1}, CU_MEM_ACCESS_FLAGS_PROT_NONE}};
    OK(cuMemSetAccess(base, 4 * GRAN, two, 2));
    CHECK_NO_FAULT(base + 3 * GRAN, 1);
    OK(set_access(base, 4 * GRAN, 1, CU_MEM_ACCESS_FLAGS_PROT_NONE)); /* peer only */
    CHECK_NO_FAULT(base, 1);

    /* memset / memcpy on mapped memory, range checks */
    unsigned char buf[8192], back[8192];
    for (size_t i = 0; i < sizeof buf; i++) buf[i] = (unsigned char)(i * 31);
    OK(cuMemcpyHtoD(base + 2 * GRAN - 4096, buf, sizeof buf)); /* crosses h -> h2 */
    OK(cuMemcpyDtoH(back, base + 2 * GRAN - 4096, sizeof back));
    CHECK(memcmp(buf, back, sizeof buf) == 0);
    OK(cuMemsetD8(base + 3 * GRAN, 0xA5, 100));
    CHECK(H(base + 3 * GRAN)[99] == 0xA5 && H(base + 3 * GRAN)[100] != 0xA5);
    CHECK_RC(cuMemsetD8(base + 4 * GRAN - 10, 0, 20), CUDA_ERROR_INVALID_VALUE);
    CHECK_RC(cuMemcpyDtoH(back, base + 8 * GRAN, 16), CUDA_ERROR_INVALID_VALUE);
    CHECK_RC(cuMemcpyHtoD((CUdeviceptr)(uintptr_t)buf, back, 16), CUDA_ERROR_INVALID_VALUE);
    fill(base, 2 * GRAN, 7); /* restore the pattern the copies overwrote */

    /* unmap must cover whole mappings */
    CHECK_RC(cuMemUnmap(base, GRAN), CUDA_ERROR_INVALID_VALUE);
    CHECK_RC(cuMemUnmap(base + GRAN, 2 * GRAN), CUDA_ERROR_INVALID_VALUE);
    CHECK_RC(cuMemUnmap(base, 3 * GRAN), CUDA_ERROR_INVALID_VALUE);
    CHECK_RC(cuMemUnmap(base, 6 * GRAN), CUDA_ERROR_INVALID_VALUE);
    CHECK_RC(cuMemAddressFree(base, RS), CUDA_ERROR_INVALID_VALUE); /* still mapped */
    OK(cuMemUnmap(base, 4 * GRAN));                                 /* two whole mappings at once */
    CHECK(fakecuda_live("mappings") == 0);
    CHECK_FAULTS(base, 0);                /* the reservation is inaccessible again... */
    CHECK(addr_occupied(base, 4 * GRAN)); /* ...but still reserved */

    /* data survives unmap + remap at another address, also at an offset */
    OK(cuMemMap(base + 8 * GRAN, 2 * GRAN, 0, h, 0));
    OK(cuMemMap(base + 4 * GRAN, GRAN, GRAN, h, 0)); /* second half of h */
    OK(set_access(base + 8 * GRAN, 2 * GRAN, 0, CU_MEM_ACCESS_FLAGS_PROT_READWRITE));
    OK(set_access(base + 4 * GRAN, GRAN, 0, CU_MEM_ACCESS_FLAGS_PROT_READWRITE));
    CHECK(check_fill(base + 8 * GRAN, 2 * GRAN, 7));
    CHECK(H(base + 4 * GRAN)[0] == H(base + 9 * GRAN)[0]);
    H(base + 4 * GRAN)[4096] = 0xEE; /* two mappings of one handle share memory */
    CHECK(H(base + 9 * GRAN)[4096] == 0xEE);
    CHECK_RC(cuMemAddressFree(base, RS), CUDA_ERROR_INVALID_VALUE);
    OK(cuMemUnmap(base + 8 * GRAN, 2 * GRAN));
    OK(cuMemUnmap(base + 4 * GRAN, GRAN));
    CHECK_RC(cuMemAddressFree(base, RS - GRAN), CUDA_ERROR_INVALID_VALUE); /* wrong size */
    OK(cuMemRelease(h));
    OK(cuMemRelease(h2));
    OK(cuMemAddressFree(base, RS));
    CHECK(!addr_occupied(base, RS));
    CHECK(fakecuda_live("handles") == 0 && fakecuda_live("reservations") == 0);
    CHECK(fakecuda_used_bytes(0) == 0);
}

/* cuMemCreate's properties are validated; RDMA-capable handles are counted. */
static void test_props(void) {
    g_section = "cuMemCreate properties";
    int v = -1;
    OK(cuDeviceGetAttribute(&v, CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WITH_CUDA_VMM_SUPPORTED, 0));
    CHECK(v == 1);
    size_t gmin = 0, grec = 0;
    CUmemAllocationProp p = prop_for(0);
    OK(cuMemGetAllocationGranularity(&gmin, &p, CU_MEM_ALLOC_GRANULARITY_MINIMUM));
    OK(cuMemGetAllocationGranularity(&grec, &p, CU_MEM_ALLOC_GRANULARITY_RECOMMENDED));
    CHECK(gmin == GRAN && grec == GRAN); /* FAKECUDA_RECOMMENDED_GRANULARITY unset */
    CUmemGenericAllocationHandle h = 0;
    p.allocFlags.gpuDirectRDMACapable = 1;
    OK(cuMemCreate(&h, GRAN, &p, 0));
    CHECK(fakecuda_live("rdma_handles") == 1);
    OK(cuMemRelease(h));
    CHECK(fakecuda_live("rdma_handles") == 0);
    p.requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
    OK(cuMemCreate(&h, GRAN, &p, 0));
    OK(cuMemRelease(h));
    CUmemAllocationProp bad[5];
    for (int i = 0; i < 5; i++) bad[i] = prop_for(0);
    bad[0].requestedHandleTypes = CU_MEM_HANDLE_TYPE_WIN32;
    bad[1].allocFlags.compressionType = CU_MEM_ALLOCATION_COMP_GENERIC;
    bad[2].allocFlags.gpuDirectRDMACapable = 2;
    bad[3].allocFlags.usage = 1;
    bad[4].allocFlags.reserved[0] = 1;
    for (int i = 0; i < 5; i++) {
        CHECK_RC(cuMemCreate(&h, GRAN, &bad[i], 0), CUDA_ERROR_INVALID_VALUE);
        size_t g;
        CHECK_RC(cuMemGetAllocationGranularity(&g, &bad[i], CU_MEM_ALLOC_GRANULARITY_MINIMUM),
                 CUDA_ERROR_INVALID_VALUE);
    }
    CHECK(fakecuda_live("handles") == 0);
}

static void test_release_while_mapped(void) {
    g_section = "release while mapped";
    CUdeviceptr base = reserve(8 * GRAN);
    long long blocks0 = memfd_blocks(0);
    CUmemGenericAllocationHandle h = create(0, 2 * GRAN);
    CHECK(fakecuda_used_bytes(0) == 2 * GRAN);
    OK(cuMemMap(base, 2 * GRAN, 0, h, 0));
    OK(cuMemMap(base + 4 * GRAN, 2 * GRAN, 0, h, 0));
    OK(set_access(base, 2 * GRAN, 0, CU_MEM_ACCESS_FLAGS_PROT_READWRITE));
    memset(H(base), 0x3c, 2 * GRAN);
    CHECK(memfd_blocks(0) >= blocks0 + (long long)(2 * GRAN / 512));
    OK(cuMemRelease(h));
    CHECK(fakecuda_live("handles") == 0);
    CHECK(fakecuda_used_bytes(0) == 2 * GRAN); /* still mapped: still charged */
    CHECK(H(base)[2 * GRAN - 1] == 0x3c);
    CHECK_RC(cuMemRelease(h), CUDA_ERROR_INVALID_VALUE);
    CHECK_RC(cuMemMap(base + 2 * GRAN, 2 * GRAN, 0, h, 0), CUDA_ERROR_INVALID_VALUE);
    OK(cuMemUnmap(base, 2 * GRAN));
    CHECK(fakecuda_used_bytes(0) == 2 * GRAN); /* one mapping left */
    OK(cuMemUnmap(base + 4 * GRAN, 2 * GRAN));
    CHECK(fakecuda_used_bytes(0) == 0);
    CHECK(memfd_blocks(0) <= blocks0); /* hole punched: host memory returned */
    CHECK_RC(cuMemMap(base, 2 * GRAN, 0, h, 0), CUDA_ERROR_INVALID_VALUE); /* stale handle */
    OK(cuMemAddressFree(base, 8 * GRAN));
}

static void test_capacity(void) {
    g_section = "capacity";
    enum { N = CAP / GRAN };
    CUmemGenericAllocationHandle hs[N], extra = 12345;
    for (int i = 0; i < N; i++) hs[i] = create(0, GRAN);
    CUmemAllocationProp prop = prop_for(0);
    CHECK_RC(cuMemCreate(&extra, GRAN, &prop, 0), CUDA_ERROR_OUT_OF_MEMORY);
    CHECK(extra == 12345);
    CHECK(fakecuda_used_bytes(0) == CAP && fakecuda_used_bytes(1) == 0);
    size_t fr = 1, tot = 0;
    OK(cuMemGetInfo(&fr, &tot));
    CHECK(fr == 0 && tot == CAP);
    CUdeviceptr p;
    CHECK_RC(cuMemAlloc(&p, 1), CUDA_ERROR_OUT_OF_MEMORY);
    /* Managed memory is host memory the driver pages in: a full device does not limit it, and
     * it may exceed the device, up to FAKECUDA_HOST_MEMORY (4x the capacity here). */
    CUdeviceptr m1, m2;
    OK(cuMemAllocManaged(&m1, 2 * CAP, CU_MEM_ATTACH_GLOBAL));
    OK(cuMemAllocManaged(&m2, 2 * CAP - GRAN, CU_MEM_ATTACH_GLOBAL));
    CHECK(fakecuda_managed_bytes() == 4 * CAP - GRAN && fakecuda_used_bytes(0) == CAP);
    H(m1)[2 * CAP - 1] = 7; /* usable from the host at once */
    CHECK_RC(cuMemAllocManaged(&p, 2 * GRAN, CU_MEM_ATTACH_GLOBAL), CUDA_ERROR_OUT_OF_MEMORY);
    CHECK_RC(cuMemAllocManaged(&p, 4 * CAP + 1, CU_MEM_ATTACH_GLOBAL), CUDA_ERROR_OUT_OF_MEMORY);
    OK(cuMemFree(m2));
    OK(cuMemFree(m1));
    CHECK(fakecuda_managed_bytes() == 0);
    CUmemGenericAllocationHandle other = create(1, GRAN); /* device 1 is separate */
    OK(cuMemRelease(other));
    /* free every other granule; bigger handles still fit (no fragmentation OOM) */
    for (int i = 0; i < N; i += 2) OK(cuMemRelease(hs[i]));
    OK(cuMemGetInfo(&fr, &tot));
    CHECK(fr == CAP / 2);
    for (int i = 0; i < N; i += 4) hs[i] = create(0, 2 * GRAN);
    CHECK_RC(cuMemCreate(&extra, GRAN, &prop, 0), CUDA_ERROR_OUT_OF_MEMORY);
    for (int i = 0; i < N; i++)
        if (i % 2 == 1 || i % 4 == 0) OK(cuMemRelease(hs[i]));
    CHECK(fakecuda_used_bytes(0) == 0);
    CHECK_RC(cuMemCreate(&extra, CAP + GRAN, &prop, 0), CUDA_ERROR_OUT_OF_MEMORY);
}

static void test_alloc(void) {
    g_section = "cuMemAlloc/managed";
    CUdeviceptr p = 0, m = 0, q = 0;
    CHECK_RC(cuMemAlloc(&p, 0), CUDA_ERROR_INVALID_VALUE);
    OK(cuMemAlloc(&p, 1000));
    CHECK(p % GRAN == 0 && fakecuda_used_bytes(0) == GRAN && fakecuda_live("allocs") == 1);
    H(p)[GRAN - 1] = 1; /* read-write right away, whole rounded size */
    OK(cuMemsetD8(p, 0xab, 1000));
    CHECK(H(p)[0] == 0xab && H(p)[999] == 0xab);
    unsigned char in[300], out[300];
    for (int i = 0; i < 300; i++) in[i] = (unsigned char)i;
    OK(cuMemcpyHtoD(p + 100, in, sizeof in));
    OK(cuMemcpyDtoH(out, p + 100, sizeof out));
    CHECK(memcmp(in, out, sizeof in) == 0);
    CHECK_RC(cuMemcpyDtoH(out, p + GRAN - 10, 20), CUDA_ERROR_INVALID_VALUE);
    CHECK_RC(cuMemcpyHtoD(p, NULL, 20), CUDA_ERROR_INVALID_VALUE);
    size_t fr, tot;
    OK(cuMemGetInfo(&fr, &tot));
    CHECK(fr == CAP - GRAN && tot == CAP);
    CHECK_RC(cuMemFree(p + 4096), CUDA_ERROR_INVALID_VALUE);
    CHECK_RC(cuMemFree(0), CUDA_ERROR_INVALID_VALUE);
    CHECK_RC(cuMemAllocManaged(&m, GRAN, 0), CUDA_ERROR_INVALID_VALUE);
    OK(cuMemAllocManaged(&m, 3 * MiB, CU_MEM_ATTACH_GLOBAL));
    CHECK(fakecuda_used_bytes(0) == GRAN && fakecuda_live("managed") == 1);
    CHECK(fakecuda_managed_bytes() == 2 * GRAN);
    H(m)[3 * MiB - 1] = 9;
    OK(cuMemsetD8(m, 1, 3 * MiB));
    OK(cuCtxSetCurrent(g_ctx1)); /* charged to the current context's device */
    OK(cuMemAlloc(&q, 5 * MiB));
    CHECK(fakecuda_used_bytes(1) == 3 * GRAN && fakecuda_used_bytes(0) == GRAN);
    OK(cuMemGetInfo(&fr, &tot));
    CHECK(fr == CAP - 3 * GRAN);
    OK(cuMemFree(q));
    OK(cuCtxSetCurrent(g_ctx0));
    OK(cuMemFree(p));
    CHECK_RC(cuMemFree(p), CUDA_ERROR_INVALID_VALUE);
    OK(cuMemFree(m));
    CHECK(fakecuda_live("allocs") == 0 && fakecuda_live("managed") == 0);
    CHECK(fakecuda_used_bytes(0) == 0 && fakecuda_used_bytes(1) == 0);
    CHECK(fakecuda_managed_bytes() == 0);
}

static unsigned long long g_hook_addr, g_hook_size;
static int g_hook_calls;
static void record_free(unsigned long long addr, unsigned long long size, void *arg) {
    CHECK(arg == &g_hook_calls);
    g_hook_addr = addr, g_hook_size = size;
    g_hook_calls++;
}

/* A freed address is handed out again at once where the next block or reservation fits; the
 * free hook sees each successful free, after it, and no failed one. */
static void test_address_reuse(void) {
    g_section = "address reuse, free hook";
    CUdeviceptr p = 0, q = 0, r = 0, v = 0, w = 0;
    OK(cuMemAlloc(&p, 3 * MiB));
    fakecuda_set_free_hook(record_free, &g_hook_calls);
    OK(cuMemFree(p));
    CHECK(g_hook_calls == 1 && g_hook_addr == p && g_hook_size == 2 * GRAN);
    CHECK_RC(cuMemFree(p), CUDA_ERROR_INVALID_VALUE);
    CHECK(g_hook_calls == 1);
    OK(cuMemAlloc(&q, GRAN)); /* fits where p was */
    CHECK(q == p);
    OK(cuMemAlloc(&r, GRAN)); /* p's address is taken: a fresh one */
    CHECK(r != p);
    OK(cuMemAddressReserve(&v, 4 * GRAN, 0, 0, 0));
    OK(cuMemAddressFree(v, 4 * GRAN));
    CHECK(g_hook_calls == 2 && g_hook_addr == v && g_hook_size == 4 * GRAN);
    OK(cuMemAddressReserve(&w, 4 * GRAN, 0, 0, 0));
    CHECK(w == v);
    fakecuda_set_free_hook(NULL, NULL);
    OK(cuMemAddressFree(w, 4 * GRAN));
    OK(cuMemFree(q));
    OK(cuMemFree(r));
    CHECK(g_hook_calls == 2 && fakecuda_live("allocs") == 0);
}

/* A reset destroys device 0's memory (not device 1's, not the reservation): every old handle,
 * mapping and block is an error afterwards, and the retains it dropped can still be released. */
static void test_reset(void) {
    g_section = "reset";
    static const char *const kinds[] = {"handles", "mappings", "allocs", "managed"};
    long before[4];
    for (int i = 0; i < 4; i++) before[i] = fakecuda_reclaimed(kinds[i]);
    CUdeviceptr base = reserve(4 * GRAN), blk, man, blk1;
    CUmemGenericAllocationHandle h0 = create(0, 2 * GRAN), spare = create(0, GRAN);
    CUmemGenericAllocationHandle h1 = create(1, GRAN);
    OK(cuMemMap(base, 2 * GRAN, 0, h0, 0));
    OK(set_access(base, 2 * GRAN, 0, CU_MEM_ACCESS_FLAGS_PROT_READWRITE));
    OK(cuMemMap(base + 2 * GRAN, GRAN, 0, h1, 0));
    OK(set_access(base + 2 * GRAN, GRAN, 1, CU_MEM_ACCESS_FLAGS_PROT_READWRITE));
    fill(base, 3 * GRAN, 7);
    OK(cuMemAlloc(&blk, 4096));
    OK(cuMemAllocManaged(&man, 4096, CU_MEM_ATTACH_GLOBAL));
    OK(cuCtxSetCurrent(g_ctx1));
    OK(cuMemAlloc(&blk1, 4096));
    OK(cuCtxSetCurrent(g_ctx0));

    CHECK_RC(cuDevicePrimaryCtxReset(2), CUDA_ERROR_INVALID_DEVICE);
    OK(cuDevicePrimaryCtxReset(0));
    static const long want[4] = {2, 1, 1, 1}; /* h0 and spare, h0's mapping, blk, man */
    for (int i = 0; i < 4; i++)
        if (fakecuda_reclaimed(kinds[i]) - before[i] != want[i])
            fail(__LINE__, "objects a reset destroyed", kinds[i]);
    CHECK(fakecuda_used_bytes(0) == 0 && fakecuda_used_bytes(1) == 2 * GRAN);
    CHECK(fakecuda_live("handles") == 1 && fakecuda_live("mappings") == 1);
    unsigned flags;
    int active = 1;
    OK(cuDevicePrimaryCtxGetState(0, &flags, &active));
    CHECK(!active);
    CUcontext c = NULL;
    OK(cuCtxGetCurrent(&c));
    CHECK(c == g_ctx0); /* still current, but nothing works in it until a retain */
    CUdeviceptr p;
    CHECK_RC(cuMemAlloc(&p, 16), CUDA_ERROR_INVALID_CONTEXT);
    OK(cuDevicePrimaryCtxRetain(&c, 0));
    CHECK(c == g_ctx0);
    OK(cuDevicePrimaryCtxGetState(0, &flags, &active));
    CHECK(active);

    CHECK_RC(cuMemRelease(h0), CUDA_ERROR_INVALID_VALUE);
    CHECK_RC(cuMemMap(base, GRAN, 0, spare, 0), CUDA_ERROR_INVALID_VALUE);
    CHECK_RC(cuMemUnmap(base, 2 * GRAN), CUDA_ERROR_INVALID_VALUE);
    CHECK_RC(cuMemsetD8(base, 0, 16), CUDA_ERROR_INVALID_VALUE);
    CHECK_FAULTS(base, 0);
    CHECK_RC(cuMemsetD8(blk, 0, 16), CUDA_ERROR_INVALID_VALUE);
    CHECK_RC(cuMemFree(blk), CUDA_ERROR_INVALID_VALUE);
    CHECK_RC(cuMemFree(man), CUDA_ERROR_INVALID_VALUE);
    CHECK(check_fill(base + 2 * GRAN, GRAN, 7 + 2 * GRAN / 4096)); /* device 1's page */

    /* The reservation is the process's: freed as before once device 1's page is unmapped. */
    CHECK_RC(cuMemAddressFree(base, 4 * GRAN), CUDA_ERROR_INVALID_VALUE);
    OK(cuMemUnmap(base + 2 * GRAN, GRAN));
    OK(cuMemRelease(h1));
    OK(cuMemAddressFree(base, 4 * GRAN));
    OK(cuCtxSetCurrent(g_ctx1));
    OK(cuMemFree(blk1));
    OK(cuCtxSetCurrent(g_ctx0));
    OK(cuMemAlloc(&p, 16)); /* the device works again */
    OK(cuMemFree(p));
    CHECK(fakecuda_used_bytes(0) == 0 && fakecuda_used_bytes(1) == 0);

    /* g_ctx0's retain from before the reset: released, while the new one keeps it active. */
    OK(cuDevicePrimaryCtxRelease(0));
    OK(cuDevicePrimaryCtxGetState(0, &flags, &active));
    CHECK(active);
}

static void test_fault_injection(void) {
    g_section = "fault injection";
    CUmemAllocationProp prop = prop_for(0);
    CUmemGenericAllocationHandle h[4];
    CHECK(fakecuda_set_fail("cuMemCreate:3") == 0);
    for (int i = 0; i < 4; i++) {
        h[i] = 777;
        CHECK_RC(cuMemCreate(&h[i], GRAN, &prop, 0),
                 i == 2 ? CUDA_ERROR_OUT_OF_MEMORY : CUDA_SUCCESS);
    }
    CHECK(h[2] == 777 && fakecuda_live("handles") == 3);
    CHECK(fakecuda_used_bytes(0) == 3 * GRAN);
    CUdeviceptr r = reserve(2 * GRAN);
    CHECK(fakecuda_set_fail("cuMemMap:*,cuMemRelease:1") == 0);
    for (int i = 0; i < 3; i++) CHECK_RC(cuMemMap(r, GRAN, 0, h[0], 0), CUDA_ERROR_OUT_OF_MEMORY);
    CHECK(fakecuda_live("mappings") == 0);
    CHECK_RC(cuMemRelease(h[0]), CUDA_ERROR_OUT_OF_MEMORY);
    CHECK(fakecuda_live("handles") == 3);
    OK(cuMemRelease(h[0]));
    CHECK(fakecuda_set_fail(NULL) == 0);
    OK(cuMemMap(r, GRAN, 0, h[1], 0));
    OK(cuMemUnmap(r, GRAN));
    OK(cuMemRelease(h[1]));
    OK(cuMemRelease(h[3]));
    OK(cuMemAddressFree(r, 2 * GRAN));

    /* bad specs are rejected and leave the previous spec in place */
    CHECK(fakecuda_set_fail("cuMemAlloc_v2:2") == 0);
    static const char *const bad[] = {
        "bogus:1",        "cuMemCreate", "cuMemCreate:",   "cuMemCreate:0",  "cuMemCreate:x",
        "cuMemCreate:1,", ":1",          "cuMemCreate:1x", "cuMemCreate:-1", "cuMemCreate:*1",
        "cuMemCreate:1,,"};
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) CHECK(fakecuda_set_fail(bad[i]) == -1);
    CUdeviceptr p, p2;
    OK(cuMemAlloc(&p, 1));
    CHECK_RC(cuMemAlloc(&p2, 1), CUDA_ERROR_OUT_OF_MEMORY);
    /* an injected cuMemFree has no side effect */
    CHECK(fakecuda_set_fail("cuMemFree:1") == 0);
    CHECK_RC(cuMemFree(p), CUDA_ERROR_OUT_OF_MEMORY);
    CHECK(fakecuda_live("allocs") == 1);
    OK(cuMemFree(p));
    /* set_fail resets positions; reset_counters does not */
    int n;
    OK(cuDeviceGetCount(&n));
    CHECK(fakecuda_set_fail("cuDeviceGetCount:2") == 0);
    OK(cuDeviceGetCount(&n));
    fakecuda_reset_counters();
    CHECK_RC(cuDeviceGetCount(&n), CUDA_ERROR_OUT_OF_MEMORY);
    OK(cuDeviceGetCount(&n));
    CHECK(fakecuda_set_fail("") == 0);
}

static void test_final(void) {
    g_section = "final";
    static const char *const kinds[] = {"handles", "mappings", "reservations", "allocs",
                                        "managed", "streams",  "events"};
    for (size_t i = 0; i < sizeof kinds / sizeof kinds[0]; i++) {
        if (fakecuda_live(kinds[i]) != 0) fail(__LINE__, "leaked objects of kind", kinds[i]);
    }
    CHECK(fakecuda_used_bytes(0) == 0 && fakecuda_used_bytes(1) == 0);
    OK(cuDevicePrimaryCtxRelease(1));
    OK(cuDevicePrimaryCtxRelease(0));
    CHECK_RC(cuDevicePrimaryCtxRelease(0), CUDA_ERROR_INVALID_CONTEXT);
    CUdeviceptr p;
    CHECK_RC(cuMemAlloc(&p, 1), CUDA_ERROR_INVALID_CONTEXT); /* primary context inactive */
    CHECK_RC(cuCtxSetCurrent(g_ctx0), CUDA_ERROR_INVALID_CONTEXT);
    OK(cuCtxSetCurrent(NULL));
}

int main(int argc, char **argv) {
    if (argc > 1) return run_mode(argv[1]); /* environment set by spawn_mode */
    setenv("FAKECUDA_DEVICES", "2", 1);
    setenv("FAKECUDA_CAPACITY", "64M", 1);
    setenv("FAKECUDA_GRANULARITY", "2M", 1);
    setenv("FAKECUDA_SYNC_TIMEOUT_MS", "1000", 1);
    setenv("FAKECUDA_FAIL", "cuDeviceGetCount:2", 1);
    unsetenv("FAKECUDA_NO_VMM");
    unsetenv("FAKECUDA_NO_PEER");
    unsetenv("FAKECUDA_HOST_MEMORY");
    test_preinit();
    test_env_fail();
    test_devices();
    test_contexts();
    test_vmm();
    test_props();
    test_release_while_mapped();
    test_capacity();
    test_alloc();
    test_address_reuse();
    test_fault_injection();
    test_reset();
    test_streams();
    test_lag_and_default_streams();
    test_capture();
    test_proc_address();
    test_exports_and_counters();
    test_threads();
    test_env_modes();
    test_final();
    printf("test_fakecuda: all checks passed\n");
    return 0;
}
