// SPDX-License-Identifier: Apache-2.0
/*
 * fakecuda_internal.h - state shared by the fake CUDA driver's source files.
 * Everything here is hidden (not exported from libcuda.so.1).
 * All mutable state is protected by fc_mu unless noted otherwise.
 */
#ifndef CUMA_FAKECUDA_INTERNAL_H
#define CUMA_FAKECUDA_INTERNAL_H

#include <pthread.h>
#include <stddef.h>
#include <stdint.h>

#include "fakecuda.h"

#define FC_HIDDEN __attribute__((visibility("hidden")))
#define FC_EXPORT __attribute__((visibility("default")))

#define FC_MAX_DEVICES    64
#define FC_DRIVER_VERSION 13000

/* Every driver API the fake implements, by base name without the "cu" prefix
 * (so that cuda.h's "#define cuMemAlloc cuMemAlloc_v2" cannot interfere). */
#define FC_API_LIST(X)                                                                             \
    X(Init)                                                                                        \
    X(DriverGetVersion)                                                                            \
    X(DeviceGet)                                                                                   \
    X(DeviceGetCount)                                                                              \
    X(DeviceGetName)                                                                               \
    X(DeviceGetUuid)                                                                               \
    X(DeviceGetAttribute)                                                                          \
    X(DeviceTotalMem)                                                                              \
    X(DeviceCanAccessPeer)                                                                         \
    X(DevicePrimaryCtxRetain)                                                                      \
    X(DevicePrimaryCtxRelease)                                                                     \
    X(DevicePrimaryCtxGetState)                                                                    \
    X(DevicePrimaryCtxReset)                                                                       \
    X(CtxSetCurrent)                                                                               \
    X(CtxGetCurrent)                                                                               \
    X(CtxGetDevice)                                                                                \
    X(CtxSynchronize)                                                                              \
    X(MemGetInfo)                                                                                  \
    X(MemAlloc)                                                                                    \
    X(MemFree)                                                                                     \
    X(MemAllocPitch)                                                                               \
    X(MemAllocAsync)                                                                               \
    X(MemFreeAsync)                                                                                \
    X(MemAllocManaged)                                                                             \
    X(MemAddressReserve)                                                                           \
    X(MemAddressFree)                                                                              \
    X(MemCreate)                                                                                   \
    X(MemRelease)                                                                                  \
    X(MemMap)                                                                                      \
    X(MemUnmap)                                                                                    \
    X(MemSetAccess)                                                                                \
    X(MemGetAllocationGranularity)                                                                 \
    X(StreamCreate)                                                                                \
    X(StreamDestroy)                                                                               \
    X(StreamSynchronize)                                                                           \
    X(StreamQuery)                                                                                 \
    X(StreamGetCtx)                                                                                \
    X(StreamWaitEvent)                                                                             \
    X(EventCreate)                                                                                 \
    X(EventDestroy)                                                                                \
    X(EventRecord)                                                                                 \
    X(EventQuery)                                                                                  \
    X(EventSynchronize)                                                                            \
    X(StreamBeginCapture)                                                                          \
    X(StreamEndCapture)                                                                            \
    X(StreamIsCapturing)                                                                           \
    X(ThreadExchangeStreamCaptureMode)                                                             \
    X(MemsetD8)                                                                                    \
    X(MemcpyHtoD)                                                                                  \
    X(MemcpyDtoH)                                                                                  \
    X(GetErrorString)                                                                              \
    X(GetErrorName)                                                                                \
    X(GetProcAddress)

enum fc_api {
#define FC_API_ENUM(n) FC_API_##n,
    FC_API_LIST(FC_API_ENUM)
#undef FC_API_ENUM
        FC_API_COUNT
};

/* Configuration read once from the environment (immutable afterwards). */
struct fc_config {
    int ndev;
    uint64_t capacity;
    uint64_t gran;        /* minimum allocation granularity */
    uint64_t rec_gran;    /* recommended granularity: a power-of-two multiple of gran */
    int no_rdma;          /* FAKECUDA_NO_RDMA=1: no GPUDirect RDMA with VMM memory */
    uint64_t host_memory; /* what cuMemAllocManaged may hand out, all devices together */
    int no_vmm;
    int no_peer;
    long sync_timeout_ms;
    unsigned event_lag; /* FAKECUDA_EVENT_LAG: every stream's initial completion lag */
    uint64_t ctx_bytes; /* FAKECUDA_CONTEXT_MB: device memory an active primary context takes */
    long vmm_call_us;   /* FAKECUDA_VMM_CALL_US: what each VMM call costs, slept */
    int sync_vmm;       /* FAKECUDA_SYNC_VMM=1: cuMemUnmap and cuMemSetAccess wait for the device */
};

/* Sorted vector of fixed-size elements whose first member is a uint64_t key. */
struct fc_vec {
    unsigned char *data;
    size_t n, cap, esz;
};

struct CUctx_st {
    int dev;
    int refcount; /* primary context retain count; 0 = inactive */
    /* Retains that a cuDevicePrimaryCtxReset dropped: the driver documents releasing them after
     * the reset as safe, so each release of one succeeds and changes nothing. Released before
     * `refcount` (a release cannot say which retain it ends; the older ones go first). */
    int stale;
};

struct CUstream_st {
    int dev;
    unsigned flags;
    int held;      /* work in flight (set only by fakecuda_stream_hold) */
    int destroyed; /* cuStreamDestroy'ed: a tombstone, kept (never freed) so any use aborts */
    int pseudo;    /* per-device NULL/legacy or per-thread stream */
    /* Late completion: work recorded on the stream is numbered (recorded) and complete up to
     * `completed`; an event recorded on it completes after `lag` queries of it (or a
     * synchronize), a cuStreamQuery after `lag` queries of the stream (qleft). */
    uint64_t recorded, completed;
    unsigned lag, qleft;
    /* Stream capture (cuStreamBeginCapture): the mode it began in, the thread that began it,
     * and whether a violation invalidated it. */
    int capturing, cap_invalid;
    CUstreamCaptureMode cap_mode;
    pthread_t cap_thread;
};

/* What an event recorded on a stream waits for besides its own stream: the other side of the
 * legacy stream's implicit synchronisation (see fakecuda_stream.c). */
struct fc_snap {
    struct CUstream_st *st;
    uint64_t ticket;
};

struct CUevent_st {
    int dev;
    struct CUstream_st *pending; /* held stream it was recorded on, or NULL */
    int destroyed;               /* cuEventDestroy'ed: a tombstone, like a stream's */
    struct CUstream_st *on;      /* the stream of its last record (NULL: never recorded) */
    uint64_t ticket;             /* its number among on's records */
    unsigned left;               /* queries before it completes */
    struct fc_snap *snap;        /* streams whose earlier work it also waits for */
    int captured;                /* last recorded in a capturing stream */
    size_t nsnap, capsnap;
};

struct fc_device {
    int memfd;
    uint64_t file_size;
    uint64_t used;                  /* bytes charged against capacity */
    struct fc_vec free_ext;         /* struct fc_extent, sorted by offset */
    struct CUctx_st ctx;            /* the primary context */
    struct CUstream_st null_stream; /* NULL stream and CU_STREAM_LEGACY */
    /* CU_STREAM_PER_THREAD is one stream per thread: see fakecuda_stream.c. */
};

struct fc_live_counts {
    long handles, mappings, reservations, allocs, managed, streams, events;
    long rdma_handles; /* of `handles`, those created gpuDirectRDMACapable */
};

extern FC_HIDDEN struct fc_config fc_cfg;

/* Device memory d's own context takes while it is active (fc_mu held). */
static inline uint64_t fc_ctx_charge(const struct fc_device *d) {
    return d->ctx.refcount > 0 ? fc_cfg.ctx_bytes : 0;
}
/* Bytes of live cuMemAllocManaged blocks (host memory, not any device's; under fc_mu). */
extern FC_HIDDEN uint64_t fc_managed_used;
extern FC_HIDDEN pthread_mutex_t fc_mu;
extern FC_HIDDEN pthread_cond_t fc_cv;
extern FC_HIDDEN int fc_initialized;
extern FC_HIDDEN struct fc_device fc_dev[FC_MAX_DEVICES];
extern FC_HIDDEN struct fc_live_counts fc_live_n;
/* Objects that cuDevicePrimaryCtxReset destroyed because they were still live (fakecuda_reclaimed).
 */
extern FC_HIDDEN struct fc_live_counts fc_reclaimed_n;
extern FC_HIDDEN _Thread_local struct CUctx_st *fc_tls_ctx;

/* fakecuda.c */
FC_HIDDEN void fc_die(const char *fmt, ...) __attribute__((noreturn, format(printf, 1, 2)));
FC_HIDDEN void fc_config_once(void);
FC_HIDDEN CUresult fc_enter(enum fc_api api, int need_init);
FC_HIDDEN CUresult fc_current_dev_locked(int *dev);
FC_HIDDEN void fc_lock(void);
FC_HIDDEN void fc_unlock(void);

/* Count the call, apply fault injection, check cuInit. */
#define FC_ENTER(name)                                                                             \
    do {                                                                                           \
        CUresult fc_rc_ = fc_enter(FC_API_##name, 1);                                              \
        if (fc_rc_ != CUDA_SUCCESS) return fc_rc_;                                                 \
    } while (0)
#define FC_ENTER_NOINIT(name)                                                                      \
    do {                                                                                           \
        CUresult fc_rc_ = fc_enter(FC_API_##name, 0);                                              \
        if (fc_rc_ != CUDA_SUCCESS) return fc_rc_;                                                 \
    } while (0)

/* fc_vec (fakecuda_mem.c) */
FC_HIDDEN void fc_vec_init(struct fc_vec *v, size_t esz);
FC_HIDDEN void *fc_vec_at(const struct fc_vec *v, size_t i);
FC_HIDDEN size_t fc_vec_lower(const struct fc_vec *v, uint64_t key);
FC_HIDDEN int fc_vec_insert(struct fc_vec *v, size_t i, const void *elem);
FC_HIDDEN void fc_vec_erase(struct fc_vec *v, size_t i, size_t count);

/* fakecuda_mem.c: per-device setup at cuInit; 0 or -1 (errno set). */
FC_HIDDEN int fc_mem_init_device(struct fc_device *d);

/* fakecuda_mem.c: destroys the memory of device dev's primary context, as a reset does (see
 * cuDevicePrimaryCtxReset_v2 in fakecuda.c). fc_mu held. */
FC_HIDDEN void fc_mem_reset_device_locked(int dev);

/* fakecuda_stream.c: per-device setup at cuInit. */
FC_HIDDEN void fc_stream_init_device(struct fc_device *d, int dev);

/* fakecuda_stream.c: CUDA_SUCCESS when s names a live stream (or a pseudo stream of the
 * current context), for the stream-ordered allocator in fakecuda_mem.c; a destroyed stream
 * aborts, naming `api`. Takes fc_mu. */
FC_HIDDEN CUresult fc_stream_check(const char *api, CUstream s);

/* fakecuda_stream.c: CUDA_SUCCESS, or CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED (invalidating the
 * captures that forbid it) when the calling thread may not make a potentially unsafe call now
 * (see cuThreadExchangeStreamCaptureMode in cuda.h). fc_mu held. */
FC_HIDDEN CUresult fc_capture_unsafe_locked(void);
/* The same, taking fc_mu. */
FC_HIDDEN CUresult fc_capture_unsafe(void);
/* The cost of a VMM call (FAKECUDA_VMM_CALL_US), and with `sync` and FAKECUDA_SYNC_VMM, the wait
 * of a synchronous one for the current device's work: cuda.h's cuMemUnmap and cuMemSetAccess
 * are synchronous with respect to the device. Called without fc_mu. */
FC_HIDDEN void fc_vmm_call(const char *api, int sync);

#endif /* CUMA_FAKECUDA_INTERNAL_H */
