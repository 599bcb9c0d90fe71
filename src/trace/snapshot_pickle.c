// SPDX-License-Identifier: Apache-2.0
/* PyTorch memory snapshot -> cuma_trace (see snapshot_pickle.h, trace.h).
 *
 * The whole (decompressed) file is read into memory and parsed by the plain-data pickle
 * reader; then only known paths are looked at: root['device_traces'][device][i][field] and
 * root['segments'][j]['blocks'][k][field]. Every list walked is bounded by max_events (a list
 * shared through the pickle memo could otherwise be walked again and again), every dict by
 * CUMA_SNAPSHOT_MAX_FIELDS fields.
 *
 * Frees: PyTorch writes free_requested when the program lets go of a block and free_completed
 * when the block is really back in the pool (after the streams that used it are done); the
 * replay takes free_completed, or free_requested when no free_completed of that block follows
 * before it is allocated again. The events of each address are put side by side by a sort on
 * (address, index), so that choice and the blocks alive before recording are found per
 * address without a hash map.
 *
 * Call stacks (only when asked for: `cuma replay` never looks at them): an alloc event's
 * 'frames', a dump block's 'frames' or, as older PyTorch wrote it, the 'frames' of the last
 * entry of its 'history'. PyTorch shares each distinct frame dict through the pickle memo, and
 * an alloc shares its frames list with its frees, so frames and stacks are first looked up by
 * node index and only interned by content (stacks.h) the first time a node is seen.
 */
#include "snapshot_pickle.h"

#include "util/error.h"
#include "pickle.h"
#include "stacks.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* Evenly spaced times for a snapshot without time_us: 1 ms apart. */
#define SYNTH_STEP_US 1000

typedef enum {
    A_OTHER = 0,
    A_ALLOC,
    A_FREE_REQ,
    A_FREE_DONE,
    A_SEG_ALLOC,
    A_SEG_FREE,
    A_SEG_MAP,
    A_SEG_UNMAP,
    A_OOM,
} act;

static const struct {
    const char *name;
    act a;
} act_names[] = {
    {"alloc", A_ALLOC},
    {"free_requested", A_FREE_REQ},
    {"free_completed", A_FREE_DONE},
    {"segment_alloc", A_SEG_ALLOC},
    {"segment_free", A_SEG_FREE},
    {"segment_map", A_SEG_MAP},
    {"segment_unmap", A_SEG_UNMAP},
    {"oom", A_OOM},
};

typedef struct rec {
    uint64_t addr, size, stream, time_us;
    uint8_t a;        /* act */
    uint8_t use;      /* a FREE_REQ/FREE_DONE that becomes the replay's FREE */
    uint8_t has_time; /* time_us was there */
    uint32_t stack;   /* an ALLOC's call stack (0: none or not asked for) */
} rec;

typedef struct conv {
    const char *path;
    const cuma_pickle *p;
    size_t max_events;
    rec *r;
    size_t n;
    cuma_stacks_builder *sb; /* NULL: stacks not asked for */
    cuma_map frame_node;     /* frame dict node -> frame id + 1 */
    cuma_map list_node;      /* frames list node -> stack id + 1 */
    uint32_t *fbuf;          /* one stack's frame ids while it is read */
    size_t fbuf_cap;
} conv;

static const cuma_pickle_node *node(const conv *c, int64_t i) {
    return i >= 0 ? &c->p->node[i] : NULL;
}

static int str_is(const conv *c, const cuma_pickle_node *nd, const char *s) {
    size_t n = strlen(s);
    return nd && nd->kind == CUMA_PK_STR && nd->u.s.len == n &&
           !memcmp(c->p->text + nd->u.s.off, s, n);
}

/* d[key] of a dict that must be a record (at most CUMA_SNAPSHOT_MAX_FIELDS fields). */
static cuma_status field(const conv *c, uint32_t d, const char *what, size_t i, const char *key,
                         int64_t *out) {
    int too_big = 0;
    if (c->p->node[d].kind != CUMA_PK_DICT)
        return cuma_fail(CUMA_ERR_PARSE, "%s: %s %zu is not a dict", c->path, what, i);
    *out = cuma_pickle_dict_get(c->p, d, key, CUMA_SNAPSHOT_MAX_FIELDS, &too_big);
    if (too_big)
        return cuma_fail(CUMA_ERR_PARSE, "%s: %s %zu has %u fields, more than the %u a record has",
                         c->path, what, i, c->p->node[d].n, CUMA_SNAPSHOT_MAX_FIELDS);
    return CUMA_OK;
}

/* An int field >= 0; absent: *present 0 (an error when present is NULL). */
static cuma_status uint_field(const conv *c, uint32_t d, const char *what, size_t i,
                              const char *key, uint64_t *out, int *present) {
    int64_t v = -1;
    cuma_status st = field(c, d, what, i, key, &v);
    if (st != CUMA_OK) return st;
    const cuma_pickle_node *nd = node(c, v);
    if (present) *present = nd != NULL;
    if (!nd) {
        *out = 0;
        if (present) return CUMA_OK;
        return cuma_fail(CUMA_ERR_PARSE, "%s: %s %zu has no '%s'", c->path, what, i, key);
    }
    if (nd->kind != CUMA_PK_INT || nd->u.i < 0)
        return cuma_fail(CUMA_ERR_PARSE, "%s: %s %zu: '%s' is not an int from 0 to 2^63-1", c->path,
                         what, i, key);
    *out = (uint64_t)nd->u.i;
    return CUMA_OK;
}

/* A list node's items (n of them) or an error naming what it should have been. */
static cuma_status list_of(const conv *c, int64_t idx, const char *what, const uint32_t **items,
                           size_t *n) {
    const cuma_pickle_node *nd = node(c, idx);
    if (!nd || (nd->kind != CUMA_PK_LIST && nd->kind != CUMA_PK_TUPLE))
        return cuma_fail(CUMA_ERR_PARSE, "%s: %s is not a list", c->path, what);
    *items = nd->u.c.items;
    *n = nd->n;
    return CUMA_OK;
}

/* A str field's text ("" when absent or None); an error when it is something else. */
static cuma_status str_field(const conv *c, uint32_t d, const char *what, size_t i, const char *key,
                             const char **p, size_t *len) {
    int64_t v = -1; /* field() sets it on success; gcc -O2 cannot tell */
    cuma_status st = field(c, d, what, i, key, &v);
    if (st != CUMA_OK) return st;
    const cuma_pickle_node *nd = node(c, v);
    *p = "";
    *len = 0;
    if (!nd || nd->kind == CUMA_PK_NONE) return CUMA_OK;
    if (nd->kind != CUMA_PK_STR)
        return cuma_fail(CUMA_ERR_PARSE, "%s: %s %zu: '%s' is not a string", c->path, what, i, key);
    *p = c->p->text + nd->u.s.off;
    *len = nd->u.s.len;
    return CUMA_OK;
}

/* The frame id of frame dict node d, frame k of `what` i (for messages). */
static cuma_status frame_of(conv *c, uint32_t d, const char *what, size_t i, uint32_t k,
                            uint32_t *out) {
    uintptr_t known = (uintptr_t)cuma_map_get(&c->frame_node, d);
    if (known) {
        *out = (uint32_t)(known - 1);
        return CUMA_OK;
    }
    const char *file, *name;
    size_t flen, nlen;
    int64_t ln;
    cuma_status st;
    char label[80];
    snprintf(label, sizeof label, "%s %zu: frame", what, i);
    if ((st = str_field(c, d, label, k, "filename", &file, &flen)) != CUMA_OK ||
        (st = str_field(c, d, label, k, "name", &name, &nlen)) != CUMA_OK ||
        (st = field(c, d, label, k, "line", &ln)) != CUMA_OK)
        return st;
    /* A line is informative only: one that is not a small int is taken as unknown. */
    const cuma_pickle_node *l = node(c, ln);
    uint32_t line =
        l && l->kind == CUMA_PK_INT && l->u.i > 0 && l->u.i <= UINT32_MAX ? (uint32_t)l->u.i : 0;
    if ((st = cuma_stacks_frame(c->sb, file, flen, name, nlen, line, out)) != CUMA_OK) return st;
    if (!cuma_map_put(&c->frame_node, d, (void *)(uintptr_t)(*out + 1)))
        return cuma_fail(CUMA_ERR_OOM, "%s: out of host memory", c->path);
    return CUMA_OK;
}

/* The stack id of a 'frames' value (node index f, -1 when absent): None or absent is stack 0. */
static cuma_status stack_of(conv *c, int64_t f, const char *what, size_t i, uint32_t *out) {
    *out = 0;
    const cuma_pickle_node *nd = node(c, f);
    if (!nd || nd->kind == CUMA_PK_NONE) return CUMA_OK;
    uintptr_t known = (uintptr_t)cuma_map_get(&c->list_node, (uint64_t)f);
    if (known) {
        *out = (uint32_t)(known - 1);
        return CUMA_OK;
    }
    if (nd->kind != CUMA_PK_LIST && nd->kind != CUMA_PK_TUPLE)
        return cuma_fail(CUMA_ERR_PARSE, "%s: %s %zu: 'frames' is not a list", c->path, what, i);
    if (nd->n > c->fbuf_cap) {
        uint32_t *b = realloc(c->fbuf, (size_t)nd->n * sizeof *b);
        if (!b) return cuma_fail(CUMA_ERR_OOM, "%s: out of host memory", c->path);
        c->fbuf = b;
        c->fbuf_cap = nd->n;
    }
    /* nd->u.c.items stays put: nothing here adds nodes to the tree. */
    for (uint32_t k = 0; k < nd->n; k++) {
        uint32_t d = nd->u.c.items[k];
        if (c->p->node[d].kind != CUMA_PK_DICT)
            return cuma_fail(CUMA_ERR_PARSE, "%s: %s %zu: frame %u is not a dict", c->path, what, i,
                             k);
        cuma_status st = frame_of(c, d, what, i, k, &c->fbuf[k]);
        if (st != CUMA_OK) return st;
    }
    cuma_status st = cuma_stacks_stack(c->sb, c->fbuf, nd->n, out);
    if (st != CUMA_OK) return st;
    if (!cuma_map_put(&c->list_node, (uint64_t)f, (void *)(uintptr_t)(*out + 1)))
        return cuma_fail(CUMA_ERR_OOM, "%s: out of host memory", c->path);
    return CUMA_OK;
}

/* A dump block's stack: its 'frames', or those of the last entry of its 'history'. */
static cuma_status block_stack(conv *c, uint32_t b, size_t j, uint32_t *out) {
    int64_t f, h;
    cuma_status st = field(c, b, "block", j, "frames", &f);
    if (st == CUMA_OK) st = stack_of(c, f, "block", j, out);
    if (st != CUMA_OK || *out) return st;
    if ((st = field(c, b, "block", j, "history", &h)) != CUMA_OK) return st;
    const cuma_pickle_node *hn = node(c, h);
    if (!hn || hn->kind == CUMA_PK_NONE ||
        ((hn->kind == CUMA_PK_LIST || hn->kind == CUMA_PK_TUPLE) && !hn->n))
        return CUMA_OK;
    if (hn->kind != CUMA_PK_LIST && hn->kind != CUMA_PK_TUPLE)
        return cuma_fail(CUMA_ERR_PARSE, "%s: block %zu: 'history' is not a list", c->path, j);
    uint32_t last = hn->u.c.items[hn->n - 1];
    if ((st = field(c, last, "block history of", j, "frames", &f)) != CUMA_OK) return st;
    return stack_of(c, f, "block history of", j, out);
}

/* Reads the chosen device's events into c->r. */
static cuma_status read_events(conv *c, const uint32_t *ev, size_t n) {
    if (n > c->max_events)
        return cuma_fail(
            CUMA_ERR_LIMIT,
            "%s: more than %zu events, the reader's limit (cuma replay --max-events N)", c->path,
            c->max_events);
    c->r = calloc(n ? n : 1, sizeof *c->r);
    if (!c->r) return cuma_fail(CUMA_ERR_OOM, "%s: out of host memory", c->path);
    for (size_t i = 0; i < n; i++) {
        rec *r = &c->r[i];
        int64_t a;
        cuma_status st = field(c, ev[i], "event", i, "action", &a);
        if (st != CUMA_OK) return st;
        if (!node(c, a) || node(c, a)->kind != CUMA_PK_STR)
            return cuma_fail(CUMA_ERR_PARSE, "%s: event %zu has no 'action' string", c->path, i);
        r->a = A_OTHER;
        for (size_t k = 0; k < sizeof act_names / sizeof act_names[0]; k++)
            if (str_is(c, node(c, a), act_names[k].name)) r->a = (uint8_t)act_names[k].a;
        int present, has_time;
        if (r->a != A_OTHER) {
            if ((st = uint_field(c, ev[i], "event", i, "addr", &r->addr, &present)) != CUMA_OK ||
                (st = uint_field(c, ev[i], "event", i, "size", &r->size, &present)) != CUMA_OK)
                return st;
            /* A stream is a cudaStream_t: any bits, so a negative int is taken as they are. */
            int64_t s;
            if ((st = field(c, ev[i], "event", i, "stream", &s)) != CUMA_OK) return st;
            r->stream =
                node(c, s) && node(c, s)->kind == CUMA_PK_INT ? (uint64_t)node(c, s)->u.i : 0;
        }
        if ((st = uint_field(c, ev[i], "event", i, "time_us", &r->time_us, &has_time)) != CUMA_OK)
            return st;
        r->has_time = (uint8_t)has_time;
        if (c->sb && r->a == A_ALLOC) {
            int64_t f;
            if ((st = field(c, ev[i], "event", i, "frames", &f)) != CUMA_OK ||
                (st = stack_of(c, f, "event", i, &r->stack)) != CUMA_OK)
                return st;
        }
    }
    c->n = n;
    return CUMA_OK;
}

/* An event of an address, for the sort that puts each address's events side by side. */
typedef struct keyed {
    uint64_t addr;
    size_t i;
} keyed;

static int cmp_u64(const void *x, const void *y) {
    uint64_t a = *(const uint64_t *)x, b = *(const uint64_t *)y;
    return a < b ? -1 : a > b;
}

static int by_addr(const void *x, const void *y) {
    const keyed *a = x, *b = y;
    if (a->addr != b->addr) return a->addr < b->addr ? -1 : 1;
    return a->i < b->i ? -1 : a->i > b->i;
}

/* Blocks alive before recording, as (addr, size) pairs: frees of an address before any
 * allocation of it, and active blocks of the dump whose address the trace never names. */
typedef struct pre {
    uint64_t addr, size, stream;
    uint32_t stack;
} pre;

typedef struct pres {
    pre *v;
    size_t n, cap;
} pres;

static cuma_status pre_add(const conv *c, pres *ps, uint64_t addr, uint64_t size, uint64_t stream,
                           uint32_t stack) {
    if (ps->n + c->n >= c->max_events)
        return cuma_fail(CUMA_ERR_LIMIT,
                         "%s: more than %zu events with the blocks alive before recording, the "
                         "reader's limit (cuma replay --max-events N)",
                         c->path, c->max_events);
    if (ps->n == ps->cap) {
        size_t cap = ps->cap ? ps->cap * 2 : 64;
        pre *v = realloc(ps->v, cap * sizeof *v);
        if (!v) return cuma_fail(CUMA_ERR_OOM, "%s: out of host memory", c->path);
        ps->v = v;
        ps->cap = cap;
    }
    ps->v[ps->n++] = (pre){addr, size, stream, stack};
    return CUMA_OK;
}

/* Sorted addresses the trace's alloc/free events name (for the dump's blocks to look up). */
typedef struct named {
    uint64_t *addr;
    size_t n;
} named;

static int named_has(const named *nm, uint64_t a) {
    size_t lo = 0, hi = nm->n;
    while (lo < hi) {
        size_t mid = lo + (hi - lo) / 2;
        if (nm->addr[mid] < a)
            lo = mid + 1;
        else
            hi = mid;
    }
    return lo < nm->n && nm->addr[lo] == a;
}

/* The sorted addresses that the trace's segment events name: a dump segment at one of them was
 * made or changed during recording, so it is no cache from before. */
static cuma_status segment_event_addrs(const conv *c, named *out) {
    out->n = 0;
    out->addr = malloc((c->n ? c->n : 1) * sizeof *out->addr);
    if (!out->addr) return cuma_fail(CUMA_ERR_OOM, "%s: out of host memory", c->path);
    for (size_t i = 0; i < c->n; i++)
        if (c->r[i].a >= A_SEG_ALLOC && c->r[i].a <= A_SEG_UNMAP)
            out->addr[out->n++] = c->r[i].addr;
    qsort(out->addr, out->n, sizeof *out->addr, cmp_u64);
    return CUMA_OK;
}

/* The segments from before recording, as the dump lists them. */
typedef struct seglist {
    cuma_trace_segment *v;
    size_t n, cap;
} seglist;

static cuma_status seg_add(const conv *c, seglist *ss, uint64_t addr, uint64_t size,
                           uint64_t stream) {
    if (ss->n == ss->cap) {
        size_t cap = ss->cap ? ss->cap * 2 : 64;
        cuma_trace_segment *v = realloc(ss->v, cap * sizeof *v);
        if (!v) return cuma_fail(CUMA_ERR_OOM, "%s: out of host memory", c->path);
        ss->v = v;
        ss->cap = cap;
    }
    ss->v[ss->n++] = (cuma_trace_segment){addr, size, stream};
    return CUMA_OK;
}

static int seg_by_addr(const void *x, const void *y) {
    const cuma_trace_segment *a = x, *b = y;
    if (a->addr != b->addr) return a->addr < b->addr ? -1 : 1;
    return a->size < b->size ? -1 : a->size > b->size;
}

/* Sorts the segments and drops those a malformed file makes overlap an earlier one (or wrap
 * around the address space): the model needs disjoint segments. */
static void segs_settle(seglist *ss) {
    if (ss->n > 1) qsort(ss->v, ss->n, sizeof *ss->v, seg_by_addr); /* v is NULL when empty */
    size_t k = 0;
    for (size_t i = 0; i < ss->n; i++) {
        const cuma_trace_segment *s = &ss->v[i];
        if (!s->size || s->addr > UINT64_MAX - s->size) continue;
        if (k && ss->v[k - 1].addr + ss->v[k - 1].size > s->addr) continue;
        ss->v[k++] = *s;
    }
    ss->n = k;
}

/* Chooses the frees (rec.use) and finds the frees of blocks allocated before recording. */
static cuma_status pair_frees(conv *c, pres *ps, named *nm) {
    size_t k = 0;
    for (size_t i = 0; i < c->n; i++)
        k += c->r[i].a == A_ALLOC || c->r[i].a == A_FREE_REQ || c->r[i].a == A_FREE_DONE;
    keyed *ix = malloc((k ? k : 1) * sizeof *ix);
    nm->addr = malloc((k ? k : 1) * sizeof *nm->addr);
    if (!ix || !nm->addr) {
        free(ix);
        return cuma_fail(CUMA_ERR_OOM, "%s: out of host memory", c->path);
    }
    k = 0;
    for (size_t i = 0; i < c->n; i++)
        if (c->r[i].a == A_ALLOC || c->r[i].a == A_FREE_REQ || c->r[i].a == A_FREE_DONE)
            ix[k++] = (keyed){c->r[i].addr, i};
    qsort(ix, k, sizeof *ix, by_addr);
    cuma_status st = CUMA_OK;
    for (size_t g = 0; g < k && st == CUMA_OK;) {
        size_t end = g;
        uint64_t addr = c->r[ix[g].i].addr;
        while (end < k && c->r[ix[end].i].addr == addr) end++;
        nm->addr[nm->n++] = addr;
        /* Backwards: a free_requested is the free unless a free_completed follows it before
         * the next allocation. */
        int done_after = 0;
        for (size_t j = end; j-- > g;) {
            rec *r = &c->r[ix[j].i];
            if (r->a == A_FREE_DONE) {
                r->use = 1;
                done_after = 1;
            } else if (r->a == A_ALLOC) {
                done_after = 0;
            } else {
                r->use = !done_after;
            }
        }
        /* Forwards: a free before the address's first allocation frees a block from before. */
        for (size_t j = g; j < end; j++) {
            const rec *r = &c->r[ix[j].i];
            if (r->a == A_ALLOC) break;
            if (r->use) {
                st = pre_add(c, ps, addr, r->size, r->stream, 0);
                break;
            }
        }
        g = end;
    }
    free(ix);
    return st;
}

/* Whether dump segment d says it is an expandable one. */
static cuma_status is_expandable(const conv *c, uint32_t d, size_t i, int *out) {
    int64_t v = -1;
    cuma_status st = field(c, d, "segment", i, "is_expandable", &v);
    const cuma_pickle_node *nd = st == CUMA_OK ? node(c, v) : NULL;
    *out = nd && (nd->kind == CUMA_PK_BOOL || nd->kind == CUMA_PK_INT) && nd->u.i;
    return st;
}

/* The dump's segments of this device: their total bytes, those no segment event names (segev:
 * reserved before recording and kept), and their active blocks the trace never names (alive
 * since before recording). */
static cuma_status read_segments(conv *c, int64_t segs, int device, const named *nm,
                                 const named *segev, pres *ps, seglist *ss,
                                 uint64_t *reserved_end) {
    *reserved_end = 0;
    if (segs < 0) return CUMA_OK; /* no 'segments': nothing alive at the dump */
    const uint32_t *sv = NULL;
    size_t ns = 0;
    cuma_status st = list_of(c, segs, "'segments'", &sv, &ns);
    if (st != CUMA_OK) return st;
    size_t walked = 0;
    for (size_t i = 0; i < ns; i++) {
        uint64_t dev, total;
        int has_dev;
        if ((st = uint_field(c, sv[i], "segment", i, "device", &dev, &has_dev)) != CUMA_OK ||
            (st = uint_field(c, sv[i], "segment", i, "total_size", &total, NULL)) != CUMA_OK)
            return st;
        if (has_dev && dev != (uint64_t)device) continue;
        if (total > UINT64_MAX - *reserved_end)
            return cuma_fail(CUMA_ERR_PARSE, "%s: the segments' sizes overflow 64 bits", c->path);
        *reserved_end += total;
        uint64_t base;
        int64_t sstream = -1;
        int has_base, expandable;
        if ((st = uint_field(c, sv[i], "segment", i, "address", &base, &has_base)) != CUMA_OK ||
            (st = field(c, sv[i], "segment", i, "stream", &sstream)) != CUMA_OK ||
            (st = is_expandable(c, sv[i], i, &expandable)) != CUMA_OK)
            return st;
        /* A stream is a cudaStream_t: any bits, as for events. */
        sstream =
            node(c, sstream) && node(c, sstream)->kind == CUMA_PK_INT ? node(c, sstream)->u.i : 0;
        if (has_base && !expandable && !named_has(segev, base) &&
            (st = seg_add(c, ss, base, total, (uint64_t)sstream)) != CUMA_OK)
            return st;
        int64_t b;
        if ((st = field(c, sv[i], "segment", i, "blocks", &b)) != CUMA_OK) return st;
        if (b < 0) continue;
        const uint32_t *bv = NULL;
        size_t nb = 0;
        if ((st = list_of(c, b, "a segment's 'blocks'", &bv, &nb)) != CUMA_OK) return st;
        for (size_t j = 0; j < nb; j++) {
            if (++walked > c->max_events)
                return cuma_fail(CUMA_ERR_LIMIT,
                                 "%s: more than %zu blocks in the segments, the "
                                 "reader's limit (cuma replay --max-events N)",
                                 c->path, c->max_events);
            int64_t state;
            if ((st = field(c, bv[j], "block", j, "state", &state)) != CUMA_OK) return st;
            if (!str_is(c, node(c, state), "active_allocated")) continue;
            uint64_t addr, size, stream = (uint64_t)sstream; /* the segment's, any bits */
            if ((st = uint_field(c, bv[j], "block", j, "address", &addr, NULL)) != CUMA_OK ||
                (st = uint_field(c, bv[j], "block", j, "size", &size, NULL)) != CUMA_OK)
                return st;
            if (named_has(nm, addr)) continue;
            uint32_t stack = 0;
            if (c->sb && (st = block_stack(c, bv[j], j, &stack)) != CUMA_OK) return st;
            if ((st = pre_add(c, ps, addr, size, stream, stack)) != CUMA_OK) return st;
        }
    }
    return CUMA_OK;
}

/* Signed sums that stop at the ends instead of overflowing: sizes come from the file. */
static int64_t sat_add(int64_t a, int64_t b) {
    if (b > 0 && a > INT64_MAX - b) return INT64_MAX;
    if (b < 0 && a < INT64_MIN - b) return INT64_MIN;
    return a + b;
}

/* The change an event makes to the reserved bytes. */
static int64_t reserved_delta(const rec *r) {
    int64_t sz = r->size > INT64_MAX ? INT64_MAX : (int64_t)r->size;
    if (r->a == A_SEG_ALLOC || r->a == A_SEG_MAP) return sz;
    if (r->a == A_SEG_FREE || r->a == A_SEG_UNMAP) return -sz;
    return 0;
}

/* PyTorch's reserved bytes over the trace: known at the dump, so walked back from there. */
static void recorded_reserved(const conv *c, uint64_t reserved_end, int has_times,
                              cuma_trace_recorded *out) {
    int64_t level = reserved_end > INT64_MAX ? INT64_MAX : (int64_t)reserved_end;
    int64_t peak = level;
    for (size_t i = c->n; i-- > 0;) {
        int64_t d = reserved_delta(&c->r[i]);
        level = sat_add(level, d == INT64_MIN ? INT64_MAX : -d);
        if (level > peak) peak = level;
    }
    /* level is now what was reserved before the first event; walk forward for the average. */
    out->valid = 1;
    out->peak_reserved = peak > 0 ? (uint64_t)peak : 0;
    if (!has_times || c->n < 2) return;
    double integral = 0;
    uint64_t t_prev = c->r[0].time_us, t_first = t_prev;
    for (size_t i = 0; i < c->n; i++) {
        const rec *r = &c->r[i];
        uint64_t t = r->time_us > t_prev ? r->time_us : t_prev;
        integral += (double)(level > 0 ? level : 0) * (double)(t - t_prev);
        t_prev = t;
        level = sat_add(level, reserved_delta(r));
    }
    if (t_prev > t_first) {
        double avg = integral / (double)(t_prev - t_first);
        out->time_avg_reserved = avg >= 0x1p63 ? (uint64_t)INT64_MAX : (uint64_t)avg;
        out->has_time_avg = 1;
    }
}

static cuma_status build(conv *c, const pres *ps, seglist *ss, int has_times, cuma_trace *out) {
    size_t n = ps->n;
    for (size_t i = 0; i < c->n; i++) {
        const rec *r = &c->r[i];
        n += r->a == A_ALLOC || r->a == A_OOM ||
             ((r->a == A_FREE_REQ || r->a == A_FREE_DONE) && r->use);
    }
    cuma_trace_event *ev = malloc((n ? n : 1) * sizeof *ev);
    uint32_t *stack = c->sb ? malloc((n ? n : 1) * sizeof *stack) : NULL;
    if (!ev || (c->sb && !stack)) {
        free(ev);
        free(stack);
        return cuma_fail(CUMA_ERR_OOM, "%s: out of host memory", c->path);
    }
    uint64_t t0 = UINT64_MAX;
    for (size_t i = 0; i < c->n; i++)
        if (c->r[i].time_us < t0) t0 = c->r[i].time_us;
    size_t k = 0;
    for (size_t i = 0; i < ps->n; i++) {
        if (stack) stack[k] = ps->v[i].stack;
        ev[k++] = (cuma_trace_event){.ptr = ps->v[i].addr,
                                     .size = ps->v[i].size,
                                     .stream = ps->v[i].stream,
                                     .action = CUMA_TRACE_ALLOC};
    }
    for (size_t i = 0; i < c->n; i++) {
        const rec *r = &c->r[i];
        uint32_t a;
        if (r->a == A_ALLOC)
            a = CUMA_TRACE_ALLOC;
        else if (r->a == A_OOM)
            a = CUMA_TRACE_ALLOC_FAIL;
        else if ((r->a == A_FREE_REQ || r->a == A_FREE_DONE) && r->use)
            a = CUMA_TRACE_FREE;
        else
            continue;
        if (stack) stack[k] = a == CUMA_TRACE_ALLOC ? r->stack : 0;
        ev[k++] = (cuma_trace_event){
            .time_us = has_times ? r->time_us - t0 : (uint64_t)(i + 1) * SYNTH_STEP_US,
            .ptr = a == CUMA_TRACE_ALLOC_FAIL ? 0 : r->addr,
            .size = r->size,
            .stream = r->stream,
            .action = a,
        };
    }
    out->ev = ev;
    out->stack = stack;
    out->n = k;
    out->preexisting = ps->n;
    segs_settle(ss);
    if (ss->n) {
        out->preseg = ss->v;
        out->npreseg = ss->n;
        ss->v = NULL;
    }
    return CUMA_OK;
}

static cuma_status convert(conv *c, int device, cuma_trace *out) {
    const cuma_pickle *p = c->p;
    const cuma_pickle_node *root = &p->node[p->root];
    if (root->kind != CUMA_PK_DICT)
        return cuma_fail(CUMA_ERR_PARSE, "%s: a pickle, but not a memory snapshot (not a dict)",
                         c->path);
    int too_big = 0;
    int64_t dt =
        cuma_pickle_dict_get(p, p->root, "device_traces", CUMA_SNAPSHOT_MAX_FIELDS, &too_big);
    int64_t segs = cuma_pickle_dict_get(p, p->root, "segments", CUMA_SNAPSHOT_MAX_FIELDS, &too_big);
    if (too_big || (dt < 0 && segs < 0))
        return cuma_fail(
            CUMA_ERR_PARSE,
            "%s: a pickle, but not a memory snapshot (no 'device_traces' or 'segments')", c->path);
    const uint32_t *devs = NULL;
    size_t ndev = 0;
    cuma_status st = dt >= 0 ? list_of(c, dt, "'device_traces'", &devs, &ndev) : CUMA_OK;
    if (st != CUMA_OK) return st;
    for (size_t d = 0; d < ndev; d++) {
        const cuma_pickle_node *nd = node(c, devs[d]);
        if (nd->kind != CUMA_PK_LIST && nd->kind != CUMA_PK_TUPLE)
            return cuma_fail(CUMA_ERR_PARSE, "%s: device_traces[%zu] is not a list", c->path, d);
    }
    if (device < 0) {
        device = 0;
        for (size_t d = 1; d < ndev; d++)
            if (p->node[devs[d]].n > p->node[devs[device]].n) device = (int)d;
    } else if ((size_t)device >= ndev && ndev) {
        return cuma_fail(CUMA_ERR_INVALID,
                         "%s: no device %d: the snapshot has traces of devices 0 to %zu", c->path,
                         device, ndev - 1);
    } else if ((size_t)device >= ndev) {
        return cuma_fail(CUMA_ERR_INVALID, "%s: no device %d: the snapshot has no device traces",
                         c->path, device);
    }
    if (ndev &&
        (st = read_events(c, p->node[devs[device]].u.c.items, p->node[devs[device]].n)) != CUMA_OK)
        return st;
    int has_times = c->n > 0;
    for (size_t i = 0; i < c->n; i++) has_times &= c->r[i].has_time;
    pres ps = {0};
    named nm = {0}, segev = {0};
    seglist ss = {0};
    uint64_t reserved_end = 0;
    st = pair_frees(c, &ps, &nm);
    if (st == CUMA_OK) st = segment_event_addrs(c, &segev);
    if (st == CUMA_OK) st = read_segments(c, segs, device, &nm, &segev, &ps, &ss, &reserved_end);
    if (st == CUMA_OK) st = build(c, &ps, &ss, has_times, out);
    if (st == CUMA_OK) {
        recorded_reserved(c, reserved_end, has_times, &out->recorded);
        out->synthetic_times = !has_times && out->n > 0;
        out->device = device;
        out->format = CUMA_TRACE_TORCH_SNAPSHOT;
    }
    free(ps.v);
    free(nm.addr);
    free(segev.addr);
    free(ss.v);
    return st;
}

cuma_status cuma_snapshot_from_bytes(const uint8_t *buf, size_t len, const char *path,
                                     size_t max_events, int device, int stacks, cuma_trace *out) {
    memset(out, 0, sizeof *out);
    cuma_pickle p;
    cuma_status st = cuma_pickle_parse(buf, len, NULL, &p);
    if (st != CUMA_OK) {
        cuma_error_saved e;
        cuma_error_save(&e);
        return cuma_fail(st, "%s: %s", path, e.text);
    }
    conv c = {.path = path, .p = &p, .max_events = max_events};
    cuma_stacks_builder sb;
    cuma_map_init(&c.frame_node);
    cuma_map_init(&c.list_node);
    if (stacks) {
        st = cuma_stacks_init(&sb, path);
        c.sb = &sb;
    }
    if (st == CUMA_OK) st = convert(&c, device, out);
    if (c.sb && st == CUMA_OK)
        cuma_stacks_finish(&sb, &out->stacks);
    else if (c.sb)
        cuma_stacks_discard(&sb);
    cuma_map_destroy(&c.frame_node);
    cuma_map_destroy(&c.list_node);
    free(c.fbuf);
    free(c.r);
    cuma_pickle_free(&p);
    if (st == CUMA_OK && !(out->path = strdup(path)))
        st = cuma_fail(CUMA_ERR_OOM, "%s: out of host memory", path);
    if (st == CUMA_OK) st = cuma_trace_link(out);
    if (st != CUMA_OK) cuma_trace_free(out);
    return st;
}

cuma_status cuma_gz_read_all(gzFile gz, const char *path, size_t max_bytes, const char *what,
                             uint8_t **out, size_t *out_len) {
    *out = NULL;
    *out_len = 0;
    size_t cap = 1 << 20, len = 0;
    uint8_t *buf = malloc(cap);
    if (!buf) return cuma_fail(CUMA_ERR_OOM, "%s: out of host memory", path);
    for (;;) {
        if (len == cap) {
            if (cap >= max_bytes) {
                free(buf);
                return cuma_fail(CUMA_ERR_LIMIT,
                                 "%s: more than %zu MiB decompressed, the %s reader's limit", path,
                                 max_bytes >> 20, what);
            }
            uint8_t *b = realloc(buf, cap * 2);
            if (!b) {
                free(buf);
                return cuma_fail(CUMA_ERR_OOM, "%s: out of host memory", path);
            }
            buf = b;
            cap *= 2;
        }
        size_t want = cap - len > (1u << 30) ? (1u << 30) : cap - len;
        int got = gzread(gz, buf + len, (unsigned)want);
        if (got < 0) {
            int zerr = Z_OK;
            const char *zmsg = gzerror(gz, &zerr);
            cuma_status st = cuma_fail(CUMA_ERR_IO, "%s: read failed: %s", path,
                                       zerr == Z_ERRNO ? strerror(errno) : zmsg);
            free(buf);
            return st;
        }
        if (got == 0) {
            /* zlib gives a gzip stream that stops short (even in its trailer, after the whole
             * data) as an end of file; only gzerror tells it apart. */
            int zerr = Z_OK;
            (void)gzerror(gz, &zerr);
            if (zerr == Z_BUF_ERROR) {
                free(buf);
                return cuma_fail(CUMA_ERR_IO,
                                 "%s: read failed: the compressed data ends early (a truncated "
                                 "file?)",
                                 path);
            }
            break;
        }
        len += (size_t)got;
    }
    *out = buf;
    *out_len = len;
    return CUMA_OK;
}

cuma_status cuma_snapshot_read(gzFile gz, const char *path, size_t max_events, int device,
                               int stacks, cuma_trace *out) {
    memset(out, 0, sizeof *out);
    uint8_t *buf;
    size_t len;
    cuma_status st = cuma_gz_read_all(gz, path, CUMA_SNAPSHOT_MAX_BYTES, "snapshot", &buf, &len);
    if (st != CUMA_OK) return st;
    st = cuma_snapshot_from_bytes(buf, len, path, max_events, device, stacks, out);
    free(buf);
    return st;
}
