// SPDX-License-Identifier: Apache-2.0
/* Streams that die, under LD_PRELOAD (run only with the shim routing, CUMA_CONF=limit:256M).
 *
 * A server makes a stream per request and destroys it after. cuma records its fences lazily and
 * keeps a slot per stream; the shim must retire a stream in cuma before the driver destroys it,
 * or cuma later records a fence on a destroyed stream (undefined on the real driver: the fake
 * aborts, naming the call and the handle) and, after 256 streams, refuses every allocation on a
 * new one.
 *
 *   test_preload_streams [tool]
 *
 * 1. Memory freed on a stream that is then destroyed, with its work still in flight (a held
 *    stream), is reused by another stream once that work is done, from the same pages, and no
 *    call touches the destroyed stream.
 * 2. 10,000 streams, one after another, each allocating and freeing (stream-ordered and plain
 *    frees, one block outliving its stream), half of them destroyed through the entry point
 *    the runtime fetches with cuGetProcAddress: every allocation is served, and what cuma holds
 *    of the driver (events, memory) stays bounded.
 * 3. (between 1 and 2) 300 blocks of device 0 freed on streams of device 1 that are then
 *    destroyed: device 0's heap retires those streams too, and still serves a new stream.
 */
#include "fakecuda.h"
#include "cuma/cuma.h"

#include <cuda.h>
#include <dlfcn.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#define MB (1024ull * 1024)

#define CHECK(cond)                                                                                \
    do {                                                                                           \
        if (!(cond)) {                                                                             \
            fprintf(stderr, "%s:%d: CHECK failed: %s\n", __FILE__, __LINE__, #cond);               \
            abort();                                                                               \
        }                                                                                          \
    } while (0)

#define CHECK_CU(expr)                                                                             \
    do {                                                                                           \
        CUresult r_ = (expr);                                                                      \
        if (r_ != CUDA_SUCCESS) {                                                                  \
            fprintf(stderr, "%s:%d: %s returned %d\n", __FILE__, __LINE__, #expr, (int)r_);        \
            abort();                                                                               \
        }                                                                                          \
    } while (0)

typedef CUresult(CUDAAPI *destroy_fn)(CUstream);

static bool is_shim(const void *p) {
    Dl_info info;
    return p && dladdr(p, &info) && info.dli_fname && strstr(info.dli_fname, "libcuma_preload");
}

static void check_dead_stream_memory(void) {
    CUstream s1, s2;
    CHECK_CU(cuStreamCreate(&s1, CU_STREAM_NON_BLOCKING));
    CHECK_CU(cuStreamCreate(&s2, CU_STREAM_NON_BLOCKING));
    CUdeviceptr p, q;
    /* 200 MiB of the 256 MiB limit: another 200 MiB fits only in the same memory. */
    CHECK_CU(cuMemAllocAsync(&p, 200 * MB, s1));
    fakecuda_stream_hold(s1); /* kernels on p still running */
    CHECK_CU(cuMemFreeAsync(p, s1));
    CHECK_CU(cuStreamDestroy_v2(s1));
    size_t used = fakecuda_used_bytes(0);
    fakecuda_stream_release(s1); /* the destroyed stream's work completes */
    CHECK_CU(cuMemAllocAsync(&q, 200 * MB, s2));
    CHECK(q == p && fakecuda_used_bytes(0) <= used);
    CHECK_CU(cuMemFreeAsync(q, s2));
    CHECK_CU(cuStreamSynchronize(s2));
    CHECK_CU(cuStreamDestroy_v2(s2));
    CHECK(fakecuda_live("streams") == 0);
}

static void check_stream_churn(void) {
    void *fn = NULL;
    CUdriverProcAddressQueryResult qr;
    CHECK_CU(cuGetProcAddress("cuStreamDestroy", &fn, 12000, 0, &qr));
    CHECK(is_shim(fn)); /* the runtime's cudaStreamDestroy comes to the shim too */
    destroy_fn runtime_destroy;
    memcpy(&runtime_destroy, &fn, sizeof fn);
    long events = -1;
    size_t used = 0;
    CUdeviceptr outlive = 0;
    for (int i = 0; i < 10000; i++) {
        CUstream s;
        CHECK_CU(cuStreamCreate(&s, CU_STREAM_NON_BLOCKING));
        CUdeviceptr a, b, c;
        CHECK_CU(cuMemAllocAsync(&a, 1 * MB + (size_t)(i % 7) * 4096, s));
        CHECK_CU(cuMemAllocAsync(&b, 4096 + (size_t)(i % 3) * 512, s));
        CHECK_CU(cuMemAlloc_v2(&c, 3 * MB));
        CHECK_CU(cuMemsetD8_v2(a, (unsigned char)i, 4096));
        if (i % 5 == 0) fakecuda_stream_hold(s); /* its work outlives it */
        CHECK_CU(cuMemFreeAsync(a, s));
        CHECK_CU(cuMemFree_v2(c));
        if (outlive) CHECK_CU(cuMemFree_v2(outlive)); /* allocated on a stream now destroyed */
        outlive = b;
        CHECK_CU(i % 2 ? runtime_destroy(s) : cuStreamDestroy_v2(s));
        if (i % 5 == 0) fakecuda_stream_release(s);
        if (i == 300) events = fakecuda_live("events"), used = fakecuda_used_bytes(0);
        if (i > 300 && i % 1000 == 0) {
            /* Bounded: no fence event or page piles up per stream (a fence ring, 32 events in
             * flight on a heap with several streams, place/streams.h, and a few pages). */
            CHECK(fakecuda_live("events") <= events + 32);
            CHECK(fakecuda_used_bytes(0) <= used + 8 * MB);
        }
    }
    CHECK_CU(cuMemFree_v2(outlive));
    CHECK(fakecuda_live("streams") == 0);
    CHECK(fakecuda_live("events") <= events + 32);
    printf("10000 streams: %ld events live, %zu bytes used at the end\n", fakecuda_live("events"),
           fakecuda_used_bytes(0));
}

/* Blocks of device 0 freed on streams of device 1 (cudaFreeAsync takes any stream), each stream
 * then destroyed: device 0's heap took a slot for every one of them and must retire it with the
 * stream, or the slots outlive their handles (a later stream given a dead one's handle would
 * inherit its fences) and, after 256 of them, every allocation on a new stream of device 0 is
 * refused. Needs FAKECUDA_DEVICES=2. */
static void check_streams_of_another_device(CUcontext primary0) {
    int ndev = 0;
    CHECK_CU(cuDeviceGetCount(&ndev));
    CHECK(ndev >= 2);
    CUdevice dev1;
    CHECK_CU(cuDeviceGet(&dev1, 1));
    CUcontext primary1;
    CHECK_CU(cuDevicePrimaryCtxRetain(&primary1, dev1));
    for (int i = 0; i < 300; i++) {
        CUdeviceptr p;
        CHECK_CU(cuCtxSetCurrent(primary0));
        CHECK_CU(cuMemAlloc_v2(&p, 1 * MB));
        CHECK_CU(cuCtxSetCurrent(primary1));
        CUstream s1;
        CHECK_CU(cuStreamCreate(&s1, CU_STREAM_NON_BLOCKING));
        CHECK_CU(cuMemFreeAsync(p, s1)); /* device 0's block, device 1's stream */
        CHECK_CU(cuStreamDestroy_v2(s1));
    }
    CHECK_CU(cuCtxSetCurrent(primary0));
    CUstream s0;
    CHECK_CU(cuStreamCreate(&s0, CU_STREAM_NON_BLOCKING));
    CUdeviceptr q;
    CHECK_CU(cuMemAllocAsync(&q, 1 * MB, s0)); /* a slot for a new stream is still there */
    CHECK_CU(cuMemFreeAsync(q, s0));
    CHECK_CU(cuStreamSynchronize(s0));
    CHECK_CU(cuStreamDestroy_v2(s0));
    CHECK_CU(cuDevicePrimaryCtxRelease_v2(dev1));
    CHECK(fakecuda_live("streams") == 0);
}

/* FAKECUDA_PROC_TOOL=1: the driver's cuGetProcAddress hands out another cuMemAlloc, as a tool
 * that wraps the driver does. The shim cannot serve calls made through it, and says so on stderr,
 * once. */
static int check_tool_warning(void) {
    FILE *f = tmpfile();
    CHECK(f != NULL);
    fflush(stderr);
    int saved = dup(2);
    CHECK(saved >= 0 && dup2(fileno(f), 2) == 2);
    void *fn = NULL, *fn2 = NULL;
    CUdriverProcAddressQueryResult qr;
    CHECK_CU(cuGetProcAddress("cuMemAlloc", &fn, 12000, 0, &qr));
    CHECK_CU(cuGetProcAddress("cuMemAlloc", &fn2, 12000, 0, &qr));
    CHECK_CU(cuGetProcAddress("cuMemFree", &fn2, 12000, 0, &qr));
    CHECK(fn && !is_shim(fn) && is_shim(fn2)); /* only the wrapped one is left alone */
    fflush(stderr);
    dup2(saved, 2);
    close(saved);
    char buf[4096];
    rewind(f);
    size_t n = fread(buf, 1, sizeof buf - 1, f);
    buf[n] = 0;
    fclose(f);
    fputs(buf, stderr);
    const char *m = strstr(buf, "cuGetProcAddress(\"cuMemAlloc\") answered");
    CHECK(m && !strstr(m + 1, "cuGetProcAddress(")); /* once */
    printf("test_preload_streams tool: warned once\n");
    return 0;
}

/* CUMA_CONF=backend:managed,limit:2G on a 1 GiB device: the device's size as the program reads
 * it is the limit, before the heap exists (the shim computes it) and after (the heap's). */
static int check_managed_total(void) {
    size_t before = 0, after = 0;
    CHECK_CU(cuDeviceTotalMem_v2(&before, 0));
    CUdeviceptr p;
    CHECK_CU(cuMemAlloc_v2(&p, 1 * MB)); /* the heap now exists */
    CHECK_CU(cuDeviceTotalMem_v2(&after, 0));
    CHECK_CU(cuMemFree_v2(p));
    printf("cuDeviceTotalMem: %zu before the heap, %zu after\n", before, after);
    CHECK(before == after && after == 2048 * MB);
    return 0;
}

/* A second copy of cuma in the process (libcuma.so, as cuma.torch.enable() loads it) under the
 * shim: its backend must get the driver's own functions, not the shim's (which would make its
 * memory blocks of the shim's heap, its device size the shim's limit, and let the two heaps hold
 * twice the limit). Its segment heap calls the fake's cuMemAlloc itself and sees the whole
 * device. */
static int check_second_cuma(const char *libcuma) {
    void *lib = dlopen(libcuma, RTLD_NOW | RTLD_LOCAL);
    CHECK(lib != NULL);
    typedef cuma_status (*create_fn)(const cuma_config *, cuma_heap **);
    typedef cuma_status (*alloc_fn)(cuma_heap *, size_t, cuma_stream, void **);
    typedef cuma_status (*free_fn)(cuma_heap *, void *, cuma_stream);
    typedef cuma_status (*stats_fn)(cuma_heap *, cuma_stats *, size_t);
    typedef void (*destroy_fn2)(cuma_heap *);
    create_fn create;
    alloc_fn alloc;
    free_fn dofree;
    stats_fn stats;
    destroy_fn2 destroy;
    void *f;
#define LOOK(var, name)                                                                            \
    do {                                                                                           \
        f = dlsym(lib, name);                                                                      \
        CHECK(f != NULL);                                                                          \
        memcpy(&var, &f, sizeof f);                                                                \
    } while (0)
    LOOK(create, "cuma_heap_create");
    LOOK(alloc, "cuma_alloc");
    LOOK(dofree, "cuma_free");
    LOOK(stats, "cuma_get_stats_sized");
    LOOK(destroy, "cuma_heap_destroy");
#undef LOOK
    cuma_config cfg = {.conf = "backend:segment,ledger:off", .flags = CUMA_CONFIG_NO_ENV};
    cuma_heap *h = NULL;
    CHECK(create(&cfg, &h) == CUMA_OK);
    fakecuda_reset_counters();
    void *p = NULL;
    CHECK(alloc(h, 4 * MB, NULL, &p) == CUMA_OK);
    cuma_stats s;
    CHECK(stats(h, &s, sizeof s) == CUMA_OK);
    printf("second cuma: %lu cuMemAlloc calls of its own, device %llu bytes\n",
           fakecuda_calls("cuMemAlloc"), (unsigned long long)s.device_total_bytes);
    CHECK(fakecuda_calls("cuMemAlloc") >= 1); /* the driver's, not the shim's heap */
    CHECK(s.device_total_bytes == 1024 * MB); /* FAKECUDA_CAPACITY, not limit:256M */
    CHECK(dofree(h, p, NULL) == CUMA_OK);
    destroy(h);
    return 0;
}

int main(int argc, char **argv) {
    CHECK_CU(cuInit(0));
    CUdevice dev;
    CHECK_CU(cuDeviceGet(&dev, 0));
    CUcontext primary;
    CHECK_CU(cuDevicePrimaryCtxRetain(&primary, dev));
    CHECK_CU(cuCtxSetCurrent(primary));
    if (argc > 1 && !strcmp(argv[1], "tool")) return check_tool_warning();
    if (argc > 1 && !strcmp(argv[1], "managed_total")) return check_managed_total();
    if (argc > 2 && !strcmp(argv[1], "second_cuma")) return check_second_cuma(argv[2]);
    CHECK(is_shim(dlsym(RTLD_DEFAULT, "cuStreamDestroy_v2")));
    check_dead_stream_memory();
    check_streams_of_another_device(primary);
    check_stream_churn();
    printf("test_preload_streams: all checks passed\n");
    return 0;
}
