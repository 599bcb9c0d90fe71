// SPDX-License-Identifier: Apache-2.0
/* The CUDA driver, loaded at run time.
 *
 * libcuma has no link-time dependency on libcuda or libcudart: a machine without a GPU runs
 * the simulated device, and the LD_PRELOAD shim must not pull a second driver copy into a
 * program. So the driver is opened with dlopen("libcuda.so.1") (or the file named by the
 * environment variable CUMA_CUDA_LIBRARY, for tests and odd installs) once per process, every
 * entry point cuma uses is resolved with dlsym under the symbol the CUDA 13 header maps its
 * name to (cuMemGetInfo -> cuMemGetInfo_v2, ...), and cuInit(0) is called.
 *
 * Thread safety: cuma_cuda_load may be called from any thread at any time; the table it
 * returns is constant and stays valid until the process exits (the library is never closed,
 * because any thread may be inside a driver call).
 */
#ifndef CUMA_BACKEND_CUDA_DRIVER_H
#define CUMA_BACKEND_CUDA_DRIVER_H

#include "cuma/cuma.h"

#include <cuda.h>

/* Every driver function cuma calls: X(field, exported symbol, parameter list). The symbol is
 * the one the header's #define names (the _v2 ABI), spelled out so that a reader can grep for
 * it; cuda_driver.c checks at compile time that each typedef matches the header's prototype. */
#define CUMA_CUDA_FUNCTIONS(X)                                                                     \
    X(Init, cuInit, (unsigned int))                                                                \
    X(GetErrorName, cuGetErrorName, (CUresult, const char **))                                     \
    X(GetErrorString, cuGetErrorString, (CUresult, const char **))                                 \
    X(DeviceGet, cuDeviceGet, (CUdevice *, int))                                                   \
    X(DeviceGetCount, cuDeviceGetCount, (int *))                                                   \
    X(DeviceGetAttribute, cuDeviceGetAttribute, (int *, CUdevice_attribute, CUdevice))             \
    X(DeviceGetUuid, cuDeviceGetUuid_v2, (CUuuid *, CUdevice))                                     \
    X(DeviceTotalMem, cuDeviceTotalMem_v2, (size_t *, CUdevice))                                   \
    X(DeviceCanAccessPeer, cuDeviceCanAccessPeer, (int *, CUdevice, CUdevice))                     \
    X(DevicePrimaryCtxRetain, cuDevicePrimaryCtxRetain, (CUcontext *, CUdevice))                   \
    X(DevicePrimaryCtxRelease, cuDevicePrimaryCtxRelease_v2, (CUdevice))                           \
    X(CtxGetCurrent, cuCtxGetCurrent, (CUcontext *))                                               \
    X(CtxSetCurrent, cuCtxSetCurrent, (CUcontext))                                                 \
    X(MemGetAllocationGranularity, cuMemGetAllocationGranularity,                                  \
      (size_t *, const CUmemAllocationProp *, CUmemAllocationGranularity_flags))                   \
    X(MemAddressReserve, cuMemAddressReserve,                                                      \
      (CUdeviceptr *, size_t, size_t, CUdeviceptr, unsigned long long))                            \
    X(MemAddressFree, cuMemAddressFree, (CUdeviceptr, size_t))                                     \
    X(MemCreate, cuMemCreate,                                                                      \
      (CUmemGenericAllocationHandle *, size_t, const CUmemAllocationProp *, unsigned long long))   \
    X(MemRelease, cuMemRelease, (CUmemGenericAllocationHandle))                                    \
    X(MemMap, cuMemMap,                                                                            \
      (CUdeviceptr, size_t, size_t, CUmemGenericAllocationHandle, unsigned long long))             \
    X(MemUnmap, cuMemUnmap, (CUdeviceptr, size_t))                                                 \
    X(MemSetAccess, cuMemSetAccess, (CUdeviceptr, size_t, const CUmemAccessDesc *, size_t))        \
    X(MemAlloc, cuMemAlloc_v2, (CUdeviceptr *, size_t))                                            \
    X(MemAllocManaged, cuMemAllocManaged, (CUdeviceptr *, size_t, unsigned int))                   \
    X(MemFree, cuMemFree_v2, (CUdeviceptr))                                                        \
    X(MemGetInfo, cuMemGetInfo_v2, (size_t *, size_t *))                                           \
    X(EventCreate, cuEventCreate, (CUevent *, unsigned int))                                       \
    X(EventDestroy, cuEventDestroy_v2, (CUevent))                                                  \
    X(EventRecord, cuEventRecord, (CUevent, CUstream))                                             \
    X(EventQuery, cuEventQuery, (CUevent))                                                         \
    X(EventSynchronize, cuEventSynchronize, (CUevent))                                             \
    X(StreamIsCapturing, cuStreamIsCapturing, (CUstream, CUstreamCaptureStatus *))                 \
    X(StreamGetCtx, cuStreamGetCtx, (CUstream, CUcontext *))                                       \
    X(StreamWaitEvent, cuStreamWaitEvent, (CUstream, CUevent, unsigned int))                       \
    X(ThreadExchangeStreamCaptureMode, cuThreadExchangeStreamCaptureMode, (CUstreamCaptureMode *))

/* Our own pointer types (cuma_cu_Init_fn, ...): the header's prototypes are declarations of
 * functions we must never reference at link time. */
#define CUMA_CUDA_TYPEDEF(field, sym, params)                                                      \
    typedef CUresult(CUDAAPI *cuma_cu_##field##_fn) params;
CUMA_CUDA_FUNCTIONS(CUMA_CUDA_TYPEDEF)
#undef CUMA_CUDA_TYPEDEF

/* The resolved entry points, e.g. `api->MemMap(addr, size, 0, handle, 0)`. Field names drop
 * the "cu" prefix so that the header's #defines (cuMemMap is not one, cuMemFree is) never
 * rewrite them. */
typedef struct cuma_cuda_api {
#define CUMA_CUDA_FIELD(field, sym, params) cuma_cu_##field##_fn field;
    CUMA_CUDA_FUNCTIONS(CUMA_CUDA_FIELD)
#undef CUMA_CUDA_FIELD
    const char *path; /* the file that was opened */
} cuma_cuda_api;

/* Loads and initialises the driver on first use (no lock held across dlopen: threads that race
 * each load, the first to finish is published); later calls return the same
 * answer. CUMA_OK and *out set, or CUMA_ERR_NO_DEVICE with cuma_last_error() naming the library
 * path and the reason (dlerror(), the missing symbol, or cuInit's CUresult name). */
cuma_status cuma_cuda_load(const cuma_cuda_api **out);

/* CUMA_OK for CUDA_SUCCESS; otherwise sets the calling thread's message to
 * "what: CUDA_ERROR_NAME (description)" and returns CUMA_ERR_OOM for
 * CUDA_ERROR_OUT_OF_MEMORY, CUMA_ERR_BACKEND for anything else. */
cuma_status cuma_cuda_check(CUresult r, const char *what);

/* "CUDA_ERROR_INVALID_VALUE (invalid argument)" for r, into buf; works without a driver
 * ("CUresult 1"). Returns buf. */
const char *cuma_cuda_result_text(CUresult r, char *buf, size_t len);

#endif
