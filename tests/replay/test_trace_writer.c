/* The `trace` setting: a heap logs every allocation, failed allocation and free in RMM's CSV
 * format, plain or gzip, from several threads, and the reader (and so `cuma replay`) reads it
 * back: every free matched to its allocation with the same size, failures as `allocate
 * failure`, times in order. A path that cannot be created fails the heap's creation, naming it.
 *
 *   test_trace_writer DIR   (a writable folder for the logs) */
#include "check.h"
#include "cuma/cuma.h"
#include "trace/trace.h"

#include <pthread.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

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
    /* A log that cannot be created: the heap is not created, and the message names the file. */
    cuma_config bad = {.conf = "backend:sim,trace:/nonexistent-dir/x.csv",
                       .flags = CUMA_CONFIG_NO_ENV};
    cuma_heap *h = NULL;
    CHECK_ST(cuma_heap_create(&bad, &h), CUMA_ERR_IO);
    CHECK(h == NULL && strstr(cuma_last_error(), "/nonexistent-dir/x.csv"));
    printf("test_trace_writer: all passed\n");
    return 0;
}
