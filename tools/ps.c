// SPDX-License-Identifier: Apache-2.0
/* `cuma ps` and `cuma top`: the heaps of a ledger as a table, once or refreshed.
 *
 * Both read the ledger through cuma_ledger_snapshot (which also frees dead processes' slots),
 * so they show what admission sees: a heap's reserved bytes are what the ledger admitted, its
 * cached and requested bytes what its release thread last published (every few ms), top's
 * allocator columns what it last published of its stats (every 100 ms). */
#include "cli.h"
#include "ledger_view.h"

#include <errno.h>
#include <inttypes.h>
#include <math.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <sys/select.h>
#include <time.h>
#include <unistd.h>

#define SZ 10 /* width of a size column: "1023.9 MiB" */

/* ---- the table ------------------------------------------------------------------------------ */

/* A heap of the previous refresh that is the same heap: a slot is reused by later heaps, so the
 * pid and device must match too. */
static const cuma_ledger_entry *previous(const ledger_view *prev, const cuma_ledger_entry *e) {
    if (!prev) return NULL;
    for (size_t i = 0; i < prev->nheaps; i++) {
        const cuma_ledger_entry *p = &prev->heaps[i];
        if (p->slot == e->slot && p->pid == e->pid && !strcmp(p->device, e->device)) return p;
    }
    return NULL;
}

static void print_device(const view_device *d) {
    char dev[128], cap[32], res[32], cached[32], guar[32], fr[32];
    view_clean(d->device, dev, sizeof dev);
    printf("device %s: capacity %s, reserved %s, cached %s, guaranteed %s, free %s (%zu heap%s)\n",
           dev, view_size(d->capacity, cap, sizeof cap), view_size(d->reserved, res, sizeof res),
           view_size(d->cached, cached, sizeof cached), view_size(d->guaranteed, guar, sizeof guar),
           view_size(d->free, fr, sizeof fr), d->count, d->count == 1 ? "" : "s");
}

static void print_header(int rates) {
    printf("%7s %-15s %5s %*s %*s %*s ", "PID", "PROCESS", "PRIO", SZ, "GUARANTEE", SZ, "LIMIT", SZ,
           "RESERVED");
    if (rates) printf("%*s ", SZ + 1, "DELTA");
    printf("%*s %*s %*s %*s %*s ", SZ, "CACHED", SZ, "IN USE", SZ, "REQUESTED", SZ, "PEAK", SZ,
           "WANT");
    if (rates)
        printf("%*s %9s %8s %5s %6s %*s\n", SZ + 2, "GIVEN/s", "DENIALS/s", "ALLOC/s", "OOMS",
               "FRAG", SZ, "STRANDED");
    else
        printf("%*s %8s\n", SZ, "GIVEN", "DENIALS");
}

/* An event rate in at most 8 characters: one decimal while it fits, then whole numbers, then
 * powers of ten (10^8 allocations a second is not expected, but must not shift the row). */
static const char *event_rate(double r, char *buf, size_t len) {
    snprintf(buf, len, r < 99999.95 ? "%.1f" : r < 99999999.5 ? "%.0f" : "%.2e", r);
    return buf;
}

/* The allocator's columns of top: allocations per second between the two refreshes' figures,
 * OOMs since the heap began, fragmentation now and the stranded bytes it is the share of (mapped
 * bytes no live block asked for: free, but only for requests that fit the gaps; cached pages are
 * not among them). The rate is over the time between the two
 * publications the figures come from (the release thread publishes every 100 ms, so a refresh
 * interval would be off by up to that much); "-" while the heap has published nothing, or
 * nothing new since the previous refresh. */
static void print_allocator(const cuma_ledger_entry *e, const cuma_ledger_entry *p, double dt) {
    char rate[32] = "-", ooms[32] = "-", frag[32] = "-", stranded[32] = "-";
    if (view_has_stats(e)) {
        snprintf(ooms, sizeof ooms, "%" PRIu64, e->ooms);
        snprintf(frag, sizeof frag, "%.1f%%", e->fragmentation * 100.0);
        /* As the exporter's cuma_stranded_bytes: from the two figures published together. */
        view_size((uint64_t)llround((double)e->mapped_bytes * e->fragmentation), stranded,
                  sizeof stranded);
        if (p && view_has_stats(p)) {
            /* A publication's time is the refresh's minus its age; the difference of the two. */
            double span = dt - ((double)e->stats_age_ns - (double)p->stats_age_ns) * 1e-9;
            uint64_t n = e->num_allocs > p->num_allocs ? e->num_allocs - p->num_allocs : 0;
            if (span > 1e-3) event_rate((double)n / span, rate, sizeof rate);
        }
    }
    printf(" %8s %5s %6s %*s\n", rate, ooms, frag, SZ, stranded);
}

/* One heap's row. With rates (top), `p` is the same heap at the previous refresh, `dt` seconds
 * ago, or NULL when it is new: its rates show as "-". */
static void print_heap(const cuma_ledger_entry *e, int rates, const cuma_ledger_entry *p,
                       double dt) {
    char name[64], g[32], l[32], r[32], c[32], u[32], q[32], pk[32], w[32];
    view_clean(e->process, name, sizeof name);
    printf("%7d %-15s %5d %*s %*s %*s ", e->pid, name, e->priority, SZ,
           view_size(e->guarantee, g, sizeof g), SZ,
           e->limit ? view_size(e->limit, l, sizeof l) : "-", SZ,
           view_size(e->reserved, r, sizeof r));
    if (rates) {
        char d[32];
        printf("%*s ", SZ + 1,
               p ? view_delta((int64_t)(e->reserved - p->reserved), d, sizeof d) : "-");
    }
    printf("%*s %*s %*s %*s %*s ", SZ, view_size(e->cached, c, sizeof c), SZ,
           view_size(view_in_use(e), u, sizeof u), SZ, view_size(e->requested, q, sizeof q), SZ,
           view_size(e->peak_reserved, pk, sizeof pk), SZ,
           e->want ? view_size(e->want, w, sizeof w) : "-");
    if (!rates) {
        char gv[32];
        printf("%*s %8" PRIu64 "\n", SZ, view_size(e->pressure_given_bytes, gv, sizeof gv),
               e->ledger_denials);
    } else if (!p || dt <= 0) {
        printf("%*s %9s", SZ + 2, "-", "-");
        print_allocator(e, NULL, 0);
    } else {
        /* Counters only grow while the slot is the same heap's; should one go back (a ledger
         * bug), the rate shows 0 rather than a wrapped figure. */
        uint64_t dg = e->pressure_given_bytes > p->pressure_given_bytes
                          ? e->pressure_given_bytes - p->pressure_given_bytes
                          : 0;
        uint64_t dd =
            e->ledger_denials > p->ledger_denials ? e->ledger_denials - p->ledger_denials : 0;
        double given = (double)dg / dt, denials = (double)dd / dt;
        char gv[32], rate[40];
        snprintf(rate, sizeof rate, "%s/s", view_size((uint64_t)llround(given), gv, sizeof gv));
        printf("%*s %9.1f", SZ + 2, rate, denials);
        print_allocator(e, p, dt);
    }
}

static void print_table(const ledger_view *v, int rates, const ledger_view *prev, double dt) {
    view_print_warnings(stdout, v);
    if (!v->nheaps) {
        printf("ledger %s: no live heaps\n", cli_shown(v->path, (char[1024]){0}, 1024));
        return;
    }
    printf("ledger %s: %zu heap%s on %zu device%s\n", cli_shown(v->path, (char[1024]){0}, 1024),
           v->nheaps, v->nheaps == 1 ? "" : "s", v->ndevices, v->ndevices == 1 ? "" : "s");
    for (size_t k = 0; k < v->ndevices; k++) {
        const view_device *d = &v->devices[k];
        printf("\n");
        print_device(d);
        print_header(rates);
        for (size_t i = d->first; i < d->first + d->count; i++)
            print_heap(&v->heaps[i], rates, previous(prev, &v->heaps[i]), dt);
    }
}

/* ---- options -------------------------------------------------------------------------------- */

typedef struct options {
    const char *ledger;
    int json;        /* ps */
    double delay;    /* top: seconds between refreshes */
    long long iters; /* top: 0 = until interrupted */
} options;

static int parse(int argc, char **argv, int top, options *o) {
    const char *cmd = top ? "top" : "ps", *usage = top ? CUMA_TOP_USAGE : CUMA_PS_USAGE;
    *o = (options){.delay = 1.0};
    for (int i = 1; i < argc; i++) {
        const char *v;
        int missing = 0;
        char *end;
        if ((v = cli_option(argc, argv, &i, "--ledger", &missing)) != NULL) {
            o->ledger = v;
        } else if (!top && !strcmp(argv[i], "--json")) {
            o->json = 1;
        } else if (top && (v = cli_option(argc, argv, &i, "-d", &missing)) != NULL) {
            errno = 0;
            o->delay = strtod(v, &end);
            /* A day at most: beyond that it is a typo, and nanosleep's seconds stay small. */
            if (errno || end == v || *end || !isfinite(o->delay) || o->delay <= 0 ||
                o->delay > 86400)
                return cli_usage_error(cmd, usage, "-d wants seconds > 0, not '%s'", v);
        } else if (top && (v = cli_option(argc, argv, &i, "-n", &missing)) != NULL) {
            errno = 0;
            o->iters = strtoll(v, &end, 10);
            if (errno || end == v || *end || o->iters <= 0)
                return cli_usage_error(cmd, usage, "-n wants a positive integer, not '%s'", v);
        } else if (missing) {
            return cli_usage_error(cmd, usage, "%s needs a value", argv[i]);
        } else {
            return cli_usage_error(cmd, usage, "unknown argument '%s'", argv[i]);
        }
    }
    return CUMA_EXIT_OK;
}

/* ---- ps ------------------------------------------------------------------------------------- */

int cuma_cmd_ps(int argc, char **argv) {
    if (cli_wants_help(argc, argv, CUMA_PS_USAGE)) return CUMA_EXIT_OK;
    options o;
    int rc = parse(argc, argv, 0, &o);
    if (rc) return rc;
    ledger_view v;
    int r = view_read(&v, o.ledger);
    if (r == -2) {
        rc = cli_usage_error("ps", CUMA_PS_USAGE, "%s", v.error);
    } else if (r) {
        cli_eprintf("cuma ps: %s\n", v.error);
        rc = CUMA_EXIT_FAIL;
    } else if (o.json) {
        view_json(stdout, &v, NULL, NULL);
    } else {
        print_table(&v, 0, NULL, 0);
    }
    view_free(&v);
    if (!rc && (fflush(stdout) || ferror(stdout))) rc = CUMA_EXIT_FAIL;
    return rc;
}

/* ---- top ------------------------------------------------------------------------------------ */

static double mono_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

/* Sleeps `s` seconds or until SIGINT/SIGTERM. They are blocked except inside pselect, so one
 * that comes just before the sleep still cuts it short (a long -d would otherwise ignore it). */
static void pause_for(double s, const sigset_t *wait_mask) {
    struct timespec ts = {(time_t)s, (long)((s - floor(s)) * 1e9)};
    if (!view_stop) pselect(0, NULL, NULL, NULL, &ts, wait_mask);
}

int cuma_cmd_top(int argc, char **argv) {
    if (cli_wants_help(argc, argv, CUMA_TOP_USAGE)) return CUMA_EXIT_OK;
    options o;
    int rc = parse(argc, argv, 1, &o);
    if (rc) return rc;
    /* Ctrl-C (or SIGTERM) sets view_stop, delivered only inside the sleep: top ends at once. */
    sigset_t wait_mask;
    view_catch_stop(&wait_mask);
    int tty = isatty(STDOUT_FILENO);
    ledger_view prev = {0}, cur;
    int have_prev = 0, ever_read = 0;
    double t_prev = 0;
    for (long long it = 0; !view_stop && (!o.iters || it < o.iters); it++) {
        if (it) pause_for(o.delay, &wait_mask);
        if (view_stop) break;
        int r = view_read(&cur, o.ledger);
        double t = mono_s();
        if (r == -2) {
            view_free(&cur);
            view_free(&prev);
            return cli_usage_error("top", CUMA_TOP_USAGE, "%s", cur.error);
        }
        /* Home and erase: the frame replaces the last one, as top and watch do. */
        if (tty) fputs("\033[H\033[2J", stdout);
        time_t now = time(NULL);
        char clock[16];
        strftime(clock, sizeof clock, "%H:%M:%S", localtime(&now));
        printf("cuma top - %s, every %gs", clock, o.delay);
        if (o.iters) printf(", refresh %lld of %lld", it + 1, o.iters);
        printf("\n");
        if (r) {
            /* A live view waits for the ledger to appear instead of giving up. */
            printf("%s\n", cur.error);
            view_free(&cur);
        } else {
            ever_read = 1;
            print_table(&cur, 1, have_prev ? &prev : NULL, t - t_prev);
            view_free(&prev);
            prev = cur;
            have_prev = 1;
            t_prev = t;
        }
        if (!tty) printf("\n");
        if (fflush(stdout) || ferror(stdout)) {
            rc = CUMA_EXIT_FAIL;
            break;
        }
    }
    view_free(&prev);
    if (!rc && !ever_read) {
        cli_eprintf("cuma top: the ledger could not be read at any refresh\n");
        rc = CUMA_EXIT_FAIL;
    }
    return rc;
}
