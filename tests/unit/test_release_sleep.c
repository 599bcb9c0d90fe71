// SPDX-License-Identifier: Apache-2.0
/* The release thread's sleep (cuma_release_sleep), on chosen times: how long it sleeps and when
 * its policy runs next, for each thing that shortens a sleep (memory due by age, the thread
 * caches' age, a plan made at an earlier look, the ledger's and the watermark's looks) and the
 * 1 ms floor. Then on a heap on the manual clock: a page freed with a 100 ms delay makes the
 * plan exactly its due time. No thread runs: the times are the test's. */
#include "check.h"
#include "heap/heap.h"
#include "cuma/sim.h"

#include <stdint.h>
#include <stdio.h>

#define MS 1000000ull
#define S  (1000 * MS)
#define T0 (50 * S) /* "now" in most cases */

/* One case: the sleep for `in` from the plan *policy_at, and the plan it leaves. */
static void expect(const char *what, cuma_sleep_in in, uint64_t plan, uint64_t want_wait,
                   uint64_t want_plan) {
    uint64_t at = plan;
    uint64_t w = cuma_release_sleep(&in, &at);
    if (w != want_wait || at != want_plan) {
        fprintf(stderr,
                "test_release_sleep: %s: slept %llu ns, plan +%lld ns; wanted %llu ns, plan "
                "+%lld ns\n",
                what, (unsigned long long)w, (long long)(at - in.now),
                (unsigned long long)want_wait, (long long)(want_plan - in.now));
        CHECK(0);
    }
}

static cuma_sleep_in at(uint64_t now, uint64_t due) {
    return (cuma_sleep_in){.now = now, .age_due = due, .tc_age_ns = INT64_MAX};
}

static void test_cases(void) {
    const uint64_t none = UINT64_MAX;
    expect("nothing due: a look a second", at(T0, none), none, S, T0 + S);
    expect("due in 3 ms", at(T0, T0 + 3 * MS), none, 3 * MS, T0 + 3 * MS);
    expect("due in 2 s: still a look a second", at(T0, T0 + 2 * S), none, S, T0 + S);
    expect("due long ago: the 1 ms floor", at(T0, 1), none, MS, T0 + MS);
    expect("due now: the 1 ms floor", at(T0, T0), none, MS, T0 + MS);
    expect("due in 10 us: the 1 ms floor", at(T0, T0 + 10000), none, MS, T0 + MS);
    cuma_sleep_in tc = at(T0, none);
    tc.tc_age_ns = 10 * MS;
    expect("thread caches of 10 ms: half their age", tc, none, 5 * MS + 1, T0 + 5 * MS + 1);
    tc.tc_age_ns = 4 * S;
    expect("thread caches of 4 s: still a second", tc, none, S, T0 + S);
    tc.tc_age_ns = 0;
    expect("thread caches of 0 ms: the 1 ms floor", tc, none, MS, T0 + MS);
    expect("an earlier plan stands", at(T0, T0 + 50 * MS), T0 + 2 * MS, 2 * MS, T0 + 2 * MS);
    expect("an earlier due time replaces the plan", at(T0, T0 + 3 * MS), T0 + 40 * MS, 3 * MS,
           T0 + 3 * MS);
    expect("a plan already past: the 1 ms floor, the plan kept", at(T0, T0 + 50 * MS), T0 - MS, MS,
           T0 - MS);
    cuma_sleep_in led = at(T0, T0 + 500 * MS);
    led.ledger = true;
    /* The look is short; the plan is not moved by it (once it was, and never came). */
    expect("ledger: a look every 5 ms, the plan kept", led, none, CUMA_LEDGER_POLL_NS,
           T0 + 500 * MS);
    expect("ledger, due in 2 ms", (cuma_sleep_in){T0, T0 + 2 * MS, INT64_MAX, true, false}, none,
           2 * MS, T0 + 2 * MS);
    cuma_sleep_in wm = at(T0, none);
    wm.watermark = true;
    expect("watermark: a look every 10 ms", wm, none, 10 * MS, T0 + S);
    wm.ledger = true;
    expect("ledger and watermark: the shorter look", wm, none, CUMA_LEDGER_POLL_NS, T0 + S);
}

/* The heap's own figures on the manual clock: a page freed at 1 s with release_delay_ms:100 is
 * due at 1.1 s, and a thread looking at 1.03 s sleeps the 70 ms left. */
static void test_manual_clock(void) {
    cuma_heap *h = heap_make("backend:sim,sim_clock:manual,release_delay_ms:100,tcache:off");
    CHECK_OK(cuma_sim_set_time(h, S));
    void *p;
    CHECK_OK(cuma_alloc(h, 4 << 20, 0, &p));
    CHECK_OK(cuma_free(h, p, 0));
    uint64_t due;
    CHECK_OK(cuma_next_release(h, &due));
    CHECK(due == S + 100 * MS);
    CHECK_OK(cuma_sim_set_time(h, S + 30 * MS));
    expect("a page freed on the manual clock", at(S + 30 * MS, due), UINT64_MAX, 70 * MS,
           S + 100 * MS);
    cuma_heap_destroy(h);
}

int main(void) {
    test_cases();
    test_manual_clock();
    puts("test_release_sleep: ok");
    return 0;
}
