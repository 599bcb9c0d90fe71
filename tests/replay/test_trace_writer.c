// SPDX-License-Identifier: Apache-2.0
/* The `trace` setting: a heap logs every allocation, failed allocation and free in RMM's CSV
 * format, plain or gzip, from several threads, and the reader (and so `cuma replay`) reads it
 * back: every free matched to its allocation with the same size, failures as `allocate
 * failure`, times in order. A path that cannot be created costs the log, not the heap: its stats
 * name the file and the cause.
 * A log is never written by two heaps or processes at once, nor overwritten by a later heap of
 * the same process (a numbered name instead); %p and %d name the process and the device.
 *
 *   test_trace_writer DIR   (a writable folder for the logs) */
#include "check.h"
#include "cuma/cuma.h"
#include "trace/trace.h"

#include <fcntl.h>
#include <pthread.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <sys/file.h>
#include <sys/wait.h>
#include <unistd.h>

#define NTHREADS 3
#define NOPS     2000

typedef struct worker {
    cuma_heap *h;
    unsigned long long seed;
    uint64_t allocs, frees;
} worker;

static void *churn(void *arg) {
    worker *w = arg;
    void *live[16] = {0};
    cuma_stream s = (cuma_stream)(uintptr_t)(0x100 * (w->seed % 3));
    for (int i = 0; i < NOPS; i++) {
        int k = (int)(rnd(&w->seed) % 16);
        if (live[k]) {
            CHECK_OK(cuma_free(w->h, live[k], s));
            live[k] = NULL;
            w->frees++;
        } else {
            size_t size = 1 + rnd(&w->seed) % (rnd(&w->seed) % 8 ? 65536 : 8 << 20);
            CHECK_OK(cuma_alloc(w->h, size, s, &live[k]));
            w->allocs++;
        }
    }
    for (int k = 0; k < 16; k++) {
        if (!live[k]) continue;
        CHECK_OK(cuma_free(w->h, live[k], s));
        w->frees++;
    }
    return NULL;
}

static const char *stats_text(cuma_heap *h) {
    static char buf[16384];
    CHECK_OK(cuma_stats_json(h, buf, sizeof buf, NULL));
    return buf;
}

static void run(const char *path) {
    char conf[512];
    snprintf(conf, sizeof conf, "backend:sim,capacity:1G,limit:256M,trace:%s", path);
    cuma_config cfg = {.conf = conf, .flags = CUMA_CONFIG_NO_ENV};
    cuma_heap *h;
    CHECK_OK(cuma_heap_create(&cfg, &h));
    char json[4096];
    CHECK_OK(cuma_stats_json(h, json, sizeof json, NULL));
    CHECK(strstr(json, "\"tcache\":false") && strstr(json, path)); /* off while tracing */
    unsigned long long seed = test_seed();
    worker w[NTHREADS];
    pthread_t t[NTHREADS];
    for (int i = 0; i < NTHREADS; i++) {
        w[i] = (worker){h, seed + (unsigned long long)i, 0, 0};
        CHECK(pthread_create(&t[i], NULL, churn, &w[i]) == 0);
    }
    uint64_t allocs = 0, frees = 0;
    for (int i = 0; i < NTHREADS; i++) {
        CHECK(pthread_join(t[i], NULL) == 0);
        allocs += w[i].allocs, frees += w[i].frees;
    }
    void *p = NULL;
    CHECK_ST(cuma_alloc(h, 300u << 20, NULL, &p), CUMA_ERR_LIMIT); /* over the limit: logged */
    cuma_heap_destroy(h);

    cuma_trace tr;
    CHECK_OK(cuma_trace_load(path, &tr));
    uint64_t na = 0, nf = 0, nfail = 0, last_t = 0;
    unsigned threads[8] = {0}, nthreads = 0;
    for (size_t i = 0; i < tr.n; i++) {
        const cuma_trace_event *e = &tr.ev[i];
        CHECK(e->time_us >= last_t);
        last_t = e->time_us;
        bool seen = false;
        for (unsigned k = 0; k < nthreads; k++) seen |= threads[k] == e->thread;
        if (!seen && nthreads < 8) threads[nthreads++] = e->thread;
        if (e->action == CUMA_TRACE_ALLOC) {
            na++;
            CHECK(e->match >= 0 && e->ptr != 0); /* everything was freed */
        } else if (e->action == CUMA_TRACE_FREE) {
            nf++;
            CHECK(e->match >= 0 && tr.ev[e->match].size == e->size);
            CHECK(tr.ev[e->match].stream == e->stream);
        } else {
            nfail++;
            CHECK(e->size == 300u << 20 && e->ptr == 0);
        }
    }
    CHECK(na == allocs && nf == frees && nfail == 1 && tr.unmatched_frees == 0);
    CHECK(nthreads == NTHREADS + 1); /* the workers and the main thread's failed allocation */
    printf("%s: %zu events, %u threads\n", path, tr.n, nthreads);
    cuma_trace_free(&tr);
}

/* The file h logs to, from its stats. */
static void logged_to(cuma_heap *h, char *out, size_t len) {
    char json[8192];
    CHECK_OK(cuma_stats_json(h, json, sizeof json, NULL));
    const char *t = strstr(json, "\"trace\":\"");
    CHECK(t);
    t += strlen("\"trace\":\"");
    size_t n = strcspn(t, "\"");
    CHECK(n < len);
    snprintf(out, len, "%.*s", (int)n, t);
}

static cuma_heap *logging_heap(const char *pattern, const char *extra) {
    char conf[600];
    snprintf(conf, sizeof conf, "backend:sim,capacity:1G,trace:%s%s", pattern, extra);
    return heap_make(conf);
}

/* One allocation and its free, then the heap goes: the log must hold exactly these. */
static void log_one(cuma_heap *h, size_t size, const char *file) {
    void *p;
    CHECK_OK(cuma_alloc(h, size, NULL, &p));
    CHECK_OK(cuma_free(h, p, NULL));
    cuma_heap_destroy(h);
    cuma_trace tr;
    CHECK_OK(cuma_trace_load(file, &tr));
    CHECK(tr.n == 2 && tr.ev[0].size == size && tr.ev[1].action == CUMA_TRACE_FREE);
    cuma_trace_free(&tr);
}

static void names(const char *dir) {
    char pattern[512], want[600], got[600], got2[600];
    /* Two heaps of one process with one trace setting (a heap per device under the shim):
     * the second logs to NAME.1.csv.gz, and neither log has the other's events. */
    snprintf(pattern, sizeof pattern, "%s/shared.csv.gz", dir);
    cuma_heap *a = logging_heap(pattern, ""), *b = logging_heap(pattern, "");
    logged_to(a, got, sizeof got);
    logged_to(b, got2, sizeof got2);
    snprintf(want, sizeof want, "%s/shared.1.csv.gz", dir);
    CHECK(!strcmp(got, pattern) && !strcmp(got2, want));
    log_one(a, 1000, got);
    log_one(b, 2000, got2);
    /* A heap made later (after a reset under the shim) does not overwrite either log. */
    a = logging_heap(pattern, "");
    logged_to(a, got, sizeof got);
    snprintf(want, sizeof want, "%s/shared.2.csv.gz", dir);
    CHECK(!strcmp(got, want));
    log_one(a, 3000, got);

    /* Another process writing the file (its flock): a numbered name; the plain ending too. */
    snprintf(pattern, sizeof pattern, "%s/held.csv", dir);
    int fd = open(pattern, O_WRONLY | O_CREAT, 0644);
    CHECK(fd >= 0 && flock(fd, LOCK_EX) == 0);
    a = logging_heap(pattern, "");
    logged_to(a, got, sizeof got);
    snprintf(want, sizeof want, "%s/held.1.csv", dir);
    CHECK(!strcmp(got, want));
    log_one(a, 4000, got);
    close(fd);

    /* A forked child whose parent is logging to the same name logs to another one. */
    snprintf(pattern, sizeof pattern, "%s/forked.csv.gz", dir);
    a = logging_heap(pattern, "");
    pid_t pid = fork();
    CHECK(pid >= 0);
    if (pid == 0) {
        /* No release thread: ThreadSanitizer cannot follow a thread started after a fork. */
        cuma_heap *c = logging_heap(pattern, ",release_thread:off");
        logged_to(c, got, sizeof got);
        snprintf(want, sizeof want, "%s/forked.1.csv.gz", dir);
        CHECK(!strcmp(got, want));
        log_one(c, 5000, got);
        _exit(0);
    }
    int ws;
    CHECK(waitpid(pid, &ws, 0) == pid && WIFEXITED(ws) && WEXITSTATUS(ws) == 0);
    log_one(a, 6000, pattern);

    /* %p and %d: the process and the device; %% a '%'. */
    snprintf(pattern, sizeof pattern, "%s/p%%p-d%%d-%%%%.csv", dir);
    a = logging_heap(pattern, ",device:3");
    logged_to(a, got, sizeof got);
    snprintf(want, sizeof want, "%s/p%ld-d3-%%.csv", dir, (long)getpid());
    CHECK(!strcmp(got, want));
    log_one(a, 7000, got);
    CHECK(unlink(got) == 0); /* a new name each run */

    /* A name too long to number: the second heap gets no log, saying so (not overwriting). */
    char longname[256];
    int used = snprintf(longname, sizeof longname, "%s/", dir);
    CHECK(used > 0 && used < 200);
    memset(longname + used, 'x', 254 - (size_t)used - 4);
    snprintf(longname + 250, sizeof longname - 250, ".csv");
    CHECK(strlen(longname) == 254);
    a = logging_heap(longname, "");
    {
        char conf[600];
        snprintf(conf, sizeof conf, "backend:sim,capacity:1G,trace:%s", longname);
        cuma_config cfg = {.conf = conf, .flags = CUMA_CONFIG_NO_ENV};
        cuma_heap *h2 = NULL;
        CHECK_OK(cuma_heap_create(&cfg, &h2));
        CHECK(strstr(stats_text(h2), "\"trace_error\":\"trace ") &&
              strstr(stats_text(h2), "a numbered name would be longer"));
        cuma_heap_destroy(h2);
    }
    log_one(a, 8000, longname);
    CHECK(unlink(longname) == 0);

    /* Any other % sequence is a bad value, named. */
    const char *bad[] = {"trace:/tmp/x%s.csv", "trace:/tmp/x%", "trace:%P"};
    for (size_t i = 0; i < sizeof bad / sizeof *bad; i++) {
        char conf[128];
        snprintf(conf, sizeof conf, "backend:sim,%s", bad[i]);
        cuma_config cfg = {.conf = conf, .flags = CUMA_CONFIG_NO_ENV};
        cuma_heap *h = NULL;
        CHECK_ST(cuma_heap_create(&cfg, &h), CUMA_ERR_CONFIG);
        CHECK(h == NULL && strstr(cuma_last_error(), "'trace'"));
    }
    printf("names: shared, reset, held, forked, %%p/%%d and bad patterns as expected\n");
}

int main(int argc, char **argv) {
    if (argc != 2) {
        fprintf(stderr, "usage: test_trace_writer DIR\n");
        return 2;
    }
    char path[512];
    snprintf(path, sizeof path, "%s/trace_writer.csv", argv[1]);
    run(path);
    snprintf(path, sizeof path, "%s/trace_writer.csv.gz", argv[1]);
    run(path);
    names(argv[1]);
    /* A log that cannot be created: the heap works without it, and its stats name the file and
     * the cause (tests/unit/test_setting_files.c: the files it refuses). */
    cuma_config bad = {.conf = "backend:sim,trace:/nonexistent-dir/x.csv",
                       .flags = CUMA_CONFIG_NO_ENV};
    cuma_heap *h = NULL;
    CHECK_OK(cuma_heap_create(&bad, &h));
    const char *js = stats_text(h);
    CHECK(strstr(js, "\"trace_error\":\"trace /nonexistent-dir/x.csv: cannot create the log: "
                     "No such file or directory\""));
    CHECK(strstr(js, "\"trace\":null")); /* no log */
    void *p;
    CHECK_OK(cuma_alloc(h, 4096, NULL, &p));
    CHECK_OK(cuma_free(h, p, NULL));
    cuma_heap_destroy(h);
    printf("test_trace_writer: all passed\n");
    return 0;
}
