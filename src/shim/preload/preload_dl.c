// SPDX-License-Identifier: Apache-2.0
/* How calls reach the shim: the real driver, dlsym, cuGetProcAddress.
 *
 * A program linked against libcuda calls the driver through the dynamic linker, so LD_PRELOAD
 * alone puts the shim's cuMemAlloc_v2 first. The CUDA runtime does not: it dlopens libcuda.so.1,
 * takes cuGetProcAddress from the handle with dlsym (a lookup on a handle ignores LD_PRELOAD)
 * and fetches every other entry point through it. So the shim also interposes dlsym (a lookup
 * that would return one of the driver's functions the shim replaces returns the shim's) and
 * cuGetProcAddress (same, by name and version), and the runtime ends up calling the shim.
 *
 * cuma itself runs inside the shim and opens the same driver with dlopen + dlsym: its lookups
 * must get the real functions, or its segment backend's cuMemAlloc would call the shim's. A
 * lookup whose caller lies in the shim's own file gets the real function, or, for the calls
 * that take device memory from the driver, a wrapper that records the memory (the owned table
 * below), so that a free the heaps refuse can be told apart from a driver allocation.
 */
#include "preload.h"

#include "util/lockrank.h"
#include "util/strbuf.h"

#include <assert.h>
#include <dlfcn.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* cuda.h renames cuGetProcAddress to cuGetProcAddress_v2; the shim defines both ABIs. */
#undef cuGetProcAddress
CUMA_PRELOAD_EXPORT CUresult CUDAAPI cuGetProcAddress(const char *symbol, void **pfn,
                                                      int cudaVersion, cuuint64_t flags);

void cuma_preload_report(const char *fmt, ...) {
    char line[768];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(line, sizeof line, fmt, ap);
    va_end(ap);
    /* One fprintf, so that lines from threads reporting at once do not interleave; a setting
     * or a name quoted in the line reaches the terminal escaped. */
    char shown[4 * sizeof line];
    fprintf(stderr, "cuma preload: %s\n", cuma_escape(line, shown, sizeof shown));
}

/* Pointers to functions and to objects have one representation on every platform that has
 * dlsym (POSIX requires it); memcpy says so without a cast the compiler may warn about. */
static void *fn_to_ptr(const void *fn_field) {
    void *p;
    memcpy(&p, fn_field, sizeof p);
    return p;
}

/* ---- the real dlsym ------------------------------------------------------------------------ */

typedef void *(*dlsym_fn)(void *, const char *);

/* glibc's dlsym; written once (every thread computes the same value), read lock-free. */
static _Atomic(dlsym_fn) real_dlsym_ptr;

/* dlsym runs before sanitizer runtimes are ready (AddressSanitizer looks up its interceptors'
 * targets with dlsym(RTLD_NEXT, ...) while it initialises): the functions on that path must
 * not touch shadow memory. */
#define NO_SANITIZE                                                                                \
    __attribute__((no_sanitize("address"))) __attribute__((no_sanitize("undefined")))

NO_SANITIZE __attribute__((noinline)) static dlsym_fn real_dlsym_slow(void) {
    /* dlvsym is not interposed, so this cannot recurse. 2.34 moved dlsym into libc; the older
     * versions are the first ones of x86-64, AArch64 and i386. */
    static const char *const versions[] = {"GLIBC_2.34", "GLIBC_2.2.5", "GLIBC_2.17", "GLIBC_2.0"};
    void *p = NULL;
    for (size_t i = 0; !p && i < sizeof versions / sizeof versions[0]; i++)
        p = dlvsym(RTLD_NEXT, "dlsym", versions[i]);
    if (!p) {
        /* Without the real dlsym no program that looks up a symbol can run; saying so beats a
         * crash at an unrelated address. */
        fputs("cuma preload: cannot find the C library's dlsym (not glibc?); remove "
              "libcuma_preload.so from LD_PRELOAD\n",
              stderr);
        abort();
    }
    dlsym_fn f = (dlsym_fn)p; /* POSIX: a dlsym result converts to a function pointer */
    atomic_store_explicit(&real_dlsym_ptr, f, memory_order_release);
    return f;
}

NO_SANITIZE static inline dlsym_fn real_dlsym(void) {
    dlsym_fn f = atomic_load_explicit(&real_dlsym_ptr, memory_order_acquire);
    return f ? f : real_dlsym_slow();
}

/* ---- the real driver ----------------------------------------------------------------------- */

/* The driver's table, published once (compare-and-swap) and constant afterwards. No lock is
 * held while dlopen runs: glibc holds its loader lock while a library's constructors run, and a
 * constructor that calls the driver would wait for our lock while our dlopen waited for the
 * loader's (a deadlock; a pthread_once here had one). Threads that race each open the driver;
 * the first to finish is published, the others close their handle. */
static _Atomic(cuma_preload_driver *) drv_pub;
/* What a call gets while its own thread opens the driver (the driver's constructors may call
 * dlsym): no functions yet. */
static const cuma_preload_driver drv_none;
static _Thread_local bool drv_loading;

static void load_driver(cuma_preload_driver *drv) {
    drv_loading = true;
    /* secure_getenv, as cuma's backend: a set-user-ID program must not load a library named by
     * its caller. The same rule makes the shim and the backend open the same file. */
    const char *path = secure_getenv("CUMA_CUDA_LIBRARY");
    if (!path || !*path) path = "libcuda.so.1";
    void *h = dlopen(path, RTLD_NOW | RTLD_LOCAL);
    if (h) {
        dlsym_fn look = real_dlsym();
#define CUMA_PRELOAD_RESOLVE(field, sym, params)                                                   \
    {                                                                                              \
        void *p_ = look(h, #sym);                                                                  \
        memcpy(&drv->field, &p_, sizeof p_);                                                       \
    }
        CUMA_PRELOAD_REAL(CUMA_PRELOAD_RESOLVE)
#undef CUMA_PRELOAD_RESOLVE
        void *p = look(h, "cuGetProcAddress");
        memcpy(&drv->GetProcAddressV1, &p, sizeof p);
        drv->handle = h;
    }
    drv_loading = false;
}

const cuma_preload_driver *cuma_preload_driver_get(void) {
    cuma_preload_driver *d = atomic_load_explicit(&drv_pub, memory_order_acquire);
    if (d) return d;
    if (drv_loading) return &drv_none;
    cuma_preload_driver *mine = calloc(1, sizeof *mine);
    if (!mine)
        return &drv_none; /* everything answers CUDA_ERROR_NOT_FOUND; the next call retries */
    load_driver(mine);
    cuma_preload_driver *expect = NULL;
    if (atomic_compare_exchange_strong_explicit(&drv_pub, &expect, mine, memory_order_acq_rel,
                                                memory_order_acquire))
        return mine;
    if (mine->handle) dlclose(mine->handle);
    free(mine);
    return expect;
}

/* ---- device memory cuma's backend took from the driver -------------------------------------- */

typedef struct owned_range {
    CUdeviceptr base;
    size_t size;
    int dev;    /* the device whose context cuma took it in; -1: unknown, never forgotten */
    bool dying; /* cuma is freeing it: the driver may already hand its addresses out again */
} owned_range;

/* Invariant: owned[0..nowned) is sorted by base (equal bases: in the order added), and the
 * ranges that are not dying do not overlap (the driver never hands out one address twice at a
 * time). A dying range is one cuma's backend is giving back: marked before the driver's free,
 * removed after it, because between the two the driver may give the same addresses to another
 * thread's allocation, whose range must not be the one removed (that made a later free of it
 * reach the driver, which freed a segment under cuma). ndying counts them; while it is nonzero
 * a lookup scans every range. All five guarded by owned_lock. */
static pthread_mutex_t owned_lock = PTHREAD_MUTEX_INITIALIZER;
static owned_range *owned;
static size_t nowned, capowned, ndying;

#ifndef NDEBUG
static void owned_validate(void) {
    size_t dying = 0;
    CUdeviceptr live_end = 0;
    for (size_t i = 0; i < nowned; i++) {
        assert(i == 0 || owned[i - 1].base <= owned[i].base);
        if (owned[i].dying) {
            dying++;
            continue;
        }
        assert(owned[i].base >= live_end);
        live_end = owned[i].base + owned[i].size;
    }
    assert(dying == ndying);
}
#else
static void owned_validate(void) {}
#endif

/* The index of the first range whose base is > addr. owned_lock held. */
static size_t owned_upper(CUdeviceptr addr) {
    size_t lo = 0, hi = nowned;
    while (lo < hi) {
        size_t mid = lo + (hi - lo) / 2;
        if (owned[mid].base <= addr)
            lo = mid + 1;
        else
            hi = mid;
    }
    return lo;
}

/* The range of base `base` that is (dying) or is not (!dying) being freed; SIZE_MAX: none.
 * owned_lock held. */
static size_t owned_find(CUdeviceptr base, bool dying) {
    for (size_t i = owned_upper(base); i > 0 && owned[i - 1].base == base; i--)
        if (owned[i - 1].dying == dying) return i - 1;
    return SIZE_MAX;
}

static void owned_add(CUdeviceptr base, size_t size, int dev) {
    cuma_mutex_lock(&owned_lock, CUMA_RANK_PRELOAD_OWNED);
    if (nowned == capowned) {
        size_t nc = capowned ? capowned * 2 : 16;
        owned_range *n = realloc(owned, nc * sizeof *n);
        if (!n) {
            /* Without host memory the range goes unrecorded: a double free in it would then
             * reach the driver, which refuses addresses it did not cuMemAlloc. */
            cuma_mutex_unlock(&owned_lock);
            return;
        }
        owned = n, capowned = nc;
    }
    size_t i = owned_upper(base);
    memmove(&owned[i + 1], &owned[i], (nowned - i) * sizeof *owned);
    owned[i] = (owned_range){base, size, dev, false};
    nowned++;
    owned_validate();
    cuma_mutex_unlock(&owned_lock);
}

/* Marks the range at base dying before the driver frees it; false when none is known. */
static bool owned_dying(CUdeviceptr base) {
    cuma_mutex_lock(&owned_lock, CUMA_RANK_PRELOAD_OWNED);
    size_t i = owned_find(base, false);
    if (i != SIZE_MAX) owned[i].dying = true, ndying++;
    owned_validate();
    cuma_mutex_unlock(&owned_lock);
    return i != SIZE_MAX;
}

/* After the driver's answer to the free of a range marked dying: gone (freed) or live again. */
static void owned_settle(CUdeviceptr base, bool freed) {
    cuma_mutex_lock(&owned_lock, CUMA_RANK_PRELOAD_OWNED);
    size_t i = owned_find(base, true);
    if (i != SIZE_MAX) {
        ndying--;
        if (freed) {
            memmove(&owned[i], &owned[i + 1], (nowned - i - 1) * sizeof *owned);
            nowned--;
        } else {
            owned[i].dying = false;
        }
    }
    owned_validate();
    cuma_mutex_unlock(&owned_lock);
}

void cuma_preload_owned_after_fork(void) {
    pthread_mutex_t fresh = PTHREAD_MUTEX_INITIALIZER;
    memcpy(&owned_lock, &fresh, sizeof fresh);
}

void cuma_preload_owned_forget(int dev) {
    cuma_mutex_lock(&owned_lock, CUMA_RANK_PRELOAD_OWNED);
    size_t kept = 0;
    for (size_t i = 0; i < nowned; i++) {
        if (owned[i].dev != dev)
            owned[kept++] = owned[i];
        else if (owned[i].dying)
            ndying--;
    }
    nowned = kept;
    owned_validate();
    cuma_mutex_unlock(&owned_lock);
}

bool cuma_preload_owned(CUdeviceptr addr, int *dev) {
    cuma_mutex_lock(&owned_lock, CUMA_RANK_PRELOAD_OWNED);
    size_t i = owned_upper(addr);
    bool in = i > 0 && addr - owned[i - 1].base < owned[i - 1].size;
    int d = in ? owned[i - 1].dev : -1;
    /* While a range is being freed, one below the nearest may still hold addr, and a live
     * range holding it names the device better than a dying one. */
    for (size_t k = 0; ndying && k < i && !(in && !owned[i - 1].dying); k++) {
        if (addr - owned[k].base >= owned[k].size) continue;
        if (!in || !owned[k].dying) d = owned[k].dev;
        in = true;
        if (!owned[k].dying) break;
    }
    if (dev) *dev = d;
    cuma_mutex_unlock(&owned_lock);
    return in;
}

/* The device of the current context: cuma's backend makes its device's primary context current
 * for every call it makes (src/backend/cuda_internal.h), so this is the device the memory is
 * for. -1 when the driver cannot say. */
static int current_device(const cuma_preload_driver *d) {
    CUdevice dev;
    return d->CtxGetDevice && d->CtxGetDevice(&dev) == CUDA_SUCCESS ? (int)dev : -1;
}

static CUresult CUDAAPI track_reserve(CUdeviceptr *ptr, size_t size, size_t align, CUdeviceptr addr,
                                      unsigned long long flags) {
    const cuma_preload_driver *d = cuma_preload_driver_get();
    if (!d->MemAddressReserve) return CUDA_ERROR_NOT_FOUND;
    CUresult r = d->MemAddressReserve(ptr, size, align, addr, flags);
    if (r == CUDA_SUCCESS) owned_add(*ptr, size, current_device(d));
    return r;
}

static CUresult CUDAAPI track_address_free(CUdeviceptr ptr, size_t size) {
    const cuma_preload_driver *d = cuma_preload_driver_get();
    if (!d->MemAddressFree) return CUDA_ERROR_NOT_FOUND;
    bool known = owned_dying(ptr);
    CUresult r = d->MemAddressFree(ptr, size);
    if (known) owned_settle(ptr, r == CUDA_SUCCESS);
    return r;
}

static CUresult CUDAAPI track_alloc(CUdeviceptr *dptr, size_t size) {
    const cuma_preload_driver *d = cuma_preload_driver_get();
    if (!d->MemAlloc) return CUDA_ERROR_NOT_FOUND;
    CUresult r = d->MemAlloc(dptr, size);
    if (r == CUDA_SUCCESS) owned_add(*dptr, size, current_device(d));
    return r;
}

static CUresult CUDAAPI track_alloc_managed(CUdeviceptr *dptr, size_t size, unsigned int flags) {
    const cuma_preload_driver *d = cuma_preload_driver_get();
    if (!d->MemAllocManaged) return CUDA_ERROR_NOT_FOUND;
    CUresult r = d->MemAllocManaged(dptr, size, flags);
    if (r == CUDA_SUCCESS) owned_add(*dptr, size, current_device(d));
    return r;
}

static CUresult CUDAAPI track_free(CUdeviceptr dptr) {
    const cuma_preload_driver *d = cuma_preload_driver_get();
    if (!d->MemFree) return CUDA_ERROR_NOT_FOUND;
    bool known = owned_dying(dptr);
    CUresult r = d->MemFree(dptr);
    if (known) owned_settle(dptr, r == CUDA_SUCCESS);
    return r;
}

void *cuma_preload_tracked(const char *name) {
    void *p = NULL;
    if (!strcmp(name, "cuMemAddressReserve")) {
        cuma_pl_MemAddressReserve_fn f = track_reserve;
        memcpy(&p, &f, sizeof p);
    } else if (!strcmp(name, "cuMemAddressFree")) {
        cuma_pl_MemAddressFree_fn f = track_address_free;
        memcpy(&p, &f, sizeof p);
    } else if (!strcmp(name, "cuMemAlloc_v2")) {
        cuma_pl_MemAlloc_fn f = track_alloc;
        memcpy(&p, &f, sizeof p);
    } else if (!strcmp(name, "cuMemAllocManaged")) {
        cuma_pl_MemAllocManaged_fn f = track_alloc_managed;
        memcpy(&p, &f, sizeof p);
    } else if (!strcmp(name, "cuMemFree_v2")) {
        cuma_pl_MemFree_fn f = track_free;
        memcpy(&p, &f, sizeof p);
    }
    return p;
}

/* ---- the entry points the shim replaces ------------------------------------------------------ */

/* What dlsym and cuGetProcAddress hand out instead of the driver's function. `sym` is the
 * exported name; `base`, `since` and `ptsz` say which cuGetProcAddress requests it answers:
 * base name, the CUDA version that introduced this ABI, and the per-thread-default-stream
 * flavour. `real` is the offset of the driver's function in cuma_preload_driver. */
typedef struct export_entry {
    const char *sym;
    const char *base;
    int since, until; /* cuGetProcAddress versions [since, until) get this one; until 0: any */
    bool ptsz;
    size_t real;
    void *(*mine)(void);
} export_entry;

/* The shim's own entry points as data pointers; the typed assignment checks each definition
 * against the driver's prototype. */
#define MINE(name, type, fn)                                                                       \
    static void *mine_##name(void) {                                                               \
        type f_ = fn;                                                                              \
        return fn_to_ptr(&f_);                                                                     \
    }
MINE(alloc, cuma_pl_MemAlloc_fn, cuMemAlloc_v2)
MINE(free, cuma_pl_MemFree_fn, cuMemFree_v2)
MINE(pitch, cuma_pl_MemAllocPitch_fn, cuMemAllocPitch_v2)
MINE(alloc_async, cuma_pl_MemAllocAsync_fn, cuMemAllocAsync)
MINE(alloc_async_ptsz, cuma_pl_MemAllocAsyncPtsz_fn, cuMemAllocAsync_ptsz)
MINE(free_async, cuma_pl_MemFreeAsync_fn, cuMemFreeAsync)
MINE(free_async_ptsz, cuma_pl_MemFreeAsyncPtsz_fn, cuMemFreeAsync_ptsz)
MINE(info, cuma_pl_MemGetInfo_fn, cuMemGetInfo_v2)
MINE(total, cuma_pl_DeviceTotalMem_fn, cuDeviceTotalMem_v2)
MINE(gpa2, cuma_pl_GetProcAddressV2_fn, cuGetProcAddress_v2)
MINE(gpa1, cuma_preload_gpa1_fn, cuGetProcAddress)
MINE(reset, cuma_pl_DevicePrimaryCtxReset_fn, cuDevicePrimaryCtxReset_v2)
MINE(reset1, cuma_pl_DevicePrimaryCtxResetV1_fn, cuDevicePrimaryCtxReset)
MINE(release, cuma_pl_DevicePrimaryCtxRelease_fn, cuDevicePrimaryCtxRelease_v2)
MINE(release1, cuma_pl_DevicePrimaryCtxReleaseV1_fn, cuDevicePrimaryCtxRelease)
MINE(sdestroy, cuma_pl_StreamDestroy_fn, cuStreamDestroy_v2)
MINE(sdestroy1, cuma_pl_StreamDestroyV1_fn, cuStreamDestroy)
#undef MINE

#define OFF(field) offsetof(cuma_preload_driver, field)
static const export_entry exports[] = {
    {"cuMemAlloc_v2", "cuMemAlloc", 3020, 0, false, OFF(MemAlloc), mine_alloc},
    {"cuMemFree_v2", "cuMemFree", 3020, 0, false, OFF(MemFree), mine_free},
    {"cuMemAllocPitch_v2", "cuMemAllocPitch", 3020, 0, false, OFF(MemAllocPitch), mine_pitch},
    {"cuMemAllocAsync", "cuMemAllocAsync", 11020, 0, false, OFF(MemAllocAsync), mine_alloc_async},
    {"cuMemAllocAsync_ptsz", "cuMemAllocAsync", 11020, 0, true, OFF(MemAllocAsyncPtsz),
     mine_alloc_async_ptsz},
    {"cuMemFreeAsync", "cuMemFreeAsync", 11020, 0, false, OFF(MemFreeAsync), mine_free_async},
    {"cuMemFreeAsync_ptsz", "cuMemFreeAsync", 11020, 0, true, OFF(MemFreeAsyncPtsz),
     mine_free_async_ptsz},
    {"cuMemGetInfo_v2", "cuMemGetInfo", 3020, 0, false, OFF(MemGetInfo), mine_info},
    {"cuDeviceTotalMem_v2", "cuDeviceTotalMem", 3020, 0, false, OFF(DeviceTotalMem), mine_total},
    {"cuGetProcAddress_v2", "cuGetProcAddress", 12000, 0, false, OFF(GetProcAddressV2), mine_gpa2},
    {"cuGetProcAddress", "cuGetProcAddress", 11030, 12000, false, OFF(GetProcAddressV1), mine_gpa1},
    /* The _v2 ABI of the context calls came with CUDA 11.0; the unversioned one serves older
     * requests (same arguments, the driver's older rules about the context's users). */
    {"cuDevicePrimaryCtxReset_v2", "cuDevicePrimaryCtxReset", 11000, 0, false,
     OFF(DevicePrimaryCtxReset), mine_reset},
    {"cuDevicePrimaryCtxReset", "cuDevicePrimaryCtxReset", 7000, 11000, false,
     OFF(DevicePrimaryCtxResetV1), mine_reset1},
    {"cuDevicePrimaryCtxRelease_v2", "cuDevicePrimaryCtxRelease", 11000, 0, false,
     OFF(DevicePrimaryCtxRelease), mine_release},
    {"cuDevicePrimaryCtxRelease", "cuDevicePrimaryCtxRelease", 7000, 11000, false,
     OFF(DevicePrimaryCtxReleaseV1), mine_release1},
    /* A stream's destruction retires it in cuma first (preload_mem.c). */
    {"cuStreamDestroy_v2", "cuStreamDestroy", 4000, 0, false, OFF(StreamDestroy), mine_sdestroy},
    {"cuStreamDestroy", "cuStreamDestroy", 2000, 4000, false, OFF(StreamDestroyV1), mine_sdestroy1},
};
#undef OFF

static void *real_of(const cuma_preload_driver *d, const export_entry *e) {
    return fn_to_ptr((const char *)d + e->real);
}

/* The shim's function for a cuGetProcAddress request the driver answered with `found`. Only a
 * request for an ABI the shim implements is answered with the shim's: an old cudaVersion asks
 * for the legacy 32-bit cuMemAlloc, which stays the driver's. */
static void substitute(const char *symbol, void **pfn, int version, cuuint64_t flags) {
    if (!symbol || !pfn || !*pfn || !cuma_preload_routing()) return;
    bool ptsz = (flags & CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM) != 0;
    const export_entry *pick = NULL;
    /* Only an answer that is one of the driver functions the shim wraps is replaced: a newer
     * ABI of the same name (a future _v3 at a newer version) is not the shim's to serve. */
    for (size_t i = 0; i < sizeof exports / sizeof exports[0]; i++) {
        const export_entry *e = &exports[i];
        if (strcmp(e->base, symbol) != 0) continue;
        if (version < e->since || (e->until && version >= e->until)) continue;
        if (e->ptsz == ptsz) {
            pick = e;
            break;
        }
        /* A function without a stream has no per-thread flavour: the plain one answers. The
         * table lists the plain flavour first, so a per-thread one found later wins. */
        if (!e->ptsz && !pick) pick = e;
    }
    if (!pick) return; /* an ABI the shim does not implement (the legacy 32-bit cuMemAlloc) */
    const cuma_preload_driver *d = cuma_preload_driver_get();
    bool known = false;
    for (size_t i = 0; i < sizeof exports / sizeof exports[0] && !known; i++)
        known = !strcmp(exports[i].base, symbol) && *pfn == real_of(d, &exports[i]);
    if (!known) {
        /* A request the shim would serve, answered with another function than the driver's: a
         * tool (Nsight, an injection library) wraps the driver, or a newer ABI. The program then
         * runs without cuma for that call: said once, since it would otherwise not know. */
        static _Atomic bool told;
        if (!atomic_exchange(&told, true))
            cuma_preload_report("cuGetProcAddress(\"%s\") answered %p, which is not the driver's "
                                "function (a tool such as Nsight or an injection library wraps "
                                "the driver, or a newer ABI): cuma does not serve calls made "
                                "through it (said once)",
                                symbol, *pfn);
        return;
    }
    if (pick) *pfn = pick->mine();
}

CUMA_PRELOAD_EXPORT CUresult CUDAAPI cuGetProcAddress_v2(const char *symbol, void **pfn,
                                                         int cudaVersion, cuuint64_t flags,
                                                         CUdriverProcAddressQueryResult *status) {
    const cuma_preload_driver *d = cuma_preload_driver_get();
    if (!d->GetProcAddressV2) return CUDA_ERROR_NOT_FOUND;
    CUresult r = d->GetProcAddressV2(symbol, pfn, cudaVersion, flags, status);
    if (r == CUDA_SUCCESS) substitute(symbol, pfn, cudaVersion, flags);
    return r;
}

CUMA_PRELOAD_EXPORT CUresult CUDAAPI cuGetProcAddress(const char *symbol, void **pfn,
                                                      int cudaVersion, cuuint64_t flags) {
    const cuma_preload_driver *d = cuma_preload_driver_get();
    CUresult r;
    if (d->GetProcAddressV1)
        r = d->GetProcAddressV1(symbol, pfn, cudaVersion, flags);
    else if (d->GetProcAddressV2)
        r = d->GetProcAddressV2(symbol, pfn, cudaVersion, flags, NULL);
    else
        return CUDA_ERROR_NOT_FOUND;
    if (r == CUDA_SUCCESS) substitute(symbol, pfn, cudaVersion, flags);
    return r;
}

/* ---- dlsym --------------------------------------------------------------------------------- */

/* Any byte of the shim's own file: dladdr on it names the shim. */
static const char self_marker = 0;

static bool from_shim(const void *caller) {
    Dl_info me, them;
    if (!dladdr(&self_marker, &me) || !dladdr(caller, &them)) return false;
    return me.dli_fbase == them.dli_fbase;
}

/* Whether the caller's code lies in another copy of cuma: a libcuma.so (the one the Python
 * package, cuma.torch.enable() and C programs load) whose own file defines cuma_heap_create.
 * That copy makes its own heaps on the driver; given the shim's entry points it would make its
 * memory blocks of the shim's heap and read the shim's limit as the device's size. */
static bool from_other_cuma(const void *caller) {
    Dl_info them, def;
    if (!dladdr(caller, &them) || !them.dli_fname || !them.dli_fname[0]) return false;
    void *h = dlopen(them.dli_fname, RTLD_LAZY | RTLD_NOLOAD);
    if (!h) return false;
    void *sym = real_dlsym()(h, "cuma_heap_create");
    bool theirs = sym && dladdr(sym, &def) && def.dli_fbase == them.dli_fbase;
    dlclose(h);
    return theirs;
}

/* A lookup of a driver name ("cu" and a capital) on a handle (not RTLD_NEXT). Out of line, so
 * that dlsym itself keeps no stack frame and can end in a tail call. */
__attribute__((noinline)) static void *lookup_cu(void *handle, const char *name,
                                                 const void *caller) {
    void *r = real_dlsym()(handle, name);
    if (!r) return NULL;
    if (from_shim(caller)) {
        /* cuma's backend opening the driver: the real function, or a recording wrapper. */
        void *t = cuma_preload_tracked(name);
        return t ? t : r;
    }
    if (from_other_cuma(caller)) return r; /* another cuma's backend: the driver's own */
    for (size_t i = 0; i < sizeof exports / sizeof exports[0]; i++) {
        const export_entry *e = &exports[i];
        if (strcmp(e->sym, name) != 0) continue;
        /* Only the driver's own function is replaced: a library of the same name elsewhere,
         * or the shim's function found through RTLD_DEFAULT, stays what it is. */
        if (!cuma_preload_routing()) return r;
        const cuma_preload_driver *d = cuma_preload_driver_get();
        return d->handle && r == real_of(d, e) ? e->mine() : r;
    }
    return r;
}

/* Exported (exports.map). glibc's dlsym finds RTLD_NEXT's "next" from its caller's address, so
 * every lookup the shim does not change ends in a tail call that leaves the caller's return
 * address in place: the file is built with sibling-call optimisation on (CMakeLists.txt), and
 * tests/shim checks that dlsym(RTLD_NEXT, ...) from the program still finds the shim's. */
NO_SANITIZE CUMA_PRELOAD_EXPORT void *dlsym(void *restrict handle, const char *restrict name) {
    dlsym_fn real = real_dlsym();
    /* RTLD_DEFAULT searches the caller's scope, which a lookup made from here would replace by
     * the shim's (a library loaded RTLD_LOCAL then finds no driver); the shim's exported entry
     * points come first in every default-scope lookup anyway. */
    if (handle != RTLD_NEXT && handle != RTLD_DEFAULT && name[0] == 'c' && name[1] == 'u' &&
        name[2] >= 'A' && name[2] <= 'Z')
        return lookup_cu(handle, name, __builtin_return_address(0));
    return real(handle, name);
}
