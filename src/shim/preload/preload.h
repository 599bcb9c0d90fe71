/* Internals of libcuma_preload.so, the LD_PRELOAD interposer (docs/PRELOAD.md).
 *
 * Two files: preload_dl.c finds the real driver and the real dlsym, interposes dlsym and
 * cuGetProcAddress, and keeps the table of device memory cuma's own backend took from the
 * driver; preload_mem.c decides whether the shim routes (CUMA_PRELOAD, CUMA_CONF), which heap a
 * call goes to, and holds the interposed allocation entry points.
 *
 * Nothing here is exported: the version script (exports.map) makes every symbol of the shim
 * local except the driver entry points it interposes and dlsym.
 */
#ifndef CUMA_SHIM_PRELOAD_H
#define CUMA_SHIM_PRELOAD_H

#include <cuda.h>
#include <stdbool.h>
#include <stdint.h>

/* The shim's exported entry points (the file is built with hidden visibility; exports.map
 * lists the same names). */
#define CUMA_PRELOAD_EXPORT __attribute__((visibility("default")))

/* Per-thread-default-stream variants, which cuda.h declares only for builds that define
 * CUDA_API_PER_THREAD_DEFAULT_STREAM. */
CUresult CUDAAPI cuMemAllocAsync_ptsz(CUdeviceptr *dptr, size_t bytesize, CUstream hStream);
CUresult CUDAAPI cuMemFreeAsync_ptsz(CUdeviceptr dptr, CUstream hStream);

/* The first cuGetProcAddress (CUDA 11.3 to 11.8 runtimes call it): cuda.h 12+ renames the name
 * to cuGetProcAddress_v2, whose extra argument this ABI lacks. */
typedef CUresult(CUDAAPI *cuma_preload_gpa1_fn)(const char *, void **, int, cuuint64_t);

/* Every real driver function the shim calls: X(field, symbol, parameter list). A symbol the
 * driver lacks stays NULL; the code that forwards to it then answers CUDA_ERROR_NOT_FOUND. */
#define CUMA_PRELOAD_REAL(X)                                                                       \
    X(MemAlloc, cuMemAlloc_v2, (CUdeviceptr *, size_t))                                            \
    X(MemFree, cuMemFree_v2, (CUdeviceptr))                                                        \
    X(MemAllocPitch, cuMemAllocPitch_v2, (CUdeviceptr *, size_t *, size_t, size_t, unsigned int))  \
    X(MemAllocAsync, cuMemAllocAsync, (CUdeviceptr *, size_t, CUstream))                           \
    X(MemAllocAsyncPtsz, cuMemAllocAsync_ptsz, (CUdeviceptr *, size_t, CUstream))                  \
    X(MemFreeAsync, cuMemFreeAsync, (CUdeviceptr, CUstream))                                       \
    X(MemFreeAsyncPtsz, cuMemFreeAsync_ptsz, (CUdeviceptr, CUstream))                              \
    X(MemGetInfo, cuMemGetInfo_v2, (size_t *, size_t *))                                           \
    X(DeviceTotalMem, cuDeviceTotalMem_v2, (size_t *, CUdevice))                                   \
    X(GetProcAddressV2, cuGetProcAddress_v2,                                                       \
      (const char *, void **, int, cuuint64_t, CUdriverProcAddressQueryResult *))                  \
    X(CtxGetCurrent, cuCtxGetCurrent, (CUcontext *))                                               \
    X(CtxSynchronize, cuCtxSynchronize, (void))                                                    \
    X(StreamSynchronize, cuStreamSynchronize, (CUstream))                                          \
    X(CtxGetDevice, cuCtxGetDevice, (CUdevice *))                                                  \
    X(StreamGetCtx, cuStreamGetCtx, (CUstream, CUcontext *))                                       \
    X(DevicePrimaryCtxGetState, cuDevicePrimaryCtxGetState, (CUdevice, unsigned int *, int *))     \
    X(DevicePrimaryCtxRetain, cuDevicePrimaryCtxRetain, (CUcontext *, CUdevice))                   \
    X(DevicePrimaryCtxRelease, cuDevicePrimaryCtxRelease_v2, (CUdevice))                           \
    X(MemAddressReserve, cuMemAddressReserve,                                                      \
      (CUdeviceptr *, size_t, size_t, CUdeviceptr, unsigned long long))                            \
    X(MemAddressFree, cuMemAddressFree, (CUdeviceptr, size_t))                                     \
    X(MemAllocManaged, cuMemAllocManaged, (CUdeviceptr *, size_t, unsigned int))

#define CUMA_PRELOAD_TYPEDEF(field, sym, params)                                                   \
    typedef CUresult(CUDAAPI *cuma_pl_##field##_fn) params;
CUMA_PRELOAD_REAL(CUMA_PRELOAD_TYPEDEF)
#undef CUMA_PRELOAD_TYPEDEF

/* The real driver. Written once under a pthread_once (cuma_preload_driver), constant after. */
typedef struct cuma_preload_driver {
#define CUMA_PRELOAD_FIELD(field, sym, params) cuma_pl_##field##_fn field;
    CUMA_PRELOAD_REAL(CUMA_PRELOAD_FIELD)
#undef CUMA_PRELOAD_FIELD
    cuma_preload_gpa1_fn GetProcAddressV1; /* "cuGetProcAddress" */
    void *handle;                          /* NULL: no driver could be opened */
} cuma_preload_driver;

/* The real driver, opened on first use from CUMA_CUDA_LIBRARY or libcuda.so.1, as cuma's CUDA
 * backend opens it (both then hold the same library). Never NULL; `handle` is NULL when the
 * library could not be opened. Thread-safe. A call made while this thread is opening the driver
 * (a dlsym from the driver's own constructors) gets the table as it is so far. */
const cuma_preload_driver *cuma_preload_driver_get(void);

/* Whether the shim routes allocations to cuma (true) or passes everything to the driver. Decided
 * once, at the first call that asks: CUMA_PRELOAD and CUMA_CONF, with a message on stderr for a
 * setting that is wrong. Thread-safe; one atomic load after the first call. */
bool cuma_preload_routing(void);

/* Whether [addr, addr + 1) lies in device memory that cuma's backend took from the driver
 * (reserved ranges, segments, managed segments): a free of such an address that no heap
 * accepts is a double free or an interior pointer, never a driver allocation. Thread-safe. */
bool cuma_preload_owned(CUdeviceptr addr);

/* The driver functions that cuma's backend resolves through dlsym from inside the shim get
 * wrappers that record what it takes (cuma_preload_owned); NULL for any other name. */
void *cuma_preload_tracked(const char *name);

/* Prints "cuma preload: <message>" on stderr. */
void cuma_preload_report(const char *fmt, ...) __attribute__((format(printf, 1, 2)));

#endif
