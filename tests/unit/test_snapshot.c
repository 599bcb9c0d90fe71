// SPDX-License-Identifier: Apache-2.0
/* cuma_snapshot_json: every figure against what the test allocated (sizes, addresses, streams,
 * arenas, the size buckets and the 32 largest in order), the totals against cuma_get_stats in
 * page mode, segment mode and the buddy, blocks in thread caches and blocks waiting on
 * record_stream fences kept apart from live ones, managed fallbacks, the buffer protocol, bad
 * arguments and a forked child whose heap is the parent's. oom_dump: the stats and snapshot at a
 * failure, in a file named by %p/%d, at most once in 10 s, the caller's error kept. */
#define _DEFAULT_SOURCE
#include "check.h"
#include "heap/heap.h"
#include "cuma/sim.h"

#include <stdarg.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#define MB (1024ull * 1024)

static char *snapshot(cuma_heap *h) {
    size_t need = 0;
    CHECK_ST(cuma_snapshot_json(h, NULL, 0, &need), CUMA_ERR_INVALID);
    char *buf = malloc(need + 1);
    CHECK(buf);
    size_t again = 0;
    CHECK_OK(cuma_snapshot_json(h, buf, need + 1, &again));
    CHECK(again == need && strlen(buf) == need);
    return buf;
}

/* The unsigned number right after `key` (which ends in ':'), searched from `from`. */
static uint64_t num_after(const char *from, const char *key) {
    const char *p = strstr(from, key);
    if (!p) fprintf(stderr, "no %s in %s\n", key, from);
    CHECK(p);
    char *end;
    uint64_t v = strtoull(p + strlen(key), &end, 10);
    CHECK(end != p + strlen(key));
    return v;
}

/* A figure of one section: num_after(the section's start, key). */
static uint64_t field(const char *json, const char *section, const char *key) {
    char sk[64], kk[64];
    snprintf(sk, sizeof sk, "\"%s\":{", section);
    snprintf(kk, sizeof kk, "\"%s\":", key);
    const char *s = strstr(json, sk);
    CHECK(s);
    return num_after(s, kk);
}

/* Structure only: brackets balance outside strings, strings close, one top-level object
 * (the Python tests parse it with json.loads). */
static void check_well_formed(const char *j) {
    int depth = 0, tops = 0;
    bool in_str = false;
    for (const char *c = j; *c; c++) {
        if (in_str) {
            if (*c == '\\')
                c++;
            else if (*c == '"')
                in_str = false;
            continue;
        }
        if (*c == '"')
            in_str = true;
        else if (*c == '{' || *c == '[')
            tops += !depth++;
        else if (*c == '}' || *c == ']')
            CHECK(--depth >= 0);
    }
    CHECK(!in_str && depth == 0 && tops == 1 && j[0] == '{');
}

/* The totals the stats count too. */
static void check_against_stats(cuma_heap *h) {
    char *j = snapshot(h);
    check_well_formed(j);
    cuma_stats s = heap_stats(h);
    CHECK(field(j, "live", "requested") + field(j, "deferred", "requested") == s.requested_bytes);
    CHECK(field(j, "live", "bytes") + field(j, "deferred", "bytes") == s.allocated_bytes);
    CHECK(field(j, "live", "count") + field(j, "deferred", "count") == s.active_allocs);
    CHECK(field(j, "free", "cached_bytes") == s.cached_bytes);
    CHECK(field(j, "free", "mapped_bytes") == s.mapped_bytes);
    CHECK(field(j, "free", "reserved_bytes") == s.reserved_bytes);
    CHECK(field(j, "managed", "bytes") == s.managed_bytes);
    CHECK(num_after(j, "\"arenas\":") == s.arenas);
    CHECK(num_after(j, "\"page_size\":") == s.page_size);
    free(j);
}

typedef struct expect_block {
    uint64_t addr, size, req;
    uintptr_t stream;
    unsigned arena;
} expect_block;

static int by_size_desc(const void *x, const void *y) {
    const expect_block *a = x, *b = y;
    if (a->size != b->size) return a->size > b->size ? -1 : 1;
    return a->addr < b->addr ? -1 : a->addr > b->addr;
}

/* Appends to a fixed buffer, failing the test when it overflows. */
static void app(char *buf, size_t len, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
static void app(char *buf, size_t len, const char *fmt, ...) {
    size_t used = strlen(buf);
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(buf + used, len - used, fmt, ap);
    va_end(ap);
    CHECK(n >= 0 && (size_t)n < len - used);
}

#define NB 44

/* Known sizes on two streams (and the default one) in two arenas: every figure exact. */
static void test_exact(void) {
    cuma_heap *h = heap_make("backend:sim,capacity:512M,page_size:2M,tcache:off,sim_clock:manual");
    cuma_stream s1 = (cuma_stream)(uintptr_t)0x1000, s2 = (cuma_stream)(uintptr_t)0x2000;
    expect_block e[NB];
    for (unsigned i = 0; i < NB; i++) {
        unsigned arena = i % 2;
        CHECK_OK(cuma_arena_use(h, arena));
        /* Distinct sizes from 1 KB to 12 MB, a few equal ones (ties go by address). */
        uint64_t req = i < 4 ? 3 * MB + 100 : (uint64_t)(i * i) * 6000 + 1;
        cuma_stream st = i % 3 == 0 ? s1 : i % 3 == 1 ? s2 : NULL;
        void *p;
        CHECK_OK(cuma_alloc(h, req, st, &p));
        size_t bs;
        CHECK_OK(cuma_block_size(h, p, &bs));
        e[i] = (expect_block){(uint64_t)(uintptr_t)p, bs, req, (uintptr_t)st, arena};
    }
    CHECK_OK(cuma_arena_use(h, 0));
    CHECK(heap_stats(h).arenas == 2);
    char *j = snapshot(h);
    check_well_formed(j);
    uint64_t bytes = 0, req = 0, bn[64] = {0}, bb[64] = {0};
    for (unsigned i = 0; i < NB; i++) {
        bytes += e[i].size, req += e[i].req;
        unsigned k = 0;
        while ((1ull << k) < e[i].size) k++;
        bn[k]++, bb[k] += e[i].size;
    }
    CHECK(field(j, "live", "count") == NB && field(j, "live", "bytes") == bytes &&
          field(j, "live", "requested") == req);
    /* The buckets, whole and in order. */
    static char want[16384];
    want[0] = 0;
    app(want, sizeof want, "\"by_size\":[");
    bool first = true;
    for (unsigned k = 0; k < 64; k++) {
        if (!bn[k]) continue;
        app(want, sizeof want, "%s{\"le\":%llu,\"count\":%llu,\"bytes\":%llu}", first ? "" : ",",
            1ull << k, (unsigned long long)bn[k], (unsigned long long)bb[k]);
        first = false;
    }
    app(want, sizeof want, "]");
    CHECK(strstr(j, want));
    /* The 32 largest, in order, with the addresses cuma_alloc returned. */
    qsort(e, NB, sizeof e[0], by_size_desc);
    unsigned ties = 0; /* the four equal sizes are among the 32, ordered by address */
    for (unsigned i = 1; i < 32; i++) ties += e[i].size == e[i - 1].size;
    CHECK(ties == 3);
    want[0] = 0;
    app(want, sizeof want, "\"largest\":[");
    for (unsigned i = 0; i < 32; i++) {
        app(want, sizeof want,
            "%s{\"addr\":\"0x%llx\",\"size\":%llu,\"requested\":%llu,\"stream\":", i ? "," : "",
            (unsigned long long)e[i].addr, (unsigned long long)e[i].size,
            (unsigned long long)e[i].req);
        if (e[i].stream)
            app(want, sizeof want, "\"0x%llx\"", (unsigned long long)e[i].stream);
        else
            app(want, sizeof want, "0");
        app(want, sizeof want, ",\"arena\":%u}", e[i].arena);
    }
    app(want, sizeof want, "]}");
    if (!strstr(j, want)) fprintf(stderr, "want %s\nin   %s\n", want, j);
    CHECK(strstr(j, want));
    CHECK(field(j, "thread_cached", "count") == 0 && field(j, "deferred", "count") == 0);
    CHECK(field(j, "managed", "count") == 0);
    /* The largest free block: at most a virtual range, at least what is left above the top. */
    uint64_t lf = field(j, "free", "largest_block");
    CHECK(lf > 0 && lf <= h->first.va_size);
    free(j);
    check_against_stats(h);

    /* Freed blocks leave; a freed block waiting on another stream is deferred, not live. */
    cuma_stream s3 = (cuma_stream)(uintptr_t)0x3000;
    CHECK_OK(cuma_record_stream(h, (void *)(uintptr_t)e[0].addr, s3));
    CHECK_OK(cuma_sim_hold_stream(h, s3));
    CHECK_OK(cuma_free(h, (void *)(uintptr_t)e[0].addr, NULL));
    CHECK_OK(cuma_free(h, (void *)(uintptr_t)e[NB - 1].addr, NULL));
    j = snapshot(h);
    CHECK(field(j, "live", "count") == NB - 2);
    CHECK(field(j, "live", "bytes") == bytes - e[0].size - e[NB - 1].size);
    CHECK(field(j, "deferred", "count") == 1 && field(j, "deferred", "bytes") == e[0].size &&
          field(j, "deferred", "requested") == e[0].req);
    char addr[64];
    snprintf(addr, sizeof addr, "\"0x%llx\"", (unsigned long long)e[0].addr);
    CHECK(!strstr(j, addr));
    /* The 33rd largest moved up into the list. */
    snprintf(addr, sizeof addr, "\"addr\":\"0x%llx\"", (unsigned long long)e[32].addr);
    CHECK(strstr(j, addr));
    free(j);
    check_against_stats(h);
    CHECK_OK(cuma_sim_release_stream(h, s3));
    CHECK_OK(cuma_poll(h));
    j = snapshot(h);
    CHECK(field(j, "deferred", "count") == 0);
    free(j);
    check_against_stats(h);
    for (unsigned i = 1; i < NB - 1; i++)
        CHECK_OK(cuma_free(h, (void *)(uintptr_t)e[i].addr, NULL));
    j = snapshot(h);
    CHECK(strstr(j, "\"live\":{\"count\":0,\"bytes\":0,\"requested\":0,\"by_size\":[],"
                    "\"largest\":[]}"));
    CHECK(field(j, "free", "cached_bytes") > 0); /* idle pages, until the release delay */
    free(j);
    check_against_stats(h);
    CHECK_OK(cuma_validate(h));
    cuma_heap_destroy(h);
}

/* With thread caches on, a block freed into the calling thread's cache is freed: counted under
 * "thread_cached", not live, as cuma_get_stats counts it. */
static void test_thread_cache(void) {
    cuma_heap *h = heap_make("backend:sim,capacity:256M,page_size:2M,sim_clock:manual");
    void *a, *b;
    CHECK_OK(cuma_alloc(h, 100000, NULL, &a));
    CHECK_OK(cuma_alloc(h, 300000, NULL, &b));
    size_t bs;
    CHECK_OK(cuma_block_size(h, b, &bs));
    CHECK_OK(cuma_free(h, b, NULL));
    CHECK(h->first.tcaches); /* the free went to this thread's cache */
    char *j = snapshot(h);
    CHECK(field(j, "live", "count") == 1 && field(j, "live", "requested") == 100000);
    CHECK(field(j, "thread_cached", "count") == 1 && field(j, "thread_cached", "bytes") == bs);
    char addr[64];
    snprintf(addr, sizeof addr, "\"addr\":\"0x%llx\"", (unsigned long long)(uintptr_t)b);
    CHECK(!strstr(j, addr));
    free(j);
    check_against_stats(h);
    /* Taken again from the cache (the fast path): live once more. */
    void *c;
    CHECK_OK(cuma_alloc(h, 300000, NULL, &c));
    CHECK(c == b);
    j = snapshot(h);
    CHECK(field(j, "live", "count") == 2 && field(j, "thread_cached", "count") == 0);
    CHECK(field(j, "live", "requested") == 400000);
    CHECK(strstr(j, addr));
    free(j);
    check_against_stats(h);
    CHECK_OK(cuma_free(h, a, NULL));
    CHECK_OK(cuma_free(h, c, NULL));
    check_against_stats(h);
    cuma_heap_destroy(h);
}

/* Segment mode, the buddy and managed fallbacks: the totals agree with the stats. */
static void test_other_modes(void) {
    const char *confs[] = {
        "backend:sim,capacity:256M,sim_segments:on,tcache:off,sim_clock:manual",
        "backend:sim,capacity:256M,policy:buddy,tcache:off,sim_clock:manual",
        "backend:sim,capacity:64M,managed_fallback:on,tcache:off,sim_clock:manual",
    };
    for (unsigned c = 0; c < 3; c++) {
        cuma_heap *h = heap_make(confs[c]);
        void *p[6];
        for (unsigned i = 0; i < 6; i++) CHECK_OK(cuma_alloc(h, (i + 1) * 700000, NULL, &p[i]));
        CHECK_OK(cuma_free(h, p[2], NULL));
        void *m = NULL;
        if (c == 2) {
            CHECK_OK(cuma_alloc(h, 300 * MB, NULL, &m)); /* more than the virtual range */
            char *j = snapshot(h);
            CHECK(field(j, "managed", "count") == 1 && field(j, "managed", "bytes") == 300 * MB);
            CHECK(field(j, "live", "count") == 5); /* managed memory is not a live block */
            free(j);
        }
        check_against_stats(h);
        for (unsigned i = 0; i < 6; i++)
            if (i != 2) CHECK_OK(cuma_free(h, p[i], NULL));
        if (m) CHECK_OK(cuma_free(h, m, NULL));
        check_against_stats(h);
        cuma_heap_destroy(h);
    }
}

/* The buffer protocol and bad arguments. */
static void test_protocol(void) {
    cuma_heap *h = heap_make("backend:sim,capacity:64M,tcache:off,sim_clock:manual");
    void *p;
    CHECK_OK(cuma_alloc(h, MB, NULL, &p));
    size_t need = 0;
    char small[16];
    memset(small, 'x', sizeof small);
    CHECK_ST(cuma_snapshot_json(h, small, sizeof small, &need), CUMA_ERR_INVALID);
    CHECK(strstr(cuma_last_error(), "too small") && need > sizeof small);
    CHECK(memchr(small, 0, sizeof small)); /* what fits, terminated */
    char *buf = malloc(need + 1);
    CHECK(buf);
    CHECK_ST(cuma_snapshot_json(h, buf, need, NULL), CUMA_ERR_INVALID); /* no room for the NUL */
    CHECK(strlen(buf) == need - 1);
    size_t again = 0;
    CHECK_OK(cuma_snapshot_json(h, buf, need + 1, &again));
    CHECK(again == need && strlen(buf) == need);
    CHECK_ST(cuma_snapshot_json(h, NULL, 100, &again), CUMA_ERR_INVALID);
    CHECK(strstr(cuma_last_error(), "buf is NULL") && again == need);
    CHECK_ST(cuma_snapshot_json(h, buf, 0, NULL), CUMA_ERR_INVALID);
    CHECK_ST(cuma_snapshot_json(NULL, buf, need + 1, &again), CUMA_ERR_INVALID);
    CHECK(strstr(cuma_last_error(), "heap is NULL"));
    free(buf);
    CHECK_OK(cuma_free(h, p, NULL));
    cuma_heap_destroy(h);
}

/* A forked child whose heap's memory is the parent's refuses, as it refuses cuma_alloc. */
static void test_fork_child(void) {
    cuma_heap *h = heap_make("backend:sim,capacity:64M,host_backing:on,tcache:off");
    void *p;
    CHECK_OK(cuma_alloc(h, MB, NULL, &p));
    fflush(stdout), fflush(stderr);
    pid_t pid = fork();
    CHECK(pid >= 0);
    if (!pid) {
        alarm(10);
        char buf[4096];
        size_t need = 0;
        CHECK_ST(cuma_snapshot_json(h, buf, sizeof buf, &need), CUMA_ERR_UNSUPPORTED);
        CHECK(strstr(cuma_last_error(), "cuma_snapshot_json") &&
              strstr(cuma_last_error(), "came through fork"));
        _exit(0); /* the parent's heap is not the child's to destroy here */
    }
    int ws;
    CHECK(waitpid(pid, &ws, 0) == pid && WIFEXITED(ws) && WEXITSTATUS(ws) == 0);
    check_against_stats(h);
    CHECK_OK(cuma_free(h, p, NULL));
    cuma_heap_destroy(h);
}

static char *read_file(const char *path) {
    FILE *f = fopen(path, "r");
    if (!f) return NULL;
    static char buf[1 << 16];
    size_t n = fread(buf, 1, sizeof buf - 1, f);
    fclose(f);
    buf[n] = 0;
    return buf;
}

/* An OOM callback that tries an allocation of its own (which fails at once, inside the ladder):
 * the dump must describe the allocation that failed for good, not this one. */
static int try_alloc_in_callback(void *user, cuma_heap *h, size_t size, cuma_stream s) {
    (void)size, (void)s;
    void *p = NULL;
    *(cuma_status *)user = cuma_alloc(h, 6 * MB, NULL, &p);
    if (p) CHECK_OK(cuma_free(h, p, NULL));
    return CUMA_OOM_PASS;
}

static void test_oom_dump(void) {
    char dir[] = "/tmp/cuma-oom-dump-XXXXXX";
    CHECK(mkdtemp(dir));
    char conf[256], path[256];
    snprintf(conf, sizeof conf,
             "backend:sim,capacity:16M,sim_clock:manual,tcache:off,device:2,oom_dump:%s/"
             "oom-%%p-%%d.json",
             dir);
    snprintf(path, sizeof path, "%s/oom-%ld-2.json", dir, (long)getpid());
    cuma_heap *h = heap_make(conf);
    cuma_status inner = CUMA_OK;
    CHECK_OK(cuma_add_oom_callback(h, try_alloc_in_callback, &inner, NULL));
    void *a, *b;
    CHECK_OK(cuma_alloc(h, 12 * MB, NULL, &a));
    CHECK(read_file(path) == NULL); /* nothing failed yet */
    CHECK_ST(cuma_alloc(h, 8 * MB, NULL, &b), CUMA_ERR_OOM);
    CHECK(inner == CUMA_ERR_OOM); /* the callback's own try failed, and wrote nothing */
    CHECK(strstr(cuma_last_error(), "out of memory: 8388608 bytes requested")); /* kept */
    char *j = read_file(path);
    CHECK(j);
    check_well_formed(j);
    CHECK(num_after(j, "\"pid\":") == (uint64_t)getpid() && num_after(j, "\"device\":") == 2);
    CHECK(num_after(j, "\"request_bytes\":") == 8 * MB);
    CHECK(strstr(j, "\"error\":\"out of memory: 8388608 bytes requested"));
    CHECK(num_after(j, "\"failed_allocs\":") == 2); /* the callback's try and the request */
    CHECK(field(j, "live", "count") == 1 && field(j, "live", "bytes") == 12 * MB);
    /* A second failure at once: not written again (the file still has the first). */
    CHECK_ST(cuma_alloc(h, 9 * MB, NULL, &b), CUMA_ERR_OOM);
    j = read_file(path);
    CHECK(num_after(j, "\"request_bytes\":") == 8 * MB && num_after(j, "\"failed_allocs\":") == 2);
    CHECK_OK(cuma_free(h, a, NULL));
    cuma_heap_destroy(h);
    CHECK(unlink(path) == 0 && rmdir(dir) == 0); /* no temporary file left either */
}

int main(void) {
    test_exact();
    test_thread_cache();
    test_other_modes();
    test_protocol();
    test_fork_child();
    test_oom_dump();
    printf("test_snapshot: ok\n");
    return 0;
}
