// SPDX-License-Identifier: Apache-2.0
/* The fast path: alloc+free pairs of one cached size, one or two threads on one heap (or on the
 * process's malloc); and the primitives cuma's hot path is built of. */
#include "bench.h"

#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>

const size_t bench_fast_sizes[] = {64, 4096, 65536, 1u << 20, 64u << 20};
const int bench_nfast_sizes = (int)(sizeof bench_fast_sizes / sizeof bench_fast_sizes[0]);

void bench_size_name(size_t size, char *buf, size_t len) {
    static const char *unit[] = {"B", "KiB", "MiB", "GiB"};
    int u = 0;
    while (u < 3 && size >= 1024 && size % 1024 == 0) size /= 1024, u++;
    snprintf(buf, len, "%zu %s", size, unit[u]);
}

static uint64_t loop_cuma(cuma_heap *h, size_t size, uint64_t n) {
    uint64_t bad = 0;
    for (uint64_t i = 0; i < n; i++) {
        void *p;
        if (cuma_alloc(h, size, NULL, &p) != CUMA_OK) {
            bad++;
            continue;
        }
        bad += cuma_free(h, p, NULL) != CUMA_OK;
    }
    return bad;
}

static uint64_t loop_host(size_t size, uint64_t n) {
    uint64_t bad = 0;
    for (uint64_t i = 0; i < n; i++) {
        void *p = malloc(size);
        bench_escape(p);
        bad += !p;
        free(p);
    }
    return bad;
}

uint64_t bench_fast_pairs(const bench_target *t, size_t size, uint64_t n) {
    return t->heap ? loop_cuma(t->heap, size, n) : loop_host(size, n);
}

typedef struct fast_job {
    const bench_target *t;
    size_t size;
    uint64_t iters;
    uint64_t bad[8];
} fast_job;

static void fast_thread(void *arg, int index, bench_span *span) {
    fast_job *j = arg;
    bench_span_begin(span);
    j->bad[index] += bench_fast_pairs(j->t, j->size, j->iters);
    bench_span_end(span);
}

/* Warms up while doubling the pair count until a loop lasts a quarter of a run, then returns
 * the count for one run of run_ms. */
static uint64_t calibrate(const bench_opts *o, const bench_target *t, size_t size, uint64_t *bad) {
    double target = o->run_ms * 1e6;
    for (uint64_t n = 16;; n *= 2) {
        uint64_t t0 = bench_now_ns();
        *bad += bench_fast_pairs(t, size, n);
        double el = (double)(bench_now_ns() - t0);
        if (el >= target / 4 || n >= (1ull << 32)) {
            double iters = el > 0 ? (double)n * target / el : (double)n;
            return iters < 16 ? 16 : (uint64_t)iters;
        }
    }
}

void bench_fast_one(const bench_opts *o, const bench_target *t, size_t size, int threads,
                    const char *note) {
    fast_job j = {.t = t, .size = size};
    uint64_t warm_bad = 0;
    j.iters = calibrate(o, t, size, &warm_bad);
    if (threads > 1) {
        uint64_t full = j.iters;
        j.iters = full / 8 + 1;
        bench_run_threads(threads, fast_thread, &j); /* every thread warms up */
        j.iters = full;
    }
    double ns[64], cpu[64];
    int runs = o->runs < 64 ? o->runs : 64;
    for (int r = 0; r < runs; r++) {
        bench_time bt = bench_run_threads(threads, fast_thread, &j);
        ns[r] = bt.wall_ns / ((double)j.iters * threads);
        cpu[r] = bt.cpu_ns / ((double)j.iters * threads);
    }
    char name[32];
    bench_size_name(size, name, sizeof name);
    bench_row row = bench_row_make("fast", name, t->name, threads);
    row.ns_per_op = bench_median(ns, runs);
    row.cpu_ns = bench_median(cpu, runs);
    row.ops_per_s = row.ns_per_op > 0 ? 1e9 / row.ns_per_op : NAN;
    uint64_t bad = warm_bad;
    for (int i = 0; i < threads; i++) bad += j.bad[i];
    if (bad)
        snprintf(row.note, sizeof row.note, "%llu calls failed", (unsigned long long)bad);
    else if (note)
        snprintf(row.note, sizeof row.note, "%s", note);
    bench_row_add(&row);
}

void bench_fast(const bench_opts *o, const bench_target *t) {
    for (int s = 0; s < bench_nfast_sizes; s++)
        for (int threads = 1; threads <= 2; threads++)
            bench_fast_one(o, t, bench_fast_sizes[s], threads, NULL);
}

/* ---- primitives --------------------------------------------------------------------------- */

static pthread_mutex_t cost_lock = PTHREAD_MUTEX_INITIALIZER;
static uint64_t cost_shared;          /* under cost_lock */
static volatile uint64_t cost_out[8]; /* one per thread: keeps the clock loop */

typedef struct cost_job {
    int what; /* 0: clock_gettime, 1: mutex lock+unlock */
    uint64_t iters;
} cost_job;

static void cost_thread(void *arg, int index, bench_span *span) {
    const cost_job *j = arg;
    uint64_t acc = 0;
    bench_span_begin(span);
    if (j->what == 0) {
        for (uint64_t i = 0; i < j->iters; i++) acc += bench_now_ns();
    } else {
        for (uint64_t i = 0; i < j->iters; i++) {
            pthread_mutex_lock(&cost_lock);
            cost_shared++;
            pthread_mutex_unlock(&cost_lock);
        }
    }
    bench_span_end(span);
    cost_out[index] = acc;
}

static void cost_row(const bench_opts *o, int what, const char *name, int threads) {
    cost_job j = {what, 1000};
    double target = o->run_ms * 1e6;
    for (;;) { /* warm-up and calibration, as for the fast path */
        double el = bench_run_threads(1, cost_thread, &j).wall_ns;
        if (el >= target / 4 || j.iters >= (1ull << 32)) {
            j.iters = el > 0 ? (uint64_t)((double)j.iters * target / el) + 1 : j.iters;
            break;
        }
        j.iters *= 2;
    }
    double ns[64], cpu[64];
    int runs = o->runs < 64 ? o->runs : 64;
    for (int r = 0; r < runs; r++) {
        bench_time bt = bench_run_threads(threads, cost_thread, &j);
        ns[r] = bt.wall_ns / ((double)j.iters * threads);
        cpu[r] = bt.cpu_ns / ((double)j.iters * threads);
    }
    bench_row row = bench_row_make("cost", name, "-", threads);
    row.ns_per_op = bench_median(ns, runs);
    row.cpu_ns = bench_median(cpu, runs);
    row.ops_per_s = row.ns_per_op > 0 ? 1e9 / row.ns_per_op : NAN;
    bench_row_add(&row);
}

void bench_costs(const bench_opts *o) {
    cost_row(o, 0, "clock_gettime(MONOTONIC)", 1);
    cost_row(o, 1, "mutex lock+unlock", 1);
    cost_row(o, 1, "mutex lock+unlock", 2);
}
