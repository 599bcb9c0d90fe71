// SPDX-License-Identifier: Apache-2.0
/* Physical pages under the virtual range (src/phys/pages.c) on a host-backed simulated device of
 * 32 pages of 2 MiB under a 128-page virtual range: reference counts, the idle cache and reuse
 * in place, stealing an idle page for another virtual page, release by age and by cache cap,
 * the page limit, fences that keep a page, pinned (preallocated) pages, data that survives a
 * move, and random operations against a shadow count per page. cuma_pages_validate runs after
 * every step. */
#include "check.h"
#include "backend/backend.h"
#include "settings/config.h"
#include "phys/pages.h"
#include "place/streams.h"

#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>
#include <string.h>

#define P     (2ull * 1024 * 1024)
#define NPHYS 32u
#define NVA   128u
#define S(x)  ((cuma_stream)(uintptr_t)(x))

typedef struct env {
    cuma_backend *be;
    cuma_streams ss;
    cuma_pages pp;
    uint64_t base;
} env;

static void setup_with(env *e, const char *extra) {
    memset(e, 0, sizeof *e);
    cuma_settings set;
    cuma_settings_default(&set);
    CHECK_OK(cuma_settings_parse(&set, "capacity:64M,page_size:2M,host_backing:on,sim_clock:manual",
                                 "test"));
    CHECK_OK(cuma_settings_parse(&set, extra, "test"));
    CHECK_OK(cuma_sim_backend_create(&set, &e->be));
    CHECK(e->be->page_size == P && e->be->capacity == NPHYS * P);
    CHECK_OK(cuma_streams_init(&e->ss, e->be));
    CHECK_OK(e->be->ops->reserve(e->be, NVA * P, P, &e->base));
    CHECK(e->base % P == 0);
    CHECK_OK(cuma_pages_init(&e->pp, e->be, &e->ss, e->base, NVA * P));
    CHECK(e->pp.nva == NVA && e->pp.page_size == P && e->pp.limit_pages == UINT64_MAX);
}

static void setup(env *e) {
    setup_with(e, "");
}

static uint64_t device_free(env *e) {
    uint64_t fr, tot;
    CHECK_OK(e->be->ops->mem_info(e->be, &fr, &tot));
    CHECK(tot == NPHYS * P);
    return fr;
}

static void validate(env *e) {
    const char *why = NULL;
    if (!cuma_pages_validate(&e->pp, &why)) {
        fprintf(stderr, "cuma_pages_validate: %s\n", why ? why : "(no reason)");
        CHECK(0);
    }
    const cuma_pages *pp = &e->pp;
    CHECK(pp->nreserved == pp->nmapped + pp->ncached);
    CHECK(pp->creates - pp->releases == pp->nreserved);
    CHECK(device_free(e) == (NPHYS - pp->nreserved) * P);
}

static void teardown(env *e) {
    validate(e);
    cuma_pages_destroy(&e->pp);
    CHECK(device_free(e) == NPHYS * P); /* every page went back */
    e->be->ops->unreserve(e->be, e->base, NVA * P);
    cuma_streams_destroy(&e->ss);
    e->be->ops->destroy(e->be);
}

typedef struct counts {
    uint64_t creates, releases, maps, unmaps, nreserved, nmapped, ncached;
} counts;

static counts get_counts(const env *e) {
    const cuma_pages *pp = &e->pp;
    return (counts){pp->creates,   pp->releases, pp->maps,   pp->unmaps,
                    pp->nreserved, pp->nmapped,  pp->ncached};
}

static bool same_counts(counts a, counts b) {
    return !memcmp(&a, &b, sizeof a);
}

static void hold(env *e, cuma_stream s, bool on) {
    CHECK_OK(cuma_simbe_hold(e->be, s, on));
}

/* Physical slot mapped at virtual page v, or CUMA_NIL. */
static uint32_t slot_at(const env *e, uint32_t v) {
    return e->pp.phys_of[v] ? e->pp.phys_of[v] - 1 : CUMA_NIL;
}

/* Whether the slot is in the cache, by walking the list. */
static bool in_cache(const env *e, uint32_t slot) {
    for (uint32_t i = e->pp.head; i != CUMA_NIL; i = e->pp.phys[i].next)
        if (i == slot) return true;
    return false;
}

/* The k-th oldest age of the idle memory. */
static uint64_t age_of(const env *e, uint64_t k) {
    CHECK(k < e->pp.nages);
    return e->pp.ages[(e->pp.age_lo + k) % e->pp.capslots];
}

static void test_ref_unref(void) {
    env e;
    setup(&e);
    validate(&e);
    CHECK(cuma_pages_oldest_idle(&e.pp) == UINT64_MAX);
    /* One byte backs one page. */
    CHECK_OK(cuma_pages_ref(&e.pp, 0, 1, 0, CUMA_PAGES_NO_STREAM));
    CHECK(e.pp.live[0] == 1 && e.pp.phys_of[0] && e.pp.nmapped == 1 && e.pp.nreserved == 1);
    CHECK(e.pp.creates == 1 && e.pp.maps == 1 && e.pp.ncached == 0);
    validate(&e);
    /* [P/2, 5P/2) spans pages 0, 1 and 2. */
    CHECK_OK(cuma_pages_ref(&e.pp, P / 2, 2 * P, 0, CUMA_PAGES_NO_STREAM));
    CHECK(e.pp.live[0] == 2 && e.pp.live[1] == 1 && e.pp.live[2] == 1 && e.pp.live[3] == 0);
    CHECK(e.pp.creates == 3 && e.pp.maps == 3 && e.pp.nmapped == 3 && e.pp.unmaps == 0);
    validate(&e);
    /* Exactly page-sized ranges touch no neighbour. */
    CHECK_OK(cuma_pages_ref(&e.pp, 4 * P, P, 0, CUMA_PAGES_NO_STREAM));
    CHECK(e.pp.live[3] == 0 && e.pp.live[4] == 1 && e.pp.live[5] == 0 && e.pp.nmapped == 4);
    validate(&e);
    /* Dropping one of two references keeps the page. */
    cuma_pages_unref(&e.pp, 0, 1, 1, 0, 0);
    CHECK(e.pp.live[0] == 1 && e.pp.nmapped == 4 && e.pp.ncached == 0);
    validate(&e);
    /* The last reference gone, pages idle in the cache, still mapped where they were. */
    uint32_t s0 = slot_at(&e, 0), s1 = slot_at(&e, 1), s2 = slot_at(&e, 2);
    cuma_pages_unref(&e.pp, P / 2, 2 * P, 2, 0, 0);
    CHECK(e.pp.live[0] == 0 && e.pp.live[1] == 0 && e.pp.live[2] == 0);
    CHECK(e.pp.nmapped == 1 && e.pp.ncached == 3 && e.pp.nreserved == 4 && e.pp.unmaps == 0);
    CHECK(slot_at(&e, 0) == s0 && slot_at(&e, 1) == s1 && slot_at(&e, 2) == s2);
    CHECK(in_cache(&e, s0) && in_cache(&e, s1) && in_cache(&e, s2));
    CHECK(e.pp.phys[s0].idle_since == 2 && cuma_pages_oldest_idle(&e.pp) == 2);
    validate(&e);
    cuma_pages_unref(&e.pp, 4 * P, P, 3, 0, 0);
    CHECK(e.pp.nmapped == 0 && e.pp.ncached == 4);
    CHECK(cuma_pages_oldest_idle(&e.pp) == 2);
    validate(&e);
    teardown(&e);
}

static void test_reuse_in_place_and_steal(void) {
    env e;
    setup(&e);
    /* Pages 0..3 idle, freed one by one so their ages differ: page 3 is the newest. */
    CHECK_OK(cuma_pages_ref(&e.pp, 0, 4 * P, 0, CUMA_PAGES_NO_STREAM));
    for (uint32_t v = 0; v < 4; v++) cuma_pages_unref(&e.pp, (uint64_t)v * P, P, 10 + v, 0, 0);
    CHECK(e.pp.head == slot_at(&e, 3) && e.pp.tail == slot_at(&e, 0));
    validate(&e);
    counts c0 = get_counts(&e);
    uint32_t s1 = slot_at(&e, 1), s3 = slot_at(&e, 3);
    /* Reuse in place: no create, no map. */
    CHECK_OK(cuma_pages_ref(&e.pp, P, 100, 20, CUMA_PAGES_NO_STREAM));
    counts c1 = get_counts(&e);
    CHECK(c1.creates == c0.creates && c1.maps == c0.maps && c1.unmaps == c0.unmaps);
    CHECK(c1.nmapped == 1 && c1.ncached == 3 && slot_at(&e, 1) == s1 && !in_cache(&e, s1));
    /* The cache still ages as if the newest page had been taken: the idle memory's ages are
     * 10, 11 and 12, while pages 0, 2 and 3 stay idle where they are. */
    CHECK(age_of(&e, 0) == 10 && age_of(&e, 1) == 11 && age_of(&e, 2) == 12);
    CHECK(e.pp.phys[s3].idle_since == 13 && in_cache(&e, s3));
    CHECK(cuma_pages_oldest_idle(&e.pp) == 10);
    validate(&e);
    /* Reuse of the newest page in place. */
    CHECK_OK(cuma_pages_ref(&e.pp, 3 * P, P, 21, CUMA_PAGES_NO_STREAM));
    CHECK(e.pp.maps == c0.maps && slot_at(&e, 3) == s3 && !in_cache(&e, s3));
    validate(&e);
    /* A virtual page without a page steals the oldest idle one: unmap + map, no create. */
    uint32_t victim = e.pp.tail;
    uint32_t victim_va = e.pp.phys[victim].va;
    CHECK(victim_va == 2 || victim_va == 0);
    CHECK_OK(cuma_pages_ref(&e.pp, 10 * P, 1, 22, CUMA_PAGES_NO_STREAM));
    counts c2 = get_counts(&e);
    CHECK(c2.creates == c0.creates && c2.maps == c0.maps + 1 && c2.unmaps == c0.unmaps + 1);
    CHECK(slot_at(&e, 10) == victim && slot_at(&e, victim_va) == CUMA_NIL);
    CHECK(e.pp.phys[victim].va == 10);
    validate(&e);
    /* The last idle page goes the same way, then the cache is empty and a page is created. */
    CHECK_OK(cuma_pages_ref(&e.pp, 11 * P, 1, 23, CUMA_PAGES_NO_STREAM));
    CHECK(e.pp.ncached == 0 && e.pp.creates == c0.creates && e.pp.unmaps == c0.unmaps + 2);
    CHECK_OK(cuma_pages_ref(&e.pp, 12 * P, 1, 24, CUMA_PAGES_NO_STREAM));
    CHECK(e.pp.creates == c0.creates + 1 && e.pp.maps == c0.maps + 3);
    CHECK(e.pp.nmapped == 5 && e.pp.nreserved == 5);
    validate(&e);
    /* An idle page whose virtual page was stolen is not reused in place: it has none. */
    cuma_pages_unref(&e.pp, 10 * P, 1, 30, 0, 0);
    CHECK(slot_at(&e, 10) == victim && in_cache(&e, victim));
    CHECK_OK(cuma_pages_ref(&e.pp, victim_va * P, 1, 31, CUMA_PAGES_NO_STREAM));
    CHECK(slot_at(&e, victim_va) == victim && slot_at(&e, 10) == CUMA_NIL);
    validate(&e);
    teardown(&e);
}

/* A steal moves the oldest idle page (likeliest to have no work pending) but the cache keeps
 * aging as if the newest had been reused: otherwise memory used again and again within the
 * release delay would keep an old peak's pages young for as long as the load goes on. The
 * pages released are still the coldest ones. */
static void test_steal_keeps_ages(void) {
    env e;
    setup(&e);
    CHECK_OK(cuma_pages_ref(&e.pp, 0, 4 * P, 0, CUMA_PAGES_NO_STREAM));
    for (uint32_t v = 0; v < 4; v++) cuma_pages_unref(&e.pp, (uint64_t)v * P, P, 10 + v, 0, 0);
    uint32_t oldest = e.pp.tail, newest = e.pp.head;
    CHECK(oldest == slot_at(&e, 0) && newest == slot_at(&e, 3));
    /* Virtual page 10 has no page: the oldest one moves there, no page is created. */
    CHECK_OK(cuma_pages_ref(&e.pp, 10 * P, 1, 20, CUMA_PAGES_NO_STREAM));
    CHECK(slot_at(&e, 10) == oldest && e.pp.creates == 4 && e.pp.ncached == 3);
    CHECK(!in_cache(&e, oldest) && in_cache(&e, newest));
    /* Idle ages left: 10, 11, 12 (13, the newest, counts as reused). */
    CHECK(cuma_pages_oldest_idle(&e.pp) == 10);
    CHECK(age_of(&e, 0) == 10 && age_of(&e, 1) == 11 && age_of(&e, 2) == 12);
    uint32_t cold = e.pp.tail;
    CHECK(cold == slot_at(&e, 1) && e.pp.phys[newest].idle_since == 13);
    validate(&e);
    /* Load that comes and goes inside the delay: the page goes back and forth. */
    for (uint64_t t = 30; t < 1000; t += 100) {
        cuma_pages_unref(&e.pp, 10 * P, 1, t, 0, 0);
        CHECK_OK(cuma_pages_ref(&e.pp, 10 * P, 1, t + 50, CUMA_PAGES_NO_STREAM));
        validate(&e);
    }
    /* The peak's idle memory ages out one delay after it went idle, not after the last reuse,
     * and the page that goes is the coldest (virtual page 1's, idle since 11). */
    CHECK(cuma_pages_release(&e.pp, 1009, 1000, UINT64_MAX, 0, false) == 0);
    CHECK(cuma_pages_release(&e.pp, 1010, 1000, UINT64_MAX, 0, false) == 1);
    CHECK(slot_at(&e, 1) == CUMA_NIL && slot_at(&e, 3) == newest && in_cache(&e, newest));
    CHECK(cuma_pages_oldest_idle(&e.pp) == 11);
    CHECK(cuma_pages_release(&e.pp, 1012, 1000, UINT64_MAX, 0, false) == 2);
    CHECK(e.pp.ncached == 0 && e.pp.nmapped == 1 && e.pp.nreserved == 1);
    validate(&e);
    teardown(&e);
}

/* Pinned (preallocated) idle pages never go back, so their age does not count: a page idle for
 * less than the delay stays, however long the pinned ones have idled. */
static void test_pinned_pages_hold_no_age(void) {
    env e;
    setup(&e);
    CHECK_OK(cuma_pages_prefill(&e.pp, 2, 0));
    CHECK(e.pp.ncached == 2 && cuma_pages_oldest_idle(&e.pp) == UINT64_MAX);
    CHECK_OK(cuma_pages_ref(&e.pp, 0, 3 * P, 100, CUMA_PAGES_NO_STREAM)); /* 2 pinned + 1 new */
    CHECK(e.pp.creates == 3 && e.pp.ncached == 0);
    CHECK(e.pp.phys[slot_at(&e, 0)].pinned && e.pp.phys[slot_at(&e, 1)].pinned);
    cuma_pages_unref(&e.pp, 0, 2 * P, 200, 0, 0); /* the pinned pages idle first */
    cuma_pages_unref(&e.pp, 2 * P, P, 500, 0, 0);
    CHECK(e.pp.ncached == 3 && cuma_pages_oldest_idle(&e.pp) == 500);
    validate(&e);
    CHECK(cuma_pages_release(&e.pp, 1200, 1000, UINT64_MAX, 0, false) == 0);
    CHECK(cuma_pages_release(&e.pp, 1500, 1000, UINT64_MAX, 0, false) == 1);
    CHECK(e.pp.ncached == 2 && e.pp.npinned == 2 && slot_at(&e, 2) == CUMA_NIL);
    validate(&e);
    teardown(&e);
}

static void test_release(void) {
    env e;
    setup(&e);
    /* Six idle pages with ages 100..600. */
    CHECK_OK(cuma_pages_ref(&e.pp, 0, 6 * P, 0, CUMA_PAGES_NO_STREAM));
    for (uint32_t v = 0; v < 6; v++)
        cuma_pages_unref(&e.pp, (uint64_t)v * P, P, 100 * (v + 1), 0, 0);
    validate(&e);
    CHECK(cuma_pages_oldest_idle(&e.pp) == 100);
    /* By age: nothing before its delay has passed. */
    CHECK(cuma_pages_release(&e.pp, 149, 50, UINT64_MAX, 0, false) == 0);
    CHECK(cuma_pages_release(&e.pp, 10000, -1, UINT64_MAX, 0, false) == 0); /* never by age */
    CHECK(cuma_pages_release(&e.pp, 50, 0, UINT64_MAX, 0, false) == 0);     /* clock before idle */
    CHECK(e.pp.nreserved == 6 && e.pp.releases == 0);
    validate(&e);
    CHECK(cuma_pages_release(&e.pp, 150, 50, UINT64_MAX, 0, false) == 1); /* exactly the delay */
    CHECK(slot_at(&e, 0) == CUMA_NIL && slot_at(&e, 1) != CUMA_NIL);
    CHECK(e.pp.releases == 1 && e.pp.unmaps == 1 && e.pp.nreserved == 5 && e.pp.ncached == 5);
    CHECK(cuma_pages_oldest_idle(&e.pp) == 200);
    validate(&e);
    CHECK(cuma_pages_release(&e.pp, 400, 100, UINT64_MAX, 0, false) == 2); /* ages 200 and 300 */
    CHECK(slot_at(&e, 1) == CUMA_NIL && slot_at(&e, 2) == CUMA_NIL && slot_at(&e, 3) != CUMA_NIL);
    CHECK(cuma_pages_oldest_idle(&e.pp) == 400);
    validate(&e);
    /* By cache cap: the oldest go until at most max_cached idle pages remain. */
    CHECK(cuma_pages_release(&e.pp, 400, -1, 3, 0, false) == 0);
    CHECK(cuma_pages_release(&e.pp, 400, -1, 2, 0, false) == 1);
    CHECK(slot_at(&e, 3) == CUMA_NIL && slot_at(&e, 4) != CUMA_NIL && e.pp.ncached == 2);
    validate(&e);
    /* Both rules at once: age takes page 4 (500), the cap would leave one anyway. */
    CHECK(cuma_pages_release(&e.pp, 1000, 500, 1, 0, false) == 1);
    CHECK(slot_at(&e, 4) == CUMA_NIL && slot_at(&e, 5) != CUMA_NIL);
    validate(&e);
    /* Mapped pages are never released. */
    CHECK_OK(cuma_pages_ref(&e.pp, 20 * P, 2 * P, 1000, CUMA_PAGES_NO_STREAM));
    CHECK(e.pp.creates == 7); /* page 20 took page 5's idle page, page 21 a new one */
    CHECK(cuma_pages_release(&e.pp, 1u << 30, 0, 0, 0, true) == 0);
    CHECK(e.pp.nreserved == 2 && e.pp.nmapped == 2 && e.pp.ncached == 0);
    CHECK(cuma_pages_oldest_idle(&e.pp) == UINT64_MAX);
    validate(&e);
    cuma_pages_unref(&e.pp, 20 * P, 2 * P, 2000, 0, 0);
    CHECK(cuma_pages_release(&e.pp, 2000, 0, UINT64_MAX, 0, false) == 2);
    CHECK(e.pp.nreserved == 0 && e.pp.creates == e.pp.releases && e.pp.creates == 7);
    validate(&e);
    teardown(&e);
}

static void test_limit(void) {
    env e;
    setup(&e);
    e.pp.limit_pages = 2;
    e.pp.limit_is_device = false;
    counts c0 = get_counts(&e);
    CHECK_ST(cuma_pages_ref(&e.pp, 0, 3 * P, 0, CUMA_PAGES_NO_STREAM), CUMA_ERR_LIMIT);
    CHECK(strstr(cuma_last_error(), "limit"));
    CHECK(same_counts(get_counts(&e), c0) && e.pp.live[0] == 0 && e.pp.live[2] == 0);
    validate(&e);
    e.pp.limit_is_device = true;
    CHECK_ST(cuma_pages_ref(&e.pp, 0, 3 * P, 0, CUMA_PAGES_NO_STREAM), CUMA_ERR_OOM);
    CHECK(same_counts(get_counts(&e), c0));
    e.pp.limit_is_device = false;
    /* Up to the limit. */
    CHECK_OK(cuma_pages_ref(&e.pp, 0, 2 * P, 0, CUMA_PAGES_NO_STREAM));
    counts c1 = get_counts(&e);
    CHECK(c1.nreserved == 2);
    CHECK_ST(cuma_pages_ref(&e.pp, 4 * P, 1, 0, CUMA_PAGES_NO_STREAM), CUMA_ERR_LIMIT);
    /* A request overlapping mapped pages only needs the new ones. */
    CHECK_OK(cuma_pages_ref(&e.pp, P, P, 0, CUMA_PAGES_NO_STREAM));
    CHECK_ST(cuma_pages_ref(&e.pp, P, 2 * P, 0, CUMA_PAGES_NO_STREAM), CUMA_ERR_LIMIT);
    CHECK(e.pp.live[1] == 2 && e.pp.live[2] == 0);
    cuma_pages_unref(&e.pp, P, P, 0, 0, 0);
    CHECK(same_counts(get_counts(&e), c1));
    validate(&e);
    /* Idle pages count against the limit only when they cannot be reused: here they can. */
    cuma_pages_unref(&e.pp, 0, 2 * P, 1, 0, 0);
    CHECK_OK(cuma_pages_ref(&e.pp, 8 * P, 2 * P, 2, CUMA_PAGES_NO_STREAM));
    CHECK(e.pp.nreserved == 2 && e.pp.creates == 2 && e.pp.unmaps == 2);
    validate(&e);
    /* Idle pages waiting on a held stream cannot be stolen: the limit is hit, nothing moves. */
    unsigned a = (unsigned)cuma_streams_index(&e.ss, S(0xA));
    hold(&e, S(0xA), true);
    uint64_t q = cuma_streams_note_free(&e.ss, a);
    cuma_pages_unref(&e.pp, 8 * P, 2 * P, 3, (uint16_t)a, q);
    counts c2 = get_counts(&e);
    CHECK_ST(cuma_pages_ref(&e.pp, 0, 1, 4, CUMA_PAGES_NO_STREAM), CUMA_ERR_LIMIT);
    CHECK(same_counts(get_counts(&e), c2) && e.pp.live[0] == 0);
    validate(&e);
    /* Reuse in place needs no fence. */
    CHECK_OK(cuma_pages_ref(&e.pp, 8 * P, 1, 5, CUMA_PAGES_NO_STREAM));
    CHECK(e.pp.maps == c2.maps && e.pp.live[8] == 1);
    cuma_pages_unref(&e.pp, 8 * P, 1, 6, (uint16_t)a, cuma_streams_note_free(&e.ss, a));
    validate(&e);
    /* Released, the stream's pages can move. */
    hold(&e, S(0xA), false);
    CHECK_OK(cuma_pages_ref(&e.pp, 0, 1, 7, CUMA_PAGES_NO_STREAM));
    CHECK(e.pp.unmaps == c2.unmaps + 1 && e.pp.maps == c2.maps + 1 && e.pp.creates == c2.creates);
    validate(&e);
    /* Lowering the limit below what is held: nothing new, but what is held stays valid. */
    e.pp.limit_pages = 1;
    CHECK_ST(cuma_pages_ref(&e.pp, 30 * P, 1, 8, CUMA_PAGES_NO_STREAM), CUMA_ERR_LIMIT);
    cuma_pages_unref(&e.pp, 0, 1, 9, 0, 0);
    CHECK(cuma_pages_release(&e.pp, 9, -1, 0, 0, true) == 2);
    CHECK_OK(cuma_pages_ref(&e.pp, 30 * P, 1, 10, CUMA_PAGES_NO_STREAM));
    validate(&e);
    cuma_pages_unref(&e.pp, 30 * P, 1, 11, 0, 0);
    e.pp.limit_pages = UINT64_MAX;

    /* The device itself is full: CUMA_ERR_OOM from the backend, this call's references
     * undone; the pages it created stay in the cache. */
    CHECK(cuma_pages_release(&e.pp, 11, 0, 0, 0, true) == 1);
    CHECK(e.pp.nreserved == 0);
    CHECK_OK(cuma_pages_ref(&e.pp, 100 * P, 1, 12, CUMA_PAGES_NO_STREAM));
    CHECK_ST(cuma_pages_ref(&e.pp, 0, NPHYS * P, 13, CUMA_PAGES_NO_STREAM), CUMA_ERR_OOM);
    CHECK(e.pp.nmapped == 1 && e.pp.live[100] == 1);
    for (uint32_t v = 0; v < NPHYS; v++) CHECK(e.pp.live[v] == 0);
    CHECK(e.pp.nreserved == NPHYS && e.pp.ncached == NPHYS - 1 && device_free(&e) == 0);
    validate(&e);
    /* One page fewer fits, from the cache alone. */
    uint64_t creates = e.pp.creates;
    CHECK_OK(cuma_pages_ref(&e.pp, 0, (NPHYS - 1) * P, 14, CUMA_PAGES_NO_STREAM));
    CHECK(e.pp.creates == creates && e.pp.nmapped == NPHYS && e.pp.ncached == 0);
    validate(&e);
    teardown(&e);
}

/* A page whose fence is incomplete is neither stolen nor released until its stream is. */
static void test_fences(void) {
    env e;
    setup(&e);
    unsigned a = (unsigned)cuma_streams_index(&e.ss, S(0xA));
    unsigned b = (unsigned)cuma_streams_index(&e.ss, S(0xB));
    CHECK_OK(cuma_pages_ref(&e.pp, 0, 2 * P, 0, CUMA_PAGES_NO_STREAM));
    uint32_t s0 = slot_at(&e, 0), s1 = slot_at(&e, 1);
    hold(&e, S(0xA), true);
    /* Page 0 freed on held stream a; page 1 freed on b, which completes. */
    cuma_pages_unref(&e.pp, 0, P, 1, (uint16_t)a, cuma_streams_note_free(&e.ss, a));
    cuma_pages_unref(&e.pp, P, P, 2, (uint16_t)b, cuma_streams_note_free(&e.ss, b));
    CHECK(e.pp.phys[s0].fence_stream == a && e.pp.phys[s0].fence_seq != 0);
    validate(&e);
    /* Page 1's page is the newest idle one and its fence completes: it is stolen. */
    CHECK_OK(cuma_pages_ref(&e.pp, 5 * P, 1, 3, CUMA_PAGES_NO_STREAM));
    CHECK(slot_at(&e, 5) == s1 && slot_at(&e, 0) == s0);
    CHECK_OK(cuma_pages_ref(&e.pp, 6 * P, 1, 4,
                            CUMA_PAGES_NO_STREAM)); /* page 0's is held: a new page */
    CHECK(slot_at(&e, 6) != s0 && slot_at(&e, 0) == s0 && e.pp.creates == 3);
    validate(&e);
    /* Release by age, by cap, even with wait: the held page stays. */
    CHECK(cuma_pages_release(&e.pp, 1000, 0, 0, 0, false) == 0);
    CHECK(cuma_pages_release(&e.pp, 1000, 0, 0, 0, true) == 0);
    CHECK(slot_at(&e, 0) == s0 && e.pp.ncached == 1);
    validate(&e);
    /* A page freed on two streams waits for both. */
    cuma_pages_unref(&e.pp, 5 * P, 1, 10, (uint16_t)b, cuma_streams_note_free(&e.ss, b));
    CHECK_OK(cuma_pages_ref(&e.pp, 5 * P, 1, 11, CUMA_PAGES_NO_STREAM));
    cuma_pages_unref(&e.pp, 5 * P, 1, 12, (uint16_t)a, cuma_streams_note_free(&e.ss, a));
    CHECK(cuma_pages_release(&e.pp, 1000, 0, 0, 0, true) == 0);
    validate(&e);
    /* Released: both pages go. */
    hold(&e, S(0xA), false);
    CHECK(cuma_pages_release(&e.pp, 1000, 0, 0, 0, false) == 2);
    CHECK(slot_at(&e, 0) == CUMA_NIL && slot_at(&e, 5) == CUMA_NIL && e.pp.nreserved == 1);
    validate(&e);
    /* MULTI: a page freed by a on a held stream and by b. */
    CHECK_OK(cuma_pages_ref(&e.pp, 40 * P, 1, 20, CUMA_PAGES_NO_STREAM));
    CHECK_OK(cuma_pages_ref(&e.pp, 40 * P, 1, 20, CUMA_PAGES_NO_STREAM));
    hold(&e, S(0xB), true);
    cuma_pages_unref(&e.pp, 40 * P, 1, 21, (uint16_t)a, cuma_streams_note_free(&e.ss, a));
    cuma_pages_unref(&e.pp, 40 * P, 1, 22, (uint16_t)b, cuma_streams_note_free(&e.ss, b));
    uint32_t s40 = slot_at(&e, 40);
    CHECK(e.pp.phys[s40].fence_stream == CUMA_FENCE_MULTI);
    CHECK(cuma_pages_release(&e.pp, 1000, 0, 0, 0, true) == 0);
    CHECK_OK(cuma_pages_ref(&e.pp, 41 * P, 1, 23, CUMA_PAGES_NO_STREAM));
    CHECK(slot_at(&e, 41) != s40 && slot_at(&e, 40) == s40);
    hold(&e, S(0xB), false);
    CHECK(cuma_pages_release(&e.pp, 1000, 0, 0, 0, false) == 1);
    CHECK(slot_at(&e, 40) == CUMA_NIL);
    validate(&e);
    teardown(&e);
}

/* With host backing, a page's bytes move with it. */
static void test_data_survives(void) {
    env e;
    setup(&e);
    CHECK(e.be->caps & CUMA_CAP_HOST_ACCESS);
    CHECK_OK(cuma_pages_ref(&e.pp, 2 * P, P, 0, CUMA_PAGES_NO_STREAM));
    uint64_t *w = (uint64_t *)(uintptr_t)(e.base + 2 * P);
    for (size_t i = 0; i < P / 8; i++) w[i] = 0x5EED0000ull + i * 0x9E3779B9ull;
    cuma_pages_unref(&e.pp, 2 * P, P, 1, 0, 0);
    /* Idle in place: still readable where it was. */
    CHECK(w[0] == 0x5EED0000ull && w[P / 8 - 1] == 0x5EED0000ull + (P / 8 - 1) * 0x9E3779B9ull);
    uint32_t s = slot_at(&e, 2);
    counts c0 = get_counts(&e);
    CHECK_OK(cuma_pages_ref(&e.pp, 7 * P, P, 2, CUMA_PAGES_NO_STREAM));
    CHECK(slot_at(&e, 7) == s && slot_at(&e, 2) == CUMA_NIL);
    CHECK(e.pp.maps == c0.maps + 1 && e.pp.unmaps == c0.unmaps + 1 && e.pp.creates == c0.creates);
    const uint64_t *r = (const uint64_t *)(uintptr_t)(e.base + 7 * P);
    for (size_t i = 0; i < P / 8; i++) CHECK(r[i] == 0x5EED0000ull + i * 0x9E3779B9ull);
    validate(&e);
    /* Released and created again, a page starts zeroed. */
    cuma_pages_unref(&e.pp, 7 * P, P, 3, 0, 0);
    CHECK(cuma_pages_release(&e.pp, 3, 0, 0, 0, false) == 1);
    CHECK_OK(cuma_pages_ref(&e.pp, 9 * P, P, 4, CUMA_PAGES_NO_STREAM));
    const uint64_t *z = (const uint64_t *)(uintptr_t)(e.base + 9 * P);
    for (size_t i = 0; i < P / 8; i += 4096) CHECK(z[i] == 0);
    cuma_pages_unref(&e.pp, 9 * P, P, 5, 0, 0);
    validate(&e);
    teardown(&e);
}

static void test_prefill(void) {
    env e;
    setup(&e);
    CHECK_OK(cuma_pages_prefill(&e.pp, 3, 5));
    CHECK(e.pp.nreserved == 3 && e.pp.ncached == 3 && e.pp.npinned == 3 && e.pp.creates == 3);
    /* Pinned pages never go back: no release is due for them. */
    CHECK(e.pp.maps == 0 && cuma_pages_oldest_idle(&e.pp) == UINT64_MAX);
    validate(&e);
    /* Pinned pages are used like any idle page (no unmap: they were never mapped)... */
    CHECK_OK(cuma_pages_ref(&e.pp, 0, 2 * P, 6, CUMA_PAGES_NO_STREAM));
    CHECK(e.pp.creates == 3 && e.pp.maps == 2 && e.pp.unmaps == 0);
    cuma_pages_unref(&e.pp, 0, 2 * P, 7, 0, 0);
    validate(&e);
    /* ...and never released, by age, cap or trim. */
    CHECK(cuma_pages_release(&e.pp, 1000, 0, 0, 0, true) == 0);
    CHECK(e.pp.nreserved == 3);
    /* Unpinned pages beside them still go. */
    CHECK_OK(cuma_pages_ref(&e.pp, 0, 4 * P, 8, CUMA_PAGES_NO_STREAM));
    CHECK(e.pp.creates == 4);
    cuma_pages_unref(&e.pp, 0, 4 * P, 9, 0, 0);
    CHECK(cuma_pages_release(&e.pp, 1000, 0, 0, 0, true) == 1);
    CHECK(e.pp.nreserved == 3);
    validate(&e);
    /* The limit counts pinned pages too. */
    e.pp.limit_pages = 3;
    CHECK_ST(cuma_pages_prefill(&e.pp, 1, 10), CUMA_ERR_LIMIT);
    CHECK(e.pp.nreserved == 3 && e.pp.npinned == 3);
    validate(&e);
    teardown(&e); /* destroy gives pinned pages back too */
}

/* A device that runs behind: an idle page whose work is pending on the stream that needs a
 * page is mapped at the new place at once; its old mapping (a ghost) stays until the work is
 * done. Its virtual page is not backed meanwhile: backing it again unmaps the ghost (work
 * done), takes the page back (idle elsewhere, same stream), or waits. */
static void test_ghosts(void) {
    env e;
    setup(&e);
    unsigned a = (unsigned)cuma_streams_index(&e.ss, S(0xA));
    unsigned b = (unsigned)cuma_streams_index(&e.ss, S(0xB));
    CHECK_OK(cuma_pages_ref(&e.pp, 0, P, 0, (int)a));
    uint32_t s0 = slot_at(&e, 0);
    uint64_t *w = (uint64_t *)(uintptr_t)e.base;
    w[7] = 0xC0FFEE;
    hold(&e, S(0xA), true);
    cuma_pages_unref(&e.pp, 0, P, 1, (uint16_t)a, cuma_streams_note_free(&e.ss, a));
    /* Another stream gets a new page; the same stream shares the pending one. */
    counts c0 = get_counts(&e);
    CHECK_OK(cuma_pages_ref(&e.pp, 10 * P, P, 2, (int)b));
    CHECK(slot_at(&e, 10) != s0 && e.pp.creates == c0.creates + 1 && e.pp.nghosts == 0);
    cuma_pages_unref(&e.pp, 10 * P, P, 3, 0, 0);
    CHECK(cuma_pages_release(&e.pp, 3, 0, 0, 0, false) == 1); /* s0 is held: it stays */
    c0 = get_counts(&e);
    CHECK_OK(cuma_pages_ref(&e.pp, 20 * P, P, 4, (int)a));
    CHECK(slot_at(&e, 20) == s0 && e.pp.creates == c0.creates && e.pp.maps == c0.maps + 1);
    CHECK(e.pp.unmaps == c0.unmaps && e.pp.early_remaps == 1 && e.pp.nghosts == 1);
    CHECK(e.pp.phys_of[0] == (CUMA_GHOST | 0) && e.pp.phys[s0].nghost == 1);
    CHECK(e.pp.phys[s0].fence_stream == a && e.pp.phys[s0].fence_seq != 0); /* still pending */
    const uint64_t *r = (const uint64_t *)(uintptr_t)(e.base + 20 * P);
    CHECK(r[7] == 0xC0FFEE && w[7] == 0xC0FFEE); /* one page, two addresses */
    validate(&e);
    /* Virtual page 0 again, its page idle at 20 with only stream a's work: taken back, no
     * driver call; 20 becomes the ghost. */
    cuma_pages_unref(&e.pp, 20 * P, P, 5, (uint16_t)a, cuma_streams_note_free(&e.ss, a));
    c0 = get_counts(&e);
    CHECK_OK(cuma_pages_ref(&e.pp, 0, P, 6, (int)a));
    CHECK(same_counts(get_counts(&e), (counts){c0.creates, c0.releases, c0.maps, c0.unmaps,
                                               c0.nreserved, c0.nmapped + 1, c0.ncached - 1}));
    CHECK(slot_at(&e, 0) == s0 && e.pp.phys_of[20] == (CUMA_GHOST | 0) && e.pp.nghosts == 1);
    validate(&e);
    /* Page 20 again while its page is live at 0: nothing to take back, and waiting on a held
     * simulated stream never ends: an error that changes nothing. */
    c0 = get_counts(&e);
    CHECK_ST(cuma_pages_ref(&e.pp, 20 * P, P, 7, (int)a), CUMA_ERR_BACKEND);
    CHECK(same_counts(get_counts(&e), c0) && e.pp.remap_waits == 1 && e.pp.live[20] == 0);
    validate(&e);
    /* Not released while its ghost waits. */
    cuma_pages_unref(&e.pp, 0, P, 8, (uint16_t)a, cuma_streams_note_free(&e.ss, a));
    CHECK(cuma_pages_release(&e.pp, 1000, 0, 0, 0, false) == 0 && e.pp.nreserved == 1);
    /* The stream completes: the next call unmaps the ghost, and 20 is backed. */
    hold(&e, S(0xA), false);
    c0 = get_counts(&e);
    CHECK_OK(cuma_pages_ref(&e.pp, 20 * P, P, 9, (int)a));
    CHECK(e.pp.nghosts == 0 && e.pp.phys_of[20] && e.pp.unmaps >= c0.unmaps + 1);
    CHECK(e.pp.phys[s0].nghost == 0 && e.pp.creates == c0.creates);
    validate(&e);
    /* Ghosts left at destroy are unmapped (teardown checks every page went back). */
    hold(&e, S(0xA), true);
    cuma_pages_unref(&e.pp, 20 * P, P, 10, (uint16_t)a, cuma_streams_note_free(&e.ss, a));
    CHECK_OK(cuma_pages_ref(&e.pp, 30 * P, 2 * P, 11, (int)a));
    CHECK(e.pp.nghosts >= 1);
    validate(&e);
    teardown(&e);
}

/* A page backed anew for a stream whose later work runs after its pending fence (an early
 * remap of its own page, or reuse in place with its own fence) takes the tag of its block's free
 * in place of that fence, whichever stream the free names (the stream of the last use, ordered
 * after the block's stream): no MULTI tag, which no stream could be ordered after. A second
 * block on the page, or a page another stream's work is pending on, still joins. */
static void test_covered_fences(void) {
    env e;
    setup(&e);
    unsigned a = (unsigned)cuma_streams_index(&e.ss, S(0xA));
    unsigned b = (unsigned)cuma_streams_index(&e.ss, S(0xB));
    e.pp.order = true; /* b may be ordered after a's held work on a's pages (no host wait) */
    hold(&e, S(0xA), true);
    hold(&e, S(0xB), true);
    CHECK_OK(cuma_pages_ref(&e.pp, 0, P, 0, (int)a));
    uint32_t s0 = slot_at(&e, 0);
    cuma_pages_unref(&e.pp, 0, P, 1, (uint16_t)a, cuma_streams_note_free(&e.ss, a));
    CHECK_OK(cuma_pages_ref(&e.pp, 10 * P, P, 2, (int)a)); /* a's pending page: early remap */
    CHECK(slot_at(&e, 10) == s0 && e.pp.nghosts == 1 && e.pp.phys[s0].covered);
    uint64_t qb = cuma_streams_note_free(&e.ss, b);
    cuma_pages_unref(&e.pp, 10 * P, P, 3, (uint16_t)b, qb); /* last used on b */
    CHECK(e.pp.phys[s0].fence_stream == b && e.pp.phys[s0].fence_seq == qb);
    CHECK(!e.pp.phys[s0].covered);
    validate(&e);
    /* In place with its own stream's fence: covered too. */
    CHECK_OK(cuma_pages_ref(&e.pp, 10 * P, P, 4, (int)b));
    CHECK(slot_at(&e, 10) == s0 && e.pp.phys[s0].covered);
    uint64_t qa = cuma_streams_note_free(&e.ss, a);
    cuma_pages_unref(&e.pp, 10 * P, P, 5, (uint16_t)a, qa);
    CHECK(e.pp.phys[s0].fence_stream == a && e.pp.phys[s0].fence_seq == qa);
    validate(&e);
    /* In place for another stream than the fence's: joined. */
    CHECK_OK(cuma_pages_ref(&e.pp, 10 * P, P, 6, (int)b));
    CHECK(!e.pp.phys[s0].covered);
    cuma_pages_unref(&e.pp, 10 * P, P, 7, (uint16_t)b, cuma_streams_note_free(&e.ss, b));
    CHECK(e.pp.phys[s0].fence_stream == CUMA_FENCE_MULTI);
    validate(&e);
    /* Two blocks on a page taken early: the first free (not the last byte) joins. */
    CHECK_OK(cuma_pages_ref(&e.pp, 20 * P, P, 8, (int)a));
    uint32_t s20 = slot_at(&e, 20);
    cuma_pages_unref(&e.pp, 20 * P, P, 9, (uint16_t)a, cuma_streams_note_free(&e.ss, a));
    CHECK_OK(cuma_pages_ref(&e.pp, 30 * P, P / 2, 10, (int)a));
    CHECK(slot_at(&e, 30) == s20 && e.pp.phys[s20].covered);
    /* b on the rest of the page, where a's held work may still touch it at the ghost's address
     * (test_ghost_page_other_stream): b is ordered after that work on the device. */
    uint64_t w = e.ss.stream_waits;
    CHECK_OK(cuma_pages_ref(&e.pp, 30 * P + P / 2, P / 2, 11, (int)b)); /* live already */
    CHECK(e.ss.stream_waits == w + 1);
    cuma_pages_unref(&e.pp, 30 * P + P / 2, P / 2, 12, (uint16_t)b,
                     cuma_streams_note_free(&e.ss, b));
    CHECK(e.pp.phys[s20].fence_stream == CUMA_FENCE_MULTI && !e.pp.phys[s20].covered);
    cuma_pages_unref(&e.pp, 30 * P, P / 2, 13, (uint16_t)a, cuma_streams_note_free(&e.ss, a));
    CHECK(e.pp.phys[s20].fence_stream == CUMA_FENCE_MULTI);
    validate(&e);
    hold(&e, S(0xA), false);
    hold(&e, S(0xB), false);
    teardown(&e);
}

/* A page remapped early is still touched at its ghost's address by the pending work of the
 * ghost's stream, on the same bytes. A block another stream gets on that page later (the rest of
 * the live page, or the page idle in place) would run beside that work: placement's tags speak
 * of virtual bytes only. So that stream is ordered after the ghost's work on the device
 * (stream_order), or the host waits for it; the ghost's own stream needs neither. */
static void test_ghost_page_other_stream(void) {
    env e;
    setup_with(&e, "sim_lag_ms:5");
    _Atomic uint64_t clock = 1000;
    CHECK_OK(cuma_simbe_set_clock(e.be, &clock));
    unsigned a = (unsigned)cuma_streams_index(&e.ss, S(0xA));
    unsigned b = (unsigned)cuma_streams_index(&e.ss, S(0xB));
    /* Page 0's page, freed on a (pending 5 ms), backs the first half of page 10 early. */
    CHECK_OK(cuma_pages_ref(&e.pp, 0, P, 1, (int)a));
    uint32_t s0 = slot_at(&e, 0);
    uint64_t qa = cuma_streams_note_free(&e.ss, a);
    cuma_pages_unref(&e.pp, 0, P, 2, (uint16_t)a, qa);
    CHECK_OK(cuma_pages_ref(&e.pp, 10 * P, P / 2, 3, (int)a));
    CHECK(slot_at(&e, 10) == s0 && e.pp.nghosts == 1 && !cuma_fence_known_done(&e.ss, a, qa));
    /* Its own stream on more of the page: no wait of any kind. */
    CHECK_OK(cuma_pages_ref(&e.pp, 10 * P + P / 2, P / 4, 4, (int)a));
    CHECK(e.pp.remap_waits == 0 && e.ss.stream_waits == 0 && !cuma_fence_known_done(&e.ss, a, qa));
    /* Another stream on the rest of the live page: the host waits for a's work first. */
    CHECK_OK(cuma_pages_ref(&e.pp, 10 * P + 3 * P / 4, P / 4, 5, (int)b));
    CHECK(e.pp.remap_waits == 1 && cuma_fence_known_done(&e.ss, a, qa));
    validate(&e);
    cuma_pages_unref(&e.pp, 10 * P, P / 2, 6, (uint16_t)a, cuma_streams_note_free(&e.ss, a));
    cuma_pages_unref(&e.pp, 10 * P + P / 2, P / 4, 6, (uint16_t)a,
                     cuma_streams_note_free(&e.ss, a));
    cuma_pages_unref(&e.pp, 10 * P + 3 * P / 4, P / 4, 6, (uint16_t)b,
                     cuma_streams_note_free(&e.ss, b));
    validate(&e);
    /* With stream_order, on a page idle in place: b is ordered after a's work on the device. */
    e.pp.order = true;
    CHECK_OK(cuma_pages_ref(&e.pp, 20 * P, P, 7, (int)a));
    uint32_t s20 = slot_at(&e, 20);
    uint64_t qa2 = cuma_streams_note_free(&e.ss, a);
    cuma_pages_unref(&e.pp, 20 * P, P, 8, (uint16_t)a, qa2);
    CHECK_OK(cuma_pages_ref(&e.pp, 30 * P, P / 2, 9, (int)a)); /* early: a ghost at 20 */
    CHECK(slot_at(&e, 30) == s20 && e.pp.phys_of[20] & CUMA_GHOST);
    cuma_pages_unref(&e.pp, 30 * P, P / 2, 10, (uint16_t)a, cuma_streams_note_free(&e.ss, a));
    uint64_t w0 = e.ss.stream_waits, r0 = e.pp.remap_waits;
    CHECK_OK(cuma_pages_ref(&e.pp, 30 * P + P / 2, P / 2, 11, (int)b)); /* in place */
    CHECK(slot_at(&e, 30) == s20 && e.ss.stream_waits == w0 + 1 && e.pp.remap_waits == r0);
    CHECK(!cuma_fence_known_done(&e.ss, a, qa2)); /* ordered on the device, not waited for */
    validate(&e);
    cuma_pages_unref(&e.pp, 30 * P + P / 2, P / 2, 12, (uint16_t)b,
                     cuma_streams_note_free(&e.ss, b));
    atomic_store(&clock, 100000000); /* the device catches up */
    teardown(&e);
}

/* A device 5 ms behind (sim_lag_ms): a ghost's work is pending until the clock passes it. A
 * release that may not wait keeps the ghost and its page; one that waits (a trim) waits for
 * the ghost's work, unmaps it and gives the page back. */
static void test_wait_reaps_ghosts(void) {
    env e;
    setup_with(&e, "sim_lag_ms:5");
    _Atomic uint64_t clock = 1000;
    CHECK_OK(cuma_simbe_set_clock(e.be, &clock));
    unsigned a = (unsigned)cuma_streams_index(&e.ss, S(0xA));
    CHECK_OK(cuma_pages_ref(&e.pp, 0, P, 1, (int)a));
    cuma_pages_unref(&e.pp, 0, P, 2, (uint16_t)a, cuma_streams_note_free(&e.ss, a));
    CHECK_OK(cuma_pages_ref(&e.pp, 10 * P, P, 3, (int)a)); /* pending: shared, a ghost at 0 */
    CHECK(e.pp.nghosts == 1 && e.pp.creates == 1 && e.pp.early_remaps == 1);
    cuma_pages_unref(&e.pp, 10 * P, P, 4, (uint16_t)a, cuma_streams_note_free(&e.ss, a));
    validate(&e);
    CHECK(cuma_pages_release(&e.pp, 5, 0, 0, 0, false) == 0);
    CHECK(e.pp.nghosts == 1 && e.pp.nreserved == 1);
    CHECK(cuma_pages_release(&e.pp, 6, 0, 0, 0, true) == 1);
    CHECK(e.pp.nghosts == 0 && e.pp.nreserved == 0 && atomic_load(&clock) == 1000);
    validate(&e);
    teardown(&e);
}

/* remap_threshold: while idle pages are at most that share of the mapped ones, backing creates
 * a page instead of moving an idle one (fewer driver calls for a little memory). */
static void test_remap_threshold(void) {
    env e;
    setup(&e);
    e.pp.remap_threshold = 0.5;
    CHECK_OK(cuma_pages_ref(&e.pp, 0, 4 * P, 0, CUMA_PAGES_NO_STREAM));
    cuma_pages_unref(&e.pp, 3 * P, P, 1, 0, 0); /* 3 mapped, 1 idle: 1 <= 0.5 x 3 */
    counts c0 = get_counts(&e);
    CHECK_OK(cuma_pages_ref(&e.pp, 10 * P, P, 2, CUMA_PAGES_NO_STREAM));
    CHECK(e.pp.creates == c0.creates + 1 && e.pp.unmaps == c0.unmaps && slot_at(&e, 3) != CUMA_NIL);
    validate(&e);
    cuma_pages_unref(&e.pp, 0, 3 * P, 3, 0, 0); /* 1 mapped, 4 idle: over the threshold */
    c0 = get_counts(&e);
    CHECK_OK(cuma_pages_ref(&e.pp, 20 * P, P, 4, CUMA_PAGES_NO_STREAM));
    CHECK(e.pp.creates == c0.creates && e.pp.unmaps == c0.unmaps + 1);
    validate(&e);
    /* Within the threshold but at the limit: an idle page moves rather than the call failing. */
    e.pp.remap_threshold = 1;
    e.pp.limit_pages = e.pp.nreserved;
    c0 = get_counts(&e);
    CHECK_OK(cuma_pages_ref(&e.pp, 30 * P, P, 5, CUMA_PAGES_NO_STREAM));
    CHECK(e.pp.creates == c0.creates && e.pp.unmaps == c0.unmaps + 1);
    e.pp.limit_pages = UINT64_MAX;
    validate(&e);
    teardown(&e);
}

/* pages.c acquire()/steal(): cuma_pages_ref backs the pages of a range in address order, and
 * the newest idle page may be that of a later virtual page of the same range. steal() skips
 * those (they are reused in place), or the earlier page would take it and the later one need
 * another: one unmap and one map more than needed. Here: pages 2 and 3 idle in place; [1, 4)
 * creates one page (for 1) and reuses 2 and 3 where they are. */
static void test_steal_own_range(void) {
    env e;
    setup(&e);
    CHECK_OK(cuma_pages_ref(&e.pp, 2 * P, 2 * P, 0, CUMA_PAGES_NO_STREAM));
    cuma_pages_unref(&e.pp, 2 * P, 2 * P, 1, 0, 0);
    counts c0 = get_counts(&e);
    CHECK_OK(cuma_pages_ref(&e.pp, P, 3 * P, 2, CUMA_PAGES_NO_STREAM));
    counts c1 = get_counts(&e);
    CHECK(c1.creates == c0.creates + 1);
    CHECK(c1.unmaps == c0.unmaps);
    CHECK(c1.maps == c0.maps + 1);
    teardown(&e);
}

/* Random ref/unref/release with fences against a shadow count per virtual page. */
static void test_random(void) {
    unsigned long long seed = test_seed();
    env e;
    setup(&e);
    unsigned st[3];
    cuma_stream handles[3] = {S(0x100), S(0x200), S(0x300)};
    bool held[3] = {false, false, false};
    for (int i = 0; i < 3; i++) st[i] = (unsigned)cuma_streams_index(&e.ss, handles[i]);
    enum { MAXR = 256 };
    struct {
        uint64_t off, len;
    } live[MAXR];
    int nlive = 0;
    uint32_t shadow[NVA] = {0};
    uint64_t now = 0, fails = 0, ok = 0;
    for (int op = 0; op < 40000; op++) {
        now += rnd(&seed) % 1000;
        unsigned r = (unsigned)(rnd(&seed) % 100);
        if (r < 50 && nlive < MAXR) {
            uint64_t off = rnd(&seed) % (NVA * P - 1);
            uint64_t maxlen = NVA * P - off;
            uint64_t len = 1 + rnd(&seed) % (rnd(&seed) % 4 ? P : 4 * P);
            if (len > maxlen) len = maxlen;
            uint32_t first = (uint32_t)(off / P), last = (uint32_t)((off + len - 1) / P);
            uint64_t need = 0;
            for (uint32_t v = first; v <= last; v++) need += !shadow[v];
            counts before = get_counts(&e);
            /* For one of the streams (pending idle pages of its own may be shared: ghosts), or
             * for none. */
            int rs = (int)(rnd(&seed) % 4);
            cuma_status s =
                cuma_pages_ref(&e.pp, off, len, now, rs < 3 ? (int)st[rs] : CUMA_PAGES_NO_STREAM);
            if (s == CUMA_OK) {
                for (uint32_t v = first; v <= last; v++) shadow[v]++;
                live[nlive].off = off, live[nlive].len = len, nlive++;
                ok++;
            } else {
                /* Only when the device cannot hold it, or idle pages wait on a held stream (a
                 * ghost in the way waits on one: CUMA_ERR_BACKEND from the simulated device). */
                bool any_held = held[0] || held[1] || held[2];
                CHECK(s == CUMA_ERR_OOM || (s == CUMA_ERR_BACKEND && any_held));
                CHECK(before.nmapped + need > NPHYS || any_held);
                CHECK(e.pp.nmapped == before.nmapped);
                fails++;
            }
        } else if (r < 90 && nlive) {
            int k = (int)(rnd(&seed) % (uint64_t)nlive);
            int si = (int)(rnd(&seed) % 4);
            uint16_t fs = 0;
            uint64_t fq = 0;
            if (si < 3) fs = (uint16_t)st[si], fq = cuma_streams_note_free(&e.ss, st[si]);
            cuma_pages_unref(&e.pp, live[k].off, live[k].len, now, fs, fq);
            uint32_t first = (uint32_t)(live[k].off / P),
                     last = (uint32_t)((live[k].off + live[k].len - 1) / P);
            for (uint32_t v = first; v <= last; v++) shadow[v]--;
            live[k] = live[--nlive];
        } else if (r < 94) {
            int si = (int)(rnd(&seed) % 3);
            held[si] = !held[si];
            hold(&e, handles[si], held[si]);
        } else {
            uint64_t before = e.pp.nreserved;
            int64_t delay = rnd(&seed) % 2 ? (int64_t)(rnd(&seed) % 5000) : -1;
            uint64_t cap = rnd(&seed) % 2 ? rnd(&seed) % 8 : UINT64_MAX;
            uint64_t n = cuma_pages_release(&e.pp, now, delay, cap, 0, rnd(&seed) % 2);
            CHECK(e.pp.nreserved == before - n);
            if (!held[0] && !held[1] && !held[2] && cap != UINT64_MAX) {
                /* Nothing pending: the cap is met. */
                CHECK(e.pp.ncached <= cap);
            }
        }
        uint64_t mapped = 0;
        for (uint32_t v = 0; v < NVA; v++) {
            CHECK(e.pp.live[v] == shadow[v]);
            mapped += shadow[v] > 0;
            if (shadow[v]) CHECK(e.pp.phys_of[v]);
        }
        CHECK(e.pp.nmapped == mapped && e.pp.nreserved <= NPHYS);
        validate(&e);
    }
    CHECK(ok > 1000 && fails > 0);
    printf("test_random: %llu refs, %llu failed, %llu early remaps, %llu remap waits\n",
           (unsigned long long)ok, (unsigned long long)fails, (unsigned long long)e.pp.early_remaps,
           (unsigned long long)e.pp.remap_waits);
    CHECK(e.pp.early_remaps > 0); /* the ghosts were exercised */
    /* Drain. */
    for (int i = 0; i < 3; i++)
        if (held[i]) hold(&e, handles[i], false);
    while (nlive) {
        nlive--;
        cuma_pages_unref(&e.pp, live[nlive].off, live[nlive].len, now, (uint16_t)st[0],
                         cuma_streams_note_free(&e.ss, st[0]));
    }
    CHECK(e.pp.nmapped == 0);
    cuma_pages_release(&e.pp, now, -1, 0, 0, true);
    CHECK(e.pp.nreserved == 0 && e.pp.ncached == 0);
    teardown(&e);
}

int main(void) {
    test_ref_unref();
    test_reuse_in_place_and_steal();
    test_steal_keeps_ages();
    test_pinned_pages_hold_no_age();
    test_release();
    test_limit();
    test_fences();
    test_data_survives();
    test_ghosts();
    test_covered_fences();
    test_remap_threshold();
    test_wait_reaps_ghosts();
    test_ghost_page_other_stream();
    test_prefill();
    test_steal_own_range();
    test_random();
    printf("test_pages: all passed\n");
    return 0;
}
