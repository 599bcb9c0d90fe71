// SPDX-License-Identifier: Apache-2.0
/* torch.profiler Chrome trace -> cuma_trace (see chrome_trace.h, trace.h).
 *
 * The whole (decompressed) file is read into memory and walked once by a small recursive JSON
 * reader that extracts only the fields named in chrome_trace.h; every other value is checked
 * and skipped. Nesting is bounded by CUMA_CHROME_MAX_DEPTH, so the recursion is too. Numbers
 * are converted from their text to integers scaled by a power of ten (bytes: 1, times: ns), so
 * a time like 1733000000000000.125 keeps its nanoseconds, which a double would lose.
 *
 * Frees of addresses never allocated in the trace are memory alive before profiling started:
 * as for snapshots (snapshot_pickle.c), each such address gets an allocation at time 0 of the
 * size its first free gives, ahead of the other events.
 */
#include "chrome_trace.h"

#include "snapshot_pickle.h"
#include "util/error.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* Decoded text kept of a key or name: longer ones match none of the names looked for. */
#define KEY_CAP 32

/* A number as written: mant * 10^exp10, negative when neg; inexact when digits were dropped
 * that were not zero. */
typedef struct num {
    uint64_t mant;
    long exp10;
    int neg, inexact;
} num;

/* One args or event field: absent, not a number (bad), or the number at offset off. */
typedef struct field {
    int present, bad;
    size_t off;
    num v;
} field;

enum { F_ADDR, F_BYTES, F_RESERVED, F_DTYPE, F_DID, F_NARGS };
static const char *const arg_names[F_NARGS] = {"Addr", "Bytes", "Total Reserved", "Device Type",
                                               "Device Id"};

/* A memory event of the file. */
typedef struct mrec {
    int64_t ts_ns;
    uint64_t addr;
    int64_t bytes;     /* negative: a free */
    uint64_t reserved; /* "Total Reserved", when has_reserved */
    size_t order;      /* index among the memory events, in file order */
    int32_t dev_id;
    int16_t dev_type;
    uint8_t oom, has_reserved;
} mrec;

typedef struct jp {
    const uint8_t *b;
    size_t n, i;
    const char *path;
    size_t base_off, base_lines; /* bytes and newlines before b[0] in the file */
    size_t max_events;
    mrec *r;
    size_t nr, cap;
    size_t nevents; /* elements of the events array seen */
    int have_events;
} jp;

static cuma_status jfail(const jp *p, size_t off, cuma_status st, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));

static cuma_status jfail(const jp *p, size_t off, cuma_status st, const char *fmt, ...) {
    char what[192];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(what, sizeof what, fmt, ap);
    va_end(ap);
    if (off > p->n) off = p->n;
    size_t line = p->base_lines + 1;
    for (const uint8_t *c = p->b, *end = p->b + off; c && c < end; c++) {
        c = memchr(c, '\n', (size_t)(end - c));
        if (!c) break;
        line++;
    }
    return cuma_fail(st, "%s:%zu: %s (offset %zu)", p->path, line, what, p->base_off + off);
}

/* The byte at p->i for a message: printable as itself, else as hex. */
static void show_byte(const jp *p, char *out, size_t len) {
    if (p->i >= p->n) {
        snprintf(out, len, "the end of the file (truncated?)");
        return;
    }
    uint8_t c = p->b[p->i];
    if (c >= 0x20 && c < 0x7f && c != '\'')
        snprintf(out, len, "'%c'", c);
    else
        snprintf(out, len, "byte 0x%02x", c);
}

static cuma_status unexpected(const jp *p, const char *wanted) {
    char got[48];
    show_byte(p, got, sizeof got);
    return jfail(p, p->i, CUMA_ERR_PARSE, "expected %s, found %s", wanted, got);
}

static void ws(jp *p) {
    while (p->i < p->n) {
        uint8_t c = p->b[p->i];
        if (c != ' ' && c != '\t' && c != '\n' && c != '\r') return;
        p->i++;
    }
}

static int hexval(uint8_t c) {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    return -1;
}

/* A string at p->i (its '"'): checked whole, its first `cap` decoded bytes in out (when out is
 * set), *len the decoded length (which may be more than cap). A \u escape of a non-ASCII
 * character decodes to one 0xFF byte: only ASCII names are compared. */
static cuma_status jstring(jp *p, char *out, size_t cap, size_t *len) {
    size_t start = p->i++;
    size_t k = 0;
    for (;;) {
        if (p->i >= p->n)
            return jfail(p, start, CUMA_ERR_PARSE, "a string that does not end (truncated?)");
        if (p->i - start > CUMA_CHROME_MAX_STRING)
            return jfail(p, start, CUMA_ERR_LIMIT,
                         "a string of more than %zu MiB, the reader's limit",
                         CUMA_CHROME_MAX_STRING >> 20);
        uint8_t c = p->b[p->i];
        if (c == '"') break;
        if (c < 0x20)
            return jfail(p, p->i, CUMA_ERR_PARSE, "control byte 0x%02x inside a string", c);
        if (c == '\\') {
            if (p->i + 1 >= p->n)
                return jfail(p, p->i, CUMA_ERR_PARSE, "an escape that does not end (truncated?)");
            uint8_t e = p->b[p->i + 1];
            const char *from = "\"\\/bfnrt", *to = "\"\\/\b\f\n\r\t";
            const char *hit = e ? strchr(from, e) : NULL;
            if (hit) {
                c = (uint8_t)to[hit - from];
                p->i += 2;
            } else if (e == 'u') {
                unsigned v = 0;
                for (int h = 0; h < 4; h++) {
                    int d = p->i + 2 + (size_t)h < p->n ? hexval(p->b[p->i + 2 + h]) : -1;
                    if (d < 0)
                        return jfail(p, p->i, CUMA_ERR_PARSE,
                                     "\\u not followed by four hex digits");
                    v = v * 16 + (unsigned)d;
                }
                c = v < 0x80 ? (uint8_t)v : 0xFF;
                p->i += 6;
            } else {
                return jfail(p, p->i, CUMA_ERR_PARSE, "unknown escape in a string");
            }
        } else {
            p->i++;
        }
        if (out && k < cap) out[k] = (char)c;
        k++;
    }
    p->i++;
    *len = k;
    return CUMA_OK;
}

/* A number at p->i, checked against JSON's grammar. */
static cuma_status jnumber(jp *p, num *v) {
    size_t start = p->i;
    *v = (num){0};
    if (p->i < p->n && p->b[p->i] == '-') v->neg = 1, p->i++;
    if (p->i >= p->n || p->b[p->i] < '0' || p->b[p->i] > '9')
        return jfail(p, start, CUMA_ERR_PARSE, "a number without digits");
    int leading_zero = p->b[p->i] == '0';
    int frac = 0;
    for (; p->i < p->n; p->i++) {
        uint8_t c = p->b[p->i];
        if (c == '.' && !frac) {
            frac = 1;
            if (p->i + 1 >= p->n || p->b[p->i + 1] < '0' || p->b[p->i + 1] > '9')
                return jfail(p, start, CUMA_ERR_PARSE, "a number with no digit after its '.'");
            continue;
        }
        if (c < '0' || c > '9') break;
        if (!frac && leading_zero && p->i > start + (size_t)v->neg)
            return jfail(p, start, CUMA_ERR_PARSE, "a number with a leading zero");
        if (v->mant <= (UINT64_MAX - (uint64_t)(c - '0')) / 10) {
            v->mant = v->mant * 10 + (c - '0');
            if (frac) v->exp10--;
        } else {
            if (!frac) v->exp10++;
            if (c != '0') v->inexact = 1;
        }
    }
    if (p->i < p->n && (p->b[p->i] == 'e' || p->b[p->i] == 'E')) {
        p->i++;
        int eneg = 0;
        if (p->i < p->n && (p->b[p->i] == '+' || p->b[p->i] == '-')) eneg = p->b[p->i++] == '-';
        if (p->i >= p->n || p->b[p->i] < '0' || p->b[p->i] > '9')
            return jfail(p, start, CUMA_ERR_PARSE, "a number with no digit in its exponent");
        long e = 0;
        for (; p->i < p->n && p->b[p->i] >= '0' && p->b[p->i] <= '9'; p->i++)
            if (e < 1000000) e = e * 10 + (p->b[p->i] - '0');
        v->exp10 += eneg ? -e : e;
    }
    if (p->i - start > CUMA_CHROME_MAX_NUMBER)
        return jfail(p, start, CUMA_ERR_LIMIT,
                     "a number of more than %u characters, the reader's limit",
                     CUMA_CHROME_MAX_NUMBER);
    return CUMA_OK;
}

/* v * 10^scale as a magnitude; -1 when it does not fit 64 bits. *exact: nothing was cut. */
static int scaled(const num *v, long scale, uint64_t *mag, int *exact) {
    uint64_t m = v->mant;
    long e = v->exp10 + scale;
    *exact = !v->inexact;
    for (; e > 0 && m; e--) {
        if (m > UINT64_MAX / 10) return -1;
        m *= 10;
    }
    for (; e < 0 && m; e++) {
        if (m % 10) *exact = 0;
        m /= 10;
    }
    *mag = m;
    return 0;
}

/* A signed integer field from lo to hi; an error naming it otherwise (at the event's offset,
 * `at`, when the field is missing). */
static cuma_status int_of(const jp *p, const field *f, const char *name, size_t ev, size_t at,
                          int64_t lo, int64_t hi, int64_t *out) {
    uint64_t m;
    int exact;
    if (!f->present || f->bad)
        return jfail(p, f->present ? f->off : at, CUMA_ERR_PARSE, "memory event %zu: %s '%s'", ev,
                     f->present ? "not a number:" : "no", name);
    int over = scaled(&f->v, 0, &m, &exact) != 0 || m > (uint64_t)INT64_MAX;
    int64_t x = over ? 0 : f->v.neg ? -(int64_t)m : (int64_t)m;
    if (over || x < lo || x > hi)
        return jfail(p, f->off, CUMA_ERR_PARSE, "memory event %zu: '%s' is not from %lld to %lld",
                     ev, name, (long long)lo, (long long)hi);
    if (!exact)
        return jfail(p, f->off, CUMA_ERR_PARSE, "memory event %zu: '%s' is not a whole number", ev,
                     name);
    *out = x;
    return CUMA_OK;
}

static cuma_status jvalue_skip(jp *p, unsigned depth);

/* The members of an object at p->i (its '{'); each key decoded into key, then member() called
 * with p->i at the value, which it must consume. */
typedef cuma_status (*member_fn)(jp *p, const char *key, size_t klen, unsigned depth, void *arg);

static cuma_status jobject(jp *p, unsigned depth, member_fn member, void *arg) {
    if (depth > CUMA_CHROME_MAX_DEPTH)
        return jfail(p, p->i, CUMA_ERR_LIMIT, "more than %u levels of nesting, the reader's limit",
                     CUMA_CHROME_MAX_DEPTH);
    p->i++;
    ws(p);
    if (p->i < p->n && p->b[p->i] == '}') {
        p->i++;
        return CUMA_OK;
    }
    for (;;) {
        ws(p);
        if (p->i >= p->n || p->b[p->i] != '"') return unexpected(p, "a key string");
        char key[KEY_CAP];
        size_t klen;
        cuma_status st = jstring(p, key, sizeof key, &klen);
        if (st != CUMA_OK) return st;
        ws(p);
        if (p->i >= p->n || p->b[p->i] != ':') return unexpected(p, "':' after a key");
        p->i++;
        ws(p);
        st = member ? member(p, key, klen, depth, arg) : jvalue_skip(p, depth + 1);
        if (st != CUMA_OK) return st;
        ws(p);
        if (p->i < p->n && p->b[p->i] == ',') {
            p->i++;
            continue;
        }
        if (p->i < p->n && p->b[p->i] == '}') {
            p->i++;
            return CUMA_OK;
        }
        return unexpected(p, "',' or '}' in an object");
    }
}

static int lit(const jp *p, const char *w) {
    size_t k = strlen(w);
    return p->n - p->i >= k && !memcmp(p->b + p->i, w, k);
}

/* Any value at p->i, checked and passed over. */
static cuma_status jvalue_skip(jp *p, unsigned depth) {
    if (depth > CUMA_CHROME_MAX_DEPTH)
        return jfail(p, p->i, CUMA_ERR_LIMIT, "more than %u levels of nesting, the reader's limit",
                     CUMA_CHROME_MAX_DEPTH);
    if (p->i >= p->n) return unexpected(p, "a value");
    uint8_t c = p->b[p->i];
    if (c == '{') return jobject(p, depth, NULL, NULL);
    if (c == '"') {
        size_t len;
        return jstring(p, NULL, 0, &len);
    }
    if (c == '-' || (c >= '0' && c <= '9')) {
        num v;
        return jnumber(p, &v);
    }
    if (c == '[') {
        p->i++;
        ws(p);
        if (p->i < p->n && p->b[p->i] == ']') {
            p->i++;
            return CUMA_OK;
        }
        for (;;) {
            ws(p);
            cuma_status st = jvalue_skip(p, depth + 1);
            if (st != CUMA_OK) return st;
            ws(p);
            if (p->i < p->n && p->b[p->i] == ',') {
                p->i++;
                continue;
            }
            if (p->i < p->n && p->b[p->i] == ']') {
                p->i++;
                return CUMA_OK;
            }
            return unexpected(p, "',' or ']' in an array");
        }
    }
    const char *words[] = {"true", "false", "null"};
    for (size_t k = 0; k < 3; k++)
        if (lit(p, words[k])) {
            p->i += strlen(words[k]);
            return CUMA_OK;
        }
    return unexpected(p, "a value");
}

/* A number value into f, or f marked bad (and the value skipped) when it is something else. */
static cuma_status number_field(jp *p, unsigned depth, field *f) {
    *f = (field){.present = 1, .off = p->i};
    if (p->i < p->n && (p->b[p->i] == '-' || (p->b[p->i] >= '0' && p->b[p->i] <= '9')))
        return jnumber(p, &f->v);
    f->bad = 1;
    return jvalue_skip(p, depth + 1);
}

/* What one event object holds of interest. */
typedef struct evfields {
    int kind; /* 0 other, 1 [memory], 2 [OutOfMemory] */
    field ts;
    field arg[F_NARGS];
} evfields;

static int key_is(const char *key, size_t klen, const char *name) {
    size_t n = strlen(name);
    return klen == n && n <= KEY_CAP && !memcmp(key, name, n);
}

static cuma_status args_member(jp *p, const char *key, size_t klen, unsigned depth, void *arg) {
    evfields *e = arg;
    for (int k = 0; k < F_NARGS; k++)
        if (key_is(key, klen, arg_names[k])) return number_field(p, depth, &e->arg[k]);
    return jvalue_skip(p, depth + 1);
}

static cuma_status event_member(jp *p, const char *key, size_t klen, unsigned depth, void *arg) {
    evfields *e = arg;
    if (key_is(key, klen, "ts")) return number_field(p, depth, &e->ts);
    if (key_is(key, klen, "args") && p->i < p->n && p->b[p->i] == '{') {
        memset(e->arg, 0, sizeof e->arg); /* a repeated "args": the last one counts */
        return jobject(p, depth + 1, args_member, e);
    }
    if (key_is(key, klen, "name") && p->i < p->n && p->b[p->i] == '"') {
        char name[KEY_CAP];
        size_t len;
        cuma_status st = jstring(p, name, sizeof name, &len);
        e->kind = key_is(name, len, "[memory]") ? 1 : key_is(name, len, "[OutOfMemory]") ? 2 : 0;
        return st;
    }
    if (key_is(key, klen, "name")) e->kind = 0;
    return jvalue_skip(p, depth + 1);
}

static cuma_status push(jp *p, const mrec *r, size_t off) {
    if (p->nr == p->max_events)
        return jfail(p, off, CUMA_ERR_LIMIT,
                     "more than %zu memory events, the reader's limit (cuma replay --max-events N)",
                     p->max_events);
    if (p->nr == p->cap) {
        size_t cap = p->cap ? p->cap * 2 : 1024;
        if (cap > p->max_events) cap = p->max_events;
        mrec *v = realloc(p->r, cap * sizeof *v);
        if (!v) return cuma_fail(CUMA_ERR_OOM, "%s: out of host memory", p->path);
        p->r = v;
        p->cap = cap;
    }
    p->r[p->nr++] = *r;
    return CUMA_OK;
}

/* One element of the events array. */
static cuma_status event(jp *p, unsigned depth) {
    size_t at = p->i, ev = p->nr;
    if (p->i >= p->n || p->b[p->i] != '{') {
        if (p->i < p->n && p->b[p->i] != ']' && p->b[p->i] != ',') {
            char got[48];
            show_byte(p, got, sizeof got);
            return jfail(p, p->i, CUMA_ERR_PARSE, "trace event %zu is not an object (%s)",
                         p->nevents, got);
        }
        return unexpected(p, "an event object");
    }
    evfields e;
    memset(&e, 0, sizeof e);
    cuma_status st = jobject(p, depth, event_member, &e);
    if (st != CUMA_OK || !e.kind) return st;
    mrec r = {.order = p->nr, .oom = e.kind == 2};
    uint64_t m;
    int exact;
    if (!e.ts.present || e.ts.bad)
        return jfail(p, e.ts.present ? e.ts.off : at, CUMA_ERR_PARSE, "memory event %zu: %s 'ts'",
                     ev, e.ts.present ? "not a number:" : "no");
    if (scaled(&e.ts.v, 3, &m, &exact) || m > (uint64_t)INT64_MAX)
        return jfail(p, e.ts.off, CUMA_ERR_PARSE,
                     "memory event %zu: 'ts' is out of range (more than 2^63 ns)", ev);
    r.ts_ns = e.ts.v.neg ? -(int64_t)m : (int64_t)m;
    int64_t x;
    if ((st = int_of(p, &e.arg[F_BYTES], "Bytes", ev, at, -INT64_MAX, INT64_MAX, &x)) != CUMA_OK)
        return st;
    r.bytes = x;
    if ((st = int_of(p, &e.arg[F_DTYPE], "Device Type", ev, at, -128, 127, &x)) != CUMA_OK)
        return st;
    r.dev_type = (int16_t)x;
    if ((st = int_of(p, &e.arg[F_DID], "Device Id", ev, at, -1, 1023, &x)) != CUMA_OK) return st;
    r.dev_id = (int32_t)x;
    if (!r.oom) {
        /* An intptr_t: any 64 bits, written signed (or, by other writers, unsigned). */
        field *a = &e.arg[F_ADDR];
        if (a->present && a->bad)
            return jfail(p, a->off, CUMA_ERR_PARSE, "memory event %zu: not a number: 'Addr'", ev);
        if (!a->present)
            return jfail(p, at, CUMA_ERR_PARSE,
                         "memory event %zu: no 'Addr' (older PyTorch, such as 1.9, recorded "
                         "no addresses, so frees cannot be told apart)",
                         ev);
        if (scaled(&a->v, 0, &m, &exact) || !exact || (a->v.neg && m > (uint64_t)INT64_MAX + 1))
            return jfail(p, a->off, CUMA_ERR_PARSE,
                         "memory event %zu: 'Addr' is not a 64-bit whole number", ev);
        r.addr = a->v.neg ? (uint64_t)0 - m : m;
    }
    field *res = &e.arg[F_RESERVED];
    if (res->present && !res->bad && !res->v.neg && !scaled(&res->v, 0, &m, &exact)) {
        r.reserved = m;
        r.has_reserved = 1;
    }
    return push(p, &r, at);
}

/* The events array at p->i (its '['). */
static cuma_status events(jp *p, unsigned depth) {
    if (depth > CUMA_CHROME_MAX_DEPTH)
        return jfail(p, p->i, CUMA_ERR_LIMIT, "more than %u levels of nesting, the reader's limit",
                     CUMA_CHROME_MAX_DEPTH);
    p->have_events = 1;
    p->i++;
    ws(p);
    if (p->i < p->n && p->b[p->i] == ']') {
        p->i++;
        return CUMA_OK;
    }
    for (;;) {
        ws(p);
        cuma_status st = event(p, depth + 1);
        if (st != CUMA_OK) return st;
        p->nevents++;
        ws(p);
        if (p->i < p->n && p->b[p->i] == ',') {
            p->i++;
            continue;
        }
        if (p->i < p->n && p->b[p->i] == ']') {
            p->i++;
            return CUMA_OK;
        }
        return unexpected(p, "',' or ']' after a trace event");
    }
}

static cuma_status top_member(jp *p, const char *key, size_t klen, unsigned depth, void *arg) {
    (void)arg;
    if (!key_is(key, klen, "traceEvents")) return jvalue_skip(p, depth + 1);
    if (p->have_events)
        return jfail(p, p->i, CUMA_ERR_PARSE, "a second 'traceEvents' in the object");
    if (p->i >= p->n || p->b[p->i] != '[') return unexpected(p, "an array for 'traceEvents'");
    return events(p, depth + 1);
}

static cuma_status parse(jp *p) {
    ws(p);
    cuma_status st;
    if (p->i < p->n && p->b[p->i] == '{')
        st = jobject(p, 1, top_member, NULL);
    else if (p->i < p->n && p->b[p->i] == '[')
        st = events(p, 1);
    else
        return unexpected(p, "'{' or '[' to start a Chrome trace");
    if (st != CUMA_OK) return st;
    ws(p);
    if (p->i < p->n) return unexpected(p, "nothing after the JSON value");
    if (!p->have_events)
        return jfail(p, 0, CUMA_ERR_PARSE,
                     "a JSON object without 'traceEvents': not a Chrome trace");
    return CUMA_OK;
}

static int by_time(const void *x, const void *y) {
    const mrec *a = x, *b = y;
    if (a->ts_ns != b->ts_ns) return a->ts_ns < b->ts_ns ? -1 : 1;
    return a->order < b->order ? -1 : a->order > b->order;
}

/* Of an address's events in time order, the index of the first (for the sort below). */
typedef struct keyed {
    uint64_t addr;
    size_t i;
} keyed;

static int by_addr(const void *x, const void *y) {
    const keyed *a = x, *b = y;
    if (a->addr != b->addr) return a->addr < b->addr ? -1 : 1;
    return a->i < b->i ? -1 : a->i > b->i;
}

/* Picks the device's records (kept at the front of p->r, in file order); *device -1 for CPU. */
static cuma_status pick_device(jp *p, int *device, size_t *n) {
    enum { NDEV = 1024 };
    size_t *count = calloc(NDEV, sizeof *count), cpu = 0, cuda = 0;
    if (!count) return cuma_fail(CUMA_ERR_OOM, "%s: out of host memory", p->path);
    for (size_t i = 0; i < p->nr; i++) {
        if (p->r[i].dev_type == 1 && p->r[i].dev_id >= 0) count[p->r[i].dev_id]++, cuda++;
        if (p->r[i].dev_type == 0) cpu++;
    }
    int want = *device, type = 1;
    if (want >= 0 && (want >= NDEV || !count[want])) {
        char have[96] = "";
        size_t len = 0;
        for (int d = 0; d < NDEV && len < sizeof have - 16; d++)
            if (count[d]) len += (size_t)snprintf(have + len, sizeof have - len, " %d", d);
        free(count);
        if (!cuda)
            return cuma_fail(CUMA_ERR_INVALID,
                             "%s: no device %d: the trace has no CUDA memory "
                             "events (%zu CPU ones)",
                             p->path, want, cpu);
        return cuma_fail(CUMA_ERR_INVALID,
                         "%s: no device %d: the trace has CUDA memory events "
                         "of device(s)%s",
                         p->path, want, have);
    }
    if (want < 0 && cuda) {
        want = 0;
        for (int d = 1; d < NDEV; d++)
            if (count[d] > count[want]) want = d;
    } else if (want < 0) {
        type = 0; /* only CPU events: those, whatever their id */
    }
    free(count);
    size_t k = 0;
    for (size_t i = 0; i < p->nr; i++)
        if (p->r[i].dev_type == type && (type == 0 || p->r[i].dev_id == want)) p->r[k++] = p->r[i];
    *n = k;
    *device = type == 0 ? -1 : want;
    return CUMA_OK;
}

static cuma_status build(jp *p, int device, cuma_trace *out) {
    /* Most likely profiled without profile_memory=True: say so rather than replay nothing. */
    if (!p->nr)
        return cuma_fail(CUMA_ERR_PARSE,
                         "%s: a Chrome trace with no [memory] events among its %zu events "
                         "(torch.profiler.profile(profile_memory=True) records them)",
                         p->path, p->nevents);
    size_t n = 0; /* pick_device sets it on success; gcc -O2 cannot tell */
    cuma_status st = pick_device(p, &device, &n);
    if (st != CUMA_OK) return st;
    if (!n)
        return cuma_fail(CUMA_ERR_PARSE,
                         "%s: no CUDA or CPU memory events among the %zu [memory] events", p->path,
                         p->nr);
    mrec *r = p->r;
    if (n > 1) qsort(r, n, sizeof *r, by_time);
    /* Addresses whose first event is a free: blocks alive before profiling started. */
    keyed *ix = malloc((n ? n : 1) * sizeof *ix);
    if (!ix) return cuma_fail(CUMA_ERR_OOM, "%s: out of host memory", p->path);
    size_t k = 0;
    for (size_t i = 0; i < n; i++)
        if (!r[i].oom && r[i].bytes) ix[k++] = (keyed){r[i].addr, i};
    if (k > 1) qsort(ix, k, sizeof *ix, by_addr);
    size_t npre = 0;
    for (size_t g = 0; g < k; g++)
        if ((g == 0 || ix[g - 1].addr != ix[g].addr) && r[ix[g].i].bytes < 0) ix[npre++] = ix[g];
    size_t total = npre;
    for (size_t i = 0; i < n; i++) total += r[i].oom || r[i].bytes;
    if (total > p->max_events) {
        free(ix);
        return cuma_fail(CUMA_ERR_LIMIT,
                         "%s: more than %zu events with the blocks alive before profiling, the "
                         "reader's limit (cuma replay --max-events N)",
                         p->path, p->max_events);
    }
    cuma_trace_event *ev = malloc((total ? total : 1) * sizeof *ev);
    if (!ev) {
        free(ix);
        return cuma_fail(CUMA_ERR_OOM, "%s: out of host memory", p->path);
    }
    size_t e = 0;
    for (size_t j = 0; j < npre; j++) {
        const mrec *f = &r[ix[j].i];
        ev[e++] = (cuma_trace_event){
            .ptr = f->addr, .size = (uint64_t)0 - (uint64_t)f->bytes, .action = CUMA_TRACE_ALLOC};
    }
    free(ix);
    int64_t t0 = n ? r[0].ts_ns : 0;
    for (size_t i = 0; i < n; i++) {
        if (!r[i].oom && !r[i].bytes) continue; /* a zero-byte record moves nothing */
        uint64_t t = ((uint64_t)r[i].ts_ns - (uint64_t)t0) / 1000;
        uint64_t mag = r[i].bytes < 0 ? (uint64_t)0 - (uint64_t)r[i].bytes : (uint64_t)r[i].bytes;
        uint32_t a = r[i].oom         ? CUMA_TRACE_ALLOC_FAIL
                     : r[i].bytes > 0 ? CUMA_TRACE_ALLOC
                                      : CUMA_TRACE_FREE;
        ev[e++] = (cuma_trace_event){
            .time_us = t, .ptr = r[i].oom ? 0 : r[i].addr, .size = mag, .action = a};
    }
    /* What PyTorch's allocator said it reserved; the CPU allocator says 0 and means nothing. */
    cuma_trace_recorded *rec = &out->recorded;
    int64_t level = -1, t_prev = 0;
    double integral = 0;
    for (size_t i = 0; i < n && device >= 0; i++) {
        if (level >= 0)
            integral += (double)level * (double)((uint64_t)r[i].ts_ns - (uint64_t)t_prev);
        t_prev = r[i].ts_ns;
        if (!r[i].has_reserved) continue;
        uint64_t v = r[i].reserved > (uint64_t)INT64_MAX ? (uint64_t)INT64_MAX : r[i].reserved;
        level = (int64_t)v;
        rec->valid = 1;
        if (v > rec->peak_reserved) rec->peak_reserved = v;
    }
    if (rec->valid && n > 1 && r[n - 1].ts_ns > r[0].ts_ns) {
        double avg = integral / (double)((uint64_t)r[n - 1].ts_ns - (uint64_t)r[0].ts_ns);
        rec->time_avg_reserved = avg >= 0x1p63 ? (uint64_t)INT64_MAX : (uint64_t)avg;
        rec->has_time_avg = 1;
    }
    out->ev = ev;
    out->n = e;
    out->preexisting = npre;
    out->device = device;
    out->format = CUMA_TRACE_TORCH_PROFILER;
    return CUMA_OK;
}

static cuma_status from_bytes(const uint8_t *buf, size_t len, const char *path, size_t skipped,
                              size_t lines, size_t max_events, int device, cuma_trace *out) {
    memset(out, 0, sizeof *out);
    jp p = {.b = buf,
            .n = len,
            .path = path,
            .base_off = skipped,
            .base_lines = lines,
            .max_events = max_events};
    cuma_status st = parse(&p);
    if (st == CUMA_OK) st = build(&p, device, out);
    free(p.r);
    if (st == CUMA_OK && !(out->path = strdup(path)))
        st = cuma_fail(CUMA_ERR_OOM, "%s: out of host memory", path);
    if (st == CUMA_OK) st = cuma_trace_link(out);
    if (st != CUMA_OK) cuma_trace_free(out);
    return st;
}

cuma_status cuma_chrome_from_bytes(const uint8_t *buf, size_t len, const char *path,
                                   size_t max_events, int device, cuma_trace *out) {
    size_t skip = 0, lines = 0;
    if (len >= 3 && !memcmp(buf, "\xEF\xBB\xBF", 3)) skip = 3;
    for (; skip < len &&
           (buf[skip] == ' ' || buf[skip] == '\t' || buf[skip] == '\n' || buf[skip] == '\r');
         skip++)
        lines += buf[skip] == '\n';
    return from_bytes(buf + skip, len - skip, path, skip, lines, max_events, device, out);
}

cuma_status cuma_chrome_read(gzFile gz, const char *path, size_t skipped, size_t lines,
                             size_t max_events, int device, cuma_trace *out) {
    memset(out, 0, sizeof *out);
    uint8_t *buf;
    size_t len;
    cuma_status st = cuma_gz_read_all(gz, path, CUMA_CHROME_MAX_BYTES, "Chrome trace", &buf, &len);
    if (st != CUMA_OK) return st;
    st = from_bytes(buf, len, path, skipped, lines, max_events, device, out);
    free(buf);
    return st;
}
