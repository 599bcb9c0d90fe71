// SPDX-License-Identifier: Apache-2.0
/* cuma-bench: how fast cuma hands out and takes back memory, next to glibc malloc, mimalloc and
 * jemalloc on the same operations.
 *
 *   cuma-bench [--quick] [--json] [--runs N] [--run-ms MS] [--events N] [--no-peers]
 *              [--only cost,fast,replay,release,pacing] [--conf STR] [TRACE.csv.gz ...]
 *
 * cuma runs in this process on a simulated device (backend:sim, no host backing,
 * sim_clock:manual): addresses are numbers nobody touches and the clock is an atomic load,
 * so the figures are the heap's own bookkeeping (the release section, bench_release.c, adds
 * sim_clock:real: it times the release thread). The host allocators run in child processes
 * (bench_peer.c). Rows are printed at the end as one table, or as JSON lines with --json.
 *
 * Profile modes (bench/profile.sh runs them under callgrind; no clock, no child, fixed counts):
 *   --profile-fast SIZE N        warm-up, then exactly N alloc+free pairs of SIZE bytes
 *   --profile-replay TRACE R     warm-up replay, then exactly R replays of TRACE (x1, or
 *                                the sizes times N with --profile-scale N)
 * Each prints "ops N": the operations after the warm-up.
 */
#include "bench.h"

#include <glob.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#ifndef CUMA_BENCH_DATA_DIR
#define CUMA_BENCH_DATA_DIR "tests/data"
#endif
#ifndef CUMA_BENCH_BUILD_TYPE
#define CUMA_BENCH_BUILD_TYPE "?"
#endif

#define BASE_CONF "backend:sim,sim_clock:manual"

static void usage(FILE *f) {
    fprintf(f,
            "usage: cuma-bench [--quick] [--json] [--runs N] [--run-ms MS] [--events N]\n"
            "                  [--no-peers] [--only LIST] [--conf STR] [TRACE.csv.gz ...]\n"
            "  --quick      tiny counts, one trace (smoke test)\n"
            "  --json       one JSON object per row\n"
            "  --runs N     timed runs per figure, the median is printed (default 5)\n"
            "  --run-ms MS  length of one timed run, fast path or replay (default 50)\n"
            "  --events N   replay only the first N events of each trace\n"
            "  --no-peers   cuma only (no glibc, mimalloc, jemalloc)\n"
            "  --only LIST  sections to run, of cost,fast,replay,release,pacing (replay includes\n"
            "               latency and scaling); default all\n"
            "  --conf STR   added to cuma's settings (" BASE_CONF ")\n"
            "  traces default to %s/*.csv.gz\n",
            CUMA_BENCH_DATA_DIR);
}

cuma_status bench_heap_try(const bench_opts *o, const char *extra, cuma_heap **out) {
    char conf[1024];
    snprintf(conf, sizeof conf, "%s%s%s%s%s", BASE_CONF, extra ? "," : "", extra ? extra : "",
             o->conf ? "," : "", o->conf ? o->conf : "");
    cuma_config cfg = {.conf = conf, .flags = CUMA_CONFIG_NO_ENV};
    return cuma_heap_create(&cfg, out);
}

cuma_heap *bench_heap(const bench_opts *o, const char *extra) {
    cuma_heap *h;
    if (bench_heap_try(o, extra, &h) != CUMA_OK) {
        fprintf(stderr, "cuma-bench: cannot create a heap (%s%s%s%s%s): %s\n", BASE_CONF,
                extra ? "," : "", extra ? extra : "", o->conf ? "," : "", o->conf ? o->conf : "",
                cuma_last_error());
        exit(2);
    }
    return h;
}

static void progress(const char *what, const char *detail) {
    if (isatty(2)) fprintf(stderr, "cuma-bench: %s %s\n", what, detail ? detail : "");
}

typedef struct cli {
    bench_opts o;
    const char *peer, *peer_job; /* --peer-child */
    int peer_fd, peer_ctl;
    const char *prof_fast, *prof_replay, *prof_count;
    long prof_scale; /* --profile-scale: the replay's sizes times this */
    glob_t g;
    bool globbed;
} cli;

static long number(const char *flag, const char *v, long min) {
    char *end;
    long n = v ? strtol(v, &end, 10) : 0;
    if (!v || *end || n < min) {
        fprintf(stderr, "cuma-bench: %s wants an integer >= %ld\n", flag, min);
        exit(2);
    }
    return n;
}

static unsigned sections(const char *v) {
    static const char *const names[] = {"cost", "fast", "replay", "release", "pacing"};
    unsigned m = 0;
    for (const char *p = v; p && *p;) {
        size_t len = strcspn(p, ",");
        unsigned bit = 0;
        for (unsigned k = 0; k < 5; k++)
            if (len == strlen(names[k]) && !strncmp(p, names[k], len)) bit = 1u << k;
        if (!bit) break;
        m |= bit;
        p += len + (p[len] == ',');
        if (!*p) return m;
    }
    fprintf(stderr, "cuma-bench: --only wants a list of cost, fast, replay, release, pacing\n");
    exit(2);
}

static void parse(int argc, char **argv, cli *c) {
    bench_opts *o = &c->o;
    *o = (bench_opts){.runs = 5, .run_ms = 50, .peers = true};
    o->only = BENCH_COST | BENCH_FAST | BENCH_REPLAY | BENCH_RELEASE | BENCH_PACING;
    bool runs_set = false, ms_set = false, ev_set = false;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (!strcmp(a, "--quick")) {
            o->quick = true;
        } else if (!strcmp(a, "--json")) {
            o->json = true;
        } else if (!strcmp(a, "--no-peers")) {
            o->peers = false;
        } else if (!strcmp(a, "--runs")) {
            o->runs = (int)number(a, v, 1), i++, runs_set = true;
        } else if (!strcmp(a, "--run-ms")) {
            if (!v || (o->run_ms = atof(v)) <= 0) number(a, NULL, 1);
            i++, ms_set = true;
        } else if (!strcmp(a, "--events")) {
            o->max_events = (size_t)number(a, v, 0), i++, ev_set = true;
        } else if (!strcmp(a, "--only")) {
            o->only = sections(v);
            i++;
        } else if (!strcmp(a, "--conf")) {
            if (!(o->conf = v)) number(a, NULL, 0);
            i++;
        } else if (!strcmp(a, "--profile-scale")) {
            c->prof_scale = number(a, v, 1), i++;
        } else if (!strcmp(a, "--peer-fd")) {
            c->peer_fd = (int)number(a, v, 0), i++;
        } else if (!strcmp(a, "--peer-ctl")) {
            c->peer_ctl = (int)number(a, v, 0), i++;
        } else if (!strcmp(a, "--peer-child") && i + 2 < argc) {
            c->peer = argv[i + 1], c->peer_job = argv[i + 2], i += 2;
        } else if ((!strcmp(a, "--profile-fast") || !strcmp(a, "--profile-replay")) &&
                   i + 2 < argc) {
            if (!strcmp(a, "--profile-fast"))
                c->prof_fast = argv[i + 1];
            else
                c->prof_replay = argv[i + 1];
            c->prof_count = argv[i + 2], i += 2;
        } else if (!strcmp(a, "-h") || !strcmp(a, "--help")) {
            usage(stdout);
            exit(0);
        } else if (a[0] == '-') {
            fprintf(stderr, "cuma-bench: unknown option %s\n", a);
            usage(stderr);
            exit(2);
        } else {
            if (!o->traces) o->traces = calloc((size_t)argc, sizeof *o->traces);
            if (!o->traces) exit(2);
            o->traces[o->ntraces++] = argv[i];
        }
    }
    if (o->quick) {
        if (!runs_set) o->runs = 3;
        if (!ms_set) o->run_ms = 1;
        if (!ev_set) o->max_events = 20000;
    }
    if (!o->ntraces && !c->peer && !c->prof_fast && !c->prof_replay) {
        c->globbed = glob(CUMA_BENCH_DATA_DIR "/*.csv.gz", 0, NULL, &c->g) == 0;
        if (c->globbed) o->traces = c->g.gl_pathv, o->ntraces = (int)c->g.gl_pathc;
    }
    if (o->quick && o->ntraces > 1) o->ntraces = 1;
}

static int profile(const cli *c) {
    bench_opts o = c->o;
    long n = number("the profile count", c->prof_count, 0);
    cuma_heap *h = bench_heap(&o, NULL);
    bench_target t = {"cuma", h};
    uint64_t bad = 0, ops;
    if (c->prof_fast) {
        size_t size = (size_t)number("--profile-fast SIZE", c->prof_fast, 1);
        bad += bench_fast_pairs(&t, size, 1000); /* warm-up: the page is mapped and cached */
        bad += bench_fast_pairs(&t, size, (uint64_t)n);
        ops = (uint64_t)n;
    } else {
        bench_ops b;
        if (bench_ops_load(c->prof_replay, o.max_events, &b)) return 2;
        bad += bench_replay_reps(&t, &b, (int)n, (uint64_t)(c->prof_scale ? c->prof_scale : 1));
        ops = (uint64_t)n * b.n;
        bench_ops_free(&b);
    }
    cuma_heap_destroy(h);
    printf("ops %llu\n", (unsigned long long)ops);
    if (bad) fprintf(stderr, "cuma-bench: %llu calls failed\n", (unsigned long long)bad);
    return bad ? 1 : 0;
}

static void machine(const bench_opts *o, char *text, size_t tlen, char *json, size_t jlen) {
    char cpu[256];
    bench_cpu_model(cpu, sizeof cpu);
    double load = -1; /* other work on the machine disturbs the figures: say how much there was */
    FILE *f = fopen("/proc/loadavg", "r");
    if (f) {
        if (fscanf(f, "%lf", &load) != 1) load = -1;
        fclose(f);
    }
    snprintf(text, tlen,
             "machine: nproc=%d cpu=\"%s\" load=%.2f; build %s; timer %s (start+stop %.1f ns, "
             "subtracted; "
             "resolution %.1f ns; %s: %.1f ns); %d runs per figure, median\n"
             "cuma: %s%s%s (in process, malloc from %s); peers in child processes: %s",
             bench_nproc(), cpu, load, CUMA_BENCH_BUILD_TYPE, bench_tm.name, bench_tm.overhead_ns,
             bench_tm.resolution_ns, bench_use_tsc ? "clock_gettime" : "rdtsc", bench_tm.other_ns,
             o->runs, BASE_CONF, o->conf ? "," : "", o->conf ? o->conf : "",
             bench_malloc_provider(), o->peers ? bench_peer_summary() : "none (--no-peers)");
    snprintf(json, jlen,
             "{\"section\":\"machine\",\"nproc\":%d,\"cpu\":\"%s\",\"load\":%.2f,\"build\":\"%s\","
             "\"timer\":\"%s\",\"timer_overhead_ns\":%.2f,\"timer_resolution_ns\":%.2f,\"runs\":%d,"
             "\"cuma_conf\":\"%s%s%s\","
             "\"peers\":\"%s\"}",
             bench_nproc(), cpu, load, CUMA_BENCH_BUILD_TYPE, bench_tm.name, bench_tm.overhead_ns,
             bench_tm.resolution_ns, o->runs, BASE_CONF, o->conf ? "," : "", o->conf ? o->conf : "",
             o->peers ? bench_peer_summary() : "");
}

static void run_fast(const bench_opts *o) {
    progress("fast path:", "cuma");
    cuma_heap *h = bench_heap(o, NULL);
    bench_target cuma = {"cuma", h};
    bench_fast(o, &cuma);
    cuma_heap_destroy(h);
    /* What the clock costs: sim_clock:real reads CLOCK_MONOTONIC on every call, as the CUDA
     * backends do, and runs the release thread, which each free may wake. */
    h = bench_heap(o, "sim_clock:real");
    bench_target real = {"cuma (real clock)", h};
    for (int threads = 1; threads <= 2; threads++)
        bench_fast_one(o, &real, 4096, threads, "sim_clock:real: clock read + release thread");
    cuma_heap_destroy(h);
    for (int p = 0; o->peers && p < bench_npeers; p++) {
        progress("fast path:", bench_peers[p]);
        bench_peer_run(o, bench_peers[p], "fast", NULL);
    }
}

/* Median over paired runs of a's ns/op over b's (1 thread, or 2 with `two`); NAN if none. */
static double paired(const bench_replay_run *a, const bench_replay_run *b, int n, bool two) {
    double r[64];
    for (int i = 0; i < n; i++) r[i] = two ? a[i].v2 / b[i].v2 : a[i].v / b[i].v;
    return n ? bench_median(r, n) : NAN;
}

static int run_trace(const bench_opts *o, const char *path) {
    bench_ops ops;
    progress("replay:", path);
    if (bench_ops_load(path, o->max_events, &ops)) return 1;
    /* At x1, cuma and the peers take turns run by run (bench_replay_begin). */
    enum { NP = 3 };
    bench_peer_proc peer[NP];
    int np = o->peers ? bench_npeers : 0, runs = o->runs < 64 ? o->runs : 64, mim = -1;
    static bench_replay_run pr[NP + 1][64]; /* [NP]: cuma */
    int ok[NP + 1] = {0};
    for (int p = 0; p < np; p++) {
        bench_peer_start(o, bench_peers[p], path, &peer[p]);
        if (!strcmp(bench_peers[p], "mimalloc")) mim = p;
    }
    cuma_heap *h = bench_heap(o, NULL);
    bench_target cuma = {"cuma", h};
    bench_replay_state *s = bench_replay_begin(o, &cuma, &ops, 1);
    for (int r = 0; r < runs; r++) {
        pr[NP][ok[NP]++] = bench_replay_step(s);
        for (int p = 0; p < np; p++)
            if (ok[p] == r && bench_peer_step(&peer[p], &pr[p][r])) ok[p]++;
    }
    /* Paired ratios need every run of both sides. */
    bool have_mim = mim >= 0 && ok[mim] == runs;
    bench_replay_end(s, have_mim ? paired(pr[NP], pr[mim], runs, false) : NAN,
                     have_mim ? paired(pr[NP], pr[mim], runs, true) : NAN);
    cuma_heap_destroy(h);
    h = bench_heap(o, NULL);
    cuma.heap = h;
    bench_replay(o, &cuma, &ops, 16);
    cuma_heap_destroy(h);
    for (int p = 0; p < np; p++) {
        bool both = have_mim && ok[p] == runs;
        bench_peer_finish(&peer[p], ops.name, both ? paired(pr[p], pr[mim], runs, false) : NAN,
                          both ? paired(pr[p], pr[mim], runs, true) : NAN);
    }
    bench_ops_free(&ops);
    return 0;
}

int main(int argc, char **argv) {
    cli c;
    memset(&c, 0, sizeof c);
    c.peer_fd = c.peer_ctl = -1;
    parse(argc, argv, &c);
    bench_opts *o = &c.o;
    if (c.peer)
        return bench_peer_child(o, c.peer, c.peer_job, c.peer_fd < 0 ? 1 : c.peer_fd, c.peer_ctl);
    if (c.prof_fast || c.prof_replay) return profile(&c);
    if (!o->ntraces && (o->only & BENCH_REPLAY)) {
        fprintf(stderr, "cuma-bench: no trace given and none in %s\n", CUMA_BENCH_DATA_DIR);
        return 2;
    }
    bench_timer_init();
    int rc = 0;

    if (o->only & BENCH_COST) {
        progress("costs of the primitives", NULL);
        bench_row tr = bench_row_make("cost", "timer start+stop", bench_tm.name, 1);
        tr.ns_per_op = bench_tm.overhead_ns;
        snprintf(tr.note, sizeof tr.note, "subtracted from every latency sample");
        bench_row_add(&tr);
        bench_costs(o);
    }
    if (o->only & BENCH_FAST) run_fast(o);
    for (int i = 0; (o->only & BENCH_REPLAY) && i < o->ntraces; i++)
        rc |= run_trace(o, o->traces[i]);
    if (o->only & BENCH_RELEASE) {
        progress("release latency", NULL);
        bench_release(o);
    }
    if (o->only & BENCH_PACING) {
        progress("pacing", NULL);
        bench_pacing(o);
    }

    char text[2048], json[2048];
    machine(o, text, sizeof text, json, sizeof json);
    bench_report(json, text, o->json);
    bench_threads_stop();
    bench_rows_free();
    if (c.globbed)
        globfree(&c.g);
    else
        free(o->traces);
    return rc;
}
