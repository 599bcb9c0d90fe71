// SPDX-License-Identifier: Apache-2.0
/* A trace written as a PyTorch memory snapshot (cuma_trace_write_snapshot, trace.h): a pickle
 * (protocol 2) of plain dicts, lists, strings and ints, the fields snapshot_pickle.c reads and
 * PyTorch's memory_viz draws.
 *
 *   {"segments": [each segment from before recording (cuma_trace.preseg), then one per other
 *                 block live at the end: {"device", "address", "total_size", "stream",
 *                 "segment_type", "allocated_size", "active_size", "requested_size",
 *                 "blocks": [{"address", "size", "requested_size", "state":
 *                 "active_allocated" or "inactive" (free room), "frames"}]}],
 *    "device_traces": [[], ..., [events of the trace's device]]}
 *
 * Events: an ALLOC is "alloc" with its stack's frames, after a "segment_alloc" of its own
 * segment when it is still live at the end outside the segments from before (so the reader does
 * not take that segment for cache reserved before recording); a FREE is "free_requested" then
 * "free_completed" at the same time (memory_viz pairs them, the reader keeps one); an ALLOC_FAIL
 * is "oom". Blocks alive before recording are not events: those still live at the end are in
 * "segments" (the reader makes them blocks from before again), the others are named by their
 * free only, as PyTorch records them. Live blocks inside a segment from before are written in
 * it, its free room between them as inactive blocks, so the reader finds the same segments
 * from before. Each distinct frame dict and frames list is written once and shared through the
 * pickle memo, as PyTorch's own pickles share them.
 */
#include "trace.h"

#include "util/error.h"

#include <errno.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define PROTO       0x80
#define MARK        '('
#define STOP        '.'
#define EMPTY_DICT  '}'
#define EMPTY_LIST  ']'
#define SETITEMS    'u'
#define APPENDS     'e'
#define BININT      'J'
#define LONG1       0x8a
#define BINUNICODE  'X'
#define LONG_BINPUT 'r'
#define LONG_BINGET 'j'

/* A block live at the end of the trace (an ALLOC event never freed), for the sort by address. */
typedef struct live_block {
    uint64_t ptr;
    size_t i; /* its event */
} live_block;

typedef struct w {
    FILE *f;
    const cuma_trace *t;
    /* Per frame, then per stack: 0 before it is written, then 1 + its memo id. Ids are given
     * in writing order, as Python's pickler numbers them, since a reader may refuse an id
     * beyond the values it has read so far. */
    uint32_t *seen;
    uint32_t memo_ids;
    live_block *live; /* the blocks live at the end, by address */
    size_t nlive;
    /* Per event: 1 + the index of the segment from before (t->preseg) that its live block lies
     * in, 0 for none (such a block is written as a segment of its own). */
    size_t *in_seg;
} w;

static void u32le(FILE *f, uint32_t v) {
    for (int i = 0; i < 4; i++) fputc((int)(v >> (8 * i)) & 0xff, f);
}

static void put_uint(FILE *f, uint64_t v) {
    if (v < (UINT64_C(1) << 31)) {
        fputc(BININT, f);
        u32le(f, (uint32_t)v);
        return;
    }
    /* LONG1: little-endian two's complement; one more byte when the top bit is set. */
    unsigned char b[9];
    int n = 0;
    for (uint64_t x = v; x; x >>= 8) b[n++] = (unsigned char)(x & 0xff);
    if (b[n - 1] & 0x80) b[n++] = 0;
    fputc(LONG1, f);
    fputc(n, f);
    fwrite(b, 1, (size_t)n, f);
}

/* A signed 64-bit value (a stream is a cudaStream_t: any bits, read back as they are). */
static void put_sint(FILE *f, int64_t v) {
    if (v >= 0) {
        put_uint(f, (uint64_t)v);
        return;
    }
    fputc(LONG1, f);
    fputc(8, f);
    for (int i = 0; i < 8; i++) fputc((int)(((uint64_t)v >> (8 * i)) & 0xff), f);
}

static void put_str(FILE *f, const char *s) {
    size_t n = strlen(s);
    fputc(BINUNICODE, f);
    u32le(f, (uint32_t)n);
    fwrite(s, 1, n, f);
}

static void key_uint(FILE *f, const char *k, uint64_t v) {
    put_str(f, k);
    put_uint(f, v);
}

static void key_str(FILE *f, const char *k, const char *v) {
    put_str(f, k);
    put_str(f, v);
}

/* A reference to the object of slot `slot` when it was written before: 1; else 0, and the
 * caller writes it and then remember()s it. */
static int memo(w *o, uint32_t slot) {
    if (o->seen[slot]) {
        fputc(LONG_BINGET, o->f);
        u32le(o->f, o->seen[slot] - 1);
        return 1;
    }
    return 0;
}

static void remember(w *o, uint32_t slot) {
    fputc(LONG_BINPUT, o->f);
    u32le(o->f, o->memo_ids);
    o->seen[slot] = ++o->memo_ids;
}

static void frame(w *o, uint32_t k) {
    if (memo(o, k)) return;
    const cuma_trace_stacks *st = &o->t->stacks;
    const cuma_trace_frame *fr = &st->frame[k];
    fputc(EMPTY_DICT, o->f);
    fputc(MARK, o->f);
    key_str(o->f, "filename", st->text + fr->file);
    key_uint(o->f, "line", fr->line);
    key_str(o->f, "name", st->text + fr->name);
    fputc(SETITEMS, o->f);
    remember(o, k);
}

/* The frames list of stack s (an empty list for stack 0 or a trace without stacks). */
static void frames(w *o, uint32_t s) {
    const cuma_trace_stacks *st = &o->t->stacks;
    if (!o->t->stack || s == 0) {
        fputc(EMPTY_LIST, o->f);
        return;
    }
    uint32_t slot = st->nframes + s;
    if (memo(o, slot)) return;
    fputc(EMPTY_LIST, o->f);
    fputc(MARK, o->f);
    for (size_t k = st->start[s]; k < st->start[s + 1]; k++) frame(o, st->ix[k]);
    fputc(APPENDS, o->f);
    remember(o, slot);
}

static uint32_t stack_of(const w *o, size_t i) {
    return o->t->stack ? o->t->stack[i] : 0;
}

static void event(w *o, const char *action, const cuma_trace_event *e, uint32_t stack) {
    FILE *f = o->f;
    fputc(EMPTY_DICT, f);
    fputc(MARK, f);
    key_str(f, "action", action);
    key_uint(f, "addr", e->ptr);
    key_uint(f, "size", e->size);
    put_str(f, "stream");
    put_sint(f, (int64_t)e->stream);
    key_uint(f, "time_us", e->time_us);
    put_str(f, "frames");
    frames(o, stack);
    fputc(SETITEMS, f);
}

/* One block of a segment's "blocks": a live one (event i) or free room (i == SIZE_MAX). */
static void block(w *o, size_t i, uint64_t addr, uint64_t size) {
    FILE *f = o->f;
    fputc(EMPTY_DICT, f);
    fputc(MARK, f);
    key_uint(f, "address", addr);
    key_uint(f, "size", size);
    key_uint(f, "requested_size", i == SIZE_MAX ? 0 : size);
    key_str(f, "state", i == SIZE_MAX ? "inactive" : "active_allocated");
    put_str(f, "frames");
    frames(o, i == SIZE_MAX ? 0 : stack_of(o, i));
    fputc(SETITEMS, f);
}

static void segment_head(w *o, uint64_t addr, uint64_t total, uint64_t stream, uint64_t live) {
    FILE *f = o->f;
    fputc(EMPTY_DICT, f);
    fputc(MARK, f);
    key_uint(f, "device", (uint64_t)o->t->device);
    key_uint(f, "address", addr);
    key_uint(f, "total_size", total);
    put_str(f, "stream");
    put_sint(f, (int64_t)stream);
    key_str(f, "segment_type", total > ((uint64_t)2 << 20) ? "large" : "small");
    key_uint(f, "allocated_size", live);
    key_uint(f, "active_size", live);
    key_uint(f, "requested_size", live);
    put_str(f, "blocks");
    fputc(EMPTY_LIST, f);
    fputc(MARK, f);
}

/* Segment from before j with its live blocks (live[*k], ... while they lie in it) and the free
 * room between them as inactive blocks. */
static void preseg(w *o, size_t j, size_t *k) {
    const cuma_trace *t = o->t;
    const cuma_trace_segment *s = &t->preseg[j];
    uint64_t live = 0;
    size_t end = *k;
    for (; end < o->nlive && o->in_seg[o->live[end].i] == j + 1; end++)
        live += t->ev[o->live[end].i].size;
    segment_head(o, s->addr, s->size, s->stream, live);
    uint64_t at = s->addr;
    for (; *k < end; ++*k) {
        const cuma_trace_event *e = &t->ev[o->live[*k].i];
        if (e->ptr > at) block(o, SIZE_MAX, at, e->ptr - at);
        block(o, o->live[*k].i, e->ptr, e->size);
        at = e->ptr + e->size;
    }
    if (at < s->addr + s->size) block(o, SIZE_MAX, at, s->addr + s->size - at);
    fputc(APPENDS, o->f);
    fputc(SETITEMS, o->f);
}

static void segments(w *o) {
    const cuma_trace *t = o->t;
    FILE *f = o->f;
    put_str(f, "segments");
    fputc(EMPTY_LIST, f);
    fputc(MARK, f);
    size_t k = 0;
    for (size_t j = 0; j < t->npreseg; j++) {
        while (k < o->nlive && o->in_seg[o->live[k].i] < j + 1) k++; /* 0: not in one */
        preseg(o, j, &k);
    }
    for (size_t i = 0; i < t->n; i++) {
        const cuma_trace_event *e = &t->ev[i];
        if (e->action != CUMA_TRACE_ALLOC || e->match >= 0 || !e->size || o->in_seg[i]) continue;
        segment_head(o, e->ptr, e->size, e->stream, e->size);
        block(o, i, e->ptr, e->size);
        fputc(APPENDS, f);
        fputc(SETITEMS, f);
    }
    fputc(APPENDS, f);
}

static int by_ptr(const void *x, const void *y) {
    const live_block *a = x, *b = y;
    if (a->ptr != b->ptr) return a->ptr < b->ptr ? -1 : 1;
    return a->i < b->i ? -1 : a->i > b->i;
}

/* o->live and o->in_seg: which live blocks lie, without overlap, in a segment from before. */
static int place_live(w *o) {
    const cuma_trace *t = o->t;
    o->live = malloc((t->n ? t->n : 1) * sizeof *o->live);
    o->in_seg = calloc(t->n ? t->n : 1, sizeof *o->in_seg);
    if (!o->live || !o->in_seg) return -1;
    for (size_t i = 0; i < t->n; i++)
        if (t->ev[i].action == CUMA_TRACE_ALLOC && t->ev[i].match < 0 && t->ev[i].size)
            o->live[o->nlive++] = (live_block){t->ev[i].ptr, i};
    qsort(o->live, o->nlive, sizeof *o->live, by_ptr);
    size_t j = 0;
    uint64_t at = 0; /* where the last block placed in segment j ends */
    for (size_t k = 0; k < o->nlive && j < t->npreseg; k++) {
        const cuma_trace_event *e = &t->ev[o->live[k].i];
        while (j < t->npreseg && t->preseg[j].addr + t->preseg[j].size <= e->ptr) {
            j++;
            at = 0;
        }
        if (j == t->npreseg) break;
        const cuma_trace_segment *s = &t->preseg[j];
        if (e->ptr < s->addr || e->ptr < at || e->size > s->addr + s->size - e->ptr) continue;
        o->in_seg[o->live[k].i] = j + 1;
        at = e->ptr + e->size;
    }
    return 0;
}

static void traces(w *o) {
    const cuma_trace *t = o->t;
    FILE *f = o->f;
    put_str(f, "device_traces");
    fputc(EMPTY_LIST, f);
    fputc(MARK, f);
    for (int d = 0; d < t->device; d++) fputc(EMPTY_LIST, f);
    fputc(EMPTY_LIST, f);
    fputc(MARK, f);
    for (size_t i = t->preexisting; i < t->n; i++) {
        const cuma_trace_event *e = &t->ev[i];
        if (e->action == CUMA_TRACE_ALLOC) {
            /* Its own segment in "segments" was made during recording: said so, as PyTorch
             * does. */
            if (e->match < 0 && e->size && !o->in_seg[i]) event(o, "segment_alloc", e, 0);
            event(o, "alloc", e, stack_of(o, i));
        } else if (e->action == CUMA_TRACE_FREE) {
            event(o, "free_requested", e, 0);
            event(o, "free_completed", e, 0);
        } else {
            event(o, "oom", e, 0);
        }
    }
    fputc(APPENDS, f);
    fputc(APPENDS, f);
}

cuma_status cuma_trace_write_snapshot(const cuma_trace *t, const char *path) {
    if (t->device < 0 || t->device > 1023)
        return cuma_fail(CUMA_ERR_INVALID, "%s: device %d is not 0 to 1023", path, t->device);
    /* Snapshots hold addresses and sizes as Python ints from int64 fields (the reader takes
     * 0 to 2^63-1): a CSV log's wider value has no such form. */
    for (size_t i = 0; i < t->n; i++)
        if (t->ev[i].ptr > INT64_MAX || t->ev[i].size > INT64_MAX)
            return cuma_fail(CUMA_ERR_INVALID,
                             "%s: event %zu: address 0x%llx or size %llu is over 2^63-1, which a "
                             "snapshot cannot hold",
                             t->path, i, (unsigned long long)t->ev[i].ptr,
                             (unsigned long long)t->ev[i].size);
    size_t slots = t->stack ? (size_t)t->stacks.nframes + t->stacks.nstacks : 0;
    w o = {.t = t, .seen = calloc(slots ? slots : 1, sizeof(uint32_t))};
    if (!o.seen || place_live(&o)) {
        free(o.seen);
        free(o.live);
        free(o.in_seg);
        return cuma_fail(CUMA_ERR_OOM, "%s: out of host memory", path);
    }
    o.f = fopen(path, "wb");
    if (!o.f) {
        int err = errno;
        free(o.seen);
        free(o.live);
        free(o.in_seg);
        return cuma_fail(CUMA_ERR_IO, "%s: cannot write: %s", path, strerror(err));
    }
    fputc(PROTO, o.f);
    fputc(2, o.f);
    fputc(EMPTY_DICT, o.f);
    fputc(MARK, o.f);
    segments(&o);
    traces(&o);
    fputc(SETITEMS, o.f);
    fputc(STOP, o.f);
    free(o.seen);
    free(o.live);
    free(o.in_seg);
    int bad = ferror(o.f);
    if (fclose(o.f) != 0) bad = 1;
    if (bad) {
        remove(path);
        return cuma_fail(CUMA_ERR_IO, "%s: error writing the snapshot", path);
    }
    return CUMA_OK;
}
