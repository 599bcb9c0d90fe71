// SPDX-License-Identifier: Apache-2.0
/*
 * fakecuda.h - test-control API of the fake CUDA driver (libcuda.so.1 built
 * from tests/fakecuda). These functions are exported by the same library as
 * the cu* driver entry points; see fakecuda.c for the model.
 *
 * Misuse of this API (unknown API or kind name, invalid stream, calling
 * stream functions before cuInit) is a bug in the test: the fake prints a
 * message to stderr and aborts. So is any use of a stream or event after it
 * was destroyed (cuStreamDestroy / cuEventDestroy): undefined on the real
 * driver, an abort naming the call and the handle here.
 *
 * Environment (read once, at the first call into the library; a malformed
 * value aborts the process with a message):
 *   FAKECUDA_DEVICES          number of devices, 0..64 (default 1)
 *   FAKECUDA_CAPACITY         bytes per device, suffix K/M/G/T (default 80G);
 *                             any size (real devices report sizes that are a
 *                             multiple of no granularity)
 *   FAKECUDA_GRANULARITY      minimum granularity, a power of two >= page
 *                             size (default 2M)
 *   FAKECUDA_RECOMMENDED_GRANULARITY  recommended granularity, a power of two
 *                             >= the minimum (default: the minimum)
 *   FAKECUDA_NO_RDMA=1        no GPUDirect RDMA with VMM memory: the attribute
 *                             says 0 and cuMemCreate refuses
 *                             gpuDirectRDMACapable
 *   FAKECUDA_HOST_MEMORY      bytes cuMemAllocManaged may hand out, all
 *                             devices together (default 4x the capacity)
 *   FAKECUDA_NO_VMM=1         no virtual memory management support
 *   FAKECUDA_NO_PEER=1        cuDeviceCanAccessPeer reports 0
 *   FAKECUDA_SYNC_TIMEOUT_MS  how long a synchronize waits for held work
 *                             before aborting (default 10000)
 *   FAKECUDA_EVENT_LAG        every stream's completion lag (default 0; see
 *                             fakecuda_stream_set_lag)
 *   FAKECUDA_FAIL             initial fault-injection spec (see below)
 */
#ifndef CUMA_FAKECUDA_H
#define CUMA_FAKECUDA_H

#include <stddef.h>
#include <cuda.h>

#ifdef __cplusplus
extern "C" {
#endif

/*
 * Mark stream `s` as having work in flight. Events recorded on it stay
 * incomplete (cuEventQuery -> CUDA_ERROR_NOT_READY), cuStreamQuery returns
 * CUDA_ERROR_NOT_READY, and cuStreamSynchronize / cuEventSynchronize /
 * cuCtxSynchronize block until fakecuda_stream_release(s) (or abort the
 * process after FAKECUDA_SYNC_TIMEOUT_MS). NULL, CU_STREAM_LEGACY and
 * CU_STREAM_PER_THREAD name the pseudo streams of the calling thread's
 * current context's device (device 0 if the thread has no context).
 * Holding an already held stream is a no-op (holds do not nest).
 */
void fakecuda_stream_hold(CUstream s);

/*
 * Complete all work recorded on `s` so far: every event recorded on it while
 * held becomes complete, the stream is no longer held, and threads blocked in
 * a synchronize call are woken. Also accepts a stream that was destroyed
 * while held (its events complete); holding or releasing a destroyed stream
 * that is not held aborts. Releasing a stream that is not held is a no-op.
 */
void fakecuda_stream_release(CUstream s);

/*
 * Make work recorded on `s` from now on complete late: an event recorded on it
 * answers CUDA_ERROR_NOT_READY to its first `queries` cuEventQuery calls and
 * completes at the next (a synchronize call completes it at once); a
 * cuStreamQuery of the stream likewise. Completing an event completes every
 * earlier record of its stream. 0 (the default unless FAKECUDA_EVENT_LAG says
 * otherwise): complete when recorded. Pseudo streams as for
 * fakecuda_stream_hold (CU_STREAM_PER_THREAD is the calling thread's).
 */
void fakecuda_stream_set_lag(CUstream s, unsigned queries);

/*
 * Replace the fault-injection spec. Grammar (same as FAKECUDA_FAIL):
 *   spec  := entry ("," entry)*
 *   entry := api ":" (n | "*")
 * where api is a driver API base name ("cuMemCreate"; a trailing "_v2" is
 * accepted and ignored) and n >= 1. The n-th call of api counted from this
 * call (1-based) returns CUDA_ERROR_OUT_OF_MEMORY without side effects; "*"
 * fails every call. The same api may appear several times. NULL or "" clears
 * all injected failures. Resets the per-API position counters used for "n".
 * Returns 0, or -1 (leaving the previous spec in place) for a bad spec.
 */
int fakecuda_set_fail(const char *spec);

/*
 * Number of calls of `api` (base name, e.g. "cuMemAlloc"; "_v2" suffix
 * accepted) since the library was loaded or since the last
 * fakecuda_reset_counters(). Calls that failed (for any reason, including
 * injected failures and CUDA_ERROR_NOT_INITIALIZED) are counted.
 */
unsigned long fakecuda_calls(const char *api);

/* Reset all call counters to zero (does not touch fault-injection positions). */
void fakecuda_reset_counters(void);

/*
 * Number of live objects of one kind:
 *   "handles"      cuMemCreate handles not yet passed to cuMemRelease
 *   "mappings"     cuMemMap mappings not yet unmapped
 *   "reservations" cuMemAddressReserve ranges not yet freed
 *   "allocs"       cuMemAlloc allocations not yet freed
 *   "managed"      cuMemAllocManaged allocations not yet freed
 *   "streams"      cuStreamCreate streams not yet destroyed
 *   "events"       cuEventCreate events not yet destroyed
 *   "rdma_handles" of "handles", those created gpuDirectRDMACapable
 */
long fakecuda_live(const char *kind);

/*
 * Number of objects of one kind (the kinds of fakecuda_live) that a
 * cuDevicePrimaryCtxReset destroyed because they were still live, since the
 * library was loaded. Code that gives its memory back before a reset leaves
 * "handles", "mappings", "allocs" and "managed" where they were.
 */
long fakecuda_reclaimed(const char *kind);

/*
 * Bytes charged to `device`'s capacity: cuMemCreate physical memory that is
 * still allocated (a released handle stays charged until its last mapping is
 * unmapped) and cuMemAlloc sizes, rounded up to the granularity. Managed
 * memory is charged to no device (fakecuda_managed_bytes).
 */
size_t fakecuda_used_bytes(int device);

/* Calls fn(addr, size, arg) in the freeing thread after each successful cuMemFree (of a
 * cuMemAlloc or managed block) and cuMemAddressFree, once the range is free and before the call
 * returns; fn NULL: none. The driver reuses a freed address for the next allocation placed
 * without a hint, so a hook that allocates can force what another thread could do between the
 * driver's free and the caller's next step. */
void fakecuda_set_free_hook(void (*fn)(unsigned long long addr, unsigned long long size, void *arg),
                            void *arg);

/* Bytes of live cuMemAllocManaged allocations (rounded up to the granularity), all devices
 * together: host memory, bounded by FAKECUDA_HOST_MEMORY, not by any device's capacity. */
size_t fakecuda_managed_bytes(void);

#ifdef __cplusplus
}
#endif

#endif /* CUMA_FAKECUDA_H */
