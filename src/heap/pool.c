// SPDX-License-Identifier: Apache-2.0
/* Fixed-size pools: one carve from a heap, handed out block by block from a stack of free
 * indices (include/cuma/pool.h). */
#include "heap/pools.h"

#include "util/error.h"
#include "heap/heap.h"

#include <assert.h>
#include <stdlib.h>
#include <string.h>

/* A pool: `count` blocks of `stride` bytes from `base`, block i at base + i * stride.
 *
 * Invariants (cuma_pool_validate; under lock):
 *   - base is the start of a live allocation of `heap` of at least count * stride bytes, and
 *     CUMA_POOL_ALIGN-aligned; stride is size rounded up to CUMA_POOL_ALIGN, size >= 1,
 *     1 <= count <= UINT32_MAX, count * stride fits in size_t;
 *   - nfree <= count; stack[0 .. nfree) holds nfree distinct indices below count, each of a
 *     block with out[i] == 0 (free), the top (the next one handed out) at nfree - 1;
 *   - every other block has out[i] == 1 (handed out), so count - nfree blocks are out, and the
 *     heap's pool_in_use counts them.
 * Debug builds assert the part a call touches (check_one) at every call, and the whole walk
 * when a pool is made or destroyed. */
struct cuma_pool {
    /* Constant after creation. */
    cuma_heap *heap; /* the heap the carve is from */
    cuma_stream stream;
    uint64_t base;
    size_t size, stride;
    uint32_t count;
    /* The heap's pool list (under heap->pool_lock). */
    struct cuma_pool *next, *prev;
    pthread_mutex_t lock; /* guards everything below */
    uint32_t nfree;
    uint32_t *stack;    /* count slots; the free indices are the first nfree */
    unsigned char *out; /* count flags: 1 while the block is handed out */
    uint64_t steps;     /* stack slots read or written so far (cuma_pool_steps) */
};

static const char *check(const cuma_pool *p) {
    if (!p->size || p->stride < p->size || p->stride % CUMA_POOL_ALIGN)
        return "the stride is not the size rounded up to the pool alignment";
    if (!p->count || p->stride > SIZE_MAX / p->count) return "the block count is out of range";
    if (p->base % CUMA_POOL_ALIGN) return "the carve is not aligned";
    if (p->nfree > p->count) return "more free blocks than blocks";
    uint32_t nout = 0;
    for (uint32_t i = 0; i < p->count; i++) {
        if (p->out[i] > 1) return "a block's state is neither free nor out";
        nout += p->out[i];
    }
    if (nout != p->count - p->nfree) return "the blocks marked out differ from count - nfree";
    /* Each free index once: marked 2 while walked, put back after. */
    const char *why = NULL;
    uint32_t k = 0;
    for (; k < p->nfree && !why; k++) {
        uint32_t i = p->stack[k];
        if (i >= p->count)
            why = "a free-stack index is past the last block";
        else if (p->out[i])
            why = p->out[i] == 2 ? "a block is on the free stack twice"
                                 : "a block on the free stack is marked out";
        else
            p->out[i] = 2;
    }
    for (uint32_t j = 0; j < k; j++)
        if (p->stack[j] < p->count && p->out[p->stack[j]] == 2) p->out[p->stack[j]] = 0;
    return why;
}

/* What one call on block i must have left (lock held). */
__attribute__((unused)) static inline bool check_one(const cuma_pool *p, uint32_t i, bool out) {
    return p->nfree <= p->count && i < p->count && p->out[i] == out &&
           (out || (p->nfree && p->stack[p->nfree - 1] == i));
}

cuma_status cuma_pool_validate(cuma_pool *p) {
    if (!p) return cuma_fail(CUMA_ERR_INVALID, "cuma_pool_validate: pool is NULL");
    cuma_mutex_lock(&p->lock, CUMA_RANK_POOL);
    const char *why = check(p);
    cuma_mutex_unlock(&p->lock);
    size_t live = 0;
    if (!why && (cuma_block_size(p->heap, (void *)(uintptr_t)p->base, &live) ||
                 live < p->count * p->stride))
        why = "the carve is not a live allocation of the heap as large as the pool";
    if (why) return cuma_fail(CUMA_ERR_CORRUPT, "cuma_pool_validate: pool %p: %s", (void *)p, why);
    return CUMA_OK;
}

static void pool_free_host(cuma_pool *p) {
    pthread_mutex_destroy(&p->lock);
    free(p->stack);
    free(p->out);
    free(p);
}

cuma_status cuma_pool_create(cuma_heap *heap, size_t size, size_t count, cuma_stream stream,
                             cuma_pool **out) {
    if (!heap || !out)
        return cuma_fail(CUMA_ERR_INVALID, "cuma_pool_create: %s is NULL", heap ? "out" : "heap");
    *out = NULL;
    if (!size || !count)
        return cuma_fail(CUMA_ERR_INVALID, "cuma_pool_create: %s is 0 (size %zu, count %zu)",
                         size ? "count" : "size", size, count);
    if (count > UINT32_MAX)
        return cuma_fail(CUMA_ERR_INVALID, "cuma_pool_create: count %zu is over %u blocks", count,
                         UINT32_MAX);
    if (size > SIZE_MAX - (CUMA_POOL_ALIGN - 1))
        return cuma_fail(CUMA_ERR_INVALID, "cuma_pool_create: block size %zu overflows", size);
    size_t stride = (size + CUMA_POOL_ALIGN - 1) / CUMA_POOL_ALIGN * CUMA_POOL_ALIGN;
    if (stride > SIZE_MAX / count)
        return cuma_fail(CUMA_ERR_INVALID,
                         "cuma_pool_create: %zu blocks of %zu bytes (stride %zu) overflow size_t",
                         count, size, stride);
    cuma_pool *p = calloc(1, sizeof *p);
    if (p) p->stack = malloc(count * sizeof *p->stack);
    if (p) p->out = calloc(count, 1);
    if (!p || !p->stack || !p->out) {
        if (p) free(p->stack), free(p->out), free(p);
        return cuma_fail(CUMA_ERR_OOM, "cuma_pool_create: no host memory for %zu blocks' index",
                         count);
    }
    void *base = NULL;
    cuma_status st = cuma_alloc(heap, count * stride, stream, &base);
    if (st) {
        cuma_error_saved why;
        cuma_error_save(&why);
        free(p->stack), free(p->out), free(p);
        return cuma_fail(st, "cuma_pool_create: %zu blocks of %zu bytes (%zu in all): %s", count,
                         size, count * stride, why.text);
    }
    p->heap = heap, p->stream = stream, p->base = (uint64_t)(uintptr_t)base;
    p->size = size, p->stride = stride, p->count = (uint32_t)count, p->nfree = (uint32_t)count;
    /* Block 0 on top: a fresh pool hands blocks out in address order. */
    for (uint32_t k = 0; k < p->count; k++) p->stack[k] = p->count - 1 - k;
    pthread_mutex_init(&p->lock, NULL);
    assert(!check(p));
    cuma_mutex_lock(&heap->pool_lock, CUMA_RANK_POOL_LIST);
    p->next = heap->pool_list;
    if (p->next) p->next->prev = p;
    heap->pool_list = p;
    atomic_fetch_add(&heap->pool_count, 1);
    atomic_fetch_add(&heap->pool_bytes, count * stride);
    atomic_fetch_add(&heap->pool_blocks, count);
    cuma_mutex_unlock(&heap->pool_lock);
    *out = p;
    return CUMA_OK;
}

cuma_status cuma_pool_destroy(cuma_pool *p) {
    if (!p) return CUMA_OK;
    cuma_heap *h = p->heap;
    if (atomic_load(&h->inherited)) return cuma_heap_inherited(h, "cuma_pool_destroy");
    cuma_mutex_lock(&p->lock, CUMA_RANK_POOL);
    uint32_t nout = p->count - p->nfree;
    assert(!check(p));
    cuma_mutex_unlock(&p->lock);
    if (nout)
        return cuma_fail(CUMA_ERR_INVALID,
                         "cuma_pool_destroy: %u of the pool's %u blocks are still allocated; free "
                         "them first (the pool is left as it was)",
                         nout, p->count);
    cuma_status st = cuma_free(h, (void *)(uintptr_t)p->base, p->stream);
    if (st) return st; /* the heap's message: the carve stays, and so does the pool */
    cuma_mutex_lock(&h->pool_lock, CUMA_RANK_POOL_LIST);
    if (p->prev)
        p->prev->next = p->next;
    else
        h->pool_list = p->next;
    if (p->next) p->next->prev = p->prev;
    atomic_fetch_sub(&h->pool_count, 1);
    atomic_fetch_sub(&h->pool_bytes, (uint64_t)p->count * p->stride);
    atomic_fetch_sub(&h->pool_blocks, p->count);
    cuma_mutex_unlock(&h->pool_lock);
    pool_free_host(p);
    return CUMA_OK;
}

cuma_status cuma_pool_alloc(cuma_pool *p, void **ptr) {
    if (!p || !ptr)
        return cuma_fail(CUMA_ERR_INVALID, "cuma_pool_alloc: %s is NULL", p ? "ptr" : "pool");
    if (atomic_load_explicit(&p->heap->inherited, memory_order_relaxed))
        return cuma_heap_inherited(p->heap, "cuma_pool_alloc");
    cuma_mutex_lock(&p->lock, CUMA_RANK_POOL);
    if (!p->nfree) {
        cuma_mutex_unlock(&p->lock);
        return cuma_fail(CUMA_ERR_OOM,
                         "cuma_pool_alloc: out of memory: all %u blocks of %zu bytes of pool %p "
                         "are in use",
                         p->count, p->size, (void *)p);
    }
    uint32_t i = p->stack[--p->nfree];
    p->out[i] = 1;
    p->steps++;
    assert(check_one(p, i, true));
    cuma_mutex_unlock(&p->lock);
    atomic_fetch_add_explicit(&p->heap->pool_in_use, 1, memory_order_relaxed);
    *ptr = (void *)(uintptr_t)(p->base + (uint64_t)i * p->stride);
    return CUMA_OK;
}

cuma_status cuma_pool_free(cuma_pool *p, void *ptr) {
    if (!p) return cuma_fail(CUMA_ERR_INVALID, "cuma_pool_free: pool is NULL");
    if (!ptr) return CUMA_OK;
    if (atomic_load_explicit(&p->heap->inherited, memory_order_relaxed))
        return cuma_heap_inherited(p->heap, "cuma_pool_free");
    uint64_t off = (uint64_t)(uintptr_t)ptr - p->base; /* wraps below base: past the end */
    if (off >= (uint64_t)p->count * p->stride)
        return cuma_fail(CUMA_ERR_BAD_POINTER,
                         "cuma_pool_free: pointer %p is not in pool %p (its %u blocks of %zu "
                         "bytes span 0x%llx-0x%llx)",
                         ptr, (void *)p, p->count, p->stride, (unsigned long long)p->base,
                         (unsigned long long)(p->base + (uint64_t)p->count * p->stride));
    if (off % p->stride)
        return cuma_fail(CUMA_ERR_BAD_POINTER,
                         "cuma_pool_free: pointer %p is %llu bytes inside block %llu of pool %p, "
                         "not at its start",
                         ptr, (unsigned long long)(off % p->stride),
                         (unsigned long long)(off / p->stride), (void *)p);
    uint32_t i = (uint32_t)(off / p->stride);
    cuma_mutex_lock(&p->lock, CUMA_RANK_POOL);
    if (!p->out[i]) {
        cuma_mutex_unlock(&p->lock);
        return cuma_fail(CUMA_ERR_BAD_POINTER,
                         "cuma_pool_free: block %u at %p of pool %p is already free (double free)",
                         i, ptr, (void *)p);
    }
    p->out[i] = 0;
    p->stack[p->nfree++] = i;
    p->steps++;
    assert(check_one(p, i, false));
    cuma_mutex_unlock(&p->lock);
    atomic_fetch_sub_explicit(&p->heap->pool_in_use, 1, memory_order_relaxed);
    return CUMA_OK;
}

cuma_status cuma_pool_info(cuma_pool *p, size_t *block_size, size_t *count, size_t *in_use) {
    if (!p) return cuma_fail(CUMA_ERR_INVALID, "cuma_pool_info: pool is NULL");
    cuma_mutex_lock(&p->lock, CUMA_RANK_POOL);
    if (block_size) *block_size = p->stride;
    if (count) *count = p->count;
    if (in_use) *in_use = p->count - p->nfree;
    cuma_mutex_unlock(&p->lock);
    return CUMA_OK;
}

uint64_t cuma_pool_steps(cuma_pool *p) {
    cuma_mutex_lock(&p->lock, CUMA_RANK_POOL);
    uint64_t n = p->steps;
    cuma_mutex_unlock(&p->lock);
    return n;
}

void cuma_pools_destroy_all(cuma_heap *h) {
    cuma_pool *p = h->pool_list;
    h->pool_list = NULL;
    while (p) {
        cuma_pool *next = p->next;
        pool_free_host(p);
        p = next;
    }
    atomic_store(&h->pool_count, 0);
    atomic_store(&h->pool_bytes, 0);
    atomic_store(&h->pool_blocks, 0);
    atomic_store(&h->pool_in_use, 0);
}

const char *cuma_pools_check(cuma_heap *h) {
    uint64_t n = 0, bytes = 0, blocks = 0, out = 0;
    const char *why = NULL;
    cuma_mutex_lock(&h->pool_lock, CUMA_RANK_POOL_LIST);
    for (cuma_pool *p = h->pool_list; p && !why; p = p->next) {
        if (p->heap != h || (p->next && p->next->prev != p) || (!p->prev) != (p == h->pool_list))
            why = "the heap's pool list is broken";
        cuma_mutex_lock(&p->lock, CUMA_RANK_POOL);
        if (!why) why = check(p);
        n++, bytes += (uint64_t)p->count * p->stride, blocks += p->count;
        out += p->count - p->nfree;
        cuma_mutex_unlock(&p->lock);
    }
    cuma_mutex_unlock(&h->pool_lock);
    if (!why && (n != atomic_load(&h->pool_count) || bytes != atomic_load(&h->pool_bytes) ||
                 blocks != atomic_load(&h->pool_blocks) || out != atomic_load(&h->pool_in_use)))
        why = "the heap's pool figures differ from its pools' sums";
    return why;
}

void cuma_pools_prefork(cuma_heap *h) {
    cuma_mutex_lock(&h->pool_lock, CUMA_RANK_POOL_LIST);
    for (cuma_pool *p = h->pool_list; p; p = p->next) cuma_mutex_lock(&p->lock, CUMA_RANK_POOL);
}

void cuma_pools_postfork(cuma_heap *h) {
    for (cuma_pool *p = h->pool_list; p; p = p->next) cuma_mutex_unlock(&p->lock);
    cuma_mutex_unlock(&h->pool_lock);
}

bool cuma_pools_owns(cuma_heap *h, uint64_t addr) {
    bool found = false;
    cuma_mutex_lock(&h->pool_lock, CUMA_RANK_POOL_LIST);
    for (cuma_pool *p = h->pool_list; p && !found; p = p->next) found = p->base == addr;
    cuma_mutex_unlock(&h->pool_lock);
    return found;
}
