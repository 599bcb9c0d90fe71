/* Heaps with known figures in a ledger, for the tests of `cuma ps`, `cuma top` and
 * `cuma exporter` (check_tools.py). Waits, holding them, until stdin reaches EOF.
 *
 *   ledger_fixture NAME sim   two heaps on the simulated device (64M) of ledger NAME:
 *                             A: priority 2, guarantee 8M, limit 48M; 12M reserved, 4M idle,
 *                                8M requested
 *                             B: priority -1, guarantee 24M (more than it holds, so the
 *                                device's free memory is 64 - 12 - 24); 20M reserved and
 *                                requested
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
 * Once every figure is in the ledger it prints one JSON object per heap (what it made, as the
 * heap's own stats say for sim heaps) and the line "ready". In raw mode the line "step" on stdin
 * changes X (see run_raw). The raw slots are left behind at exit, as a killed process leaves
 * them: readers must reap them. */
#include "check.h"
#include "coord/ledger.h"
#include "cuma/ledger.h"

#include <inttypes.h>
#include <pthread.h>
#include <stdio.h>
#include <string.h>
#include <sys/prctl.h>
#include <time.h>
#include <unistd.h>

#define MB (1024ull * 1024ull)

static const char *ledger_name;

static void print_entry(const cuma_ledger_entry *e) {
    printf("{\"pid\":%d,\"process\":\"", e->pid);
    for (const char *p = e->process; *p; p++)
        printf("%s%c", *p == '"' || *p == '\\' ? "\\" : "", *p);
    printf("\",\"device\":\"%s\",\"capacity\":%" PRIu64 ",\"priority\":%d,\"guarantee\":%" PRIu64
           ",\"limit\":%" PRIu64 ",\"reserved\":%" PRIu64 ",\"cached\":%" PRIu64
           ",\"requested\":%" PRIu64 ",\"peak_reserved\":%" PRIu64 ",\"want\":%" PRIu64
           ",\"denials\":%" PRIu64 ",\"pressure_asks\":%" PRIu64 ",\"pressure_given\":%" PRIu64
           ",\"pressure_calls\":%" PRIu64 "}\n",
           e->device, e->capacity, e->priority, e->guarantee, e->limit, e->reserved, e->cached,
           e->requested, e->peak_reserved, e->want, e->denials, e->pressure_asks, e->pressure_given,
           e->pressure_calls);
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

/* A sim heap's entry once its release thread has published what its stats say (every 5 ms).
 * The entry printed is the ledger's, checked against the heap's own stats first. */
static void settle_sim(cuma_heap *h, int priority) {
    uint64_t t0 = now_ms();
    for (;;) {
        cuma_stats s = heap_stats(h);
        cuma_ledger_entry e;
        CHECK(find(&e, "sim", priority));
        if (e.cached == s.cached_bytes && e.requested == s.requested_bytes &&
            e.reserved == s.reserved_bytes) {
            CHECK(e.denials == s.ledger_denials && e.pressure_asks == s.pressure_asks &&
                  e.pressure_given == s.pressure_given_bytes &&
                  e.pressure_calls == s.pressure_callbacks && e.limit == s.limit_bytes &&
                  e.peak_reserved == s.peak_reserved_bytes);
            print_entry(&e);
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

static void wait_for_eof(void) {
    char buf[256];
    while (fread(buf, 1, sizeof buf, stdin) > 0) {
    }
}

static int run_sim(void) {
    cuma_heap *a = sim_heap("priority:2,guarantee:8M,limit:48M");
    cuma_heap *b = sim_heap("priority:-1,guarantee:24M");
    void *a6, *a4, *a2, *b20;
    CHECK_OK(cuma_alloc(a, 6 * MB, NULL, &a6));
    CHECK_OK(cuma_alloc(a, 4 * MB, NULL, &a4));
    CHECK_OK(cuma_alloc(a, 2 * MB, NULL, &a2));
    CHECK_OK(cuma_free(a, a4, NULL));
    CHECK_OK(cuma_alloc(b, 20 * MB, NULL, &b20));
    cuma_stats sa = heap_stats(a), sb = heap_stats(b);
    CHECK(sa.reserved_bytes == 12 * MB && sa.cached_bytes == 4 * MB &&
          sa.requested_bytes == 8 * MB && sa.peak_reserved_bytes == 12 * MB);
    CHECK(sb.requested_bytes == 20 * MB && sb.reserved_bytes == 20 * MB && sb.cached_bytes == 0 &&
          sb.peak_reserved_bytes == 20 * MB);
    settle_sim(a, 2);
    settle_sim(b, -1);
    printf("ready\n");
    fflush(stdout);
    wait_for_eof();
    CHECK_OK(cuma_free(a, a6, NULL));
    CHECK_OK(cuma_free(a, a2, NULL));
    CHECK_OK(cuma_free(b, b20, NULL));
    cuma_heap_destroy(a);
    cuma_heap_destroy(b);
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
    print_entry(&ex);
    print_entry(&ey);
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

int main(int argc, char **argv) {
    if (argc != 3 || (strcmp(argv[2], "sim") && strcmp(argv[2], "raw"))) {
        fprintf(stderr, "usage: ledger_fixture LEDGER_NAME sim|raw\n");
        return 2;
    }
    ledger_name = argv[1];
    return !strcmp(argv[2], "sim") ? run_sim() : run_raw();
}
