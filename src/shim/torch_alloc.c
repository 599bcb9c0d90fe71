// SPDX-License-Identifier: Apache-2.0
/* PyTorch's pluggable allocator entry points over the default heaps (include/cuma/torch.h).
 *
 * Thin on purpose: PyTorch calls malloc and free on every tensor, so they are one default
 * heap lookup (an atomic load once the heap exists) plus the heap call. Everything here is
 * thread-safe because the heap API and cuma_default_heap are.
 */
#include "cuma/torch.h"

#include "util/error.h"
#include "heap/heap.h"
#include "default_heap.h"

#include <limits.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

/* The hooks PyTorch cannot get a status from report here, so a misuse is not silent. */
static void report(const char *hook) {
    fprintf(stderr, "cuma: %s: %s\n", hook, cuma_last_error());
}

/* Whether `stream` captures a CUDA graph, as the heap's driver says (never on the simulated
 * device; also when the driver cannot be asked, which the message says). The legacy stream (NULL),
 * where most of PyTorch's work runs, cannot capture, and is not asked: the question is a driver
 * call. */
static bool capturing(const cuma_heap *h, cudaStream_t stream) {
    cuma_backend *be = h->be;
    return stream && be->ops->stream_capturing &&
           be->ops->stream_capturing(be, (cuma_stream)stream);
}

cuma_status cuma_torch_alloc(ssize_t size, int device, cudaStream_t stream, void **ptr) {
    if (!ptr) return cuma_fail(CUMA_ERR_INVALID, "cuma_torch_alloc: ptr is NULL");
    *ptr = NULL;
    if (size == 0) {
        cuma_clear_error(); /* not a failure: PyTorch's empty tensors have no storage */
        return CUMA_OK;
    }
    if (size < 0) return cuma_fail(CUMA_ERR_INVALID, "cuma_torch_alloc: negative size %zd", size);
    cuma_heap *h;
    cuma_status st = cuma_default_heap(device, &h);
    if (st) return st;
    if (capturing(h, stream))
        return cuma_fail(CUMA_ERR_UNSUPPORTED,
                         "cuma_torch_alloc: stream %p captures a CUDA graph (or its context could "
                         "not be made current to ask): under cuma.torch.enable() graphs are not "
                         "supported (PyTorch keeps a graph's memory in its own allocator's "
                         "pools); capture without cuma",
                         (void *)stream);
    return cuma_alloc(h, (size_t)size, (cuma_stream)stream, ptr);
}

/* Failures of the plain entry point said on stderr: the first few, then every 1000th. */
static _Atomic unsigned long malloc_failures;

void *cuma_torch_malloc(ssize_t size, int device, cudaStream_t stream) {
    void *p;
    if (cuma_torch_alloc(size, device, stream, &p) == CUMA_OK) return p;
    /* PyTorch keeps the NULL as a tensor without storage and fails later, saying nothing of
     * why: this line is the program's only clue (libcuma_torch.so raises instead). */
    unsigned long n = atomic_fetch_add(&malloc_failures, 1) + 1;
    if (n <= 5 || n % 1000 == 0)
        fprintf(stderr, "cuma: allocating %zd bytes on device %d failed (%lu so far): %s\n", size,
                device, n, cuma_last_error());
    return NULL;
}

/* Pointers whose next cuma_torch_free is skipped (cuma_torch_disown). A handful at most: one
 * is set just before its storage dies, inside a compaction's mover. Slots are claimed and
 * emptied with compare-and-swap; `disowned` counts the claimed ones so that the free of
 * every other tensor pays one atomic load. */
enum { DISOWN_SLOTS = 64 };
static _Atomic(uintptr_t) disown_slot[DISOWN_SLOTS];
static _Atomic unsigned disowned;

static bool take_disowned(uintptr_t p) {
    if (!atomic_load_explicit(&disowned, memory_order_acquire)) return false;
    for (int i = 0; i < DISOWN_SLOTS; i++) {
        uintptr_t want = p;
        if (atomic_compare_exchange_strong(&disown_slot[i], &want, 0)) {
            atomic_fetch_sub(&disowned, 1);
            return true;
        }
    }
    return false;
}

cuma_status cuma_torch_disown(void *ptr) {
    if (!ptr) return cuma_fail(CUMA_ERR_INVALID, "cuma_torch_disown: ptr is NULL");
    for (int i = 0; i < DISOWN_SLOTS; i++) {
        uintptr_t want = 0;
        if (atomic_compare_exchange_strong(&disown_slot[i], &want, (uintptr_t)ptr)) {
            atomic_fetch_add(&disowned, 1);
            return CUMA_OK;
        }
    }
    return cuma_fail(CUMA_ERR_LIMIT,
                     "cuma_torch_disown: %d pointers already wait for their skipped free",
                     DISOWN_SLOTS);
}

bool cuma_torch_disowned(const void *ptr) {
    for (int i = 0; i < DISOWN_SLOTS && atomic_load(&disowned); i++)
        if (atomic_load(&disown_slot[i]) == (uintptr_t)ptr) return true;
    return false;
}

void cuma_torch_free(void *ptr, ssize_t size, int device, cudaStream_t stream) {
    /* The heap knows the block's size (PyTorch's may be rounded differently) and the stream it
     * was allocated on, which is what PyTorch means to pass here (other streams come through
     * record_stream); some PyTorch releases (2.5-2.9) could pass another allocation's stream. */
    (void)size, (void)stream;
    if (!ptr || take_disowned((uintptr_t)ptr)) return;
    cuma_heap *h = cuma_default_heap_peek(device);
    if (h) {
        cuma_status st = cuma_free(h, ptr, NULL);
        if (st == CUMA_OK) return;
        /* The heap refused for another reason than the pointer (one a forked child inherited,
         * say): that reason, not a search of the other heaps that ends in "not a live
         * allocation", is what the user must read. */
        if (st != CUMA_ERR_BAD_POINTER) {
            report("free");
            return;
        }
    }
    /* Not on the device PyTorch named (or that heap does not exist): a wrong device ordinal
     * must not leak the block, so ask the others before calling it a bad pointer. */
    for (int d = 0; d < CUMA_MAX_DEFAULT_HEAPS; d++) {
        cuma_heap *o = cuma_default_heap_peek(d);
        size_t bs;
        if (!o || o == h || cuma_block_size(o, ptr, &bs) != CUMA_OK) continue;
        if (cuma_free(o, ptr, NULL) != CUMA_OK) report("free");
        return;
    }
    cuma_fail(
        CUMA_ERR_BAD_POINTER,
        "cuma_torch_free: pointer %p (device %d) is not a live allocation of any default heap", ptr,
        device);
    report("free");
}

void cuma_torch_init(int device_count) {
    if (device_count > CUMA_MAX_DEFAULT_HEAPS)
        fprintf(stderr, "cuma: init: %d devices; only ordinals 0..%d get a heap\n", device_count,
                CUMA_MAX_DEFAULT_HEAPS - 1);
    const char *conf = getenv("CUMA_CONF");
    if (conf && cuma_config_check(conf) != CUMA_OK) report("init: CUMA_CONF");
}

void cuma_torch_reset(void) {
    for (int d = 0; d < CUMA_MAX_DEFAULT_HEAPS; d++) {
        cuma_heap *h = cuma_default_heap_peek(d);
        if (h) cuma_trim(h, 0);
    }
}

void cuma_torch_memory_fraction(double fraction, int device) {
    cuma_heap *h;
    cuma_status st = cuma_default_heap(device, &h);
    if (st == CUMA_OK) st = cuma_set_memory_fraction(h, fraction);
    if (st != CUMA_OK) report("memory_fraction");
}

void cuma_torch_record_stream(void *ptr, cudaStream_t stream) {
    if (!ptr) return;
    /* PyTorch does not say which device: the heap whose live table holds ptr is the owner.
     * At most a few heaps exist and each lookup is one hash probe. */
    for (int d = 0; d < CUMA_MAX_DEFAULT_HEAPS; d++) {
        cuma_heap *h = cuma_default_heap_peek(d);
        size_t bs;
        if (!h || cuma_block_size(h, ptr, &bs) != CUMA_OK) continue;
        if (cuma_record_stream(h, ptr, (cuma_stream)stream) != CUMA_OK) report("record_stream");
        return;
    }
    /* Not cuma's: PyTorch hands the hook every tensor's storage, also memory it did not get
     * from the allocator (torch.from_blob, DLPack, another process's through IPC), which its
     * own allocator skips without a word; so does this (NCCL records a stream on every
     * collective's buffers). */
}

int cuma_torch_stats_json(int device, char *buf, size_t len) {
    cuma_heap *h;
    cuma_status st = cuma_default_heap(device, &h);
    if (st != CUMA_OK) return -(int)st;
    size_t needed = 0;
    st = cuma_stats_json(h, buf, len, &needed);
    /* A short buffer is not a failure here: the length tells the caller what to retry with. */
    if (st != CUMA_OK && needed < len) return -(int)st;
    if (st != CUMA_OK) cuma_clear_error();
    return needed > INT_MAX ? INT_MAX : (int)needed;
}

cuma_heap *cuma_torch_created_heap(int device) {
    return cuma_default_heap_peek(device);
}
