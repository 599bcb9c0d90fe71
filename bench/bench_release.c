// SPDX-License-Identifier: Apache-2.0
/* The release section: how soon idle memory goes back to the device, on heaps with the real
 * clock and the release thread (sim_clock:real, release_thread:on: what a running program
 * has), watched from outside the heap through its statistics.
 *
 *   idle delay   a block of whole pages freed at t0 goes back at t0 + release_delay_ms; the
 *                rows give how late, next to a plain thread's timed wait to the same moment
 *                (what the machine's scheduler allows), watched by the same poller; thread
 *                caches off but in one row, where the block waits in the freeing thread's batch
 *   trim         cuma_trim(heap, 0) of cached pages: ns per page, against the allocation that
 *                made those pages, and against the device calls when they cost time
 *   max_cached   a free that takes the cache over max_cached: when the excess is gone
 *   ledger       a heap of high priority that needs another heap's idle cache (a named ledger
 *                of two simulated heaps): the allocation call's time, against the same
 *                allocation with room
 *
 * Every heap is made before the poller's timer slack is lowered: threads inherit the slack of
 * the thread that creates them, and the release threads must sleep as in any program. */
#include "bench.h"
#include "heap/heap.h" /* CUMA_LEDGER_POLL_NS: how often a release thread looks at the ledger */
#include "cuma/ledger.h"

#include <errno.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <unistd.h>

#define MiB (1024ull * 1024ull)

enum {
    MAXR = 400,        /* rounds per case at most */
    DELAY_MS = 20,     /* release_delay_ms of the idle-delay heaps */
    FREED_PAGES = 32,  /* pages freed each round */
    LIVE_PAGES = 64,   /* pages held in use by the busy heaps */
    MAX_CACHED_MB = 8, /* max_cached of its heap */
    LEDGER_CAP_MB = 1024,
    LOW_HOLDS_MB = 768, /* idle in the low-priority heap */
    HIGH_WANTS_MB = 512 /* so 256 MiB must come from the other heap */
};

/* Polls every 1 ms until FINE_LEAD before the moment that matters, then every POLL_NS: the
 * resolution where it counts, without a spinning thread taking the CPU that the release thread
 * needs (the machine may have two). A round gives up GIVE_UP after it. */
static const uint64_t COARSE_NS = 1000000, POLL_NS = 20000, FINE_LEAD = 2000000,
                      GIVE_UP = 2000000000;

static int rounds_of(const bench_opts *o, int per_run) {
    int r = o->quick ? 3 : per_run * o->runs;
    return r > MAXR ? MAXR : r;
}

static void sleep_ns(uint64_t ns) {
    struct timespec ts = {(time_t)(ns / 1000000000ull), (long)(ns % 1000000000ull)};
    while (nanosleep(&ts, &ts) && errno == EINTR) {
    }
}

static cuma_stats stats_of(cuma_heap *h) {
    cuma_stats s;
    cuma_get_stats(h, &s);
    return s;
}

/* A number among the heap's settings as it runs them (--conf may have changed ours); NAN when
 * the key is missing or not a number ("never", null). */
static double setting(cuma_heap *h, const char *key) {
    static char js[16384];
    char pat[64];
    if (cuma_stats_json(h, js, sizeof js, NULL) != CUMA_OK) return NAN;
    const char *c = strstr(js, "\"config\":");
    snprintf(pat, sizeof pat, "\"%s\":", key);
    const char *v = c ? strstr(c, pat) : NULL;
    if (!v) return NAN;
    char *end;
    double d = strtod(v + strlen(pat), &end);
    return end == v + strlen(pat) ? NAN : d;
}

/* ---- the poller ----------------------------------------------------------------------------- */

typedef bool (*probe_fn)(void *ctx);

/* at: the clock just after the first probe that said yes (0: none before give_up); gap: since
 * the clock just before the probe that last said no. What was watched happened between the two. */
typedef struct seen {
    uint64_t at, gap;
} seen;

static seen poll_until(probe_fn probe, void *ctx, uint64_t fine_from, uint64_t give_up) {
    uint64_t prev = bench_now_ns();
    for (;;) {
        uint64_t before = bench_now_ns();
        bool yes = probe(ctx);
        uint64_t t = bench_now_ns();
        if (yes) return (seen){t, t - prev};
        if (t >= give_up) return (seen){0, 0};
        prev = before;
        sleep_ns(t + COARSE_NS <= fine_from ? COARSE_NS : POLL_NS);
    }
}

/* The poller's sleeps would otherwise end up to 50 us late (the default timer slack). */
static unsigned long slack_saved;
static void slack_fine(void) {
    slack_saved = (unsigned long)prctl(PR_GET_TIMERSLACK, 0, 0, 0, 0);
    prctl(PR_SET_TIMERSLACK, 1ul, 0, 0, 0);
}
static void slack_restore(void) {
    prctl(PR_SET_TIMERSLACK, slack_saved, 0, 0, 0);
}

/* ---- idle delay ------------------------------------------------------------------------------ */

typedef struct idle_case {
    const char *conf; /* the heap's settings after the release-section ones; NULL: reference */
    int live_pages;   /* held in use through the rounds */
    int per_run;      /* rounds per --runs */
    char name[96];
    const char *alloc;
    cuma_heap *h; /* NULL: the reference, a thread's timed wait */
    void *live;
    uint64_t rel0;        /* page_releases before the round's free */
    uint64_t freed, gone; /* pages freed, pages given back, over the timed rounds */
    double first;         /* lateness of the untimed first round (NAN: never seen) */
    double late[MAXR], gap[MAXR];
    int n, missed, bad, early; /* early: given back before the delay was over */
    /* the reference */
    pthread_mutex_t m;
    pthread_cond_t cv;
    uint64_t due;
    atomic_int woke;
} idle_case;

static bool heap_gave_back(void *ctx) {
    idle_case *c = ctx;
    return stats_of(c->h).page_releases > c->rel0;
}

static bool ref_woke(void *ctx) {
    return atomic_load(&((idle_case *)ctx)->woke) != 0;
}

/* A thread that sleeps until `due` as the release thread does (a condition variable on the
 * monotonic clock, nobody signalling), with the timer slack programs have. */
static void *ref_thread(void *arg) {
    idle_case *c = arg;
    prctl(PR_SET_TIMERSLACK, slack_saved, 0, 0, 0);
    struct timespec ts = {(time_t)(c->due / 1000000000ull), (long)(c->due % 1000000000ull)};
    pthread_mutex_lock(&c->m);
    while (pthread_cond_timedwait(&c->cv, &c->m, &ts) != ETIMEDOUT) {
    }
    pthread_mutex_unlock(&c->m);
    atomic_store(&c->woke, 1);
    return NULL;
}

/* One round: FREED_PAGES pages freed at t0 (or the reference thread started then), watched
 * until they are given back. timed: false for the first round, which is kept apart (a fresh
 * heap's release thread may still sleep as if it had nothing to do). */
static void idle_round(idle_case *c, uint64_t delay_ns, uint64_t page, bool timed) {
    void *p = NULL;
    pthread_t th;
    if (c->h && cuma_alloc(c->h, FREED_PAGES * page, NULL, &p) != CUMA_OK) {
        c->bad++;
        return;
    }
    if (c->h) c->rel0 = stats_of(c->h).page_releases;
    atomic_store(&c->woke, 0);
    /* The pages' idle time is stamped inside the free, a few us after t0 at most: lateness is
     * overstated by that much, never understated. */
    uint64_t t0 = bench_now_ns(), due = t0 + delay_ns;
    if (c->h) {
        if (cuma_free(c->h, p, NULL) != CUMA_OK) c->bad++;
    } else {
        c->due = due;
        if (pthread_create(&th, NULL, ref_thread, c)) {
            c->bad++;
            return;
        }
    }
    seen w = poll_until(c->h ? heap_gave_back : ref_woke, c, due - FINE_LEAD, due + GIVE_UP);
    if (!c->h) pthread_join(th, NULL);
    double late = w.at ? (double)w.at - (double)due : NAN;
    if (!timed) {
        c->first = late;
    } else if (!w.at) {
        c->missed++;
    } else {
        c->early += c->h && w.at < due; /* seen given back before due: certainly early */
        c->late[c->n] = late;
        c->gap[c->n++] = (double)w.gap;
    }
    if (c->h) {
        if (timed) {
            c->freed += FREED_PAGES;
            c->gone += stats_of(c->h).page_releases - c->rel0;
        }
        /* Whatever stayed past the round (a missed release) must not shift the next one. */
        if (!w.at) cuma_trim(c->h, 0);
    }
}

static void idle_row(idle_case *c, double delay_ms, double tc_age_ms, int rounds) {
    bench_row r = bench_row_make("release", c->name, c->alloc, 1);
    if (!(delay_ms >= 0)) { /* --conf made it "never" */
        snprintf(r.note, sizeof r.note, "release_delay_ms is never: nothing goes back by age");
        bench_row_add(&r);
        return;
    }
    double late[MAXR], gap[MAXR];
    memcpy(late, c->late, sizeof late);
    memcpy(gap, c->gap, sizeof gap);
    if (c->n) {
        r.p50 = bench_quantile(late, c->n, 0.50);
        r.p99 = bench_quantile(late, c->n, 0.99);
        r.max = bench_quantile(late, c->n, 1.0);
    }
    double g50 = bench_quantile(gap, c->n, 0.50) / 1e3, gmax = bench_quantile(gap, c->n, 1.0) / 1e3;
    bool tcache = c->h && !strstr(c->conf, "tcache:off");
    if (c->bad)
        snprintf(r.note, sizeof r.note, "%d calls failed", c->bad);
    else if (c->missed)
        snprintf(r.note, sizeof r.note, "%d of %d rounds: never given back (waited 2 s)", c->missed,
                 rounds);
    else if (c->early)
        snprintf(r.note, sizeof r.note, "%d of %d rounds: given back before the delay", c->early,
                 rounds);
    else if (!c->h)
        snprintf(r.note, sizeof r.note,
                 "past t0+%.0f ms: the OS's floor; poll gap p50 %.0f us max %.0f", delay_ms, g50,
                 gmax);
    else if (tcache)
        snprintf(
            r.note, sizeof r.note,
            "past t0+%.0f ms; x%.2f tcache_age_ms (%.0f), the free's batch; 1st round %+.0f ms",
            delay_ms, r.p50 / (tc_age_ms * 1e6), tc_age_ms, c->first / 1e6);
    else
        snprintf(r.note, sizeof r.note,
                 "past t0+%.0f ms (p50 x%.3f of it); %llu/%llu pages went; poll gap %.0f us",
                 delay_ms, (delay_ms * 1e6 + r.p50) / (delay_ms * 1e6), (unsigned long long)c->gone,
                 (unsigned long long)c->freed, g50);
    bench_row_add(&r);
}

/* Lateness of the release by age, with the cases taking turns round by round, so that a slow
 * spell of a shared machine falls on all of them. Thread caches are off but in the last case:
 * a block freed by a thread with a cache waits in its batch of frees until that thread's next
 * slow call or until the release thread ages the caches (tcache_age_ms), and only then do its
 * pages start to idle; the other cases time the release policy from the moment pages idle. */
static void run_idle(const bench_opts *o) {
    static idle_case c[] = {
        {.conf = NULL, .per_run = 20},
        {.conf = "tcache:off", .per_run = 20},
        {.conf = "tcache:off,fragmentation_threshold:0", .live_pages = LIVE_PAGES, .per_run = 20},
        {.conf = "tcache:off,fragmentation_threshold:0.05",
         .live_pages = LIVE_PAGES,
         .per_run = 20},
        /* its rounds last tcache_age_ms longer, and vary less */
        {.conf = "", .per_run = 4},
    };
    enum { NC = sizeof c / sizeof c[0] };
    char conf[256];
    for (int i = 0; i < NC; i++) {
        memset(&c[i].h, 0, sizeof c[i] - offsetof(idle_case, h));
        c[i].first = NAN;
        c[i].alloc = c[i].conf ? "cuma" : "cond_timedwait";
        if (!c[i].conf) continue;
        snprintf(conf, sizeof conf,
                 "sim_clock:real,release_thread:on,sim_call_us:0,release_delay_ms:%d%s%s", DELAY_MS,
                 *c[i].conf ? "," : "", c[i].conf);
        c[i].h = bench_heap(o, conf);
    }
    uint64_t page = stats_of(c[1].h).page_size;
    double delay_ms = setting(c[1].h, "release_delay_ms");
    double tc_age_ms = setting(c[NC - 1].h, "tcache_age_ms");
    for (int i = 0; i < NC; i++) {
        char what[64];
        if (!c[i].h)
            snprintf(what, sizeof what, "a thread's timed wait");
        else if (c[i].live_pages)
            snprintf(what, sizeof what, "%d of %d pages freed, frag %g", FREED_PAGES,
                     FREED_PAGES + c[i].live_pages, setting(c[i].h, "fragmentation_threshold"));
        else if (!strstr(c[i].conf, "tcache:off"))
            snprintf(what, sizeof what, "idle heap, thread caches on");
        else
            snprintf(what, sizeof what, "idle heap (all freed)");
        snprintf(c[i].name, sizeof c[i].name, "delay %.0f ms: %s", delay_ms, what);
        if (c[i].live_pages &&
            cuma_alloc(c[i].h, (size_t)c[i].live_pages * page, NULL, &c[i].live) != CUMA_OK)
            c[i].bad++;
    }
    pthread_mutex_init(&c[0].m, NULL);
    pthread_condattr_t ca;
    pthread_condattr_init(&ca);
    pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
    pthread_cond_init(&c[0].cv, &ca);
    pthread_condattr_destroy(&ca);
    int rounds = delay_ms >= 0 ? rounds_of(o, 20) : 0;
    slack_fine();
    for (int r = 0; r <= rounds && rounds; r++)
        for (int i = 0; i < NC; i++)
            if (!c[i].bad && r <= rounds_of(o, c[i].per_run))
                idle_round(&c[i], (uint64_t)(delay_ms * 1e6), page, r > 0);
    slack_restore();
    for (int i = 0; i < NC; i++) {
        idle_row(&c[i], delay_ms, tc_age_ms, rounds ? rounds_of(o, c[i].per_run) : 0);
        if (c[i].live) cuma_free(c[i].h, c[i].live, NULL);
        cuma_heap_destroy(c[i].h);
    }
    pthread_cond_destroy(&c[0].cv);
    pthread_mutex_destroy(&c[0].m);
}

/* ---- trim ------------------------------------------------------------------------------------ */

/* cuma_trim(heap, 0) of `bytes` of idle pages (nothing goes by age: release_delay_ms:never),
 * timed; the allocation that made the pages is timed too. Thread caches are off, so that the
 * pages are idle before the call: a block in the freeing thread's batch would be given back to
 * the heap by the trim first. With call_us > 0 the device's page calls cost that much host time
 * each, and the reference is those calls: an unmap and a release per page. */
static void run_trim(const bench_opts *o, uint64_t bytes, int call_us) {
    char conf[160], name[96], size[32];
    snprintf(conf, sizeof conf, "sim_clock:real,release_delay_ms:never,tcache:off,sim_call_us:%d",
             call_us);
    cuma_heap *h = bench_heap(o, conf);
    int rounds = rounds_of(o, call_us ? 4 : 20), n = 0, bad = 0;
    double trim[MAXR], per_page[MAXR], alloc_pp[MAXR];
    uint64_t pages = 0;
    for (int r = 0; r < rounds; r++) {
        void *p;
        cuma_stats s0 = stats_of(h);
        uint64_t t0 = bench_now_ns();
        if (cuma_alloc(h, bytes, NULL, &p) != CUMA_OK) {
            bad++;
            continue;
        }
        uint64_t t1 = bench_now_ns();
        bool ok = cuma_free(h, p, NULL) == CUMA_OK;
        cuma_stats s1 = stats_of(h);
        uint64_t t2 = bench_now_ns();
        ok &= cuma_trim(h, 0) == CUMA_OK;
        uint64_t t3 = bench_now_ns();
        cuma_stats s2 = stats_of(h);
        uint64_t made = s1.page_creates - s0.page_creates;
        pages = s2.page_releases - s1.page_releases;
        if (!ok || !pages || !made || s2.reserved_bytes) {
            bad++;
            continue;
        }
        trim[n] = (double)(t3 - t2);
        per_page[n] = trim[n] / (double)pages;
        alloc_pp[n++] = (double)(t1 - t0) / (double)made;
    }
    bench_size_name((size_t)bytes, size, sizeof size);
    snprintf(name, sizeof name, call_us ? "trim %s, sim_call_us:%d" : "trim %s", size, call_us);
    bench_row row = bench_row_make("release", name, "cuma", 1);
    if (n) {
        row.ns_per_op = bench_median(per_page, n);
        row.ops_per_s = 1e9 / row.ns_per_op;
        row.max = bench_quantile(trim, n, 1.0);
        row.p99 = bench_quantile(trim, n, 0.99);
        row.p50 = bench_quantile(trim, n, 0.50);
    }
    double apage = bench_median(alloc_pp, n);
    if (bad)
        snprintf(row.note, sizeof row.note, "%d of %d rounds failed (a call, or pages left)", bad,
                 rounds);
    else if (call_us)
        snprintf(row.note, sizeof row.note,
                 "%llu pages; x%.2f the 2 device calls/page (%d us each); alloc %.0f ns/page",
                 (unsigned long long)pages, row.ns_per_op / (2e3 * call_us), call_us, apage);
    else
        snprintf(row.note, sizeof row.note,
                 "%llu pages; x%.2f the alloc that made them (%.0f ns/page)",
                 (unsigned long long)pages, row.ns_per_op / apage, apage);
    bench_row_add(&row);
    cuma_heap_destroy(h);
}

/* ---- max_cached ------------------------------------------------------------------------------ */

typedef struct capped {
    cuma_heap *h;
    uint64_t rel0, cap;
} capped;

static bool excess_gone(void *ctx) {
    capped *c = ctx;
    cuma_stats s = stats_of(c->h);
    return s.page_releases > c->rel0 && s.cached_bytes <= c->cap;
}

/* A free that takes the cache over max_cached: the time from the free's call until the excess
 * is seen gone (in the free itself when the free's own release policy gives it back), against
 * the same free on a heap without the cap. Nothing goes by age within a round (a delay of a
 * minute, so that the release thread runs: "never" would stop it). With thread caches on, the
 * block waits in the freeing thread's batch first, and the reference is tcache_age_ms. */
static void run_max_cached(const bench_opts *o, bool tcache) {
    char conf[192], name[96];
    const char *base = tcache
                           ? "sim_clock:real,release_thread:on,release_delay_ms:60000"
                           : "sim_clock:real,release_thread:on,release_delay_ms:60000,tcache:off";
    snprintf(conf, sizeof conf, "%s,max_cached:%dM", base, MAX_CACHED_MB);
    capped c = {.h = bench_heap(o, conf)};
    cuma_heap *free_h = bench_heap(o, base);
    uint64_t page = stats_of(c.h).page_size;
    double cap_set = setting(c.h, "max_cached"); /* NAN: --conf made it none */
    c.cap = cap_set >= 0 ? (uint64_t)cap_set : UINT64_MAX;
    int rounds = rounds_of(o, tcache ? 4 : 20), n = 0, at_once = 0, bad = 0, missed = 0;
    double gone[MAXR], plain[MAXR], first = NAN;
    slack_fine();
    /* Round 0 is kept apart, as in the idle-delay rows: a fresh heap's release thread may still
     * sleep as if it had nothing to do. */
    for (int r = 0; r <= rounds; r++) {
        void *p, *q;
        if (cuma_alloc(c.h, FREED_PAGES * page, NULL, &p) != CUMA_OK ||
            cuma_alloc(free_h, FREED_PAGES * page, NULL, &q) != CUMA_OK) {
            bad++;
            break;
        }
        c.rel0 = stats_of(c.h).page_releases;
        uint64_t t0 = bench_now_ns();
        bad += cuma_free(c.h, p, NULL) != CUMA_OK;
        uint64_t t1 = bench_now_ns();
        bool now_gone = excess_gone(&c);
        seen w = {t1, 0};
        if (!now_gone) w = poll_until(excess_gone, &c, t1, t1 + GIVE_UP);
        uint64_t f0 = bench_now_ns();
        bad += cuma_free(free_h, q, NULL) != CUMA_OK;
        uint64_t f1 = bench_now_ns();
        bad += cuma_trim(free_h, 0) != CUMA_OK;
        if (!w.at) cuma_trim(c.h, 0); /* so that the next round starts from the cap */
        if (!r) {
            first = w.at ? (double)(w.at - t0) : NAN;
        } else if (!w.at) {
            missed++;
        } else {
            at_once += now_gone;
            plain[n] = (double)(f1 - f0);
            gone[n++] = (double)(w.at - t0);
        }
    }
    slack_restore();
    char cap[32];
    bench_size_name((size_t)c.cap, cap, sizeof cap);
    snprintf(name, sizeof name, "max_cached %s, %d pages freed%s", cap, FREED_PAGES,
             tcache ? ", tcache on" : "");
    bench_row row = bench_row_make("release", name, "cuma", 1);
    if (n) {
        row.p50 = bench_quantile(gone, n, 0.50);
        row.p99 = bench_quantile(gone, n, 0.99);
        row.max = bench_quantile(gone, n, 1.0);
    }
    if (bad)
        snprintf(row.note, sizeof row.note, "%d calls failed", bad);
    else if (missed)
        snprintf(row.note, sizeof row.note, "%d of %d rounds: the excess stayed (waited 2 s)",
                 missed, rounds);
    else if (tcache)
        snprintf(row.note, sizeof row.note,
                 "from the free's call: x%.2f tcache_age_ms (%.0f); in the free %d/%d; 1st %.0f ms",
                 row.p50 / (setting(c.h, "tcache_age_ms") * 1e6), setting(c.h, "tcache_age_ms"),
                 at_once, rounds, first / 1e6);
    else
        snprintf(row.note, sizeof row.note,
                 "from the free's call; gone in the free %d/%d; uncapped free p50 %.0f ns", at_once,
                 rounds, bench_median(plain, n));
    bench_row_add(&row);
    cuma_heap_destroy(c.h);
    cuma_heap_destroy(free_h);
}

/* ---- the ledger ------------------------------------------------------------------------------ */

/* Waits (2 s at most) until the ledger shows `bytes` idle in the heap of priority `prio` of this
 * process: a heap publishes from its release thread every few ms, and a requester waits only
 * for what the others published they can give. */
static bool published(const char *ledger, int prio, uint64_t bytes) {
    cuma_ledger_entry e[16];
    for (uint64_t until = bench_now_ns() + GIVE_UP; bench_now_ns() < until; sleep_ns(COARSE_NS)) {
        size_t n = 0;
        if (cuma_ledger_snapshot(ledger, e, 16, &n) != CUMA_OK) return false;
        for (size_t i = 0; i < n && i < 16; i++)
            if (e[i].pid == (int)getpid() && e[i].priority == prio && e[i].cached == bytes)
                return true;
    }
    return false;
}

static void ledger_unlink(const char *name) {
    char path[160];
    if (cuma_ledger_path(name, path, sizeof path) == CUMA_OK && !strncmp(path, "/dev/shm/", 9))
        shm_unlink(path + strlen("/dev/shm"));
}

/* Two simulated heaps of one device in a ledger named for this process: the low-priority one
 * holds LOW_HOLDS_MB idle (thread caches off: a block freed into a thread's batch is not idle
 * yet, and in a heap in a ledger it stayed there, seconds on end, at this revision), the
 * high-priority one asks for HIGH_WANTS_MB, of which only LEDGER_CAP_MB - LOW_HOLDS_MB is free.
 * Timed: that allocation call, which waits for the other heap's release thread to answer (it looks
 * at the ledger every CUMA_LEDGER_POLL_NS); the reference is the same allocation once the room is
 * there. */
static void run_ledger(const bench_opts *o) {
    char name[64], conf[256], label[48];
    snprintf(name, sizeof name, "cuma-bench-%d", (int)getpid());
    snprintf(label, sizeof label, "ledger pressure: %d MiB, %d of %d MiB idle", HIGH_WANTS_MB,
             LOW_HOLDS_MB, LEDGER_CAP_MB);
    bench_row row = bench_row_make("release", label, "cuma", 1);
    ledger_unlink(name);
    cuma_heap *lo = NULL, *hi = NULL;
    snprintf(conf, sizeof conf,
             "sim_clock:real,release_thread:on,capacity:%dM,ledger:%s,priority:-1,"
             "release_delay_ms:never,tcache:off",
             LEDGER_CAP_MB, name);
    cuma_status st = bench_heap_try(o, conf, &lo);
    if (!st) {
        snprintf(conf, sizeof conf,
                 "sim_clock:real,release_thread:on,capacity:%dM,ledger:%s,priority:1,"
                 "release_delay_ms:never,pressure_timeout_ms:1000",
                 LEDGER_CAP_MB, name);
        st = bench_heap_try(o, conf, &hi);
    }
    if (st) {
        snprintf(row.note, sizeof row.note, "no ledger: %.80s", cuma_last_error());
        bench_row_add(&row);
        cuma_heap_destroy(lo);
        ledger_unlink(name);
        return;
    }
    int rounds = rounds_of(o, 10), n = 0, unasked = 0;
    const char *why = NULL; /* the step that failed */
    double wait[MAXR], room[MAXR];
    for (int r = 0; r < rounds; r++) {
        void *p, *q;
        if (cuma_alloc(lo, LOW_HOLDS_MB * MiB, NULL, &p) || cuma_free(lo, p, NULL)) {
            why = "the low heap's alloc or free";
            break;
        }
        if (!published(name, -1, LOW_HOLDS_MB * MiB)) {
            why = "the low heap's idle bytes never showed in the ledger";
            break;
        }
        /* The bytes showed just after the low heap's release thread looked at the ledger: asking
         * right away would always wait about one whole poll. The rounds ask at offsets spread
         * over one poll interval instead, as requests that come at any time would. */
        sleep_ns(CUMA_LEDGER_POLL_NS * (uint64_t)r / (uint64_t)rounds);
        uint64_t asks = stats_of(hi).pressure_asks;
        uint64_t t0 = bench_now_ns();
        st = cuma_alloc(hi, HIGH_WANTS_MB * MiB, NULL, &q);
        uint64_t t1 = bench_now_ns();
        if (st) {
            why = "the allocation under pressure";
            break;
        }
        unasked += stats_of(hi).pressure_asks == asks;
        if (cuma_free(hi, q, NULL) || cuma_trim(hi, 0) || cuma_trim(lo, 0)) {
            why = "a free or trim";
            break;
        }
        uint64_t t2 = bench_now_ns();
        st = cuma_alloc(hi, HIGH_WANTS_MB * MiB, NULL, &q);
        uint64_t t3 = bench_now_ns();
        if (st || cuma_free(hi, q, NULL) || cuma_trim(hi, 0)) {
            why = "the allocation with room";
            break;
        }
        wait[n] = (double)(t1 - t0);
        room[n++] = (double)(t3 - t2);
    }
    if (n) {
        row.p50 = bench_quantile(wait, n, 0.50);
        row.p99 = bench_quantile(wait, n, 0.99);
        row.max = bench_quantile(wait, n, 1.0);
    }
    if (why)
        snprintf(row.note, sizeof row.note, "round %d failed: %s", n + 1, why);
    else if (unasked)
        snprintf(row.note, sizeof row.note, "%d of %d allocations did not ask the ledger", unasked,
                 rounds);
    else
        snprintf(row.note, sizeof row.note,
                 "victim looks every %.0f ms; alloc with room p50 %.0f us",
                 (double)CUMA_LEDGER_POLL_NS / 1e6, bench_median(room, n) / 1e3);
    bench_row_add(&row);
    cuma_heap_destroy(hi);
    cuma_heap_destroy(lo);
    ledger_unlink(name);
}

void bench_release(const bench_opts *o) {
    run_idle(o);
    run_trim(o, 64 * MiB, 0);
    run_trim(o, 1024 * MiB, 0);
    run_trim(o, 64 * MiB, 20);
    run_max_cached(o, false);
    run_max_cached(o, true);
    run_ledger(o);
}
