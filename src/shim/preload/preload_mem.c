// SPDX-License-Identifier: Apache-2.0
/* The interposed allocation entry points: which calls go to cuma, and how.
 *
 * A call goes to cuma when the shim routes (CUMA_PRELOAD is not off, CUMA_CONF is valid and
 * names no simulated device) and the context it allocates in is the primary context of its
 * device. cuma's CUDA backend maps its pages in the device's primary context (the one the
 * CUDA runtime uses), so memory it hands out is valid in that context and in every context
 * that shares it. A context the program created itself (cuCtxCreate) has its own address space
 * rules and lifetime, which cuma does not follow: its calls go to the driver unchanged.
 *
 * Everything else passes through unchanged: frees of pointers no heap handed out (memory from
 * before the shim routed, from another context, from cuMemAllocManaged), and every call when
 * the shim does not route. A setting that is wrong never breaks the program: it is reported once
 * on stderr and the driver serves everything.
 *
 * Thread safety: every entry point may be called from any thread at any time. The per-device
 * table below is written with release stores and read with acquire loads; heap creation is
 * serialised by cuma_default_heap. A heap is used only under a pin of its device
 * (preload_pin.c), so that a reset of the device (preload_ctx.c) can destroy it once nobody does.
 */
#include "preload.h"

#include "settings/config.h"
#include "cuma/cuma.h"
#include "shim/default_heap.h"

#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

/* cudaMallocPitch's row alignment on current GPUs; a multiple of every texture pitch alignment
 * NVIDIA devices report (32 to 512). */
#define PITCH_ALIGN 512

/* ---- whether the shim routes ----------------------------------------------------------------- */

enum { ROUTING_UNDECIDED, ROUTING_ON, ROUTING_OFF };

static _Atomic int routing = ROUTING_UNDECIDED; /* set once by decide_routing */
static void after_fork_child(void);
static pthread_once_t routing_once = PTHREAD_ONCE_INIT;
/* CUMA_CONF parsed, for the limit a device reports before its heap exists. Written by
 * decide_routing before `routing` is published, constant afterwards. */
static cuma_settings conf;

static bool word_in(const char *v, const char *const *words) {
    for (; *words; words++)
        if (!strcasecmp(v, *words)) return true;
    return false;
}

static void decide_routing(void) {
    static const char *const off[] = {"off", "0", "false", "no", NULL};
    static const char *const on[] = {"on", "1", "true", "yes", NULL};
    int r = ROUTING_ON;
    const char *v = getenv("CUMA_PRELOAD");
    if (v && *v && word_in(v, off)) {
        r = ROUTING_OFF;
    } else if (v && *v && !word_in(v, on)) {
        cuma_preload_report("CUMA_PRELOAD=%s is neither on nor off; cuma is off in this process "
                            "and every allocation goes to the CUDA driver",
                            v);
        r = ROUTING_OFF;
    } else {
        const char *env = getenv("CUMA_CONF");
        cuma_settings_default(&conf);
        /* The check is the one every heap makes, so a string that passes here creates heaps. */
        if (env && cuma_config_check(env) != CUMA_OK) {
            cuma_preload_report("CUMA_CONF: %s; cuma is off in this process and every allocation "
                                "goes to the CUDA driver",
                                cuma_last_error());
            r = ROUTING_OFF;
        } else if (env && cuma_settings_parse(&conf, env, "CUMA_CONF") == CUMA_OK &&
                   conf.backend_named && !strcmp(conf.backend, "sim")) {
            cuma_preload_report("CUMA_CONF: backend:sim is the simulated device, which a CUDA "
                                "program cannot use; cuma is off in this process and every "
                                "allocation goes to the CUDA driver");
            r = ROUTING_OFF;
        }
    }
    atomic_store_explicit(&routing, r, memory_order_release);
    pthread_atfork(NULL, NULL, after_fork_child);
}

bool cuma_preload_routing(void) {
    int r = atomic_load_explicit(&routing, memory_order_acquire);
    if (r == ROUTING_UNDECIDED) {
        pthread_once(&routing_once, decide_routing);
        r = atomic_load_explicit(&routing, memory_order_acquire);
    }
    return r == ROUTING_ON;
}

/* ---- the heap of a context ------------------------------------------------------------------- */

enum { DEV_UNTRIED, DEV_READY, DEV_FAILED, DEV_RETIRING };

/* One per device ordinal. state: UNTRIED (no heap: the next allocation in the device's primary
 * context adopts one), READY (heap and primary set), FAILED (final: the driver serves the
 * device), RETIRING (a reset is destroying the heap; calls go to the driver until it is over,
 * then UNTRIED). Transitions: UNTRIED -> READY or FAILED (adoption, compare-and-swap), UNTRIED
 * or READY -> RETIRING -> UNTRIED (retirement, one at a time: preload_ctx.c).
 *
 * Invariants: while state == READY, heap and primary are set and do not change (cuma's heap
 * holds a retain on the primary context, so the handle stays that device's primary context).
 * heap is dereferenced only by a thread that pinned the device before it read state as READY
 * (pin_heap), and a retirement waits for the device's pins after it leaves READY, so a heap is
 * never destroyed under a call that uses it. Writers store heap, then primary, then state, with
 * release; readers load state with acquire first. */
typedef struct preload_dev {
    _Atomic(cuma_heap *) heap;
    _Atomic(CUcontext) primary;
    _Atomic int state;
} preload_dev;

static preload_dev devs[CUMA_MAX_DEFAULT_HEAPS];
/* 1 + the highest ordinal that was ever READY or about to be (only grows; raised before the
 * device's state turns READY): the scans stop there. */
static _Atomic int ndevs;

/* A forked child. CUDA does not work in a child of a process that had initialised it: if the
 * parent used the shim's heaps (any device past UNTRIED), the child's calls go to the driver,
 * which refuses them as it would without the shim, and nothing of the parent's heaps (whose
 * memory is the parent's) is touched. A parent that never allocated leaves its children free to
 * use CUDA, and cuma, afresh. Either way the parent's other threads' pins and locks are gone. */
static void after_fork_child(void) {
    bool used = atomic_load_explicit(&ndevs, memory_order_relaxed) > 0;
    for (int d = 0; d < CUMA_MAX_DEFAULT_HEAPS && !used; d++)
        used = atomic_load_explicit(&devs[d].state, memory_order_relaxed) != DEV_UNTRIED;
    if (used) atomic_store_explicit(&routing, ROUTING_OFF, memory_order_relaxed);
    cuma_preload_pins_after_fork();
    cuma_preload_owned_after_fork();
    cuma_preload_ctx_after_fork();
}

/* Device i's heap if it is READY; the caller holds a pin of i (or uses only the pointer). */
static cuma_heap *ready_heap(int i) {
    if (atomic_load_explicit(&devs[i].state, memory_order_acquire) != DEV_READY) return NULL;
    return atomic_load_explicit(&devs[i].heap, memory_order_relaxed);
}

/* Pins dev and returns its heap, pinned; NULL, with no pin held, when it has none. */
static cuma_heap *pin_heap(int dev, cuma_preload_pin *pin) {
    cuma_preload_pin_take(pin, dev);
    cuma_heap *h = ready_heap(dev);
    if (!h) cuma_preload_pin_drop(pin);
    return h;
}

/* The heap whose device's primary context is ctx, among the devices already routed, pinned;
 * NULL (nothing pinned) if there is none. The scan compares handles and reads no heap. */
static cuma_heap *pin_known_ctx(CUcontext ctx, cuma_preload_pin *pin) {
    int n = atomic_load_explicit(&ndevs, memory_order_acquire);
    for (int i = 0; i < n; i++) {
        if (!ready_heap(i) || atomic_load_explicit(&devs[i].primary, memory_order_relaxed) != ctx)
            continue;
        cuma_heap *h = pin_heap(i, pin);
        /* Retired and adopted again since the scan read it: still right if ctx is its context. */
        if (h && atomic_load_explicit(&devs[i].primary, memory_order_relaxed) != ctx) {
            cuma_preload_pin_drop(pin);
            h = NULL;
        }
        return h;
    }
    return NULL;
}

bool cuma_preload_has_heap(int dev) {
    return dev >= 0 && dev < CUMA_MAX_DEFAULT_HEAPS && ready_heap(dev) != NULL;
}

static void fail_device(int dev, const char *why) {
    int expect = DEV_UNTRIED;
    if (atomic_compare_exchange_strong(&devs[dev].state, &expect, DEV_FAILED))
        cuma_preload_report("device %d: %s; its allocations go to the CUDA driver", dev, why);
}

/* Whether h's memory is device memory: the stats name the backend. */
static bool is_cuda_heap(cuma_heap *h) {
    char small[2048], *buf = small;
    size_t needed = 0;
    if (cuma_stats_json(h, small, sizeof small, &needed) != CUMA_OK) {
        if (needed < sizeof small || !(buf = malloc(needed + 1))) return false;
        if (cuma_stats_json(h, buf, needed + 1, &needed) != CUMA_OK) {
            free(buf);
            return false;
        }
    }
    const char *b = strstr(buf, "\"backend\":\"");
    bool cuda = false;
    if (b) {
        b += strlen("\"backend\":\"");
        cuda =
            !strncmp(b, "vmm\"", 4) || !strncmp(b, "segment\"", 8) || !strncmp(b, "managed\"", 8);
    }
    if (buf != small) free(buf);
    return cuda;
}

/* Creates (or finds) the default heap of dev, whose primary context is ctx and is retained by
 * the caller, and publishes it; returns it pinned, or NULL with nothing pinned. The pin is taken
 * before the state is read, so a reset that starts meanwhile waits for this call, finds the heap
 * made here unpublished (the state is no longer UNTRIED) and destroys it. */
static cuma_heap *adopt(int dev, CUcontext ctx, cuma_preload_pin *pin) {
    /* Not under the pin: a reset that waits for it may hold glibc's loader lock (a library
     * constructor), which dlopen of the driver waits for. */
    cuma_default_heap_load_driver();
    cuma_preload_pin_take(pin, dev);
    cuma_heap *h = NULL;
    if (atomic_load_explicit(&devs[dev].state, memory_order_acquire) != DEV_UNTRIED) {
        /* Another thread adopted it (READY, checked below), or a reset is under way. */
    } else if (cuma_default_heap(dev, &h) != CUMA_OK) {
        char why[512];
        snprintf(why, sizeof why, "cuma cannot serve it: %s", cuma_last_error());
        fail_device(dev, why);
    } else if (!is_cuda_heap(h)) {
        /* With backend_fallback:sim the default heap is on the simulated device where cuma
         * finds no driver; its addresses are host memory that a kernel would fault on. */
        fail_device(dev, "cuma's heap for it is not on the CUDA driver (no driver found?)");
    } else {
        atomic_store_explicit(&devs[dev].heap, h, memory_order_release);
        atomic_store_explicit(&devs[dev].primary, ctx, memory_order_release);
        /* The scans' bound first, then READY: a thread whose scan missed the device and then
         * sees it READY scans again and finds it (heap_of_current). Before, such a thread's
         * allocation went to the driver, outside the limit and the stats. */
        int n = atomic_load_explicit(&ndevs, memory_order_relaxed);
        while (n < dev + 1 &&
               !atomic_compare_exchange_weak_explicit(&ndevs, &n, dev + 1, memory_order_release,
                                                      memory_order_relaxed)) {
        }
        int expect = DEV_UNTRIED;
        atomic_compare_exchange_strong(&devs[dev].state, &expect, DEV_READY);
    }
    h = ready_heap(dev);
    if (h && atomic_load_explicit(&devs[dev].primary, memory_order_relaxed) != ctx) h = NULL;
    if (!h) cuma_preload_pin_drop(pin);
    return h;
}

/* The heap for an allocation in the current context cur (not NULL), pinned, creating the
 * device's heap on first use; NULL when cur is not its device's primary context or the device
 * passes. */
static cuma_heap *heap_of_current(const cuma_preload_driver *d, CUcontext cur,
                                  cuma_preload_pin *pin) {
    cuma_heap *h = pin_known_ctx(cur, pin);
    if (h) return h;
    CUdevice dev;
    if (!d->CtxGetDevice || d->CtxGetDevice(&dev) != CUDA_SUCCESS) return NULL;
    if (dev < 0 || dev >= CUMA_MAX_DEFAULT_HEAPS) return NULL;
    /* READY since the scan above read its bound (another thread adopted the device meanwhile;
     * adopt raises the bound before READY, so a second scan finds it); a routed device whose
     * primary context is not cur: the program's own context. */
    int state = atomic_load_explicit(&devs[dev].state, memory_order_acquire);
    if (state == DEV_READY) return pin_known_ctx(cur, pin);
    if (state != DEV_UNTRIED) return NULL;
    /* An inactive primary context cannot be current; retaining it would create one (device
     * memory, hundreds of MiB on a real GPU) only to find that out. */
    unsigned flags;
    int active = 1;
    if (d->DevicePrimaryCtxGetState && d->DevicePrimaryCtxGetState(dev, &flags, &active) == 0 &&
        !active)
        return NULL;
    CUcontext primary = NULL;
    if (!d->DevicePrimaryCtxRetain || !d->DevicePrimaryCtxRelease ||
        d->DevicePrimaryCtxRetain(&primary, dev) != CUDA_SUCCESS)
        return NULL;
    if (primary == cur) h = adopt(dev, primary, pin);
    d->DevicePrimaryCtxRelease(dev); /* the heap holds its own retain */
    return h;
}

/* The heap for a call in the current context, pinned; NULL: pass the call to the driver. */
static cuma_heap *current_heap(const cuma_preload_driver *d, cuma_preload_pin *pin) {
    CUcontext cur = NULL;
    if (!d->CtxGetCurrent || d->CtxGetCurrent(&cur) != CUDA_SUCCESS || !cur) return NULL;
    return heap_of_current(d, cur, pin);
}

/* The heap for a stream-ordered call on stream s, pinned: the stream's context decides (a stream
 * may belong to another device than the current context's). */
static cuma_heap *stream_heap(const cuma_preload_driver *d, CUstream s, cuma_preload_pin *pin) {
    CUcontext cur = NULL;
    if (!d->CtxGetCurrent || d->CtxGetCurrent(&cur) != CUDA_SUCCESS) return NULL;
    if (s && s != CU_STREAM_LEGACY && s != CU_STREAM_PER_THREAD && d->StreamGetCtx) {
        CUcontext sc = NULL;
        if (d->StreamGetCtx(s, &sc) != CUDA_SUCCESS) return NULL; /* the driver reports it */
        if (sc != cur) return pin_known_ctx(sc, pin);
    }
    return cur ? heap_of_current(d, cur, pin) : NULL;
}

/* ---- retiring a device's heap --------------------------------------------------------------- */

bool cuma_preload_retire_begin(int dev) {
    if (dev < 0 || dev >= CUMA_MAX_DEFAULT_HEAPS) return false;
    int s = atomic_load_explicit(&devs[dev].state, memory_order_acquire);
    do {
        if (s != DEV_READY && s != DEV_UNTRIED) return false; /* FAILED: the driver's device */
    } while (!atomic_compare_exchange_weak(&devs[dev].state, &s, DEV_RETIRING));
    /* No call that starts now uses the heap; those under way finish first. An UNTRIED device is
     * retired too: an adoption may be under way, or a default heap of it made by another entry
     * point (the PyTorch hooks, the Python package). */
    cuma_preload_pins_wait(dev);
    cuma_default_heap_retire(dev);
    cuma_preload_owned_forget(dev);
    return true;
}

void cuma_preload_retire_end(int dev) {
    atomic_store_explicit(&devs[dev].heap, NULL, memory_order_relaxed);
    atomic_store_explicit(&devs[dev].primary, NULL, memory_order_relaxed);
    atomic_store_explicit(&devs[dev].state, DEV_UNTRIED, memory_order_release);
}

/* ---- statuses ------------------------------------------------------------------------------- */

static CUresult to_cu(cuma_status st) {
    switch (st) {
    case CUMA_OK:
        return CUDA_SUCCESS;
    case CUMA_ERR_OOM:
    case CUMA_ERR_LIMIT:
        return CUDA_ERROR_OUT_OF_MEMORY;
    case CUMA_ERR_INVALID:
    case CUMA_ERR_BAD_POINTER:
    case CUMA_ERR_CONFIG:
    case CUMA_ERR_PARSE:
        return CUDA_ERROR_INVALID_VALUE;
    case CUMA_ERR_NO_DEVICE:
        return CUDA_ERROR_NO_DEVICE;
    case CUMA_ERR_UNSUPPORTED:
        return CUDA_ERROR_NOT_SUPPORTED;
    case CUMA_ERR_IO:
        return CUDA_ERROR_OPERATING_SYSTEM;
    case CUMA_ERR_BACKEND:
    case CUMA_ERR_CORRUPT:
        break;
    }
    return CUDA_ERROR_UNKNOWN;
}

/* A failure the program sees only as a CUresult: the first one that is not out-of-memory (which
 * programs expect and handle) is reported with cuma's message, so that it can be diagnosed. */
static _Atomic bool failure_reported;

static CUresult failed(const char *call, cuma_status st) {
    if (st != CUMA_ERR_OOM && st != CUMA_ERR_LIMIT &&
        !atomic_exchange_explicit(&failure_reported, true, memory_order_relaxed))
        cuma_preload_report("%s: %s (reported once)", call, cuma_last_error());
    return to_cu(st);
}

/* ---- allocation --------------------------------------------------------------------------- */

/* Forwards to a driver function the driver may lack. */
#define FORWARD(d, field, ...) ((d)->field ? (d)->field(__VA_ARGS__) : CUDA_ERROR_NOT_FOUND)

static CUresult alloc_in(cuma_heap *h, const char *call, CUdeviceptr *dptr, size_t size,
                         CUstream stream) {
    void *p = NULL;
    cuma_status st = cuma_alloc(h, size, (cuma_stream)stream, &p);
    if (st != CUMA_OK) return failed(call, st);
    *dptr = (CUdeviceptr)(uintptr_t)p;
    return CUDA_SUCCESS;
}

CUMA_PRELOAD_EXPORT CUresult CUDAAPI cuMemAlloc_v2(CUdeviceptr *dptr, size_t bytesize) {
    const cuma_preload_driver *d = cuma_preload_driver_get();
    cuma_heap *h;
    cuma_preload_pin pin;
    /* Bad arguments get the driver's own answer. */
    if (!dptr || !bytesize || !cuma_preload_routing() || !(h = current_heap(d, &pin)))
        return FORWARD(d, MemAlloc, dptr, bytesize);
    CUresult r = alloc_in(h, "cuMemAlloc", dptr, bytesize, NULL);
    cuma_preload_pin_drop(&pin);
    return r;
}

CUMA_PRELOAD_EXPORT CUresult CUDAAPI cuMemAllocPitch_v2(CUdeviceptr *dptr, size_t *pPitch,
                                                        size_t WidthInBytes, size_t Height,
                                                        unsigned int ElementSizeBytes) {
    const cuma_preload_driver *d = cuma_preload_driver_get();
    bool valid = dptr && pPitch && WidthInBytes && Height &&
                 (ElementSizeBytes == 4 || ElementSizeBytes == 8 || ElementSizeBytes == 16) &&
                 WidthInBytes <= SIZE_MAX - PITCH_ALIGN;
    size_t pitch = valid ? (WidthInBytes + PITCH_ALIGN - 1) / PITCH_ALIGN * PITCH_ALIGN : 0;
    cuma_heap *h;
    cuma_preload_pin pin;
    if (!valid || Height > SIZE_MAX / pitch || !cuma_preload_routing() ||
        !(h = current_heap(d, &pin)))
        return FORWARD(d, MemAllocPitch, dptr, pPitch, WidthInBytes, Height, ElementSizeBytes);
    CUdeviceptr p = 0;
    CUresult r = alloc_in(h, "cuMemAllocPitch", &p, pitch * Height, NULL);
    if (r == CUDA_SUCCESS && p % PITCH_ALIGN) {
        /* cuma aligns to 512-byte granules, so this does not happen; if a policy ever changes
         * that, the driver serves the rows it must align. */
        cuma_free(h, (void *)(uintptr_t)p, NULL);
        cuma_preload_pin_drop(&pin);
        return FORWARD(d, MemAllocPitch, dptr, pPitch, WidthInBytes, Height, ElementSizeBytes);
    }
    cuma_preload_pin_drop(&pin);
    if (r != CUDA_SUCCESS) return r;
    *dptr = p;
    *pPitch = pitch;
    return CUDA_SUCCESS;
}

static CUresult alloc_async(CUdeviceptr *dptr, size_t size, CUstream stream, bool ptsz) {
    const cuma_preload_driver *d = cuma_preload_driver_get();
    /* The per-thread flavour's NULL stream is the calling thread's default stream. */
    CUstream s = ptsz && !stream ? CU_STREAM_PER_THREAD : stream;
    cuma_heap *h;
    cuma_preload_pin pin;
    if (!dptr || !size || !cuma_preload_routing() || !(h = stream_heap(d, s, &pin)))
        return ptsz ? FORWARD(d, MemAllocAsyncPtsz, dptr, size, stream)
                    : FORWARD(d, MemAllocAsync, dptr, size, stream);
    CUresult r = alloc_in(h, "cuMemAllocAsync", dptr, size, s);
    cuma_preload_pin_drop(&pin);
    return r;
}

CUMA_PRELOAD_EXPORT CUresult CUDAAPI cuMemAllocAsync(CUdeviceptr *dptr, size_t bytesize,
                                                     CUstream hStream) {
    return alloc_async(dptr, bytesize, hStream, false);
}

CUMA_PRELOAD_EXPORT CUresult CUDAAPI cuMemAllocAsync_ptsz(CUdeviceptr *dptr, size_t bytesize,
                                                          CUstream hStream) {
    return alloc_async(dptr, bytesize, hStream, true);
}

/* ---- free ---------------------------------------------------------------------------------- */

/* Frees p if cuma's: true with *out set when a heap took it or it lies in cuma's memory (a
 * double free: never shown to the driver, which could free a whole segment under cuma). false:
 * not cuma's, the driver's to free. owner: the device whose range holds p (-1: unknown), asked
 * first; the others only if it refuses (a range of unknown device), so that a free on device 7
 * does not ask seven heaps (and format seven refusals) first. */
static bool free_in_cuma(CUdeviceptr p, int owner, CUstream stream, bool device_wide,
                         const char *call, CUresult *out) {
    if (!p || !cuma_preload_routing()) return false;
    int n = atomic_load_explicit(&ndevs, memory_order_acquire);
    for (int k = -1; k < n; k++) {
        int i = k < 0 ? owner : k;
        if (i < 0 || i >= n || (k >= 0 && k == owner)) continue;
        cuma_preload_pin pin;
        cuma_heap *h = pin_heap(i, &pin);
        if (!h) continue;
        cuma_status st = device_wide ? cuma_free_device_wide(h, (void *)(uintptr_t)p)
                                     : cuma_free(h, (void *)(uintptr_t)p, (cuma_stream)stream);
        cuma_preload_pin_drop(&pin);
        if (st == CUMA_ERR_BAD_POINTER) continue; /* another heap's, or nobody's: unchanged */
        *out = st == CUMA_OK ? CUDA_SUCCESS : failed(call, st);
        return true;
    }
    if (!cuma_preload_owned(p, NULL)) return false;
    *out = CUDA_ERROR_INVALID_VALUE;
    return true;
}

/* A free of dptr on stream s (NULL: the block's allocation stream), cuma's if it is cuma's
 * memory; false when it is the driver's to free. Nothing waits here, on a per-thread default
 * stream either: every thread's is the one handle CU_STREAM_PER_THREAD, but the heap keys it by
 * the calling thread (place/streams.c), so the block waits for the right thread's work. */
static bool free_routed(CUdeviceptr dptr, CUstream s, const char *call, CUresult *out) {
    int owner;
    if (!dptr || !cuma_preload_routing() || !cuma_preload_owned(dptr, &owner)) return false;
    return free_in_cuma(dptr, owner, s, false, call, out);
}

/* cuMemFree: the driver's waits for the device, so a program may free memory that any thread
 * used on any stream, and use what the next cuMemAlloc returns on any stream. The block waits, in
 * the heap, for its allocation stream and for the legacy stream's work issued so far, which
 * waits for every blocking stream (every thread's per-thread stream among them), and nobody
 * reuses it before (cuma_free_device_wide): not even the legacy stream, since the next
 * cuMemAlloc's memory may be used on another stream, unordered after the old work. */
static bool free_device_wide(CUdeviceptr dptr, CUresult *out) {
    int owner;
    if (!dptr || !cuma_preload_routing() || !cuma_preload_owned(dptr, &owner)) return false;
    return free_in_cuma(dptr, owner, NULL, true, "cuMemFree", out);
}

CUMA_PRELOAD_EXPORT CUresult CUDAAPI cuMemFree_v2(CUdeviceptr dptr) {
    const cuma_preload_driver *d = cuma_preload_driver_get();
    CUresult r;
    if (free_device_wide(dptr, &r)) return r;
    return FORWARD(d, MemFree, dptr);
}

CUMA_PRELOAD_EXPORT CUresult CUDAAPI cuMemFreeAsync(CUdeviceptr dptr, CUstream hStream) {
    const cuma_preload_driver *d = cuma_preload_driver_get();
    CUresult r;
    /* cuma's NULL means "the allocation's stream"; the driver's NULL is the legacy stream. */
    if (free_routed(dptr, hStream ? hStream : CU_STREAM_LEGACY, "cuMemFreeAsync", &r)) return r;
    return FORWARD(d, MemFreeAsync, dptr, hStream);
}

CUMA_PRELOAD_EXPORT CUresult CUDAAPI cuMemFreeAsync_ptsz(CUdeviceptr dptr, CUstream hStream) {
    const cuma_preload_driver *d = cuma_preload_driver_get();
    CUresult r;
    if (free_routed(dptr, hStream ? hStream : CU_STREAM_PER_THREAD, "cuMemFreeAsync", &r)) return r;
    return FORWARD(d, MemFreeAsyncPtsz, dptr, hStream);
}

/* ---- streams that die ---------------------------------------------------------------------- */

/* cuma records its fences lazily, and keeps a slot per stream: a stream the program destroys is
 * retired first, while the handle is valid (cuma_stream_retire: one last fence, and the slot free
 * for the next stream once that is done). Then the driver destroys it. Every device's heap is
 * asked, not only the stream's own: a block of device 0 freed on a stream of device 1
 * (cudaFreeAsync takes any stream) gave device 0's heap a slot for that stream, which would
 * otherwise outlive the handle, and a later stream given the same handle value would inherit its
 * fences. A heap that never saw the stream has nothing to retire. The pseudo streams go straight
 * to the driver. */
static CUresult destroy_stream(CUresult(CUDAAPI *real)(CUstream), CUstream s) {
    if (!real) return CUDA_ERROR_NOT_FOUND;
    if (s && s != CU_STREAM_LEGACY && s != CU_STREAM_PER_THREAD && cuma_preload_routing()) {
        int n = atomic_load_explicit(&ndevs, memory_order_acquire);
        for (int i = 0; i < n; i++) {
            cuma_preload_pin pin;
            cuma_heap *h = pin_heap(i, &pin);
            if (!h) continue;
            cuma_status st = cuma_stream_retire(h, s);
            cuma_preload_pin_drop(&pin);
            if (st != CUMA_OK) failed("cuStreamDestroy", st); /* reported; the stream still goes */
        }
    }
    return real(s);
}

CUMA_PRELOAD_EXPORT CUresult CUDAAPI cuStreamDestroy_v2(CUstream hStream) {
    return destroy_stream(cuma_preload_driver_get()->StreamDestroy, hStream);
}

CUMA_PRELOAD_EXPORT CUresult CUDAAPI cuStreamDestroy(CUstream hStream) {
    return destroy_stream(cuma_preload_driver_get()->StreamDestroyV1, hStream);
}

/* ---- what the program is told about memory ------------------------------------------------- */

/* The limit CUMA_CONF sets for a device of `capacity` bytes, as the heap computes it
 * (cuma_arena_refresh_limit in src/heap/heap_life.c), for a device whose heap does not exist
 * yet: creating one would retain its primary context, which a query must not do. */
static uint64_t configured_limit(uint64_t capacity) {
    uint64_t lim = capacity;
    /* Managed memory takes any limit the user sets, past the device (oversubscription is what
     * it is for); the backend does not exist yet, so its setting tells. */
    bool over = !strcmp(conf.backend, "managed");
    if (conf.limit != CUMA_UNLIMITED && (over || conf.limit < lim)) lim = conf.limit;
    if (conf.memory_fraction > 0) {
        uint64_t f = (uint64_t)(conf.memory_fraction * (double)capacity);
        if (f < lim) lim = f;
    }
    if (!conf.growth && conf.preallocate < lim) lim = conf.preallocate;
    return lim;
}

/* total = the heap's limit. free = the limit less the memory under live allocations, and no
 * more than the heap could still get: what the device has free plus what the heap holds that no
 * live allocation uses (its idle pages or segments, the unused tails of mapped pages). With
 * exact counters the memory under live allocations is reserved - cached (the mapped pages); the
 * smaller of that and allocated_bytes also counts free space that a segment has not merged yet
 * (segment mode) and the free part of partly used pages as free, since the heap serves new
 * requests from it. Clamped to [0, total]: a lowered limit below what is held gives 0, never a
 * wrapped value. */
CUMA_PRELOAD_EXPORT CUresult CUDAAPI cuMemGetInfo_v2(size_t *free, size_t *total) {
    const cuma_preload_driver *d = cuma_preload_driver_get();
    cuma_heap *h;
    cuma_preload_pin pin;
    cuma_stats s;
    if (!free || !total || !cuma_preload_routing() || !(h = current_heap(d, &pin)))
        return FORWARD(d, MemGetInfo, free, total);
    /* Blocks cuMemFree left waiting for the device's work count as in use until a poll sees that
     * work done (the release thread's, unless it is off): the program that asks after freeing
     * wants today's answer. */
    cuma_status st = cuma_poll(h);
    if (st == CUMA_OK) st = cuma_get_stats(h, &s);
    cuma_preload_pin_drop(&pin);
    if (st != CUMA_OK) return FORWARD(d, MemGetInfo, free, total);
    uint64_t mapped =
        s.reserved_bytes - (s.cached_bytes < s.reserved_bytes ? s.cached_bytes : s.reserved_bytes);
    uint64_t in_use = s.allocated_bytes < mapped ? s.allocated_bytes : mapped;
    uint64_t f = s.limit_bytes > in_use ? s.limit_bytes - in_use : 0;
    if (s.device_total_bytes) {
        uint64_t can_get = s.device_free_bytes + (s.reserved_bytes - in_use);
        if (can_get < f) f = can_get;
    }
    /* Other jobs' unused guarantees, and memory jobs of higher priority wait for, are not the
     * driver's business but are not this program's to take either. */
    if (s.ledger_room_bytes != UINT64_MAX) {
        uint64_t can_get = s.ledger_room_bytes + (s.reserved_bytes - in_use);
        if (can_get < f) f = can_get;
    }
    *free = (size_t)f;
    *total = (size_t)s.limit_bytes;
    return CUDA_SUCCESS;
}

CUMA_PRELOAD_EXPORT CUresult CUDAAPI cuDeviceTotalMem_v2(size_t *bytes, CUdevice dev) {
    const cuma_preload_driver *d = cuma_preload_driver_get();
    CUresult r = FORWARD(d, DeviceTotalMem, bytes, dev);
    if (r != CUDA_SUCCESS || !cuma_preload_routing() || dev < 0 || dev >= CUMA_MAX_DEFAULT_HEAPS)
        return r;
    cuma_preload_pin pin;
    cuma_heap *h = pin_heap(dev, &pin);
    if (h) {
        cuma_stats s;
        if (cuma_get_stats(h, &s) == CUMA_OK) *bytes = (size_t)s.limit_bytes;
        cuma_preload_pin_drop(&pin);
    } else if (atomic_load_explicit(&devs[dev].state, memory_order_acquire) != DEV_FAILED) {
        /* No heap yet, or one being retired: the next one gets CUMA_CONF's limit. */
        *bytes = (size_t)configured_limit(*bytes);
    }
    return CUDA_SUCCESS;
}
