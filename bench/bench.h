// SPDX-License-Identifier: Apache-2.0
/* cuma-bench: shared declarations.
 *
 *   bench_time.c    clocks (rdtsc or clock_gettime, calibrated), medians, percentiles, machine
 *   bench_fast.c    fast path: alloc+free pairs of one size; primitive costs (clock, mutex)
 *   bench_replay.c  trace replays: throughput, per-operation latency, 1 and 2 threads
 *   bench_peer.c    host allocators in child processes (LD_PRELOAD), rows over a pipe
 *   bench_release.c how soon idle memory goes back: release delay, trim, max_cached, ledger
 *   bench_pacing.c  pacing on the real clock: page moves a pass with and without it
 *   bench_report.c  rows: the table and the JSON lines
 *   cuma_bench.c    options, the order of the measurements, profile modes
 */
#ifndef CUMA_BENCH_H
#define CUMA_BENCH_H

#include "cuma/cuma.h"
#include "trace/trace.h"

#include <math.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <time.h>

#if defined(__x86_64__) || defined(__i386__)
#include <x86intrin.h>
#define BENCH_HAVE_TSC 1
#else
#define BENCH_HAVE_TSC 0
#endif

/* ---- options ------------------------------------------------------------------------------ */

#define BENCH_COST    1u
#define BENCH_FAST    2u
#define BENCH_REPLAY  4u /* replay, latency and scaling */
#define BENCH_RELEASE 8u
#define BENCH_PACING  16u

typedef struct bench_opts {
    int runs;          /* timed runs per figure; the median is reported */
    double run_ms;     /* target length of one timed run (fast path or replay) */
    size_t max_events; /* replay only the first N events of a trace (0 = all) */
    bool quick;        /* smoke mode: tiny counts, one trace */
    bool json;         /* one JSON object per row instead of the table */
    bool peers;        /* run the host allocators too */
    unsigned only;     /* BENCH_COST | ... | BENCH_PACING: sections to run */
    const char *conf;  /* appended to cuma's settings */
    char **traces;     /* trace paths */
    int ntraces;
} bench_opts;

/* ---- clocks (bench_time.c) ---------------------------------------------------------------- */

/* CLOCK_MONOTONIC in ns. */
static inline uint64_t bench_now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

/* The per-operation timer: rdtsc between load fences where the CPU has a constant TSC and it
 * is cheaper than clock_gettime, else clock_gettime. bench_timer_init picks one. */
typedef struct bench_timer {
    const char *name;     /* "rdtsc" or "clock_gettime" */
    double ns_per_tick;   /* 1 for clock_gettime */
    double overhead_ns;   /* median cost of one start/stop reading pair, subtracted */
    double other_ns;      /* the same for the timer not chosen (0 if none) */
    double resolution_ns; /* smallest step the timer was seen to make */
} bench_timer;

extern bench_timer bench_tm;
extern int bench_use_tsc;

static inline uint64_t bench_ticks(void) {
#if BENCH_HAVE_TSC
    if (bench_use_tsc) {
        _mm_lfence();
        uint64_t t = __rdtsc();
        _mm_lfence();
        return t;
    }
#endif
    return bench_now_ns();
}

void bench_timer_init(void);

/* Median of n doubles (sorts v). NAN for n == 0. */
double bench_median(double *v, int n);
/* Nearest-rank quantile q in [0, 1] of n doubles (sorts v): the smallest value with at least
 * q of them at or below it. NAN for n == 0. */
double bench_quantile(double *v, int n, double q);

/* Latency percentiles of n tick samples (sorts s), in ns with the timer overhead taken off. */
typedef struct bench_pct {
    double p50, p99, p999;
} bench_pct;
bench_pct bench_percentiles(uint32_t *s, size_t n);

/* "nproc=.. cpu=.." facts for the first line. */
int bench_nproc(void);
void bench_cpu_model(char *buf, size_t len);

/* CPU time of the calling thread in ns (a system call: only around whole runs). */
static inline uint64_t bench_cpu_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

/* One thread's timed part: wall and CPU time at its start and end. CPU time leaves out the
 * time the thread was not running (other work on a loaded machine, waits for a lock). */
typedef struct bench_span {
    uint64_t wall0, wall1, cpu0, cpu1;
} bench_span;

static inline void bench_span_begin(bench_span *s) {
    s->cpu0 = bench_cpu_ns();
    s->wall0 = bench_now_ns();
}

static inline void bench_span_end(bench_span *s) {
    s->wall1 = bench_now_ns();
    s->cpu1 = bench_cpu_ns();
}

/* Runs fn(arg, i, span_i) on n threads (n <= 8) released together: the calling thread is
 * thread 0, the others are workers kept for the next runs. wall_ns: from the first thread's
 * start to the last one's end; cpu_ns: the threads' CPU times added up. */
typedef void (*bench_thread_fn)(void *arg, int index, bench_span *span);
typedef struct bench_time {
    double wall_ns, cpu_ns;
} bench_time;
bench_time bench_run_threads(int n, bench_thread_fn fn, void *arg);
/* Ends the workers (before exit, so that nothing is left running). */
void bench_threads_stop(void);

/* Keeps the compiler from dropping an unused malloc/free pair. */
static inline void bench_escape(void *p) {
    __asm__ volatile("" : : "r"(p) : "memory");
}

/* ---- rows (bench_report.c) ---------------------------------------------------------------- */

typedef struct bench_row {
    char section[12]; /* cost, fast, replay, latency, scaling, release */
    char name[48];    /* the case: "4 KiB", "resnet_train x1" */
    char alloc[32];   /* cuma, glibc, mimalloc, jemalloc (or a primitive's name) */
    int threads;
    double ns_per_op; /* wall ns / operations over all threads (inverse throughput) */
    double cpu_ns;    /* CPU ns of all threads / operations */
    double ops_per_s;
    double p50, p99, p999;
    double max;      /* largest sample (release rows, where rounds are few) */
    double scale_2t; /* scaling: 2-thread throughput / 1-thread throughput */
    double vs_mim;   /* ns_per_op over mimalloc's, median over paired runs (NAN: from medians) */
    char note[96];
} bench_row;

/* A row with every figure NAN. */
bench_row bench_row_make(const char *section, const char *name, const char *alloc, int threads);
void bench_row_add(const bench_row *r);
size_t bench_row_count(void);
const bench_row *bench_row_get(size_t i);
void bench_rows_free(void);

/* Prints the machine line and every row, as a table or as JSON lines. */
void bench_report(const char *machine_json, const char *machine_text, bool json);

/* Writes a row as one tab-separated line / parses one back (peer pipe). */
void bench_row_write(int fd, const bench_row *r);
bool bench_row_parse(char *line, bench_row *r);

/* bench_pacing.c: paced and unpaced replay rows (real clock, 20 us page calls). */
void bench_pacing(const bench_opts *o);

/* ---- measurements -------------------------------------------------------------------------- */

/* A heap on the bench's settings (cuma_bench.c): the simulated device on a manual clock, then
 * `extra` (later keys win: "sim_clock:real" gives the real one), then --conf. The first
 * exits naming the settings when the heap cannot be made; the second returns the status. */
cuma_heap *bench_heap(const bench_opts *o, const char *extra);
cuma_status bench_heap_try(const bench_opts *o, const char *extra, cuma_heap **out);

/* An allocator under test: cuma on a heap, or the process's malloc. */
typedef struct bench_target {
    const char *name; /* row label */
    cuma_heap *heap;  /* NULL: malloc/free */
} bench_target;

extern const size_t bench_fast_sizes[];
extern const int bench_nfast_sizes;
void bench_size_name(size_t size, char *buf, size_t len);

/* bench_fast.c: fast-path rows for every size, 1 and 2 threads. */
void bench_fast(const bench_opts *o, const bench_target *t);
/* One fast-path row (used for the extra cuma configurations). */
void bench_fast_one(const bench_opts *o, const bench_target *t, size_t size, int threads,
                    const char *note);
/* The primitives the heap's hot path is built of: clock_gettime, a mutex pair. */
void bench_costs(const bench_opts *o);
/* Exactly n pairs, untimed (profile mode). Returns failed calls. */
uint64_t bench_fast_pairs(const bench_target *t, size_t size, uint64_t n);

/* bench_replay.c: one trace turned into a flat operation list. */
typedef struct bench_op {
    uint64_t size;   /* bytes for an alloc; 0 marks a free */
    uint32_t slot;   /* the allocation's slot in the pointer table */
    uint32_t stream; /* the trace's stream (cuma only) */
} bench_op;

typedef struct bench_ops {
    char name[40]; /* the trace's base name without .csv.gz */
    bench_op *op;
    size_t n, nslots, nallocs;
} bench_ops;

int bench_ops_load(const char *path, size_t max_events, bench_ops *out);
void bench_ops_free(bench_ops *ops);

/* Replay, latency and scaling rows of one trace; scale multiplies every size. */
void bench_replay(const bench_opts *o, const bench_target *t, const bench_ops *ops, uint64_t scale);
/* The same, run by run, so that several allocators (cuma here, the peers in their children)
 * take turns: run r of each before run r + 1 of any, and a ratio between two allocators is
 * the median of per-run ratios, which a slow spell of a shared machine moves far less than a
 * ratio of medians measured minutes apart. begin: buffers and warm-up; step: one 1-thread
 * replay and one 2-thread replay (ns per operation, wall and CPU); end: the rows (vs_mim and
 * vs_mim_2t: paired ratios to mimalloc, or NAN) and the latency runs. */
typedef struct bench_replay_run {
    double v, cpu, v2, cpu2;
} bench_replay_run;
typedef struct bench_replay_state bench_replay_state;
bench_replay_state *bench_replay_begin(const bench_opts *o, const bench_target *t,
                                       const bench_ops *ops, uint64_t scale);
bench_replay_run bench_replay_step(bench_replay_state *s);
void bench_replay_end(bench_replay_state *s, double vs_mim, double vs_mim_2t);
/* Exactly `reps` replays after one warm-up, the sizes times `scale`, untimed (profile mode).
 * Returns failed calls. */
uint64_t bench_replay_reps(const bench_target *t, const bench_ops *ops, int reps, uint64_t scale);

/* bench_release.c: how soon idle memory goes back to the device (release rows). */
void bench_release(const bench_opts *o);

/* bench_peer.c: the host allocators ("glibc", "mimalloc", "jemalloc"), each measured in a
 * child process (the same program re-executed, with LD_PRELOAD for mimalloc and jemalloc).
 * job is "fast" or a trace path; trace_name (NULL for "fast") names the rows. A peer that
 * cannot run still gets its rows, with a note that says why. */
extern const char *const bench_peers[];
extern const int bench_npeers;
void bench_peer_run(const bench_opts *o, const char *peer, const char *job, const char *trace_name);
/* A peer replaying a trace in step with the parent: start spawns the child, which loads the
 * trace, warms up and waits; each step has it run one bench_replay_step (false when it could
 * not); finish has it measure latencies and send its rows, which are added with the paired
 * ratios given (NAN if none). */
typedef struct bench_peer_proc {
    int pi, pid, ctl, res; /* res: the child's rows and runs; ctl: the parent's commands */
    void *in;              /* FILE * over res */
    char lib[4096], why[96], info[160];
} bench_peer_proc;
void bench_peer_start(const bench_opts *o, const char *peer, const char *job, bench_peer_proc *p);
bool bench_peer_step(bench_peer_proc *p, bench_replay_run *out);
void bench_peer_finish(bench_peer_proc *p, const char *trace_name, double vs_mim, double vs_mim_2t);
/* The child's side: measures `job` with the process's malloc and writes rows to fd. */
int bench_peer_child(const bench_opts *o, const char *peer, const char *job, int fd, int ctl);
/* What each peer turned out to be ("mimalloc 2.0.9 (/usr/lib/...)"), "; "-separated. */
const char *bench_peer_summary(void);
/* The file of the library that provides malloc in this process ("libc.so.6"). */
const char *bench_malloc_provider(void);

#endif
