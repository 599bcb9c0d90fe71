// SPDX-License-Identifier: Apache-2.0
/* The placement policies (src/place/tlsf.c, src/place/buddy.c) through cuma_policy_ops, each
 * over a stream table on a simulated device: rounding, ranges, 10^5 random allocations and
 * frees against a shadow list (no overlap, inside the range, big enough, aligned; validate()
 * and free + live bytes after every phase), filling the range completely, freeing back to one
 * block, fences between two streams (a block freed on a busy stream goes to that stream at
 * once and to the other only when the fence is known complete), a random fence test that
 * checks every granule handed out, merge rules, coalesce and remove_range. */
#include "check.h"
#include "backend/backend.h"
#include "settings/config.h"
#include "place/policy.h"
#include "place/streams.h"

#include <stdbool.h>
#include <stdint.h>
#include <string.h>

#define KB    (1024ull)
#define MB    (1024ull * 1024)
#define RANGE (1ull << 30)
#define S(x)  ((cuma_stream)(uintptr_t)(x))

typedef struct env {
    const cuma_policy_ops *ops;
    cuma_backend *be;
    cuma_streams ss;
    cuma_policy *p;
    uint64_t range_off, range_size;
} env;

/* Asks the device as a new allocator operation does (a new epoch: see streams.h). */
static bool op_poll(cuma_streams *ss, unsigned stream, uint64_t seq, bool wait) {
    cuma_streams_tick(ss, 0);
    return cuma_fence_poll(ss, stream, seq, wait);
}

static bool is_buddy(const env *e) {
    return e->ops == &cuma_buddy_ops;
}

/* A policy over [off, off + size), on a stream table whose streams are sim streams. */
static void setup(env *e, const cuma_policy_ops *ops, unsigned flags, uint64_t off, uint64_t size) {
    memset(e, 0, sizeof *e);
    e->ops = ops;
    cuma_settings set;
    cuma_settings_default(&set);
    CHECK_OK(cuma_settings_parse(&set, "capacity:64M,page_size:2M,sim_clock:manual", "test"));
    CHECK_OK(cuma_sim_backend_create(&set, &e->be));
    CHECK_OK(cuma_streams_init(&e->ss, e->be));
    CHECK_OK(ops->create(&e->p, &e->ss, flags));
    CHECK(e->p && e->p->ops == ops);
    CHECK(ops->largest_free(e->p) == 0);
    if (size) CHECK_OK(ops->add_range(e->p, off, size));
    e->range_off = off, e->range_size = size;
}

static void teardown(env *e) {
    e->ops->destroy(e->p);
    cuma_streams_destroy(&e->ss);
    e->be->ops->destroy(e->be);
}

/* validate() holds and the range is accounted for: free + live == range. */
static void validate(env *e, uint64_t want_live) {
    const char *why = NULL;
    uint64_t fb = 1, lb = 1;
    if (!e->ops->validate(e->p, &why, &fb, &lb)) {
        fprintf(stderr, "%s validate: %s\n", e->ops->name, why ? why : "(no reason)");
        CHECK(0);
    }
    if (fb + lb != e->range_size || lb != want_live) {
        fprintf(stderr, "%s: free %llu + live %llu, range %llu, want live %llu\n", e->ops->name,
                (unsigned long long)fb, (unsigned long long)lb, (unsigned long long)e->range_size,
                (unsigned long long)want_live);
        CHECK(0);
    }
    CHECK(e->ops->largest_free(e->p) <= fb);
}

/* What the heap does with a block it gets: mark it live for a request on a stream. */
static cuma_block *get(env *e, uint64_t req, unsigned stream) {
    uint64_t n = e->ops->round(req);
    CHECK(n >= req && n % CUMA_GRANULE == 0);
    cuma_block *b = e->ops->alloc(e->p, n, stream);
    if (!b) return NULL;
    CHECK(!b->is_free && b->size >= n);
    b->req = req;
    b->stream = (uint16_t)stream;
    return b;
}

static void check_block(const env *e, const cuma_block *b, uint64_t n) {
    CHECK(b->off % CUMA_GRANULE == 0 && b->size % CUMA_GRANULE == 0);
    CHECK(b->off >= e->range_off && b->off + b->size <= e->range_off + e->range_size);
    CHECK(b->size >= n);
    if (is_buddy(e)) {
        CHECK((b->size & (b->size - 1)) == 0 && b->off % b->size == 0);
        CHECK(b->size == n); /* the buddy's rounding is its block size */
    } else {
        CHECK(b->size == n); /* tlsf splits off every whole granule it does not need */
    }
}

static void test_round_and_ranges(const cuma_policy_ops *ops) {
    uint64_t (*round)(uint64_t) = ops->round;
    CHECK(round(0) == 512 && round(1) == 512 && round(512) == 512 && round(513) == 1024);
    if (ops == &cuma_buddy_ops) {
        CHECK(round(1025) == 2048 && round(3000) == 4096 && round(MB + 1) == 2 * MB);
        CHECK(round(1ull << 46) == 1ull << 46 && round((1ull << 46) + 1) == 0);
        for (uint64_t s = 1; s < (1ull << 40); s = s * 3 + 1) {
            uint64_t r = round(s);
            CHECK(r >= s && (r & (r - 1)) == 0 && (r == 512 || r / 2 < s));
        }
    } else {
        CHECK(round(1025) == 1536 && round(3000) == 3072 && round(MB + 1) == MB + 512);
        CHECK(round(1ull << 47) == 1ull << 47 && round((1ull << 47) + 1) == 0);
        CHECK(round(UINT64_MAX) == 0);
        for (uint64_t s = 1; s < (1ull << 40); s = s * 3 + 1) {
            uint64_t r = round(s);
            CHECK(r >= s && r % 512 == 0 && r - s < 512);
        }
    }
    CHECK(round(UINT64_MAX) == 0);

    env e;
    setup(&e, ops, 0, 0, 0);
    /* Bad ranges. */
    CHECK_ST(ops->add_range(e.p, 100, 1 * MB), CUMA_ERR_INVALID);
    CHECK_ST(ops->add_range(e.p, 0, 1000), CUMA_ERR_INVALID);
    CHECK_ST(ops->add_range(e.p, 0, 0), CUMA_ERR_INVALID);
    if (ops == &cuma_buddy_ops) {
        CHECK_ST(ops->add_range(e.p, 0, 3 * MB), CUMA_ERR_INVALID);  /* not a power of two */
        CHECK_ST(ops->add_range(e.p, MB, 2 * MB), CUMA_ERR_INVALID); /* not aligned to it */
    }
    CHECK(ops->largest_free(e.p) == 0);
    CHECK(ops->alloc(e.p, 512, 0) == NULL); /* nothing to allocate from */
    /* Two ranges: blocks never cross from one into the other. */
    CHECK_OK(ops->add_range(e.p, 0, 4 * MB));
    CHECK_OK(ops->add_range(e.p, 4 * MB, 4 * MB)); /* adjacent, but a range of its own */
    e.range_size = 8 * MB;
    CHECK(ops->largest_free(e.p) == 4 * MB);
    validate(&e, 0);
    CHECK(get(&e, 6 * MB, 0) == NULL);
    cuma_block *a = get(&e, 3 * MB, 0), *b = get(&e, 3 * MB, 0);
    CHECK(a && b && a->off != b->off);
    CHECK((a->off < 4 * MB) != (b->off < 4 * MB)); /* one per range */
    validate(&e, 8 * MB * (ops == &cuma_buddy_ops) + 6 * MB * (ops != &cuma_buddy_ops));
    ops->free(e.p, a, 0, 0);
    ops->free(e.p, b, 0, 0);
    validate(&e, 0);
    CHECK(ops->largest_free(e.p) == 4 * MB);
    teardown(&e);

    /* remove_range: a whole free range goes away; the others stay. */
    setup(&e, ops, 0, 0, RANGE);
    CHECK_OK(ops->add_range(e.p, 2 * RANGE, MB));
    e.range_size = RANGE + MB;
    validate(&e, 0);
    cuma_block *x = get(&e, MB, 0); /* the exact fit is the small range */
    CHECK(x && x->off == 2 * RANGE && x->size == MB);
    cuma_block *whole = ops->free(e.p, x, 0, 0);
    CHECK(whole && whole->is_free && whole->off == 2 * RANGE && whole->size == MB);
    ops->remove_range(e.p, whole);
    e.range_size = RANGE;
    validate(&e, 0);
    CHECK(ops->largest_free(e.p) == RANGE);
    x = get(&e, MB, 0);
    CHECK(x && x->off < RANGE);
    ops->free(e.p, x, 0, 0);
    validate(&e, 0);
    teardown(&e);
}

typedef struct live_block {
    cuma_block *b;
    uint64_t off, size;
} live_block;

/* A request size from 1 B to 64 MiB, skewed small: a uniform power of two, then uniform
 * below it. */
static uint64_t random_size(unsigned long long *seed, unsigned max_log) {
    unsigned e = (unsigned)(rnd(seed) % (max_log + 1));
    return 1 + rnd(seed) % (1ull << e);
}

/* test_random with a hint (tlsf.c hint_choose): per 2 MiB unit of the range, the live blocks on
 * it, as the heap's pages keep them; NULL without. */
#define HINT_SHIFT 21
static uint32_t *hint_used;

static void hint_count(const cuma_block *b, int d) {
    if (!hint_used) return;
    for (uint64_t u = b->off >> HINT_SHIFT; u <= (b->off + b->size - 1) >> HINT_SHIFT; u++)
        hint_used[u] = (uint32_t)((int)hint_used[u] + d);
}

static void check_no_overlap(const live_block *live, int n, const cuma_block *b) {
    for (int i = 0; i < n; i++)
        if (b->off < live[i].off + live[i].size && live[i].off < b->off + b->size) {
            fprintf(stderr, "block [%llu, +%llu) overlaps live [%llu, +%llu)\n",
                    (unsigned long long)b->off, (unsigned long long)b->size,
                    (unsigned long long)live[i].off, (unsigned long long)live[i].size);
            CHECK(0);
        }
}

static void free_one(env *e, live_block *live, int *n, int k, uint64_t *live_bytes) {
    live_block lb = live[k];
    CHECK(lb.b->off == lb.off && lb.b->size == lb.size && !lb.b->is_free);
    hint_count(lb.b, -1);
    cuma_block *m = e->ops->free(e->p, lb.b, 0, 0);
    CHECK(m && m->is_free && m->off <= lb.off && m->off + m->size >= lb.off + lb.size);
    *live_bytes -= lb.size;
    live[k] = live[--*n];
}

/* 10^5 random operations, clean fences (seq 0), one stream; with `hint`, under a hint of the
 * units in use (blocks then go to other places and ends). */
static void test_random(const cuma_policy_ops *ops, unsigned flags, unsigned long long *seed,
                        bool hint) {
    env e;
    setup(&e, ops, flags, 0, RANGE);
    if (hint) {
        CHECK((hint_used = calloc(RANGE >> HINT_SHIFT, sizeof *hint_used)) != NULL);
        e.p->hint = (cuma_place_hint){hint_used, RANGE >> HINT_SHIFT, HINT_SHIFT};
    }
    validate(&e, 0);
    CHECK(ops->largest_free(e.p) == RANGE);
    enum { MAXLIVE = 1 << 14 };
    live_block *live = malloc(MAXLIVE * sizeof *live);
    CHECK(live);
    int n = 0;
    uint64_t live_bytes = 0, nulls = 0;
    const int OPS = 100000, PHASE = 10000;
    for (int op = 1; op <= OPS; op++) {
        /* Grow towards ~256 MiB live, then churn around it; the last phases drain. */
        int phase = op / PHASE;
        unsigned alloc_pct = phase >= 8 ? 35 : live_bytes < 256 * MB ? 65 : 40;
        if ((unsigned)(rnd(seed) % 100) < alloc_pct && n < MAXLIVE) {
            uint64_t req = random_size(seed, 26);
            uint64_t sz = ops->round(req);
            cuma_block *b = get(&e, req, 0);
            if (!b) {
                CHECK(ops->largest_free(e.p) < sz);
                nulls++;
                continue;
            }
            check_block(&e, b, sz);
            check_no_overlap(live, n, b);
            hint_count(b, 1);
            live[n].b = b, live[n].off = b->off, live[n].size = b->size;
            n++;
            live_bytes += b->size;
        } else if (n) {
            free_one(&e, live, &n, (int)(rnd(seed) % (uint64_t)n), &live_bytes);
        }
        if (op % PHASE == 0) validate(&e, live_bytes);
    }
    CHECK(nulls < (uint64_t)OPS / 100);
    /* Everything back: one free block, the whole range. */
    while (n) free_one(&e, live, &n, (int)(rnd(seed) % (uint64_t)n), &live_bytes);
    validate(&e, 0);
    CHECK(ops->largest_free(e.p) == RANGE);

    /* Fill the range to the last granule, without frees: a request fails only when the
     * largest free block is too small; then smaller requests fill what is left. */
    unsigned max_log = 26;
    while (1) {
        uint64_t req = random_size(seed, max_log);
        uint64_t sz = ops->round(req);
        cuma_block *b = get(&e, req, 0);
        if (!b) {
            CHECK(ops->largest_free(e.p) < sz);
            if (sz == CUMA_GRANULE) break;
            if (max_log) max_log--;
            continue;
        }
        check_block(&e, b, sz);
        if (n < 4096) check_no_overlap(live, n, b); /* the rest is checked by validate */
        if (n == MAXLIVE) {
            /* Too many to track one by one: keep the big ones tracked, count the rest. */
            live_bytes += b->size;
            continue;
        }
        live[n].b = b, live[n].off = b->off, live[n].size = b->size;
        n++;
        live_bytes += b->size;
    }
    CHECK(ops->largest_free(e.p) == 0);
    validate(&e, RANGE);
    CHECK(live_bytes == RANGE);
    teardown(&e); /* untracked blocks, if any, go with the policy */
    free(live);
    free(hint_used);
    hint_used = NULL;
}

/* Two streams: a block freed with a fence of stream 0 goes back to stream 0 at once, and to
 * stream 1 only once the fence is known complete. */
static void test_fences(const cuma_policy_ops *ops, unsigned flags) {
    env e;
    setup(&e, ops, flags, 0, RANGE);
    unsigned s0 = (unsigned)cuma_streams_index(&e.ss, S(0xA0));
    unsigned s1 = (unsigned)cuma_streams_index(&e.ss, S(0xB0));
    CHECK(s0 == 0 && s1 == 1);
    CHECK_OK(cuma_simbe_hold(e.be, S(0xA0), true));
    cuma_block *a = get(&e, MB, s0), *nb = get(&e, MB, s0); /* nb keeps a off the top block */
    CHECK(a && nb);
    uint64_t aoff = a->off, asize = a->size;
    uint64_t q = cuma_streams_note_free(&e.ss, s0);
    cuma_block *m = ops->free(e.p, a, (uint16_t)s0, q);
    CHECK(m->off == aoff && m->size == asize); /* nothing to merge with */
    CHECK(m->fence_stream == s0 && m->fence_seq == q);
    validate(&e, MB);
    /* Stream 1 may not have it. */
    cuma_block *x = get(&e, MB, s1);
    CHECK(x && (x->off + x->size <= aoff || x->off >= aoff + asize));
    /* Stream 0 gets it back at once, though its fence is not complete. */
    CHECK(e.ss.slot[s0].done < q);
    cuma_block *y = get(&e, MB, s0);
    CHECK(y && y->off == aoff && y->fence_seq == 0);
    validate(&e, 3 * MB);
    /* Freed again: waits for the held stream, then goes to stream 1. */
    q = cuma_streams_note_free(&e.ss, s0);
    ops->free(e.p, y, (uint16_t)s0, q);
    cuma_block *x2 = get(&e, MB, s1);
    CHECK(x2 && (x2->off + x2->size <= aoff || x2->off >= aoff + asize));
    CHECK(!op_poll(&e.ss, s0, q, false)); /* held: not complete */
    cuma_block *x3 = get(&e, MB, s1);
    CHECK(x3 && (x3->off + x3->size <= aoff || x3->off >= aoff + asize));
    CHECK_OK(cuma_simbe_hold(e.be, S(0xA0), false));
    /* Complete on the device, but not known until someone asks: still not handed out. */
    cuma_block *x4 = get(&e, MB, s1);
    CHECK(x4 && (x4->off + x4->size <= aoff || x4->off >= aoff + asize));
    CHECK(op_poll(&e.ss, s0, q, false) && e.ss.slot[s0].done >= q);
    cuma_block *z = get(&e, MB, s1);
    CHECK(z && z->off == aoff);
    validate(&e, 6 * MB);
    cuma_block *all[] = {nb, x, x2, x3, x4, z};
    for (int i = 0; i < 6; i++) ops->free(e.p, all[i], (uint16_t)s1, 0);
    validate(&e, 0);
    CHECK(ops->largest_free(e.p) == RANGE);

    /* The other way round, and only the stream of the fence is exempt: a third stream waits
     * too. */
    unsigned s2 = (unsigned)cuma_streams_index(&e.ss, S(0xC0));
    CHECK_OK(cuma_simbe_hold(e.be, S(0xB0), true));
    cuma_block *c = get(&e, 64 * KB, s1), *cn = get(&e, 64 * KB, s1);
    uint64_t coff = c->off;
    q = cuma_streams_note_free(&e.ss, s1);
    ops->free(e.p, c, (uint16_t)s1, q);
    cuma_block *w0 = get(&e, 64 * KB, s0), *w2 = get(&e, 64 * KB, s2);
    CHECK(w0->off != coff && w2->off != coff);
    cuma_block *w1 = get(&e, 64 * KB, s1);
    CHECK(w1->off == coff);
    CHECK_OK(cuma_simbe_hold(e.be, S(0xB0), false));
    cuma_block *rest[] = {cn, w0, w2, w1};
    for (int i = 0; i < 4; i++) ops->free(e.p, rest[i], 0, 0);
    validate(&e, 0);
    teardown(&e);
}

/* Merge rules with fences (tlsf and buddy alike): with two streams, pending memory does not
 * merge with complete memory nor with another stream's pending memory; the same stream's
 * pending memory merges. */
static void test_merge_rules(const cuma_policy_ops *ops) {
    env e;
    setup(&e, ops, 0, 0, 8 * MB);
    unsigned s0 = (unsigned)cuma_streams_index(&e.ss, S(0xA0));
    unsigned s1 = (unsigned)cuma_streams_index(&e.ss, S(0xB0));
    CHECK_OK(cuma_simbe_hold(e.be, S(0xA0), true));
    CHECK_OK(cuma_simbe_hold(e.be, S(0xB0), true));
    /* Eight 1 MiB blocks fill the range: blocks 2k and 2k+1 are buddies. */
    cuma_block *b[8];
    for (int i = 0; i < 8; i++) {
        b[i] = get(&e, MB, s0);
        CHECK(b[i] && b[i]->off == (uint64_t)i * MB);
    }
    CHECK(ops->largest_free(e.p) == 0);
    /* 0 pending on s0, 1 clean: apart. */
    cuma_block *m = ops->free(e.p, b[0], (uint16_t)s0, cuma_streams_note_free(&e.ss, s0));
    CHECK(m->size == MB);
    m = ops->free(e.p, b[1], (uint16_t)s0, 0);
    CHECK(m->off == MB && m->size == MB);
    /* 2 pending on s0, 3 pending on s1: apart. */
    m = ops->free(e.p, b[2], (uint16_t)s0, cuma_streams_note_free(&e.ss, s0));
    m = ops->free(e.p, b[3], (uint16_t)s1, cuma_streams_note_free(&e.ss, s1));
    CHECK(m->off == 3 * MB && m->size == MB);
    /* 4 and 5 pending on s0: one block. */
    m = ops->free(e.p, b[4], (uint16_t)s0, cuma_streams_note_free(&e.ss, s0));
    uint64_t q5 = cuma_streams_note_free(&e.ss, s0);
    m = ops->free(e.p, b[5], (uint16_t)s0, q5);
    CHECK(m->off == 4 * MB && m->size == 2 * MB && m->fence_stream == s0 && m->fence_seq == q5);
    /* 6 and 7 clean: one block. */
    m = ops->free(e.p, b[6], (uint16_t)s1, 0);
    m = ops->free(e.p, b[7], (uint16_t)s1, 0);
    CHECK(m->off == 6 * MB && m->size == 2 * MB && m->fence_seq == 0);
    CHECK(ops->largest_free(e.p) == 2 * MB);
    validate(&e, 0);
    /* Stream s1 can use the clean blocks and its own: 1, 3, 6-7. */
    cuma_block *g = get(&e, 2 * MB, s1);
    CHECK(g && g->off == 6 * MB);
    cuma_block *h1 = get(&e, MB, s1), *h2 = get(&e, MB, s1);
    CHECK(h1 && h2 &&
          ((h1->off == MB && h2->off == 3 * MB) || (h1->off == 3 * MB && h2->off == MB)));
    CHECK(get(&e, MB, s1) == NULL); /* the rest waits on s0 */
    validate(&e, 4 * MB);
    /* s0 can use its own pending blocks at once. */
    cuma_block *k = get(&e, 2 * MB, s0);
    CHECK(k && k->off == 4 * MB);
    ops->free(e.p, k, (uint16_t)s0, cuma_streams_note_free(&e.ss, s0));
    /* Completed and known: the held blocks become everyone's. */
    CHECK_OK(cuma_simbe_hold(e.be, S(0xA0), false));
    CHECK_OK(cuma_simbe_hold(e.be, S(0xB0), false));
    CHECK(op_poll(&e.ss, s0, e.ss.slot[s0].last, false));
    CHECK(op_poll(&e.ss, s1, e.ss.slot[s1].last, false));
    ops->free(e.p, g, (uint16_t)s1, 0);
    ops->free(e.p, h1, (uint16_t)s1, 0);
    ops->free(e.p, h2, (uint16_t)s1, 0);
    validate(&e, 0);
    /* Frees after the fences are known complete merge everything again. */
    ops->coalesce(e.p, NULL, NULL);
    validate(&e, 0);
    CHECK(ops->largest_free(e.p) == 8 * MB);
    teardown(&e);
}

static void count_whole(void *ctx, cuma_block *whole) {
    uint64_t *c = ctx;
    CHECK(whole->is_free);
    c[0]++;
    c[1] = whole->off;
    c[2] = whole->size;
}

/* tlsf: a block merges into the range's top block when fences allow: with fence seq 0 always,
 * with a pending fence and one stream unless CUMA_POLICY_KEEP_TOP_CLEAN; coalesce merges what
 * completed later and reports whole ranges. */
static void test_tlsf_top_and_coalesce(void) {
    for (unsigned flags = 0; flags <= CUMA_POLICY_KEEP_TOP_CLEAN;
         flags += CUMA_POLICY_KEEP_TOP_CLEAN) {
        env e;
        setup(&e, &cuma_tlsf_ops, flags, 0, RANGE);
        unsigned s0 = (unsigned)cuma_streams_index(&e.ss, S(0xA0));
        CHECK_OK(cuma_simbe_hold(e.be, S(0xA0), true));
        cuma_block *a = get(&e, MB, s0);
        CHECK(a->off == 0);
        cuma_block *m = cuma_tlsf_ops.free(e.p, a, (uint16_t)s0, 0);
        CHECK(m->off == 0 && m->size == RANGE); /* clean: always */
        a = get(&e, MB, s0);
        uint64_t q = cuma_streams_note_free(&e.ss, s0);
        m = cuma_tlsf_ops.free(e.p, a, (uint16_t)s0, q);
        if (flags & CUMA_POLICY_KEEP_TOP_CLEAN) {
            CHECK(m->off == 0 && m->size == MB);
            CHECK(cuma_tlsf_ops.largest_free(e.p) == RANGE - MB);
        } else {
            CHECK(m->off == 0 && m->size == RANGE && m->fence_seq == q); /* one stream */
        }
        validate(&e, 0);
        /* Once the fence is known complete, coalesce merges and reports the whole range. */
        uint64_t calls[3] = {0};
        cuma_tlsf_ops.coalesce(e.p, count_whole, calls);
        CHECK(calls[0] == (flags ? 0u : 1u)); /* still pending, unless merged already */
        CHECK_OK(cuma_simbe_hold(e.be, S(0xA0), false));
        CHECK(op_poll(&e.ss, s0, q, false));
        calls[0] = 0;
        cuma_tlsf_ops.coalesce(e.p, count_whole, calls);
        CHECK(calls[0] == 1 && calls[1] == 0 && calls[2] == RANGE);
        CHECK(cuma_tlsf_ops.largest_free(e.p) == RANGE);
        validate(&e, 0);
        teardown(&e);
    }
    /* Two streams and two ranges (as in segment mode): pending memory merges with nothing
     * complete; coalesce reports every range that is one free block, and merges a range
     * once its fences are known complete. */
    env e;
    setup(&e, &cuma_tlsf_ops, 0, 0, 4 * MB);
    CHECK_OK(cuma_tlsf_ops.add_range(e.p, 8 * MB, 4 * MB));
    e.range_size = 8 * MB;
    unsigned s0 = (unsigned)cuma_streams_index(&e.ss, S(0xA0));
    unsigned s1 = (unsigned)cuma_streams_index(&e.ss, S(0xB0));
    CHECK_OK(cuma_simbe_hold(e.be, S(0xA0), true));
    cuma_block *x = get(&e, MB, s0), *y = get(&e, MB, s1);
    CHECK(x->off == 0 && y->off == MB); /* best fit keeps to the first range */
    uint64_t q = cuma_streams_note_free(&e.ss, s0);
    cuma_tlsf_ops.free(e.p, x, (uint16_t)s0, q);
    cuma_block *m = cuma_tlsf_ops.free(e.p, y, (uint16_t)s1, 0);
    CHECK(m->off == MB && m->size == 3 * MB); /* with the clean rest, not with x */
    validate(&e, 0);
    uint64_t calls[3] = {0};
    cuma_tlsf_ops.coalesce(e.p, count_whole, calls);
    CHECK(calls[0] == 1 && calls[1] == 8 * MB && calls[2] == 4 * MB); /* the untouched range */
    CHECK(cuma_tlsf_ops.largest_free(e.p) == 4 * MB);
    CHECK_OK(cuma_simbe_hold(e.be, S(0xA0), false));
    calls[0] = 0;
    cuma_tlsf_ops.coalesce(e.p, count_whole, calls); /* complete, but nobody asked */
    CHECK(calls[0] == 1);
    CHECK(op_poll(&e.ss, s0, q, false));
    calls[0] = 0;
    cuma_tlsf_ops.coalesce(e.p, count_whole, calls);
    CHECK(calls[0] == 2);
    cuma_tlsf_ops.coalesce(e.p, NULL, NULL); /* fn may be NULL */
    validate(&e, 0);
    /* A live block keeps its range from being reported. */
    x = get(&e, 512, s1);
    calls[0] = 0;
    cuma_tlsf_ops.coalesce(e.p, count_whole, calls);
    CHECK(calls[0] == 1 && (calls[1] < 4 * MB) != (x->off < 4 * MB)); /* the other range */
    cuma_tlsf_ops.free(e.p, x, (uint16_t)s1, 0);
    validate(&e, 0);
    teardown(&e);
}

/* Random allocations and frees on three streams with random fences, holds and polls. Every
 * granule handed to a stream must be clean, last freed by that stream, or known complete. */
static void test_random_fences(const cuma_policy_ops *ops, unsigned flags,
                               unsigned long long *seed) {
    const uint64_t R = 64 * MB, NG = R / CUMA_GRANULE;
    env e;
    setup(&e, ops, flags, 0, R);
    enum { NS = 3 };
    unsigned sidx[NS];
    bool held[NS] = {false};
    for (int i = 0; i < NS; i++) sidx[i] = (unsigned)cuma_streams_index(&e.ss, S(0x100 * (i + 1)));
    uint16_t *gs = calloc(NG, sizeof *gs);
    uint64_t *gq = calloc(NG, sizeof *gq);
    enum { MAXLIVE = 4096 };
    live_block *live = malloc(MAXLIVE * sizeof *live);
    CHECK(gs && gq && live);
    int n = 0;
    uint64_t live_bytes = 0, nulls = 0, allocs = 0, reused_pending = 0;
    for (int op = 1; op <= 100000; op++) {
        unsigned r = (unsigned)(rnd(seed) % 100);
        if (r < 45 && n < MAXLIVE && live_bytes < R - R / 8) {
            unsigned s = sidx[rnd(seed) % NS];
            uint64_t req = random_size(seed, 20);
            cuma_block *b = get(&e, req, s);
            if (!b) {
                nulls++;
                continue;
            }
            allocs++;
            check_block(&e, b, ops->round(req));
            check_no_overlap(live, n, b);
            for (uint64_t g = b->off / CUMA_GRANULE; g < (b->off + b->size) / CUMA_GRANULE; g++) {
                bool ok = gq[g] == 0 || gs[g] == s || cuma_fence_known_done(&e.ss, gs[g], gq[g]);
                if (!ok) {
                    fprintf(stderr,
                            "%s: granule %llu (freed on stream %u, seq %llu) handed to stream %u\n",
                            ops->name, (unsigned long long)g, gs[g], (unsigned long long)gq[g], s);
                    CHECK(0);
                }
                reused_pending +=
                    gq[g] && gs[g] == s && !cuma_fence_known_done(&e.ss, gs[g], gq[g]);
            }
            live[n].b = b, live[n].off = b->off, live[n].size = b->size;
            n++;
            live_bytes += b->size;
        } else if (r < 88 && n) {
            int k = (int)(rnd(seed) % (uint64_t)n);
            live_block lb = live[k];
            unsigned fs = rnd(seed) % 4 ? lb.b->stream : sidx[rnd(seed) % NS];
            uint64_t q = rnd(seed) % 8 ? cuma_streams_note_free(&e.ss, fs) : 0;
            cuma_block *m = ops->free(e.p, lb.b, (uint16_t)fs, q);
            CHECK(m->is_free && m->off <= lb.off && m->off + m->size >= lb.off + lb.size);
            for (uint64_t g = lb.off / CUMA_GRANULE; g < (lb.off + lb.size) / CUMA_GRANULE; g++)
                gs[g] = (uint16_t)fs, gq[g] = q;
            live_bytes -= lb.size;
            live[k] = live[--n];
        } else if (r < 93) {
            int i = (int)(rnd(seed) % NS);
            held[i] = !held[i];
            CHECK_OK(cuma_simbe_hold(e.be, S(0x100 * (i + 1)), held[i]));
        } else if (r < 98) {
            for (int i = 0; i < NS; i++) op_poll(&e.ss, sidx[i], e.ss.slot[sidx[i]].last, false);
        } else {
            ops->coalesce(e.p, NULL, NULL);
        }
        if (op % 5000 == 0) {
            validate(&e, live_bytes);
            const char *why = NULL;
            if (!cuma_streams_validate(&e.ss, &why)) {
                fprintf(stderr, "streams: %s\n", why);
                CHECK(0);
            }
        }
    }
    CHECK(allocs > 10000 && reused_pending > 0);
    /* Everything completes and comes back. */
    for (int i = 0; i < NS; i++) {
        if (held[i]) CHECK_OK(cuma_simbe_hold(e.be, S(0x100 * (i + 1)), false));
        CHECK(op_poll(&e.ss, sidx[i], e.ss.slot[sidx[i]].last, false));
    }
    while (n) {
        live_block lb = live[--n];
        ops->free(e.p, lb.b, lb.b->stream, cuma_streams_note_free(&e.ss, lb.b->stream));
        live_bytes -= lb.size;
    }
    for (int i = 0; i < NS; i++) CHECK(op_poll(&e.ss, sidx[i], e.ss.slot[sidx[i]].last, false));
    ops->coalesce(e.p, NULL, NULL);
    validate(&e, 0);
    if (ops == &cuma_tlsf_ops) CHECK(ops->largest_free(e.p) == R);
    /* Whatever the buddy left unmerged, every stream can use all of it now. */
    uint64_t got = 0;
    for (cuma_block *b; (b = get(&e, 512, sidx[rnd(seed) % NS]));) got += b->size;
    CHECK(got == R);
    validate(&e, R);
    teardown(&e);
    free(gs), free(gq), free(live);
}

/* tlsf.c scan_bin()/tlsf_alloc(): only the first SCAN (16) blocks of the request's own bin are
 * examined. When 16 smaller blocks of that bin come first and no higher bin has a block, the
 * fitting block behind them is never found and alloc returns NULL, although largest_free()
 * reports it. Here: blocks of 64 and 65 granules share bin (2, 0); the 65-granule block was
 * freed first, then 17 of 64 granules. In the heap this is an OOM (VMM: once the range's top
 * is used up) or a needless new segment (segment mode: every segment is a range). */
static void test_tlsf_scan_limit(void) {
    const uint64_t big = 65 * CUMA_GRANULE, small = 64 * CUMA_GRANULE, sep = CUMA_GRANULE;
    const uint64_t total = big + sep + 17 * (small + sep);
    env e;
    setup(&e, &cuma_tlsf_ops, 0, 0, total);
    cuma_block *blk[18], *seps[18];
    for (int i = 0; i < 18; i++) {
        blk[i] = get(&e, i ? small : big, 0);
        seps[i] = get(&e, sep, 0);
        CHECK(blk[i] && seps[i]);
    }
    CHECK(cuma_tlsf_ops.largest_free(e.p) == 0);
    for (int i = 0; i < 18; i++) cuma_tlsf_ops.free(e.p, blk[i], 0, 0);
    validate(&e, 18 * sep);
    CHECK(cuma_tlsf_ops.largest_free(e.p) == big);
    cuma_block *b = get(&e, big, 0);
    CHECK(b != NULL); /* fails: NULL */
    teardown(&e);
}

/* buddy.c buddy_alloc(): the same bound with fences. Only the first 16 blocks of each order
 * are examined; when they all wait on another stream and no higher order has a block, a clean
 * block behind them is not found. */
static void test_buddy_scan_limit(void) {
    env e;
    setup(&e, &cuma_buddy_ops, 0, 0, 64 * MB);
    unsigned s0 = (unsigned)cuma_streams_index(&e.ss, S(0xA0));
    unsigned s1 = (unsigned)cuma_streams_index(&e.ss, S(0xB0));
    CHECK_OK(cuma_simbe_hold(e.be, S(0xA0), true));
    cuma_block *b[64];
    for (int i = 0; i < 64; i++) CHECK((b[i] = get(&e, MB, s0)) != NULL);
    cuma_buddy_ops.free(e.p, b[0], (uint16_t)s0, 0); /* clean, first in, last on the list */
    for (int i = 2; i <= 32; i += 2)                 /* 16 pending, their buddies live */
        cuma_buddy_ops.free(e.p, b[i], (uint16_t)s0, cuma_streams_note_free(&e.ss, s0));
    cuma_block *x = get(&e, MB, s1);
    CHECK(x != NULL && x->off == 0); /* fails: NULL */
    teardown(&e);
}

/* buddy.c buddy_coalesce() does nothing, against policy.h ("merges free neighbours that fences
 * now allow to merge; calls fn for every free block that then spans a whole range"): buddies
 * freed with different fences stay apart after the fences complete, so the whole range is
 * free but a request for all of it fails, and fn is never called. */
static void test_buddy_coalesce(void) {
    env e;
    setup(&e, &cuma_buddy_ops, 0, 0, 4 * MB);
    unsigned s0 = (unsigned)cuma_streams_index(&e.ss, S(0xA0));
    (void)cuma_streams_index(&e.ss, S(0xB0));
    CHECK_OK(cuma_simbe_hold(e.be, S(0xA0), true));
    cuma_block *a = get(&e, 2 * MB, s0), *b = get(&e, 2 * MB, s0);
    uint64_t q = cuma_streams_note_free(&e.ss, s0);
    cuma_buddy_ops.free(e.p, a, (uint16_t)s0, q);
    cuma_buddy_ops.free(e.p, b, (uint16_t)s0, 0);
    CHECK_OK(cuma_simbe_hold(e.be, S(0xA0), false));
    CHECK(op_poll(&e.ss, s0, q, false));
    uint64_t calls[3] = {0};
    cuma_buddy_ops.coalesce(e.p, count_whole, calls);
    CHECK(calls[0] == 1);                              /* fails: 0 */
    CHECK(cuma_buddy_ops.largest_free(e.p) == 4 * MB); /* fails: 2 MiB */
    teardown(&e);
}

/* tlsf.c hint_choose(): with the pages known, a block of 1/32 of a page up to a page goes to
 * the lowest fitting address among the best fit and the next blocks by size, not to the best
 * fit: holes x (768 KiB at 1 MiB) and y (512 KiB at 5.75 MiB) between live blocks, a 512 KiB
 * request. Best fit takes y (still so without a hint, and for a block under 64 KiB). */
static void test_tlsf_hint_lowest(void) {
    env e;
    setup(&e, &cuma_tlsf_ops, CUMA_POLICY_KEEP_TOP_CLEAN, 0, 64 * MB);
    uint32_t used[32] = {1, 1, 1, 1};
    cuma_block *a = get(&e, MB, 0), *x = get(&e, 768 * KB, 0), *s1 = get(&e, 4 * MB, 0);
    cuma_block *y = get(&e, 512 * KB, 0), *s2 = get(&e, MB, 0);
    CHECK(a && x && s1 && y && s2 && x->off == MB && y->off == 5 * MB + 768 * KB);
    uint64_t xo = x->off, yo = y->off;
    cuma_tlsf_ops.free(e.p, x, 0, 0);
    cuma_tlsf_ops.free(e.p, y, 0, 0);
    cuma_block *b = get(&e, 512 * KB, 0); /* no hint: best fit */
    CHECK(b && b->off == yo);
    cuma_tlsf_ops.free(e.p, b, 0, 0);
    e.p->hint = (cuma_place_hint){used, 32, 21};
    b = get(&e, 32 * KB, 0); /* under 1/32 of a page: best fit */
    CHECK(b && b->off == yo);
    cuma_tlsf_ops.free(e.p, b, 0, 0);
    b = get(&e, 512 * KB, 0);
    CHECK(b && b->off == xo); /* fails: best fit, 5.75 MiB */
    validate(&e, 6 * MB + 512 * KB);
    teardown(&e);
}

/* hint_choose(): the end of the hole a small block goes at is the one on a page in use. Hole
 * [4, 7.5) MiB: its page [4, 6) holds nothing, [6, 8) a live block above it; a 1 MiB block goes
 * at [6.5, 7.5), not at 4 MiB where it would need a page of its own; the hole's rest stays one
 * free block that a 2.5 MiB request then fills exactly. */
/* The candidates are the next fitting blocks besides the best fit: meeting the best fit after a
 * lower block was picked does not use up one of the 8. Scan order (by bin): L and the best fit Y
 * in the request's bin (L freed last, so first), then B1..B7 in seven higher bins; B7 is the
 * lowest. Counting Y, the scan stopped at B6 and took B1. */
static void test_tlsf_hint_candidates(void) {
    env e;
    setup(&e, &cuma_tlsf_ops, CUMA_POLICY_KEEP_TOP_CLEAN, 0, 64 * MB);
    uint32_t used[32];
    for (int i = 0; i < 32; i++) used[i] = 1;
    const uint64_t sizes[9] = {736 * KB, 544 * KB, 576 * KB, 608 * KB, 640 * KB,
                               672 * KB, 704 * KB, 520 * KB, 512 * KB}; /* B7, B1..B6, L, Y */
    cuma_block *blk[9], *sep[9];
    for (int i = 0; i < 9; i++) {
        blk[i] = get(&e, sizes[i], 0);
        sep[i] = get(&e, 64 * KB, 0); /* keeps the free blocks apart */
        CHECK(blk[i] && sep[i]);
    }
    uint64_t b7 = blk[0]->off;
    for (int i = 0; i < 9; i++) CHECK(i == 0 || blk[i]->off > b7);
    /* Y before L: L, freed last, heads the request's bin. */
    cuma_tlsf_ops.free(e.p, blk[8], 0, 0);
    cuma_tlsf_ops.free(e.p, blk[7], 0, 0);
    for (int i = 0; i < 7; i++) cuma_tlsf_ops.free(e.p, blk[i], 0, 0);
    e.p->hint = (cuma_place_hint){used, 32, 21};
    cuma_block *b = get(&e, 512 * KB, 0);
    CHECK(b && b->off == b7);
    cuma_tlsf_ops.free(e.p, b, 0, 0);
    for (int i = 0; i < 9; i++) cuma_tlsf_ops.free(e.p, sep[i], 0, 0);
    validate(&e, 0);
    teardown(&e);
}

static void test_tlsf_hint_top_end(void) {
    env e;
    setup(&e, &cuma_tlsf_ops, CUMA_POLICY_KEEP_TOP_CLEAN, 0, 64 * MB);
    uint32_t used[32] = {1, 1, 0, 1, 1};
    cuma_block *a = get(&e, 4 * MB, 0), *x = get(&e, 3 * MB + 512 * KB, 0);
    cuma_block *s = get(&e, MB, 0);
    CHECK(a && x && s && x->off == 4 * MB && s->off == 7 * MB + 512 * KB);
    cuma_tlsf_ops.free(e.p, x, 0, 0);
    e.p->hint = (cuma_place_hint){used, 32, 21};
    cuma_block *b = get(&e, MB, 0);
    CHECK(b && b->off == 6 * MB + 512 * KB); /* fails: 4 MiB */
    validate(&e, 6 * MB);
    cuma_block *c = get(&e, 2 * MB + 512 * KB, 0);
    CHECK(c && c->off == 4 * MB);
    validate(&e, 8 * MB + 512 * KB);
    teardown(&e);
}

/* Every descriptor at its type's alignment, so that none shares a cache line with another:
 * two threads' fast paths each write their own block's fields, and descriptors straddling
 * lines made each call miss (the 2-thread fast path ran at 2.7x the 1-thread cost). calloc
 * gave the 128 KiB chunks 16 bytes past a page. */
static void test_blockpool_aligned(void) {
    enum { N = 2500 }; /* three chunks */
    static cuma_block *b[N];
    cuma_blockpool bp;
    cuma_blockpool_init(&bp);
    for (int i = 0; i < N; i++) {
        b[i] = cuma_block_new(&bp);
        CHECK(b[i] != NULL);
        if ((uintptr_t)b[i] % _Alignof(cuma_block))
            fprintf(stderr, "block %d at %p: not %zu-aligned\n", i, (void *)b[i],
                    (size_t) _Alignof(cuma_block));
        CHECK((uintptr_t)b[i] % _Alignof(cuma_block) == 0);
    }
    CHECK(bp.live == N);
    for (int i = 0; i < N; i++) cuma_block_delete(&bp, b[i]);
    CHECK(bp.live == 0);
    cuma_blockpool_destroy(&bp);
}

int main(void) {
    unsigned long long seed = test_seed();
    const cuma_policy_ops *all[] = {&cuma_tlsf_ops, &cuma_buddy_ops};
    for (int i = 0; i < 2; i++) {
        const cuma_policy_ops *ops = all[i];
        test_round_and_ranges(ops);
        test_random(ops, 0, &seed, false);
        test_fences(ops, 0);
        test_merge_rules(ops);
        test_random_fences(ops, 0, &seed);
    }
    test_random(&cuma_tlsf_ops, CUMA_POLICY_KEEP_TOP_CLEAN, &seed, false);
    test_random(&cuma_tlsf_ops, CUMA_POLICY_KEEP_TOP_CLEAN, &seed, true);
    test_tlsf_hint_lowest();
    test_tlsf_hint_top_end();
    test_tlsf_hint_candidates();
    test_fences(&cuma_tlsf_ops, CUMA_POLICY_KEEP_TOP_CLEAN);
    test_random_fences(&cuma_tlsf_ops, CUMA_POLICY_KEEP_TOP_CLEAN, &seed);
    test_tlsf_top_and_coalesce();
    test_tlsf_scan_limit();
    test_buddy_scan_limit();
    test_buddy_coalesce();
    test_blockpool_aligned();
    printf("test_policy: all passed\n");
    return 0;
}
