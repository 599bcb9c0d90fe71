// SPDX-License-Identifier: Apache-2.0
/* Segment mode over the fake driver: heaps on backend:segment (cuMemAlloc) and
 * backend:managed (cuMemAllocManaged). Data survives churn, a segment goes back with cuMemFree
 * once it is entirely free and trimmed, and nothing is left in the driver at the end.
 *
 *   test_cuda_segment [segment|managed|auto]   (default segment; auto with FAKECUDA_NO_VMM=1)
 */
#include "cuda_test.h"

static void test_churn(const char *backend) {
    bool managed = !strcmp(backend, "managed");
    const char *kind = managed ? "managed" : "allocs";
    const char *alloc_api = managed ? "cuMemAllocManaged" : "cuMemAlloc";
    char conf[128];
    snprintf(conf, sizeof conf, "backend:%s,release_delay_ms:never", backend);
    cuma_heap *h = heap_make(conf);
    char json[8192];
    CHECK_OK(cuma_stats_json(h, json, sizeof json, NULL));
    char want[64];
    /* backend:auto on a device without VMM must be segment. */
    snprintf(want, sizeof want, "\"backend\":\"%s\"",
             strcmp(backend, "auto") ? backend : "segment");
    CHECK(strstr(json, want) && strstr(json, "\"device\":\"GPU-"));
    fakecuda_reset_counters();

    churn c;
    churn_run(h, &c, 40, 1200, 5, 24 * MB, 512 * 1024, 0, 0);
    churn_check(&c);
    CHECK(fakecuda_calls(alloc_api) > 0);
    CHECK(fakecuda_live(kind) > 0);
    cuma_stats s = heap_stats(h);
    CHECK(s.reserved_bytes > 0);
    CHECK((managed ? fakecuda_managed_bytes() : fakecuda_used_bytes(0)) >= s.reserved_bytes);

    churn_free(h, &c);
    CHECK_OK(cuma_validate(h));
    /* Entirely free segments idle until trimmed, then each goes back with one cuMemFree. */
    unsigned long frees0 = fakecuda_calls("cuMemFree");
    long live0 = fakecuda_live(kind);
    CHECK_OK(cuma_trim(h, 0));
    CHECK(fakecuda_live(kind) == 0);
    CHECK(fakecuda_calls("cuMemFree") == frees0 + (unsigned long)live0);
    CHECK(fakecuda_calls(alloc_api) == fakecuda_calls("cuMemFree"));
    s = heap_stats(h);
    CHECK(s.reserved_bytes == 0);
    CHECK(fakecuda_used_bytes(0) == 0 && fakecuda_managed_bytes() == 0);
    CHECK_OK(cuma_validate(h));
    cuma_heap_destroy(h);
    check_no_driver_objects();
}

/* A segment with a live block stays; it goes once its last block is freed and trimmed. */
static void test_partial(const char *backend) {
    char conf[128];
    snprintf(conf, sizeof conf, "backend:%s,release_delay_ms:never", backend);
    const char *kind = strcmp(backend, "managed") ? "allocs" : "managed";
    cuma_heap *h = heap_make(conf);
    void *a, *b;
    CHECK_OK(cuma_alloc(h, 100 * 1024, DS, &a));
    CHECK_OK(cuma_alloc(h, 100 * 1024, DS, &b));
    CHECK(fakecuda_live(kind) == 1); /* both small blocks share one segment */
    CHECK_OK(cuma_free(h, a, DS));
    CHECK_OK(cuma_trim(h, 0));
    CHECK(fakecuda_live(kind) == 1);
    pattern_fill(b, 100 * 1024, 3);
    CHECK(pattern_ok(b, 100 * 1024, 3));
    CHECK_OK(cuma_free(h, b, DS));
    CHECK_OK(cuma_trim(h, 0));
    CHECK(fakecuda_live(kind) == 0);
    cuma_heap_destroy(h);
    check_no_driver_objects();
}

/* A busy stream keeps its segment: the release policy leaves it until the work is done. (No
 * thread cache: it would keep the freed block for its own age first.) */
static void test_held_stream(const char *backend) {
    char conf[128];
    snprintf(conf, sizeof conf, "backend:%s,release_delay_ms:0,tcache:off", backend);
    const char *kind = strcmp(backend, "managed") ? "allocs" : "managed";
    CUstream a = stream_new();
    cuma_heap *h = heap_make(conf);
    void *p;
    CHECK_OK(cuma_alloc(h, 4 * MB, a, &p));
    fakecuda_stream_hold(a);
    CHECK_OK(cuma_free(h, p, a));
    usleep(100 * 1000); /* past the delay, the fence pending: the heap must stay usable */
    watchdog(20, "cuma_poll while an idle segment waits on a held stream");
    CHECK_OK(cuma_poll(h)); /* release_delay 0, but the work is not done */
    CHECK(fakecuda_live(kind) == 1);
    watchdog(240, backend);
    fakecuda_stream_release(a);
    CHECK_OK(cuma_poll(h));
    CHECK(fakecuda_live(kind) == 0);
    cuma_heap_destroy(h);
    check_no_driver_objects();
    CHECK_CU(cuStreamDestroy(a));
}

/* Allocates `chunk`-byte blocks until one fails or `most` are live; the number that succeeded. */
static unsigned fill(cuma_heap *h, void **p, unsigned most, size_t chunk, cuma_status *last) {
    unsigned n = 0;
    *last = CUMA_OK;
    while (n < most && (*last = cuma_alloc(h, chunk, DS, &p[n])) == CUMA_OK) n++;
    return n;
}

static void free_all(cuma_heap *h, void **p, unsigned n) {
    for (unsigned i = 0; i < n; i++) CHECK_OK(cuma_free(h, p[i], DS));
}

/* backend:managed oversubscribes up to the limit the user sets (the device here is 1 GiB, the
 * fake's host memory 4 GiB); without one it stops at the device size, as every backend does. The
 * ledger admits none of it: other heaps keep the device. */
static void test_oversubscribe(void) {
    const uint64_t dev = 1024 * MB, chunk = 64 * MB;
    void *p[64];
    cuma_status last;
    char conf[160];
    snprintf(conf, sizeof conf,
             "backend:managed,limit:3G,release_delay_ms:never,ledger:cuma-test-%d", (int)getpid());
    for (int with_ledger = 0; with_ledger < 2; with_ledger++) {
        cuma_heap *h = heap_make(with_ledger ? conf : "backend:managed,limit:3G,ledger:off");
        cuma_stats s = heap_stats(h);
        CHECK(s.limit_bytes == 3 * dev && s.device_total_bytes == dev);
        unsigned n = fill(h, p, 64, chunk, &last);
        CHECK_ST(last, CUMA_ERR_LIMIT); /* the user's limit, not the device, stopped it */
        s = heap_stats(h);
        CHECK(n * chunk > 2 * dev && s.reserved_bytes <= 3 * dev && s.reserved_bytes > 2 * dev);
        CHECK(fakecuda_managed_bytes() == s.reserved_bytes && fakecuda_used_bytes(0) == 0);
        CHECK_OK(cuma_validate(h)); /* the ledger admitted none of it */
        free_all(h, p, n);
        /* One block larger than the device fits as well. */
        CHECK_OK(cuma_alloc(h, 1536 * MB, DS, &p[0]));
        pattern_fill((char *)p[0] + 1535 * MB, MB, 7);
        CHECK_OK(cuma_free(h, p[0], DS));
        cuma_heap_destroy(h);
    }
    /* No limit: the device size (CUMA_ERR_OOM at it, as on any backend). */
    cuma_heap *h = heap_make("backend:managed,ledger:off");
    CHECK(heap_stats(h).limit_bytes == dev);
    unsigned n = fill(h, p, 64, chunk, &last);
    CHECK_ST(last, CUMA_ERR_OOM);
    CHECK(n * chunk <= dev && heap_stats(h).reserved_bytes <= dev);
    free_all(h, p, n);
    void *big;
    CHECK_ST(cuma_alloc(h, 1536 * MB, DS, &big), CUMA_ERR_OOM);
    cuma_heap_destroy(h);
    /* Device memory is not oversubscribed: a limit above it is the device size. */
    h = heap_make("backend:segment,limit:3G,ledger:off");
    CHECK(heap_stats(h).limit_bytes == dev);
    cuma_heap_destroy(h);
    check_no_driver_objects();
}

/* managed_fallback serves what the full device cannot, beyond the device's size. */
static void test_managed_fallback_beyond_device(const char *backend) {
    const uint64_t dev = 1024 * MB;
    char conf[128];
    snprintf(conf, sizeof conf, "backend:%s,managed_fallback:on,ledger:off,release_delay_ms:never",
             backend);
    cuma_heap *h = heap_make(conf);
    void *p[64];
    cuma_status last;
    unsigned n = fill(h, p, 16, 64 * MB, &last); /* the device is full */
    CHECK_OK(last);
    CHECK(heap_stats(h).reserved_bytes == dev && heap_stats(h).managed_fallbacks == 0);
    void *m[3];
    for (int i = 0; i < 3; i++) CHECK_OK(cuma_alloc(h, 1024 * MB, DS, &m[i]));
    cuma_stats s = heap_stats(h);
    CHECK(s.managed_fallbacks == 3 && s.managed_bytes == 3 * dev && s.reserved_bytes <= dev);
    CHECK(fakecuda_managed_bytes() >= 3 * dev);
    pattern_fill((char *)m[2] + dev - MB, MB, 3);
    for (int i = 0; i < 3; i++) CHECK_OK(cuma_free(h, m[i], DS));
    free_all(h, p, n);
    CHECK(heap_stats(h).managed_bytes == 0 && fakecuda_managed_bytes() == 0);
    cuma_heap_destroy(h);
    check_no_driver_objects();
}

int main(int argc, char **argv) {
    const char *backend = argc > 1 ? argv[1] : "segment";
    watchdog(240, backend);
    test_ctx t = test_ctx_open(0);
    test_churn(backend);
    test_partial(backend);
    test_held_stream(backend);
    if (!strcmp(backend, "managed")) test_oversubscribe();
    if (!strcmp(backend, "segment")) test_managed_fallback_beyond_device(backend);
    test_ctx_close(&t);
    fprintf(stderr, "test_cuda_segment %s: ok\n", backend);
    return 0;
}
