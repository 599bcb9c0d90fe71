// SPDX-License-Identifier: Apache-2.0
/* Rows: collected while measuring, printed at the end as one table or as JSON lines, and sent
 * from a peer child to the parent as tab-separated lines. */
#include "bench.h"

#include <math.h>

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static bench_row *rows;
static size_t nrows, caprows;

bench_row bench_row_make(const char *section, const char *name, const char *alloc, int threads) {
    bench_row r;
    memset(&r, 0, sizeof r);
    snprintf(r.section, sizeof r.section, "%s", section);
    snprintf(r.name, sizeof r.name, "%s", name);
    snprintf(r.alloc, sizeof r.alloc, "%s", alloc);
    r.threads = threads;
    r.ns_per_op = r.cpu_ns = r.ops_per_s = r.p50 = r.p99 = r.p999 = r.max = r.scale_2t = r.vs_mim =
        NAN;
    return r;
}

void bench_row_add(const bench_row *r) {
    if (nrows == caprows) {
        size_t cap = caprows ? caprows * 2 : 64;
        bench_row *n = realloc(rows, cap * sizeof *n);
        if (!n) {
            fprintf(stderr, "cuma-bench: out of memory for the rows\n");
            exit(1);
        }
        rows = n, caprows = cap;
    }
    rows[nrows++] = *r;
}

size_t bench_row_count(void) {
    return nrows;
}
const bench_row *bench_row_get(size_t i) {
    return i < nrows ? &rows[i] : NULL;
}

void bench_rows_free(void) {
    free(rows);
    rows = NULL;
    nrows = caprows = 0;
}

/* ns/op of this row over mimalloc's on the same section, case and thread count: the median
 * of the per-run ratios where the runs were paired (replays), else the ratio of the medians. */
static double vs_mimalloc(const bench_row *r) {
    if (strcmp(r->section, "fast") && strcmp(r->section, "replay") && strcmp(r->section, "scaling"))
        return NAN;
    if (!isnan(r->vs_mim)) return r->vs_mim;
    for (size_t i = 0; i < nrows; i++) {
        const bench_row *m = &rows[i];
        if (!strcmp(m->alloc, "mimalloc") && !strcmp(m->section, r->section) &&
            !strcmp(m->name, r->name) && m->threads == r->threads && m->ns_per_op > 0)
            return r->ns_per_op / m->ns_per_op;
    }
    return NAN;
}

/* ---- table -------------------------------------------------------------------------------- */

enum { NCOL = 14, CELL = 100 };
static const char *heads[NCOL] = {"section",   "case",  "allocator",  "thr",    "ns/op",
                                  "cpu ns/op", "Mop/s", "x mimalloc", "p50 ns", "p99 ns",
                                  "p99.9 ns",  "2T/1T", "max ns",     "note"};

static void num(char *cell, double v, const char *fmt) {
    if (isnan(v))
        snprintf(cell, CELL, "-");
    else
        snprintf(cell, CELL, fmt, v);
}

static void cells_of(const bench_row *r, char c[NCOL][CELL]) {
    snprintf(c[0], CELL, "%s", r->section);
    snprintf(c[1], CELL, "%s", r->name);
    snprintf(c[2], CELL, "%s", r->alloc);
    snprintf(c[3], CELL, "%d", r->threads);
    num(c[4], r->ns_per_op, r->ns_per_op < 10 ? "%.2f" : "%.1f");
    num(c[5], r->cpu_ns, r->cpu_ns < 10 ? "%.2f" : "%.1f");
    num(c[6], r->ops_per_s / 1e6, "%.2f");
    num(c[7], vs_mimalloc(r), "%.2f");
    num(c[8], r->p50, "%.0f");
    num(c[9], r->p99, "%.0f");
    num(c[10], r->p999, "%.0f");
    /* After 2T/1T: scripts/gpu-check.sh reads that column by its place. */
    num(c[11], r->scale_2t, "%.2f");
    num(c[12], r->max, "%.0f");
    snprintf(c[13], CELL, "%s", r->note);
}

static bool right_aligned(int k) {
    return k >= 3 && k <= 12;
}

static void print_line(char c[NCOL][CELL], const int *w) {
    for (int k = 0; k < NCOL; k++) {
        int pad = w[k] - (int)strlen(c[k]);
        if (right_aligned(k))
            printf("| %*s%s ", pad, "", c[k]);
        else
            printf("| %s%*s ", c[k], pad, "");
    }
    printf("|\n");
}

static void print_table(void) {
    int w[NCOL];
    char c[NCOL][CELL];
    for (int k = 0; k < NCOL; k++) w[k] = (int)strlen(heads[k]);
    for (size_t i = 0; i < nrows; i++) {
        cells_of(&rows[i], c);
        for (int k = 0; k < NCOL; k++)
            if ((int)strlen(c[k]) > w[k]) w[k] = (int)strlen(c[k]);
    }
    for (int k = 0; k < NCOL; k++) snprintf(c[k], CELL, "%s", heads[k]);
    print_line(c, w);
    for (int k = 0; k < NCOL; k++) {
        printf("|%s", right_aligned(k) ? "-" : ":");
        for (int d = 0; d < w[k]; d++) putchar('-');
        printf("%s", right_aligned(k) ? ":" : "-");
    }
    printf("|\n");
    for (size_t i = 0; i < nrows; i++) {
        cells_of(&rows[i], c);
        print_line(c, w);
    }
}

/* ---- JSON --------------------------------------------------------------------------------- */

static void json_str(const char *s) {
    putchar('"');
    for (; *s; s++) {
        unsigned char ch = (unsigned char)*s;
        if (ch == '"' || ch == '\\')
            printf("\\%c", ch);
        else if (ch < 0x20)
            printf("\\u%04x", ch);
        else
            putchar(ch);
    }
    putchar('"');
}

static void json_num(const char *key, double v) {
    printf(",\"%s\":", key);
    if (isnan(v) || isinf(v))
        printf("null");
    else
        printf("%.6g", v);
}

static void print_json_row(const bench_row *r) {
    printf("{\"section\":");
    json_str(r->section);
    printf(",\"case\":");
    json_str(r->name);
    printf(",\"allocator\":");
    json_str(r->alloc);
    printf(",\"threads\":%d", r->threads);
    json_num("ns_per_op", r->ns_per_op);
    json_num("cpu_ns_per_op", r->cpu_ns);
    json_num("ops_per_s", r->ops_per_s);
    json_num("vs_mimalloc", vs_mimalloc(r));
    json_num("p50_ns", r->p50);
    json_num("p99_ns", r->p99);
    json_num("p999_ns", r->p999);
    json_num("max_ns", r->max);
    json_num("scaling_2t_1t", r->scale_2t);
    printf(",\"note\":");
    json_str(r->note);
    printf("}\n");
}

void bench_report(const char *machine_json, const char *machine_text, bool json) {
    if (json) {
        printf("%s\n", machine_json);
        for (size_t i = 0; i < nrows; i++) print_json_row(&rows[i]);
    } else {
        printf("%s\n\n", machine_text);
        print_table();
        printf("\nns/op: wall time / operations of all threads (fast: one op = one alloc+free "
               "pair); cpu ns/op: the threads' CPU time / operations\n(less sensitive to other "
               "work on the machine); x mimalloc: ns/op over mimalloc's on the same row (x1 "
               "replays: median of\nper-run ratios, the allocators taking turns); latency: one "
               "alloc or free, timer overhead subtracted; 2T/1T: two-thread\nthroughput over "
               "one-thread (median of per-run ratios). Each other figure is the median of the "
               "runs.\nrelease: p50/p99/max over rounds of how late idle memory went back (or "
               "how long the call took), the reference in the note.\n");
    }
    fflush(stdout);
}

/* ---- the peer pipe ------------------------------------------------------------------------ */

void bench_row_write(int fd, const bench_row *r) {
    dprintf(fd, "row\t%s\t%s\t%s\t%d\t%.9g\t%.9g\t%.9g\t%.9g\t%.9g\t%.9g\t%.9g\t%s\n", r->section,
            r->name, r->alloc, r->threads, r->ns_per_op, r->cpu_ns, r->ops_per_s, r->p50, r->p99,
            r->p999, r->scale_2t, r->note);
}

/* Splits off the next tab-separated field (empty fields are kept). */
static char *field(char **s) {
    if (!*s) return NULL;
    char *f = *s, *tab = strchr(f, '\t');
    if (tab)
        *tab = 0, *s = tab + 1;
    else
        *s = NULL;
    return f;
}

bool bench_row_parse(char *line, bench_row *r) {
    char *s = line, *f[13];
    line[strcspn(line, "\n")] = 0;
    for (int i = 0; i < 13; i++)
        if (!(f[i] = field(&s))) return false;
    if (strcmp(f[0], "row")) return false;
    *r = bench_row_make(f[1], f[2], f[3], atoi(f[4]));
    double *v[7] = {&r->ns_per_op, &r->cpu_ns, &r->ops_per_s, &r->p50,
                    &r->p99,       &r->p999,   &r->scale_2t};
    for (int i = 0; i < 7; i++) *v[i] = strtod(f[5 + i], NULL);
    snprintf(r->note, sizeof r->note, "%s", f[12]);
    return true;
}
