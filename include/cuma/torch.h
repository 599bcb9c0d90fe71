// SPDX-License-Identifier: Apache-2.0
/* cuma as PyTorch's CUDA allocator.
 *
 * These are the entry points that torch.cuda.memory.CUDAPluggableAllocator loads by name (the
 * Python package's cuma.torch.enable() does it for you):
 *
 *     alloc = torch.cuda.memory.CUDAPluggableAllocator(
 *         "/path/to/libcuma_torch.so", "cuma_torch_raising_malloc", "cuma_torch_free")
 *     torch.cuda.memory.change_current_allocator(alloc)
 *
 * libcuma_torch.so (built where a C++ compiler is found) holds cuma_torch_raising_malloc, which
 * throws a C++ exception on failure: PyTorch raises it as a RuntimeError whose text starts with
 * "CUDA out of memory." for an out-of-memory, and carries cuma's reason.
 * libcuma_torch_c10-<torch version>.so (built where PyTorch's C++ headers are found) holds the
 * same function throwing PyTorch's c10::OutOfMemoryError for an out-of-memory instead, which
 * PyTorch raises as torch.cuda.OutOfMemoryError; cuma.torch.enable() prefers it. PyTorch keeps
 * a NULL from a pluggable allocator as a tensor without storage, and never raises its own
 * OutOfMemoryError for one, so cuma_torch_malloc (the same call returning NULL) is for callers
 * that check the pointer; with PyTorch it leaves only its line on stderr to say why.
 *
 * and the optional hooks that PyTorch 2.x accepts as function pointers (init, reset =
 * empty_cache, memory fraction, record_stream). Every call works on the process-wide default
 * heap of its device (cuma_default_heap), configured by CUMA_CONF.
 *
 * Thread safety: every function may be called from any thread at any time, concurrently,
 * like the heap API; none may race with cuma_default_heaps_shutdown.
 *
 * Errors: PyTorch's hooks return nothing (or NULL), so a failure leaves its reason in
 * cuma_last_error() of the calling thread; the hooks that cannot report at all (free,
 * record_stream, memory_fraction) also print it to stderr, since it means a bug or a
 * misconfiguration that would otherwise go unseen.
 */
#ifndef CUMA_TORCH_H
#define CUMA_TORCH_H

#include "cuma.h"

#include <stdbool.h>
#include <stddef.h>
#include <sys/types.h> /* ssize_t */

#ifdef __cplusplus
extern "C" {
#endif

/* cudaStream_t without the CUDA headers: the same pointer type that driver_types.h declares.
 * C11 and C++ accept an identical typedef twice, so including cuda_runtime_api.h after this
 * header is fine too; the guard only spares older compilers when it came first. */
#ifndef __DRIVER_TYPES_H__
typedef struct CUstream_st *cudaStream_t;
#endif

/* Allocates `size` bytes on `device` for use on `stream`, in *ptr. Size 0 gives NULL and
 * CUMA_OK; a negative size or a device outside 0..63 is CUMA_ERR_INVALID; a stream that
 * captures a CUDA graph is CUMA_ERR_UNSUPPORTED (PyTorch keeps a graph's memory in pools of
 * its own allocator, which a pluggable allocator is not told of: memory freed during the
 * capture would be handed out again while the graph's replays still write it); else
 * cuma_alloc's status on the device's default heap. */
cuma_status cuma_torch_alloc(ssize_t size, int device, cudaStream_t stream, void **ptr);

/* cuma_torch_alloc returning the pointer: NULL on failure (reason in cuma_last_error(), and
 * said on stderr: the first five failures, then every 1000th). */
void *cuma_torch_malloc(ssize_t size, int device, cudaStream_t stream);

/* Frees a pointer from cuma_torch_malloc (or libcuma_torch's). `size` and `stream` are not
 * needed: the heap knows the block's size and the stream it was allocated on (other streams
 * that used it came through cuma_torch_record_stream). NULL is a no-op. */
void cuma_torch_free(void *ptr, ssize_t size, int device, cudaStream_t stream);

/* The next cuma_torch_free(ptr) does nothing: the block's owner has moved it (cuma.torch.compact
 * moves a tensor's block with cuma_compact, which frees the old place itself, while PyTorch's
 * storage at the old place would still free it when it dies). Call it while the block at ptr
 * is still live, just before that storage dies, so that no other block can be at ptr when the
 * skipped free comes. At most 64 pointers wait at a time (CUMA_ERR_LIMIT beyond). */
cuma_status cuma_torch_disown(void *ptr);

/* Whether a cuma_torch_disown(ptr) still waits for its skipped free. */
bool cuma_torch_disowned(const void *ptr);

/* PyTorch's init hook: checks CUMA_CONF early, so a bad setting is reported when CUDA starts
 * rather than at the first allocation. Heaps are still created on first use, so devices the
 * program never touches cost nothing. */
void cuma_torch_init(int device_count);

/* PyTorch's reset hook (torch.cuda.empty_cache()): gives every default heap's cache back to
 * the device (cuma_trim(heap, 0)). */
void cuma_torch_reset(void);

/* PyTorch's memory fraction hook (torch.cuda.set_per_process_memory_fraction). */
void cuma_torch_memory_fraction(double fraction, int device);

/* PyTorch's record_stream hook: `ptr` is also used on `stream`; finds the default heap that
 * owns it. Memory no default heap owns (a tensor PyTorch did not allocate through cuma:
 * from_blob, DLPack, IPC) is skipped silently, as PyTorch's own allocator skips it. */
void cuma_torch_record_stream(void *ptr, cudaStream_t stream);

/* The stats JSON of `device`'s default heap (created if needed), like cuma_stats_json, into
 * buf (at most len bytes, NUL-terminated when len > 0). Returns the full length of the JSON
 * without the NUL (like snprintf: a result >= len means the buffer was too small and holds
 * only a truncated prefix), or minus a cuma_status on failure (reason in cuma_last_error()). */
int cuma_torch_stats_json(int device, char *buf, size_t len);

/* The default heap of `device` if it has been created, else NULL; never creates one (for
 * callers that act on existing heaps only, like the Python package's set_memory_limit). */
cuma_heap *cuma_torch_created_heap(int device);

#ifdef __cplusplus
}
#endif
#endif
