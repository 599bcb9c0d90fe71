// SPDX-License-Identifier: Apache-2.0
/* cuma's simulated device: controls for tests and for `cuma replay`.
 *
 * A heap created with "backend:sim" runs on a simulated device of `capacity` bytes with pages
 * of `page_size` bytes. With "sim_clock:manual" its clock only moves when told (replays drive
 * it with trace timestamps, so time-based release is deterministic); otherwise it reads the
 * monotonic clock. With "host_backing:on" allocations are backed by host memory, so tests can
 * write into them and check that data survives.
 *
 * Streams on the simulated device are any pointer values. Work "issued" on a stream completes
 * at once, unless a test holds the stream: events recorded while it is held complete only when
 * it is released.
 *
 * The stream functions return CUMA_ERR_UNSUPPORTED for a heap that is not on the simulated
 * device; the clock functions work on every backend.
 * Thread-safe like the rest of the heap API.
 */
#ifndef CUMA_SIM_H
#define CUMA_SIM_H

#include "cuma.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Sets the heap's clock (nanoseconds; must not go backwards). Needs sim_clock:manual, which
 * works on every backend (a replay on backend:vmm drives the release policy the same way). */
cuma_status cuma_sim_set_time(cuma_heap *heap, uint64_t ns);

/* Reads the heap's clock, whatever the backend (nanoseconds). */
cuma_status cuma_sim_get_time(cuma_heap *heap, uint64_t *ns);

/* Holds a stream busy: events recorded on it from now on stay incomplete. */
cuma_status cuma_sim_hold_stream(cuma_heap *heap, cuma_stream stream);

/* Releases a held stream: everything recorded on it so far completes. */
cuma_status cuma_sim_release_stream(cuma_heap *heap, cuma_stream stream);

/* Another program on the simulated device holds `bytes` of it from now on (rounded up to pages;
 * replaces the amount set before, 0 gives it all back): the device's free memory and what the
 * heap can create shrink by them, as when another process allocates on a shared GPU.
 * CUMA_ERR_OOM when they do not fit next to what the heap holds. */
cuma_status cuma_sim_take_memory(cuma_heap *heap, uint64_t bytes);

#ifdef __cplusplus
}
#endif
#endif
