// SPDX-License-Identifier: Apache-2.0
/*
 * fakecuda.c - a fake CUDA driver (libcuda.so.1) for cuma's tests.
 *
 * Model
 * -----
 * Device memory is host memory, so tests can read and write "device"
 * pointers directly from the CPU.
 *
 * - Devices: FAKECUDA_DEVICES of them (default 1), each with capacity
 *   FAKECUDA_CAPACITY bytes (default 80G) and allocation granularity
 *   FAKECUDA_GRANULARITY (default 2M; minimum == recommended). Each device
 *   has one primary context (a static object); the current context is a
 *   thread-local pointer. cuDevicePrimaryCtxReset destroys the memory of the
 *   context (its cuMemAlloc/managed blocks, its handles and their mappings;
 *   fakecuda_reclaimed counts what was still live) and makes it inactive
 *   until the next retain; the last cuDevicePrimaryCtxRelease makes it
 *   inactive but keeps its memory, so that leak checks still see it.
 * - Physical memory: one sparse memfd per device, carved by a first-fit
 *   extent allocator in granularity units. The file is made larger than the
 *   capacity (16x when possible, sparse so it costs nothing) so that
 *   fragmentation of file offsets never causes an OOM that a real GPU would
 *   not report; the capacity limit itself is enforced by byte accounting:
 *   cuMemCreate and cuMemAlloc (rounded up to the granularity) are charged
 *   to the device, and a request that would exceed the capacity fails with
 *   CUDA_ERROR_OUT_OF_MEMORY. Freed physical ranges
 *   are returned to the host with fallocate(PUNCH_HOLE).
 * - Handles (cuMemCreate) are opaque 64-bit ids (generation << 32 | slot+1)
 *   into a slot table. A released handle's memory is freed when its last
 *   mapping goes, as with the real driver.
 * - Reservations are PROT_NONE anonymous NORESERVE host mappings. cuMemMap
 *   maps the memfd range MAP_SHARED|MAP_FIXED with PROT_NONE; cuMemSetAccess
 *   mprotects it (for each mapping, the host protection is the access granted
 *   to the device that owns the mapped handle); cuMemUnmap puts the PROT_NONE
 *   reservation back. Data in a handle survives unmap + remap elsewhere.
 * - cuMemAlloc memory comes from the same memfd allocator, mapped read-write
 *   at a granularity-aligned address: where the last freed block or
 *   reservation was when it fits there (the real driver reuses a freed
 *   address at once), else a fresh one. cuMemAllocManaged is anonymous
 *   read-write memory of the current context, charged to no device: as on a
 *   Linux GPU with concurrent managed access, it may exceed device memory
 *   (the driver pages it in on use) up to host memory, FAKECUDA_HOST_MEMORY
 *   (default 4x the capacity) for all devices together.
 * - Streams: cuStreamCreate objects plus per-device pseudo streams for
 *   NULL/CU_STREAM_LEGACY and CU_STREAM_PER_THREAD. Work completes instantly
 *   unless a test holds the stream (fakecuda_stream_hold): then events
 *   recorded on it stay pending until fakecuda_stream_release. Synchronize
 *   calls that would block on held work wait up to FAKECUDA_SYNC_TIMEOUT_MS
 *   (default 10000) for a release and then abort the process with a message:
 *   waiting on held work is a bug in the code under test. A destroyed stream
 *   or event is kept as a tombstone and any later use of it aborts the
 *   process naming the call and the handle (undefined on the real driver).
 * - Fault injection: FAKECUDA_FAIL / fakecuda_set_fail ("cuMemCreate:3",
 *   "cuMemMap:*") make chosen calls return CUDA_ERROR_OUT_OF_MEMORY with no
 *   side effect. Call counters and live-object counters are kept per API.
 * - Other environment: FAKECUDA_NO_VMM=1 (VMM attribute 0, cuMemCreate and
 *   cuMemGetAllocationGranularity return CUDA_ERROR_NOT_SUPPORTED),
 *   FAKECUDA_NO_PEER=1 (cuDeviceCanAccessPeer reports 0), FAKECUDA_CONTEXT_MB
 *   (device memory an active primary context takes, as a real one takes
 *   hundreds of MiB: cuMemGetInfo's free and every allocation's room are
 *   less by it; fakecuda_used_bytes counts allocations only),
 *   FAKECUDA_VMM_CALL_US (each cuMemCreate, cuMemRelease, cuMemMap,
 *   cuMemUnmap and cuMemSetAccess sleeps that long: calls that are not
 *   free), FAKECUDA_SYNC_VMM=1 (cuMemUnmap and cuMemSetAccess first wait
 *   for all work of the current device, completing it, as synchronous
 *   calls do; on held work this waits, and aborts past the timeout).
 *
 * One global mutex (fc_mu) protects all state; fc_cv is signalled when held
 * work completes. Source files: fakecuda.c (configuration, counters, fault
 * injection, devices, contexts, errors, cuGetProcAddress, test control),
 * fakecuda_mem.c (memory), fakecuda_stream.c (streams and events).
 */
#include "fakecuda_internal.h"

#include <ctype.h>
#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

FC_HIDDEN struct fc_config fc_cfg;
FC_HIDDEN pthread_mutex_t fc_mu = PTHREAD_MUTEX_INITIALIZER;
FC_HIDDEN pthread_cond_t fc_cv;
FC_HIDDEN int fc_initialized;
FC_HIDDEN struct fc_device fc_dev[FC_MAX_DEVICES];
FC_HIDDEN struct fc_live_counts fc_live_n;
FC_HIDDEN struct fc_live_counts fc_reclaimed_n;
FC_HIDDEN uint64_t fc_managed_used;
FC_HIDDEN _Thread_local struct CUctx_st *fc_tls_ctx;

static pthread_once_t g_once = PTHREAD_ONCE_INIT;

static const char *const g_api_names[FC_API_COUNT] = {
#define FC_API_NAME(n) "cu" #n,
    FC_API_LIST(FC_API_NAME)
#undef FC_API_NAME
};

struct fc_fail_entry {
    int api;
    unsigned long n; /* 0 = every call */
};

static unsigned long g_calls[FC_API_COUNT];
static unsigned long g_fail_pos[FC_API_COUNT];
static struct fc_fail_entry *g_fail;
static size_t g_nfail;

void fc_die(const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    fputs("fakecuda: ", stderr);
    vfprintf(stderr, fmt, ap);
    fputc('\n', stderr);
    va_end(ap);
    fflush(stderr);
    abort();
}

void fc_lock(void) {
    if (pthread_mutex_lock(&fc_mu) != 0) fc_die("pthread_mutex_lock failed");
}

void fc_unlock(void) {
    pthread_mutex_unlock(&fc_mu);
}

/* ---- configuration ------------------------------------------------------ */

static uint64_t env_size(const char *name, uint64_t def) {
    const char *s = getenv(name);
    if (!s || !*s) return def;
    if (!isdigit((unsigned char)s[0]))
        fc_die("%s=%s: expected a number with K/M/G/T suffix", name, s);
    char *end;
    errno = 0;
    unsigned long long v = strtoull(s, &end, 10);
    unsigned shift = 0;
    switch (toupper((unsigned char)*end)) {
    case 'K':
        shift = 10;
        break;
    case 'M':
        shift = 20;
        break;
    case 'G':
        shift = 30;
        break;
    case 'T':
        shift = 40;
        break;
    case '\0':
        break;
    default:
        fc_die("%s=%s: bad suffix", name, s);
    }
    if (shift) end++;
    if (errno || *end || v > (UINT64_MAX >> shift)) fc_die("%s=%s: bad value", name, s);
    return (uint64_t)v << shift;
}

static long env_long(const char *name, long def, long min, long max) {
    const char *s = getenv(name);
    if (!s || !*s) return def;
    char *end;
    errno = 0;
    long v = strtol(s, &end, 10);
    if (errno || *end || v < min || v > max)
        fc_die("%s=%s: expected an integer in [%ld, %ld]", name, s, min, max);
    return v;
}

static int parse_fail_spec(const char *spec, struct fc_fail_entry **out, size_t *nout);

static void load_config(void) {
    fc_cfg.ndev = (int)env_long("FAKECUDA_DEVICES", 1, 0, FC_MAX_DEVICES);
    fc_cfg.gran = env_size("FAKECUDA_GRANULARITY", 2ull << 20);
    fc_cfg.rec_gran = env_size("FAKECUDA_RECOMMENDED_GRANULARITY", fc_cfg.gran);
    fc_cfg.capacity = env_size("FAKECUDA_CAPACITY", 80ull << 30);
    fc_cfg.host_memory = env_size("FAKECUDA_HOST_MEMORY", 4 * fc_cfg.capacity);
    fc_cfg.no_rdma = env_long("FAKECUDA_NO_RDMA", 0, 0, 1) != 0;
    fc_cfg.no_vmm = env_long("FAKECUDA_NO_VMM", 0, 0, 1) != 0;
    fc_cfg.no_peer = env_long("FAKECUDA_NO_PEER", 0, 0, 1) != 0;
    fc_cfg.sync_timeout_ms = env_long("FAKECUDA_SYNC_TIMEOUT_MS", 10000, 1, 86400000L);
    fc_cfg.event_lag = (unsigned)env_long("FAKECUDA_EVENT_LAG", 0, 0, 1000000L);
    fc_cfg.ctx_bytes = (uint64_t)env_long("FAKECUDA_CONTEXT_MB", 0, 0, 1L << 30) << 20;
    fc_cfg.vmm_call_us = env_long("FAKECUDA_VMM_CALL_US", 0, 0, 1000000L);
    fc_cfg.sync_vmm = env_long("FAKECUDA_SYNC_VMM", 0, 0, 1) != 0;
    if (fc_cfg.ctx_bytes > fc_cfg.capacity)
        fc_die("FAKECUDA_CONTEXT_MB: %llu MiB is more than the capacity",
               (unsigned long long)(fc_cfg.ctx_bytes >> 20));
    long page = sysconf(_SC_PAGESIZE);
    if (fc_cfg.gran < (uint64_t)page || (fc_cfg.gran & (fc_cfg.gran - 1)))
        fc_die("FAKECUDA_GRANULARITY=%llu: must be a power of two >= the page size (%ld)",
               (unsigned long long)fc_cfg.gran, page);
    if (fc_cfg.rec_gran < fc_cfg.gran || (fc_cfg.rec_gran & (fc_cfg.rec_gran - 1)))
        fc_die("FAKECUDA_RECOMMENDED_GRANULARITY=%llu: must be a power of two >= the "
               "granularity (%llu)",
               (unsigned long long)fc_cfg.rec_gran, (unsigned long long)fc_cfg.gran);
    /* Any size, as real devices report (an H200: 143771 MiB, a multiple of neither). */
    if (fc_cfg.capacity == 0) fc_die("FAKECUDA_CAPACITY=0: a device needs memory");
    const char *fail = getenv("FAKECUDA_FAIL");
    if (fail && *fail && parse_fail_spec(fail, &g_fail, &g_nfail) != 0)
        fc_die("FAKECUDA_FAIL=%s: bad spec (expected api:n or api:* separated by commas)", fail);

    pthread_condattr_t ca;
    if (pthread_condattr_init(&ca) != 0 || pthread_condattr_setclock(&ca, CLOCK_MONOTONIC) != 0 ||
        pthread_cond_init(&fc_cv, &ca) != 0)
        fc_die("cannot initialise the condition variable");
    pthread_condattr_destroy(&ca);
}

void fc_config_once(void) {
    pthread_once(&g_once, load_config);
}

/* ---- counters and fault injection -------------------------------------- */

/* Map "cuMemAlloc", "cuMemAlloc_v2", "cuStreamQuery_ptsz" to an API index. */
static int api_index(const char *name, size_t len) {
    static const char *const suffixes[] = {"_v2_ptds", "_v2_ptsz", "_ptds", "_ptsz", "_v2"};
    for (size_t i = 0; i < sizeof suffixes / sizeof suffixes[0]; i++) {
        size_t sl = strlen(suffixes[i]);
        if (len > sl && memcmp(name + len - sl, suffixes[i], sl) == 0) {
            len -= sl;
            break;
        }
    }
    for (int i = 0; i < FC_API_COUNT; i++)
        if (strlen(g_api_names[i]) == len && memcmp(g_api_names[i], name, len) == 0) return i;
    return -1;
}

static int parse_fail_spec(const char *spec, struct fc_fail_entry **out, size_t *nout) {
    *out = NULL;
    *nout = 0;
    if (!spec || !*spec) return 0;
    size_t cap = 1;
    for (const char *p = spec; *p; p++) cap += *p == ',';
    struct fc_fail_entry *v = calloc(cap, sizeof *v);
    if (!v) return -1;
    size_t n = 0;
    const char *p = spec;
    for (;;) {
        const char *comma = strchr(p, ',');
        size_t elen = comma ? (size_t)(comma - p) : strlen(p);
        const char *colon = memchr(p, ':', elen);
        if (!colon) goto bad;
        int api = api_index(p, (size_t)(colon - p));
        if (api < 0) goto bad;
        const char *num = colon + 1;
        size_t numlen = elen - (size_t)(num - p);
        if (numlen == 1 && num[0] == '*') {
            v[n].n = 0;
        } else {
            if (numlen == 0 || numlen > 18) goto bad;
            unsigned long x = 0;
            for (size_t i = 0; i < numlen; i++) {
                if (!isdigit((unsigned char)num[i])) goto bad;
                x = x * 10 + (unsigned long)(num[i] - '0');
            }
            if (x == 0) goto bad;
            v[n].n = x;
        }
        v[n++].api = api;
        if (!comma) break;
        p = comma + 1;
    }
    *out = v;
    *nout = n;
    return 0;
bad:
    free(v);
    return -1;
}

CUresult fc_enter(enum fc_api api, int need_init) {
    fc_config_once();
    fc_lock();
    g_calls[api]++;
    unsigned long pos = ++g_fail_pos[api];
    int fail = 0;
    for (size_t i = 0; i < g_nfail; i++)
        if (g_fail[i].api == (int)api && (g_fail[i].n == 0 || g_fail[i].n == pos)) fail = 1;
    int init = fc_initialized;
    fc_unlock();
    if (fail) return CUDA_ERROR_OUT_OF_MEMORY;
    if (need_init && !init) return CUDA_ERROR_NOT_INITIALIZED;
    return CUDA_SUCCESS;
}

/* ---- initialisation, devices, contexts ---------------------------------- */

CUresult fc_current_dev_locked(int *dev) {
    struct CUctx_st *c = fc_tls_ctx;
    if (!c || c->refcount <= 0) return CUDA_ERROR_INVALID_CONTEXT;
    *dev = c->dev;
    return CUDA_SUCCESS;
}

static int valid_dev(CUdevice dev) {
    return dev >= 0 && dev < fc_cfg.ndev;
}

CUresult cuInit(unsigned int Flags) {
    FC_ENTER_NOINIT(Init);
    if (Flags != 0) return CUDA_ERROR_INVALID_VALUE;
    CUresult rc = CUDA_SUCCESS;
    fc_lock();
    if (!fc_initialized) {
        if (fc_cfg.ndev == 0) {
            rc = CUDA_ERROR_NO_DEVICE;
        } else {
            for (int i = 0; i < fc_cfg.ndev; i++) {
                struct fc_device *d = &fc_dev[i];
                if (fc_mem_init_device(d) != 0)
                    fc_die("cannot create the memfd for device %d: %s", i, strerror(errno));
                d->ctx.dev = i;
                d->ctx.refcount = 0;
                d->ctx.stale = 0;
                fc_stream_init_device(d, i);
            }
            fc_initialized = 1;
        }
    }
    fc_unlock();
    return rc;
}

CUresult cuDriverGetVersion(int *driverVersion) {
    FC_ENTER_NOINIT(DriverGetVersion);
    if (!driverVersion) return CUDA_ERROR_INVALID_VALUE;
    *driverVersion = FC_DRIVER_VERSION;
    return CUDA_SUCCESS;
}

CUresult cuDeviceGet(CUdevice *device, int ordinal) {
    FC_ENTER(DeviceGet);
    if (!device) return CUDA_ERROR_INVALID_VALUE;
    if (!valid_dev(ordinal)) return CUDA_ERROR_INVALID_DEVICE;
    *device = ordinal;
    return CUDA_SUCCESS;
}

CUresult cuDeviceGetCount(int *count) {
    FC_ENTER(DeviceGetCount);
    if (!count) return CUDA_ERROR_INVALID_VALUE;
    *count = fc_cfg.ndev;
    return CUDA_SUCCESS;
}

CUresult cuDeviceGetName(char *name, int len, CUdevice dev) {
    FC_ENTER(DeviceGetName);
    if (!name || len <= 0) return CUDA_ERROR_INVALID_VALUE;
    if (!valid_dev(dev)) return CUDA_ERROR_INVALID_DEVICE;
    snprintf(name, (size_t)len, "cuma fake device %d", dev);
    return CUDA_SUCCESS;
}

static uint64_t mix64(uint64_t x) {
    x += 0x9e3779b97f4a7c15ull;
    x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
    x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
    return x ^ (x >> 31);
}

CUresult cuDeviceGetUuid_v2(CUuuid *uuid, CUdevice dev) {
    FC_ENTER(DeviceGetUuid);
    if (!uuid) return CUDA_ERROR_INVALID_VALUE;
    if (!valid_dev(dev)) return CUDA_ERROR_INVALID_DEVICE;
    /* Each process's fake device is its own memory, so its UUID names the process too: the
     * cross-process ledger counts processes with the same UUID as sharing one device. */
    uint64_t pid = (uint64_t)getpid();
    uint64_t w[2] = {mix64(0x63756d6166616b65ull ^ (uint64_t)dev ^ (pid << 32)),
                     mix64(0x6465766963650000ull + (uint64_t)dev + (pid << 8))};
    memcpy(uuid->bytes, w, sizeof uuid->bytes);
    return CUDA_SUCCESS;
}

CUresult cuDeviceGetAttribute(int *pi, CUdevice_attribute attrib, CUdevice dev) {
    FC_ENTER(DeviceGetAttribute);
    if (!pi || (int)attrib < 1 || attrib >= CU_DEVICE_ATTRIBUTE_MAX)
        return CUDA_ERROR_INVALID_VALUE;
    if (!valid_dev(dev)) return CUDA_ERROR_INVALID_DEVICE;
    int v = 0;
    switch (attrib) {
    case CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED:
        v = !fc_cfg.no_vmm;
        break;
    case CU_DEVICE_ATTRIBUTE_MANAGED_MEMORY:
        v = 1;
        break;
    case CU_DEVICE_ATTRIBUTE_UNIFIED_ADDRESSING:
        v = 1;
        break;
    case CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR:
        v = 9;
        break;
    case CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR:
        v = 0;
        break;
    case CU_DEVICE_ATTRIBUTE_PCI_BUS_ID:
        v = 0x10 + dev;
        break;
    case CU_DEVICE_ATTRIBUTE_PCI_DEVICE_ID:
        v = 0;
        break;
    case CU_DEVICE_ATTRIBUTE_PCI_DOMAIN_ID:
        v = 0;
        break;
    case CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT:
        v = 132;
        break;
    case CU_DEVICE_ATTRIBUTE_WARP_SIZE:
        v = 32;
        break;
    case CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_BLOCK:
        v = 1024;
        break;
    case CU_DEVICE_ATTRIBUTE_CAN_MAP_HOST_MEMORY:
        v = 1;
        break;
    case CU_DEVICE_ATTRIBUTE_CONCURRENT_MANAGED_ACCESS:
        v = 1;
        break;
    case CU_DEVICE_ATTRIBUTE_CONCURRENT_KERNELS:
        v = 1;
        break;
    case CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WITH_CUDA_VMM_SUPPORTED:
        v = !fc_cfg.no_vmm && !fc_cfg.no_rdma;
        break;
    case CU_DEVICE_ATTRIBUTE_ASYNC_ENGINE_COUNT:
        v = 2;
        break;
    default:
        v = 0;
        break;
    }
    *pi = v;
    return CUDA_SUCCESS;
}

CUresult cuDeviceTotalMem_v2(size_t *bytes, CUdevice dev) {
    FC_ENTER(DeviceTotalMem);
    if (!bytes) return CUDA_ERROR_INVALID_VALUE;
    if (!valid_dev(dev)) return CUDA_ERROR_INVALID_DEVICE;
    *bytes = (size_t)fc_cfg.capacity;
    return CUDA_SUCCESS;
}

CUresult cuDeviceCanAccessPeer(int *canAccessPeer, CUdevice dev, CUdevice peerDev) {
    FC_ENTER(DeviceCanAccessPeer);
    if (!canAccessPeer) return CUDA_ERROR_INVALID_VALUE;
    if (!valid_dev(dev) || !valid_dev(peerDev)) return CUDA_ERROR_INVALID_DEVICE;
    *canAccessPeer = dev != peerDev && !fc_cfg.no_peer;
    return CUDA_SUCCESS;
}

CUresult cuDevicePrimaryCtxRetain(CUcontext *pctx, CUdevice dev) {
    FC_ENTER(DevicePrimaryCtxRetain);
    if (!pctx) return CUDA_ERROR_INVALID_VALUE;
    if (!valid_dev(dev)) return CUDA_ERROR_INVALID_DEVICE;
    fc_lock();
    struct fc_device *d = &fc_dev[dev];
    /* An inactive context comes back with its own memory, which the device must have room for
     * (with the driver, the first CUDA call of a process on a full device fails this way). */
    if (d->ctx.refcount == 0 && fc_cfg.ctx_bytes > fc_cfg.capacity - d->used) {
        fc_unlock();
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    d->ctx.refcount++;
    *pctx = &d->ctx;
    fc_unlock();
    return CUDA_SUCCESS;
}

/* The last release makes the context inactive but, unlike the driver, keeps its memory: leak
 * checks made after it (a library that releases the context it retained) still see what was
 * left behind. cuDevicePrimaryCtxReset destroys it. */
CUresult cuDevicePrimaryCtxRelease_v2(CUdevice dev) {
    FC_ENTER(DevicePrimaryCtxRelease);
    if (!valid_dev(dev)) return CUDA_ERROR_INVALID_DEVICE;
    CUresult rc = CUDA_SUCCESS;
    fc_lock();
    struct CUctx_st *c = &fc_dev[dev].ctx;
    if (c->stale > 0)
        c->stale--;
    else if (c->refcount > 0)
        c->refcount--;
    else
        rc = CUDA_ERROR_INVALID_CONTEXT;
    fc_unlock();
    return rc;
}

/* The context's memory is destroyed (fc_mem_reset_device_locked) and the context becomes inactive
 * until the next retain, which gets the same handle (as the driver's does). The retains it had
 * are not released but dropped: their releases still succeed (`stale`). A thread's current
 * context stays set, and calls in it fail until someone retains the context again. Streams and
 * events are kept (a simplification: code under test must not rely on it). */
CUresult cuDevicePrimaryCtxReset_v2(CUdevice dev) {
    FC_ENTER(DevicePrimaryCtxReset);
    if (!valid_dev(dev)) return CUDA_ERROR_INVALID_DEVICE;
    fc_lock();
    fc_mem_reset_device_locked(dev);
    struct CUctx_st *c = &fc_dev[dev].ctx;
    c->stale += c->refcount;
    c->refcount = 0;
    fc_unlock();
    return CUDA_SUCCESS;
}

CUresult cuDevicePrimaryCtxGetState(CUdevice dev, unsigned int *flags, int *active) {
    FC_ENTER(DevicePrimaryCtxGetState);
    if (!flags || !active) return CUDA_ERROR_INVALID_VALUE;
    if (!valid_dev(dev)) return CUDA_ERROR_INVALID_DEVICE;
    fc_lock();
    *active = fc_dev[dev].ctx.refcount > 0;
    fc_unlock();
    *flags = 0;
    return CUDA_SUCCESS;
}

CUresult cuCtxSetCurrent(CUcontext ctx) {
    FC_ENTER(CtxSetCurrent);
    if (!ctx) {
        fc_tls_ctx = NULL;
        return CUDA_SUCCESS;
    }
    CUresult rc = CUDA_ERROR_INVALID_CONTEXT;
    fc_lock();
    for (int i = 0; i < fc_cfg.ndev; i++) {
        if (ctx == &fc_dev[i].ctx && ctx->refcount > 0) {
            fc_tls_ctx = ctx;
            rc = CUDA_SUCCESS;
        }
    }
    fc_unlock();
    return rc;
}

CUresult cuCtxGetCurrent(CUcontext *pctx) {
    FC_ENTER(CtxGetCurrent);
    if (!pctx) return CUDA_ERROR_INVALID_VALUE;
    *pctx = fc_tls_ctx;
    return CUDA_SUCCESS;
}

CUresult cuCtxGetDevice(CUdevice *device) {
    FC_ENTER(CtxGetDevice);
    if (!device) return CUDA_ERROR_INVALID_VALUE;
    int dev = 0;
    fc_lock();
    CUresult rc = fc_current_dev_locked(&dev);
    fc_unlock();
    if (rc == CUDA_SUCCESS) *device = dev;
    return rc;
}

/* ---- errors ------------------------------------------------------------- */

#define FC_ERRORS(X)                                                                               \
    X(CUDA_SUCCESS, "no error")                                                                    \
    X(CUDA_ERROR_INVALID_VALUE, "invalid argument")                                                \
    X(CUDA_ERROR_OUT_OF_MEMORY, "out of memory")                                                   \
    X(CUDA_ERROR_NOT_INITIALIZED, "initialization error (cuInit has not been called)")             \
    X(CUDA_ERROR_DEINITIALIZED, "driver shutting down")                                            \
    X(CUDA_ERROR_STUB_LIBRARY, "stub library loaded instead of the real driver")                   \
    X(CUDA_ERROR_NO_DEVICE, "no CUDA-capable device is detected")                                  \
    X(CUDA_ERROR_INVALID_DEVICE, "invalid device ordinal")                                         \
    X(CUDA_ERROR_INVALID_IMAGE, "device kernel image is invalid")                                  \
    X(CUDA_ERROR_INVALID_CONTEXT, "invalid device context")                                        \
    X(CUDA_ERROR_CONTEXT_ALREADY_CURRENT, "context already current")                               \
    X(CUDA_ERROR_MAP_FAILED, "mapping of buffer object failed")                                    \
    X(CUDA_ERROR_UNMAP_FAILED, "unmapping of buffer object failed")                                \
    X(CUDA_ERROR_ALREADY_MAPPED, "resource already mapped")                                        \
    X(CUDA_ERROR_NOT_MAPPED, "resource not mapped")                                                \
    X(CUDA_ERROR_PEER_ACCESS_UNSUPPORTED, "peer access is not supported between these devices")    \
    X(CUDA_ERROR_OPERATING_SYSTEM, "OS call failed or operation not supported on this OS")         \
    X(CUDA_ERROR_INVALID_HANDLE, "invalid resource handle")                                        \
    X(CUDA_ERROR_ILLEGAL_STATE, "the operation cannot be performed in the present state")          \
    X(CUDA_ERROR_NOT_FOUND, "named symbol not found")                                              \
    X(CUDA_ERROR_NOT_READY, "device not ready")                                                    \
    X(CUDA_ERROR_ILLEGAL_ADDRESS, "an illegal memory access was encountered")                      \
    X(CUDA_ERROR_LAUNCH_FAILED, "unspecified launch failure")                                      \
    X(CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED, "peer access is already enabled")                    \
    X(CUDA_ERROR_PEER_ACCESS_NOT_ENABLED, "peer access has not been enabled")                      \
    X(CUDA_ERROR_PRIMARY_CONTEXT_ACTIVE, "primary context active")                                 \
    X(CUDA_ERROR_CONTEXT_IS_DESTROYED, "context is destroyed")                                     \
    X(CUDA_ERROR_NOT_PERMITTED, "operation not permitted")                                         \
    X(CUDA_ERROR_NOT_SUPPORTED, "operation not supported")                                         \
    X(CUDA_ERROR_SYSTEM_NOT_READY, "system not yet initialized")                                   \
    X(CUDA_ERROR_SYSTEM_DRIVER_MISMATCH, "system has unsupported display driver / cuda driver "    \
                                         "combination")                                            \
    X(CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED, "operation not permitted when stream is capturing")   \
    X(CUDA_ERROR_STREAM_CAPTURE_INVALIDATED, "operation failed due to a previous error during "    \
                                             "capture")                                            \
    X(CUDA_ERROR_STREAM_CAPTURE_IMPLICIT, "operation would make the legacy stream depend on a "    \
                                          "capturing blocking stream")                             \
    X(CUDA_ERROR_STREAM_CAPTURE_WRONG_THREAD, "attempt to terminate a thread-local capture "       \
                                              "sequence from another thread")                      \
    X(CUDA_ERROR_CAPTURED_EVENT, "operation not permitted on an event last recorded in a "         \
                                 "capturing stream")                                               \
    X(CUDA_ERROR_TIMEOUT, "wait operation timed out")                                              \
    X(CUDA_ERROR_UNKNOWN, "unknown error")

static int error_lookup(CUresult error, const char **name, const char **str) {
    switch (error) {
#define FC_ERR_CASE(code, text)                                                                    \
    case code:                                                                                     \
        *name = #code;                                                                             \
        *str = text;                                                                               \
        return 0;
        FC_ERRORS(FC_ERR_CASE)
#undef FC_ERR_CASE
    default:
        return -1;
    }
}

CUresult cuGetErrorString(CUresult error, const char **pStr) {
    FC_ENTER_NOINIT(GetErrorString);
    if (!pStr) return CUDA_ERROR_INVALID_VALUE;
    const char *name, *str;
    if (error_lookup(error, &name, &str) != 0) {
        *pStr = NULL;
        return CUDA_ERROR_INVALID_VALUE;
    }
    *pStr = str;
    return CUDA_SUCCESS;
}

CUresult cuGetErrorName(CUresult error, const char **pStr) {
    FC_ENTER_NOINIT(GetErrorName);
    if (!pStr) return CUDA_ERROR_INVALID_VALUE;
    const char *name, *str;
    if (error_lookup(error, &name, &str) != 0) {
        *pStr = NULL;
        return CUDA_ERROR_INVALID_VALUE;
    }
    *pStr = name;
    return CUDA_SUCCESS;
}

/* ---- plain (unversioned) aliases whose signature equals the _v2 one ----- */
/* The other unversioned names (cuMemAlloc, cuMemGetInfo, ...) are legacy
 * 32-bit entry points with a different ABI in the real driver; they are
 * deliberately not exported, so code that dlsym()s them fails loudly. */

#undef cuStreamDestroy
#undef cuEventDestroy
#undef cuDevicePrimaryCtxRelease
#undef cuDevicePrimaryCtxReset
#undef cuDeviceGetUuid
FC_EXPORT CUresult cuStreamDestroy(CUstream hStream);
FC_EXPORT CUresult cuEventDestroy(CUevent hEvent);
FC_EXPORT CUresult cuDevicePrimaryCtxRelease(CUdevice dev);
FC_EXPORT CUresult cuDevicePrimaryCtxReset(CUdevice dev);
FC_EXPORT CUresult cuDeviceGetUuid(CUuuid *uuid, CUdevice dev);
CUresult cuStreamDestroy(CUstream hStream) {
    return cuStreamDestroy_v2(hStream);
}
CUresult cuEventDestroy(CUevent hEvent) {
    return cuEventDestroy_v2(hEvent);
}
CUresult cuDevicePrimaryCtxRelease(CUdevice dev) {
    return cuDevicePrimaryCtxRelease_v2(dev);
}
CUresult cuDevicePrimaryCtxReset(CUdevice dev) {
    return cuDevicePrimaryCtxReset_v2(dev);
}
CUresult cuDeviceGetUuid(CUuuid *uuid, CUdevice dev) {
    return cuDeviceGetUuid_v2(uuid, dev);
}

/* ---- cuGetProcAddress ---------------------------------------------------- */

struct fc_proc {
    const char *name;
    void *fn;     /* current (_v2 where one exists) entry point */
    int since;    /* CUDA version that introduced fn */
    void *old_fn; /* ABI-compatible older entry point, or NULL */
    int old_since;
};

#define P(name, fn, since)                                                                         \
    { name, (void *)(fn), since, NULL, 0 }
#define P2(name, fn, since, old, old_since)                                                        \
    { name, (void *)(fn), since, (void *)(old), old_since }
static const struct fc_proc g_procs[] = {
    P("cuInit", cuInit, 2000),
    P("cuDriverGetVersion", cuDriverGetVersion, 2020),
    P("cuDeviceGet", cuDeviceGet, 2000),
    P("cuDeviceGetCount", cuDeviceGetCount, 2000),
    P("cuDeviceGetName", cuDeviceGetName, 2000),
    P2("cuDeviceGetUuid", cuDeviceGetUuid_v2, 11040, cuDeviceGetUuid, 9020),
    P("cuDeviceGetAttribute", cuDeviceGetAttribute, 2000),
    P("cuDeviceTotalMem", cuDeviceTotalMem_v2, 3020),
    P("cuDeviceCanAccessPeer", cuDeviceCanAccessPeer, 4000),
    P("cuDevicePrimaryCtxRetain", cuDevicePrimaryCtxRetain, 7000),
    P2("cuDevicePrimaryCtxRelease", cuDevicePrimaryCtxRelease_v2, 11000, cuDevicePrimaryCtxRelease,
       7000),
    P("cuDevicePrimaryCtxGetState", cuDevicePrimaryCtxGetState, 7000),
    P2("cuDevicePrimaryCtxReset", cuDevicePrimaryCtxReset_v2, 11000, cuDevicePrimaryCtxReset, 7000),
    P("cuCtxSetCurrent", cuCtxSetCurrent, 4000),
    P("cuCtxGetCurrent", cuCtxGetCurrent, 4000),
    P("cuCtxGetDevice", cuCtxGetDevice, 2000),
    P("cuCtxSynchronize", cuCtxSynchronize, 2000),
    P("cuMemGetInfo", cuMemGetInfo_v2, 3020),
    P("cuMemAlloc", cuMemAlloc_v2, 3020),
    P("cuMemFree", cuMemFree_v2, 3020),
    P("cuMemAllocPitch", cuMemAllocPitch_v2, 3020),
    P("cuMemAllocAsync", cuMemAllocAsync, 11020),
    P("cuMemFreeAsync", cuMemFreeAsync, 11020),
    P("cuMemAllocManaged", cuMemAllocManaged, 6000),
    P("cuMemAddressReserve", cuMemAddressReserve, 10020),
    P("cuMemAddressFree", cuMemAddressFree, 10020),
    P("cuMemCreate", cuMemCreate, 10020),
    P("cuMemRelease", cuMemRelease, 10020),
    P("cuMemMap", cuMemMap, 10020),
    P("cuMemUnmap", cuMemUnmap, 10020),
    P("cuMemSetAccess", cuMemSetAccess, 10020),
    P("cuMemGetAllocationGranularity", cuMemGetAllocationGranularity, 10020),
    P("cuStreamCreate", cuStreamCreate, 2000),
    P2("cuStreamDestroy", cuStreamDestroy_v2, 4000, cuStreamDestroy, 2000),
    P("cuStreamSynchronize", cuStreamSynchronize, 2000),
    P("cuStreamQuery", cuStreamQuery, 2000),
    P("cuStreamGetCtx", cuStreamGetCtx, 9020),
    P("cuStreamWaitEvent", cuStreamWaitEvent, 3020),
    P("cuEventCreate", cuEventCreate, 2000),
    P2("cuEventDestroy", cuEventDestroy_v2, 4000, cuEventDestroy, 2000),
    P("cuEventRecord", cuEventRecord, 2000),
    P("cuEventQuery", cuEventQuery, 2000),
    P("cuEventSynchronize", cuEventSynchronize, 2000),
    P("cuStreamBeginCapture", cuStreamBeginCapture_v2, 10010),
    P("cuStreamEndCapture", cuStreamEndCapture, 10000),
    P("cuStreamIsCapturing", cuStreamIsCapturing, 10000),
    P("cuThreadExchangeStreamCaptureMode", cuThreadExchangeStreamCaptureMode, 10010),
    P("cuMemsetD8", cuMemsetD8_v2, 3020),
    P("cuMemcpyHtoD", cuMemcpyHtoD_v2, 3020),
    P("cuMemcpyDtoH", cuMemcpyDtoH_v2, 3020),
    P("cuGetErrorString", cuGetErrorString, 6000),
    P("cuGetErrorName", cuGetErrorName, 6000),
    P("cuGetProcAddress", cuGetProcAddress_v2, 12000),
};
#undef P
#undef P2

/* Works before cuInit, like the real driver (the runtime fetches cuInit
 * itself through it). Not-found symbols give CUDA_SUCCESS with *pfn = NULL. */
/* FAKECUDA_PROC_TOOL=1: cuGetProcAddress("cuMemAlloc") hands out a wrapper of the fake's own, as
 * a profiler or an injection library that wraps the driver's entry points does. */
static CUresult tool_mem_alloc(CUdeviceptr *dptr, size_t bytesize) {
    return cuMemAlloc_v2(dptr, bytesize);
}

CUresult cuGetProcAddress_v2(const char *symbol, void **pfn, int cudaVersion, cuuint64_t flags,
                             CUdriverProcAddressQueryResult *symbolStatus) {
    FC_ENTER_NOINIT(GetProcAddress);
    if (!symbol || !pfn || cudaVersion > FC_DRIVER_VERSION ||
        (flags & ~(cuuint64_t)(CU_GET_PROC_ADDRESS_LEGACY_STREAM |
                               CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM)))
        return CUDA_ERROR_INVALID_VALUE;
    CUdriverProcAddressQueryResult st = CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND;
    *pfn = NULL;
    for (size_t i = 0; i < sizeof g_procs / sizeof g_procs[0]; i++) {
        const struct fc_proc *p = &g_procs[i];
        if (strcmp(p->name, symbol) != 0) continue;
        if (cudaVersion >= p->since) {
            *pfn = p->fn;
        } else if (p->old_fn && cudaVersion >= p->old_since) {
            *pfn = p->old_fn;
        }
        st = *pfn ? CU_GET_PROC_ADDRESS_SUCCESS : CU_GET_PROC_ADDRESS_VERSION_NOT_SUFFICIENT;
        break;
    }
    const char *tool = getenv("FAKECUDA_PROC_TOOL");
    if (*pfn == (void *)cuMemAlloc_v2 && tool && !strcmp(tool, "1")) {
        CUresult (*w)(CUdeviceptr *, size_t) = tool_mem_alloc;
        memcpy(pfn, &w, sizeof *pfn);
    }
    if (symbolStatus) *symbolStatus = st;
    return CUDA_SUCCESS;
}

/* ---- test-control API ---------------------------------------------------- */

int fakecuda_set_fail(const char *spec) {
    fc_config_once();
    struct fc_fail_entry *v;
    size_t n;
    if (parse_fail_spec(spec, &v, &n) != 0) return -1;
    fc_lock();
    struct fc_fail_entry *old = g_fail;
    g_fail = v;
    g_nfail = n;
    memset(g_fail_pos, 0, sizeof g_fail_pos);
    fc_unlock();
    free(old);
    return 0;
}

unsigned long fakecuda_calls(const char *api) {
    fc_config_once();
    int i = api ? api_index(api, strlen(api)) : -1;
    if (i < 0) fc_die("fakecuda_calls: unknown API name \"%s\"", api ? api : "(null)");
    fc_lock();
    unsigned long n = g_calls[i];
    fc_unlock();
    return n;
}

void fakecuda_reset_counters(void) {
    fc_config_once();
    fc_lock();
    memset(g_calls, 0, sizeof g_calls);
    fc_unlock();
}

/* One kind's figure in a set of counts; `api` names the caller in the message for a bad kind. */
static long count_of(const struct fc_live_counts *counts, const char *kind, const char *api) {
    fc_config_once();
    static const struct {
        const char *name;
        size_t off;
    } kinds[] = {
        {"handles", offsetof(struct fc_live_counts, handles)},
        {"mappings", offsetof(struct fc_live_counts, mappings)},
        {"reservations", offsetof(struct fc_live_counts, reservations)},
        {"allocs", offsetof(struct fc_live_counts, allocs)},
        {"managed", offsetof(struct fc_live_counts, managed)},
        {"streams", offsetof(struct fc_live_counts, streams)},
        {"events", offsetof(struct fc_live_counts, events)},
        {"rdma_handles", offsetof(struct fc_live_counts, rdma_handles)},
    };
    for (size_t i = 0; kind && i < sizeof kinds / sizeof kinds[0]; i++) {
        if (strcmp(kinds[i].name, kind) != 0) continue;
        long v;
        fc_lock();
        memcpy(&v, (const char *)counts + kinds[i].off, sizeof v);
        fc_unlock();
        return v;
    }
    fc_die("%s: unknown kind \"%s\"", api, kind ? kind : "(null)");
}

long fakecuda_live(const char *kind) {
    return count_of(&fc_live_n, kind, "fakecuda_live");
}

long fakecuda_reclaimed(const char *kind) {
    return count_of(&fc_reclaimed_n, kind, "fakecuda_reclaimed");
}

size_t fakecuda_managed_bytes(void) {
    fc_config_once();
    fc_lock();
    size_t v = (size_t)fc_managed_used;
    fc_unlock();
    return v;
}

size_t fakecuda_used_bytes(int device) {
    fc_config_once();
    if (device < 0 || device >= fc_cfg.ndev)
        fc_die("fakecuda_used_bytes: no device %d (FAKECUDA_DEVICES=%d)", device, fc_cfg.ndev);
    fc_lock();
    size_t v = (size_t)fc_dev[device].used;
    fc_unlock();
    return v;
}
