/* The release thread on a real clock, in the cases where it once missed its work: a large block
 * freed into the freeing thread's batch (thread caches on) must reach the device after
 * tcache_age_ms + release_delay_ms, also when the thread wakes every few ms for the ledger or the
 * watermark (each look once planned the policy anew, always ahead, so it never ran), also on a
 * fresh heap (the thread slept a whole second before any cache existed), and max_cached must
 * act on it with release_delay_ms:never (no release thread was started at all). Each case polls
 * with a deadline and prints how long it took. */
#include "check.h"
#include "cuma/ledger.h"

#include <stdint.h>
#include <stdio.h>
#include <time.h>
#include <unistd.h>

#define MB (1024ull * 1024ull)

static uint64_t now_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000 + (uint64_t)ts.tv_nsec / 1000000;
}

/* Allocates and frees 64 MiB on a fresh heap, then waits until at most `keep` bytes are reserved;
 * fails past limit_ms. Returns the ms it took. */
static uint64_t free_and_wait(const char *what, const char *conf, uint64_t keep,
                              uint64_t limit_ms) {
    cuma_heap *h = heap_make(conf);
    void *p;
    CHECK_OK(cuma_alloc(h, 64 * MB, 0, &p));
    CHECK_OK(cuma_free(h, p, 0));
    uint64_t t0 = now_ms();
    cuma_stats s;
    for (;;) {
        CHECK_OK(cuma_get_stats(h, &s));
        if (s.reserved_bytes <= keep) break;
        if (now_ms() - t0 > limit_ms) {
            fprintf(stderr,
                    "test_release_thread: %s: %llu bytes still reserved (%llu mapped) after %llu "
                    "ms, wanted at most %llu\n",
                    what, (unsigned long long)s.reserved_bytes, (unsigned long long)s.mapped_bytes,
                    (unsigned long long)limit_ms, (unsigned long long)keep);
            CHECK(0);
        }
        usleep(1000);
    }
    uint64_t took = now_ms() - t0;
    printf("test_release_thread: %s: back within %llu ms\n", what, (unsigned long long)took);
    CHECK_OK(cuma_validate(h));
    cuma_heap_destroy(h);
    return took;
}

int main(void) {
    char ledger[64], conf[256], path[128];
    snprintf(ledger, sizeof ledger, "test-release-thread-%d", (int)getpid());
    CHECK_OK(cuma_ledger_path(ledger, path, sizeof path));
    /* tcache_age_ms 50 + release_delay_ms 20: about 70-100 ms when it works. */
    snprintf(conf, sizeof conf, "backend:sim,capacity:1G,release_delay_ms:20,ledger:%s", ledger);
    free_and_wait("in a ledger, thread caches on", conf, 0, 3000);
    unlink(path);
    free_and_wait("with free_watermark, thread caches on",
                  "backend:sim,capacity:1G,release_delay_ms:20,free_watermark:1M", 0, 3000);
    /* No ledger, no watermark: the thread's first sleep once lasted a second. */
    uint64_t took = free_and_wait("fresh heap, thread caches on",
                                  "backend:sim,capacity:1G,release_delay_ms:20", 0, 3000);
    CHECK(took < 600);
    free_and_wait("max_cached 8M, release_delay_ms:never",
                  "backend:sim,capacity:1G,release_delay_ms:never,max_cached:8M", 8 * MB, 3000);
    puts("test_release_thread: ok");
    return 0;
}
