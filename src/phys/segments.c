// SPDX-License-Identifier: Apache-2.0
#include "phys/segments.h"
#include "util/error.h"
#include "util/marks.h"

#include <assert.h>
#include <stdlib.h>
#include <string.h>

#define MB (1024ull * 1024)

void cuma_segs_init(cuma_segs *sg, cuma_backend *be, cuma_streams *ss, cuma_policy *pol,
                    uint64_t segment_size) {
    memset(sg, 0, sizeof *sg);
    sg->be = be, sg->ss = ss, sg->pol = pol;
    cuma_map_init(&sg->byaddr);
    sg->small_seg = 2 * MB;
    sg->mid_seg =
        segment_size < 2 * MB ? 2 * MB : (segment_size + 2 * MB - 1) / (2 * MB) * (2 * MB);
    sg->limit_bytes = UINT64_MAX;
}

static bool free_seg(void *ctx, uint64_t key, void *val) {
    cuma_segs *sg = ctx;
    cuma_seg *s = val;
    sg->be->ops->seg_free(sg->be, key, s->size);
    free(s);
    return true;
}

void cuma_segs_destroy(cuma_segs *sg) {
    cuma_map_each(&sg->byaddr, free_seg, sg);
    cuma_map_destroy(&sg->byaddr);
}

static void idle_remove(cuma_segs *sg, cuma_seg *s) {
    if (s->prev)
        s->prev->next = s->next;
    else
        sg->head = s->next;
    if (s->next)
        s->next->prev = s->prev;
    else
        sg->tail = s->prev;
    s->prev = s->next = NULL;
    s->whole = NULL;
    assert(sg->idle_bytes >= s->size && sg->nidle > 0);
    sg->idle_bytes -= s->size;
    sg->nidle--;
}

static cuma_status add_segment(cuma_segs *sg, uint64_t size, cuma_seg **out);

cuma_status cuma_segs_prefill(cuma_segs *sg, uint64_t bytes, uint64_t now) {
    cuma_seg *s;
    cuma_status st = add_segment(sg, (bytes + 2 * MB - 1) / (2 * MB) * (2 * MB), &s);
    if (st) return st;
    s->pinned = true;
    /* Its one free block spans it: it idles like any free segment, but never goes back. */
    cuma_block *b = sg->pol->ops->alloc(sg->pol, s->size, 0);
    if (b) cuma_segs_on_free(sg, sg->pol->ops->free(sg->pol, b, 0, 0), now);
    return CUMA_OK;
}

cuma_status cuma_segs_grow(cuma_segs *sg, uint64_t n) {
    uint64_t size = n <= MB       ? sg->small_seg
                    : n < 10 * MB ? sg->mid_seg
                                  : (n + 2 * MB - 1) / (2 * MB) * (2 * MB);
    if (size < n) size = (n + 2 * MB - 1) / (2 * MB) * (2 * MB);
    cuma_seg *s;
    return add_segment(sg, size, &s);
}

static cuma_status add_segment(cuma_segs *sg, uint64_t size, cuma_seg **out) {
    if (sg->reserved + size > sg->limit_bytes)
        return cuma_fail(sg->limit_is_device ? CUMA_ERR_OOM : CUMA_ERR_LIMIT,
                         "a %llu-byte segment would pass the %llu-byte limit (%llu reserved)",
                         (unsigned long long)size, (unsigned long long)sg->limit_bytes,
                         (unsigned long long)sg->reserved);
    cuma_seg *s = calloc(1, sizeof *s);
    if (!s) return cuma_fail(CUMA_ERR_OOM, "no host memory for a segment record");
    uint64_t addr;
    cuma_mark_push(sg->marks, CUMA_MARK_SEG_ALLOC);
    cuma_status st = sg->be->ops->seg_alloc(sg->be, size, &addr);
    cuma_mark_pop(sg->marks);
    if (st) {
        free(s);
        return st;
    }
    if (!cuma_map_put(&sg->byaddr, addr, s))
        st = cuma_fail(CUMA_ERR_OOM, "no host memory for the segment table");
    else if ((st = sg->pol->ops->add_range(sg->pol, addr, size)) != CUMA_OK)
        cuma_map_remove(&sg->byaddr, addr);
    if (st) {
        sg->be->ops->seg_free(sg->be, addr, size);
        free(s);
        return st;
    }
    s->addr = addr, s->size = size;
    sg->reserved += size;
    atomic_store_explicit(&sg->all_reserved, sg->reserved, memory_order_relaxed);
    sg->creates++;
    *out = s;
    return CUMA_OK;
}

void cuma_segs_on_alloc(cuma_segs *sg, const cuma_block *b) {
    if (!sg->nidle) return;
    cuma_seg *s = cuma_map_get(&sg->byaddr, b->off);
    if (s && s->whole) idle_remove(sg, s);
}

void cuma_segs_on_free(cuma_segs *sg, cuma_block *m, uint64_t now) {
    if (m->prev || !m->range_end) return;
    cuma_seg *s = cuma_map_get(&sg->byaddr, m->off);
    if (!s || s->whole) return;
    s->whole = m;
    s->idle_since = now;
    s->prev = NULL;
    s->next = sg->head;
    if (sg->head)
        sg->head->prev = s;
    else
        sg->tail = s;
    sg->head = s;
    sg->idle_bytes += s->size;
    sg->nidle++;
    assert(sg->idle_bytes <= sg->reserved); /* an idle segment is one of the reserved */
}

uint64_t cuma_segs_release(cuma_segs *sg, uint64_t now, int64_t delay_ns, uint64_t max_cached_bytes,
                           uint64_t age_keep_bytes, bool wait) {
    uint64_t released = 0;
    for (cuma_seg *s = sg->tail, *prev; s; s = prev) {
        prev = s->prev;
        bool old = delay_ns >= 0 && now >= s->idle_since &&
                   now - s->idle_since >= (uint64_t)delay_ns && sg->idle_bytes > age_keep_bytes;
        if (!old && sg->idle_bytes <= max_cached_bytes) break;
        cuma_block *w = s->whole;
        if (s->pinned) continue;
        /* cuMemFree is not stream-ordered: the work that last used the segment must be done. */
        if (!cuma_fence_poll(sg->ss, w->fence_stream, w->fence_seq, wait)) continue;
        idle_remove(sg, s);
        sg->pol->ops->remove_range(sg->pol, w);
        cuma_map_remove(&sg->byaddr, s->addr);
        cuma_mark_push(sg->marks, CUMA_MARK_SEG_FREE);
        sg->be->ops->seg_free(sg->be, s->addr, s->size);
        cuma_mark_pop(sg->marks);
        assert(sg->reserved >= s->size && sg->idle_bytes <= sg->reserved);
        sg->reserved -= s->size;
        atomic_store_explicit(&sg->all_reserved, sg->reserved, memory_order_relaxed);
        sg->releases++;
        released += s->size;
        free(s);
    }
    return released;
}

uint64_t cuma_segs_oldest_idle(const cuma_segs *sg) {
    return sg->tail ? sg->tail->idle_since : UINT64_MAX;
}

typedef struct segwalk {
    uint64_t total, idle;
    const char *why;
} segwalk;

static bool check_seg(void *ctx, uint64_t key, void *val) {
    segwalk *w = ctx;
    cuma_seg *s = val;
    if (s->addr != key)
        return w->why = "segments: table key differs from the segment address", false;
    w->total += s->size;
    if (s->whole) {
        w->idle += s->size;
        if (!s->whole->is_free || s->whole->off != s->addr || s->whole->size != s->size)
            return w->why = "segments: an idle segment is not one free block", false;
    }
    return true;
}

bool cuma_segs_validate(const cuma_segs *sg, const char **why) {
    segwalk w = {0, 0, NULL};
    cuma_map_each(&sg->byaddr, check_seg, &w);
    if (w.why) return *why = w.why, false;
    if (w.total != sg->reserved || atomic_load(&sg->all_reserved) != sg->reserved)
        return *why = "segments: reserved bytes differ from the segments", false;
    if (w.idle != sg->idle_bytes)
        return *why = "segments: idle bytes differ from the idle segments", false;
    uint64_t n = 0, t = UINT64_MAX;
    for (const cuma_seg *s = sg->head; s; s = s->next) {
        if (++n > sg->nidle) return *why = "segments: idle list longer than the idle count", false;
        if (!s->whole) return *why = "segments: a busy segment on the idle list", false;
        if (s->idle_since > t) return *why = "segments: idle list not newest first", false;
        t = s->idle_since;
    }
    if (n != sg->nidle) return *why = "segments: idle list misses idle segments", false;
    return cuma_map_validate(&sg->byaddr, why);
}
