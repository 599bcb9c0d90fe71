// SPDX-License-Identifier: Apache-2.0
/* Pacing (page_call_budget): when the device's page calls take more than their share of the
 * time, idle pages stay where they are so that fewer move. A simulated device whose page calls
 * cost 20 us each (sim_call_us) replays a bundled trace (sizes x16) pass after pass on the
 * manual clock: the program's own work between two calls is COMPUTE_NS of clock, and the page
 * calls add their cost to the device's clock (sim.c), which pacing reads. With pacing the heap
 * keeps some idle memory in place and moves far fewer pages per pass than the same heap
 * without it, for a bounded amount of memory; when the program then works longer between
 * calls, the calls fall under the budget and what pacing keeps goes back to nothing. Nothing
 * here depends on how fast the machine is (bench/ times the same on the real clock).
 *
 *   test_pacing TRACE [SCALE]    (SCALE 16 by default; 1 for a trace at GPU size, such as
 *                                 scripts/gpu/torch_trace.py's) */
#include "check.h"
#include "cuma/cuma.h"
#include "cuma/sim.h"
#include "trace/trace.h"

#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

#define MB (1024ull * 1024)

/* Clock per trace call: about what a replay on this machine spent in the heap itself. */
#define COMPUTE_NS 1000ull
#define PASSES     8

static uint64_t scale = 16;

typedef struct outcome {
    uint64_t late_passes, late_maps; /* passes of the second half, their maps */
    double keep_max;                 /* the most pacing kept, seen between passes */
    double keep_end;                 /* what it kept after the last pass */
    cuma_stats end;
} outcome;

static void one_pass(cuma_heap *h, const cuma_trace *t, void **ptrs, uint64_t *clock,
                     uint64_t compute_ns) {
    for (size_t i = 0; i < t->n; i++) {
        const cuma_trace_event *e = &t->ev[i];
        *clock += compute_ns;
        CHECK_OK(cuma_sim_set_time(h, *clock));
        if (e->action == CUMA_TRACE_ALLOC) {
            ptrs[i] = NULL;
            if (e->size) CHECK_OK(cuma_alloc(h, e->size * scale, NULL, &ptrs[i]));
        } else if (e->action == CUMA_TRACE_FREE && e->match >= 0 && ptrs[e->match]) {
            CHECK_OK(cuma_free(h, ptrs[e->match], NULL));
            ptrs[e->match] = NULL;
        }
    }
    for (size_t i = 0; i < t->n; i++) /* what the trace leaves live */
        if (t->ev[i].action == CUMA_TRACE_ALLOC && ptrs[i]) CHECK_OK(cuma_free(h, ptrs[i], NULL));
}

static double keep_of(cuma_heap *h) {
    cuma_stats s;
    CHECK_OK(cuma_get_stats(h, &s));
    return s.remap_keep;
}

/* passes at compute_ns a call, then idle_passes at idle_ns a call (0: none). */
static outcome replay(const char *conf, const cuma_trace *t, void **ptrs, unsigned idle_passes,
                      uint64_t idle_ns) {
    cuma_config cfg = {.conf = conf, .flags = CUMA_CONFIG_NO_ENV};
    cuma_heap *h;
    CHECK_OK(cuma_heap_create(&cfg, &h));
    outcome o = {0};
    uint64_t clock = 1000000000ull;
    for (unsigned p = 0; p < PASSES; p++) {
        cuma_stats s;
        CHECK_OK(cuma_get_stats(h, &s));
        one_pass(h, t, ptrs, &clock, COMPUTE_NS);
        cuma_stats s2;
        CHECK_OK(cuma_get_stats(h, &s2));
        if (s2.remap_keep > o.keep_max) o.keep_max = s2.remap_keep;
        if (p >= PASSES / 2) {
            o.late_maps += s2.maps - s.maps;
            o.late_passes++;
        }
    }
    CHECK_OK(cuma_get_stats(h, &o.end));
    for (unsigned p = 0; p < idle_passes; p++) one_pass(h, t, ptrs, &clock, idle_ns);
    o.keep_end = keep_of(h);
    CHECK_OK(cuma_validate(h));
    cuma_heap_destroy(h);
    return o;
}

int main(int argc, char **argv) {
    if (argc < 2 || argc > 3 || (argc == 3 && (scale = strtoull(argv[2], NULL, 10)) == 0)) {
        fprintf(stderr, "usage: test_pacing TRACE [SCALE]\n");
        return 2;
    }
    cuma_trace t;
    CHECK_OK(cuma_trace_load(argv[1], &t));
    void **ptrs = calloc(t.n, sizeof *ptrs);
    CHECK(ptrs != NULL);
    const char *paced =
        "backend:sim,sim_clock:manual,capacity:32G,sim_call_us:20,tcache:off,arenas:1";
    const char *unpaced = "backend:sim,sim_clock:manual,capacity:32G,sim_call_us:20,tcache:off,"
                          "arenas:1,page_call_budget:0";
    /* Then a pass with 1 ms of work between calls: the calls are far under a quarter of
     * the budget, and every 250 ms window takes a quarter off what is kept, to nothing. */
    outcome a = replay(paced, &t, ptrs, 1, 1000000);
    outcome b = replay(unpaced, &t, ptrs, 0, 0);
    double ma = (double)a.late_maps / (double)a.late_passes;
    double mb = (double)b.late_maps / (double)b.late_passes;
    printf("paced:   %.0f maps a pass late, keep up to %.3f (%.3f after the idle passes), "
           "%.0f ms of clock in page calls, peak %.0f MiB\n",
           ma, a.keep_max, a.keep_end, (double)a.end.page_call_ns / 1e6,
           (double)a.end.peak_reserved_bytes / MB);
    printf("unpaced: %.0f maps a pass late, keep up to %.3f, %.0f ms of clock in page calls, "
           "peak %.0f MiB\n",
           mb, b.keep_max, (double)b.end.page_call_ns / 1e6,
           (double)b.end.peak_reserved_bytes / MB);
    fflush(stdout);
    CHECK(b.keep_max == 0); /* no budget, no pacing */
    CHECK(mb > 100);        /* the trace moves pages when nothing is kept */
    /* The calls are timed on the device's clock: 20 us each, every one of them. */
    CHECK(b.end.page_call_ns ==
          20000ull * (b.end.page_creates + b.end.page_releases + b.end.maps + b.end.unmaps));
    /* 20 us a call and thousands of moves a pass: far over a 1 % budget. */
    CHECK(a.keep_max >= 0.02);
    CHECK(ma < 0.5 * mb);
    /* What pacing keeps is bounded: at most a quarter of the memory in use. */
    CHECK(a.keep_max <= 0.25);
    CHECK(a.end.peak_reserved_bytes <= b.end.peak_reserved_bytes * 5 / 4 + 2 * MB);
    CHECK(a.keep_end == 0); /* cheap calls: nothing kept any more */
    free(ptrs);
    cuma_trace_free(&t);
    printf("test_pacing: all passed\n");
    return 0;
}
