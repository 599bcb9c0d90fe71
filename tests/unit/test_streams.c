// SPDX-License-Identifier: Apache-2.0
/* Stream fences (src/place/streams.c) over the simulated device: the stream table, lazy event
 * recording (none until someone asks, one event for many frees), held streams, the event
 * ring, MULTI tags, cuma_fence_join and cuma_streams_validate. */
#include "check.h"
#include "backend/backend.h"
#include "settings/config.h"
#include "place/streams.h"

#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>
#include <string.h>

#define S(x) ((cuma_stream)(uintptr_t)(x))

static cuma_backend *be;

static void setup(cuma_streams *ss) {
    cuma_settings set;
    cuma_settings_default(&set);
    CHECK_OK(cuma_settings_parse(&set, "capacity:64M,page_size:2M,sim_clock:manual", "test"));
    CHECK_OK(cuma_sim_backend_create(&set, &be));
    CHECK_OK(cuma_streams_init(ss, be));
    CHECK(ss->n == 0 && ss->gseq == 0 && ss->events_recorded == 0 && ss->slot);
}

static void teardown(cuma_streams *ss) {
    cuma_streams_destroy(ss);
    CHECK(ss->slot == NULL);
    cuma_streams_destroy(ss); /* twice is harmless */
    be->ops->destroy(be);
    be = NULL;
}

static void validate(const cuma_streams *ss) {
    const char *why = NULL;
    if (!cuma_streams_validate(ss, &why)) {
        fprintf(stderr, "cuma_streams_validate: %s\n", why ? why : "(no reason)");
        CHECK(0);
    }
}

/* A poll as one allocator operation makes it: a new epoch, then the poll (test_epoch tests
 * several polls within one). */
static bool op_poll(cuma_streams *ss, unsigned stream, uint64_t seq, bool wait) {
    cuma_streams_tick(ss, 0);
    return cuma_fence_poll(ss, stream, seq, wait);
}

static void hold(cuma_stream s, bool on) {
    CHECK_OK(cuma_simbe_hold(be, s, on));
}

static void test_table(void) {
    cuma_streams ss;
    setup(&ss);
    CHECK(cuma_streams_index(&ss, NULL) == 0); /* the default stream is a stream */
    CHECK(cuma_streams_index(&ss, S(0x10)) == 1);
    CHECK(cuma_streams_index(&ss, NULL) == 0 && cuma_streams_index(&ss, S(0x10)) == 1);
    CHECK(ss.n == 2 && ss.slot[1].handle == S(0x10));
    CHECK(ss.slot[1].last == 0 && ss.slot[1].done == 0 && ss.slot[1].fenced == 0);
    validate(&ss);
    /* Fill the table. */
    for (unsigned i = 2; i < CUMA_MAX_STREAMS; i++)
        CHECK(cuma_streams_index(&ss, S(0x1000 + i)) == (int)i);
    CHECK(ss.n == CUMA_MAX_STREAMS);
    validate(&ss);
    CHECK(cuma_streams_index(&ss, S(0xdead)) == -1);
    CHECK(cuma_streams_index(&ss, S(0xbeef)) == -1);
    CHECK(ss.n == CUMA_MAX_STREAMS);
    /* Known streams are still found when it is full. */
    CHECK(cuma_streams_index(&ss, NULL) == 0);
    CHECK(cuma_streams_index(&ss, S(0x1000 + CUMA_MAX_STREAMS - 1)) == CUMA_MAX_STREAMS - 1);
    /* Fences work on the last slot too. */
    uint64_t q = cuma_streams_note_free(&ss, CUMA_MAX_STREAMS - 1);
    CHECK(op_poll(&ss, CUMA_MAX_STREAMS - 1, q, false));
    validate(&ss);
    teardown(&ss);
}

static void test_lazy(void) {
    cuma_streams ss;
    setup(&ss);
    unsigned a = (unsigned)cuma_streams_index(&ss, S(0xA)),
             b = (unsigned)cuma_streams_index(&ss, S(0xB));
    /* Frees take increasing heap-wide sequence numbers; nothing is recorded. */
    uint64_t prev = 0;
    for (int i = 0; i < 1000; i++) {
        uint64_t q = cuma_streams_note_free(&ss, i % 3 ? a : b);
        CHECK(q == prev + 1 && q == ss.gseq);
        prev = q;
    }
    CHECK(ss.slot[a].last == 999 && ss.slot[b].last == 1000);
    CHECK(ss.events_recorded == 0);
    CHECK(ss.slot[a].fenced == 0 && ss.slot[a].done == 0 && ss.slot[a].npending == 0);
    validate(&ss);
    /* Tag (any, 0) is clean; known_done does not ask the device. */
    CHECK(cuma_fence_known_done(&ss, a, 0) && cuma_fence_known_done(&ss, CUMA_FENCE_MULTI, 0));
    CHECK(!cuma_fence_known_done(&ss, a, 1));
    CHECK(ss.events_recorded == 0);
    CHECK(op_poll(&ss, a, 0, false)); /* clean: no event */
    CHECK(ss.events_recorded == 0);
    /* One poll records one event, which covers every free on the stream so far. */
    CHECK(op_poll(&ss, a, 2, false));
    CHECK(ss.events_recorded == 1);
    CHECK(ss.slot[a].done == 999 && ss.slot[a].fenced == 999 && ss.slot[a].npending == 0);
    CHECK(ss.slot[b].done == 0 && ss.slot[b].fenced == 0); /* the other stream is untouched */
    for (uint64_t q = 1; q <= 999; q++) CHECK(cuma_fence_known_done(&ss, a, q));
    CHECK(op_poll(&ss, a, 999, false) && op_poll(&ss, a, 500, true));
    CHECK(ss.events_recorded == 1);
    validate(&ss);
    /* More frees: the next poll records again. */
    uint64_t q = cuma_streams_note_free(&ss, a);
    CHECK(!cuma_fence_known_done(&ss, a, q));
    CHECK(op_poll(&ss, a, q, false) && ss.events_recorded == 2 && ss.slot[a].done == q);
    validate(&ss);
    teardown(&ss);
}

static void test_held(void) {
    cuma_streams ss;
    setup(&ss);
    unsigned a = (unsigned)cuma_streams_index(&ss, S(0xA)),
             b = (unsigned)cuma_streams_index(&ss, S(0xB));
    uint64_t q1 = cuma_streams_note_free(&ss, a);
    uint64_t q2 = cuma_streams_note_free(&ss, a);
    uint64_t qb = cuma_streams_note_free(&ss, b);
    uint64_t q3 = cuma_streams_note_free(&ss, a);
    hold(S(0xA), true);
    /* A held stream keeps `done` behind; one event covers q1..q3 and is not recorded twice. */
    CHECK(!op_poll(&ss, a, q1, false));
    CHECK(ss.events_recorded == 1 && ss.slot[a].fenced == q3 && ss.slot[a].npending == 1);
    CHECK(ss.slot[a].done == 0);
    CHECK(!op_poll(&ss, a, q3, false) && !op_poll(&ss, a, q2, false));
    CHECK(ss.events_recorded == 1);
    /* Waiting on a held simulated stream would never end: the poll says not done. */
    CHECK(!op_poll(&ss, a, q1, true));
    CHECK(ss.slot[a].done == 0 && ss.events_recorded == 1);
    validate(&ss);
    /* Other streams are not held. */
    CHECK(op_poll(&ss, b, qb, false) && ss.slot[b].done == qb);
    /* A free after the event needs a second one, also held. */
    uint64_t q4 = cuma_streams_note_free(&ss, a);
    CHECK(!op_poll(&ss, a, q4, false));
    CHECK(ss.events_recorded == 3 && ss.slot[a].npending == 2 && ss.slot[a].fenced == q4);
    validate(&ss);
    /* Released: both events complete at the next poll, without a new one. */
    hold(S(0xA), false);
    CHECK(!cuma_fence_known_done(&ss, a, q1)); /* nobody asked yet */
    CHECK(op_poll(&ss, a, q1, false));
    CHECK(ss.slot[a].done == q4 && ss.slot[a].npending == 0 && ss.events_recorded == 3);
    CHECK(cuma_fence_known_done(&ss, a, q4));
    validate(&ss);
    /* Held again: events recorded before the new hold are complete, later ones are not. */
    uint64_t q5 = cuma_streams_note_free(&ss, a);
    CHECK(op_poll(&ss, a, q5, false)); /* not held: done at once */
    hold(S(0xA), true);
    uint64_t q6 = cuma_streams_note_free(&ss, a);
    CHECK(!op_poll(&ss, a, q6, false));
    CHECK(ss.slot[a].done == q5);
    hold(S(0xA), false);
    CHECK(op_poll(&ss, a, q6, true) && ss.slot[a].done == q6);
    validate(&ss);
    teardown(&ss);
}

/* The ring holds CUMA_FENCE_RING events; beyond it no event is recorded and the tags wait. */
static void test_ring(void) {
    cuma_streams ss;
    setup(&ss);
    unsigned a = (unsigned)cuma_streams_index(&ss, S(0xA));
    hold(S(0xA), true);
    uint64_t qs[CUMA_FENCE_RING + 3];
    for (int i = 0; i < CUMA_FENCE_RING + 3; i++) {
        qs[i] = cuma_streams_note_free(&ss, a);
        CHECK(!op_poll(&ss, a, qs[i], false));
        uint64_t want = i < CUMA_FENCE_RING ? (uint64_t)i + 1 : CUMA_FENCE_RING;
        CHECK(ss.events_recorded == want && ss.slot[a].npending == want);
        validate(&ss);
    }
    CHECK(ss.slot[a].fenced == qs[CUMA_FENCE_RING - 1]);
    hold(S(0xA), false);
    /* The first poll retires the whole ring. */
    CHECK(op_poll(&ss, a, qs[0], false));
    CHECK(ss.slot[a].done >= qs[CUMA_FENCE_RING - 1]);
    validate(&ss);
    CHECK(op_poll(&ss, a, qs[CUMA_FENCE_RING + 2], false));
    CHECK(ss.slot[a].done == qs[CUMA_FENCE_RING + 2] && ss.slot[a].npending == 0);
    CHECK(ss.events_recorded == CUMA_FENCE_RING + 1);
    validate(&ss);
    /* The ring wraps: many more rounds of held events. */
    for (int round = 0; round < 5; round++) {
        hold(S(0xA), true);
        uint64_t last = 0;
        for (int i = 0; i < CUMA_FENCE_RING - 1; i++) {
            last = cuma_streams_note_free(&ss, a);
            CHECK(!op_poll(&ss, a, last, false));
        }
        validate(&ss);
        hold(S(0xA), false);
        CHECK(op_poll(&ss, a, last, false) && ss.slot[a].npending == 0);
        validate(&ss);
    }
    /* Destroy with events still pending releases them (ASan builds see leaks). */
    hold(S(0xA), true);
    CHECK(!op_poll(&ss, a, cuma_streams_note_free(&ss, a), false));
    CHECK(ss.slot[a].npending == 1);
    teardown(&ss);
}

/* Within one epoch the device is asked about a stream's pending work once: a scan over many
 * idle pages of a lagging stream costs one query, not one per page. */
static void test_epoch(void) {
    cuma_streams ss;
    setup(&ss);
    unsigned a = (unsigned)cuma_streams_index(&ss, S(0xA)),
             b = (unsigned)cuma_streams_index(&ss, S(0xB));
    uint64_t q[100];
    for (int i = 0; i < 100; i++) q[i] = cuma_streams_note_free(&ss, i % 2 ? a : b);
    hold(S(0xA), true);
    cuma_streams_tick(&ss, 0);
    CHECK(!cuma_fence_poll(&ss, a, q[1], false));
    uint64_t asked = ss.event_queries, recorded = ss.events_recorded;
    CHECK(asked >= 1 && recorded == 1);
    for (int i = 1; i < 100; i += 2) CHECK(!cuma_fence_poll(&ss, a, q[i], false));
    CHECK(ss.event_queries == asked && ss.events_recorded == recorded);
    /* Other streams are asked as usual. */
    CHECK(cuma_fence_poll(&ss, b, q[98], false) && ss.event_queries > asked);
    asked = ss.event_queries;
    /* The stream completes (and is held again for later work); within the epoch a later tag is
     * still answered from memory, but a wait always asks and sees the completion. */
    hold(S(0xA), false);
    hold(S(0xA), true);
    uint64_t later = cuma_streams_note_free(&ss, a);
    CHECK(!cuma_fence_poll(&ss, a, later, false) && ss.event_queries == asked);
    CHECK(cuma_fence_poll(&ss, a, q[1], true) && ss.event_queries > asked);
    CHECK(ss.slot[a].done == q[99]);
    /* The next operation records an event for the later tag: held, so pending. */
    recorded = ss.events_recorded;
    cuma_streams_tick(&ss, 0);
    CHECK(!cuma_fence_poll(&ss, a, later, false) && ss.events_recorded == recorded + 1);
    validate(&ss);
    hold(S(0xA), false);
    cuma_streams_tick(&ss, 0);
    CHECK(cuma_fence_poll(&ss, a, later, false));
    validate(&ss);
    teardown(&ss);
}

/* sim_lag_ms: the simulated device completes work that long after it was recorded, on the
 * clock it is given (a heap's manual clock). */
static void test_lag(void) {
    cuma_settings set;
    cuma_settings_default(&set);
    CHECK_OK(cuma_settings_parse(&set, "capacity:64M,sim_lag_ms:5", "test"));
    CHECK(set.sim_lag_ms == 5);
    CHECK_OK(cuma_sim_backend_create(&set, &be));
    _Atomic uint64_t clock = 1000000;
    CHECK_OK(cuma_simbe_set_clock(be, &clock));
    cuma_streams ss;
    CHECK_OK(cuma_streams_init(&ss, be));
    unsigned a = (unsigned)cuma_streams_index(&ss, S(0xA));
    uint64_t q = cuma_streams_note_free(&ss, a);
    CHECK(!op_poll(&ss, a, q, false)); /* recorded at 1 ms: due at 6 ms */
    atomic_store(&clock, 5999999);
    CHECK(!op_poll(&ss, a, q, false));
    atomic_store(&clock, 6000000);
    CHECK(op_poll(&ss, a, q, false) && ss.events_recorded == 1);
    /* Waiting completes at once: the host waits, the clock stays. */
    uint64_t q2 = cuma_streams_note_free(&ss, a);
    CHECK(op_poll(&ss, a, q2, true) && ss.slot[a].done == q2 && atomic_load(&clock) == 6000000);
    validate(&ss);
    /* A full ring of pending events and a later tag no event covers: the wait waits for the
     * oldest, records one for the tag and waits for it (it used to give up). */
    for (int i = 0; i < CUMA_FENCE_RING; i++)
        CHECK(!op_poll(&ss, a, cuma_streams_note_free(&ss, a), false));
    CHECK(ss.slot[a].npending == CUMA_FENCE_RING);
    uint64_t q3 = cuma_streams_note_free(&ss, a);
    CHECK(op_poll(&ss, a, q3, true) && ss.slot[a].done == q3);
    validate(&ss);
    teardown(&ss);
}

static void test_multi(void) {
    cuma_streams ss;
    setup(&ss);
    unsigned a = (unsigned)cuma_streams_index(&ss, S(0xA)),
             b = (unsigned)cuma_streams_index(&ss, S(0xB));
    unsigned c = (unsigned)cuma_streams_index(&ss, S(0xC)); /* never frees anything */
    (void)c;
    uint64_t qa = cuma_streams_note_free(&ss, a);
    uint64_t qb = cuma_streams_note_free(&ss, b);
    /* MULTI (seq): every stream's frees up to seq have completed. */
    CHECK(!cuma_fence_known_done(&ss, CUMA_FENCE_MULTI, qb));
    hold(S(0xB), true);
    CHECK(!op_poll(&ss, CUMA_FENCE_MULTI, qb, false));
    CHECK(ss.slot[a].done == qa); /* a was asked too, and is done */
    CHECK(ss.slot[b].done == 0);
    CHECK(ss.events_recorded == 2); /* one per stream with frees, none for c */
    validate(&ss);
    /* A free on a after the tag: the poll's new event on a covers it too. */
    uint64_t qa2 = cuma_streams_note_free(&ss, a);
    CHECK(!cuma_fence_known_done(&ss, CUMA_FENCE_MULTI, qb));
    hold(S(0xB), false);
    CHECK(!cuma_fence_known_done(&ss, CUMA_FENCE_MULTI, qb)); /* nobody asked yet */
    CHECK(op_poll(&ss, CUMA_FENCE_MULTI, qb, false));
    CHECK(ss.slot[b].done == qb && ss.slot[a].done == qa2);
    CHECK(cuma_fence_known_done(&ss, CUMA_FENCE_MULTI, qb));
    CHECK(cuma_fence_known_done(&ss, CUMA_FENCE_MULTI, qa2));
    CHECK(ss.events_recorded == 3);
    validate(&ss);
    /* A stream that frees nothing never holds a MULTI tag back. */
    hold(S(0xC), true);
    uint64_t qa3 = cuma_streams_note_free(&ss, a);
    CHECK(op_poll(&ss, CUMA_FENCE_MULTI, qa3, false));
    teardown(&ss);
}

static void test_join(void) {
    cuma_streams ss;
    setup(&ss);
    unsigned a = (unsigned)cuma_streams_index(&ss, S(0xA)),
             b = (unsigned)cuma_streams_index(&ss, S(0xB));
    uint64_t a1 = cuma_streams_note_free(&ss, a), b1 = cuma_streams_note_free(&ss, b);
    uint64_t a2 = cuma_streams_note_free(&ss, a), b2 = cuma_streams_note_free(&ss, b);
    uint16_t st;
    uint64_t sq;
    /* The other tag is clean: mine stays. */
    st = (uint16_t)a, sq = a1;
    cuma_fence_join(&ss, &st, &sq, (uint16_t)b, 0);
    CHECK(st == a && sq == a1);
    /* Mine is clean: the other's is taken. */
    st = 0, sq = 0;
    cuma_fence_join(&ss, &st, &sq, (uint16_t)b, b1);
    CHECK(st == b && sq == b1);
    /* Both pending on one stream: the later. */
    st = (uint16_t)a, sq = a1;
    cuma_fence_join(&ss, &st, &sq, (uint16_t)a, a2);
    CHECK(st == a && sq == a2);
    st = (uint16_t)a, sq = a2;
    cuma_fence_join(&ss, &st, &sq, (uint16_t)a, a1);
    CHECK(st == a && sq == a2);
    /* Pending on two streams: MULTI with the larger sequence number. */
    st = (uint16_t)a, sq = a2;
    cuma_fence_join(&ss, &st, &sq, (uint16_t)b, b1);
    CHECK(st == CUMA_FENCE_MULTI && sq == a2);
    st = (uint16_t)a, sq = a1;
    cuma_fence_join(&ss, &st, &sq, (uint16_t)b, b2);
    CHECK(st == CUMA_FENCE_MULTI && sq == b2);
    /* MULTI stays MULTI. */
    cuma_fence_join(&ss, &st, &sq, (uint16_t)a, a1);
    CHECK(st == CUMA_FENCE_MULTI && sq == b2);
    st = (uint16_t)a, sq = a1;
    cuma_fence_join(&ss, &st, &sq, CUMA_FENCE_MULTI, b1);
    CHECK(st == CUMA_FENCE_MULTI && sq == b1);
    /* A tag known complete counts as clean, whatever its number. */
    CHECK(op_poll(&ss, a, a1, false) && ss.slot[a].done == a2);
    st = (uint16_t)a, sq = a2;
    cuma_fence_join(&ss, &st, &sq, (uint16_t)b, b1);
    CHECK(st == b && sq == b1);
    st = (uint16_t)b, sq = b2;
    cuma_fence_join(&ss, &st, &sq, (uint16_t)a, a2);
    CHECK(st == b && sq == b2);
    /* The joined tag is complete only when both parts are. */
    uint64_t a3 = cuma_streams_note_free(&ss, a);
    st = (uint16_t)a, sq = a3;
    cuma_fence_join(&ss, &st, &sq, (uint16_t)b, b2);
    CHECK(st == CUMA_FENCE_MULTI);
    hold(S(0xB), true);
    CHECK(!op_poll(&ss, st, sq, false));
    CHECK(ss.slot[a].done == a3); /* a's part is done */
    hold(S(0xB), false);
    CHECK(op_poll(&ss, st, sq, false));
    validate(&ss);
    teardown(&ss);
}

static void test_validate_detects(void) {
    cuma_streams ss;
    setup(&ss);
    unsigned a = (unsigned)cuma_streams_index(&ss, S(0xA));
    (void)cuma_streams_index(&ss, S(0xB));
    hold(S(0xA), true);
    uint64_t q1 = cuma_streams_note_free(&ss, a);
    CHECK(!op_poll(&ss, a, q1, false));
    uint64_t q2 = cuma_streams_note_free(&ss, a);
    CHECK(!op_poll(&ss, a, q2, false));
    validate(&ss);
    cuma_stream_slot saved = ss.slot[a];
    const char *why;
    /* done > fenced */
    ss.slot[a].done = q2 + 1;
    why = NULL;
    CHECK(!cuma_streams_validate(&ss, &why) && why);
    ss.slot[a] = saved;
    /* last > gseq */
    ss.slot[a].last = ss.gseq + 1;
    why = NULL;
    CHECK(!cuma_streams_validate(&ss, &why) && why);
    ss.slot[a] = saved;
    /* ring out of order */
    unsigned h = ss.slot[a].head;
    uint64_t c0 = ss.slot[a].ring[h].covers, c1 = ss.slot[a].ring[(h + 1) % CUMA_FENCE_RING].covers;
    ss.slot[a].ring[h].covers = c1, ss.slot[a].ring[(h + 1) % CUMA_FENCE_RING].covers = c0;
    why = NULL;
    CHECK(!cuma_streams_validate(&ss, &why) && why && strstr(why, "ring"));
    ss.slot[a] = saved;
    /* ring overfull */
    ss.slot[a].npending = CUMA_FENCE_RING + 1;
    why = NULL;
    CHECK(!cuma_streams_validate(&ss, &why) && why);
    ss.slot[a] = saved;
    /* a stream listed twice */
    cuma_stream hb = ss.slot[1].handle;
    ss.slot[1].handle = ss.slot[0].handle;
    why = NULL;
    CHECK(!cuma_streams_validate(&ss, &why) && why && strstr(why, "twice"));
    ss.slot[1].handle = hb;
    validate(&ss);
    hold(S(0xA), false);
    CHECK(op_poll(&ss, a, q2, false));
    validate(&ss);
    teardown(&ss);
}

/* Retirement (cuma_streams_retire): one last event on the stream, a dead slot that matches no
 * handle and records nothing, tags of later frees on it that wait for that event, and the slot
 * taken over by a new stream (the same handle value included) once the event is done. */
static void test_retire(void) {
    cuma_streams ss;
    setup(&ss);
    bool found = true;
    CHECK_OK(cuma_streams_retire(&ss, S(0xA), &found));
    CHECK(!found && ss.n == 0); /* never seen: nothing to do */
    unsigned a = (unsigned)cuma_streams_index(&ss, S(0xA)),
             b = (unsigned)cuma_streams_index(&ss, S(0xB));
    uint64_t qa = cuma_streams_note_free(&ss, a);
    hold(S(0xA), true);
    CHECK_OK(cuma_streams_retire(&ss, S(0xA), &found));
    CHECK(found && ss.slot[a].dead && ss.events_recorded == 1);
    CHECK(ss.slot[a].fenced == ss.slot[a].last && ss.slot[a].last > qa);
    validate(&ss);
    /* A later free of memory allocated on it waits for the last event; nothing new is recorded. */
    uint64_t late = cuma_streams_note_free(&ss, a);
    CHECK(late == ss.slot[a].last);
    CHECK(!op_poll(&ss, a, late, false) && !op_poll(&ss, a, qa, false));
    CHECK(ss.events_recorded == 1);
    /* The handle is gone: its value names a new stream, in a new slot while the old one drains. */
    int a2 = cuma_streams_index(&ss, S(0xA));
    CHECK(a2 == 2 && ss.n == 3 && !ss.slot[a2].dead);
    validate(&ss);
    hold(S(0xA), false);
    CHECK(op_poll(&ss, a, late, false) && cuma_fence_known_done(&ss, a, qa));
    /* Drained: the next new stream takes the slot over, and the old tags stay done. */
    int c = cuma_streams_index(&ss, S(0xC));
    CHECK(c == (int)a && ss.n == 3 && !ss.slot[a].dead && ss.slot[a].handle == S(0xC));
    CHECK(cuma_fence_known_done(&ss, a, late));
    uint64_t qc = cuma_streams_note_free(&ss, a);
    CHECK(qc > late && !cuma_fence_known_done(&ss, a, qc));
    validate(&ss);
    /* A stream per request, 10,000 of them, each with frees, some held while retired: the table
     * stays at a few slots. */
    for (int i = 0; i < 10000; i++) {
        cuma_stream h = S(0x1000 + (i % 3)); /* the driver reuses handle values */
        int k = cuma_streams_index(&ss, h);
        CHECK(k >= 0);
        cuma_streams_note_free(&ss, (unsigned)k);
        if (i % 4 == 0) hold(h, true);
        CHECK_OK(cuma_streams_retire(&ss, h, &found));
        CHECK(found);
        if (i % 4 == 0) hold(h, false);
    }
    CHECK(ss.n <= 6);
    validate(&ss);
    (void)b;
    teardown(&ss);
}

/* One allocator operation orders stream x after tag (y, seq): cuma_fence_order in a new epoch. */
static cuma_status op_order(cuma_streams *ss, unsigned x, unsigned y, uint64_t seq) {
    cuma_streams_tick(ss, 0);
    return cuma_fence_order(ss, x, (uint16_t)y, seq);
}

/* A stream ordered after another's tag is ordered after every earlier tag of it too: the device
 * is asked to wait once, not once per page or ghost of that stream's it takes. A later tag
 * needs a new wait; another waiting stream, and a new stream in a slot taken over, have waited
 * for nothing. */
static void test_order_memo(void) {
    cuma_streams ss;
    setup(&ss);
    unsigned x = (unsigned)cuma_streams_index(&ss, S(0xA)),
             y = (unsigned)cuma_streams_index(&ss, S(0xB)),
             z = (unsigned)cuma_streams_index(&ss, S(0xC));
    hold(S(0xB), true);
    uint64_t q1 = cuma_streams_note_free(&ss, y), q2 = cuma_streams_note_free(&ss, y);
    CHECK_OK(op_order(&ss, x, y, q1));
    CHECK(ss.stream_waits == 1 && !cuma_fence_known_done(&ss, y, q2));
    for (int i = 0; i < 10; i++) { /* the same tags again, in one operation and in later ones */
        CHECK_OK(cuma_fence_order(&ss, x, (uint16_t)y, q2));
        CHECK_OK(op_order(&ss, x, y, q1));
        CHECK_OK(op_order(&ss, x, y, q2));
    }
    CHECK(ss.stream_waits == 1);
    uint64_t q3 = cuma_streams_note_free(&ss, y);
    CHECK_OK(op_order(&ss, x, y, q3)); /* a later tag: not covered */
    CHECK(ss.stream_waits == 2);
    CHECK_OK(op_order(&ss, z, y, q1)); /* z never waited */
    CHECK(ss.stream_waits == 3);
    CHECK_OK(op_order(&ss, x, y, q3));
    CHECK_OK(op_order(&ss, z, y, q2));
    CHECK(ss.stream_waits == 3);
    /* y's events complete and go back to the backend, which hands them out again for newer
     * records: a wait remembered is a tag, not an event. */
    hold(S(0xB), false);
    CHECK(op_poll(&ss, y, q3, false));
    hold(S(0xB), true);
    uint64_t q4 = cuma_streams_note_free(&ss, y);
    CHECK_OK(op_order(&ss, x, y, q4));
    CHECK(ss.stream_waits == 4);
    CHECK_OK(op_order(&ss, x, y, q4));
    CHECK(ss.stream_waits == 4);
    /* x's stream goes; a new one takes its slot over and has waited for nothing. */
    bool found = false;
    CHECK_OK(cuma_streams_retire(&ss, S(0xA), &found));
    CHECK(found && ss.slot[x].dead);
    CHECK(cuma_fence_order(&ss, x, (uint16_t)y, q4) != CUMA_OK); /* a dead stream runs nothing */
    unsigned d = (unsigned)cuma_streams_index(&ss, S(0xD));
    CHECK(d == x && !ss.slot[d].dead);
    CHECK_OK(op_order(&ss, d, y, q4));
    CHECK(ss.stream_waits == 5);
    /* More other streams than the memo holds: those whose tags are done make room first. */
    unsigned o[CUMA_ORDER_MEMO + 2];
    uint64_t t[CUMA_ORDER_MEMO + 2];
    for (unsigned i = 0; i < CUMA_ORDER_MEMO + 2; i++) {
        o[i] = (unsigned)cuma_streams_index(&ss, S(0x100 + 16 * i));
        hold(S(0x100 + 16 * i), true);
        t[i] = cuma_streams_note_free(&ss, o[i]);
    }
    uint64_t w = ss.stream_waits;
    for (int round = 0; round < 3; round++)
        for (unsigned i = 0; i < CUMA_ORDER_MEMO + 2; i++) CHECK_OK(op_order(&ss, z, o[i], t[i]));
    /* Every tag still pending: each round waits for the streams the memo could not keep. */
    CHECK(ss.stream_waits > w + CUMA_ORDER_MEMO + 2);
    for (unsigned i = 0; i < 3; i++) {
        hold(S(0x100 + 16 * i), false);
        CHECK(op_poll(&ss, o[i], t[i], false));
    }
    for (unsigned i = 3; i < CUMA_ORDER_MEMO + 2; i++) CHECK_OK(op_order(&ss, z, o[i], t[i]));
    w = ss.stream_waits;
    for (int round = 0; round < 3; round++)
        for (unsigned i = 3; i < CUMA_ORDER_MEMO + 2; i++) CHECK_OK(op_order(&ss, z, o[i], t[i]));
    CHECK(ss.stream_waits == w);
    for (unsigned i = 3; i < CUMA_ORDER_MEMO + 2; i++) hold(S(0x100 + 16 * i), false);
    hold(S(0xB), false);
    validate(&ss);
    teardown(&ss);
}

int main(void) {
    test_table();
    test_lazy();
    test_held();
    test_ring();
    test_epoch();
    test_lag();
    test_multi();
    test_join();
    test_validate_detects();
    test_retire();
    test_order_memo();
    printf("test_streams: all passed\n");
    return 0;
}
