// SPDX-License-Identifier: Apache-2.0
/* The thread caches' fast paths (tcache.h says how the caches work), inline in cuma_alloc and
 * cuma_free: a call into another file costs a frame and the saving of registers on every
 * alloc+free pair, a fifth of the pair's instructions. */
#ifndef CUMA_HEAP_TCACHE_FAST_H
#define CUMA_HEAP_TCACHE_FAST_H

#include "heap/heap.h"
#include "heap/tcache.h"

/* The size a request a thread cache may serve is rounded to: granules up to 4 KiB, then eight
 * classes per power of two (at most 1/8 more). A cache keeps blocks by exact size, and a program
 * whose sizes drift a little from step to step (a sequence that grows by a token) would miss on
 * every new size; in a class, the block freed a step ago serves the next. The slack costs
 * address space, not memory: pages are mapped under the requested bytes only. */
static inline uint64_t cuma_tc_round(uint64_t size) {
    uint64_t n = (size + CUMA_GRANULE - 1) & ~(uint64_t)(CUMA_GRANULE - 1);
    if (n <= 4096) return n;
    uint64_t step = 1ull << (60 - __builtin_clzll(n)); /* an eighth of n's top power of two */
    return (n + step - 1) & ~(step - 1);
}

/* Records a block the owner handed out in its pointer table (tcache.c). */
void cuma_tcache_tab_put(cuma_tcache *tc, uint64_t key, cuma_block *b, uint64_t gen);

/* A block's bin: its size class (cuma_tc_round: 0-7 the granules up to 4 KiB, then 8 per power
 * of two, 72 at 1 MiB, 120 at 64 MiB), so that the sizes a thread uses at once never share a
 * bin on one stream; other streams' bins are the same spread by a stride. Sizes that are not
 * a class (another policy's rounding) land in the class below and find no match there. */
static inline unsigned cuma_tc_bin_of(uint64_t n, unsigned stream) {
    unsigned c;
    if (n <= 4096) {
        c = (unsigned)(n >> 9) - 1;
    } else {
        unsigned b = 63u - (unsigned)__builtin_clzll(n);
        c = 8u * (b - 11u) + (unsigned)(n >> (b - 3)) - 8u;
    }
    return (c + stream * 37u) & (CUMA_TC_BINS - 1);
}

/* The owner's pointer table: 4-way set-associative by address, no probing and no shifting. An
 * entry that finds every way taken is not recorded and its free takes the slow path, which is
 * always correct (the heap's own table knows every block). */
/* Hashed by offset from the heap's base, so that which blocks collide (and so which frees take
 * the slow path) does not depend on where the heap's range happens to lie: replays repeat. */
static inline uint32_t cuma_tc_key_slot(const cuma_tcache *tc, uint64_t key, uint32_t cap) {
    uint64_t x = ((key - tc->base) >> 9) * 0x9E3779B97F4A7C15ull;
    return (uint32_t)((x ^ (x >> 29)) >> 20) & (cap - 4);
}

static inline cuma_tc_entry *cuma_tc_tab_find(cuma_tcache *tc, uint64_t key) {
    if (!tc->tabcap) return NULL;
    cuma_tc_entry *e = &tc->tab[cuma_tc_key_slot(tc, key, tc->tabcap)];
    for (int w = 0; w < 4; w++)
        if (e[w].key == key) return &e[w];
    return NULL;
}

static inline void cuma_tc_tab_remove(cuma_tcache *tc, cuma_tc_entry *e) {
    e->key = 0;
    tc->tabn--;
}

static inline int cuma_tc_stream_index(const cuma_tcache *tc, cuma_stream s) {
    /* A stream was retired since the map was made: its handle may name a new stream now. */
    if (__builtin_expect(tc->stream_gen !=
                             atomic_load_explicit(&tc->arena->stream_gen, memory_order_relaxed),
                         0))
        return -1;
    for (unsigned i = 0; i < tc->nstreams; i++)
        if (tc->streams[i].handle == s) return tc->streams[i].index;
    return -1;
}

/* Counters are the owner's: a load and a store, no read-modify-write. */
#define CUMA_TC_BUMP(field, d)                                                                     \
    atomic_store_explicit(&tc->field,                                                              \
                          atomic_load_explicit(&tc->field, memory_order_relaxed) + (d),            \
                          memory_order_relaxed)

static inline void cuma_tc_note_peaks(cuma_tcache *tc) {
    cuma_heap *h = tc->heap;
    int64_t req = tc->others_req +
                  atomic_load_explicit(&tc->arena->pub[CUMA_PUB_REQUESTED], memory_order_relaxed) +
                  atomic_load_explicit(&tc->requested, memory_order_relaxed);
    uint64_t peak = atomic_load_explicit(&h->peak_req, memory_order_relaxed);
    while (req > 0 && (uint64_t)req > peak &&
           !atomic_compare_exchange_weak_explicit(&h->peak_req, &peak, (uint64_t)req,
                                                  memory_order_relaxed, memory_order_relaxed)) {
    }
}

__attribute__((always_inline)) static inline bool
cuma_tcache_alloc(cuma_tcache *tc, uint64_t size, uint64_t n, cuma_stream stream, void **ptr) {
    int si = cuma_tc_stream_index(tc, stream);
    if (si < 0) return false;
    cuma_tc_bin *bin = &tc->bins[cuma_tc_bin_of(n, (unsigned)si)];
    if (bin->size != n || bin->stream != si || !bin->n) return false;
    cuma_block *b = NULL;
    while (bin->n && !b) {
        b = atomic_exchange_explicit(&bin->slot[--bin->n], NULL, memory_order_acquire);
        tc->held -= n; /* popped, or taken by a flush */
    }
    if (!b) return false;
    unsigned sh = tc->page_shift;
    if (sh && ((b->off + size - 1) >> sh) != ((b->off + b->mapped_len - 1) >> sh)) {
        /* The request ends on another page than the block's mapped bytes: the slow path must
         * change page references. Put it back. */
        atomic_store_explicit(&bin->slot[bin->n++], b, memory_order_release);
        tc->held += n;
        return false;
    }
    b->req = size;
    b->stream = (uint16_t)si;
    uint64_t g = atomic_load_explicit(&b->gen, memory_order_relaxed) + 1;
    atomic_store_explicit(&b->gen, g, memory_order_release);
    uint64_t addr = tc->base + b->off;
    /* The slot its last free emptied is in the right set for this address: take it again
     * unless the table was rebuilt since or someone else took it. */
    cuma_tc_entry *e = tc->tab + b->tc_slot;
    if (b->tc_tabgen == tc->tabgen && b->tc_slot < tc->tabcap && !e->key) {
        *e = (cuma_tc_entry){addr, b, g};
        tc->tabn++;
    } else {
        cuma_tcache_tab_put(tc, addr, b, g);
    }
    CUMA_TC_BUMP(requested, (int64_t)size);
    CUMA_TC_BUMP(allocated, (int64_t)n);
    CUMA_TC_BUMP(allocs, 1);
    cuma_tc_note_peaks(tc);
    *ptr = (void *)(uintptr_t)addr;
    return true;
}

__attribute__((always_inline)) static inline cuma_tc_result
cuma_tcache_free(cuma_tcache *tc, uint64_t addr, cuma_stream stream) {
    cuma_tc_entry *e = cuma_tc_tab_find(tc, addr);
    if (!e) return CUMA_TC_MISS;
    cuma_block *b = e->b;
    uint64_t g = e->gen;
    if (atomic_load_explicit(&b->gen, memory_order_acquire) != g) {
        cuma_tc_tab_remove(tc,
                           e); /* freed by another thread meanwhile: the slow path sorts it out */
        return CUMA_TC_MISS;
    }
    if (b->extra[0] != CUMA_NO_STREAM || b->extra_all) return CUMA_TC_MISS; /* deferred */
    int si = stream ? cuma_tc_stream_index(tc, stream) : b->stream;
    if (si < 0) return CUMA_TC_MISS;
    uint64_t n = b->size;
    cuma_tc_bin *bin = &tc->bins[cuma_tc_bin_of(n, (unsigned)si)];
    bool to_bin = n <= tc->max_block && tc->held + n <= tc->max_bytes && bin->n < CUMA_TC_DEPTH &&
                  (!bin->n || (bin->size == n && bin->stream == si));
    if (!atomic_compare_exchange_strong_explicit(&b->gen, &g, g + 1, memory_order_acq_rel,
                                                 memory_order_relaxed)) {
        cuma_tc_tab_remove(tc, e);
        return CUMA_TC_MISS;
    }
    CUMA_TC_BUMP(requested, -(int64_t)b->req);
    CUMA_TC_BUMP(allocated, -(int64_t)n);
    CUMA_TC_BUMP(frees, 1);
    b->tc_slot = (uint32_t)(e - tc->tab), b->tc_tabgen = tc->tabgen;
    cuma_tc_tab_remove(tc, e);
    b->stream = (uint16_t)si; /* the stream it was last used on: its fence when flushed */
    uint64_t now = atomic_load_explicit(&tc->arena->coarse_now, memory_order_relaxed);
    if (!to_bin) {
        if (!tc->npending) atomic_store_explicit(&tc->pending_stamp, now, memory_order_relaxed);
        atomic_store_explicit(&tc->pending[tc->npending++], b, memory_order_release);
        return tc->npending == CUMA_TC_PENDING ? CUMA_TC_DRAIN : CUMA_TC_DONE;
    }
    if (!bin->n) bin->size = n, bin->stream = (uint16_t)si;
    atomic_store_explicit(&bin->stamp, now, memory_order_relaxed);
    atomic_store_explicit(&bin->slot[bin->n++], b, memory_order_release);
    tc->held += n;
    return CUMA_TC_DONE;
}

#endif
