// SPDX-License-Identifier: Apache-2.0
/* nvtx:on marks the slow paths as NVTX ranges (src/util/marks.h), nvtx:off makes no NVTX call.
 * Run with NVTX_INJECTION64_PATH naming tests/nvtx/inject.c's library and CUMA_NVTX_LOG the file
 * it records to (CMake sets both). The same work runs on a simulated heap twice: with nvtx:off
 * the injection is never even loaded (no log file: NVTX loads it at its first call); with
 * nvtx:on the log holds the ranges, which must nest: every push popped on its thread, the
 * ladder's rungs inside "oom" in the ladder's order, the release thread's passes and its answers
 * to the ledger on its own thread.
 *
 * `test_nvtx missing`: for a libcuma built without the nvtx3 headers, nvtx:on is refused with
 * an error that says why. */
#include "check.h"
#include "cuma/cuma.h"
#include "cuma/ledger.h"
#include "cuma/sim.h"

#include <fcntl.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#define MB (1024ull * 1024)
#define S1 ((cuma_stream)(uintptr_t)1)

static char ledger_name[64];

/* The OOM callback frees the block it is given, once, and asks for a retry. */
static int free_held(void *user, cuma_heap *h, size_t size, cuma_stream stream) {
    (void)size, (void)stream;
    void **held = user;
    if (!*held) return 0;
    CHECK_OK(cuma_free(h, *held, S1));
    *held = NULL;
    return CUMA_OOM_RETRY;
}

/* Page calls, a trim that waits for a fence, an OOM the callback recovers from (after the cache
 * and the ledger rungs), an OOM only managed memory serves. */
static void work(const char *nvtx) {
    char conf[512];
    snprintf(conf, sizeof conf,
             "backend:sim,capacity:64M,page_size:2M,sim_clock:manual,sim_lag_ms:5,tcache:off,"
             "arenas:1,managed_fallback:on,release_delay_ms:100000,ledger:%s,"
             "pressure_timeout_ms:10,nvtx:%s",
             ledger_name, nvtx);
    cuma_heap *h = heap_make(conf);
    void *p = NULL, *held = NULL, *q = NULL;
    CHECK_OK(cuma_alloc(h, 8 * MB, S1, &p));
    CHECK_OK(cuma_free(h, p, S1));
    CHECK_OK(cuma_trim(h, 0)); /* the device is 5 ms behind: the trim waits for the free's work */
    CHECK(heap_stats(h).reserved_bytes == 0);

    int id;
    CHECK_OK(cuma_add_oom_callback(h, free_held, &held, &id));
    CHECK_OK(cuma_alloc(h, 40 * MB, S1, &held));
    CHECK_OK(cuma_alloc(h, 40 * MB, S1, &q)); /* fits once the callback freed `held` */
    CHECK(!held);
    CHECK_OK(cuma_free(h, q, S1));
    CHECK_OK(cuma_alloc(h, 100 * MB, S1, &q)); /* more than the device: managed memory */
    CHECK(heap_stats(h).managed_bytes >= 100 * MB);
    CHECK_OK(cuma_free(h, q, S1));
    cuma_heap_destroy(h);
}

/* Segment mode (a device without virtual memory management): a segment made, then freed by a
 * trim. */
static void segments(void) {
    cuma_heap *h = heap_make("backend:sim,capacity:64M,sim_segments:on,sim_clock:manual,tcache:off,"
                             "arenas:1,nvtx:on");
    void *p;
    CHECK_OK(cuma_alloc(h, 8 * MB, NULL, &p));
    CHECK_OK(cuma_free(h, p, NULL));
    CHECK_OK(cuma_trim(h, 0));
    CHECK(heap_stats(h).reserved_bytes == 0);
    cuma_heap_destroy(h);
}

/* The release thread gives an idle page back on a real clock: its pass is a range on its own
 * thread. Waits (at most 30 s) until the log shows one. */
static void release_thread_pass(const char *log) {
    cuma_heap *h = heap_make("backend:sim,capacity:64M,page_size:2M,release_delay_ms:0,tcache:off,"
                             "arenas:1,nvtx:on");
    void *p;
    CHECK_OK(cuma_alloc(h, 4 * MB, NULL, &p));
    CHECK_OK(cuma_free(h, p, NULL));
    bool seen = false;
    for (int i = 0; i < 3000 && !seen; i++) {
        FILE *f = fopen(log, "r");
        CHECK(f);
        char line[256];
        while (fgets(line, sizeof line, f))
            if (strstr(line, " cuma release pass\n")) seen = true;
        fclose(f);
        if (!seen) nanosleep(&(struct timespec){0, 10000000}, NULL);
    }
    CHECK(seen);
    cuma_heap_destroy(h);
}

/* Two heaps in one ledger: b's allocation needs what a holds idle; b's ladder asks (the ledger
 * rung), a's release thread answers on its own thread. Waits (at most 5 s) until a has published
 * its idle bytes, which b must see to ask. */
static void ledger_answer(void) {
    char conf[512];
    snprintf(conf, sizeof conf,
             "backend:sim,capacity:64M,page_size:2M,ledger:%s,release_delay_ms:100000,tcache:off,"
             "arenas:1,pressure_timeout_ms:5000,nvtx:on",
             ledger_name);
    cuma_heap *a = heap_make(conf), *b = heap_make(conf);
    void *pa, *pb;
    CHECK_OK(cuma_alloc(a, 48 * MB, NULL, &pa));
    CHECK_OK(cuma_free(a, pa, NULL));
    bool published = false;
    for (int i = 0; i < 5000 && !published; i++) {
        cuma_ledger_entry e[8];
        size_t n = 0;
        CHECK_OK(cuma_ledger_snapshot(ledger_name, e, 8, &n));
        for (size_t k = 0; k < n && k < 8; k++)
            if (e[k].pid == getpid() && e[k].cached == 48 * MB) published = true;
        if (!published) usleep(1000);
    }
    CHECK(published);
    CHECK_OK(cuma_alloc(b, 32 * MB, NULL, &pb));
    CHECK(heap_stats(b).pressure_asks == 1 && heap_stats(a).pressure_given_bytes >= 16 * MB);
    CHECK_OK(cuma_free(b, pb, NULL));
    cuma_heap_destroy(a);
    cuma_heap_destroy(b);
}

/* ---- the log ---------------------------------------------------------------------------- */

#define MAX_THREADS 8
#define MAX_DEPTH   16

typedef struct thread_stack {
    long tid;
    int n;
    char names[MAX_DEPTH][64];
    int rung; /* innermost "oom": rank of the last rung seen inside it */
} thread_stack;

static const char *const wanted[] = {
    "page create", "page map",      "page unmap",    "page release", "release",    "release pass",
    "trim",        "fence wait",    "oom",           "oom cache",    "oom ledger", "oom callbacks",
    "oom managed", "ledger answer", "segment alloc", "segment free",
};
#define NWANTED (sizeof wanted / sizeof wanted[0])

/* The ladder's order; 0 for names that are no rung. */
static int rung_rank(const char *name) {
    static const char *const rungs[] = {"oom cache", "oom arenas", "oom ledger", "oom callbacks",
                                        "oom managed"};
    for (int i = 0; i < 5; i++)
        if (!strcmp(name, rungs[i])) return i + 1;
    return 0;
}

static thread_stack *stack_of(thread_stack *ts, int *nts, long tid) {
    for (int i = 0; i < *nts; i++)
        if (ts[i].tid == tid) return &ts[i];
    CHECK(*nts < MAX_THREADS);
    ts[*nts] = (thread_stack){.tid = tid};
    return &ts[(*nts)++];
}

static bool under(const thread_stack *s, const char *name) {
    for (int i = 0; i < s->n; i++)
        if (!strcmp(s->names[i], name)) return true;
    return false;
}

static void check_log(const char *log, long main_tid) {
    FILE *f = fopen(log, "r");
    CHECK(f);
    thread_stack ts[MAX_THREADS];
    int nts = 0;
    bool seen[NWANTED] = {0}, domain = false, trim_released = false, pass_elsewhere = false,
         release_pages = false;
    int lines = 0, pushes = 0, pops = 0;
    char line[256];
    while (fgets(line, sizeof line, f)) {
        line[strcspn(line, "\n")] = 0;
        if (!lines++) {
            CHECK(!strcmp(line, "init"));
            continue;
        }
        if (!strncmp(line, "domain ", 7)) {
            CHECK(!strcmp(line, "domain cuma"));
            domain = true;
            continue;
        }
        long tid;
        int depth, at = 0;
        char dom[64];
        if (sscanf(line, "push %ld %d %63s %n", &tid, &depth, dom, &at) == 3 && at) {
            const char *name = line + at;
            thread_stack *s = stack_of(ts, &nts, tid);
            if (strcmp(dom, "cuma") || depth != s->n || s->n == MAX_DEPTH)
                fprintf(stderr, "bad push (thread depth %d): %s\n", s->n, line);
            CHECK(!strcmp(dom, "cuma") && depth == s->n && s->n < MAX_DEPTH);
            const char *parent = s->n ? s->names[s->n - 1] : "";
            int rank = rung_rank(name);
            /* A rung sits right inside "oom", after the rungs before it. */
            if (rank) {
                if (strcmp(parent, "oom") || rank <= s->rung)
                    fprintf(stderr, "rung out of place (in '%s', after rung %d): %s\n", parent,
                            s->rung, line);
                CHECK(!strcmp(parent, "oom") && rank > s->rung);
                s->rung = rank;
            }
            /* An OOM nests only in an OOM callback's allocation. */
            if (!strcmp(name, "oom")) {
                CHECK(!*parent || !strcmp(parent, "oom callbacks"));
                s->rung = 0;
            }
            if (!strcmp(name, "page release") && under(s, "release")) release_pages = true;
            if (!strcmp(name, "segment free")) CHECK(under(s, "release"));
            if (!strcmp(name, "release") && !strcmp(parent, "trim")) trim_released = true;
            if (!strcmp(name, "ledger answer")) CHECK(s->n == 0 && tid != main_tid);
            if (!strcmp(name, "release pass")) {
                CHECK(s->n == 0);
                if (tid != main_tid) pass_elsewhere = true;
            }
            snprintf(s->names[s->n++], sizeof s->names[0], "%s", name);
            for (size_t i = 0; i < NWANTED; i++)
                if (!strcmp(name, wanted[i])) seen[i] = true;
            pushes++;
        } else if (sscanf(line, "pop %ld %d %63s", &tid, &depth, dom) == 3) {
            thread_stack *s = stack_of(ts, &nts, tid);
            if (depth != s->n - 1) fprintf(stderr, "bad pop (thread depth %d): %s\n", s->n, line);
            CHECK(!strcmp(dom, "cuma") && s->n > 0 && depth == s->n - 1);
            s->n--;
            pops++;
        } else {
            fprintf(stderr, "unexpected log line: %s\n", line);
            CHECK(0);
        }
    }
    fclose(f);
    for (int i = 0; i < nts; i++) {
        if (ts[i].n) fprintf(stderr, "thread %ld left %d ranges open\n", ts[i].tid, ts[i].n);
        CHECK(ts[i].n == 0);
    }
    for (size_t i = 0; i < NWANTED; i++) {
        if (!seen[i]) fprintf(stderr, "no '%s' range in %s\n", wanted[i], log);
        CHECK(seen[i]);
    }
    CHECK(domain && trim_released && pass_elsewhere && release_pages);
    CHECK(pushes == pops);
    printf("test_nvtx: %d ranges on %d threads, nested right\n", pushes, nts);
}

static void unlink_ledger(void) {
    char path[128];
    CHECK_OK(cuma_ledger_path(ledger_name, path, sizeof path));
    if (!strncmp(path, "/dev/shm/", 9)) shm_unlink(path + strlen("/dev/shm"));
}

int main(int argc, char **argv) {
    if (argc > 1 && !strcmp(argv[1], "missing")) {
        CHECK_ST(cuma_config_check("nvtx:on"), CUMA_ERR_CONFIG);
        CHECK(strstr(cuma_last_error(), "nvtx:on") &&
              strstr(cuma_last_error(), "built without NVTX"));
        cuma_config cfg = {.conf = "backend:sim,capacity:64M,nvtx:on", .flags = CUMA_CONFIG_NO_ENV};
        cuma_heap *h = NULL;
        CHECK_ST(cuma_heap_create(&cfg, &h), CUMA_ERR_CONFIG);
        CHECK_OK(cuma_config_check("nvtx:off"));
        printf("test_nvtx missing: nvtx:on refused: %s\n", cuma_last_error());
        return 0;
    }
    const char *log = getenv("CUMA_NVTX_LOG");
    CHECK(log && *log && getenv("NVTX_INJECTION64_PATH"));
    unlink(log);
    snprintf(ledger_name, sizeof ledger_name, "nvtx-test-%d", (int)getpid());

    work("off");
    CHECK(access(log, F_OK) != 0); /* no NVTX call: the injection was never loaded */

    work("on");
    CHECK(access(log, F_OK) == 0);
    segments();
    release_thread_pass(log);
    ledger_answer();
    unlink_ledger();
    check_log(log, (long)syscall(SYS_gettid));
    return 0;
}
