// SPDX-License-Identifier: Apache-2.0
/* Pacing on the real clock (page_call_budget): a trace replayed pass after pass (sizes x16) as
 * fast as the machine goes, on a simulated device whose page calls spin 20 us each, with and
 * without pacing. test_pacing checks the same logic on the manual clock; this is the wall-clock
 * figure, which moves with the machine and its load. */
#include "bench.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define PACE_SCALE   16u
#define PACE_CALL_US 20

typedef struct pace_outcome {
    uint64_t late_passes, late_maps, late_ops, late_ns, total_ns;
    double keep_max;
    cuma_stats end;
    bool bad;
} pace_outcome;

static cuma_stats stats_now(cuma_heap *h) {
    cuma_stats s;
    memset(&s, 0, sizeof s);
    cuma_get_stats(h, &s);
    return s;
}

/* One pass of ops, then the frees of what it left live; false when a call failed. */
static bool pace_pass(cuma_heap *h, const bench_ops *ops, void **slot) {
    bool ok = true;
    for (size_t i = 0; i < ops->n; i++) {
        const bench_op *op = &ops->op[i];
        if (op->size) {
            slot[op->slot] = NULL;
            ok &= cuma_alloc(h, op->size * PACE_SCALE, NULL, &slot[op->slot]) == CUMA_OK;
        } else if (slot[op->slot]) {
            ok &= cuma_free(h, slot[op->slot], NULL) == CUMA_OK;
            slot[op->slot] = NULL;
        }
    }
    for (size_t i = 0; i < ops->nslots; i++)
        if (slot[i]) {
            ok &= cuma_free(h, slot[i], NULL) == CUMA_OK;
            slot[i] = NULL;
        }
    return ok;
}

static pace_outcome pace_run(const bench_opts *o, const bench_ops *ops, void **slot, bool paced,
                             double seconds) {
    char conf[160];
    snprintf(conf, sizeof conf,
             "sim_clock:real,release_delay_ms:never,capacity:32G,sim_call_us:%d,tcache:off,"
             "arenas:1%s",
             PACE_CALL_US, paced ? "" : ",page_call_budget:0");
    cuma_heap *h = bench_heap(o, conf);
    pace_outcome r = {0};
    uint64_t t0 = bench_now_ns(), half = t0 + (uint64_t)(seconds * 0.5e9);
    uint64_t end = t0 + (uint64_t)(seconds * 1e9);
    while (!r.bad && (bench_now_ns() < end || !r.late_passes)) {
        uint64_t p0 = bench_now_ns();
        cuma_stats s = stats_now(h);
        r.bad = !pace_pass(h, ops, slot);
        cuma_stats s2 = stats_now(h);
        if (s2.remap_keep > r.keep_max) r.keep_max = s2.remap_keep;
        if (p0 >= half) {
            r.late_maps += s2.maps - s.maps;
            r.late_ops += ops->n;
            r.late_ns += bench_now_ns() - p0;
            r.late_passes++;
        }
    }
    r.total_ns = bench_now_ns() - t0;
    r.end = stats_now(h);
    cuma_heap_destroy(h);
    return r;
}

void bench_pacing(const bench_opts *o) {
    /* lstm_phases where it is among the traces (its pages move most), else the first. */
    const char *path = o->ntraces ? o->traces[0] : NULL;
    for (int i = 0; i < o->ntraces; i++)
        if (strstr(o->traces[i], "lstm_phases")) path = o->traces[i];
    if (!path) return;
    bench_ops ops;
    if (bench_ops_load(path, o->max_events, &ops)) return;
    void **slot = calloc(ops.nslots ? ops.nslots : 1, sizeof *slot);
    if (!slot) {
        bench_ops_free(&ops);
        return;
    }
    double seconds = o->quick ? 0.4 : 3.0;
    char name[48];
    snprintf(name, sizeof name, "%.20s x%u, sim_call_us:%d", ops.name, PACE_SCALE, PACE_CALL_US);
    for (int paced = 1; paced >= 0; paced--) {
        pace_outcome r = pace_run(o, &ops, slot, paced, seconds);
        bench_row row =
            bench_row_make("pacing", name, paced ? "cuma (paced)" : "cuma (unpaced)", 1);
        if (r.bad) {
            snprintf(row.note, sizeof row.note, "a call failed: %.70s", cuma_last_error());
        } else {
            row.ns_per_op = (double)r.late_ns / (double)r.late_ops;
            row.ops_per_s = 1e9 / row.ns_per_op;
            snprintf(row.note, sizeof row.note,
                     "%.0f maps a pass (2nd half); keep up to %.3f; calls %.0f %% of the time; "
                     "peak %.0f MiB",
                     (double)r.late_maps / (double)r.late_passes, r.keep_max,
                     100.0 * (double)r.end.page_call_ns / (double)r.total_ns,
                     (double)r.end.peak_reserved_bytes / (1024.0 * 1024.0));
        }
        bench_row_add(&row);
    }
    free(slot);
    bench_ops_free(&ops);
}
