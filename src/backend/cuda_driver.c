// SPDX-License-Identifier: Apache-2.0
/* Loads libcuda at run time: see cuda_driver.h for why. */
#include "cuda_driver.h"
#include "util/error.h"

#include <dlfcn.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* Each typedef must be the header's own prototype: a wrong parameter type would compile and
 * then corrupt arguments at run time. The check names the symbol, so the header's declaration
 * of cuMemGetInfo (renamed to cuMemGetInfo_v2 by its #define) is what we compare against. */
#if defined(__GNUC__)
#define CUMA_CUDA_CHECK_TYPE(field, sym, params)                                                   \
    _Static_assert(__builtin_types_compatible_p(cuma_cu_##field##_fn, __typeof__(&sym)),           \
                   "cuma_cu_" #field "_fn differs from cuda.h's " #sym);
CUMA_CUDA_FUNCTIONS(CUMA_CUDA_CHECK_TYPE)
#undef CUMA_CUDA_CHECK_TYPE
#endif

/* One attempt to load the driver. Published once (compare-and-swap), read-only afterwards. No
 * lock of cuma's is held while dlopen runs: glibc holds its loader lock while a library's
 * constructors run, and a constructor that allocates through cuma (LD_PRELOAD) would wait for
 * our lock while our dlopen waited for the loader's. Threads that race each load, one wins. */
typedef struct loaded {
    cuma_cuda_api api;
    cuma_status status;
    int have_error_names; /* api.GetErrorName/String resolved */
    void *lib;            /* the handle, kept while the status is CUMA_OK */
    /* Room for the longest message whole: "CUDA driver " + path (255) + ": cuInit(0) failed: " +
     * the driver's text (199), so a failure is never reported cut short. */
    char error[512];
    char path[256];
} loaded;

static _Atomic(loaded *) published;

static const char *result_text(const loaded *L, CUresult r, char *buf, size_t len) {
    const char *name = NULL, *text = NULL;
    if (L && L->have_error_names) {
        if (L->api.GetErrorName(r, &name) != CUDA_SUCCESS) name = NULL;
        if (L->api.GetErrorString(r, &text) != CUDA_SUCCESS) text = NULL;
    }
    if (name && text)
        snprintf(buf, len, "%s (%s)", name, text);
    else if (name)
        snprintf(buf, len, "%s", name);
    else
        snprintf(buf, len, "CUresult %d", (int)r);
    return buf;
}

static void load(loaded *L) {
    /* secure_getenv: a set-user-ID program must not load a library named by its caller. */
    const char *path = secure_getenv("CUMA_CUDA_LIBRARY");
    if (!path || !*path) path = "libcuda.so.1";
    snprintf(L->path, sizeof L->path, "%s", path);
    L->api.path = L->path;
    L->status = CUMA_ERR_NO_DEVICE;
    void *lib = dlopen(L->path, RTLD_NOW | RTLD_LOCAL);
    if (!lib) {
        const char *why = dlerror();
        snprintf(L->error, sizeof L->error, "CUDA driver: dlopen(\"%s\") failed: %s", L->path,
                 why ? why : "unknown error");
        return;
    }
#define CUMA_CUDA_RESOLVE(field, sym, params)                                                      \
    {                                                                                              \
        void *p_ = dlsym(lib, #sym);                                                               \
        if (!p_) {                                                                                 \
            snprintf(L->error, sizeof L->error,                                                    \
                     "CUDA driver %s has no symbol %s (driver too old?)", L->path, #sym);          \
            goto fail;                                                                             \
        }                                                                                          \
        /* POSIX guarantees that a dlsym result converts to a function pointer. */                 \
        memcpy(&L->api.field, &p_, sizeof p_);                                                     \
    }
    CUMA_CUDA_FUNCTIONS(CUMA_CUDA_RESOLVE)
#undef CUMA_CUDA_RESOLVE
    L->have_error_names = 1;
    CUresult r = L->api.Init(0);
    if (r != CUDA_SUCCESS) {
        char text[200];
        snprintf(L->error, sizeof L->error, "CUDA driver %s: cuInit(0) failed: %s", L->path,
                 result_text(L, r, text, sizeof text));
        goto fail;
    }
    L->status = CUMA_OK;
    L->lib = lib;
    return;
fail:
    /* Nothing of the library is used after this: closing it gives its memory back. */
    L->have_error_names = 0;
    memset(&L->api, 0, sizeof L->api);
    L->api.path = L->path;
    dlclose(lib);
}

cuma_status cuma_cuda_load(const cuma_cuda_api **out) {
    *out = NULL;
    loaded *L = atomic_load_explicit(&published, memory_order_acquire);
    if (!L) {
        loaded *mine = calloc(1, sizeof *mine);
        if (!mine) return cuma_fail(CUMA_ERR_OOM, "CUDA driver: no host memory for its table");
        load(mine);
        loaded *expect = NULL;
        if (atomic_compare_exchange_strong_explicit(&published, &expect, mine, memory_order_acq_rel,
                                                    memory_order_acquire)) {
            L = mine;
        } else { /* another thread published first: its table is the one */
            if (mine->lib) dlclose(mine->lib);
            free(mine);
            L = expect;
        }
    }
    if (L->status != CUMA_OK) return cuma_fail(L->status, "%s", L->error);
    *out = &L->api;
    return CUMA_OK;
}

const char *cuma_cuda_result_text(CUresult r, char *buf, size_t len) {
    return result_text(atomic_load_explicit(&published, memory_order_acquire), r, buf, len);
}

cuma_status cuma_cuda_check(CUresult r, const char *what) {
    if (r == CUDA_SUCCESS) return CUMA_OK;
    char text[200];
    cuma_cuda_result_text(r, text, sizeof text);
    return cuma_fail(r == CUDA_ERROR_OUT_OF_MEMORY ? CUMA_ERR_OOM : CUMA_ERR_BACKEND, "%s: %s",
                     what, text);
}
