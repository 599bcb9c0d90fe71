// SPDX-License-Identifier: Apache-2.0
/* A CUDA program that knows nothing of cuma, run with and without libcuma_preload.so.
 *
 * It links only the fake driver (tests/fakecuda: its controls count driver calls and live
 * objects) and makes the calls a CUDA program and the CUDA runtime make: the driver API
 * directly, and the runtime's path (dlopen("libcuda.so.1"), dlsym(handle,
 * "cuGetProcAddress_v2"), entry points fetched through it). The arguments say what to expect:
 *
 *   test_preload ROUTED SHIM [STDERR_TEXT]
 *
 * ROUTED 1: allocations come from cuma (CUMA_CONF=limit:256M): the driver's cuMemAlloc is
 * never called for them, two small blocks share a page or segment, cuMemGetInfo and
 * cuDeviceTotalMem say 256 MiB, a request beyond it fails with CUDA_ERROR_OUT_OF_MEMORY.
 * ROUTED 0: the plain driver's answers (FAKECUDA_CAPACITY=1G). SHIM 1: the shim is loaded
 * (LD_PRELOAD), which dlsym(RTLD_NEXT, ...) from the program must still see. STDERR_TEXT: what
 * the shim must have written on stderr, once (a bad CUMA_CONF names its key).
 *
 * Last, the program resets the device (cudaDeviceReset: cuDevicePrimaryCtxReset fetched through
 * cuGetProcAddress and through dlsym) with blocks live and freed ones cached, and goes on: the
 * reset must find nothing of cuma's left to destroy, the next allocation must be real memory in
 * a fresh heap, a free of an old pointer must fail cleanly. With a second device
 * (FAKECUDA_DEVICES=2), a thread works on device 1 while device 0 is reset over and over. Routed,
 * a reset also comes while another thread's allocation waits inside the heap for a held stream,
 * and must wait for it.
 */
#include "fakecuda.h"

#include <cuda.h>
#include <dlfcn.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

CUresult CUDAAPI cuMemAllocAsync_ptsz(CUdeviceptr *dptr, size_t bytesize, CUstream hStream);
CUresult CUDAAPI cuMemFreeAsync_ptsz(CUdeviceptr dptr, CUstream hStream);

#define MB       (1024ull * 1024)
#define LIMIT    (256 * MB)
#define CAPACITY (1024 * MB) /* FAKECUDA_CAPACITY in CMakeLists.txt */

/* stderr goes to a file while the checks run (the shim's messages are checked at the end);
 * a failure puts it back and shows what was captured before its own message. */
static FILE *captured;
static int saved_stderr = -1;

static void show_captured(void) {
    if (saved_stderr < 0) return;
    fflush(stderr);
    dup2(saved_stderr, 2);
    close(saved_stderr);
    saved_stderr = -1;
    char buf[8192];
    rewind(captured);
    size_t n = fread(buf, 1, sizeof buf - 1, captured);
    buf[n] = 0;
    fputs(buf, stderr);
}

#define FAIL(...)                                                                                  \
    do {                                                                                           \
        show_captured();                                                                           \
        fprintf(stderr, __VA_ARGS__);                                                              \
        abort();                                                                                   \
    } while (0)

#define CHECK(cond)                                                                                \
    do {                                                                                           \
        if (!(cond)) FAIL("%s:%d: CHECK failed: %s\n", __FILE__, __LINE__, #cond);                 \
    } while (0)

#define CHECK_RES(expr, want)                                                                      \
    do {                                                                                           \
        CUresult r_ = (expr);                                                                      \
        if (r_ != (want))                                                                          \
            FAIL("%s:%d: %s returned %d, wanted %d (%s)\n", __FILE__, __LINE__, #expr, (int)r_,    \
                 (int)(want), #want);                                                              \
    } while (0)

#define CHECK_CU(expr) CHECK_RES(expr, CUDA_SUCCESS)

static bool routed, shim_loaded, vmm;
static CUcontext primary;
/* How many times this program retained device 0's primary context (a reset drops them without
 * releasing them; each may still be released). */
static int retains;

/* The file that defines the function at p, for "whose function is this?". */
static const char *file_of(const void *p) {
    Dl_info info;
    return p && dladdr(p, &info) && info.dli_fname ? info.dli_fname : "?";
}

static const char *name_of(const void *p) {
    Dl_info info;
    return p && dladdr(p, &info) && info.dli_sname ? info.dli_sname : "?";
}

static bool is_shim(const void *p) {
    return strstr(file_of(p), "libcuma_preload") != NULL;
}

/* Writes a pattern through the driver and reads it back: the memory is mapped and accessible. */
static void touch(CUdeviceptr p, size_t n, unsigned char v) {
    CHECK_CU(cuMemsetD8_v2(p, v, n));
    unsigned char ends[2];
    CHECK_CU(cuMemcpyDtoH_v2(&ends[0], p, 1));
    CHECK_CU(cuMemcpyDtoH_v2(&ends[1], p + n - 1, 1));
    CHECK(ends[0] == v && ends[1] == v);
}

/* Two small blocks: cuma places them side by side in one page or segment; the driver gives
 * each an allocation of its own, a granularity (2 MiB) apart. */
static void check_small_blocks_share(void) {
    long allocs = fakecuda_live("allocs");
    CUdeviceptr a, b;
    CHECK_CU(cuMemAlloc_v2(&a, 4096));
    CHECK_CU(cuMemAlloc_v2(&b, 4096));
    uint64_t dist = a > b ? a - b : b - a;
    CHECK(routed ? dist < 2 * MB : dist >= 2 * MB);
    /* vmm: no driver allocation at all; segments: at most the one they share. */
    long added = fakecuda_live("allocs") - allocs;
    CHECK(routed ? (vmm ? added == 0 : added <= 1) : added == 2);
    touch(a, 4096, 0x11);
    touch(b, 4096, 0x22);
    CHECK_CU(cuMemFree_v2(a));
    CHECK_CU(cuMemFree_v2(b));
}

static void check_alloc_free(void) {
    fakecuda_reset_counters();
    CUdeviceptr p;
    CHECK_CU(cuMemAlloc_v2(&p, 3 * MB + 100));
    touch(p, 3 * MB + 100, 0x5a);
    /* The driver's cuMemAlloc served it, or cuma's pages (vmm) / its segments (no VMM). */
    if (!routed) CHECK(fakecuda_calls("cuMemAlloc") == 1 && fakecuda_calls("cuMemCreate") == 0);
    /* vmm: the pages under it are mapped (maybe earlier, idle and reused in place). */
    if (routed && vmm)
        CHECK(fakecuda_calls("cuMemAlloc") == 0 && fakecuda_live("allocs") == 0 &&
              fakecuda_live("mappings") > 0);
    CHECK_CU(cuMemFree_v2(p));
    check_small_blocks_share();

    /* Bad input gets the driver's answer, or cuma's, never a crash. */
    CHECK_RES(cuMemAlloc_v2(NULL, 16), CUDA_ERROR_INVALID_VALUE);
    CHECK_RES(cuMemAlloc_v2(&p, 0), CUDA_ERROR_INVALID_VALUE);
    CHECK_RES(cuMemFree_v2(0), CUDA_ERROR_INVALID_VALUE);
    CHECK_CU(cuMemAlloc_v2(&p, 1 * MB));
    CHECK_RES(cuMemFree_v2(p + 256), CUDA_ERROR_INVALID_VALUE); /* inside a block */
    CHECK_CU(cuMemFree_v2(p));
    CHECK_RES(cuMemFree_v2(p), CUDA_ERROR_INVALID_VALUE); /* double free */
    CHECK_CU(cuMemAlloc_v2(&p, 1 * MB));                  /* still works */
    touch(p, MB, 0x33);
    CHECK_CU(cuMemFree_v2(p));
}

/* Segment mode's danger: a block of over 10 MiB gets a segment of its own and starts where
 * the segment does, so a double free of it handed to the driver would free the segment that
 * cuma keeps cached and hands out again. The shim must refuse it, and the next block placed
 * there must be usable. */
static void check_double_free_keeps_memory(void) {
    CUdeviceptr a, b;
    CHECK_CU(cuMemAlloc_v2(&a, 12 * MB));
    CHECK_CU(cuMemFree_v2(a));
    long allocs = fakecuda_live("allocs");
    CHECK_RES(cuMemFree_v2(a), CUDA_ERROR_INVALID_VALUE);
    CHECK(fakecuda_live("allocs") == allocs);
    CHECK_CU(cuMemAlloc_v2(&b, 12 * MB));
    touch(b, 12 * MB, 0x44);
    CHECK_CU(cuMemFree_v2(b));
}

static void check_limit(void) {
    size_t fr = 0, tot = 0;
    CHECK_CU(cuMemGetInfo_v2(&fr, &tot));
    CHECK(tot == (routed ? LIMIT : CAPACITY));
    CHECK(fr <= tot);
    /* Nothing live. Idle pages count as free; blocks this thread's cache still holds (at most
     * tcache_bytes, 32 MiB) and, in segment mode, segments whose free blocks are not merged
     * yet do not. */
    if (routed && tot - fr > 32 * MB) FAIL("nothing live, yet free %zu of %zu\n", fr, tot);
    size_t dev_total = 0;
    CHECK_CU(cuDeviceTotalMem_v2(&dev_total, 0));
    CHECK(dev_total == (routed ? LIMIT : CAPACITY));
    CHECK_RES(cuMemGetInfo_v2(NULL, &tot), CUDA_ERROR_INVALID_VALUE);

    CUdeviceptr big, more;
    /* Past any device: out of memory, as the driver says (frameworks retry only on that). */
    CHECK_RES(cuMemAlloc_v2(&big, (size_t)1 << 50), CUDA_ERROR_OUT_OF_MEMORY);
    CHECK_RES(cuMemAlloc_v2(&big, 300 * MB), routed ? CUDA_ERROR_OUT_OF_MEMORY : CUDA_SUCCESS);
    if (!routed) CHECK_CU(cuMemFree_v2(big));
    CHECK_CU(cuMemAlloc_v2(&big, 200 * MB));
    touch(big, 200 * MB, 0x66);
    CHECK_CU(cuMemGetInfo_v2(&fr, &tot));
    CHECK(fr + 200 * MB <= tot);
    CHECK_RES(cuMemAlloc_v2(&more, 100 * MB), routed ? CUDA_ERROR_OUT_OF_MEMORY : CUDA_SUCCESS);
    if (!routed) CHECK_CU(cuMemFree_v2(more));
    CHECK_CU(cuMemFree_v2(big));
    CHECK_CU(cuMemAlloc_v2(&more, 100 * MB)); /* the freed memory serves it */
    CHECK_CU(cuMemFree_v2(more));
    /* Frees wait in the thread's cache or free batch until its next allocator call or, at the
     * latest, until they are tcache_age_ms (50 ms) old, when the release thread takes them. */
    for (int i = 0; i < 300; i++) {
        CHECK_CU(cuMemGetInfo_v2(&fr, &tot));
        if (!routed || fr == tot) break;
        usleep(10 * 1000);
    }
    if (routed && fr != tot) FAIL("all freed 3 s ago, yet free %zu of %zu\n", fr, tot);
}

static void check_async_and_pitch(void) {
    fakecuda_reset_counters();
    CUstream s;
    CHECK_CU(cuStreamCreate(&s, CU_STREAM_NON_BLOCKING));
    CUdeviceptr p, q;
    CHECK_CU(cuMemAllocAsync(&p, 2 * MB, s));
    CHECK_CU(cuMemAllocAsync(&q, 5000, NULL));
    touch(p, 2 * MB, 0x77);
    touch(q, 5000, 0x78);
    CHECK(fakecuda_calls("cuMemAllocAsync") == (routed ? 0u : 2u));
    CHECK_CU(cuMemFreeAsync(p, s));
    CHECK_CU(cuMemFreeAsync(q, NULL));
    CHECK_RES(cuMemFreeAsync(p, s), CUDA_ERROR_INVALID_VALUE);
    CHECK(fakecuda_calls("cuMemFreeAsync") == (routed ? 0u : 3u));
    CHECK_RES(cuMemAllocAsync(&p, 0, s), CUDA_ERROR_INVALID_VALUE);
    CHECK_CU(cuStreamSynchronize(s));
    CHECK_CU(cuStreamDestroy_v2(s));

    size_t pitch = 0;
    CHECK_CU(cuMemAllocPitch_v2(&p, &pitch, 1000, 10, 4));
    CHECK(pitch == 1024 && p % 512 == 0);
    touch(p, pitch * 10, 0x79);
    CHECK(fakecuda_calls("cuMemAllocPitch") == (routed ? 0u : 1u));
    CHECK_CU(cuMemFree_v2(p));
    CHECK_RES(cuMemAllocPitch_v2(&p, &pitch, 1000, 10, 3), CUDA_ERROR_INVALID_VALUE);
}

/* Memory the shim never handed out (here managed memory, as cudaMallocManaged gives) is freed
 * by the driver through the shim's cuMemFree. */
static void check_foreign_free(void) {
    CUdeviceptr m;
    long before = fakecuda_live("managed");
    CHECK_CU(cuMemAllocManaged(&m, MB, CU_MEM_ATTACH_GLOBAL));
    CHECK(fakecuda_live("managed") == before + 1);
    CHECK_CU(cuMemFree_v2(m));
    CHECK(fakecuda_live("managed") == before);
}

typedef CUresult (*gpa_fn)(const char *, void **, int, cuuint64_t,
                           CUdriverProcAddressQueryResult *);
typedef CUresult (*alloc_fn)(CUdeviceptr *, size_t);
typedef CUresult (*free_fn)(CUdeviceptr);
typedef CUresult (*info_fn)(size_t *, size_t *);
typedef CUresult (*async_fn)(CUdeviceptr *, size_t, CUstream);

/* The CUDA runtime's way in: every entry point through cuGetProcAddress from the handle. */
/* Every thread's per-thread default stream is one handle (CU_STREAM_PER_THREAD), and the heap
 * tells the threads' streams apart (place/streams.c): a free on it waits neither for the stream
 * nor for the context, and a block a thread freed with its stream's work in flight goes to no
 * other thread's stream until that work is done. */
typedef struct ptds_worker {
    CUdeviceptr p;
    atomic_int phase; /* 1: p freed with its stream held; 2: main allocated; 3: stream released */
} ptds_worker;

static void *ptds_worker_main(void *arg) {
    ptds_worker *w = arg;
    CHECK_CU(cuCtxSetCurrent(primary));
    CHECK_CU(cuMemAllocAsync_ptsz(&w->p, 1 * MB, NULL));
    touch(w->p, 1 * MB, 0x3c);
    fakecuda_stream_hold(CU_STREAM_PER_THREAD); /* this thread's kernels on p still running */
    CHECK_CU(cuMemFreeAsync_ptsz(w->p, NULL));  /* returns at once: nothing waits for them */
    atomic_store(&w->phase, 1);
    while (atomic_load(&w->phase) != 2) sched_yield();
    fakecuda_stream_release(CU_STREAM_PER_THREAD);
    atomic_store(&w->phase, 3);
    return NULL;
}

static void check_per_thread_streams(void) {
    fakecuda_reset_counters();
    CUdeviceptr p, q;
    CHECK_CU(cuMemAllocAsync_ptsz(&p, 1 * MB, NULL));
    CHECK_CU(cuMemAllocAsync(&q, 1 * MB, CU_STREAM_PER_THREAD));
    touch(p, 1 * MB, 0x5a);
    CHECK_CU(cuMemFreeAsync_ptsz(p, NULL));
    CHECK_CU(cuMemFree_v2(q));
    CHECK_RES(cuMemFreeAsync_ptsz(p, NULL), CUDA_ERROR_INVALID_VALUE); /* a second free */

    ptds_worker w = {0};
    pthread_t t;
    CHECK(pthread_create(&t, NULL, ptds_worker_main, &w) == 0);
    while (atomic_load(&w.phase) != 1) sched_yield();
    /* This thread's per-thread stream, while the worker's work on w.p is in flight. */
    CUdeviceptr mine[4];
    for (int i = 0; i < 4; i++) {
        CHECK_CU(cuMemAllocAsync_ptsz(&mine[i], 1 * MB, NULL));
        if (routed && mine[i] < w.p + 1 * MB && w.p < mine[i] + 1 * MB)
            FAIL("another thread's per-thread stream got %#llx, freed by the worker with its work "
                 "in flight\n",
                 (unsigned long long)mine[i]);
    }
    for (int i = 0; i < 4; i++) CHECK_CU(cuMemFree_v2(mine[i]));
    atomic_store(&w.phase, 2);
    CHECK(pthread_join(t, NULL) == 0 && atomic_load(&w.phase) == 3);
    CHECK(fakecuda_calls("cuStreamSynchronize") == 0);
    CHECK(fakecuda_calls("cuCtxSynchronize") == 0);
}

/* cuMemFree (cudaFree) waits for the device as the driver's does, in the heap rather than on the
 * host: a block a worker allocated on its per-thread stream and this thread used on its own,
 * freed here with cuMemFree while that work is in flight, is not handed to the worker's stream
 * (the block's allocation stream) until this thread's work is done too. */
typedef struct ptds_owner {
    CUdeviceptr p, got[4];
    atomic_int phase; /* 1: p allocated; 2: p freed by main; 3: worker allocated */
} ptds_owner;

static void *ptds_owner_main(void *arg) {
    ptds_owner *w = arg;
    CHECK_CU(cuCtxSetCurrent(primary));
    CHECK_CU(cuMemAllocAsync_ptsz(&w->p, 1 * MB, NULL));
    atomic_store(&w->phase, 1);
    while (atomic_load(&w->phase) != 2) sched_yield();
    for (int i = 0; i < 4; i++) CHECK_CU(cuMemAllocAsync_ptsz(&w->got[i], 1 * MB, NULL));
    atomic_store(&w->phase, 3);
    return NULL;
}

static void check_free_waits_for_freeing_thread(void) {
    fakecuda_reset_counters();
    ptds_owner w = {0};
    pthread_t t;
    CHECK(pthread_create(&t, NULL, ptds_owner_main, &w) == 0);
    while (atomic_load(&w.phase) != 1) sched_yield();
    touch(w.p, 1 * MB, 0x4d);
    fakecuda_stream_hold(CU_STREAM_PER_THREAD); /* this thread's kernels on w.p still running */
    CHECK_CU(cuMemFree_v2(w.p));                /* returns at once */
    atomic_store(&w.phase, 2);
    while (atomic_load(&w.phase) != 3) sched_yield();
    for (int i = 0; i < 4; i++)
        if (routed && w.got[i] < w.p + 1 * MB && w.p < w.got[i] + 1 * MB)
            FAIL("the worker's per-thread stream got %#llx back, freed with cuMemFree by another "
                 "thread with its work on it in flight\n",
                 (unsigned long long)w.got[i]);
    fakecuda_stream_release(CU_STREAM_PER_THREAD);
    CHECK(pthread_join(t, NULL) == 0);
    for (int i = 0; i < 4; i++) CHECK_CU(cuMemFreeAsync_ptsz(w.got[i], NULL));
    CHECK(fakecuda_calls("cuStreamSynchronize") == 0);
    CHECK(fakecuda_calls("cuCtxSynchronize") == 0);
}

/* cudaFree promises that the device is done with the memory, so the program may use what the
 * next cudaMalloc returns on any stream. A block freed with work on a blocking stream in flight
 * must not come back from cuMemAlloc before that work is done (the legacy stream's fence covers
 * it), though nothing waits on the host. */
static void check_free_waits_for_blocking_streams(void) {
    fakecuda_reset_counters();
    CUstream s1;
    CHECK_CU(cuStreamCreate(&s1, CU_STREAM_DEFAULT));
    CUdeviceptr p, q[4];
    CHECK_CU(cuMemAlloc_v2(&p, 1 * MB));
    touch(p, 1 * MB, 0x2e);
    fakecuda_stream_hold(s1);  /* kernels on p still running on s1 */
    CHECK_CU(cuMemFree_v2(p)); /* returns at once */
    for (int i = 0; i < 4; i++) {
        CHECK_CU(cuMemAlloc_v2(&q[i], 1 * MB));
        if (routed && q[i] < p + 1 * MB && p < q[i] + 1 * MB)
            FAIL("cuMemAlloc returned %#llx, freed with cuMemFree while a blocking stream's work "
                 "on it was in flight\n",
                 (unsigned long long)q[i]);
    }
    fakecuda_stream_release(s1);
    for (int i = 0; i < 4; i++) CHECK_CU(cuMemFree_v2(q[i]));
    CHECK_CU(cuStreamDestroy_v2(s1));
    CHECK(fakecuda_calls("cuStreamSynchronize") == 0);
    CHECK(fakecuda_calls("cuCtxSynchronize") == 0);
}

/* The driver as the runtime opens it (dlopen, then dlsym of cuGetProcAddress_v2): its handle in
 * *h and its cuGetProcAddress, which must be the shim's exactly when the calls are routed. */
static gpa_fn runtime_gpa(void **h) {
    const char *lib = getenv("CUMA_CUDA_LIBRARY");
    *h = dlopen(lib && *lib ? lib : "libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    CHECK(*h);
    void *sym = dlsym(*h, "cuGetProcAddress_v2");
    CHECK(sym && is_shim(sym) == routed);
    gpa_fn gpa;
    memcpy(&gpa, &sym, sizeof sym);
    return gpa;
}

static void check_runtime_path(void) {
    void *h, *sym;
    gpa_fn gpa = runtime_gpa(&h);

    CUdriverProcAddressQueryResult st;
    void *fn = NULL;
    CHECK_CU(gpa("cuGetProcAddress", &fn, 13000, 0, &st));
    CHECK(fn && st == CU_GET_PROC_ADDRESS_SUCCESS && is_shim(fn) == routed);
    CHECK_CU(gpa("cuMemAlloc", &fn, 13000, 0, &st));
    CHECK(fn && is_shim(fn) == routed);
    if (routed) CHECK(!strcmp(name_of(fn), "cuMemAlloc_v2"));
    alloc_fn alloc;
    memcpy(&alloc, &fn, sizeof fn);
    CHECK_CU(gpa("cuMemFree", &fn, 13000, 0, &st));
    CHECK(fn && is_shim(fn) == routed);
    free_fn release;
    memcpy(&release, &fn, sizeof fn);
    CHECK_CU(gpa("cuMemGetInfo", &fn, 12000, 0, &st));
    CHECK(fn && is_shim(fn) == routed);
    info_fn info;
    memcpy(&info, &fn, sizeof fn);
    CHECK_CU(
        gpa("cuMemAllocAsync", &fn, 13000, CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM, &st));
    CHECK(fn && is_shim(fn) == routed);
    if (routed) CHECK(!strcmp(name_of(fn), "cuMemAllocAsync_ptsz"));
    async_fn alloc_async;
    memcpy(&alloc_async, &fn, sizeof fn);
    /* A version older than the _v2 ABI gets no function here (the fake has no 32-bit one),
     * and the shim does not offer its own for it. */
    fn = NULL;
    CHECK_CU(gpa("cuMemAlloc", &fn, 3000, 0, &st));
    CHECK(!fn && st == CU_GET_PROC_ADDRESS_VERSION_NOT_SUFFICIENT);
    /* Entry points the shim does not replace stay the driver's. */
    CHECK_CU(gpa("cuMemsetD8", &fn, 13000, 0, &st));
    CHECK(fn && !is_shim(fn));
    CHECK(!is_shim(dlsym(h, "cuMemcpyHtoD_v2")));
    CHECK(is_shim(dlsym(h, "cuMemAlloc_v2")) == routed);

    fakecuda_reset_counters();
    CUdeviceptr p, q;
    CHECK_CU(alloc(&p, 6 * MB));
    CHECK_CU(alloc_async(&q, 64 * 1024, NULL));
    touch(p, 6 * MB, 0x01);
    touch(q, 64 * 1024, 0x02);
    if (!routed) CHECK(fakecuda_calls("cuMemAlloc") == 1);
    if (routed && vmm) CHECK(fakecuda_calls("cuMemAlloc") == 0);
    size_t fr, tot;
    CHECK_CU(info(&fr, &tot));
    CHECK(tot == (routed ? LIMIT : CAPACITY) && fr + 6 * MB <= tot);
    CHECK_CU(release(p));
    CHECK_CU(release(q));
    CHECK_RES(release(p), CUDA_ERROR_INVALID_VALUE);
    dlclose(h);

    /* RTLD_NEXT from the program finds the next definition after the program: the shim's when
     * it is preloaded, whether it routes or not (its dlsym must not answer as itself). */
    sym = dlsym(RTLD_NEXT, "cuMemAlloc_v2");
    CHECK(sym && is_shim(sym) == shim_loaded);
}

typedef CUresult (*ctx_fn)(CUdevice);

/* What a reset destroys (fakecuda_reclaimed): objects that were still live when it came. */
static const char *const reclaim_kinds[] = {"handles", "mappings", "allocs", "managed"};
#define NKINDS (sizeof reclaim_kinds / sizeof reclaim_kinds[0])

/* The runtime's next call after cudaDeviceReset retains the primary context again. */
static void retain_again(CUdevice dev) {
    CUcontext c = NULL;
    CHECK_CU(cuDevicePrimaryCtxRetain(&c, dev));
    CHECK(c != NULL);
    CHECK_CU(cuCtxSetCurrent(c));
    if (dev == 0) {
        CHECK(c == primary); /* the driver hands out the same handle again */
        retains++;
    }
}

/* A reset of device 0 through reset_fn with two blocks live and a freed one in cuma's cache, then
 * the program goes on. */
static void reset_and_go_on(ctx_fn reset_fn, const char *how) {
    CUdeviceptr keep, old, idle;
    CHECK_CU(cuMemAlloc_v2(&keep, 1 * MB));
    CHECK_CU(cuMemAlloc_v2(&old, 3 * MB));
    CHECK_CU(cuMemAlloc_v2(&idle, 5 * MB));
    touch(keep, 1 * MB, 0x21);
    touch(old, 3 * MB, 0x22);
    touch(idle, 5 * MB, 0x23);
    CHECK_CU(cuMemFree_v2(idle));
    long before[NKINDS];
    for (size_t i = 0; i < NKINDS; i++) before[i] = fakecuda_reclaimed(reclaim_kinds[i]);
    CHECK_CU(reset_fn(0));
    for (size_t i = 0; i < NKINDS; i++) {
        long n = fakecuda_reclaimed(reclaim_kinds[i]) - before[i];
        /* Routed: cuma gave back every page and segment while the context still existed. Plain:
         * the driver destroys the program's two blocks. */
        long want = !routed && !strcmp(reclaim_kinds[i], "allocs") ? 2 : 0;
        if (n != want)
            FAIL("reset through %s destroyed %ld %s, wanted %ld%s\n", how, n, reclaim_kinds[i],
                 want, routed ? " (cuma still held them)" : "");
    }
    /* Nothing of cuma's is left: no page, range or segment, nothing charged to the device. */
    CHECK(fakecuda_live("handles") == 0 && fakecuda_live("mappings") == 0);
    CHECK(fakecuda_live("reservations") == 0 && fakecuda_live("allocs") == 0);
    CHECK(fakecuda_used_bytes(0) == 0);
    retain_again(0);

    CUdeviceptr fresh;
    CHECK_CU(cuMemAlloc_v2(&fresh, 2 * MB));
    touch(fresh, 2 * MB, 0x24); /* mapped: real memory behind the address */
    size_t fr, tot;
    CHECK_CU(cuMemGetInfo_v2(&fr, &tot));
    CHECK(tot == (routed ? LIMIT : CAPACITY));
    /* A fresh heap: the old blocks count no more (4 MiB of them would). */
    if (routed && tot - fr > 2 * MB) FAIL("after the reset, free %zu of %zu\n", fr, tot);
    /* An old pointer is no block any more. The driver may hand its address out again (so may
     * cuma's new heap), and a free of it would then free the new block, as without the shim:
     * free one that the new block does not start at. */
    CUdeviceptr stale = fresh == old ? keep : old;
    CHECK_RES(cuMemFree_v2(stale), CUDA_ERROR_INVALID_VALUE);
    CHECK_RES(cuMemFreeAsync(stale, NULL), CUDA_ERROR_INVALID_VALUE);
    touch(fresh, 2 * MB, 0x25); /* untouched by those frees */
    CHECK_CU(cuMemFree_v2(fresh));
    CHECK_RES(cuMemFree_v2(fresh), CUDA_ERROR_INVALID_VALUE);
}

/* Device 1's user: its heap, blocks and frees (which look at device 0's heap first) must not
 * notice device 0's resets. */
static void *device1_main(void *arg) {
    atomic_int *stop = arg;
    retain_again(1);
    CUdeviceptr held;
    CHECK_CU(cuMemAlloc_v2(&held, 12 * MB)); /* a segment of its own in segment mode */
    touch(held, 12 * MB, 0x61);
    unsigned long rounds = 0;
    while (!atomic_load(stop) || rounds < 200) {
        CUdeviceptr p;
        size_t n = 4096 + (rounds % 64) * 65536;
        CHECK_CU(cuMemAlloc_v2(&p, n));
        CHECK_CU(cuMemsetD8_v2(p + n - 1, (unsigned char)rounds, 1));
        CHECK_CU(cuMemFree_v2(p));
        size_t fr, tot;
        CHECK_CU(cuMemGetInfo_v2(&fr, &tot));
        rounds++;
    }
    unsigned char c = 0;
    CHECK_CU(cuMemcpyDtoH_v2(&c, held + 12 * MB - 1, 1));
    CHECK(c == 0x61);
    CHECK_CU(cuMemFree_v2(held));
    CHECK_RES(cuMemFree_v2(held), CUDA_ERROR_INVALID_VALUE); /* still known as cuma's */
    return NULL;
}

static void check_reset_beside_device1(ctx_fn reset_fn) {
    atomic_int stop = 0;
    pthread_t t;
    CHECK(pthread_create(&t, NULL, device1_main, &stop) == 0);
    for (int i = 0; i < 20; i++) {
        CUdeviceptr p;
        CHECK_CU(cuMemAlloc_v2(&p, (size_t)(i + 1) * 100000));
        touch(p, (size_t)(i + 1) * 100000, (unsigned char)i);
        CHECK_CU(reset_fn(0));
        retain_again(0);
    }
    atomic_store(&stop, 1);
    CHECK(pthread_join(t, NULL) == 0);
    /* Device 1's turn: its heap goes too, and nothing of cuma's is left anywhere. */
    long before = fakecuda_reclaimed("handles") + fakecuda_reclaimed("allocs");
    CHECK_CU(reset_fn(1));
    CHECK(fakecuda_reclaimed("handles") + fakecuda_reclaimed("allocs") == before);
    CHECK(fakecuda_live("reservations") == 0 && fakecuda_used_bytes(1) == 0);
}

/* The driver hands a freed address out again at once (tests/fakecuda does too). A reset of
 * device 0 gives its segments back; the free hook stands in for a thread on device 1 whose heap
 * grows between the driver's free of one of them and the shim's next step, and gets the same
 * address. That segment is device 1's: the program's free of a block in it must reach device 1's
 * heap, not the driver (which would free the segment under cuma: a later block carved from it
 * had no memory behind it, preload_routed_segment_lagged's rare failure). */
typedef struct reuse_state {
    CUdeviceptr target;     /* the address whose free the hook waits for */
    CUcontext dev1;         /* device 1's primary context */
    CUdeviceptr freed, got; /* the range freed (its base), and device 1's block */
    size_t freed_size, size;
    bool fired;
    pthread_t watcher; /* set: a free by this thread of a range holding `got` is a failure */
    bool watching, forwarded;
} reuse_state;

static void reuse_hook(unsigned long long addr, unsigned long long size, void *arg) {
    reuse_state *r = arg;
    if (r->watching && pthread_equal(pthread_self(), r->watcher) && r->got - addr < size)
        r->forwarded = true;
    if (r->fired || r->target - addr >= size) return;
    r->fired = true;
    r->freed = addr, r->freed_size = size;
    CUcontext prev = NULL;
    CHECK_CU(cuCtxGetCurrent(&prev));
    CHECK_CU(cuCtxSetCurrent(r->dev1));
    CHECK_CU(cuMemAlloc_v2(&r->got, r->size));
    CHECK_CU(cuCtxSetCurrent(prev));
}

static void check_freed_address_reused(ctx_fn reset_fn) {
    reuse_state r = {.size = 20 * MB};
    CHECK_CU(cuDevicePrimaryCtxRetain(&r.dev1, 1));
    CHECK_CU(cuCtxSetCurrent(r.dev1));
    CUdeviceptr warm;
    CHECK_CU(cuMemAlloc_v2(&warm, 4096)); /* device 1's heap exists before the reset */
    CHECK_CU(cuCtxSetCurrent(primary));
    CHECK_CU(cuMemAlloc_v2(&r.target, r.size)); /* a segment of its own */
    CHECK_CU(cuMemFree_v2(r.target));           /* cached: the reset gives it back */
    fakecuda_set_free_hook(reuse_hook, &r);
    CHECK_CU(reset_fn(0));
    retain_again(0);
    CHECK(r.fired);
    if (r.got - r.freed >= r.freed_size)
        FAIL("device 1's block %#llx is not where the driver freed %#llx\n",
             (unsigned long long)r.got, (unsigned long long)r.freed);
    CHECK_CU(cuCtxSetCurrent(r.dev1));
    touch(r.got, r.size, 0x5a);
    r.watcher = pthread_self();
    r.watching = true;
    CHECK_CU(cuMemFree_v2(r.got));
    r.watching = false;
    fakecuda_set_free_hook(NULL, NULL);
    if (r.forwarded)
        FAIL("the free of device 1's block %#llx reached the driver, not cuma\n",
             (unsigned long long)r.got);
    CHECK_RES(cuMemFree_v2(r.got), CUDA_ERROR_INVALID_VALUE); /* still known as cuma's */
    CUdeviceptr again;
    CHECK_CU(cuMemAlloc_v2(&again, r.size));
    touch(again, r.size, 0x5b);
    CHECK_CU(cuMemFree_v2(again));
    CHECK_CU(cuMemFree_v2(warm));
    long before = fakecuda_reclaimed("handles") + fakecuda_reclaimed("allocs");
    CHECK_CU(reset_fn(1));
    CHECK(fakecuda_reclaimed("handles") + fakecuda_reclaimed("allocs") == before);
    CHECK(fakecuda_used_bytes(1) == 0);
    CHECK_CU(cuCtxSetCurrent(primary));
}

/* A reset while a call is inside the heap, blocked on work the device has not finished: the
 * reset must wait for it (preload_pin.c) before it destroys the heap. Thread A frees a block on a
 * stream S that is held (its pages idle, but fenced by S's work) and then asks for a block that
 * fits only once they go back: the out-of-memory ladder releases the cache, which waits for S's
 * events, pinned. Thread B resets the device meanwhile. B must not return before S is released;
 * A's allocation then gets the freed memory, and the reset finds nothing of cuma's to destroy.
 *
 * With a release thread, the heap's destruction stops it under the arena lock that A holds while
 * it waits, so a reset that did not wait for pins would still wait for A, by luck: the
 * preload_reset_wait run turns the thread off (release_thread:off), and there only the pin
 * makes B wait. */
#define PIN_WAIT_MS 500

struct pin_wait {
    ctx_fn reset_fn;
    CUstream s;
    CUdeviceptr p;
    CUresult alloc_r, reset_r;
    atomic_int reset_done;
};

static void *pin_wait_alloc_main(void *arg) {
    struct pin_wait *w = arg;
    CHECK_CU(cuCtxSetCurrent(primary));
    CUdeviceptr x;
    CHECK_CU(cuMemAllocAsync(&x, 200 * MB, w->s));
    CHECK_CU(cuMemFreeAsync(x, w->s)); /* idle once S's work is done, which it is not */
    w->alloc_r = cuMemAlloc_v2(&w->p, 200 * MB);
    return NULL;
}

static void *pin_wait_reset_main(void *arg) {
    struct pin_wait *w = arg;
    w->reset_r = w->reset_fn(0);
    atomic_store(&w->reset_done, 1);
    return NULL;
}

static void check_reset_waits_for_pins(ctx_fn reset_fn) {
    if (!routed) return; /* the plain driver's allocation does not wait, and nothing pins */
    struct pin_wait w = {.reset_fn = reset_fn};
    atomic_init(&w.reset_done, 0);
    CHECK_CU(cuStreamCreate(&w.s, CU_STREAM_NON_BLOCKING));
    fakecuda_stream_hold(w.s);
    long before[NKINDS];
    for (size_t i = 0; i < NKINDS; i++) before[i] = fakecuda_reclaimed(reclaim_kinds[i]);
    unsigned long syncs = fakecuda_calls("cuEventSynchronize");
    pthread_t a, b;
    CHECK(pthread_create(&a, NULL, pin_wait_alloc_main, &w) == 0);
    /* A is inside the heap once it waits for S's event (nothing else A does waits for one; the
     * fake counts a call when it starts). */
    for (int ms = 0; fakecuda_calls("cuEventSynchronize") == syncs; ms++) {
        if (ms == 8000) FAIL("the allocation never waited for the held stream\n");
        usleep(1000);
    }
    CHECK(pthread_create(&b, NULL, pin_wait_reset_main, &w) == 0);
    /* B cannot return while A is in the heap: wait a while for it to do so all the same. */
    for (int ms = 0; ms < PIN_WAIT_MS && !atomic_load(&w.reset_done); ms++) usleep(1000);
    if (atomic_load(&w.reset_done))
        FAIL("the reset returned while a call was inside the heap (waiting for a held stream)\n");
    fakecuda_stream_release(w.s);
    CHECK(pthread_join(a, NULL) == 0);
    CHECK(pthread_join(b, NULL) == 0);
    CHECK(atomic_load(&w.reset_done));
    CHECK_RES(w.reset_r, CUDA_SUCCESS);
    /* The cache release gave the freed block's pages back: the request fits the limit. */
    CHECK_RES(w.alloc_r, CUDA_SUCCESS);
    /* cuma gave back every page, A's new block's included, before the driver's reset. */
    for (size_t i = 0; i < NKINDS; i++) {
        long n = fakecuda_reclaimed(reclaim_kinds[i]) - before[i];
        if (n) FAIL("reset beside a pinned call destroyed %ld %s\n", n, reclaim_kinds[i]);
    }
    CHECK(fakecuda_live("handles") == 0 && fakecuda_live("mappings") == 0);
    CHECK(fakecuda_live("reservations") == 0 && fakecuda_live("allocs") == 0);
    CHECK(fakecuda_used_bytes(0) == 0);
    retain_again(0);
    CHECK_RES(cuMemFree_v2(w.p), CUDA_ERROR_INVALID_VALUE); /* gone with the reset */
    CHECK_CU(cuStreamDestroy_v2(w.s));
    CUdeviceptr p;
    CHECK_CU(cuMemAlloc_v2(&p, 200 * MB)); /* a fresh heap, with all of the limit */
    touch(p, 200 * MB, 0x41);
    CHECK_CU(cuMemFree_v2(p));
}

/* The program's releases. cuma's heap holds a reference of its own: the program's last release
 * leaves the context active (without the shim it goes inactive). A release more than the
 * program took takes cuma's: the context goes inactive, and the shim retires the heap that held
 * it (the plain driver refuses that release). */
static void check_release(ctx_fn release_fn) {
    CUdeviceptr p;
    CHECK_CU(cuMemAlloc_v2(&p, 1 * MB));
    touch(p, 1 * MB, 0x31);
    CHECK_CU(cuMemFree_v2(p));
    for (; retains > 0; retains--) CHECK_CU(release_fn(0));
    unsigned flags;
    int active = -1;
    CHECK_CU(cuDevicePrimaryCtxGetState(0, &flags, &active));
    CHECK(active == (routed ? 1 : 0));
    if (routed) {
        CHECK_CU(release_fn(0));
        CHECK_CU(cuDevicePrimaryCtxGetState(0, &flags, &active));
        CHECK(!active);
        CHECK(fakecuda_live("handles") == 0 && fakecuda_live("mappings") == 0);
        CHECK(fakecuda_live("reservations") == 0 && fakecuda_live("allocs") == 0);
    } else {
        CHECK_RES(release_fn(0), CUDA_ERROR_INVALID_CONTEXT);
    }
    retain_again(0); /* the program starts over, and cuma with a new heap */
    CHECK_CU(cuMemAlloc_v2(&p, 1 * MB));
    touch(p, 1 * MB, 0x32);
    CHECK_CU(cuMemFree_v2(p));
}

/* cudaDeviceReset as the runtime reaches it: cuDevicePrimaryCtxReset from cuGetProcAddress (the
 * _v2 ABI, and the unversioned one a runtime older than CUDA 11 asks for) and from dlsym. */
static void check_reset(void) {
    void *h, *sym;
    gpa_fn gpa = runtime_gpa(&h);
    CUdriverProcAddressQueryResult st;
    void *fn = NULL;
    ctx_fn by_gpa, by_gpa_v1, by_dlsym, release_fn;
    CHECK_CU(gpa("cuDevicePrimaryCtxReset", &fn, 13000, 0, &st));
    CHECK(fn && is_shim(fn) == routed);
    if (routed) CHECK(!strcmp(name_of(fn), "cuDevicePrimaryCtxReset_v2"));
    memcpy(&by_gpa, &fn, sizeof fn);
    CHECK_CU(gpa("cuDevicePrimaryCtxReset", &fn, 10020, 0, &st));
    CHECK(fn && is_shim(fn) == routed);
    if (routed) CHECK(!strcmp(name_of(fn), "cuDevicePrimaryCtxReset"));
    memcpy(&by_gpa_v1, &fn, sizeof fn);
    sym = dlsym(h, "cuDevicePrimaryCtxReset_v2");
    CHECK(sym && is_shim(sym) == routed);
    memcpy(&by_dlsym, &sym, sizeof sym);
    CHECK_CU(gpa("cuDevicePrimaryCtxRelease", &fn, 13000, 0, &st));
    CHECK(fn && is_shim(fn) == routed);
    memcpy(&release_fn, &fn, sizeof fn);

    reset_and_go_on(by_gpa, "cuGetProcAddress");
    reset_and_go_on(by_dlsym, "dlsym");
    reset_and_go_on(by_gpa_v1, "cuGetProcAddress (CUDA 10.2)");
    int ndev = 0;
    CHECK_CU(cuDeviceGetCount(&ndev));
    if (ndev >= 2) check_reset_beside_device1(by_gpa);
    if (ndev >= 2 && routed && !vmm) check_freed_address_reused(by_gpa);
    check_reset_waits_for_pins(by_gpa);
    check_release(release_fn);
    dlclose(h);
}

#define THREADS 4
#define ROUNDS  2000

static void *thread_main(void *arg) {
    unsigned id = (unsigned)(uintptr_t)arg;
    unsigned long long x = 0x9E3779B97F4A7C15ull * (id + 1);
    CHECK_CU(cuCtxSetCurrent(primary));
    CUdeviceptr live[8] = {0};
    size_t sizes[8] = {0};
    for (int i = 0; i < ROUNDS; i++) {
        x ^= x << 13, x ^= x >> 7, x ^= x << 17;
        int k = (int)(x % 8);
        if (live[k]) {
            unsigned char c = 0;
            CHECK_CU(cuMemcpyDtoH_v2(&c, live[k] + sizes[k] - 1, 1));
            CHECK(c == (unsigned char)(id + 1));
            CHECK_CU(cuMemFree_v2(live[k]));
            live[k] = 0;
        } else {
            sizes[k] = 1 + (size_t)(x >> 20) % (256 * 1024);
            CHECK_CU(cuMemAlloc_v2(&live[k], sizes[k]));
            CHECK_CU(cuMemsetD8_v2(live[k], (unsigned char)(id + 1), sizes[k]));
        }
    }
    for (int k = 0; k < 8; k++)
        if (live[k]) CHECK_CU(cuMemFree_v2(live[k]));
    return NULL;
}

/* Several threads, each with the primary context current, allocate and free at once. */
static void check_threads(void) {
    pthread_t t[THREADS];
    for (unsigned i = 0; i < THREADS; i++)
        CHECK(pthread_create(&t[i], NULL, thread_main, (void *)(uintptr_t)i) == 0);
    for (unsigned i = 0; i < THREADS; i++) CHECK(pthread_join(t[i], NULL) == 0);
}

static void capture_stderr(void) {
    captured = tmpfile();
    CHECK(captured);
    fflush(stderr);
    saved_stderr = dup(2);
    CHECK(saved_stderr >= 0 && dup2(fileno(captured), 2) == 2);
}

/* The shim's messages: `want` once, or none at all. */
static void check_stderr(const char *want) {
    fflush(stderr);
    char buf[8192];
    rewind(captured);
    size_t n = fread(buf, 1, sizeof buf - 1, captured);
    buf[n] = 0;
    show_captured(); /* into the test log */
    if (!want) {
        CHECK(strstr(buf, "cuma preload:") == NULL);
        return;
    }
    const char *hit = strstr(buf, want);
    CHECK(hit != NULL);
    CHECK(strstr(hit + 1, want) == NULL); /* reported once */
}

int main(int argc, char **argv) {
    if (argc < 3) {
        fprintf(stderr, "usage: %s ROUTED SHIM [STDERR_TEXT]\n", argv[0]);
        return 2;
    }
    routed = atoi(argv[1]) != 0;
    shim_loaded = atoi(argv[2]) != 0;
    const char *want = argc > 3 ? argv[3] : NULL;
    const char *novmm = getenv("FAKECUDA_NO_VMM");
    vmm = !(novmm && *novmm == '1');
    capture_stderr();

    CHECK_CU(cuInit(0));
    CUdevice dev;
    CHECK_CU(cuDeviceGet(&dev, 0));
    /* Before anything allocated: the limit comes from CUMA_CONF, and no context is made. */
    size_t total = 0;
    CHECK_CU(cuDeviceTotalMem_v2(&total, dev));
    CHECK(total == (routed ? LIMIT : CAPACITY));
    CHECK(fakecuda_calls("cuDevicePrimaryCtxRetain") == 0);
    CHECK_CU(cuDevicePrimaryCtxRetain(&primary, dev));
    retains = 1;
    CHECK_CU(cuCtxSetCurrent(primary));
    /* The first call that needs the heap makes it; with nothing allocated, all is free. */
    size_t fr = 0;
    CHECK_CU(cuMemGetInfo_v2(&fr, &total));
    CHECK(total == (routed ? LIMIT : CAPACITY));
    if (routed && fr != total) FAIL("a new heap: free %zu of %zu\n", fr, total);

    check_threads();
    check_alloc_free();
    check_double_free_keeps_memory();
    check_limit();
    check_async_and_pitch();
    check_foreign_free();
    check_per_thread_streams();
    check_free_waits_for_freeing_thread();
    check_free_waits_for_blocking_streams();
    check_runtime_path();
    check_reset();
    check_stderr(want);
    printf("test_preload: routed=%d shim=%d vmm=%d: all checks passed\n", routed, shim_loaded, vmm);
    return 0;
}
