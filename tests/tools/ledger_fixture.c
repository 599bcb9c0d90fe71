// SPDX-License-Identifier: Apache-2.0
/* Heaps with known figures in a ledger, for the tests of `cuma ps`, `cuma top` and
 * `cuma exporter` (check_tools.py). Waits, holding them, until stdin reaches EOF.
 *
 *   ledger_fixture NAME sim   three heaps on the simulated device (64M, 2M pages) of ledger NAME:
 *                             A: priority 2, guarantee 8M, limit 48M; 12M reserved, 4M idle,
 *                                8M requested
 *                             B: priority -1, guarantee 24M (more than it holds, so the
 *                                device's free memory is 64 - 12 - 24 - C's); 20M reserved and
 *                                requested
 *                             C: priority 0, limit 16M, for the allocator's counters (see
 *                                run_sim): 4 allocations, 2 frees, 1 failure, 2 trips down
 *                                the OOM ladder, 1 OOM with 2 callbacks (the second frees a
 *                                block and has the allocation retried), 3 trims, 3M + 6M live
 *                                (part of a page unused: fragmentation above 0)
 *                             (the raw slots carry the denial and pressure figures: a sim
 *                             heap refused part way keeps idle pages, and what a later trim
 *                             gives back shows in the ledger's cached figure only at the next
 *                             release-policy run)
 *   ledger_fixture NAME raw   two slots on a made-up device "GPU-cuma-fixture-0001" (64M),
 *                             joined through the ledger's internal side so that every figure,
 *                             the pressure ones included, is set by hand:
 *                             X (process 'fx"q\z'): priority 0, guarantee 16M, limit 60M,
 *                                40M reserved, 8M cached, 30M requested, 1 denial, gave 6M
 *                                in 2 callbacks
 *                             Y (process "raw_y"): priority 1, 16M reserved and requested,
 *                                waiting for 12M (one pressure request that nobody answers)
 *
 *   ledger_fixture NAME hold  one slot on a made-up device "GPU-cuma-fixture-hold" (64M): process
 *                             "holder", priority 0, 4M reserved and requested; on the line
 *                             "hold" it takes the ledger's lock, prints "held" and stops itself
 *                             (SIGSTOP) holding it, as a process stopped in the middle of a
 *                             ledger call (Ctrl-Z, a debugger) does; the test kills it, and the
 *                             next reader finds the lock's holder dead and takes it over
 *   ledger_fixture NAME many  MANY_SLOTS slots on a made-up device "GPU-cuma-fixture-many"
 *                             (64M): process "many", priorities 0 to MANY_SLOTS - 1 (128), 256K
 *                             reserved and requested each, for an answer larger than a
 *                             socket's buffers
 *   ledger_fixture NAME twins two slots on made-up devices whose names differ only in a control
 *                             byte ("GPU-cuma-fixture-twin" and \x01 or \x02, as a writer of
 *                             the ledger may make them): 1M and 2M reserved and requested;
 *                             prints no objects (the names are not JSON), only "ready"
 *
 * Once every figure is in the ledger it prints one JSON object per heap (what it made, as the
 * heap's own stats say for sim heaps, whose objects also carry "stats": the allocator figures
 * of its cuma_get_stats under the ledger's names, once its release thread has published them)
 * and the line "ready". The raw slots never publish allocator figures: they have no heap. The
 * line "step" on stdin changes X in raw mode (see run_raw) and makes C allocate and free
 * STEP_ALLOCS times in sim mode, which then prints C's object again; both then print
 * "stepped". The raw slots are left behind at exit, as a killed process leaves them: readers
 * must reap them. */
#include "check.h"
#include "coord/ledger.h"
#include "cuma/ledger.h"

#include <inttypes.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <string.h>
#include <sys/prctl.h>
#include <time.h>
#include <unistd.h>

#define MB          (1024ull * 1024ull)
#define STEP_ALLOCS 200

static const char *ledger_name;

/* The heap's own report of its backend (cuma_stats has none). */
static void own_backend(cuma_heap *h, char *out, size_t len) {
    char json[8192];
    CHECK_OK(cuma_stats_json(h, json, sizeof json, NULL));
    const char *p = strstr(json, "\"backend\":\"");
    CHECK(p != NULL);
    p += strlen("\"backend\":\"");
    size_t n = strcspn(p, "\"");
    CHECK(n < len);
    memcpy(out, p, n);
    out[n] = 0;
}

/* One figure of print_stats: a ratio (a double) exactly, a count or size as it is. */
static void print_figure(const char *name, double ratio, uint64_t n, int is_double) {
    if (is_double)
        printf(",\"%s\":%.17g", name, ratio);
    else
        printf(",\"%s\":%" PRIu64, name, n);
}

/* The heap's own stats: the figures of the list in cuma.h that the ledger carries, under their
 * names (those of cuma_ledger_entry and of `cuma stats --json`). */
static void print_stats(cuma_heap *h) {
    cuma_stats s = heap_stats(h);
    char backend[32];
    own_backend(h, backend, sizeof backend);
    printf(",\"stats\":{\"backend\":\"%s\"", backend);
#define P(type, name, kind, where, help)                                                           \
    CUMA_STAT_IF_LEDGER(where, print_figure(#name,                                                 \
                                            _Generic(s.name, double                                \
                                                     : s.name, default : 0.0),                     \
                                            _Generic(s.name, double : 0, default                   \
                                                     : s.name),                                    \
                                            _Generic(s.name, double : 1, default : 0));)
    CUMA_STATS_FIELDS(P)
#undef P
    printf("}");
}

/* One heap's line: its ledger entry, and for a heap (h not NULL) its own stats. */
static void print_entry(const cuma_ledger_entry *e, cuma_heap *h) {
    printf("{\"pid\":%d,\"process\":\"", e->pid);
    for (const char *p = e->process; *p; p++)
        printf("%s%c", *p == '"' || *p == '\\' ? "\\" : "", *p);
    printf("\",\"device\":\"%s\",\"capacity\":%" PRIu64 ",\"priority\":%d,\"guarantee\":%" PRIu64
           ",\"limit\":%" PRIu64 ",\"reserved\":%" PRIu64 ",\"cached\":%" PRIu64
           ",\"requested\":%" PRIu64 ",\"peak_reserved\":%" PRIu64 ",\"want\":%" PRIu64
           ",\"ledger_denials\":%" PRIu64 ",\"pressure_asks\":%" PRIu64
           ",\"pressure_given_bytes\":%" PRIu64 ",\"pressure_callbacks\":%" PRIu64,
           e->device, e->capacity, e->priority, e->guarantee, e->limit, e->reserved, e->cached,
           e->requested, e->peak_reserved, e->want, e->ledger_denials, e->pressure_asks,
           e->pressure_given_bytes, e->pressure_callbacks);
    if (h) print_stats(h);
    printf("}\n");
}

/* This process's heap on `device` with `priority` as the ledger shows it (each heap here has a
 * priority of its own). */
static int find(cuma_ledger_entry *out, const char *device, int priority) {
    cuma_ledger_entry e[64];
    size_t n = 0;
    CHECK_OK(cuma_ledger_snapshot(ledger_name, e, 64, &n));
    for (size_t i = 0; i < n && i < 64; i++)
        if (e[i].pid == getpid() && !strcmp(e[i].device, device) && e[i].priority == priority) {
            *out = e[i];
            return 1;
        }
    return 0;
}

static uint64_t now_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000 + (uint64_t)ts.tv_nsec / 1000000;
}

/* Waits until the heap's release thread has published its allocator figures twice since the
 * call (it does every 100 ms): the first publication seen may come from a snapshot taken
 * before the call, the second cannot. A publication is seen as the age of the figures going
 * down between two looks (the same publication only grows older). */
static void wait_stats(int priority) {
    uint64_t t0 = now_ms(), last = UINT64_MAX;
    int seen = -1; /* the first look only sets `last` */
    while (seen < 2) {
        cuma_ledger_entry e;
        CHECK(find(&e, "sim", priority));
        if (seen < 0 || e.stats_age_ns < last) seen++;
        last = e.stats_age_ns;
        if (now_ms() - t0 > 10000) {
            fprintf(stderr, "ledger_fixture: heap of priority %d published no figures in 10 s\n",
                    priority);
            abort();
        }
        usleep(5000);
    }
}

/* A sim heap's entry once its release thread has published what its stats say (cached and
 * requested every 5 ms, the allocator figures every 100 ms). The entry printed is the ledger's,
 * checked against the heap's own stats first; the allocator figures printed are the heap's own,
 * for the test to compare with what the tools read from the ledger. */
static void settle_sim(cuma_heap *h, int priority) {
    uint64_t t0 = now_ms();
    for (;;) {
        cuma_stats s = heap_stats(h);
        cuma_ledger_entry e;
        CHECK(find(&e, "sim", priority));
        if (e.cached == s.cached_bytes && e.requested == s.requested_bytes &&
            e.reserved == s.reserved_bytes) {
            CHECK(e.ledger_denials == s.ledger_denials && e.pressure_asks == s.pressure_asks &&
                  e.pressure_given_bytes == s.pressure_given_bytes &&
                  e.pressure_callbacks == s.pressure_callbacks && e.limit == s.limit_bytes &&
                  e.peak_reserved == s.peak_reserved_bytes);
            wait_stats(priority);
            CHECK(find(&e, "sim", priority));
            print_entry(&e, h);
            return;
        }
        if (now_ms() - t0 > 10000) {
            fprintf(stderr,
                    "ledger_fixture: heap of priority %d: the ledger says %" PRIu64
                    " reserved, %" PRIu64 " cached, %" PRIu64 " requested; its stats %" PRIu64
                    ", %" PRIu64 ", %" PRIu64 "\n",
                    priority, e.reserved, e.cached, e.requested, s.reserved_bytes, s.cached_bytes,
                    s.requested_bytes);
            abort();
        }
        usleep(5000);
    }
}

static cuma_heap *sim_heap(const char *extra) {
    char conf[512];
    snprintf(conf, sizeof conf,
             "backend:sim,capacity:64M,ledger:%s,release_delay_ms:1000000,tcache:off,arenas:1,%s",
             ledger_name, extra);
    return heap_make(conf);
}

/* C's OOM callbacks: the first passes; the second frees the block it is given, once, and has
 * the allocation retried. */
static int oom_pass(void *user, cuma_heap *h, size_t size, cuma_stream stream) {
    (void)user, (void)h, (void)size, (void)stream;
    return CUMA_OOM_PASS;
}

static int oom_free(void *user, cuma_heap *h, size_t size, cuma_stream stream) {
    (void)size, (void)stream;
    void **spare = user;
    if (!*spare) return CUMA_OOM_PASS;
    CHECK_OK(cuma_free(h, *spare, NULL));
    *spare = NULL;
    return CUMA_OOM_RETRY;
}

static void *spare; /* C's block for oom_free */

/* C's history: every counter of the allocator ends at a value of its own. */
static void run_c(cuma_heap *c, void **c3, void **c6) {
    void *c8, *x;
    CHECK_OK(cuma_alloc(c, 3 * MB, NULL, c3));
    CHECK_OK(cuma_alloc(c, 8 * MB, NULL, &c8));
    CHECK_OK(cuma_free(c, c8, NULL));
    /* Beyond the limit: the cache goes (a trim), the allocation still fails, no callbacks yet
     * (an out-of-memory all the same: ooms counts it). */
    CHECK_ST(cuma_alloc(c, 20 * MB, NULL, &x), CUMA_ERR_LIMIT);
    CHECK_OK(cuma_add_oom_callback(c, oom_pass, NULL, NULL));
    CHECK_OK(cuma_add_oom_callback(c, oom_free, &spare, NULL));
    CHECK_OK(cuma_alloc(c, 10 * MB, NULL, &spare));
    /* 4M + 10M held, 6M more would pass the limit: both callbacks run, the second frees the
     * spare block, and the retry fits. */
    CHECK_OK(cuma_alloc(c, 6 * MB, NULL, c6));
    CHECK(spare == NULL);
    CHECK_OK(cuma_trim(c, 0));
    cuma_stats s = heap_stats(c);
    CHECK(s.num_allocs == 4 && s.num_frees == 2 && s.active_allocs == 2 && s.failed_allocs == 1 &&
          s.alloc_retries == 2 && s.ooms == 2 && s.oom_callbacks == 2 && s.trims == 3 &&
          s.requested_bytes == 9 * MB && s.fragmentation > 0);
}

/* "step": C allocates and frees a block STEP_ALLOCS times, for top's allocation rate. */
static void step_c(cuma_heap *c) {
    for (int i = 0; i < STEP_ALLOCS; i++) {
        void *p;
        CHECK_OK(cuma_alloc(c, 4096, NULL, &p));
        CHECK_OK(cuma_free(c, p, NULL));
    }
}

static int run_sim(void) {
    cuma_heap *a = sim_heap("priority:2,guarantee:8M,limit:48M");
    cuma_heap *b = sim_heap("priority:-1,guarantee:24M");
    cuma_heap *c = sim_heap("priority:0,limit:16M");
    void *a6, *a4, *a2, *b20, *c3, *c6;
    CHECK_OK(cuma_alloc(a, 6 * MB, NULL, &a6));
    CHECK_OK(cuma_alloc(a, 4 * MB, NULL, &a4));
    CHECK_OK(cuma_alloc(a, 2 * MB, NULL, &a2));
    CHECK_OK(cuma_free(a, a4, NULL));
    CHECK_OK(cuma_alloc(b, 20 * MB, NULL, &b20));
    run_c(c, &c3, &c6);
    cuma_stats sa = heap_stats(a), sb = heap_stats(b);
    CHECK(sa.reserved_bytes == 12 * MB && sa.cached_bytes == 4 * MB &&
          sa.requested_bytes == 8 * MB && sa.peak_reserved_bytes == 12 * MB);
    CHECK(sb.requested_bytes == 20 * MB && sb.reserved_bytes == 20 * MB && sb.cached_bytes == 0 &&
          sb.peak_reserved_bytes == 20 * MB);
    settle_sim(a, 2);
    settle_sim(b, -1);
    settle_sim(c, 0);
    printf("ready\n");
    fflush(stdout);
    char line[64];
    while (fgets(line, sizeof line, stdin)) {
        if (strcmp(line, "step\n")) continue;
        step_c(c);
        settle_sim(c, 0);
        printf("stepped\n");
        fflush(stdout);
    }
    CHECK_OK(cuma_free(a, a6, NULL));
    CHECK_OK(cuma_free(a, a2, NULL));
    CHECK_OK(cuma_free(b, b20, NULL));
    CHECK_OK(cuma_free(c, c3, NULL));
    CHECK_OK(cuma_free(c, c6, NULL));
    cuma_heap_destroy(a);
    cuma_heap_destroy(b);
    cuma_heap_destroy(c);
    return 0;
}

static cuma_ledger *raw_join(const char *process, int priority, uint64_t guarantee,
                             uint64_t limit) {
    /* The ledger reads the name from /proc/self/comm, the main thread's. */
    CHECK(prctl(PR_SET_NAME, process, 0, 0, 0) == 0);
    cuma_ledger_join_info in = {.name = ledger_name,
                                .device = "GPU-cuma-fixture-0001",
                                .capacity = 64 * MB,
                                .guarantee = guarantee,
                                .limit = limit,
                                .priority = priority};
    cuma_ledger *l;
    CHECK_OK(cuma_ledger_join(&in, &l));
    return l;
}

/* Y's pressure request: nobody answers raw slots, so it waits (longer than any test) and its
 * want stays posted until the process exits. */
static void *ask(void *l) {
    cuma_ledger_reclaim(l, 12 * MB, 3600 * 1000, NULL, NULL);
    return NULL;
}

static int run_raw(void) {
    cuma_ledger *x = raw_join("fx\"q\\z", 0, 16 * MB, 60 * MB);
    cuma_ledger *y = raw_join("raw_y", 1, 0, 0);
    CHECK_OK(cuma_ledger_admit(x, 40 * MB));
    CHECK_OK(cuma_ledger_admit(y, 16 * MB));
    /* 40 + 30 + 16 > 64: denied and counted. */
    CHECK_ST(cuma_ledger_admit(x, 30 * MB), CUMA_ERR_OOM);
    cuma_ledger_publish(x, 8 * MB, 30 * MB, CUMA_LEDGER_ANSWERS_CACHE | CUMA_LEDGER_ANSWERS_SHRINK);
    cuma_ledger_publish(y, 0, 16 * MB, CUMA_LEDGER_ANSWERS_CACHE);
    cuma_ledger_gave(x, 6 * MB, 2);
    /* Y (priority 1) may ask: X's cache (8M) and its use beyond its guarantee (16M) could go,
     * and 8M are free; 12M do not fit now, so the request stays. */
    pthread_t t;
    CHECK(pthread_create(&t, NULL, ask, y) == 0);
    cuma_ledger_entry ex, ey;
    uint64_t t0 = now_ms();
    for (;;) {
        cuma_ledger_self(y, &ey);
        if (ey.want) break;
        CHECK(now_ms() - t0 < 10000);
        usleep(1000);
    }
    cuma_ledger_self(x, &ex);
    print_entry(&ex, NULL);
    print_entry(&ey, NULL);
    printf("ready\n");
    fflush(stdout);
    /* "step": X gives 4M more in one callback, is refused 4M once and gives 2M back to the
     * device, so that `cuma top` has rates to show. */
    char line[64];
    while (fgets(line, sizeof line, stdin)) {
        if (strcmp(line, "step\n")) continue;
        cuma_ledger_gave(x, 4 * MB, 1);
        CHECK_ST(cuma_ledger_admit(x, 4 * MB), CUMA_ERR_OOM);
        cuma_ledger_unadmit(x, 2 * MB);
        printf("stepped\n");
        fflush(stdout);
    }
    _exit(0); /* slots left as a killed process leaves them; the waiting thread dies too */
}

/* The one place that holds the ledger's lock on purpose (the ledger's own test hook). */
static void hold_ledger_lock(cuma_ledger *l) {
    CHECK_OK(cuma_ledger_test_hold_lock(l));
}

static int run_hold(void) {
    CHECK(prctl(PR_SET_NAME, "holder", 0, 0, 0) == 0);
    cuma_ledger_join_info in = {
        .name = ledger_name, .device = "GPU-cuma-fixture-hold", .capacity = 64 * MB, .priority = 0};
    cuma_ledger *l;
    CHECK_OK(cuma_ledger_join(&in, &l));
    CHECK_OK(cuma_ledger_admit(l, 4 * MB));
    cuma_ledger_publish(l, 0, 4 * MB, 0);
    cuma_ledger_entry e;
    cuma_ledger_self(l, &e);
    print_entry(&e, NULL);
    printf("ready\n");
    fflush(stdout);
    char line[64];
    while (fgets(line, sizeof line, stdin)) {
        if (strcmp(line, "hold\n")) continue;
        hold_ledger_lock(l);
        printf("held\n");
        fflush(stdout);
        raise(SIGSTOP); /* until killed: the lock stays held */
    }
    _exit(0);
}

#define MANY_SLOTS 128

static int run_many(void) {
    CHECK(prctl(PR_SET_NAME, "many", 0, 0, 0) == 0);
    for (int i = 0; i < MANY_SLOTS; i++) {
        cuma_ledger_join_info in = {.name = ledger_name,
                                    .device = "GPU-cuma-fixture-many",
                                    .capacity = 64 * MB,
                                    .priority = i};
        cuma_ledger *l;
        CHECK_OK(cuma_ledger_join(&in, &l));
        CHECK_OK(cuma_ledger_admit(l, MB / 4));
        cuma_ledger_publish(l, 0, MB / 4, 0);
        cuma_ledger_entry e;
        cuma_ledger_self(l, &e);
        print_entry(&e, NULL);
    }
    printf("ready\n");
    fflush(stdout);
    char line[64];
    while (fgets(line, sizeof line, stdin)) {
    }
    _exit(0); /* slots left as a killed process leaves them */
}

static int run_twins(void) {
    const char *devices[] = {"GPU-cuma-fixture-twin\x01", "GPU-cuma-fixture-twin\x02"};
    for (int i = 0; i < 2; i++) {
        cuma_ledger_join_info in = {.name = ledger_name, .device = devices[i], .capacity = 64 * MB};
        cuma_ledger *l;
        CHECK_OK(cuma_ledger_join(&in, &l));
        CHECK_OK(cuma_ledger_admit(l, (uint64_t)(i + 1) * MB));
        cuma_ledger_publish(l, 0, (uint64_t)(i + 1) * MB, 0);
    }
    printf("ready\n");
    fflush(stdout);
    char line[64];
    while (fgets(line, sizeof line, stdin)) {
    }
    _exit(0);
}

int main(int argc, char **argv) {
    if (argc != 3 || (strcmp(argv[2], "sim") && strcmp(argv[2], "raw") && strcmp(argv[2], "hold") &&
                      strcmp(argv[2], "many") && strcmp(argv[2], "twins"))) {
        fprintf(stderr, "usage: ledger_fixture LEDGER_NAME sim|raw|hold|many|twins\n");
        return 2;
    }
    ledger_name = argv[1];
    if (!strcmp(argv[2], "hold")) return run_hold();
    if (!strcmp(argv[2], "many")) return run_many();
    if (!strcmp(argv[2], "twins")) return run_twins();
    return !strcmp(argv[2], "sim") ? run_sim() : run_raw();
}
