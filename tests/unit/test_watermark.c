// SPDX-License-Identifier: Apache-2.0
/* Device pressure (free_watermark): another program takes memory on the (simulated) device; while
 * the device's free memory is under the watermark, the heap's release thread gives back idle pages,
 * oldest first, just enough to lift it again, never pages under live bytes, and nothing while
 * the device has room. Real clock and release thread; every wait polls with a deadline. */
#include "check.h"
#include "cuma/sim.h"

#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#define MB (1024ull * 1024ull)

static uint64_t now_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000 + (uint64_t)ts.tv_nsec / 1000000;
}

static cuma_stats stats(cuma_heap *h) {
    cuma_stats s;
    CHECK_OK(cuma_get_stats(h, &s));
    return s;
}

/* Waits (at most 20 s: a bound on a hang, not on speed) until the heap's cached bytes are at most
 * `want`; returns the ms it took. */
static uint64_t wait_cached_at_most(cuma_heap *h, uint64_t want) {
    uint64_t t0 = now_ms();
    while (stats(h).cached_bytes > want) {
        if (now_ms() - t0 > 20000) {
            cuma_stats s = stats(h);
            fprintf(stderr, "test_watermark: cached %llu bytes after 20 s, wanted at most %llu\n",
                    (unsigned long long)s.cached_bytes, (unsigned long long)want);
            CHECK(0);
        }
        usleep(1000);
    }
    return now_ms() - t0;
}

/* The cache stays as it is for `ms` milliseconds. */
static void check_cache_stays(cuma_heap *h, uint64_t cached, unsigned ms) {
    for (unsigned i = 0; i < ms; i += 5) {
        CHECK(stats(h).cached_bytes == cached);
        usleep(5000);
    }
}

int main(void) {
    /* No release by age: only device pressure gives idle pages back. */
    cuma_heap *h = heap_make("backend:sim,capacity:1G,page_size:2M,release_delay_ms:never,"
                             "tcache:off,arenas:1,free_watermark:100M");
    void *big, *live;
    CHECK_OK(cuma_alloc(h, 600 * MB, 0, &big));
    CHECK_OK(cuma_alloc(h, 200 * MB, 0, &live));
    CHECK_OK(cuma_free(h, big, 0));
    cuma_stats s = stats(h);
    CHECK(s.cached_bytes == 600 * MB && s.reserved_bytes == 800 * MB);
    /* 224M free: above the watermark, nothing goes. */
    check_cache_stays(h, 600 * MB, 60);

    /* Another program takes 200M: 24M free, 76M under the watermark; 38 pages go, no more. */
    CHECK_OK(cuma_sim_take_memory(h, 200 * MB));
    uint64_t took = wait_cached_at_most(h, 524 * MB);
    s = stats(h);
    printf("test_watermark: 76M under the watermark, given back within %llu ms\n",
           (unsigned long long)took);
    CHECK(s.cached_bytes == 524 * MB);
    CHECK(s.watermark_released_bytes == 76 * MB);
    CHECK(s.device_free_bytes == 100 * MB);
    check_cache_stays(h, 524 * MB, 50);

    /* It takes the 100M left: 100M more go. */
    CHECK_OK(cuma_sim_take_memory(h, 300 * MB));
    wait_cached_at_most(h, 424 * MB);
    s = stats(h);
    CHECK(s.cached_bytes == 424 * MB && s.watermark_released_bytes == 176 * MB);
    CHECK(s.device_free_bytes == 100 * MB);

    /* The other program leaves; the heap grows past what it kept and caches again, and keeps
     * its cache (624M idle, 200M in use: 200M free). */
    CHECK_OK(cuma_sim_take_memory(h, 0));
    CHECK_OK(cuma_alloc(h, 624 * MB, 0, &big));
    CHECK_OK(cuma_free(h, big, 0));
    check_cache_stays(h, 624 * MB, 60);
    /* What a program cannot take is refused, naming the sizes (also sizes whose page count
     * would wrap). */
    CHECK_ST(cuma_sim_take_memory(h, 900 * MB), CUMA_ERR_OOM);
    CHECK(strstr(cuma_last_error(), "do not fit"));
    CHECK_ST(cuma_sim_take_memory(h, UINT64_MAX), CUMA_ERR_OOM);
    CHECK_ST(cuma_sim_take_memory(h, UINT64_MAX - 2 * MB), CUMA_ERR_OOM);
    CHECK(stats(h).device_free_bytes == 1024 * MB - 824 * MB);
    CHECK_OK(cuma_validate(h));
    CHECK_OK(cuma_free(h, live, 0));
    cuma_heap_destroy(h);

    /* A watermark the whole cache cannot reach: every idle page goes, the pages in use stay. */
    h = heap_make("backend:sim,capacity:1G,page_size:2M,release_delay_ms:never,tcache:off,"
                  "arenas:1,free_watermark:900M");
    CHECK_OK(cuma_alloc(h, 600 * MB, 0, &big));
    CHECK_OK(cuma_alloc(h, 200 * MB, 0, &live));
    CHECK_OK(cuma_free(h, big, 0));
    wait_cached_at_most(h, 0);
    s = stats(h);
    CHECK(s.reserved_bytes == 200 * MB && s.requested_bytes == 200 * MB);
    CHECK(s.watermark_released_bytes == 600 * MB);
    CHECK_OK(cuma_validate(h));
    CHECK_OK(cuma_free(h, live, 0));
    cuma_heap_destroy(h);

    /* Preallocated pages in use do not keep the others from going. */
    h = heap_make("backend:sim,capacity:64M,page_size:2M,release_delay_ms:never,tcache:off,"
                  "arenas:1,preallocate:16M,free_watermark:40M");
    void *pre;
    CHECK_OK(cuma_alloc(h, 16 * MB, 0, &pre)); /* the preallocated pages */
    CHECK_OK(cuma_alloc(h, 16 * MB, 0, &big));
    CHECK_OK(cuma_free(h, big, 0)); /* 32M free, 8M under the watermark */
    wait_cached_at_most(h, 8 * MB);
    s = stats(h);
    CHECK(s.watermark_released_bytes == 8 * MB && s.device_free_bytes == 40 * MB);
    CHECK_OK(cuma_free(h, pre, 0));
    cuma_heap_destroy(h);

    /* Off (the default): the same pressure leaves the cache alone. */
    h = heap_make("backend:sim,capacity:1G,page_size:2M,release_delay_ms:never,tcache:off");
    CHECK_OK(cuma_alloc(h, 600 * MB, 0, &big));
    CHECK_OK(cuma_free(h, big, 0));
    CHECK_OK(cuma_sim_take_memory(h, 400 * MB));
    check_cache_stays(h, 600 * MB, 60);
    CHECK(stats(h).watermark_released_bytes == 0);
    cuma_heap_destroy(h);
    /* Without the thread that watches, a watermark would do nothing: refused, saying why. */
    cuma_config bad = {.conf = "backend:sim,free_watermark:1M,release_thread:off",
                       .flags = CUMA_CONFIG_NO_ENV};
    CHECK_ST(cuma_heap_create(&bad, &h), CUMA_ERR_CONFIG);
    CHECK(strstr(cuma_last_error(), "free_watermark") &&
          strstr(cuma_last_error(), "release_thread"));
    puts("test_watermark: ok");
    return 0;
}
