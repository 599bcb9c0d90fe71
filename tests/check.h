// SPDX-License-Identifier: Apache-2.0
/* Test assertions that stay on in release builds and say what failed. */
#ifndef CUMA_TESTS_CHECK_H
#define CUMA_TESTS_CHECK_H

#include <stdio.h>
#include <stdlib.h>

#include "cuma/cuma.h"

#define CHECK(cond)                                                                                \
    do {                                                                                           \
        if (!(cond)) {                                                                             \
            fprintf(stderr, "%s:%d: CHECK failed: %s (last error: %s)\n", __FILE__, __LINE__,      \
                    #cond, cuma_last_error());                                                     \
            abort();                                                                               \
        }                                                                                          \
    } while (0)

#define CHECK_OK(expr)                                                                             \
    do {                                                                                           \
        cuma_status st_ = (expr);                                                                  \
        if (st_ != CUMA_OK) {                                                                      \
            fprintf(stderr, "%s:%d: %s returned %s: %s\n", __FILE__, __LINE__, #expr,              \
                    cuma_status_string(st_), cuma_last_error());                                   \
            abort();                                                                               \
        }                                                                                          \
    } while (0)

#define CHECK_ST(expr, want)                                                                       \
    do {                                                                                           \
        cuma_status st_ = (expr);                                                                  \
        if (st_ != (want)) {                                                                       \
            fprintf(stderr, "%s:%d: %s returned %s, wanted %s (%s)\n", __FILE__, __LINE__, #expr,  \
                    cuma_status_string(st_), cuma_status_string(want), cuma_last_error());         \
            abort();                                                                               \
        }                                                                                          \
    } while (0)

/* A heap from a settings string, CUMA_CONF ignored; the test fails if it cannot be made. */
static inline cuma_heap *heap_make(const char *conf) {
    cuma_config cfg = {.conf = conf, .flags = CUMA_CONFIG_NO_ENV};
    cuma_heap *h = NULL;
    CHECK_OK(cuma_heap_create(&cfg, &h));
    return h;
}

static inline cuma_stats heap_stats(cuma_heap *h) {
    cuma_stats s;
    CHECK_OK(cuma_get_stats(h, &s));
    return s;
}

/* Seeded xorshift: randomized tests print their seed and take CUMA_TEST_SEED to replay it. */
static inline unsigned long long test_seed(void) {
    const char *e = getenv("CUMA_TEST_SEED");
    unsigned long long s =
        e ? strtoull(e, NULL, 0) : 0x9E3779B97F4A7C15ull ^ (unsigned long long)(size_t)&test_seed;
    if (!s) s = 1;
    fprintf(stderr, "seed: CUMA_TEST_SEED=0x%llx\n", s);
    return s;
}

static inline unsigned long long rnd(unsigned long long *s) {
    unsigned long long x = *s;
    x ^= x << 13, x ^= x >> 7, x ^= x << 17;
    return *s = x;
}

#endif
