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

/* The CUDA backend the settings name: CUMA_ERR_NO_DEVICE with *no_driver set when the driver
 * itself cannot be used, as opposed to a working driver without the device asked for. */
static cuma_status cuda_create(const cuma_settings *s, cuma_backend **out, bool *no_driver) {
    *no_driver = false;
#ifdef CUMA_HAVE_CUDA
    cuma_status st = cuma_cuda_backend_create(s, out);
    if (st != CUMA_ERR_NO_DEVICE) return st;
    /* The load's answer is kept for the process, so asking again costs nothing and says which
     * of the two it was; the backend's own message stays the one reported. */
    char why[512];
    snprintf(why, sizeof why, "%s", cuma_last_error());
    const cuma_cuda_api *api;
    *no_driver = cuma_cuda_load(&api) != CUMA_OK;
    return cuma_fail(st, "%s", why);
#else
    (void)out;
    *no_driver = true;
    return cuma_fail(CUMA_ERR_NO_DEVICE, "this libcuma was built without the CUDA backends (no "
                                         "cuda.h)");
#endif
}

/* Creates the backend; *no_driver as for cuda_create. */
static cuma_status create(const cuma_settings *s, cuma_backend **out, bool *no_driver) {
    *no_driver = false;
    if (!strcmp(s->backend, "sim")) return cuma_sim_backend_create(s, out);
    cuma_status st = cuda_create(s, out, no_driver);
    if (st != CUMA_ERR_NO_DEVICE || !*no_driver) return st;
    /* Never the simulated device unasked: its pointers are host bookkeeping, and a program that
     * wanted GPU memory would crash on them far from here. The message says how to ask. */
    char why[512];
    snprintf(why, sizeof why, "%s", cuma_last_error());
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
