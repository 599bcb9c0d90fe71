// SPDX-License-Identifier: Apache-2.0
/* A trace written as a PyTorch memory snapshot (cuma_trace_write_snapshot, trace.h): a pickle
 * (protocol 2) of plain dicts, lists, strings and ints, the fields snapshot_pickle.c reads and
 * PyTorch's memory_viz draws.
 *
 *   {"segments": [one per block live at the end: {"device", "address", "total_size",
 *                 "stream", "segment_type", "allocated_size", "active_size", "requested_size",
 *                 "blocks": [{"address", "size", "requested_size", "state":
 *                 "active_allocated", "frames"}]}],
 *    "device_traces": [[], ..., [events of the trace's device]]}
 *
 * Events: an ALLOC is "alloc" with its stack's frames; a FREE is "free_requested" then
 * "free_completed" at the same time (memory_viz pairs them, the reader keeps one); an
 * ALLOC_FAIL is "oom". Blocks alive before recording are not events: those still live at the
 * end are in "segments" (the reader makes them blocks from before again), the others are named
 * by their free only, as PyTorch records them. Each distinct frame dict and frames list is
 * written once and shared through the pickle memo, as PyTorch's own pickles share them.
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

typedef struct w {
    FILE *f;
    const cuma_trace *t;
    unsigned char *seen; /* per memo slot: written already (frames, then stacks) */
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

/* A reference to the object at memo slot `slot` when it was written before: 1; else 0, and the
 * caller writes it and then remember()s it. */
static int memo(w *o, uint32_t slot) {
    if (o->seen[slot]) {
        fputc(LONG_BINGET, o->f);
        u32le(o->f, slot);
        return 1;
    }
    return 0;
}

static void remember(w *o, uint32_t slot) {
    fputc(LONG_BINPUT, o->f);
    u32le(o->f, slot);
    o->seen[slot] = 1;
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

static void segments(w *o) {
    const cuma_trace *t = o->t;
    FILE *f = o->f;
    put_str(f, "segments");
    fputc(EMPTY_LIST, f);
    fputc(MARK, f);
    for (size_t i = 0; i < t->n; i++) {
        const cuma_trace_event *e = &t->ev[i];
        if (e->action != CUMA_TRACE_ALLOC || e->match >= 0 || !e->size) continue;
        fputc(EMPTY_DICT, f);
        fputc(MARK, f);
        key_uint(f, "device", (uint64_t)t->device);
        key_uint(f, "address", e->ptr);
        key_uint(f, "total_size", e->size);
        put_str(f, "stream");
        put_sint(f, (int64_t)e->stream);
        key_str(f, "segment_type", "large");
        key_uint(f, "allocated_size", e->size);
        key_uint(f, "active_size", e->size);
        key_uint(f, "requested_size", e->size);
        put_str(f, "blocks");
        fputc(EMPTY_LIST, f);
        fputc(MARK, f);
        fputc(EMPTY_DICT, f);
        fputc(MARK, f);
        key_uint(f, "address", e->ptr);
        key_uint(f, "size", e->size);
        key_uint(f, "requested_size", e->size);
        key_str(f, "state", "active_allocated");
        put_str(f, "frames");
        frames(o, stack_of(o, i));
        fputc(SETITEMS, f);
        fputc(APPENDS, f);
        fputc(SETITEMS, f);
    }
    fputc(APPENDS, f);
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
    w o = {.t = t, .seen = calloc(slots ? slots : 1, 1)};
    if (!o.seen) return cuma_fail(CUMA_ERR_OOM, "%s: out of host memory", path);
    o.f = fopen(path, "wb");
    if (!o.f) {
        int err = errno;
        free(o.seen);
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
    int bad = ferror(o.f);
    if (fclose(o.f) != 0) bad = 1;
    if (bad) {
        remove(path);
        return cuma_fail(CUMA_ERR_IO, "%s: error writing the snapshot", path);
    }
    return CUMA_OK;
}
