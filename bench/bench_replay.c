// SPDX-License-Identifier: Apache-2.0
/* Trace replays: the trace is parsed and flattened into operations first; then only the
 * allocator calls run in the timed loop. Throughput (1 thread), per-operation latency and
 * scaling (2 threads, each replaying its own copy on the shared heap or malloc). */
#include "bench.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

int bench_ops_load(const char *path, size_t max_events, bench_ops *out) {
    memset(out, 0, sizeof *out);
    cuma_trace t;
    if (cuma_trace_load(path, &t) != CUMA_OK) {
        fprintf(stderr, "cuma-bench: %s\n", cuma_last_error());
        return -1;
    }
    size_t n = max_events && max_events < t.n ? max_events : t.n;
    int64_t *slot_of = malloc((n ? n : 1) * sizeof *slot_of);
    out->op = malloc((n ? n : 1) * sizeof *out->op);
    if (!slot_of || !out->op) {
        free(slot_of);
        free(out->op);
        out->op = NULL;
        cuma_trace_free(&t);
        fprintf(stderr, "cuma-bench: no memory for %zu operations of %s\n", n, path);
        return -1;
    }
    for (size_t i = 0; i < n; i++) {
        const cuma_trace_event *e = &t.ev[i];
        slot_of[i] = -1;
        if (e->action == CUMA_TRACE_ALLOC && e->size > 0) {
            slot_of[i] = (int64_t)out->nslots;
            out->op[out->n++] = (bench_op){e->size, (uint32_t)out->nslots++, (uint32_t)e->stream};
            out->nallocs++;
        } else if (e->action == CUMA_TRACE_FREE && e->match >= 0 && (size_t)e->match < i &&
                   slot_of[e->match] >= 0) {
            out->op[out->n++] = (bench_op){0, (uint32_t)slot_of[e->match], 0};
        }
    }
    free(slot_of);
    const char *base = strrchr(path, '/');
    base = base ? base + 1 : path;
    snprintf(out->name, sizeof out->name, "%s", base);
    char *dot = strstr(out->name, ".csv");
    if (dot) *dot = 0;
    cuma_trace_free(&t);
    return 0;
}

void bench_ops_free(bench_ops *ops) {
    free(ops->op);
    memset(ops, 0, sizeof *ops);
}

/* ---- the loops ---------------------------------------------------------------------------- */

static uint64_t replay_cuma(cuma_heap *h, const bench_ops *ops, uint64_t scale, void **ptrs) {
    uint64_t bad = 0;
    for (size_t i = 0; i < ops->n; i++) {
        const bench_op *op = &ops->op[i];
        if (op->size) {
            cuma_stream s = (cuma_stream)(uintptr_t)op->stream;
            if (cuma_alloc(h, (size_t)(op->size * scale), s, &ptrs[op->slot]) != CUMA_OK) {
                ptrs[op->slot] = NULL;
                bad++;
            }
        } else if (ptrs[op->slot]) {
            bad += cuma_free(h, ptrs[op->slot], NULL) != CUMA_OK;
            ptrs[op->slot] = NULL;
        }
    }
    return bad;
}

static uint64_t replay_host(const bench_ops *ops, uint64_t scale, void **ptrs) {
    uint64_t bad = 0;
    for (size_t i = 0; i < ops->n; i++) {
        const bench_op *op = &ops->op[i];
        if (op->size) {
            ptrs[op->slot] = malloc((size_t)(op->size * scale));
            bad += !ptrs[op->slot];
        } else if (ptrs[op->slot]) {
            free(ptrs[op->slot]);
            ptrs[op->slot] = NULL;
        }
    }
    return bad;
}

/* The same loops with the timer read around every call; lat gets one sample per call. */
static uint64_t replay_cuma_lat(cuma_heap *h, const bench_ops *ops, uint64_t scale, void **ptrs,
                                uint32_t *lat, size_t *nlat) {
    uint64_t bad = 0;
    size_t k = 0;
    for (size_t i = 0; i < ops->n; i++) {
        const bench_op *op = &ops->op[i];
        uint64_t t0, t1;
        if (op->size) {
            cuma_stream s = (cuma_stream)(uintptr_t)op->stream;
            t0 = bench_ticks();
            cuma_status st = cuma_alloc(h, (size_t)(op->size * scale), s, &ptrs[op->slot]);
            t1 = bench_ticks();
            if (st != CUMA_OK) ptrs[op->slot] = NULL, bad++;
        } else if (ptrs[op->slot]) {
            t0 = bench_ticks();
            cuma_status st = cuma_free(h, ptrs[op->slot], NULL);
            t1 = bench_ticks();
            bad += st != CUMA_OK;
            ptrs[op->slot] = NULL;
        } else {
            continue;
        }
        lat[k++] = t1 - t0 > UINT32_MAX ? UINT32_MAX : (uint32_t)(t1 - t0);
    }
    *nlat = k;
    return bad;
}

static uint64_t replay_host_lat(const bench_ops *ops, uint64_t scale, void **ptrs, uint32_t *lat,
                                size_t *nlat) {
    uint64_t bad = 0;
    size_t k = 0;
    for (size_t i = 0; i < ops->n; i++) {
        const bench_op *op = &ops->op[i];
        uint64_t t0, t1;
        if (op->size) {
            t0 = bench_ticks();
            void *p = malloc((size_t)(op->size * scale));
            t1 = bench_ticks();
            ptrs[op->slot] = p;
            bad += !p;
        } else if (ptrs[op->slot]) {
            void *p = ptrs[op->slot];
            t0 = bench_ticks();
            free(p);
            t1 = bench_ticks();
            ptrs[op->slot] = NULL;
        } else {
            continue;
        }
        lat[k++] = t1 - t0 > UINT32_MAX ? UINT32_MAX : (uint32_t)(t1 - t0);
    }
    *nlat = k;
    return bad;
}

/* Frees what the trace left live, so every replay starts from the same state. Returns the
 * frees. */
static uint64_t cleanup(const bench_target *t, void **ptrs, size_t nslots) {
    uint64_t n = 0;
    for (size_t i = 0; i < nslots; i++) {
        if (!ptrs[i]) continue;
        if (t->heap)
            cuma_free(t->heap, ptrs[i], NULL);
        else
            free(ptrs[i]);
        ptrs[i] = NULL;
        n++;
    }
    return n;
}

static uint64_t replay_once(const bench_target *t, const bench_ops *ops, uint64_t scale,
                            void **ptrs) {
    return t->heap ? replay_cuma(t->heap, ops, scale, ptrs) : replay_host(ops, scale, ptrs);
}

typedef struct replay_job {
    const bench_target *t;
    const bench_ops *ops;
    uint64_t scale;
    void **ptrs[2];
    uint64_t bad[2];
    int reps;         /* replays per timed run (bench_replay_begin) */
    uint64_t done[2]; /* operations of each thread's last run */
} replay_job;

/* One timed run of a thread: the trace `reps` times, each followed by the frees of what it
 * left live (operations too: the next replay starts from an empty heap, as the first did). */
static void replay_thread(void *arg, int index, bench_span *span) {
    replay_job *j = arg;
    uint64_t ops = 0;
    bench_span_begin(span);
    for (int k = 0; k < j->reps; k++) {
        j->bad[index] += replay_once(j->t, j->ops, j->scale, j->ptrs[index]);
        ops += j->ops->n + cleanup(j->t, j->ptrs[index], j->ops->nslots);
    }
    bench_span_end(span);
    j->done[index] = ops;
}

uint64_t bench_replay_reps(const bench_target *t, const bench_ops *ops, int reps, uint64_t scale) {
    void **ptrs = calloc(ops->nslots ? ops->nslots : 1, sizeof *ptrs);
    if (!ptrs) return 1;
    uint64_t bad = 0;
    for (int r = 0; r <= reps; r++) { /* r == 0: the warm-up */
        bad += replay_once(t, ops, scale, ptrs);
        cleanup(t, ptrs, ops->nslots);
    }
    free(ptrs);
    return bad;
}

static void failed_note(bench_row *row, uint64_t bad) {
    if (bad) snprintf(row->note, sizeof row->note, "%llu calls failed", (unsigned long long)bad);
}

/* A replay measured run by run (bench.h). */
struct bench_replay_state {
    const bench_opts *o;
    replay_job j;
    char name[64];
    int done;
    bench_replay_run run[64];
};

bench_replay_state *bench_replay_begin(const bench_opts *o, const bench_target *t,
                                       const bench_ops *ops, uint64_t scale) {
    bench_replay_state *s = calloc(1, sizeof *s);
    size_t nslots = ops->nslots ? ops->nslots : 1;
    if (s) {
        s->o = o;
        s->j = (replay_job){.t = t, .ops = ops, .scale = scale, .reps = 1};
        s->j.ptrs[0] = calloc(nslots, sizeof(void *));
        s->j.ptrs[1] = calloc(nslots, sizeof(void *));
    }
    if (!s || !s->j.ptrs[0] || !s->j.ptrs[1]) {
        fprintf(stderr, "cuma-bench: no memory for the replay of %s\n", ops->name);
        exit(1);
    }
    snprintf(s->name, sizeof s->name, "%s x%llu", ops->name, (unsigned long long)scale);
    /* Warm-up: one replay on 1 thread and one on 2 (each thread its own copy of the trace on
     * the shared heap / malloc), so that caches, arenas and thread heaps are in place. */
    bench_time w = bench_run_threads(1, replay_thread, &s->j);
    bench_run_threads(2, replay_thread, &s->j);
    /* A run of a few milliseconds measures the scheduler as much as the allocator (a thread
     * preempted for part of a time slice halves a 2-thread figure): each timed run replays the
     * trace as often as it takes to last --run-ms. */
    double reps = o->run_ms * 1e6 / (w.wall_ns > 1 ? w.wall_ns : 1);
    s->j.reps = reps <= 1 ? 1 : reps > 1000 ? 1000 : (int)ceil(reps);
    s->j.bad[0] = s->j.bad[1] = 0;
    return s;
}

bench_replay_run bench_replay_step(bench_replay_state *s) {
    bench_time bt = bench_run_threads(1, replay_thread, &s->j);
    double n = (double)(s->j.done[0] ? s->j.done[0] : 1);
    bench_time bt2 = bench_run_threads(2, replay_thread, &s->j);
    double n2 = (double)(s->j.done[0] + s->j.done[1]);
    if (n2 < 1) n2 = 1;
    bench_replay_run r = {bt.wall_ns / n, bt.cpu_ns / n, bt2.wall_ns / n2, bt2.cpu_ns / n2};
    if (s->done < 64) s->run[s->done++] = r;
    return r;
}

void bench_replay_end(bench_replay_state *s, double vs_mim, double vs_mim_2t) {
    const bench_opts *o = s->o;
    const bench_target *t = s->j.t;
    const bench_ops *ops = s->j.ops;
    int runs = s->done;
    double v[64], cpu[64], v2[64], cpu2[64], ratio[64], p50[64], p99[64], p999[64];
    for (int r = 0; r < runs; r++) {
        v[r] = s->run[r].v, cpu[r] = s->run[r].cpu;
        v2[r] = s->run[r].v2, cpu2[r] = s->run[r].cpu2;
        ratio[r] = s->run[r].v / s->run[r].v2;
    }
    bench_row one = bench_row_make("replay", s->name, t->name, 1);
    one.ns_per_op = bench_median(v, runs);
    one.cpu_ns = bench_median(cpu, runs);
    one.ops_per_s = 1e9 / one.ns_per_op;
    one.vs_mim = vs_mim;
    bench_row two = bench_row_make("scaling", s->name, t->name, 2);
    two.ns_per_op = bench_median(v2, runs);
    two.cpu_ns = bench_median(cpu2, runs);
    two.ops_per_s = 1e9 / two.ns_per_op;
    /* A 1-thread run and the 2-thread run right after it make one pair: a slow spell of a
     * shared machine moves both sides of a ratio rather than one. */
    two.scale_2t = bench_median(ratio, runs);
    two.vs_mim = vs_mim_2t;
    failed_note(&one, s->j.bad[0] + s->j.bad[1]);
    failed_note(&two, s->j.bad[0] + s->j.bad[1]);
    bench_row_add(&one);

    /* Latency of single calls: the same replay with the timer around each call. */
    uint32_t *lat = malloc((ops->n ? ops->n : 1) * sizeof *lat);
    if (!lat) {
        fprintf(stderr, "cuma-bench: no memory for the latencies of %s\n", ops->name);
        exit(1);
    }
    uint64_t bad = 0;
    int lruns = o->runs < 64 ? o->runs : 64;
    for (int r = 0; r < lruns; r++) {
        size_t nlat = 0;
        bad += t->heap ? replay_cuma_lat(t->heap, ops, s->j.scale, s->j.ptrs[0], lat, &nlat)
                       : replay_host_lat(ops, s->j.scale, s->j.ptrs[0], lat, &nlat);
        cleanup(t, s->j.ptrs[0], ops->nslots);
        bench_pct p = bench_percentiles(lat, nlat);
        p50[r] = p.p50, p99[r] = p.p99, p999[r] = p.p999;
    }
    bench_row lr = bench_row_make("latency", s->name, t->name, 1);
    lr.p50 = bench_median(p50, lruns);
    lr.p99 = bench_median(p99, lruns);
    lr.p999 = bench_median(p999, lruns);
    failed_note(&lr, bad);
    bench_row_add(&lr);
    bench_row_add(&two);

    free(s->j.ptrs[0]);
    free(s->j.ptrs[1]);
    free(lat);
    free(s);
}

void bench_replay(const bench_opts *o, const bench_target *t, const bench_ops *ops,
                  uint64_t scale) {
    bench_replay_state *s = bench_replay_begin(o, t, ops, scale);
    int runs = o->runs < 64 ? o->runs : 64;
    for (int r = 0; r < runs; r++) bench_replay_step(s);
    bench_replay_end(s, NAN, NAN);
}
