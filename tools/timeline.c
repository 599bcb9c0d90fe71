// SPDX-License-Identifier: Apache-2.0
/* Timeline files: the sampling writer behind `cuma replay --timeline` and the strict reader
 * behind `cuma plot` (timeline.h). */
#include "timeline.h"

#include "cli.h"

#include <errno.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

/* Positions in tl_writer.keep: a peak at K_PEAK + 2 * column, its end right after it. */
enum { K_FIRST, K_LAST, K_PEAK };

/* ---- writing -------------------------------------------------------------------------------- */

/* The slice of time_us. Integer arithmetic, so that a checker can recompute it exactly:
 * floor((t - t0) * TL_BUCKETS / span), the end of the span in the last slice. */
static uint64_t bucket_of(const tl_writer *w, uint64_t time_us) {
    uint64_t dt = time_us > w->t0_us ? time_us - w->t0_us : 0;
    if (dt >= w->span_us) return TL_BUCKETS - 1;
    if (w->span_us <= UINT64_MAX / TL_BUCKETS) return dt * TL_BUCKETS / w->span_us;
    return dt / (w->span_us / TL_BUCKETS + 1); /* a span of centuries: no overflow */
}

const char *tl_stem(const char *trace_path, size_t *len) {
    const char *slash = strrchr(trace_path, '/'), *base = slash ? slash + 1 : trace_path;
    size_t n = strlen(base);
    if (n > 3 && !strcmp(base + n - 3, ".gz")) n -= 3;
    if (n > 4 && !strncmp(base + n - 4, ".csv", 4)) n -= 4;
    *len = n;
    return base;
}

int tl_open(tl_writer *w, const char *dir, const char *trace_path, uint64_t t0_us,
            uint64_t span_us) {
    memset(w, 0, sizeof *w);
    w->bucket = UINT64_MAX;
    w->t0_us = t0_us;
    w->span_us = span_us;
    size_t len;
    const char *base = tl_stem(trace_path, &len);
    size_t need = strlen(dir) + len + sizeof "/.timeline.csv";
    w->path = malloc(need);
    if (!w->path) {
        cli_eprintf("cuma replay: %s: out of memory\n", trace_path);
        return -1;
    }
    snprintf(w->path, need, "%s/%.*s.timeline.csv", dir, (int)len, base);
    w->f = fopen(w->path, "w");
    if (!w->f) {
        cli_eprintf("cuma replay: --timeline: cannot write %s: %s\n", w->path, strerror(errno));
        free(w->path);
        w->path = NULL;
        return -1;
    }
    fputs(TL_HEADER "\n", w->f);
    return 0;
}

static int by_seq(const void *a, const void *b) {
    uint64_t x = ((const tl_state *)a)->seq, y = ((const tl_state *)b)->seq;
    return x < y ? -1 : x > y;
}

/* Writes the slice's kept states in the order they came, each once. */
static void flush_bucket(tl_writer *w) {
    tl_state s[TL_KEEP];
    memcpy(s, w->keep, sizeof s);
    qsort(s, TL_KEEP, sizeof s[0], by_seq);
    for (int i = 0; i < TL_KEEP; i++) {
        if (i && s[i].seq == s[i - 1].seq) continue;
        /* Whole microseconds, printed exactly: a double would round late in a day-long trace. */
        fprintf(w->f, "%llu.%06llu,%llu,%llu,%llu,%llu\n",
                (unsigned long long)(s[i].time_us / 1000000),
                (unsigned long long)(s[i].time_us % 1000000), (unsigned long long)s[i].requested,
                (unsigned long long)s[i].reserved, (unsigned long long)s[i].cached,
                (unsigned long long)s[i].mapped);
        w->rows++;
    }
}

void tl_add(tl_writer *w, uint64_t time_us, uint64_t requested, uint64_t reserved, uint64_t cached,
            uint64_t mapped) {
    tl_state s = {time_us, requested, reserved, cached, mapped, w->seq++};
    uint64_t b = bucket_of(w, time_us);
    if (b != w->bucket) {
        if (w->bucket != UINT64_MAX) flush_bucket(w);
        w->bucket = b;
        for (int i = 0; i < TL_KEEP; i++) w->keep[i] = s;
        w->open_end[0] = w->open_end[1] = 1;
        return;
    }
    w->keep[K_LAST] = s;
    for (int c = 0; c < 2; c++) {
        uint64_t v = c ? reserved : requested;
        tl_state *peak = &w->keep[K_PEAK + 2 * c];
        uint64_t pv = c ? peak->reserved : peak->requested;
        /* Strict: the first state at the peak is kept. Its end is kept too, so that the peak
         * lasts as long in the file as it did: a peak held until the next kept row would
         * make the file's time integrals too high. */
        if (v > pv) {
            *peak = peak[1] = s;
            w->open_end[c] = 1;
        } else if (w->open_end[c] && v != pv) {
            peak[1] = s;
            w->open_end[c] = 0;
        }
    }
}

int tl_close(tl_writer *w, int ok) {
    if (!w->f) return ok ? -1 : 0;
    if (ok && w->bucket != UINT64_MAX) flush_bucket(w);
    int bad = ferror(w->f);
    if (fclose(w->f) != 0) bad = 1;
    w->f = NULL;
    int rc = 0;
    if (ok && bad) {
        cli_eprintf("cuma replay: --timeline: error writing %s\n", w->path);
        rc = -1;
    }
    if (!ok || bad) remove(w->path); /* no half-written timeline to be plotted later */
    free(w->path);
    w->path = NULL;
    return rc;
}

/* ---- reading -------------------------------------------------------------------------------- */

static const char *const field_names[5] = {"time_s", "requested_bytes", "reserved_bytes",
                                           "cached_bytes", "mapped_bytes"};

/* Parses one field into *v: field 0 a finite non-negative decimal number, the others decimal
 * integers of at most 64 bits. NULL, or what is wrong with it. */
static const char *parse_field(int i, const char *text, double *v) {
    if (!*text) return "empty";
    if (*text == '-') return "negative";
    char *end;
    errno = 0;
    if (i == 0) {
        /* A plain decimal: strtod would also take "nan", "inf", hex and spaces. */
        if ((*text < '0' || *text > '9') && *text != '.') return "not a number";
        if (text[strspn(text, "0123456789.eE+-")]) return "not a number";
        *v = strtod(text, &end);
        if (*end) return "not a number";
        if (!isfinite(*v)) return "out of range";
        return NULL;
    }
    for (const char *c = text; *c; c++)
        if (*c < '0' || *c > '9') return "not a non-negative integer";
    unsigned long long u = strtoull(text, &end, 10);
    if (errno == ERANGE) return "out of range (more than 2^64-1)";
    *v = (double)u;
    return NULL;
}

/* Splits a line in place at its commas: 0 when it has exactly 5 fields. */
static int split(char *line, char *f[5]) {
    int n = 0;
    for (char *p = line;; p++) {
        if (n == 5) return -1;
        f[n++] = p;
        p = strchr(p, ',');
        if (!p) break;
        *p = 0;
    }
    return n == 5 ? 0 : -1;
}

static int read_error(const char *prog, const char *path, size_t line, const char *fmt,
                      const char *what, const char *text) {
    if (line)
        cli_eprintf("%s: %s:%zu: ", prog, path, line);
    else
        cli_eprintf("%s: %s: ", prog, path);
    cli_eprintf(fmt, what);
    if (text) cli_eprintf(" ('%.40s')", text);
    fputc('\n', stderr);
    return CUMA_EXIT_USAGE;
}

static int read_rows(const char *prog, FILE *f, tl_series *out) {
    char *line = NULL;
    size_t cap = 0, lineno = 0, alloc = 0;
    ssize_t got;
    int rc = CUMA_EXIT_OK;
    const char *path = out->path;
    while (rc == CUMA_EXIT_OK && (got = getline(&line, &cap, f)) >= 0) {
        lineno++;
        size_t len = (size_t)got;
        while (len && (line[len - 1] == '\n' || line[len - 1] == '\r')) line[--len] = 0;
        if (strlen(line) != len) {
            rc = read_error(prog, path, lineno, "%s", "a NUL byte in the line", NULL);
        } else if (lineno == 1) {
            if (strcmp(line, TL_HEADER))
                rc = read_error(prog, path, 1, "not a timeline header, expected '%s'", TL_HEADER,
                                line);
        } else if (len) {
            char *f5[5];
            tl_row r;
            double *v[5] = {&r.t, &r.requested, &r.reserved, &r.cached, &r.mapped};
            const char *why = NULL;
            int i = 0;
            if (split(line, f5))
                rc =
                    read_error(prog, path, lineno, "%s", "expected 5 comma-separated fields", NULL);
            for (; rc == CUMA_EXIT_OK && i < 5 && !(why = parse_field(i, f5[i], v[i])); i++) {
            }
            if (rc == CUMA_EXIT_OK && why) {
                char what[96];
                snprintf(what, sizeof what, "%s: %s", field_names[i], why);
                rc = read_error(prog, path, lineno, "%s", what, f5[i]);
            } else if (rc == CUMA_EXIT_OK && out->n && r.t < out->rows[out->n - 1].t) {
                rc = read_error(prog, path, lineno, "%s", "time_s goes back", f5[0]);
            } else if (rc == CUMA_EXIT_OK) {
                if (out->n == alloc) {
                    size_t more = alloc ? 2 * alloc : 1024;
                    tl_row *rows = realloc(out->rows, more * sizeof *rows);
                    if (!rows) {
                        cli_eprintf("%s: %s: out of memory\n", prog, path);
                        rc = CUMA_EXIT_FAIL;
                        break;
                    }
                    out->rows = rows;
                    alloc = more;
                }
                out->rows[out->n++] = r;
            }
        }
    }
    free(line);
    if (rc != CUMA_EXIT_OK) return rc;
    if (ferror(f)) return read_error(prog, path, 0, "read error: %s", strerror(errno), NULL);
    if (lineno == 0) return read_error(prog, path, 0, "empty file, expected '%s'", TL_HEADER, NULL);
    if (!out->n) return read_error(prog, path, 0, "%s", "no samples after the header", NULL);
    return CUMA_EXIT_OK;
}

int tl_read(const char *prog, const char *path, tl_series *out) {
    memset(out, 0, sizeof *out);
    out->path = strdup(path);
    if (!out->path) {
        cli_eprintf("%s: %s: out of memory\n", prog, path);
        return CUMA_EXIT_FAIL;
    }
    FILE *f = fopen(path, "r");
    if (!f) {
        read_error(prog, path, 0, "%s", strerror(errno), NULL);
        tl_series_free(out);
        return CUMA_EXIT_USAGE;
    }
    int rc = read_rows(prog, f, out);
    fclose(f);
    if (rc != CUMA_EXIT_OK) tl_series_free(out);
    return rc;
}

void tl_series_free(tl_series *s) {
    free(s->path);
    free(s->rows);
    memset(s, 0, sizeof *s);
}
