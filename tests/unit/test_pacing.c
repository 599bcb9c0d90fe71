/* Pacing (page_call_budget): when the device's page calls take more than their share of the
 * wall time, idle pages stay where they are so that fewer move. A simulated device whose page
 * calls take 20 us each (sim_call_us, as a GPU driver's do) replays a bundled trace (sizes x16)
 * over and over on the real clock, as fast as it can: with pacing the heap keeps some idle
 * memory in place and moves far fewer pages per pass than the same heap without it, for a
 * bounded amount of memory. About 6 s of wall time.
 *
 *   test_pacing TRACE [SCALE]    (SCALE 16 by default; 1 for a trace at GPU size, such as
 *                                 scripts/gpu/torch_trace.py's: about 15 s) */
#include "check.h"
#include "cuma/cuma.h"
#include "trace/trace.h"

#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

#define MB (1024ull * 1024)

static uint64_t scale = 16;

static uint64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

typedef struct outcome {
    uint64_t passes, late_passes, late_maps; /* passes begun in the second half, their maps */
    double keep_max;                         /* the most pacing kept, seen between passes */
    cuma_stats end;
} outcome;

static void one_pass(cuma_heap *h, const cuma_trace *t, void **ptrs) {
    for (size_t i = 0; i < t->n; i++) {
        const cuma_trace_event *e = &t->ev[i];
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

static outcome replay_for(const char *conf, const cuma_trace *t, void **ptrs, double seconds) {
    cuma_config cfg = {.conf = conf, .flags = CUMA_CONFIG_NO_ENV};
    cuma_heap *h;
    CHECK_OK(cuma_heap_create(&cfg, &h));
    outcome o = {0};
    uint64_t t0 = now_ns(), half = t0 + (uint64_t)(seconds * 0.5e9);
    uint64_t end = t0 + (uint64_t)(seconds * 1e9);
    while (now_ns() < end || o.late_passes == 0) {
        bool late = now_ns() >= half;
        cuma_stats s;
        CHECK_OK(cuma_get_stats(h, &s));
        one_pass(h, t, ptrs);
        o.passes++;
        cuma_stats s2;
        CHECK_OK(cuma_get_stats(h, &s2));
        if (s2.remap_keep > o.keep_max) o.keep_max = s2.remap_keep;
        if (late) {
            o.late_maps += s2.maps - s.maps;
            o.late_passes++;
        }
    }
    CHECK_OK(cuma_get_stats(h, &o.end));
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
    const char *paced = "backend:sim,capacity:32G,sim_call_us:20,tcache:off,arenas:1";
    const char *unpaced =
        "backend:sim,capacity:32G,sim_call_us:20,tcache:off,arenas:1,page_call_budget:0";
    outcome a = replay_for(paced, &t, ptrs, 3.0);
    outcome b = replay_for(unpaced, &t, ptrs, 3.0);
    double ma = (double)a.late_maps / (double)a.late_passes;
    double mb = (double)b.late_maps / (double)b.late_passes;
    printf("paced:   %llu passes, %.0f maps a pass late, keep up to %.3f, %.0f ms in page calls, "
           "peak %.0f MiB\n",
           (unsigned long long)a.passes, ma, a.keep_max, (double)a.end.page_call_ns / 1e6,
           (double)a.end.peak_reserved_bytes / MB);
    printf("unpaced: %llu passes, %.0f maps a pass late, keep up to %.3f, %.0f ms in page calls, "
           "peak %.0f MiB\n",
           (unsigned long long)b.passes, mb, b.keep_max, (double)b.end.page_call_ns / 1e6,
           (double)b.end.peak_reserved_bytes / MB);
    fflush(stdout);
    CHECK(b.keep_max == 0); /* no budget, no pacing */
    CHECK(mb > 100);        /* the trace moves pages when nothing is kept */
    /* 20 us a call and thousands of moves a pass: far over a 1 % budget. */
    CHECK(a.keep_max >= 0.02);
    CHECK(ma < 0.5 * mb);
    /* What pacing keeps is bounded: at most a quarter of the memory in use. */
    CHECK(a.end.peak_reserved_bytes <= b.end.peak_reserved_bytes * 5 / 4 + 2 * MB);
    free(ptrs);
    cuma_trace_free(&t);
    printf("test_pacing: all passed\n");
    return 0;
}
