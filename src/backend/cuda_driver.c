/* Loads libcuda at run time: see cuda_driver.h for why. */
#include "cuda_driver.h"
#include "core/error.h"

#include <dlfcn.h>
#include <pthread.h>
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

/* Written once by load_once (under pthread_once), read-only afterwards. */
static pthread_once_t load_flag = PTHREAD_ONCE_INIT;
static cuma_cuda_api api;
static cuma_status load_status;
static char load_error[400];
static char load_path[256];

/* Whether api.GetErrorName/String may be called: only once they resolved, which happens before
 * the status is published, so readers after pthread_once see a consistent value. */
static int have_error_names;

static void load_once(void) {
    /* secure_getenv: a set-user-ID program must not load a library named by its caller. */
    const char *path = secure_getenv("CUMA_CUDA_LIBRARY");
    if (!path || !*path) path = "libcuda.so.1";
    snprintf(load_path, sizeof load_path, "%s", path);
    api.path = load_path;
    load_status = CUMA_ERR_NO_DEVICE;
    void *lib = dlopen(load_path, RTLD_NOW | RTLD_LOCAL);
    if (!lib) {
        const char *why = dlerror();
        snprintf(load_error, sizeof load_error, "CUDA driver: dlopen(\"%s\") failed: %s", load_path,
                 why ? why : "unknown error");
        return;
    }
#define CUMA_CUDA_RESOLVE(field, sym, params)                                                      \
    {                                                                                              \
        void *p_ = dlsym(lib, #sym);                                                               \
        if (!p_) {                                                                                 \
            snprintf(load_error, sizeof load_error,                                                \
                     "CUDA driver %s has no symbol %s (driver too old?)", load_path, #sym);        \
            goto fail;                                                                             \
        }                                                                                          \
        /* POSIX guarantees that a dlsym result converts to a function pointer. */                 \
        memcpy(&api.field, &p_, sizeof p_);                                                        \
    }
    CUMA_CUDA_FUNCTIONS(CUMA_CUDA_RESOLVE)
#undef CUMA_CUDA_RESOLVE
    have_error_names = 1;
    CUresult r = api.Init(0);
    if (r != CUDA_SUCCESS) {
        char text[200];
        snprintf(load_error, sizeof load_error, "CUDA driver %s: cuInit(0) failed: %s", load_path,
                 cuma_cuda_result_text(r, text, sizeof text));
        goto fail;
    }
    load_status = CUMA_OK;
    return;
fail:
    /* Nothing of the library is used after this: closing it gives its memory back. */
    have_error_names = 0;
    memset(&api, 0, sizeof api);
    api.path = load_path;
    dlclose(lib);
}

cuma_status cuma_cuda_load(const cuma_cuda_api **out) {
    *out = NULL;
    if (pthread_once(&load_flag, load_once) != 0)
        return cuma_fail(CUMA_ERR_NO_DEVICE, "CUDA driver: pthread_once failed");
    if (load_status != CUMA_OK) return cuma_fail(load_status, "%s", load_error);
    *out = &api;
    return CUMA_OK;
}

const char *cuma_cuda_result_text(CUresult r, char *buf, size_t len) {
    const char *name = NULL, *text = NULL;
    if (have_error_names) {
        if (api.GetErrorName(r, &name) != CUDA_SUCCESS) name = NULL;
        if (api.GetErrorString(r, &text) != CUDA_SUCCESS) text = NULL;
    }
    if (name && text)
        snprintf(buf, len, "%s (%s)", name, text);
    else if (name)
        snprintf(buf, len, "%s", name);
    else
        snprintf(buf, len, "CUresult %d", (int)r);
    return buf;
}

cuma_status cuma_cuda_check(CUresult r, const char *what) {
    if (r == CUDA_SUCCESS) return CUMA_OK;
    char text[200];
    cuma_cuda_result_text(r, text, sizeof text);
    return cuma_fail(r == CUDA_ERROR_OUT_OF_MEMORY ? CUMA_ERR_OOM : CUMA_ERR_BACKEND, "%s: %s",
                     what, text);
}
