/* Internal view of the default heaps (src/shim/default_heap.c) for the framework shims. */
#ifndef CUMA_SHIM_DEFAULT_HEAP_H
#define CUMA_SHIM_DEFAULT_HEAP_H

#include "cuma/cuma.h"

/* Device ordinals 0..CUMA_MAX_DEFAULT_HEAPS-1 have a default heap. */
#define CUMA_MAX_DEFAULT_HEAPS 64

/* The default heap of `device` if it has been created, else NULL (also for a bad ordinal).
 * Never creates one: for hooks that act on "every heap there is" (empty_cache, record_stream)
 * and must not create heaps for devices the program never used. */
cuma_heap *cuma_default_heap_peek(int device);

#endif
