// SPDX-License-Identifier: Apache-2.0
/* Clocks, medians, percentiles, threads and the machine's description. */
#include "bench.h"

#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

bench_timer bench_tm = {"clock_gettime", 1.0, 0.0, 0.0, 0.0};
int bench_use_tsc = 0;

static int cmp_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

static int cmp_u32(const void *a, const void *b) {
    uint32_t x = *(const uint32_t *)a, y = *(const uint32_t *)b;
    return (x > y) - (x < y);
}

double bench_median(double *v, int n) {
    if (n <= 0) return NAN;
    qsort(v, (size_t)n, sizeof *v, cmp_double);
    return n % 2 ? v[n / 2] : (v[n / 2 - 1] + v[n / 2]) / 2;
}

double bench_quantile(double *v, int n, double q) {
    if (n <= 0) return NAN;
    qsort(v, (size_t)n, sizeof *v, cmp_double);
    int k = (int)ceil(q * (double)n);
    return v[(k < 1 ? 1 : k > n ? n : k) - 1];
}

/* Median cost in ticks of a start/stop pair of readings with nothing between them. */
static double pair_overhead_ticks(void) {
    enum { N = 20001 };
    static double d[N];
    for (int i = 0; i < N; i++) {
        uint64_t a = bench_ticks();
        uint64_t b = bench_ticks();
        d[i] = (double)(b - a);
    }
    return bench_median(d, N);
}

/* The timer's resolution: the smallest non-zero step between two plain back-to-back readings
 * (an upper bound where one reading costs more than a step). */
static double step_ticks(bool tsc) {
    uint64_t best = UINT64_MAX;
    for (int i = 0; i < 100000; i++) {
        uint64_t a, b;
#if BENCH_HAVE_TSC
        if (tsc) {
            a = __rdtsc();
            b = __rdtsc();
        } else
#endif
        {
            (void)tsc;
            a = bench_now_ns();
            b = bench_now_ns();
        }
        if (b > a && b - a < best) best = b - a;
    }
    return (double)best;
}

#if BENCH_HAVE_TSC
/* TSC ticks per ns against CLOCK_MONOTONIC over about 20 ms. */
static double tsc_ns_per_tick(void) {
    uint64_t c0 = __rdtsc(), t0 = bench_now_ns(), t1, c1;
    do {
        t1 = bench_now_ns();
        c1 = __rdtsc();
    } while (t1 - t0 < 20000000ull);
    return (double)(t1 - t0) / (double)(c1 - c0);
}

/* The TSC counts time (not cycles) only where the CPU says it is constant and non-stop. */
static bool tsc_invariant(void) {
    FILE *f = fopen("/proc/cpuinfo", "r");
    if (!f) return false;
    char line[4096];
    bool found = false;
    while (!found && fgets(line, sizeof line, f))
        if (!strncmp(line, "flags", 5))
            found = strstr(line, " constant_tsc") && strstr(line, " nonstop_tsc");
    fclose(f);
    return found;
}
#endif

void bench_timer_init(void) {
    bench_use_tsc = 0;
    double cg = pair_overhead_ticks();
    bench_tm = (bench_timer){"clock_gettime", 1.0, cg, 0.0, step_ticks(false)};
#if BENCH_HAVE_TSC
    if (!tsc_invariant()) return;
    double npt = tsc_ns_per_tick();
    bench_use_tsc = 1;
    double tsc = pair_overhead_ticks() * npt;
    if (tsc <= cg) {
        bench_tm = (bench_timer){"rdtsc", npt, tsc, cg, step_ticks(true) * npt};
    } else {
        bench_use_tsc = 0;
        bench_tm.other_ns = tsc;
    }
#endif
}

bench_pct bench_percentiles(uint32_t *s, size_t n) {
    bench_pct p = {NAN, NAN, NAN};
    if (!n) return p;
    qsort(s, n, sizeof *s, cmp_u32);
    double q[3] = {0.50, 0.99, 0.999}, out[3];
    for (int i = 0; i < 3; i++) {
        /* Nearest rank: the smallest sample with at least q of them at or below it. */
        size_t k = (size_t)ceil(q[i] * (double)n);
        if (k < 1) k = 1;
        double ns = (double)s[k - 1] * bench_tm.ns_per_tick - bench_tm.overhead_ns;
        out[i] = ns > 0 ? ns : 0;
    }
    p.p50 = out[0], p.p99 = out[1], p.p999 = out[2];
    return p;
}

int bench_nproc(void) {
    return (int)sysconf(_SC_NPROCESSORS_ONLN);
}

void bench_cpu_model(char *buf, size_t len) {
    snprintf(buf, len, "unknown");
    FILE *f = fopen("/proc/cpuinfo", "r");
    if (!f) return;
    char line[512];
    while (fgets(line, sizeof line, f)) {
        if (strncmp(line, "model name", 10)) continue;
        char *v = strchr(line, ':');
        if (!v) break;
        v++;
        while (*v == ' ' || *v == '\t') v++;
        v[strcspn(v, "\n")] = 0;
        snprintf(buf, len, "%s", v);
        break;
    }
    fclose(f);
}

/* ---- threads ------------------------------------------------------------------------------ */

/* Worker threads live across runs, so per-thread allocator state (cuma's thread caches,
 * mimalloc's and jemalloc's thread heaps) warms up once, as in a program's long-lived threads.
 * Worker i-1 is thread i of a run; the calling thread is thread 0. */
enum { MAXT = 8 };

static struct {
    pthread_mutex_t m;
    pthread_cond_t go, done;
    pthread_t th[MAXT];
    int nworkers; /* started so far */
    uint64_t job; /* bumped for each run */
    int want;     /* workers taking part in this run */
    int pending;  /* of those, still running */
    bool stop;
    bench_thread_fn fn;
    void *arg;
    pthread_barrier_t *start;
    bench_span span[MAXT];
} pool = {.m = PTHREAD_MUTEX_INITIALIZER,
          .go = PTHREAD_COND_INITIALIZER,
          .done = PTHREAD_COND_INITIALIZER};

static void *worker(void *p) {
    int index = (int)(intptr_t)p; /* 1.. */
    uint64_t seen = 0;
    pthread_mutex_lock(&pool.m);
    for (;;) {
        while (!pool.stop && (pool.job == seen || index > pool.want)) {
            if (pool.job != seen)
                seen = pool.job; /* a run without this worker */
            else
                pthread_cond_wait(&pool.go, &pool.m);
        }
        if (pool.stop) break;
        seen = pool.job;
        bench_thread_fn fn = pool.fn;
        void *arg = pool.arg;
        pthread_barrier_t *start = pool.start;
        pthread_mutex_unlock(&pool.m);
        pthread_barrier_wait(start);
        fn(arg, index, &pool.span[index]);
        pthread_mutex_lock(&pool.m);
        if (--pool.pending == 0) pthread_cond_signal(&pool.done);
    }
    pthread_mutex_unlock(&pool.m);
    return NULL;
}

bench_time bench_run_threads(int n, bench_thread_fn fn, void *arg) {
    if (n < 1) n = 1;
    if (n > MAXT) n = MAXT;
    pthread_barrier_t start;
    pthread_barrier_init(&start, NULL, (unsigned)n);
    pthread_mutex_lock(&pool.m);
    while (pool.nworkers < n - 1) {
        if (pthread_create(&pool.th[pool.nworkers], NULL, worker,
                           (void *)(intptr_t)(pool.nworkers + 1))) {
            fprintf(stderr, "cuma-bench: cannot start a thread\n");
            exit(1);
        }
        pool.nworkers++;
    }
    pool.fn = fn, pool.arg = arg, pool.start = &start;
    pool.want = pool.pending = n - 1;
    pool.job++;
    pthread_cond_broadcast(&pool.go);
    pthread_mutex_unlock(&pool.m);
    pthread_barrier_wait(&start);
    fn(arg, 0, &pool.span[0]);
    pthread_mutex_lock(&pool.m);
    while (pool.pending) pthread_cond_wait(&pool.done, &pool.m);
    pthread_mutex_unlock(&pool.m);
    pthread_barrier_destroy(&start);
    uint64_t s = pool.span[0].wall0, e = pool.span[0].wall1, cpu = 0;
    for (int i = 0; i < n; i++) {
        if (pool.span[i].wall0 < s) s = pool.span[i].wall0;
        if (pool.span[i].wall1 > e) e = pool.span[i].wall1;
        cpu += pool.span[i].cpu1 - pool.span[i].cpu0;
    }
    return (bench_time){(double)(e - s), (double)cpu};
}

void bench_threads_stop(void) {
    pthread_mutex_lock(&pool.m);
    pool.stop = true;
    pthread_cond_broadcast(&pool.go);
    pthread_mutex_unlock(&pool.m);
    for (int i = 0; i < pool.nworkers; i++) pthread_join(pool.th[i], NULL);
    pool.nworkers = 0;
    pool.stop = false;
}
