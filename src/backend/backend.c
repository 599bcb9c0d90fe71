// SPDX-License-Identifier: Apache-2.0
/* Picks the backend a heap's settings name, and the simulated device in its place where the
 * settings ask for that fallback and no CUDA driver can be used. */
#include "backend.h"
#include "util/error.h"
#ifdef CUMA_HAVE_CUDA
#include "cuda_driver.h"
#endif

#include <stdio.h>
#include <string.h>

/* The kinds of CUMA_BACKEND_LIST with their constructors, in the list's order. */
typedef struct kind_desc {
    const char *name;
    cuma_status (*create)(const cuma_settings *s, cuma_backend **out);
} kind_desc;

#define KIND_DESC(kind, name, family, what)                                                        \
    [CUMA_BACKEND_##kind] = {#name, cuma_##family##_backend_create},
static const kind_desc kinds[] = {CUMA_BACKEND_LIST(KIND_DESC)};
#undef KIND_DESC
#define NKINDS (sizeof kinds / sizeof kinds[0])

const char *cuma_backend_kind_name(cuma_backend_kind kind) {
    return (unsigned)kind < NKINDS ? kinds[kind].name : "?";
}

bool cuma_backend_kind_find(const char *name, cuma_backend_kind *kind) {
    for (size_t i = 0; i < NKINDS; i++)
        if (!strcmp(name, kinds[i].name)) return *kind = (cuma_backend_kind)i, true;
    return false;
}

#ifndef CUMA_HAVE_CUDA
/* The settings name the CUDA kinds in every build (a settings string means the same
 * everywhere); a libcuma built without cuda.h answers them here. */
cuma_status cuma_cuda_backend_create(const cuma_settings *s, cuma_backend **out) {
    (void)s;
    *out = NULL;
    return cuma_fail(CUMA_ERR_NO_DEVICE, "this libcuma was built without the CUDA backends (no "
                                         "cuda.h)");
}
#endif

/* Whether the CUDA driver itself cannot be used, as opposed to a working driver without the
 * device asked for. The load's answer is kept for the process, so asking again costs nothing. */
static bool no_cuda_driver(void) {
#ifdef CUMA_HAVE_CUDA
    const cuma_cuda_api *api;
    return cuma_cuda_load(&api) != CUMA_OK;
#else
    return true;
#endif
}

/* Creates the backend; *no_driver set when a device backend failed for want of a usable
 * driver. "auto" is the CUDA family's to resolve (vmm where the device has it, else segment). */
static cuma_status create(const cuma_settings *s, cuma_backend **out, bool *no_driver) {
    *no_driver = false;
    cuma_backend_kind kind = CUMA_BACKEND_VMM;
    if (!cuma_backend_kind_find(s->backend, &kind) && strcmp(s->backend, "auto"))
        return cuma_fail(CUMA_ERR_CONFIG, "backend '%s' is not one of " CUMA_BACKEND_CHOICES,
                         s->backend);
    cuma_status st = kinds[kind].create(s, out);
    if (kind == CUMA_BACKEND_SIM || st != CUMA_ERR_NO_DEVICE) return st;
    char why[512];
    snprintf(why, sizeof why, "%s", cuma_last_error());
    if (!(*no_driver = no_cuda_driver())) return cuma_fail(st, "%s", why);
    /* Never the simulated device unasked: its pointers are host bookkeeping, and a program that
     * wanted GPU memory would crash on them far from here. The message says how to ask. */
    return cuma_fail(st,
                     "backend:%s: no usable CUDA driver: %s; set backend:sim for the simulated "
                     "device, or backend_fallback:sim to use it where no driver can be used",
                     s->backend, why);
}

cuma_status cuma_backend_create(const cuma_settings *s, cuma_backend **out) {
    bool no_driver;
    return create(s, out, &no_driver);
}

cuma_status cuma_backend_create_or_fallback(const cuma_settings *s, cuma_backend **out,
                                            bool *fell_back) {
    *fell_back = false;
    bool no_driver;
    cuma_status st = create(s, out, &no_driver);
    if (!no_driver || strcmp(s->backend_fallback, "sim")) return st;
    st = cuma_sim_backend_create(s, out);
    if (st) return st;
    *fell_back = true;
    cuma_clear_error();
    return CUMA_OK;
}
