// SPDX-License-Identifier: Apache-2.0
/* The PyTorch caching-allocator model (torch_model.h): blocks, pools, malloc, free, the
 * release steps, and the replay of a trace. */
#include "torch_model.h"

#include "util/error.h"

#include <assert.h>
#include <stdlib.h>
#include <string.h>

#define SEGMENT_ALIGN ((uint64_t)2 << 20) /* made-up segment addresses are 2 MiB aligned */

#ifdef NDEBUG
#define CHECK_MODEL(m) ((void)0)
#else
#define CHECK_MODEL(m) assert(cuma_tm_validate(m) == CUMA_OK)
#endif

/* ---- sizes ---------------------------------------------------------------------------------- */

static unsigned log2_floor(uint64_t v) {
    return 63u - (unsigned)__builtin_clzll(v);
}

static uint32_t divisions_for(const cuma_tm_conf *c, uint64_t size) {
    unsigned lg = log2_floor(size), start = 20; /* intervals start at 1 MiB */
    unsigned idx = lg > start ? lg - start : 0;
    if (idx >= CUMA_TM_DIV_INTERVALS) idx = CUMA_TM_DIV_INTERVALS - 1;
    return c->divisions[idx];
}

/* size rounded up to the next of `div` equal steps between two powers of two. */
static uint64_t power2_division(uint64_t size, uint32_t div) {
    if (size <= 4 || (size & (size - 1)) == 0) return size;
    uint64_t floor2 = (uint64_t)1 << log2_floor(size);
    uint64_t step = floor2 >> log2_floor(div);
    if (step == 0) return floor2 << 1;
    uint64_t down = size & ~(step - 1);
    return down == size ? size : down + step;
}

uint64_t cuma_tm_round_size(const cuma_tm_conf *c, uint64_t size) {
    if (size < CUMA_TM_MIN_BLOCK) return CUMA_TM_MIN_BLOCK;
    uint32_t div = divisions_for(c, size);
    if (div > 1 && size > (uint64_t)CUMA_TM_MIN_BLOCK * div) return power2_division(size, div);
    return (size + CUMA_TM_MIN_BLOCK - 1) / CUMA_TM_MIN_BLOCK * CUMA_TM_MIN_BLOCK;
}

uint64_t cuma_tm_segment_size(uint64_t rounded) {
    if (rounded <= CUMA_TM_SMALL_SIZE) return CUMA_TM_SMALL_BUFFER;
    if (rounded < CUMA_TM_MIN_LARGE) return CUMA_TM_LARGE_BUFFER;
    return (rounded + CUMA_TM_ROUND_LARGE - 1) / CUMA_TM_ROUND_LARGE * CUMA_TM_ROUND_LARGE;
}

/* ---- blocks and pools ----------------------------------------------------------------------- */

/* Host memory for what one malloc or free may add (two block slots, one pool entry), taken
 * before anything changes, so the steps after it cannot fail halfway. -1: out of memory. */
static int reserve(cuma_tm *m, cuma_tm_pool *p) {
    if (m->nb + 2 > m->capb) {
        size_t cap = m->capb ? m->capb * 2 : 256;
        if (cap > INT32_MAX) return -1;
        cuma_tm_block *nb = realloc(m->b, cap * sizeof *nb);
        if (!nb) return -1;
        m->b = nb;
        m->capb = cap;
    }
    if (p->n + 1 > p->cap) {
        size_t cap = p->cap ? p->cap * 2 : 64;
        int32_t *ids = realloc(p->ids, cap * sizeof *ids);
        if (!ids) return -1;
        p->ids = ids;
        p->cap = cap;
    }
    return 0;
}

/* A fresh slot (room was reserved). */
static int32_t new_block(cuma_tm *m) {
    if (m->spare >= 0) {
        int32_t id = m->spare;
        m->spare = m->b[id].next;
        memset(&m->b[id], 0, sizeof m->b[id]);
        m->b[id].in_use = 1;
        return id;
    }
    assert(m->nb < m->capb);
    int32_t id = (int32_t)m->nb++;
    memset(&m->b[id], 0, sizeof m->b[id]);
    m->b[id].in_use = 1;
    return id;
}

static void drop_block(cuma_tm *m, int32_t id) {
    m->b[id].in_use = 0;
    m->b[id].next = m->spare;
    m->spare = id;
}

/* <0, 0, >0 as block a sorts before, with, after the key (stream, size, addr). */
static int key_cmp(const cuma_tm_block *a, uint64_t stream, uint64_t size, uint64_t addr) {
    if (a->stream != stream) return a->stream < stream ? -1 : 1;
    if (a->size != size) return a->size < size ? -1 : 1;
    if (a->addr != addr) return a->addr < addr ? -1 : 1;
    return 0;
}

/* The first position whose block is not before the key. */
static size_t lower_bound(const cuma_tm *m, const cuma_tm_pool *p, uint64_t stream, uint64_t size,
                          uint64_t addr) {
    size_t lo = 0, hi = p->n;
    while (lo < hi) {
        size_t mid = lo + (hi - lo) / 2;
        if (key_cmp(&m->b[p->ids[mid]], stream, size, addr) < 0)
            lo = mid + 1;
        else
            hi = mid;
    }
    return lo;
}

/* Puts free block id in its pool (room was reserved). */
static void pool_insert(cuma_tm *m, int32_t id) {
    cuma_tm_block *b = &m->b[id];
    cuma_tm_pool *p = &m->pool[b->large];
    assert(p->n < p->cap);
    size_t at = lower_bound(m, p, b->stream, b->size, b->addr);
    memmove(p->ids + at + 1, p->ids + at, (p->n - at) * sizeof *p->ids);
    p->ids[at] = id;
    p->n++;
    b->gc_base = p->calls - b->gc_count;
}

static void pool_remove_at(cuma_tm *m, cuma_tm_pool *p, size_t at) {
    cuma_tm_block *b = &m->b[p->ids[at]];
    b->gc_count = (uint32_t)(p->calls - b->gc_base);
    memmove(p->ids + at, p->ids + at + 1, (p->n - at - 1) * sizeof *p->ids);
    p->n--;
}

static void pool_remove(cuma_tm *m, int32_t id) {
    cuma_tm_block *b = &m->b[id];
    cuma_tm_pool *p = &m->pool[b->large];
    size_t at = lower_bound(m, p, b->stream, b->size, b->addr);
    assert(at < p->n && p->ids[at] == id);
    pool_remove_at(m, p, at);
}

/* Expandable segments' unmapped blocks, sorted by (stream, address). */
static size_t um_lower_bound(const cuma_tm *m, const cuma_tm_pool *p, uint64_t stream,
                             uint64_t addr) {
    size_t lo = 0, hi = p->n;
    while (lo < hi) {
        size_t mid = lo + (hi - lo) / 2;
        const cuma_tm_block *b = &m->b[p->ids[mid]];
        if (b->stream < stream || (b->stream == stream && b->addr < addr))
            lo = mid + 1;
        else
            hi = mid;
    }
    return lo;
}

/* Room for one more unmapped block in pool `large`'s set. -1: out of host memory. */
static int um_reserve(cuma_tm *m, int large) {
    cuma_tm_pool *p = &m->unmapped[large];
    if (p->n < p->cap) return 0;
    size_t cap = p->cap ? p->cap * 2 : 16;
    int32_t *ids = realloc(p->ids, cap * sizeof *ids);
    if (!ids) return -1;
    p->ids = ids;
    p->cap = cap;
    return 0;
}

/* Puts unmapped block id in its set (room was reserved). */
static void um_insert(cuma_tm *m, int32_t id) {
    cuma_tm_block *b = &m->b[id];
    cuma_tm_pool *p = &m->unmapped[b->large];
    assert(p->n < p->cap);
    size_t at = um_lower_bound(m, p, b->stream, b->addr);
    memmove(p->ids + at + 1, p->ids + at, (p->n - at) * sizeof *p->ids);
    p->ids[at] = id;
    p->n++;
}

static void um_remove(cuma_tm *m, int32_t id) {
    cuma_tm_block *b = &m->b[id];
    cuma_tm_pool *p = &m->unmapped[b->large];
    size_t at = um_lower_bound(m, p, b->stream, b->addr);
    assert(at < p->n && p->ids[at] == id);
    memmove(p->ids + at, p->ids + at + 1, (p->n - at - 1) * sizeof *p->ids);
    p->n--;
}

/* A free block leaves its set: the pool (mapped) or the unmapped blocks. */
static void detach(cuma_tm *m, int32_t id) {
    if (m->b[id].mapped)
        pool_remove(m, id);
    else
        um_remove(m, id);
}

/* Whether block nb is a neighbour that a free block of mapping state `mapped` merges with. */
static int mergeable(const cuma_tm *m, int32_t nb, int mapped) {
    return nb >= 0 && !m->b[nb].allocated && !m->b[nb].pending && m->b[nb].mapped == mapped;
}

/* ---- segments ------------------------------------------------------------------------------- */

/* The cap on reserved bytes: the capacity, cut by the memory fraction. 0: none. */
static uint64_t reserve_limit(const cuma_tm_conf *c) {
    if (!c->capacity) return 0;
    if (c->memory_fraction > 0) return (uint64_t)((double)c->capacity * c->memory_fraction);
    return c->capacity;
}

/* A new segment of `size` bytes as one block (not in a pool), or -1 when it does not fit. */
static int32_t alloc_segment(cuma_tm *m, uint64_t size, uint64_t stream, int large) {
    uint64_t limit = reserve_limit(&m->conf);
    if (limit && (size > limit || m->st.reserved > limit - size)) return -1;
    int32_t id = new_block(m);
    cuma_tm_block *b = &m->b[id];
    b->addr = m->next_addr;
    b->size = size;
    b->stream = stream;
    b->prev = b->next = -1;
    b->large = (uint8_t)large;
    b->mapped = 1;
    m->next_addr += (size + SEGMENT_ALIGN - 1) / SEGMENT_ALIGN * SEGMENT_ALIGN;
    m->st.reserved += size;
    if (m->st.reserved > m->st.peak_reserved) m->st.peak_reserved = m->st.reserved;
    m->st.segments_created++;
    return id;
}

/* Gives a free whole segment (in its pool at position `at`) back to the device. */
static void release_at(cuma_tm *m, cuma_tm_pool *p, size_t at) {
    int32_t id = p->ids[at];
    pool_remove_at(m, p, at);
    m->st.reserved -= m->b[id].size;
    m->st.segments_released++;
    drop_block(m, id);
}

/* A fixed segment that is one free block. */
static int whole(const cuma_tm_block *b) {
    return b->prev < 0 && b->next < 0 && !b->expandable;
}

static int unmap_block(cuma_tm *m, int32_t id);

/* Frees the pool's whole fixed segments and unmaps the free pages of its expandable ones. */
static void release_pool(cuma_tm *m, cuma_tm_pool *p) {
    size_t n_exp = 0;
    for (size_t i = p->n; i-- > 0;) {
        if (whole(&m->b[p->ids[i]]))
            release_at(m, p, i);
        else
            n_exp += m->b[p->ids[i]].expandable;
    }
    if (!n_exp) return;
    /* Unmapping changes the pool, so the blocks are gathered first. */
    int32_t *ids = malloc(n_exp * sizeof *ids);
    if (!ids) return; /* host memory: they stay cached */
    size_t k = 0;
    for (size_t i = 0; i < p->n; i++)
        if (m->b[p->ids[i]].expandable) ids[k++] = p->ids[i];
    for (size_t i = 0; i < k && !unmap_block(m, ids[i]); i++) {
    }
    free(ids);
}

void cuma_tm_empty_cache(cuma_tm *m) {
    /* As PyTorch's release synchronizes on the outstanding events first. */
    (void)cuma_tm_process_events(m, UINT64_MAX);
    release_pool(m, &m->pool[0]);
    release_pool(m, &m->pool[1]);
}

/* Frees cached oversize segments of the stream: the smallest one that covers the request's key,
 * else the largest ones until as many bytes are freed. 1 if that was enough. */
static int release_oversize(cuma_tm *m, cuma_tm_pool *p, uint64_t stream, uint64_t rounded) {
    uint64_t split = m->conf.max_split_size;
    if (split == CUMA_TM_NO_SPLIT_LIMIT) return 0;
    uint64_t key = rounded < split ? split : rounded;
    size_t at = lower_bound(m, p, stream, key, 0);
    if (at < p->n && m->b[p->ids[at]].stream == stream) {
        if (!whole(&m->b[p->ids[at]])) return 0;
        release_at(m, p, at);
        return 1;
    }
    uint64_t freed = 0;
    while (freed < key && at > 0) {
        cuma_tm_block *b = &m->b[p->ids[at - 1]];
        if (b->size < split || b->stream != stream) break;
        at--;
        if (!whole(b)) continue;
        freed += b->size;
        release_at(m, p, at);
    }
    return freed >= key;
}

/* Garbage collection before a new segment: while reserved is over the threshold (of the
 * capacity times the memory fraction), frees whole cached large segments whose age is at least
 * the average age, every such one in a pass. */
static void collect(cuma_tm *m) {
    /* As in PyTorch, only a set memory fraction gives the collector its maximum. */
    uint64_t limit = m->conf.memory_fraction > 0 ? reserve_limit(&m->conf) : 0;
    if (m->conf.gc_threshold <= 0 || !limit) return;
    uint64_t mark = (uint64_t)(m->conf.gc_threshold * (double)limit);
    if (m->st.reserved <= mark) return;
    uint64_t target = m->st.reserved - mark, reclaimed = 0, total_age = 0, count = 0;
    cuma_tm_pool *p = &m->pool[1];
    for (size_t i = 0; i < p->n; i++) {
        const cuma_tm_block *b = &m->b[p->ids[i]];
        if (whole(b)) total_age += p->calls - b->gc_base, count++;
    }
    int freed = 1;
    while (reclaimed < target && freed && count) {
        uint64_t age_mark = total_age / count;
        freed = 0;
        for (size_t i = p->n; i-- > 0;) {
            const cuma_tm_block *b = &m->b[p->ids[i]];
            uint64_t age = p->calls - b->gc_base;
            if (!whole(b) || age < age_mark) continue;
            freed = 1;
            reclaimed += b->size;
            total_age -= age;
            count--;
            release_at(m, p, i);
            m->st.gc_releases++;
        }
    }
}

/* ---- malloc and free ------------------------------------------------------------------------ */

/* The cached block a request takes, removed from its pool, or -1. */
static int32_t take_free_block(cuma_tm *m, cuma_tm_pool *p, uint64_t stream, uint64_t rounded) {
    p->calls++;
    size_t at = lower_bound(m, p, stream, rounded, 0);
    if (at == p->n) return -1;
    int32_t id = p->ids[at];
    const cuma_tm_block *b = &m->b[id];
    uint64_t split = m->conf.max_split_size;
    if (b->stream != stream) return -1;
    if (rounded < split && b->size >= split) return -1;
    if (rounded >= split && b->size - rounded >= m->conf.max_non_split_rounding) return -1;
    pool_remove_at(m, p, at);
    m->b[id].gc_count = 0;
    return id;
}

static int32_t try_expandable(cuma_tm *m, uint64_t stream, int large, uint64_t rounded);

/* New device memory for a request: a fixed segment of `seg` bytes, or pages of an expandable
 * segment. -1: it does not fit. */
static int32_t new_memory(cuma_tm *m, uint64_t seg, uint64_t rounded, uint64_t stream, int large) {
    if (m->conf.expandable) return try_expandable(m, stream, large, rounded);
    return alloc_segment(m, seg, stream, large);
}

static int should_split(const cuma_tm *m, const cuma_tm_block *b, uint64_t rounded) {
    uint64_t rest = b->size - rounded;
    if (!b->large || b->expandable) return rest >= CUMA_TM_MIN_BLOCK;
    return rounded < m->conf.max_split_size && rest > CUMA_TM_SMALL_SIZE;
}

cuma_status cuma_tm_malloc(cuma_tm *m, uint64_t size, uint64_t stream, int32_t *id) {
    *id = -1;
    if (size == 0) return cuma_fail(CUMA_ERR_INVALID, "pytorch model: a request of 0 bytes");
    if (size > CUMA_TM_MAX_REQUEST) { /* no device has it: a failed allocation */
        m->st.failed_allocs++;
        return cuma_fail(CUMA_ERR_OOM, "pytorch model: a request of %llu bytes is over 4 EiB",
                         (unsigned long long)size);
    }
    uint64_t rounded = cuma_tm_round_size(&m->conf, size);
    int large = rounded > CUMA_TM_SMALL_SIZE;
    cuma_tm_pool *p = &m->pool[large];
    if (reserve(m, p)) return cuma_fail(CUMA_ERR_OOM, "pytorch model: out of host memory");
    int32_t got = take_free_block(m, p, stream, rounded);
    if (got < 0) {
        uint64_t seg = cuma_tm_segment_size(rounded);
        collect(m);
        got = new_memory(m, seg, rounded, stream, large);
        if (got < 0 && release_oversize(m, p, stream, rounded)) {
            m->st.oversize_releases++;
            got = new_memory(m, seg, rounded, stream, large);
        }
        if (got < 0) {
            cuma_tm_empty_cache(m);
            m->st.full_releases++;
            got = new_memory(m, seg, rounded, stream, large);
        }
        if (got < 0) {
            m->st.failed_allocs++;
            return cuma_fail(CUMA_ERR_OOM,
                             "pytorch model: %llu bytes do not fit the capacity (%llu reserved)",
                             (unsigned long long)size, (unsigned long long)m->st.reserved);
        }
    }
    if (should_split(m, &m->b[got], rounded)) {
        int32_t rest = new_block(m);
        cuma_tm_block *b = &m->b[got], *r = &m->b[rest];
        *r = *b;
        r->addr = b->addr + rounded;
        r->size = b->size - rounded;
        r->prev = got;
        r->gc_count = 0;
        if (r->next >= 0) m->b[r->next].prev = rest;
        b->size = rounded;
        b->next = rest;
        pool_insert(m, rest);
    }
    cuma_tm_block *b = &m->b[got];
    b->allocated = 1;
    b->requested = size;
    m->st.allocated += b->size;
    m->st.requested += size;
    if (m->st.allocated > m->st.peak_allocated) m->st.peak_allocated = m->st.allocated;
    if (m->st.requested > m->st.peak_requested) m->st.peak_requested = m->st.requested;
    m->st.allocs++;
    *id = got;
    CHECK_MODEL(m);
    return CUMA_OK;
}

/* Absorbs free neighbour `nb` of block `id` (nb leaves its pool and is dropped). */
static void merge(cuma_tm *m, int32_t id, int32_t nb) {
    cuma_tm_block *b = &m->b[id], *n = &m->b[nb];
    detach(m, nb);
    if (n->addr < b->addr) {
        b->addr = n->addr;
        b->prev = n->prev;
        if (b->prev >= 0) m->b[b->prev].next = id;
    } else {
        b->next = n->next;
        if (b->next >= 0) m->b[b->next].prev = id;
    }
    b->size += n->size;
    drop_block(m, nb);
}

/* The first half of a free: the block's bytes leave the counts. */
static cuma_status unaccount(cuma_tm *m, int32_t id) {
    if (id < 0 || (size_t)id >= m->nb || !m->b[id].in_use || !m->b[id].allocated)
        return cuma_fail(CUMA_ERR_BAD_POINTER, "pytorch model: block %d is not allocated", (int)id);
    if (reserve(m, &m->pool[m->b[id].large]))
        return cuma_fail(CUMA_ERR_OOM, "pytorch model: out of host memory");
    cuma_tm_block *b = &m->b[id];
    m->st.allocated -= b->size;
    m->st.requested -= b->requested;
    m->st.frees++;
    b->allocated = 0;
    b->requested = 0;
    return CUMA_OK;
}

/* The second half: the block merges with its free neighbours and joins its pool (room for one
 * entry was reserved). */
static void cache_block(cuma_tm *m, int32_t id) {
    if (mergeable(m, m->b[id].prev, 1)) merge(m, id, m->b[id].prev);
    if (mergeable(m, m->b[id].next, 1)) merge(m, id, m->b[id].next);
    pool_insert(m, id);
}

cuma_status cuma_tm_free(cuma_tm *m, int32_t id) {
    cuma_status st = unaccount(m, id);
    if (st != CUMA_OK) return st;
    cache_block(m, id);
    CHECK_MODEL(m);
    return CUMA_OK;
}

cuma_status cuma_tm_free_after(cuma_tm *m, int32_t id, uint64_t due_us) {
    if (m->npend == m->cappend && m->pend_head) {
        /* The queue's consumed head is dropped before it grows. */
        memmove(m->pend, m->pend + m->pend_head, (m->npend - m->pend_head) * sizeof *m->pend);
        m->npend -= m->pend_head;
        m->pend_head = 0;
    }
    if (m->npend == m->cappend) {
        size_t cap = m->cappend ? m->cappend * 2 : 64;
        cuma_tm_pending *q = realloc(m->pend, cap * sizeof *q);
        if (!q) return cuma_fail(CUMA_ERR_OOM, "pytorch model: out of host memory");
        m->pend = q;
        m->cappend = cap;
    }
    cuma_status st = unaccount(m, id);
    if (st != CUMA_OK) return st;
    m->b[id].pending = 1;
    m->st.deferred_frees++;
    /* Kept sorted by due time; with one lag the new one goes last. */
    size_t at = m->npend++;
    for (; at > m->pend_head && m->pend[at - 1].due_us > due_us; at--)
        m->pend[at] = m->pend[at - 1];
    m->pend[at] = (cuma_tm_pending){id, due_us};
    CHECK_MODEL(m);
    return CUMA_OK;
}

cuma_status cuma_tm_process_events(cuma_tm *m, uint64_t now_us) {
    while (m->pend_head < m->npend && m->pend[m->pend_head].due_us <= now_us) {
        int32_t id = m->pend[m->pend_head].id;
        if (reserve(m, &m->pool[m->b[id].large]))
            return cuma_fail(CUMA_ERR_OOM, "pytorch model: out of host memory");
        m->pend_head++;
        m->b[id].pending = 0;
        cache_block(m, id);
    }
    if (m->pend_head == m->npend) m->pend_head = m->npend = 0;
    CHECK_MODEL(m);
    return CUMA_OK;
}

/* ---- expandable segments -------------------------------------------------------------------- */

/* With expandable_segments, each (stream, pool) gets a virtual range 9/8 of the device
 * (1 TiB when unlimited) whose pages (2 MiB small, 20 MiB large) are mapped as requests need
 * them; a request takes the free and unmapped room it needs at the range's end, and releasing
 * the cache unmaps the pages wholly inside free blocks. Reserved bytes are mapped bytes. */
#define EXP_VA_UNLIMITED ((uint64_t)1 << 40)

static uint64_t page_of(int large) {
    return large ? CUMA_TM_LARGE_BUFFER : CUMA_TM_SMALL_BUFFER;
}

/* A new expandable range for (stream, pool), one unmapped block; -1: out of host memory. */
static int32_t new_expandable(cuma_tm *m, uint64_t stream, int large) {
    /* A device and an eighth, room for pages moved to the end (1 TiB when unlimited). */
    uint64_t page = page_of(large),
             va = m->conf.capacity ? m->conf.capacity + m->conf.capacity / 8 : EXP_VA_UNLIMITED;
    va = (va + page - 1) / page * page;
    if (reserve(m, &m->pool[large]) || um_reserve(m, large)) return -1;
    /* Bases are multiples of 20 MiB, so pages of either size start at multiples of their size. */
    uint64_t base =
        (m->next_addr + CUMA_TM_LARGE_BUFFER - 1) / CUMA_TM_LARGE_BUFFER * CUMA_TM_LARGE_BUFFER;
    int32_t id = new_block(m);
    cuma_tm_block *b = &m->b[id];
    b->addr = base;
    b->size = va;
    b->stream = stream;
    b->prev = b->next = -1;
    b->large = (uint8_t)large;
    b->expandable = 1;
    m->next_addr = base + va + SEGMENT_ALIGN;
    um_insert(m, id);
    return id;
}

/* The first block of a run of free (mapped or not) blocks of at least `size` bytes that holds
 * an unmapped block of the stream, starting at the free block before it if any; else a new
 * range. -1: out of host memory. */
static int32_t find_expandable(cuma_tm *m, uint64_t stream, int large, uint64_t size) {
    const cuma_tm_pool *u = &m->unmapped[large];
    for (size_t at = um_lower_bound(m, u, stream, 0);
         at < u->n && m->b[u->ids[at]].stream == stream; at++) {
        int32_t c = u->ids[at];
        /* A block freed on another stream and waiting for its events (pending) is not free. */
        if (m->b[c].prev >= 0 && !m->b[m->b[c].prev].allocated && !m->b[m->b[c].prev].pending)
            c = m->b[c].prev;
        uint64_t bytes = 0;
        for (int32_t x = c; x >= 0 && bytes < size && !m->b[x].allocated && !m->b[x].pending;
             x = m->b[x].next)
            bytes += m->b[x].size;
        if (bytes >= size) return c;
    }
    return new_expandable(m, stream, large);
}

/* Maps the pages under the first `size` bytes of unmapped block id; the mapped part merges with
 * free mapped neighbours (keeping id) into the pool. -1: over the capacity, or host memory. */
static int map_block(cuma_tm *m, int32_t id, uint64_t size) {
    cuma_tm_block *b = &m->b[id];
    assert(!b->mapped && !b->allocated);
    uint64_t page = page_of(b->large), end = (b->addr + size + page - 1) / page * page;
    if (end > b->addr + b->size) end = b->addr + b->size;
    uint64_t len = end - b->addr, limit = reserve_limit(&m->conf);
    if (limit && (len > limit || m->st.reserved > limit - len)) return -1;
    int large = b->large; /* reserve may move the block array under b */
    if (reserve(m, &m->pool[large]) || um_reserve(m, large)) return -1;
    b = &m->b[id];
    um_remove(m, id);
    b->mapped = 1;
    if (len < b->size) { /* the rest stays unmapped */
        int32_t rest = new_block(m);
        cuma_tm_block *r = &m->b[rest];
        b = &m->b[id];
        *r = *b;
        r->addr = b->addr + len;
        r->size = b->size - len;
        r->mapped = 0;
        r->prev = id;
        if (r->next >= 0) m->b[r->next].prev = rest;
        b->next = rest;
        b->size = len;
        um_insert(m, rest);
    }
    if (mergeable(m, b->prev, 1)) merge(m, id, b->prev);
    if (mergeable(m, m->b[id].next, 1)) merge(m, id, m->b[id].next);
    m->b[id].gc_count = 0;
    pool_insert(m, id);
    m->st.reserved += len;
    if (m->st.reserved > m->st.peak_reserved) m->st.peak_reserved = m->st.reserved;
    m->st.segments_created++;
    return 0;
}

/* Unmaps the pages wholly inside free mapped block id (in its pool); partial pages at its ends
 * stay mapped free blocks. -1: out of host memory (nothing changed). */
static int unmap_block(cuma_tm *m, int32_t id) {
    cuma_tm_block *b = &m->b[id];
    assert(b->mapped && !b->allocated && b->expandable);
    uint64_t page = page_of(b->large);
    uint64_t begin = (b->addr + page - 1) / page * page;
    uint64_t end = (b->addr + b->size) / page * page;
    if (end <= begin) return 0;
    int large = b->large; /* reserve may move the block array under b */
    if (reserve(m, &m->pool[large]) || um_reserve(m, large)) return -1;
    b = &m->b[id];
    pool_remove(m, id);
    if (begin > b->addr) { /* a mapped piece before */
        int32_t nb = new_block(m);
        cuma_tm_block *x = &m->b[nb];
        b = &m->b[id];
        *x = *b;
        x->size = begin - b->addr;
        x->next = id;
        if (x->prev >= 0) m->b[x->prev].next = nb;
        b->prev = nb;
        b->addr = begin;
        b->size -= x->size;
        pool_insert(m, nb);
    }
    if (end < b->addr + b->size) { /* and after */
        int32_t nb = new_block(m);
        cuma_tm_block *x = &m->b[nb];
        b = &m->b[id];
        *x = *b;
        x->addr = end;
        x->size = b->addr + b->size - end;
        x->prev = id;
        if (x->next >= 0) m->b[x->next].prev = nb;
        b->next = nb;
        b->size = end - b->addr;
        pool_insert(m, nb);
    }
    b->mapped = 0;
    m->st.reserved -= b->size;
    m->st.segments_released++;
    if (mergeable(m, b->prev, 0)) merge(m, id, b->prev);
    if (mergeable(m, m->b[id].next, 0)) merge(m, id, m->b[id].next);
    um_insert(m, id);
    return 0;
}

/* A block of at least `rounded` bytes from an expandable range, out of its pool, or -1. */
static int32_t try_expandable(cuma_tm *m, uint64_t stream, int large, uint64_t rounded) {
    int32_t c = find_expandable(m, stream, large, rounded);
    if (c < 0) return -1;
    if (!m->b[c].mapped) {
        uint64_t want = m->b[c].size < rounded ? m->b[c].size : rounded;
        if (map_block(m, c, want)) return -1;
    }
    while (m->b[c].size < rounded) { /* free mapped, then unmapped: map more of it */
        int32_t nx = m->b[c].next;
        assert(nx >= 0 && !m->b[nx].mapped && !m->b[nx].allocated);
        uint64_t rest = rounded - m->b[c].size;
        if (map_block(m, nx, rest < m->b[nx].size ? rest : m->b[nx].size)) return -1;
        c = nx; /* it took c in */
    }
    pool_remove(m, c);
    m->b[c].gc_count = 0;
    return c;
}

/* ---- segments from before the trace -------------------------------------------------------- */

/* Room for `blocks` more block slots and `free` more entries in each pool, grown at once. */
static int reserve_many(cuma_tm *m, size_t blocks, size_t free) {
    if (blocks > INT32_MAX - m->nb || free > INT32_MAX) return -1;
    /* At least 256 slots: reserve() grows by doubling and needs room for two. */
    if (m->nb + blocks > m->capb) {
        size_t cap = m->nb + blocks < 256 ? 256 : m->nb + blocks;
        cuma_tm_block *nb = realloc(m->b, cap * sizeof *nb);
        if (!nb) return -1;
        m->b = nb;
        m->capb = cap;
    }
    for (int k = 0; k < 2; k++) {
        cuma_tm_pool *p = &m->pool[k];
        if (p->n + free <= p->cap) continue;
        size_t cap = p->n + free < 64 ? 64 : p->n + free;
        int32_t *ids = realloc(p->ids, cap * sizeof *ids);
        if (!ids) return -1;
        p->ids = ids;
        p->cap = cap;
    }
    return 0;
}

/* The last seeded segment starting at or below addr, or nseg when none. */
static size_t seg_at(const cuma_trace_segment *seg, size_t nseg, uint64_t addr) {
    size_t lo = 0, hi = nseg;
    while (lo < hi) {
        size_t mid = lo + (hi - lo) / 2;
        if (seg[mid].addr <= addr)
            lo = mid + 1;
        else
            hi = mid;
    }
    return lo ? lo - 1 : nseg;
}

/* An event by its address, for placing blocks in address order. */
typedef struct by_addr {
    uint64_t ptr;
    size_t k;
} by_addr;

static int by_ptr(const void *x, const void *y) {
    const by_addr *a = x, *b = y;
    if (a->ptr != b->ptr) return a->ptr < b->ptr ? -1 : 1;
    return a->k < b->k ? -1 : a->k > b->k;
}

/* Splits free block id at offset `at` (a multiple of 512 inside it): the part from `at` on is
 * a new free block (room was reserved), returned. */
static int32_t split_at(cuma_tm *m, int32_t id, uint64_t at) {
    int32_t r = new_block(m);
    cuma_tm_block *b = &m->b[id], *x = &m->b[r];
    *x = *b;
    x->addr = b->addr + at;
    x->size = b->size - at;
    x->prev = id;
    if (x->next >= 0) m->b[x->next].prev = r;
    b->next = r;
    b->size = at;
    return r;
}

/* Puts the block of event ev where it was, in the free block at the right end of its segment's
 * placed part (*tail), which moves past it. -1: it does not lie in *tail. */
static int32_t place(cuma_tm *m, const cuma_trace_event *ev, int32_t *tail) {
    if (*tail < 0 || ev->size > CUMA_TM_MAX_REQUEST) return -1;
    uint64_t size = cuma_tm_round_size(&m->conf, ev->size);
    const cuma_tm_block *t = &m->b[*tail];
    if (ev->ptr < t->addr || ev->ptr - t->addr >= t->size || (ev->ptr - t->addr) % 512 ||
        size > t->addr + t->size - ev->ptr)
        return -1;
    int32_t id = *tail;
    if (ev->ptr > t->addr) id = split_at(m, id, ev->ptr - t->addr);
    *tail = size < m->b[id].size ? split_at(m, id, size) : -1;
    cuma_tm_block *b = &m->b[id];
    b->allocated = 1;
    b->requested = ev->size;
    m->st.allocated += b->size;
    m->st.requested += ev->size;
    m->st.allocs++;
    m->st.blocks_placed++;
    return id;
}

cuma_status cuma_tm_seed(cuma_tm *m, const cuma_trace_segment *seg, size_t nseg,
                         const cuma_trace_event *ev, size_t n, int32_t *ids) {
    if (m->conf.expandable || m->nb)
        return cuma_fail(CUMA_ERR_INVALID,
                         "pytorch model: only a fresh model without expandable segments is seeded");
    for (size_t k = 0; k < n; k++) ids[k] = -1;
    if (!nseg) return CUMA_OK;
    for (size_t i = 1; i < nseg; i++)
        if (seg[i - 1].addr > UINT64_MAX - seg[i - 1].size ||
            seg[i - 1].addr + seg[i - 1].size > seg[i].addr)
            return cuma_fail(CUMA_ERR_INVALID,
                             "pytorch model: seeded segments %zu and %zu overlap or are unsorted",
                             i - 1, i);
    /* Each placed block adds at most two blocks (itself split off, the rest after it). */
    int32_t *tail = malloc(nseg * sizeof *tail);
    by_addr *ord = malloc((n ? n : 1) * sizeof *ord);
    if (!tail || !ord || nseg > SIZE_MAX / 4 - n || reserve_many(m, nseg + 2 * n, nseg + n)) {
        free(tail);
        free(ord);
        return cuma_fail(CUMA_ERR_OOM, "pytorch model: out of host memory for %zu segments", nseg);
    }
    for (size_t i = 0; i < nseg; i++) {
        const cuma_trace_segment *s = &seg[i];
        tail[i] = -1;
        if (!s->size || s->size % CUMA_TM_MIN_BLOCK) continue;
        int32_t id = new_block(m);
        cuma_tm_block *b = &m->b[id];
        b->addr = s->addr;
        b->size = s->size;
        b->stream = s->stream;
        b->prev = b->next = -1;
        b->large = s->size > CUMA_TM_SMALL_BUFFER;
        b->mapped = 1;
        tail[i] = id;
        m->st.reserved += s->size;
        m->st.segments_seeded++;
        /* Made-up addresses of later segments start above the seeded ones. */
        uint64_t end = s->addr + s->size;
        end = end > UINT64_MAX - 2 * SEGMENT_ALIGN
                  ? UINT64_MAX - SEGMENT_ALIGN
                  : (end + SEGMENT_ALIGN) / SEGMENT_ALIGN * SEGMENT_ALIGN;
        if (end > m->next_addr) m->next_addr = end;
    }
    for (size_t k = 0; k < n; k++) ord[k] = (by_addr){ev[k].ptr, k};
    qsort(ord, n, sizeof *ord, by_ptr);
    for (size_t k = 0; k < n; k++) {
        const cuma_trace_event *e = &ev[ord[k].k];
        size_t j = seg_at(seg, nseg, e->ptr);
        if (e->action != CUMA_TRACE_ALLOC || !e->size || j == nseg) continue;
        ids[ord[k].k] = place(m, e, &tail[j]);
    }
    for (size_t i = 0; i < m->nb; i++)
        if (m->b[i].in_use && !m->b[i].allocated) pool_insert(m, (int32_t)i);
    m->st.peak_reserved = m->st.reserved;
    m->st.peak_allocated = m->st.allocated;
    m->st.peak_requested = m->st.requested;
    free(tail);
    free(ord);
    CHECK_MODEL(m);
    return CUMA_OK;
}

/* ---- life and checks ------------------------------------------------------------------------ */

cuma_status cuma_tm_init(cuma_tm *m, const cuma_tm_conf *c) {
    memset(m, 0, sizeof *m);
    m->conf = *c;
    m->spare = -1;
    m->next_addr = SEGMENT_ALIGN;
    return CUMA_OK;
}

void cuma_tm_destroy(cuma_tm *m) {
    free(m->b);
    free(m->pool[0].ids);
    free(m->pool[1].ids);
    free(m->unmapped[0].ids);
    free(m->unmapped[1].ids);
    free(m->pend);
    memset(m, 0, sizeof *m);
}

cuma_status cuma_tm_validate(const cuma_tm *m) {
    uint64_t reserved = 0, allocated = 0, free_mapped = 0, unmapped = 0, pending = 0;
    for (size_t i = 0; i < m->nb; i++) {
        const cuma_tm_block *b = &m->b[i];
        if (!b->in_use) continue;
        if (b->size % CUMA_TM_MIN_BLOCK || !b->size || (b->allocated && !b->mapped))
            return cuma_fail(CUMA_ERR_CORRUPT, "pytorch model: block %zu has size %llu, %s", i,
                             (unsigned long long)b->size, b->mapped ? "mapped" : "unmapped");
        if (b->prev < 0) { /* a segment's first block: walk the segment */
            uint64_t end = b->addr;
            for (int32_t j = (int32_t)i, last = -1; j >= 0; last = j, j = m->b[j].next) {
                const cuma_tm_block *s = &m->b[j];
                if (s->addr != end || s->prev != last || s->large != b->large ||
                    s->expandable != b->expandable)
                    return cuma_fail(CUMA_ERR_CORRUPT,
                                     "pytorch model: segment at %llu is broken at block %d",
                                     (unsigned long long)b->addr, (int)j);
                if (!s->allocated && !s->pending && mergeable(m, s->next, s->mapped))
                    return cuma_fail(CUMA_ERR_CORRUPT,
                                     "pytorch model: free blocks %d and %d are not merged", (int)j,
                                     (int)s->next);
                end += s->size;
                if (s->mapped) reserved += s->size;
            }
        }
        if (b->allocated && b->pending)
            return cuma_fail(CUMA_ERR_CORRUPT, "pytorch model: block %zu is allocated and pending",
                             i);
        if (b->allocated)
            allocated += b->size;
        else if (b->pending)
            pending++;
        else if (b->mapped)
            free_mapped++;
        else
            unmapped++;
    }
    if (reserved != m->st.reserved || allocated != m->st.allocated)
        return cuma_fail(CUMA_ERR_CORRUPT,
                         "pytorch model: reserved %llu/allocated %llu, counted %llu/%llu",
                         (unsigned long long)m->st.reserved, (unsigned long long)m->st.allocated,
                         (unsigned long long)reserved, (unsigned long long)allocated);
    if (free_mapped != m->pool[0].n + m->pool[1].n ||
        unmapped != m->unmapped[0].n + m->unmapped[1].n)
        return cuma_fail(CUMA_ERR_CORRUPT,
                         "pytorch model: %llu free and %llu unmapped blocks, %zu and %zu in sets",
                         (unsigned long long)free_mapped, (unsigned long long)unmapped,
                         m->pool[0].n + m->pool[1].n, m->unmapped[0].n + m->unmapped[1].n);
    if (pending != m->npend - m->pend_head)
        return cuma_fail(CUMA_ERR_CORRUPT, "pytorch model: %llu pending blocks, %zu queued",
                         (unsigned long long)pending, m->npend - m->pend_head);
    for (size_t i = m->pend_head; i < m->npend; i++) {
        const cuma_tm_block *b = &m->b[m->pend[i].id];
        if (!b->in_use || !b->pending || !b->mapped ||
            (i > m->pend_head && m->pend[i - 1].due_us > m->pend[i].due_us))
            return cuma_fail(CUMA_ERR_CORRUPT, "pytorch model: pending queue entry %zu is wrong",
                             i);
    }
    for (int k = 0; k < 2; k++) {
        for (size_t i = 0; i < m->pool[k].n; i++) {
            const cuma_tm_block *b = &m->b[m->pool[k].ids[i]];
            if (b->allocated || !b->mapped || b->large != k)
                return cuma_fail(CUMA_ERR_CORRUPT, "pytorch model: pool %d holds a wrong block", k);
            if (i && key_cmp(&m->b[m->pool[k].ids[i - 1]], b->stream, b->size, b->addr) >= 0)
                return cuma_fail(CUMA_ERR_CORRUPT, "pytorch model: pool %d is out of order", k);
        }
        for (size_t i = 0; i < m->unmapped[k].n; i++) {
            const cuma_tm_block *b = &m->b[m->unmapped[k].ids[i]], *a;
            if (b->allocated || b->mapped || b->large != k || !b->expandable)
                return cuma_fail(CUMA_ERR_CORRUPT,
                                 "pytorch model: unmapped set %d holds a wrong block", k);
            if (i && ((a = &m->b[m->unmapped[k].ids[i - 1]])->stream > b->stream ||
                      (a->stream == b->stream && a->addr >= b->addr)))
                return cuma_fail(CUMA_ERR_CORRUPT, "pytorch model: unmapped set %d is out of order",
                                 k);
        }
    }
    return CUMA_OK;
}

/* ---- replay --------------------------------------------------------------------------------- */

cuma_status cuma_tm_replay(const cuma_trace *t, const cuma_tm_conf *c, cuma_tm_result *out) {
    memset(out, 0, sizeof *out);
    int32_t *ids = malloc((t->n ? t->n : 1) * sizeof *ids);
    if (!ids) return cuma_fail(CUMA_ERR_OOM, "pytorch model: no host memory for %zu events", t->n);
    cuma_tm m;
    cuma_tm_init(&m, c);
    cuma_status st = CUMA_OK;
    uint64_t now = t->n ? t->ev[0].time_us : 0, t0 = now;
    for (size_t i = 0; i < t->n; i++) ids[i] = -1;
    /* PyTorch's cache from before recording: the seeded blocks from before are allocated. */
    if (!c->expandable && t->npreseg)
        st = cuma_tm_seed(&m, t->preseg, t->npreseg, t->ev, t->preexisting, ids);
    for (size_t i = 0; i < t->n && st == CUMA_OK; i++) {
        const cuma_trace_event *e = &t->ev[i];
        if (e->time_us > now) {
            double dt = (double)(e->time_us - now);
            out->int_reserved += dt * (double)m.st.reserved;
            out->int_requested += dt * (double)m.st.requested;
            now = e->time_us;
        }
        if (e->action == CUMA_TRACE_ALLOC) {
            if (ids[i] >= 0) continue; /* placed by the seed */
            if (!e->size) {
                out->zero_allocs++;
                continue;
            }
            uint64_t failed = m.st.failed_allocs;
            st = cuma_tm_process_events(&m, e->time_us);
            if (st != CUMA_OK) break;
            cuma_status a = cuma_tm_malloc(&m, e->size, e->stream, &ids[i]);
            if (a != CUMA_OK && m.st.failed_allocs == failed) st = a; /* not the capacity */
        } else if (e->action == CUMA_TRACE_FREE) {
            if (e->match < 0)
                out->unmatched_frees++;
            else if (ids[e->match] < 0)
                out->orphan_frees++;
            else if (c->lag_us && e->stream && e->stream != t->ev[e->match].stream)
                st = cuma_tm_free_after(&m, ids[e->match], e->time_us + c->lag_us);
            else
                st = cuma_tm_free(&m, ids[e->match]);
        } else {
            out->trace_failures++;
        }
    }
    if (st == CUMA_OK) st = cuma_tm_validate(&m);
    out->st = m.st;
    out->end_reserved = m.st.reserved;
    out->span_us = now - t0;
    cuma_tm_destroy(&m);
    free(ids);
    return st;
}
