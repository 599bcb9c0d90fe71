// SPDX-License-Identifier: Apache-2.0
/* Reader of RMM's CSV event log (see trace.h).
 *
 * The file is read line by line through zlib's gz* calls, which pass plain files through
 * unchanged, so one code path serves .csv and .csv.gz. Every line is split and parsed by hand
 * (no sscanf, no allocation per line): a 200k-event trace loads in a few tens of milliseconds.
 * Frees are matched to their allocations with an open-addressing map from pointer to the index
 * of the allocation that holds it while it is live.
 */
#include "trace.h"

#include "chrome_trace.h"
#include "snapshot_pickle.h"
#include "stack_file.h"
#include "stacks.h"

#include "util/error.h"

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <unistd.h>
#include <zlib.h>

/* Longer lines are malformed: a valid one is well under 100 characters. */
#define LINE_CAP 4096
/* How much of an offending text goes into a message (the message buffer is 512 bytes). */
#define SHOW_CAP 120
#define NFIELDS  6

static const char *const header_names[NFIELDS] = {"Thread",  "Time", "Action",
                                                  "Pointer", "Size", "Stream"};

/* A piece of the line buffer; fields are not NUL-terminated. */
typedef struct span {
    const char *p;
    size_t n;
} span;

/* ---- pointer -> live allocation map ------------------------------------------------------ */

/* Open addressing with linear probing. A slot is empty when val < 0, so every key (0 too) can
 * be stored. Deletion shifts later entries back instead of leaving tombstones: a trace frees
 * as often as it allocates, and tombstones would fill the table. The map holds only the live
 * pointers, so it stays small and cache-resident even for long traces. */
typedef struct slot {
    uint64_t key;
    int64_t val;
} slot;

typedef struct ptrmap {
    slot *s;
    size_t mask; /* capacity - 1; capacity is a power of two */
    size_t used;
} ptrmap;

/* Pointers are aligned, so their low bits carry nothing: mix all bits into the low ones
 * (the finaliser of MurmurHash3). */
static size_t ptr_hash(uint64_t x) {
    x ^= x >> 33;
    x *= 0xff51afd7ed558ccdULL;
    x ^= x >> 33;
    x *= 0xc4ceb9fe1a85ec53ULL;
    x ^= x >> 33;
    return (size_t)x;
}

static int map_init(ptrmap *m, size_t cap) {
    m->s = malloc(cap * sizeof *m->s);
    if (!m->s) return -1;
    for (size_t i = 0; i < cap; i++) m->s[i].val = -1;
    m->mask = cap - 1;
    m->used = 0;
    return 0;
}

/* The slot holding key, or the empty slot where it would go. */
static size_t map_find(const ptrmap *m, uint64_t key) {
    size_t i = ptr_hash(key) & m->mask;
    while (m->s[i].val >= 0 && m->s[i].key != key) i = (i + 1) & m->mask;
    return i;
}

static int map_grow(ptrmap *m) {
    ptrmap bigger;
    if (map_init(&bigger, (m->mask + 1) * 2) != 0) return -1;
    for (size_t i = 0; i <= m->mask; i++) {
        if (m->s[i].val < 0) continue;
        bigger.s[map_find(&bigger, m->s[i].key)] = m->s[i];
        bigger.used++;
    }
    free(m->s);
    *m = bigger;
    return 0;
}

/* Sets key -> val, replacing an existing entry. */
static int map_put(ptrmap *m, uint64_t key, int64_t val) {
    /* Keep the load under one half so probe runs stay short. */
    if ((m->used + 1) * 2 > m->mask + 1 && map_grow(m) != 0) return -1;
    size_t i = map_find(m, key);
    if (m->s[i].val < 0) m->used++;
    m->s[i].key = key;
    m->s[i].val = val;
    return 0;
}

/* Removes key and returns its value, or -1 if absent. */
static int64_t map_take(ptrmap *m, uint64_t key) {
    size_t i = map_find(m, key);
    int64_t val = m->s[i].val;
    if (val < 0) return -1;
    /* Backward-shift deletion: move each later entry of the run into the hole when the hole
     * lies between its home slot and where it sits, so every key stays reachable. */
    size_t hole = i;
    for (size_t j = (i + 1) & m->mask; m->s[j].val >= 0; j = (j + 1) & m->mask) {
        size_t home = ptr_hash(m->s[j].key) & m->mask;
        if (((j - home) & m->mask) >= ((j - hole) & m->mask)) {
            m->s[hole] = m->s[j];
            hole = j;
        }
    }
    m->s[hole].val = -1;
    m->used--;
    return val;
}

/* ---- field parsers ----------------------------------------------------------------------- */

static span trim(span f) {
    while (f.n && (f.p[0] == ' ' || f.p[0] == '\t')) f.p++, f.n--;
    while (f.n && (f.p[f.n - 1] == ' ' || f.p[f.n - 1] == '\t')) f.n--;
    return f;
}

static int is_digit(char c) {
    return c >= '0' && c <= '9';
}

/* Decimal digits only, no sign, no overflow. */
static int parse_dec(span f, uint64_t *out) {
    if (f.n == 0) return -1;
    uint64_t v = 0;
    for (size_t i = 0; i < f.n; i++) {
        if (!is_digit(f.p[i])) return -1;
        unsigned d = (unsigned)(f.p[i] - '0');
        if (v > (UINT64_MAX - d) / 10) return -1;
        v = v * 10 + d;
    }
    *out = v;
    return 0;
}

static int hex_value(char c) {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    return -1;
}

/* 0x followed by 1 to 16 hex digits. */
static int parse_hex(span f, uint64_t *out) {
    if (f.n < 3 || f.n > 18 || f.p[0] != '0' || (f.p[1] != 'x' && f.p[1] != 'X')) return -1;
    uint64_t v = 0;
    for (size_t i = 2; i < f.n; i++) {
        int d = hex_value(f.p[i]);
        if (d < 0) return -1;
        v = v << 4 | (uint64_t)d;
    }
    *out = v;
    return 0;
}

static int span_is(span f, const char *s) {
    return f.n == strlen(s) && !memcmp(f.p, s, f.n);
}

/* A pointer: 0x-hex; the null pointer of an `allocate failure` may also be spelled by the
 * C library's or C++'s printer, which write it without a 0x. */
static int parse_ptr(span f, uint64_t *out) {
    if (span_is(f, "(nil)") || span_is(f, "nullptr") || span_is(f, "NULL")) {
        *out = 0;
        return 0;
    }
    return parse_hex(f, out);
}

/* Streams are written as numbers or as pointers (a cudaStream_t), depending on the logger. */
static int parse_stream(span f, uint64_t *out) {
    if (f.n > 2 && f.p[0] == '0' && (f.p[1] == 'x' || f.p[1] == 'X')) return parse_hex(f, out);
    return parse_dec(f, out);
}

/* Reads 1..maxd decimal digits at f->p, advancing f. */
static int take_digits(span *f, size_t maxd, uint64_t *v, size_t *ndigits) {
    size_t k = 0;
    uint64_t x = 0;
    while (k < f->n && is_digit(f->p[k])) {
        if (k == maxd) return -1;
        x = x * 10 + (uint64_t)(f->p[k] - '0');
        k++;
    }
    if (k == 0) return -1;
    f->p += k;
    f->n -= k;
    *v = x;
    if (ndigits) *ndigits = k;
    return 0;
}

static int take_char(span *f, char c) {
    if (f->n == 0 || f->p[0] != c) return -1;
    f->p++;
    f->n--;
    return 0;
}

/* HH:MM:SS:frac or HH:MM:SS.frac. The fraction is read as a decimal fraction of a second, so
 * the six digits RMM writes are microseconds and a shorter or longer fraction still means what
 * it says. Hours may exceed 24 (a long run), up to CUMA_TRACE_MAX_HOURS: a larger one is a
 * damaged line, and its microseconds would overflow what a replay integrates over time.
 * Returns 0, -1 (malformed) or -2 (hours over the maximum). */
static int parse_time(span f, uint64_t *us) {
    uint64_t h, m, s, frac;
    size_t fd;
    if (take_digits(&f, 9, &h, NULL) || take_char(&f, ':') || take_digits(&f, 2, &m, NULL) ||
        take_char(&f, ':') || take_digits(&f, 2, &s, NULL))
        return -1;
    if (m >= 60 || s >= 60) return -1;
    if (f.n == 0 || (f.p[0] != ':' && f.p[0] != '.')) return -1;
    f.p++, f.n--;
    if (take_digits(&f, 9, &frac, &fd) || f.n != 0) return -1;
    if (h > CUMA_TRACE_MAX_HOURS) return -2;
    for (; fd < 6; fd++) frac *= 10;
    for (; fd > 6; fd--) frac /= 10;
    /* At most 10^4 h = 3.6 * 10^13 us: far inside 64 bits. */
    *us = ((h * 60 + m) * 60 + s) * 1000000u + frac;
    return 0;
}

static int parse_action(span f, uint32_t *out) {
    if (span_is(f, "allocate"))
        *out = CUMA_TRACE_ALLOC;
    else if (span_is(f, "free"))
        *out = CUMA_TRACE_FREE;
    else if (span_is(f, "allocate failure"))
        *out = CUMA_TRACE_ALLOC_FAIL;
    else
        return -1;
    return 0;
}

/* Splits a line at commas into at most `cap` fields and returns how many there are (counting
 * beyond cap, so a line with too many fields is reported with its real count). */
static size_t split(const char *line, size_t len, span *fields, size_t cap) {
    size_t nf = 0;
    const char *start = line;
    for (size_t i = 0; i <= len; i++) {
        if (i < len && line[i] != ',') continue;
        if (nf < cap) fields[nf] = trim((span){start, (size_t)(line + i - start)});
        nf++;
        start = line + i + 1;
    }
    return nf;
}

/* ---- the loader -------------------------------------------------------------------------- */

/* Everything one load works with, so the helpers can fail with one call. */
typedef struct loader {
    const char *path;
    size_t line; /* 1-based number of the line being parsed */
    cuma_trace_event *ev;
    size_t n, cap;
    size_t max_events; /* n never exceeds it: the bound on the memory a load takes */
    size_t unmatched;
    ptrmap live;
} loader;

static cuma_status bad_field(const loader *L, const char *what, span f) {
    int show = (int)(f.n < SHOW_CAP ? f.n : SHOW_CAP);
    return cuma_fail(CUMA_ERR_PARSE, "%s:%zu: %s (%.*s)", L->path, L->line, what, show, f.p);
}

static cuma_status push(loader *L, const cuma_trace_event *e) {
    if (L->n == L->max_events)
        return cuma_fail(CUMA_ERR_LIMIT,
                         "%s:%zu: more than %zu events, the reader's limit (%zu MiB of host "
                         "memory); raise it if the trace is real (cuma replay --max-events N)",
                         L->path, L->line, L->max_events, (L->max_events * sizeof *L->ev) >> 20);
    if (L->n == L->cap) {
        size_t cap = L->cap ? L->cap * 2 : 65536;
        if (cap > L->max_events) cap = L->max_events; /* never more than the limit asks */
        cuma_trace_event *ev = realloc(L->ev, cap * sizeof *ev);
        if (!ev)
            return cuma_fail(CUMA_ERR_OOM, "%s: out of host memory at line %zu", L->path, L->line);
        L->ev = ev;
        L->cap = cap;
    }
    L->ev[L->n++] = *e;
    return CUMA_OK;
}

/* Parses one event line and links it to its partner. */
static cuma_status parse_event(loader *L, const char *line, size_t len) {
    span f[NFIELDS];
    size_t nf = split(line, len, f, NFIELDS);
    if (nf != NFIELDS) {
        char what[64];
        snprintf(what, sizeof what, "%zu fields where %d are expected", nf, NFIELDS);
        return bad_field(L, what, (span){line, len});
    }
    cuma_trace_event e;
    uint64_t thread;
    if (parse_dec(f[0], &thread)) return bad_field(L, "bad thread id", f[0]);
    /* Fold wide ids (some loggers print a pthread_t) so distinct threads stay distinct. */
    e.thread = (uint32_t)(thread > UINT32_MAX ? (thread >> 32) ^ thread : thread);
    int t = parse_time(f[1], &e.time_us);
    if (t == -2) {
        char what[80];
        snprintf(what, sizeof what, "bad time, more than the %u hours a log may span",
                 CUMA_TRACE_MAX_HOURS);
        return bad_field(L, what, f[1]);
    }
    if (t) return bad_field(L, "bad time, expected HH:MM:SS:micro", f[1]);
    if (parse_action(f[2], &e.action))
        return bad_field(L, "unknown action, expected allocate, free or allocate failure", f[2]);
    if (parse_ptr(f[3], &e.ptr))
        return bad_field(L, "bad pointer, expected 0x and hex digits", f[3]);
    if (parse_dec(f[4], &e.size)) return bad_field(L, "bad size, expected a decimal number", f[4]);
    if (parse_stream(f[5], &e.stream)) return bad_field(L, "bad stream", f[5]);

    int64_t self = (int64_t)L->n;
    e.match = -1;
    if (e.action == CUMA_TRACE_ALLOC) {
        /* A pointer allocated again without a free in between (a lost free in the log): the
         * older allocation stays live forever and the newer one takes over the pointer. */
        if (map_put(&L->live, e.ptr, self) != 0)
            return cuma_fail(CUMA_ERR_OOM, "%s: out of host memory at line %zu", L->path, L->line);
    } else if (e.action == CUMA_TRACE_FREE) {
        int64_t a = map_take(&L->live, e.ptr);
        if (a >= 0) {
            e.match = a;
            L->ev[a].match = self;
        } else {
            L->unmatched++;
        }
    }
    return push(L, &e);
}

static int is_header(const char *line, size_t len) {
    span f[NFIELDS];
    if (split(line, len, f, NFIELDS) != NFIELDS) return 0;
    for (int i = 0; i < NFIELDS; i++)
        if (f[i].n != strlen(header_names[i]) || strncasecmp(f[i].p, header_names[i], f[i].n))
            return 0;
    return 1;
}

/* CUMA_ERR_IO if zlib met a read or decompression error (a truncated or damaged .gz). */
static cuma_status read_error(const loader *L, gzFile gz) {
    int zerr = Z_OK;
    const char *zmsg = gzerror(gz, &zerr);
    if (zerr == Z_ERRNO)
        return cuma_fail(CUMA_ERR_IO, "%s: read failed: %s", L->path, strerror(errno));
    if (zerr == Z_OK) return CUMA_OK;
    /* zlib prefixes "<fd:N>: " for a gzdopen'ed file; the path is named already. */
    const char *colon = strncmp(zmsg, "<fd:", 4) == 0 ? strstr(zmsg, ": ") : NULL;
    if (colon) zmsg = colon + 2;
    return cuma_fail(CUMA_ERR_IO, "%s: read failed: %s", L->path, zmsg);
}

/* Reads every line after the file is open. */
static cuma_status read_all(loader *L, gzFile gz) {
    int have_header = 0;
    char line[LINE_CAP];
    /* The uncompressed offset before each line: gzgets says nothing of a NUL byte it copied,
     * after which strlen stops short; the bytes it consumed tell. */
    z_off_t at = gztell(gz);
    while (gzgets(gz, line, sizeof line)) {
        L->line++;
        size_t len = strlen(line);
        z_off_t next = gztell(gz);
        int nul = at >= 0 && next >= at && (uint64_t)(next - at) != len;
        at = next;
        if (nul) return bad_field(L, "a NUL byte in the line", (span){line, len});
        int complete = len > 0 && line[len - 1] == '\n';
        if (!complete && len == sizeof line - 1 && !gzeof(gz))
            return bad_field(L, "line too long", (span){line, len});
        /* A last line without its newline may be all that a damaged .gz gave before failing:
         * report the read error rather than a parse error on the fragment. */
        if (!complete) {
            cuma_status st = read_error(L, gz);
            if (st != CUMA_OK) return st;
        }
        while (len && (line[len - 1] == '\n' || line[len - 1] == '\r')) len--;
        const char *p = line;
        if (L->line == 1 && len >= 3 && !memcmp(p, "\xEF\xBB\xBF", 3)) p += 3, len -= 3;
        if (trim((span){p, len}).n == 0) continue; /* blank lines carry nothing */
        if (!have_header) {
            if (!is_header(p, len))
                return cuma_fail(CUMA_ERR_PARSE,
                                 "%s:%zu: missing header, expected "
                                 "Thread,Time,Action,Pointer,Size,Stream (%.*s)",
                                 L->path, L->line, (int)(len < SHOW_CAP ? len : SHOW_CAP), p);
            have_header = 1;
            continue;
        }
        cuma_status st = parse_event(L, p, len);
        if (st != CUMA_OK) return st;
    }
    cuma_status st = read_error(L, gz);
    if (st != CUMA_OK) return st;
    if (!have_header)
        return cuma_fail(
            CUMA_ERR_PARSE,
            "%s: empty file, expected the header Thread,Time,Action,Pointer,Size,Stream", L->path);
    return CUMA_OK;
}

cuma_status cuma_trace_load(const char *path, cuma_trace *out) {
    return cuma_trace_load_max(path, CUMA_TRACE_MAX_EVENTS, out);
}

cuma_status cuma_trace_load_max(const char *path, size_t max_events, cuma_trace *out) {
    cuma_trace_opts o = {.max_events = max_events, .device = -1};
    if (!max_events) {
        if (out) memset(out, 0, sizeof *out);
        return cuma_fail(CUMA_ERR_INVALID, "cuma_trace_load: max_events 0 is not from 1 to %zu",
                         SIZE_MAX / 2 / sizeof(cuma_trace_event));
    }
    return cuma_trace_load_opts(path, &o, out);
}

cuma_status cuma_trace_link(cuma_trace *t) {
    ptrmap live;
    if (map_init(&live, 1024) != 0)
        return cuma_fail(CUMA_ERR_OOM, "%s: out of host memory", t->path ? t->path : "trace");
    t->unmatched_frees = 0;
    for (size_t i = 0; i < t->n; i++) {
        cuma_trace_event *e = &t->ev[i];
        e->match = -1;
        if (e->action == CUMA_TRACE_ALLOC) {
            if (map_put(&live, e->ptr, (int64_t)i) != 0) {
                free(live.s);
                return cuma_fail(CUMA_ERR_OOM, "%s: out of host memory",
                                 t->path ? t->path : "trace");
            }
        } else if (e->action == CUMA_TRACE_FREE) {
            int64_t a = map_take(&live, e->ptr);
            if (a >= 0) {
                e->match = a;
                t->ev[a].match = (int64_t)i;
            } else {
                t->unmatched_frees++;
            }
        }
    }
    free(live.s);
    return CUMA_OK;
}

/* The first byte after decompression, pushed back so the readers see it again (no seek, so
 * a pipe works too); -1 for an empty or unreadable file (the reader reports which). */
static int first_byte(gzFile gz) {
    int c = gzgetc(gz);
    if (c >= 0 && gzungetc(c, gz) != c) return -2;
    return c < 0 ? -1 : c;
}

/* Passes over a UTF-8 byte-order mark and white space (counting bytes and newlines) and
 * returns the next byte, pushed back like first_byte's. A JSON file may start so; for a CSV
 * log the reader would skip them too, so its lines are counted from *lines on. A byte-order
 * mark cut short is left to the CSV reader as a malformed header. */
static int first_json_byte(gzFile gz, int first, size_t *skipped, size_t *lines) {
    *skipped = *lines = 0;
    int c = first;
    if (c == 0xEF) {
        (void)gzgetc(gz);
        int b2 = gzgetc(gz), b3 = b2 == 0xBB ? gzgetc(gz) : -1;
        if (b2 != 0xBB || b3 != 0xBF) return -3;
        *skipped = 3;
        c = gzgetc(gz);
        if (c >= 0 && gzungetc(c, gz) != c) return -2;
    }
    while (c == ' ' || c == '\t' || c == '\n' || c == '\r') {
        (void)gzgetc(gz);
        ++*skipped;
        *lines += c == '\n';
        c = gzgetc(gz);
        if (c >= 0 && gzungetc(c, gz) != c) return -2;
    }
    return c < 0 ? -1 : c;
}

cuma_status cuma_trace_load_opts(const char *path, const cuma_trace_opts *o, cuma_trace *out) {
    if (!out) return cuma_fail(CUMA_ERR_INVALID, "cuma_trace_load: out is NULL");
    memset(out, 0, sizeof *out);
    if (!path) return cuma_fail(CUMA_ERR_INVALID, "cuma_trace_load: path is NULL");
    size_t max_events = o && o->max_events ? o->max_events : CUMA_TRACE_MAX_EVENTS;
    int device = o ? o->device : -1;
    if (max_events > SIZE_MAX / 2 / sizeof(cuma_trace_event))
        return cuma_fail(CUMA_ERR_INVALID, "cuma_trace_load: max_events %zu is not from 1 to %zu",
                         max_events, SIZE_MAX / 2 / sizeof(cuma_trace_event));

    /* open() first: errno after gzopen is not reliable, and the message must name the cause. */
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) return cuma_fail(CUMA_ERR_IO, "%s: cannot open: %s", path, strerror(errno));
    gzFile gz = gzdopen(fd, "rb");
    if (!gz) {
        close(fd);
        return cuma_fail(CUMA_ERR_OOM, "%s: out of host memory opening the file", path);
    }
    gzbuffer(gz, 1 << 17); /* fewer, larger reads */

    loader L = {.path = path, .max_events = max_events};
    cuma_status st = CUMA_OK;
    int first = first_byte(gz);
    if (first == 0x80) {
        st = cuma_snapshot_read(gz, path, max_events, device, o ? o->stacks : 0, out);
        gzclose(gz);
        return st;
    }
    size_t skipped = 0, lines = 0;
    if (first == 0xEF || first == ' ' || first == '\t' || first == '\n' || first == '\r')
        first = first_json_byte(gz, first, &skipped, &lines);
    if (first == '{' || first == '[') {
        st = cuma_chrome_read(gz, path, skipped, lines, max_events, device, out);
        gzclose(gz);
        return st;
    }
    if (first == -3)
        st = cuma_fail(CUMA_ERR_PARSE,
                       "%s:1: missing header, expected Thread,Time,Action,Pointer,Size,Stream "
                       "(a byte-order mark cut short)",
                       path);
    if (first == -2) st = cuma_fail(CUMA_ERR_OOM, "%s: out of host memory reading the file", path);
    L.line = lines;
    if (st == CUMA_OK && map_init(&L.live, 1024) != 0)
        st = cuma_fail(CUMA_ERR_OOM, "%s: out of host memory", path);
    if (st == CUMA_OK) st = read_all(&L, gz);
    gzclose(gz); /* closes fd too */
    free(L.live.s);

    char *pcopy = NULL;
    if (st == CUMA_OK && !(pcopy = strdup(path)))
        st = cuma_fail(CUMA_ERR_OOM, "%s: out of host memory", path);
    if (st != CUMA_OK) {
        free(L.ev);
        return st;
    }
    /* Give back the slack of the last doubling; keep the larger block if realloc refuses. */
    if (L.n && L.n < L.cap) {
        cuma_trace_event *ev = realloc(L.ev, L.n * sizeof *ev);
        if (ev) L.ev = ev;
    }
    out->path = pcopy;
    out->ev = L.ev;
    out->n = L.n;
    out->unmatched_frees = L.unmatched;
    out->format = CUMA_TRACE_RMM_CSV;
    /* A log written with trace_stacks has its allocations' stacks beside it. */
    if (o && o->stacks && (st = cuma_stack_file_read(path, out)) != CUMA_OK) {
        cuma_trace_free(out);
        return st;
    }
    return CUMA_OK;
}

void cuma_trace_free(cuma_trace *t) {
    if (!t) return;
    free(t->path);
    free(t->ev);
    free(t->stack);
    free(t->preseg);
    cuma_trace_stacks_free(&t->stacks);
    memset(t, 0, sizeof *t);
}

const char *cuma_trace_action_name(uint32_t action) {
    switch (action) {
    case CUMA_TRACE_ALLOC:
        return "allocate";
    case CUMA_TRACE_FREE:
        return "free";
    case CUMA_TRACE_ALLOC_FAIL:
        return "allocate failure";
    }
    return "?";
}
