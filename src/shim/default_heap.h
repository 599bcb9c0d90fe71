// SPDX-License-Identifier: Apache-2.0
/* Internal view of the default heaps (src/shim/default_heap.c) for the framework shims. */
#ifndef CUMA_SHIM_DEFAULT_HEAP_H
#define CUMA_SHIM_DEFAULT_HEAP_H

#include "cuma/cuma.h"

#include <stdbool.h>

/* Device ordinals 0..CUMA_MAX_DEFAULT_HEAPS-1 have a default heap. */
#define CUMA_MAX_DEFAULT_HEAPS 64

/* The default heap of `device` if it has been created, else NULL (also for a bad ordinal).
 * Never creates one: for hooks that act on "every heap there is" (empty_cache, record_stream)
 * and must not create heaps for devices the program never used. */
/* Opens the CUDA driver for the default heaps (unless CUMA_CONF names the simulated device),
 * taking no lock of cuma's. dlopen waits for glibc's loader lock, whose holder may be running a
 * library constructor that allocates through cuma (LD_PRELOAD) and waits for a lock of cuma's:
 * so the driver is opened before any such lock (create_lock, a device's pin in the shim) is
 * taken, never under one. cuma_default_heap calls it first; the shim before it pins a device. */
void cuma_default_heap_load_driver(void);
cuma_heap *cuma_default_heap_peek(int device);

/* Destroys the default heap of `device` and unpublishes it, so that the next
 * cuma_default_heap(device) creates a new one: for a device whose context is about to be
 * destroyed (a device reset), which would take the heap's memory with it. The heap's pages go
 * back through the driver, so the context must still exist. Like cuma_heap_destroy, it must not
 * race with any use of that heap (cuma_default_heap_peek included); the caller guarantees it.
 * Returns whether there was a heap. A bad ordinal is a no-op. */
bool cuma_default_heap_retire(int device);

#endif
