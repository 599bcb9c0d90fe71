// SPDX-License-Identifier: Apache-2.0
/* The open-addressing map (src/util/hashmap.c): put/get/remove/replace, growth, each, removal
 * whose backward shift wraps around the end of the table, and 10^6 random operations checked
 * against a plain array, with cuma_map_validate after every phase. */
#include "check.h"
#include "util/hashmap.h"

#include <stdbool.h>
#include <stdint.h>
#include <string.h>

#define VAL(x) ((void *)(uintptr_t)(x))

static void validate(const cuma_map *m) {
    const char *why = NULL;
    if (!cuma_map_validate(m, &why)) {
        fprintf(stderr, "cuma_map_validate: %s\n", why ? why : "(no reason)");
        CHECK(0);
    }
    CHECK(m->cap == 0 || (m->cap & (m->cap - 1)) == 0);
    CHECK(m->count * 2 <= m->cap || m->cap == 0);
}

/* The home slot as hashmap.c computes it (Fibonacci hashing, bits 17 and up). The tests that
 * need colliding keys check that this copy still matches the map's layout. */
static size_t home_of(uint64_t key, size_t cap) {
    return (size_t)((key * 0x9E3779B97F4A7C15ull) >> 17) & (cap - 1);
}

static bool count_fn(void *ctx, uint64_t key, void *val) {
    (void)key, (void)val;
    (*(size_t *)ctx)++;
    return true;
}

typedef struct each_ctx {
    size_t calls, stop_after;
    uint64_t key_sum, val_sum;
} each_ctx;

static bool sum_fn(void *ctx, uint64_t key, void *val) {
    each_ctx *c = ctx;
    c->calls++;
    c->key_sum += key;
    c->val_sum += (uint64_t)(uintptr_t)val;
    return c->calls != c->stop_after;
}

static void test_basic(void) {
    cuma_map m;
    cuma_map_init(&m);
    validate(&m);
    CHECK(m.cap == 0 && m.count == 0);
    CHECK(cuma_map_get(&m, 0) == NULL && cuma_map_get(&m, 42) == NULL);
    CHECK(cuma_map_remove(&m, 42) == NULL);
    size_t n = 0;
    cuma_map_each(&m, count_fn, &n);
    CHECK(n == 0);

    CHECK(cuma_map_put(&m, 512, VAL(1)));
    CHECK(m.cap > 0 && m.count == 1);
    CHECK(cuma_map_get(&m, 512) == VAL(1) && cuma_map_get(&m, 1024) == NULL);
    /* Key 0 and the largest key are ordinary keys. */
    CHECK(cuma_map_put(&m, 0, VAL(2)) && cuma_map_put(&m, UINT64_MAX, VAL(3)));
    CHECK(cuma_map_get(&m, 0) == VAL(2) && cuma_map_get(&m, UINT64_MAX) == VAL(3));
    CHECK(m.count == 3);
    validate(&m);
    /* Replace keeps the count. */
    CHECK(cuma_map_put(&m, 512, VAL(10)));
    CHECK(m.count == 3 && cuma_map_get(&m, 512) == VAL(10));
    validate(&m);
    /* Remove returns the value once. */
    CHECK(cuma_map_remove(&m, 512) == VAL(10));
    CHECK(cuma_map_remove(&m, 512) == NULL);
    CHECK(cuma_map_get(&m, 512) == NULL && m.count == 2);
    CHECK(cuma_map_remove(&m, 777) == NULL && m.count == 2);
    CHECK(cuma_map_remove(&m, 0) == VAL(2) && cuma_map_remove(&m, UINT64_MAX) == VAL(3));
    CHECK(m.count == 0);
    validate(&m);
    /* Every slot is empty again. */
    for (size_t i = 0; i < m.cap; i++) CHECK(m.vals[i] == NULL);
    CHECK(cuma_map_put(&m, 512, VAL(4)) && cuma_map_get(&m, 512) == VAL(4));
    cuma_map_destroy(&m);
    CHECK(m.cap == 0 && m.count == 0 && !m.keys && !m.vals);
    CHECK(cuma_map_get(&m, 512) == NULL && cuma_map_remove(&m, 512) == NULL);
    cuma_map_destroy(&m); /* twice is harmless */
}

static void test_growth_and_each(void) {
    cuma_map m;
    cuma_map_init(&m);
    const size_t N = 200000;
    size_t last_cap = 0, grows = 0;
    for (size_t i = 0; i < N; i++) {
        uint64_t key = (uint64_t)i * 512; /* aligned offsets, as the heap uses */
        CHECK(cuma_map_put(&m, key, VAL(i + 1)));
        CHECK(m.count == i + 1 && m.count * 2 <= m.cap);
        if (m.cap != last_cap) {
            CHECK(last_cap == 0 || m.cap == last_cap * 2);
            last_cap = m.cap;
            grows++;
            validate(&m);
            /* Every key survived the rehash. */
            for (size_t j = 0; j <= i; j++)
                CHECK(cuma_map_get(&m, (uint64_t)j * 512) == VAL(j + 1));
        }
    }
    CHECK(grows >= 10);
    validate(&m);
    for (size_t i = 0; i < N; i++) CHECK(cuma_map_get(&m, (uint64_t)i * 512) == VAL(i + 1));
    CHECK(cuma_map_get(&m, 511) == NULL && cuma_map_get(&m, (uint64_t)N * 512) == NULL);

    each_ctx c = {0};
    cuma_map_each(&m, sum_fn, &c);
    CHECK(c.calls == N);
    CHECK(c.key_sum == 512ull * (N - 1) * N / 2 && c.val_sum == (uint64_t)N * (N + 1) / 2);
    /* each stops when fn says so. */
    each_ctx stop = {.stop_after = 3};
    cuma_map_each(&m, sum_fn, &stop);
    CHECK(stop.calls == 3);

    /* Remove every other key; the map does not shrink, lookups stay right. */
    size_t cap = m.cap;
    for (size_t i = 0; i < N; i += 2) CHECK(cuma_map_remove(&m, (uint64_t)i * 512) == VAL(i + 1));
    CHECK(m.count == N / 2 && m.cap == cap);
    validate(&m);
    for (size_t i = 0; i < N; i++)
        CHECK(cuma_map_get(&m, (uint64_t)i * 512) == (i % 2 ? VAL(i + 1) : NULL));
    for (size_t i = 1; i < N; i += 2) CHECK(cuma_map_remove(&m, (uint64_t)i * 512) == VAL(i + 1));
    CHECK(m.count == 0);
    validate(&m);
    cuma_map_destroy(&m);
}

/* Keys with a given home slot in a table of `cap` slots. */
static void keys_with_home(size_t home, size_t cap, uint64_t *out, int n, uint64_t *cursor) {
    for (int k = 0; k < n; (*cursor)++)
        if (home_of(*cursor, cap) == home) out[k++] = *cursor;
}

static void check_present(const cuma_map *m, const uint64_t *keys, const bool *present, int n) {
    for (int i = 0; i < n; i++) CHECK(cuma_map_get(m, keys[i]) == (present[i] ? VAL(i + 1) : NULL));
}

/* Keys that collide at the end of the table fill it and wrap to slots 0, 1, ...; keys whose
 * home is slot 0 or 1 then sit behind them. Removing them in every order must move each
 * survivor back only where its probe sequence allows, across the wrap. */
static void test_wraparound(void) {
    cuma_map probe;
    cuma_map_init(&probe);
    CHECK(cuma_map_put(&probe, 1, VAL(1)));
    const size_t cap = probe.cap; /* the first table */
    cuma_map_destroy(&probe);
    CHECK(cap >= 8);

    enum { N = 7 };
    uint64_t keys[N], cursor = 1;
    keys_with_home(cap - 1, cap, keys, 3, &cursor);     /* home: the last slot */
    keys_with_home(cap - 2, cap, keys + 3, 1, &cursor); /* home: the one before */
    keys_with_home(0, cap, keys + 4, 2, &cursor);       /* home: slot 0 */
    keys_with_home(1, cap, keys + 6, 1, &cursor);       /* home: slot 1 */

    /* Inserted in this order, the layout is fixed: check it, so that a changed hash shows
     * here rather than as a weaker test. */
    cuma_map m;
    cuma_map_init(&m);
    for (int i = 0; i < N; i++) CHECK(cuma_map_put(&m, keys[i], VAL(i + 1)));
    CHECK(m.cap == cap);
    /* slots: cap-2: k3, cap-1: k0, 0: k1, 1: k2, 2: k4, 3: k5, 4: k6 */
    CHECK(m.keys[cap - 2] == keys[3] && m.keys[cap - 1] == keys[0]);
    CHECK(m.keys[0] == keys[1] && m.keys[1] == keys[2] && m.keys[2] == keys[4]);
    CHECK(m.keys[3] == keys[5] && m.keys[4] == keys[6] && m.vals[5] == NULL);
    validate(&m);
    /* The first removal shifts every entry of the wrapped run back by one. */
    CHECK(cuma_map_remove(&m, keys[0]) == VAL(1));
    CHECK(m.keys[cap - 1] == keys[1] && m.keys[0] == keys[2] && m.keys[1] == keys[4]);
    CHECK(m.keys[2] == keys[5] && m.keys[3] == keys[6] && m.vals[4] == NULL);
    validate(&m);
    cuma_map_destroy(&m);

    /* Every removal order of the seven keys (7! = 5040), validated after each step. */
    int perm[N];
    for (int i = 0; i < N; i++) perm[i] = i;
    long orders = 0;
    for (;;) {
        cuma_map_init(&m);
        for (int i = 0; i < N; i++) CHECK(cuma_map_put(&m, keys[i], VAL(i + 1)));
        bool present[N];
        for (int i = 0; i < N; i++) present[i] = true;
        for (int s = 0; s < N; s++) {
            CHECK(cuma_map_remove(&m, keys[perm[s]]) == VAL(perm[s] + 1));
            present[perm[s]] = false;
            validate(&m);
            check_present(&m, keys, present, N);
            /* Re-insert and remove again: the run is rebuilt with a different layout. */
            if (s == N / 2) {
                CHECK(cuma_map_put(&m, keys[perm[s]], VAL(perm[s] + 1)));
                validate(&m);
                CHECK(cuma_map_remove(&m, keys[perm[s]]) == VAL(perm[s] + 1));
                validate(&m);
                check_present(&m, keys, present, N);
            }
        }
        CHECK(m.count == 0);
        cuma_map_destroy(&m);
        orders++;
        /* next permutation */
        int i = N - 2;
        while (i >= 0 && perm[i] > perm[i + 1]) i--;
        if (i < 0) break;
        int j = N - 1;
        while (perm[j] < perm[i]) j--;
        int t = perm[i];
        perm[i] = perm[j], perm[j] = t;
        for (int a = i + 1, b = N - 1; a < b; a++, b--) t = perm[a], perm[a] = perm[b], perm[b] = t;
    }
    CHECK(orders == 5040);

    /* A long run across the end: many keys homed in the last few slots, up to the load
     * limit, removed from the middle of the run. */
    cuma_map_init(&m);
    CHECK(cuma_map_put(&m, 1, VAL(1000)));
    CHECK(cuma_map_remove(&m, 1) == VAL(1000));
    enum { R = 24 };
    uint64_t run[R];
    cursor = 1;
    for (int i = 0; i < R; i++) keys_with_home(cap - 1 - (size_t)(i % 3), cap, &run[i], 1, &cursor);
    for (int i = 0; i < R && (size_t)(i + 1) * 2 <= cap; i++)
        CHECK(cuma_map_put(&m, run[i], VAL(i + 1)));
    CHECK(m.cap == cap);
    int in = (int)(m.count);
    bool present[R] = {false};
    for (int i = 0; i < in; i++) present[i] = true;
    for (int i = in / 2; i >= 0; i -= 2) {
        CHECK(cuma_map_remove(&m, run[i]) == VAL(i + 1));
        present[i] = false;
        validate(&m);
        for (int k = 0; k < in; k++)
            CHECK(cuma_map_get(&m, run[k]) == (present[k] ? VAL(k + 1) : NULL));
    }
    cuma_map_destroy(&m);
}

/* A bijection of 64-bit values (the splitmix64 finalizer). */
static uint64_t mix64(uint64_t x) {
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
    x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
    return x ^ (x >> 31);
}

static int cmp_u64(const void *a, const void *b) {
    uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
    return x < y ? -1 : x > y;
}

/* Random operations on a universe of keys, against a plain array. */
static void test_random(void) {
    unsigned long long seed = test_seed();
    enum { U = 1 << 15 };
    uint64_t *keys = malloc(U * sizeof *keys);
    uintptr_t *shadow = calloc(U, sizeof *shadow);
    CHECK(keys && shadow);
    /* Distinct keys: odd indices give aligned offsets (as the heap uses), even ones arbitrary
     * 64-bit values from a bijection of the index; sorted, they must differ. */
    uint64_t salt = rnd(&seed);
    for (size_t i = 0; i < U; i++) keys[i] = i % 2 ? (uint64_t)i * 512 : mix64(i + salt);
    uint64_t *sorted = malloc(U * sizeof *sorted);
    CHECK(sorted);
    memcpy(sorted, keys, U * sizeof *sorted);
    qsort(sorted, U, sizeof *sorted, cmp_u64);
    for (size_t i = 1; i < U; i++) CHECK(sorted[i] != sorted[i - 1]);
    free(sorted);
    cuma_map m;
    cuma_map_init(&m);
    size_t live = 0;
    const long OPS = 1000000;
    /* Phases change the share of puts, so the live set grows, churns at a steady size and
     * shrinks; the universe in use widens so that the table keeps growing. */
    static const struct {
        unsigned put_pct;
        size_t universe;
    } phases[] = {{80, U / 16}, {50, U / 16}, {70, U / 4}, {50, U / 2}, {80, U},
                  {50, U},      {20, U},      {50, U / 8}, {5, U},      {60, U}};
    const int NPH = (int)(sizeof phases / sizeof phases[0]);
    for (int ph = 0; ph < NPH; ph++) {
        for (long op = 0; op < OPS / NPH; op++) {
            size_t i = (size_t)(rnd(&seed) % phases[ph].universe);
            unsigned r = (unsigned)(rnd(&seed) % 100);
            if (r < phases[ph].put_pct) {
                uintptr_t v = (uintptr_t)(rnd(&seed) | 1);
                CHECK(cuma_map_put(&m, keys[i], (void *)v));
                live += !shadow[i];
                shadow[i] = v;
            } else if (r < phases[ph].put_pct + (100 - phases[ph].put_pct) * 3 / 4) {
                void *got = cuma_map_remove(&m, keys[i]);
                CHECK(got == (void *)shadow[i]);
                live -= !!shadow[i];
                shadow[i] = 0;
            } else {
                CHECK(cuma_map_get(&m, keys[i]) == (void *)shadow[i]);
            }
            CHECK(m.count == live);
        }
        validate(&m);
        for (size_t i = 0; i < U; i++) CHECK(cuma_map_get(&m, keys[i]) == (void *)shadow[i]);
        size_t n = 0;
        cuma_map_each(&m, count_fn, &n);
        CHECK(n == live);
    }
    /* Empty it. */
    for (size_t i = 0; i < U; i++)
        if (shadow[i]) CHECK(cuma_map_remove(&m, keys[i]) == (void *)shadow[i]);
    CHECK(m.count == 0);
    validate(&m);
    for (size_t i = 0; i < m.cap; i++) CHECK(m.vals[i] == NULL);
    cuma_map_destroy(&m);
    free(keys);
    free(shadow);
}

/* cuma_map_validate finds broken maps. */
static void test_validate_detects(void) {
    cuma_map m;
    cuma_map_init(&m);
    uint64_t keys[3], cursor = 1;
    CHECK(cuma_map_put(&m, 1, VAL(1)));
    CHECK(cuma_map_remove(&m, 1) == VAL(1));
    keys_with_home(5, m.cap, keys, 3, &cursor);
    for (int i = 0; i < 3; i++) CHECK(cuma_map_put(&m, keys[i], VAL(i + 1)));
    validate(&m);
    const char *why = NULL;
    /* A hole in the middle of a run. */
    CHECK(m.keys[6] == keys[1]);
    m.vals[6] = NULL;
    CHECK(!cuma_map_validate(&m, &why) && why && strstr(why, "unreachable"));
    m.vals[6] = VAL(2);
    validate(&m);
    /* A wrong count. */
    m.count++;
    why = NULL;
    CHECK(!cuma_map_validate(&m, &why) && why);
    m.count--;
    /* Over half full. */
    size_t count = m.count;
    m.count = m.cap / 2 + 1;
    why = NULL;
    CHECK(!cuma_map_validate(&m, &why) && why && strstr(why, "load"));
    m.count = count;
    validate(&m);
    cuma_map_destroy(&m);
}

int main(void) {
    test_basic();
    test_growth_and_each();
    test_wraparound();
    test_validate_detects();
    test_random();
    printf("test_hashmap: all passed\n");
    return 0;
}
