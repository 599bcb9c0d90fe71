// SPDX-License-Identifier: Apache-2.0
/* Unit test of the plain-data pickle reader (src/trace/pickle.c) and the PyTorch snapshot
 * converter behind cuma_trace_load_opts (src/trace/snapshot_pickle.c), on pickles written
 * byte by byte here, with their call stacks (cuma_trace_opts.stacks).
 *
 * usage: test_snapshot_reader WORK_DIR   (a writable folder for the snapshot files)
 */
#include "check.h"
#include "trace/pickle.h"
#include "trace/trace.h"

#include <stdint.h>
#include <string.h>
#include <zlib.h>

/* ---- a tiny pickle writer ---------------------------------------------------------------- */

typedef struct buf {
    uint8_t b[1 << 16];
    size_t n;
} buf;

static void put(buf *w, const void *p, size_t n) {
    CHECK(w->n + n <= sizeof w->b);
    memcpy(w->b + w->n, p, n);
    w->n += n;
}

static void op(buf *w, uint8_t c) {
    put(w, &c, 1);
}

static void str(buf *w, const char *s) {
    op(w, 0x8c); /* SHORT_BINUNICODE */
    op(w, (uint8_t)strlen(s));
    put(w, s, strlen(s));
}

static void i64(buf *w, int64_t x) {
    op(w, 0x8a); /* LONG1, 8 bytes */
    op(w, 8);
    for (int i = 0; i < 8; i++) op(w, (uint8_t)((uint64_t)x >> (8 * i)));
}

static void proto(buf *w) {
    w->n = 0;
    op(w, 0x80);
    op(w, 4);
}

/* An event dict; time < 0 leaves time_us out. */
static void event(buf *w, const char *action, int64_t addr, int64_t size, int64_t stream,
                  int64_t time) {
    op(w, '}');
    op(w, '(');
    str(w, "action"), str(w, action);
    str(w, "addr"), i64(w, addr);
    str(w, "size"), i64(w, size);
    str(w, "stream"), i64(w, stream);
    if (time >= 0) str(w, "time_us"), i64(w, time);
    str(w, "frames"), op(w, ']');
    op(w, 'u');
}

/* ---- pickle reader ----------------------------------------------------------------------- */

static cuma_status parse(const buf *w, const cuma_pickle_limits *lim, cuma_pickle *p) {
    return cuma_pickle_parse(w->b, w->n, lim, p);
}

static void test_values(void) {
    buf w;
    proto(&w);
    op(&w, ']'), op(&w, 0x94); /* memo 0: the outer list */
    op(&w, '(');
    op(&w, 'K'), op(&w, 200);
    op(&w, 'M'), op(&w, 0x34), op(&w, 0x12);
    op(&w, 'J'), put(&w, "\xff\xff\xff\xff", 4);               /* -1 */
    op(&w, 0x8a), op(&w, 2), put(&w, "\x00\x80", 2);           /* LONG1 -32768 */
    op(&w, 0x8a), op(&w, 9), put(&w, "\0\0\0\0\0\0\0\0\1", 9); /* 2^64: too wide */
    op(&w, 'G'), put(&w, "\x3f\xf8\0\0\0\0\0\0", 8);           /* 1.5 */
    str(&w, "hi"), op(&w, 0x94);                               /* memo 1 */
    op(&w, 'h'), op(&w, 1);                                    /* the same str again */
    op(&w, 'N'), op(&w, 0x88), op(&w, 'C'), op(&w, 2), put(&w, "ab", 2);
    op(&w, 'h'), op(&w, 0); /* the list holds itself */
    op(&w, 'e');
    op(&w, '.');
    cuma_pickle p;
    CHECK_OK(parse(&w, NULL, &p));
    CHECK_OK(cuma_pickle_validate(&p));
    const cuma_pickle_node *l = &p.node[p.root];
    CHECK(l->kind == CUMA_PK_LIST && l->n == 12);
    const uint32_t *it = l->u.c.items;
    CHECK(p.node[it[0]].kind == CUMA_PK_INT && p.node[it[0]].u.i == 200);
    CHECK(p.node[it[1]].u.i == 0x1234);
    CHECK(p.node[it[2]].u.i == -1);
    CHECK(p.node[it[3]].kind == CUMA_PK_INT && p.node[it[3]].u.i == -32768);
    CHECK(p.node[it[4]].kind == CUMA_PK_BIGINT);
    CHECK(p.node[it[5]].kind == CUMA_PK_FLOAT && p.node[it[5]].u.f == 1.5);
    CHECK(it[6] == it[7] && p.node[it[6]].kind == CUMA_PK_STR && p.node[it[6]].u.s.len == 2 &&
          !memcmp(p.text + p.node[it[6]].u.s.off, "hi", 2));
    CHECK(p.node[it[8]].kind == CUMA_PK_NONE);
    CHECK(p.node[it[9]].kind == CUMA_PK_BOOL && p.node[it[9]].u.i == 1);
    CHECK(p.node[it[10]].kind == CUMA_PK_BYTES);
    CHECK(it[11] == p.root);
    cuma_pickle_free(&p);
    CHECK(!p.node && !p.n);

    /* A dict's repeated key: the last one wins, as in Python. */
    proto(&w);
    op(&w, '}'), op(&w, '('), str(&w, "k"), op(&w, 'K'), op(&w, 1), str(&w, "k"), op(&w, 'K'),
        op(&w, 2), op(&w, 'u'), op(&w, '.');
    CHECK_OK(parse(&w, NULL, &p));
    int64_t v = cuma_pickle_dict_get(&p, p.root, "k", 64, NULL);
    CHECK(v >= 0 && p.node[v].u.i == 2);
    int too_big = 0;
    CHECK(cuma_pickle_dict_get(&p, p.root, "k", 1, &too_big) < 0 && too_big);
    CHECK(cuma_pickle_dict_get(&p, p.root, "absent", 64, NULL) < 0);
    cuma_pickle_free(&p);
}

static void expect_fail(const buf *w, const cuma_pickle_limits *lim, cuma_status want,
                        const char *msg) {
    cuma_pickle p;
    cuma_status st = parse(w, lim, &p);
    if (st != want || !strstr(cuma_last_error(), msg)) {
        fprintf(stderr, "wanted status %d with '%s', got %d: %s\n", (int)want, msg, (int)st,
                cuma_last_error());
        abort();
    }
    CHECK(!p.node && !p.n && !p.text);
}

static void test_refused(void) {
    static const struct {
        uint8_t op;
        const char *name;
    } code[] = {{'c', "GLOBAL"}, {0x93, "STACK_GLOBAL"}, {'R', "REDUCE"},      {'b', "BUILD"},
                {'i', "INST"},   {'o', "OBJ"},           {0x81, "NEWOBJ"},     {0x92, "NEWOBJ_EX"},
                {'P', "PERSID"}, {'Q', "BINPERSID"},     {0x82, "EXT1"},       {'I', "INT"},
                {'S', "STRING"}, {0x8f, "EMPTY_SET"},    {0x97, "NEXT_BUFFER"}};
    buf w;
    for (size_t i = 0; i < sizeof code / sizeof code[0]; i++) {
        proto(&w);
        op(&w, code[i].op);
        put(&w, "os\nsystem\n", 10);
        char want[80];
        snprintf(want, sizeof want, "pickle: %s (0x%02x) at offset 2: refused", code[i].name,
                 code[i].op);
        expect_fail(&w, NULL, CUMA_ERR_PARSE, want);
    }
    proto(&w);
    op(&w, 0xff);
    expect_fail(&w, NULL, CUMA_ERR_PARSE, "unknown opcode (0xff) at offset 2: not a pickle opcode");
    w.n = 0;
    op(&w, 0x80), op(&w, 6), op(&w, 'N'), op(&w, '.');
    expect_fail(&w, NULL, CUMA_ERR_PARSE, "protocol not from 2 to 5");
    proto(&w);
    op(&w, 'N'), op(&w, 'N'), op(&w, '.');
    expect_fail(&w, NULL, CUMA_ERR_PARSE, "exactly one value");
    proto(&w);
    op(&w, 'K'), op(&w, 1), op(&w, 'K'), op(&w, 2), op(&w, 'a');
    expect_fail(&w, NULL, CUMA_ERR_PARSE, "APPEND (0x61) at offset 6: the target is not a list");
    proto(&w);
    op(&w, 'h'), op(&w, 3);
    expect_fail(&w, NULL, CUMA_ERR_PARSE, "memo entry never set");
    proto(&w);
    op(&w, 'N'), op(&w, 'r'), put(&w, "\0\0\0\x40", 4);
    expect_fail(&w, NULL, CUMA_ERR_PARSE, "memo id beyond the values made so far");
    proto(&w);
    op(&w, 'X'), put(&w, "\xff\xff\xff\x7f", 4), put(&w, "abc", 3);
    expect_fail(&w, NULL, CUMA_ERR_PARSE, "BINUNICODE (0x58) at offset 2: the pickle ends inside");

    /* Every prefix of a valid pickle fails cleanly. */
    buf full;
    proto(&full);
    event(&full, "alloc", 4096, 512, 0, 10);
    op(&full, '.');
    for (size_t n = 0; n < full.n; n++) {
        cuma_pickle p;
        CHECK(cuma_pickle_parse(full.b, n, NULL, &p) == CUMA_ERR_PARSE);
        CHECK(strstr(cuma_last_error(), "truncated"));
    }
}

static void test_limits(void) {
    buf w;
    proto(&w);
    for (int i = 0; i < 20; i++) op(&w, '(');
    cuma_pickle_limits lim = {
        .max_nodes = 100, .max_bytes = 1 << 20, .max_depth = 10, .max_stack = 100};
    expect_fail(&w, &lim, CUMA_ERR_LIMIT, "MARK (0x28) at offset 12: more than 10 open MARKs");
    proto(&w);
    for (int i = 0; i < 200; i++) op(&w, 'N');
    expect_fail(&w, &lim, CUMA_ERR_LIMIT, "more than 100 values, the reader's limit");
    lim.max_nodes = 1000;
    expect_fail(&w, &lim, CUMA_ERR_LIMIT, "more than 100 values on the stack");
    proto(&w);
    op(&w, ']'), op(&w, '(');
    for (int i = 0; i < 50; i++) op(&w, 'N');
    op(&w, 'e');
    lim.max_stack = 1000;
    lim.max_bytes = 256;
    expect_fail(&w, &lim, CUMA_ERR_LIMIT, "bytes of memory");
}

/* ---- snapshots --------------------------------------------------------------------------- */

static char path_buf[4096];

static const char *save(const char *dir, const char *name, const buf *w, int gz) {
    snprintf(path_buf, sizeof path_buf, "%s/%s", dir, name);
    if (gz) {
        gzFile f = gzopen(path_buf, "wb");
        CHECK(f && gzwrite(f, w->b, (unsigned)w->n) == (int)w->n && gzclose(f) == Z_OK);
    } else {
        FILE *f = fopen(path_buf, "wb");
        CHECK(f && fwrite(w->b, 1, w->n, f) == w->n && fclose(f) == 0);
    }
    return path_buf;
}

/* The stream of device 0's segment from before recording (a cudaStream_t: any bits). */
static int64_t seg_stream = 5;

/* Device 0: a segment from before recording with one live block, a block freed only by
 * request, streams, an OOM; device 1: one event. */
static void snapshot(buf *w, int times) {
    int64_t T0 = 1700000000000000;
#define T(x) (times ? T0 + (x) : -1)
    proto(w);
    op(w, '}'), op(w, '(');
    str(w, "segments"), op(w, ']'), op(w, '(');
    op(w, '}'), op(w, '('), str(w, "device"), i64(w, 0), str(w, "address"), i64(w, 0x100000),
        str(w, "total_size"), i64(w, 2 << 20), str(w, "stream"), i64(w, seg_stream),
        str(w, "blocks"), op(w, ']'), op(w, '('), op(w, '}'), op(w, '('), str(w, "address"),
        i64(w, 0x100000), str(w, "size"), i64(w, 4096), str(w, "state"), str(w, "active_allocated"),
        op(w, 'u'), op(w, 'e'), op(w, 'u');
    op(w, '}'), op(w, '('), str(w, "device"), i64(w, 1), str(w, "address"), i64(w, 0x900000),
        str(w, "total_size"), i64(w, 8 << 20), op(w, 'u');
    op(w, 'e');
    str(w, "device_traces"), op(w, ']'), op(w, '(');
    op(w, ']'), op(w, '(');
    event(w, "segment_map", 0x400000, 4 << 20, 0, T(100));
    event(w, "alloc", 0x400000, 1 << 20, 7, T(100));
    event(w, "oom", 12345, 1ll << 40, 0, T(150));
    event(w, "free_requested", 0x400000, 1 << 20, 7, T(200));
    event(w, "snapshot", 0, 0, 0, T(210));
    event(w, "segment_unmap", 0x400000, 4 << 20, 0, T(300));
    event(w, "alloc", 0x800000, 256, 0, T(400));
    event(w, "free_requested", 0x800000, 256, 0, T(410));
    event(w, "free_completed", 0x800000, 256, 0, T(500));
    op(w, 'e');
    op(w, ']'), op(w, '('), event(w, "alloc", 0x900000, 64, 0, T(0)), op(w, 'e');
    op(w, 'e');
    op(w, 'u');
    op(w, '.');
#undef T
}

static void test_snapshot(const char *dir) {
    buf w;
    snapshot(&w, 1);
    cuma_trace t;
    cuma_trace_opts o = {.device = -1};
    CHECK_OK(cuma_trace_load_opts(save(dir, "snap.csv.gz", &w, 1), &o, &t));
    CHECK(t.format == CUMA_TRACE_TORCH_SNAPSHOT && t.device == 0 && !t.synthetic_times);
    CHECK(t.n == 6 && t.preexisting == 1 && t.unmatched_frees == 0);
    if (t.n == 6) {
        /* The block from before, then alloc, oom, free (requested only), alloc, free. */
        const cuma_trace_event *e = t.ev;
        CHECK(e[0].action == CUMA_TRACE_ALLOC && e[0].time_us == 0 && e[0].ptr == 0x100000 &&
              e[0].size == 4096 && e[0].stream == 5 && e[0].match == -1);
        CHECK(e[1].action == CUMA_TRACE_ALLOC && e[1].time_us == 0 && e[1].stream == 7 &&
              e[1].match == 3);
        CHECK(e[2].action == CUMA_TRACE_ALLOC_FAIL && e[2].ptr == 0 && e[2].time_us == 50);
        CHECK(e[3].action == CUMA_TRACE_FREE && e[3].time_us == 100 && e[3].match == 1);
        CHECK(e[4].action == CUMA_TRACE_ALLOC && e[4].time_us == 300 && e[4].match == 5);
        CHECK(e[5].action == CUMA_TRACE_FREE && e[5].time_us == 400);
    }
    /* Reserved: 2 MiB before, 6 MiB from 100 to 300, 2 MiB after; span 100..500. */
    CHECK(t.recorded.valid && t.recorded.peak_reserved == 6 << 20);
    CHECK(t.recorded.has_time_avg &&
          t.recorded.time_avg_reserved == ((2ull << 20) * 200 + (6ull << 20) * 200) / 400);
    cuma_trace_free(&t);

    o.device = 1;
    CHECK_OK(cuma_trace_load_opts(path_buf, &o, &t));
    CHECK(t.device == 1 && t.n == 1 && t.recorded.peak_reserved == 8 << 20);
    cuma_trace_free(&t);
    o.device = 2;
    CHECK_ST(cuma_trace_load_opts(path_buf, &o, &t), CUMA_ERR_INVALID);
    CHECK(strstr(cuma_last_error(), "no device 2: the snapshot has traces of devices 0 to 1"));
    o.device = -1;
    o.max_events = 5;
    CHECK_ST(cuma_trace_load_opts(path_buf, &o, &t), CUMA_ERR_LIMIT);
    CHECK(strstr(cuma_last_error(), "more than 5 events"));
    o.max_events = 0;

    snapshot(&w, 0);
    CHECK_OK(cuma_trace_load_opts(save(dir, "snap_notimes.pickle", &w, 0), &o, &t));
    CHECK(t.synthetic_times && !t.recorded.has_time_avg && t.recorded.peak_reserved == 6 << 20);
    for (size_t i = 1 + t.preexisting; i < t.n; i++) CHECK(t.ev[i].time_us > t.ev[i - 1].time_us);
    cuma_trace_free(&t);

    /* Not a snapshot; a record with too many fields. */
    proto(&w);
    op(&w, ']'), op(&w, '.');
    CHECK_ST(cuma_trace_load_opts(save(dir, "list.pickle", &w, 0), &o, &t), CUMA_ERR_PARSE);
    CHECK(strstr(cuma_last_error(), "not a memory snapshot"));
    proto(&w);
    op(&w, '}'), op(&w, '('), str(&w, "device_traces"), op(&w, ']'), op(&w, '('), op(&w, ']'),
        op(&w, '('), op(&w, '}'), op(&w, '(');
    for (int i = 0; i < 70; i++) {
        char k[8];
        snprintf(k, sizeof k, "k%d", i);
        str(&w, k), op(&w, 'N');
    }
    op(&w, 'u'), op(&w, 'e'), op(&w, 'e'), op(&w, 'u'), op(&w, '.');
    CHECK_ST(cuma_trace_load_opts(save(dir, "wide.pickle", &w, 0), &o, &t), CUMA_ERR_PARSE);
    CHECK(strstr(cuma_last_error(), "event 0 has 70 fields, more than the 64"));
}

/* A frame dict; line < 0 writes None for it, file NULL writes None. */
static void frame(buf *w, const char *file, const char *name, int64_t line) {
    op(w, '}'), op(w, '(');
    str(w, "filename");
    if (file)
        str(w, file);
    else
        op(w, 'N');
    str(w, "name"), str(w, name);
    str(w, "line");
    if (line >= 0)
        i64(w, line);
    else
        op(w, 'N');
    op(w, 'u');
}

/* An event whose 'frames' the caller writes next (then closes the dict with 'u'). */
static void event_head(buf *w, const char *action, int64_t addr) {
    op(w, '}'), op(w, '(');
    str(w, "action"), str(w, action), str(w, "addr"), i64(w, addr), str(w, "size"), i64(w, 64),
        str(w, "stream"), i64(w, 0), str(w, "time_us"), i64(w, addr);
    str(w, "frames");
}

/* Stacks: one list shared through the memo by an alloc and its free, the same frames in a
 * second list (memo references) and as fresh copies in a third, a shorter stack, an empty one,
 * and a block from before recording whose stack is in its 'history'. Memo: 0 frame A, 1 frame
 * B, 2 the list [A, B]. */
/* A stream is any bits in a segment as in an event: a negative int is taken as it is, for the
 * segment and for its live blocks. */
static void test_negative_segment_stream(const char *dir) {
    buf w;
    seg_stream = -3;
    snapshot(&w, 1);
    seg_stream = 5;
    cuma_trace t;
    cuma_trace_opts o = {.device = -1};
    CHECK_OK(cuma_trace_load_opts(save(dir, "snap_negstream.pickle", &w, 0), &o, &t));
    CHECK(t.preexisting == 1 && t.n >= 1 && t.ev[0].stream == (uint64_t)-3);
    cuma_trace_free(&t);
}

static void test_stacks(const char *dir) {
    buf w;
    proto(&w);
    op(&w, '}'), op(&w, '(');
    str(&w, "device_traces"), op(&w, ']'), op(&w, '('), op(&w, ']'), op(&w, '(');
    event_head(&w, "alloc", 0x1000);
    op(&w, ']'), op(&w, '(');
    frame(&w, "train.py", "leaky_cache", 42), op(&w, 0x94);
    frame(&w, "??", "torch::unwind::unwind()", 0), op(&w, 0x94);
    op(&w, 'e'), op(&w, 0x94), op(&w, 'u');
    event_head(&w, "free_requested", 0x1000), op(&w, 'h'), op(&w, 2), op(&w, 'u');
    event_head(&w, "alloc", 0x2000);
    op(&w, ']'), op(&w, '('), op(&w, 'h'), op(&w, 0), op(&w, 'h'), op(&w, 1), op(&w, 'e');
    op(&w, 'u');
    event_head(&w, "alloc", 0x3000);
    op(&w, ']'), op(&w, '('), frame(&w, "train.py", "leaky_cache", 42);
    frame(&w, "??", "torch::unwind::unwind()", 0), op(&w, 'e'), op(&w, 'u');
    event_head(&w, "alloc", 0x4000);
    op(&w, ']'), op(&w, '('), frame(&w, NULL, "anonymous", -1), op(&w, 'e'), op(&w, 'u');
    event(&w, "alloc", 0x5000, 64, 0, 0x5000);
    op(&w, 'e'), op(&w, 'e');
    str(&w, "segments"), op(&w, ']'), op(&w, '(');
    op(&w, '}'), op(&w, '('), str(&w, "device"), i64(&w, 0), str(&w, "address"), i64(&w, 0x100000),
        str(&w, "total_size"), i64(&w, 2 << 20), str(&w, "blocks"), op(&w, ']'), op(&w, '(');
    op(&w, '}'), op(&w, '('), str(&w, "address"), i64(&w, 0x100000), str(&w, "size"), i64(&w, 4096),
        str(&w, "state"), str(&w, "active_allocated"), str(&w, "frames"), op(&w, ']'),
        str(&w, "history"), op(&w, ']'), op(&w, '('), op(&w, '}'), op(&w, '('), str(&w, "frames"),
        op(&w, 'h'), op(&w, 2), op(&w, 'u'), op(&w, 'e'), op(&w, 'u');
    op(&w, 'e'), op(&w, 'u'), op(&w, 'e');
    op(&w, 'u'), op(&w, '.');
    const char *path = save(dir, "stacks.pickle", &w, 0);

    cuma_trace t;
    cuma_trace_opts o = {.device = -1};
    CHECK_OK(cuma_trace_load_opts(path, &o, &t));
    CHECK(t.n == 7 && !t.stack && !t.stacks.start && !t.stacks.text); /* not asked for */
    cuma_trace_free(&t);

    o.stacks = 1;
    CHECK_OK(cuma_trace_load_opts(path, &o, &t));
    CHECK_OK(cuma_trace_stacks_validate(&t));
    /* The block from before, alloc, free, alloc, alloc, alloc, alloc. */
    CHECK(t.n == 7 && t.preexisting == 1 && t.stack);
    if (t.n == 7 && t.stack) {
        const uint32_t *s = t.stack;
        const cuma_trace_stacks *st = &t.stacks;
        CHECK(s[1] != 0 && s[0] == s[1] && s[3] == s[1] && s[4] == s[1]);
        CHECK(s[2] == 0 && s[6] == 0 && s[5] != 0 && s[5] != s[1]);
        CHECK(st->nstacks == 3 && st->nframes == 3 && st->nix == 3);
        CHECK(st->start[s[1] + 1] - st->start[s[1]] == 2);
        const cuma_trace_frame *a = &st->frame[st->ix[st->start[s[1]]]];
        const cuma_trace_frame *b = &st->frame[st->ix[st->start[s[1]] + 1]];
        CHECK(!strcmp(st->text + a->file, "train.py") &&
              !strcmp(st->text + a->name, "leaky_cache") && a->line == 42);
        CHECK(!strcmp(st->text + b->file, "??") && b->line == 0);
        const cuma_trace_frame *c = &st->frame[st->ix[st->start[s[5]]]];
        CHECK(!strcmp(st->text + c->file, "") && !strcmp(st->text + c->name, "anonymous") &&
              c->line == 0);
    }
    /* Broken on purpose: the reader's validator must say what is wrong. */
    if (t.stack && t.n) {
        uint32_t keep = t.stack[0];
        t.stack[0] = t.stacks.nstacks;
        CHECK_ST(cuma_trace_stacks_validate(&t), CUMA_ERR_CORRUPT);
        CHECK(strstr(cuma_last_error(), "event 0 has stack 3 of 3"));
        t.stack[0] = keep;
    }
    cuma_trace_free(&t);
}

int main(int argc, char **argv) {
    if (argc != 2) {
        fprintf(stderr, "usage: %s WORK_DIR\n", argv[0]);
        return 2;
    }
    test_values();
    test_refused();
    test_limits();
    test_snapshot(argv[1]);
    test_negative_segment_stream(argv[1]);
    test_stacks(argv[1]);
    printf("snapshot reader: all checks passed\n");
    return 0;
}
