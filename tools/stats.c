// SPDX-License-Identifier: Apache-2.0
/* `cuma stats`: every figure the ledger holds of a heap, one block per heap, or as JSON.
 *
 * ps and top keep to one row a heap; this is the view of one process's allocator from outside
 * (what cuma_get_stats says inside it), for an operator asking why a job fails or holds what it
 * holds. The allocator figures are those the heap's release thread last published (every
 * 100 ms); the ledger's own (reserved, pressure) are exact at the read. */
#include "cli.h"
#include "ledger_view.h"

#include <errno.h>
#include <inttypes.h>
#include <limits.h>
#include <signal.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdlib.h>
#include <string.h>

/* The allocator's figures: those of the list in cuma.h that the ledger carries, under their
 * names (cuma_ledger_entry's, and those of cuma.ledger() in Python too), in the list's order.
 * The JSON and the text both expand from it, so a figure added to the list shows in both. */
typedef struct stat_field {
    const char *name;
    size_t off;    /* in cuma_ledger_entry */
    int is_double; /* a double (a ratio), else a uint64_t */
    unsigned kind; /* CUMA_STAT_GAUGE or _COUNTER, | its unit */
} stat_field;

#define F(type, name, kind, where, help)                                                           \
    CUMA_STAT_IF_LEDGER(where,                                                                     \
                        {#name, offsetof(cuma_ledger_entry, name),                                 \
                         _Generic(((cuma_ledger_entry *)0)->name, double : 1, default : 0),        \
                         kind}, )
static const stat_field stat_fields[] = {CUMA_STATS_FIELDS(F)};
#undef F

/* ---- text ----------------------------------------------------------------------------------- */

/* "453 ns", "12.5 us", "3.2 ms", "1.50 s": page calls take microseconds, ages seconds. */
static const char *duration(uint64_t ns, char *buf, size_t len) {
    if (ns < 1000)
        snprintf(buf, len, "%" PRIu64 " ns", ns);
    else if (ns < 1000000)
        snprintf(buf, len, "%.1f us", (double)ns / 1e3);
    else if (ns < 1000000000)
        snprintf(buf, len, "%.1f ms", (double)ns / 1e6);
    else
        snprintf(buf, len, "%.2f s", (double)ns / 1e9);
    return buf;
}

/* One line of a block: the label in a column of its own, then the figures. */
static void line(const char *label, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void line(const char *label, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    printf("  %-14s", label);
    vprintf(fmt, ap);
    putchar('\n');
    va_end(ap);
}

/* A figure's value in its unit: sizes as cuma ps shows them, times as durations, ratios in
 * percent, counts as they are. */
static const char *figure_text(const cuma_ledger_entry *e, const stat_field *f, char *buf,
                               size_t len) {
    const char *at = (const char *)e + f->off;
    if (f->is_double) {
        snprintf(buf, len, "%.1f%%", *(const double *)at * 100.0);
        return buf;
    }
    uint64_t v = *(const uint64_t *)at;
    switch (CUMA_STAT_UNIT(f->kind)) {
    case CUMA_STAT_BYTES:
        return view_size(v, buf, len);
    case CUMA_STAT_NS:
        return duration(v, buf, len);
    default:
        snprintf(buf, len, "%" PRIu64, v);
        return buf;
    }
}

/* The text's width: a line that would pass it goes on under the label's column. */
#define TEXT_WIDTH 100
#define LABEL_COLS 16

/* The allocator's figures of one kind (gauges: values now; counters: since the heap was made),
 * "name value" in the list's order, under `label`. */
static void print_figures(const cuma_ledger_entry *e, unsigned counter, const char *label) {
    int col = printf("  %-14s", label), first = 1;
    for (size_t k = 0; k < sizeof stat_fields / sizeof stat_fields[0]; k++) {
        const stat_field *f = &stat_fields[k];
        if ((f->kind & CUMA_STAT_COUNTER) != counter) continue;
        char v[32], item[96];
        int n = snprintf(item, sizeof item, "%s %s", f->name, figure_text(e, f, v, sizeof v));
        if (!first && col + 2 + n > TEXT_WIDTH) {
            printf(",\n%*s", LABEL_COLS, "");
            col = LABEL_COLS;
        } else if (!first) {
            col += printf(", ");
        }
        col += printf("%s", item);
        first = 0;
    }
    putchar('\n');
}

static void print_block(const cuma_ledger_entry *e) {
    char name[64], dev[128], be[64], a[32], b[32], c[32], d[32];
    view_clean(e->process, name, sizeof name);
    view_clean(e->device, dev, sizeof dev);
    view_clean(e->backend, be, sizeof be);
    int st = view_has_stats(e);
    printf("pid %d %s, device %s, slot %u\n", e->pid, name, dev, e->slot);
    line("backend", "%s", be[0] ? be : "-");
    line("settings", "priority %d, guarantee %s, limit %s", e->priority,
         view_size(e->guarantee, a, sizeof a), e->limit ? view_size(e->limit, b, sizeof b) : "-");
    line("memory", "reserved %s, cached %s, in use %s, requested %s",
         view_size(e->reserved, a, sizeof a), view_size(e->cached, b, sizeof b),
         view_size(view_in_use(e), c, sizeof c), view_size(e->requested, d, sizeof d));
    line("peaks", "reserved %s", view_size(e->peak_reserved, a, sizeof a));
    if (st) {
        print_figures(e, CUMA_STAT_GAUGE, "gauges");
        print_figures(e, CUMA_STAT_COUNTER, "counters");
    } else {
        /* Said in words: zeros here would read as an idle heap. */
        line("allocator", "never published (no release thread: release_thread:off or "
                          "sim_clock:manual)");
    }
    line("ledger", "want %s, denials %" PRIu64 ", asks %" PRIu64 ", given %s, callbacks %" PRIu64,
         e->want ? view_size(e->want, a, sizeof a) : "-", e->ledger_denials, e->pressure_asks,
         view_size(e->pressure_given_bytes, b, sizeof b), e->pressure_callbacks);
    if (st)
        line("age", "allocator figures %s, cached/requested %s",
             duration(e->stats_age_ns, a, sizeof a), duration(e->age_ns, b, sizeof b));
    else
        line("age", "cached/requested %s", duration(e->age_ns, b, sizeof b));
}

static void print_text(const ledger_view *v, const unsigned char *keep, int filtered) {
    size_t shown = 0;
    for (size_t i = 0; i < v->nheaps; i++) shown += keep[i];
    view_print_warnings(stdout, v);
    if (!v->nheaps && !filtered) {
        printf("ledger %s: no live heaps\n", cli_shown(v->path, (char[1024]){0}, 1024));
        return;
    }
    if (!shown) return; /* only PIDs without heaps: their errors say it all */
    if (filtered)
        printf("ledger %s: %zu of its %zu heap%s\n", cli_shown(v->path, (char[1024]){0}, 1024),
               shown, v->nheaps, v->nheaps == 1 ? "" : "s");
    else
        printf("ledger %s: %zu heap%s on %zu device%s\n", cli_shown(v->path, (char[1024]){0}, 1024),
               v->nheaps, v->nheaps == 1 ? "" : "s", v->ndevices, v->ndevices == 1 ? "" : "s");
    for (size_t i = 0; i < v->nheaps; i++) {
        if (!keep[i]) continue;
        putchar('\n');
        print_block(&v->heaps[i]);
    }
}

/* ---- JSON ----------------------------------------------------------------------------------- */

/* The fields after cuma ps's: unknown figures are null, not zero (a heap that never published
 * is not an idle one). */
static void json_stats(FILE *f, const cuma_ledger_entry *e) {
    fputs(",\"backend\":", f);
    if (e->backend[0])
        view_json_string(f, e->backend);
    else
        fputs("null", f);
    int st = view_has_stats(e);
    for (size_t k = 0; k < sizeof stat_fields / sizeof stat_fields[0]; k++) {
        const stat_field *sf = &stat_fields[k];
        const char *at = (const char *)e + sf->off;
        if (!st)
            fprintf(f, ",\"%s\":null", sf->name);
        else if (sf->is_double) /* The ledger keeps parts per million: six decimals are exact. */
            fprintf(f, ",\"%s\":%.6f", sf->name, *(const double *)at);
        else
            fprintf(f, ",\"%s\":%" PRIu64, sf->name, *(const uint64_t *)at);
    }
    if (st)
        fprintf(f, ",\"stats_age_ns\":%" PRIu64, e->stats_age_ns);
    else
        fputs(",\"stats_age_ns\":null", f);
}

/* ---- the command ---------------------------------------------------------------------------- */

/* A PID argument: digits only, 1 to INT_MAX. */
static int parse_pid(const char *s, int *pid) {
    if (*s < '0' || *s > '9') return -1;
    char *end;
    errno = 0;
    long v = strtol(s, &end, 10);
    if (errno || *end || v < 1 || v > INT_MAX) return -1;
    *pid = (int)v;
    return 0;
}

/* Why `pid` has no heap here: gone, or alive without one in this ledger. */
static void report_missing(int pid, const char *path) {
    if (kill(pid, 0) && errno == ESRCH)
        cli_eprintf("cuma stats: pid %d is not running\n", pid);
    else
        cli_eprintf("cuma stats: pid %d has no heap in ledger %s\n", pid, path);
}

int cuma_cmd_stats(int argc, char **argv) {
    if (cli_wants_help(argc, argv, CUMA_STATS_USAGE)) return CUMA_EXIT_OK;
    const char *ledger = NULL;
    int json = 0, npids = 0, options_done = 0;
    int *pids = calloc((size_t)argc, sizeof *pids);
    if (!pids) {
        cli_eprintf("cuma stats: out of memory\n");
        return CUMA_EXIT_FAIL;
    }
    for (int i = 1; i < argc; i++) {
        const char *v;
        int missing = 0;
        if (!options_done && !strcmp(argv[i], "--")) {
            options_done = 1;
        } else if (!options_done &&
                   (v = cli_option(argc, argv, &i, "--ledger", &missing)) != NULL) {
            ledger = v;
        } else if (!options_done && !strcmp(argv[i], "--json")) {
            json = 1;
        } else if (missing) {
            free(pids);
            return cli_usage_error("stats", CUMA_STATS_USAGE, "%s needs a value", argv[i]);
        } else if (!options_done && argv[i][0] == '-') {
            free(pids);
            return cli_usage_error("stats", CUMA_STATS_USAGE, "unknown argument '%s'", argv[i]);
        } else if (parse_pid(argv[i], &pids[npids]) == 0) {
            npids++;
        } else {
            free(pids);
            return cli_usage_error("stats", CUMA_STATS_USAGE,
                                   "a PID is a positive integer, not '%s'", argv[i]);
        }
    }
    ledger_view v;
    int r = view_read(&v, ledger), rc = CUMA_EXIT_OK;
    unsigned char *keep = NULL;
    if (r == -2) {
        rc = cli_usage_error("stats", CUMA_STATS_USAGE, "%s", v.error);
    } else if (r) {
        cli_eprintf("cuma stats: %s\n", v.error);
        rc = CUMA_EXIT_FAIL;
    } else if (!(keep = calloc(v.nheaps ? v.nheaps : 1, 1))) {
        cli_eprintf("cuma stats: out of memory\n");
        rc = CUMA_EXIT_FAIL;
    } else {
        for (size_t i = 0; i < v.nheaps; i++) {
            keep[i] = !npids;
            for (int k = 0; k < npids && !keep[i]; k++) keep[i] = v.heaps[i].pid == pids[k];
        }
        if (json)
            view_json(stdout, &v, keep, json_stats);
        else
            print_text(&v, keep, npids > 0);
        for (int k = 0; k < npids; k++) {
            int found = 0, again = 0;
            for (size_t i = 0; i < v.nheaps && !found; i++) found = v.heaps[i].pid == pids[k];
            for (int j = 0; j < k && !again; j++) again = pids[j] == pids[k];
            if (found || again) continue;
            report_missing(pids[k], v.path);
            rc = CUMA_EXIT_FAIL;
        }
    }
    free(keep);
    free(pids);
    view_free(&v);
    if (fflush(stdout) || ferror(stdout)) rc = CUMA_EXIT_FAIL;
    return rc;
}
