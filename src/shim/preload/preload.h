// SPDX-License-Identifier: Apache-2.0
/* Internals of libcuma_preload.so, the LD_PRELOAD interposer (docs/PRELOAD.md).
 *
 * preload_dl.c finds the real driver and the real dlsym, interposes dlsym and cuGetProcAddress,
 * and keeps the table of device memory cuma's own backend took from the driver; preload_mem.c
 * decides whether the shim routes (CUMA_PRELOAD, CUMA_CONF), which heap a call goes to, and holds
 * the interposed allocation entry points; preload_ctx.c interposes the calls that end a primary
 * context (reset, release) and retires the device's heap before the context goes;
 * preload_pin.c lets that retirement wait until no thread uses the heap.
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

/* cuda.h renames the unversioned primary-context calls to their _v2 ABI; the shim defines both
 * names (runtimes before CUDA 11 fetch the unversioned ones). */
#undef cuDevicePrimaryCtxReset
#undef cuDevicePrimaryCtxRelease
CUresult CUDAAPI cuDevicePrimaryCtxReset(CUdevice dev);
CUresult CUDAAPI cuDevicePrimaryCtxRelease(CUdevice dev);

/* Likewise cuStreamDestroy: the unversioned one is what CUDA before 4.0 fetches. */
#undef cuStreamDestroy
CUresult CUDAAPI cuStreamDestroy(CUstream hStream);

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
    X(StreamDestroy, cuStreamDestroy_v2, (CUstream))                                               \
    X(StreamDestroyV1, cuStreamDestroy, (CUstream))                                                \
    X(DevicePrimaryCtxGetState, cuDevicePrimaryCtxGetState, (CUdevice, unsigned int *, int *))     \
    X(DevicePrimaryCtxRetain, cuDevicePrimaryCtxRetain, (CUcontext *, CUdevice))                   \
    X(DevicePrimaryCtxRelease, cuDevicePrimaryCtxRelease_v2, (CUdevice))                           \
    X(DevicePrimaryCtxReleaseV1, cuDevicePrimaryCtxRelease, (CUdevice))                            \
    X(DevicePrimaryCtxReset, cuDevicePrimaryCtxReset_v2, (CUdevice))                               \
    X(DevicePrimaryCtxResetV1, cuDevicePrimaryCtxReset, (CUdevice))                                \
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
 * accepts is a double free or an interior pointer, never a driver allocation. *dev (may be NULL)
 * gets the device whose heap took it (-1: unknown or not cuma's). Thread-safe. */
bool cuma_preload_owned(CUdeviceptr addr, int *dev);

/* Forgets the ranges cuma took on device `dev` that are still recorded: called once the device's
 * heap is gone and its context is being destroyed, which takes whatever the heap could not give
 * back (the driver may then hand those addresses to others). Thread-safe. */
void cuma_preload_owned_forget(int dev);

/* The driver functions that cuma's backend resolves through dlsym from inside the shim get
 * wrappers that record what it takes (cuma_preload_owned); NULL for any other name. */
void *cuma_preload_tracked(const char *name);

/* ---- retiring a device's heap (preload_mem.c) ---- */

/* Retires device dev's heap before its primary context is destroyed: new calls for the device
 * stop using the heap (they go to the driver until cuma_preload_retire_end), the heap is
 * destroyed once no thread holds a pin of the device (its pages unmapped and released through
 * the driver while the context still exists), and the ranges it took are forgotten. False, with
 * nothing done, for an ordinal out of range and a device the shim passes to the driver (its heap
 * could not be made). Calls for one device must not overlap (preload_ctx.c serialises them). */
bool cuma_preload_retire_begin(int dev);

/* After the context is gone: the next allocation on dev makes a new heap. Only after a
 * cuma_preload_retire_begin(dev) that returned true. */
void cuma_preload_retire_end(int dev);

/* Whether dev has a heap the shim routes to. Thread-safe. */
bool cuma_preload_has_heap(int dev);

/* ---- pins (preload_pin.c) ---- */

/* A thread's claim that it may use device `dev`'s heap until cuma_preload_pin_drop. A call takes
 * the pin before it reads the device's state and uses the heap only if the state still says the
 * heap is there; a retirement stores the new state before it waits (cuma_preload_pins_wait), so
 * that either the thread keeps off the heap or the retirement waits for it. Pins nest. */
typedef struct cuma_preload_pin {
    void *rec;     /* the thread's record; NULL: counted among the device's anonymous pins */
    uint64_t prev; /* the record's mask before this pin */
    int dev;
} cuma_preload_pin;

/* dev in 0..CUMA_MAX_DEFAULT_HEAPS-1. */
void cuma_preload_pin_take(cuma_preload_pin *pin, int dev);
void cuma_preload_pin_drop(const cuma_preload_pin *pin);

/* Returns once no thread holds a pin of dev that it took before the caller's last store. */
void cuma_preload_pins_wait(int dev);
/* In a forked child: the pins of the parent's other threads are dropped (those threads are not
 * there to drop them). */
void cuma_preload_pins_after_fork(void);
/* In a forked child: the locks of the owned ranges and of retirements start free. */
void cuma_preload_owned_after_fork(void);
void cuma_preload_ctx_after_fork(void);

/* Prints "cuma preload: <message>" on stderr. */
void cuma_preload_report(const char *fmt, ...) __attribute__((format(printf, 1, 2)));

#endif
