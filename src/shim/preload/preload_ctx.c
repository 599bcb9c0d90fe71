// SPDX-License-Identifier: Apache-2.0
/* The calls that end a primary context: cuDevicePrimaryCtxReset (cudaDeviceReset) and
 * cuDevicePrimaryCtxRelease, in both ABIs.
 *
 * A reset destroys every allocation of the device's primary context, the pages cuma mapped in
 * it included. Left alone, cuma's heap would go on handing out addresses with nothing behind
 * them, and later unmap and release objects the driver had already destroyed. So the shim
 * retires the heap first (preload_mem.c): new calls for the device stop using it, the calls
 * under way finish (pins, preload_pin.c), the heap is destroyed while the context still exists
 * (its pages unmapped and released through the driver, its retain of the context dropped), and
 * the ranges it took are forgotten. Then the driver resets the context, and the next allocation
 * on the device creates a fresh heap. A free of an old pointer finds no heap and no range of
 * cuma's, and gets the driver's answer for memory that is gone: CUDA_ERROR_INVALID_VALUE (unless
 * the driver, or the new heap, has handed the address out again, as the plain driver would).
 *
 * A release ends the context when it drops the last reference. cuma's heap holds a reference of
 * its own, so the program's release of its last one leaves the context, and cuma's memory, alive
 * (the plain driver would destroy them; the blocks the program never freed stay allocated).
 * Counting the program's retains to retire the heap at its last release would be a guess: a
 * retain that does not pass through the shim (the runtime has private ways into the driver)
 * would make the shim destroy memory the program still uses. What the shim does check is the
 * driver's word: after a release, if the context became inactive (a program that released more
 * than it retained took cuma's reference), the context and cuma's memory are gone already, and
 * the heap is retired the same way (its driver calls then fail; what they leave is forgotten).
 */
#include "preload.h"

#include "util/lockrank.h"

#include <pthread.h>
#include <string.h>

/* Retirements one at a time: two resets of one device must not both destroy its heap, and the
 * second must not publish the device again while the first still resets it. Never taken by an
 * allocation or a free. */
static pthread_mutex_t retire_lock = PTHREAD_MUTEX_INITIALIZER;

void cuma_preload_ctx_after_fork(void) {
    pthread_mutex_t fresh = PTHREAD_MUTEX_INITIALIZER;
    memcpy(&retire_lock, &fresh, sizeof fresh);
}

typedef CUresult(CUDAAPI *ctx_fn)(CUdevice);

static CUresult reset(ctx_fn real, CUdevice dev) {
    if (!real) return CUDA_ERROR_NOT_FOUND;
    if (!cuma_preload_routing()) return real(dev);
    /* A reset the driver would refuse (no such device, the driver not initialised or shut down)
     * must not cost the program its memory: the device's state is asked first, with the same
     * handle, and only a device the driver knows has its heap retired. */
    const cuma_preload_driver *d = cuma_preload_driver_get();
    unsigned flags;
    int active;
    if (!d->DevicePrimaryCtxGetState || d->DevicePrimaryCtxGetState(dev, &flags, &active) != 0)
        return real(dev);
    cuma_mutex_lock(&retire_lock, CUMA_RANK_PRELOAD_RETIRE);
    bool retired = cuma_preload_retire_begin(dev);
    CUresult r = real(dev);
    /* Also after a reset the driver refused for another reason: the heap is gone either way, and
     * the next allocation makes a new one in whatever context the device then has. */
    if (retired) cuma_preload_retire_end(dev);
    cuma_mutex_unlock(&retire_lock);
    return r;
}

static CUresult release(ctx_fn real, CUdevice dev) {
    if (!real) return CUDA_ERROR_NOT_FOUND;
    CUresult r = real(dev);
    if (r != CUDA_SUCCESS || !cuma_preload_routing() || !cuma_preload_has_heap(dev)) return r;
    const cuma_preload_driver *d = cuma_preload_driver_get();
    unsigned flags;
    int active = 1;
    if (!d->DevicePrimaryCtxGetState || d->DevicePrimaryCtxGetState(dev, &flags, &active) != 0 ||
        active)
        return r;
    cuma_mutex_lock(&retire_lock, CUMA_RANK_PRELOAD_RETIRE);
    if (cuma_preload_retire_begin(dev)) cuma_preload_retire_end(dev);
    cuma_mutex_unlock(&retire_lock);
    return r;
}

CUMA_PRELOAD_EXPORT CUresult CUDAAPI cuDevicePrimaryCtxReset_v2(CUdevice dev) {
    return reset(cuma_preload_driver_get()->DevicePrimaryCtxReset, dev);
}

CUMA_PRELOAD_EXPORT CUresult CUDAAPI cuDevicePrimaryCtxReset(CUdevice dev) {
    return reset(cuma_preload_driver_get()->DevicePrimaryCtxResetV1, dev);
}

CUMA_PRELOAD_EXPORT CUresult CUDAAPI cuDevicePrimaryCtxRelease_v2(CUdevice dev) {
    return release(cuma_preload_driver_get()->DevicePrimaryCtxRelease, dev);
}

CUMA_PRELOAD_EXPORT CUresult CUDAAPI cuDevicePrimaryCtxRelease(CUdevice dev) {
    return release(cuma_preload_driver_get()->DevicePrimaryCtxReleaseV1, dev);
}
