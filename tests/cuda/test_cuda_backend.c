// SPDX-License-Identifier: Apache-2.0
/* The CUDA backends over the fake driver: the vmm heap end to end (data, driver call counts,
 * trim, destroy), compaction, busy streams, backend choice, context hygiene, and the backend ops
 * one by one.
 *
 *   test_cuda_backend            everything that needs a VMM device
 *   test_cuda_backend novmm      FAKECUDA_NO_VMM=1: auto picks segment, vmm is refused
 *   test_cuda_backend nodriver WHY   no usable driver (CUMA_CUDA_LIBRARY=/nonexistent, a library
 *                                without the symbols, no device): CUMA_ERR_NO_DEVICE, WHY in
 *                                the message
 *   test_cuda_backend twodev     FAKECUDA_DEVICES=2: a heap on device 1, peer access
 *   test_cuda_backend autofallback   FAKECUDA_FAIL=cuMemGetAllocationGranularity:1: auto falls
 *                                back to segment when VMM cannot be set up
 */
#include "cuda_test.h"

#include "backend/backend.h"
#include "place/streams.h"
#include "settings/config.h"
#include "cuma/compact.h"

#include <pthread.h>
#include <stdlib.h>
#include <time.h>
#include <unistd.h>

static uint64_t capacity_env(void) {
    const char *e = getenv("FAKECUDA_CAPACITY");
    uint64_t v = 0;
    CHECK(e && cuma_parse_size(e, &v));
    return v;
}

static cuma_backend *backend_make(const char *name, int device) {
    cuma_settings s;
    cuma_settings_default(&s);
    snprintf(s.backend, sizeof s.backend, "%s", name);
    s.device = device;
    cuma_backend *be = NULL;
    CHECK_OK(cuma_backend_create(&s, &be));
    return be;
}

static void check_json_device(cuma_heap *h, const char *backend) {
    char buf[8192];
    CHECK_OK(cuma_stats_json(h, buf, sizeof buf, NULL));
    char want[64];
    snprintf(want, sizeof want, "\"backend\":\"%s\"", backend);
    CHECK(strstr(buf, want));
    CHECK(strstr(buf, "\"device\":\"GPU-"));
}

/* Random allocations and frees with data written into each block and checked before its free
 * and at the end: pages move between addresses under the heap's feet, data must not. */
static void test_vmm_churn(void) {
    cuma_heap *h = heap_make("backend:vmm,release_delay_ms:never,max_cached:16M");
    check_json_device(h, "vmm");
    cuma_stats s = heap_stats(h);
    CHECK(s.device_total_bytes == capacity_env());
    CHECK(s.page_size == 2 * MB);
    CHECK(s.virtual_bytes >= 4 * capacity_env());
    CHECK(fakecuda_live("reservations") == 1);
    fakecuda_reset_counters();

    churn c;
    churn_run(h, &c, 48, 1500, 4, 6 * MB, 256 * 1024, 500, 4 * MB);
    churn_check(&c);

    /* The heap's counters are the driver's. */
    s = heap_stats(h);
    CHECK(s.page_creates == fakecuda_calls("cuMemCreate"));
    CHECK(s.maps == fakecuda_calls("cuMemMap"));
    CHECK(s.map_runs == fakecuda_calls("cuMemSetAccess")); /* one per run of pages */
    CHECK(s.map_runs > 0 && s.map_runs <= s.maps);
    /* A moved page's old place is unmapped with its neighbours' in one call; released pages
     * and ghosts one by one. */
    CHECK(s.unmaps >= fakecuda_calls("cuMemUnmap"));
    CHECK(s.unmap_runs > 0 && s.unmap_runs <= fakecuda_calls("cuMemUnmap"));
    CHECK(s.page_releases == fakecuda_calls("cuMemRelease"));
    CHECK((uint64_t)fakecuda_live("handles") * s.page_size == s.reserved_bytes);
    CHECK((uint64_t)fakecuda_live("mappings") <= s.reserved_bytes / s.page_size);
    CHECK(fakecuda_used_bytes(0) == s.reserved_bytes);
    CHECK(s.page_creates > 0 && s.unmaps > 0 && s.page_releases > 0);

    churn_free(h, &c);
    CHECK_OK(cuma_trim(h, 0));
    CHECK(fakecuda_live("handles") == 0 && fakecuda_live("mappings") == 0);
    CHECK(fakecuda_used_bytes(0) == 0);
    s = heap_stats(h);
    CHECK(s.reserved_bytes == 0 && s.page_creates == s.page_releases && s.maps == s.unmaps);
    CHECK(s.device_free_bytes == s.device_total_bytes);
    CHECK_OK(cuma_validate(h));
    cuma_heap_destroy(h);
    check_no_driver_objects();
}

/* Compaction over the VMM backend: small blocks among freed large ones move (the fake driver's
 * memory is the host's, so the mover memcpys), their old pages go idle, and a waiting trim gives
 * them back to the driver (with FAKECUDA_EVENT_LAG the compaction's own release leaves pages whose
 * fences are pending). */
typedef struct compact_owner {
    void *p[12];
    size_t n[12];
} compact_owner;

static bool compact_move(void *user, void *old_ptr, void *new_ptr, size_t size, cuma_stream s) {
    compact_owner *o = user;
    (void)s;
    for (int i = 0; i < 12; i++) {
        if (o->p[i] != old_ptr) continue;
        memcpy(new_ptr, old_ptr, size);
        o->p[i] = new_ptr;
        return true;
    }
    return false;
}

static void test_vmm_compact(void) {
    cuma_heap *h = heap_make("backend:vmm,tcache:off,release_delay_ms:never");
    compact_owner o;
    void *dense[16], *big[12];
    for (int i = 0; i < 16; i++) CHECK_OK(cuma_alloc(h, 4 * MB, DS, &dense[i]));
    for (int i = 0; i < 12; i++) {
        o.n[i] = (size_t)(8192 + 4096 * i);
        CHECK_OK(cuma_alloc(h, o.n[i], DS, &o.p[i]));
        CHECK_OK(cuma_alloc(h, 3 * MB, DS, &big[i]));
        memset(o.p[i], 0x40 + i, o.n[i]);
    }
    for (int i = 0; i < 12; i++) CHECK_OK(cuma_free(h, big[i], DS));
    CHECK_OK(cuma_trim(h, 0));
    cuma_stats s0 = heap_stats(h);
    CHECK(s0.fragmentation > 0.25);
    cuma_compact_result r;
    CHECK_OK(cuma_compact(h, compact_move, &o, &r));
    CHECK(r.blocks_moved == 12 && r.pages_emptied > 0);
    for (int i = 0; i < 12; i++)
        for (size_t k = 0; k < o.n[i]; k++) CHECK(((unsigned char *)o.p[i])[k] == 0x40 + i);
    CHECK_OK(cuma_trim(h, 0));
    cuma_stats s1 = heap_stats(h);
    CHECK(s1.fragmentation < 0.05 && s1.reserved_bytes < s0.reserved_bytes);
    CHECK(fakecuda_used_bytes(0) == s1.reserved_bytes);
    CHECK_OK(cuma_validate(h));
    for (int i = 0; i < 12; i++) CHECK_OK(cuma_free(h, o.p[i], DS));
    for (int i = 0; i < 16; i++) CHECK_OK(cuma_free(h, dense[i], DS));
    cuma_heap_destroy(h);
    check_no_driver_objects();
}

typedef struct releaser {
    CUstream stream;
    unsigned long unmaps_at_release;
} releaser;

static void *release_later(void *arg) {
    releaser *r = arg;
    usleep(300 * 1000);
    r->unmaps_at_release = fakecuda_calls("cuMemUnmap");
    fakecuda_stream_release(r->stream);
    return NULL;
}

/* Memory freed on a busy stream: reused at once by that stream, by no other, and not given
 * back to the driver before the stream's work is done. */
static void test_busy_stream(void) {
    CUstream a = stream_new(), b = stream_new();
    cuma_heap *h = heap_make("backend:vmm,release_delay_ms:never");
    void *p, *q, *r;
    CHECK_OK(cuma_alloc(h, 4 * MB, a, &p));
    pattern_fill(p, 4 * MB, 1);
    fakecuda_stream_hold(a);
    CHECK_OK(cuma_free(h, p, a));
    CHECK_OK(cuma_alloc(h, 4 * MB, a, &q));
    CHECK(q == p); /* the freeing stream reuses at once */
    CHECK_OK(cuma_free(h, q, a));
    CHECK_OK(cuma_alloc(h, 4 * MB, b, &r));
    uintptr_t pa = (uintptr_t)p, ra = (uintptr_t)r;
    CHECK(ra >= pa + 4 * MB || ra + 4 * MB <= pa); /* another stream does not */
    pattern_fill(r, 4 * MB, 2);
    CHECK_OK(cuma_validate(h));
    CHECK_OK(cuma_free(h, r, b));

    /* trim waits for the held work (cuEventSynchronize) instead of unmapping under it: a
     * thread completes the work later and notes how many unmaps had happened by then. */
    unsigned long unmaps0 = fakecuda_calls("cuMemUnmap");
    releaser rel = {a, 0};
    pthread_t t;
    CHECK(pthread_create(&t, NULL, release_later, &rel) == 0);
    CHECK_OK(cuma_trim(h, 0));
    CHECK(pthread_join(t, NULL) == 0);
    CHECK(rel.unmaps_at_release == unmaps0);
    CHECK(fakecuda_calls("cuMemUnmap") > unmaps0);
    CHECK(fakecuda_live("handles") == 0 && fakecuda_live("mappings") == 0);
    CHECK_OK(cuma_validate(h));
    cuma_heap_destroy(h);
    check_no_driver_objects();
    CHECK_CU(cuStreamDestroy(a));
    CHECK_CU(cuStreamDestroy(b));
}

/* Work still queued on a stream (held here) keeps its idle pages at their addresses; a block
 * the same stream needs elsewhere maps them there at once (a second mapping of the same handle,
 * no cuMemCreate), and the old mappings go when the work completes. Another stream gets new
 * pages. */
static void test_early_remap(void) {
    CUstream a = stream_new(), b = stream_new();
    cuma_heap *h = heap_make("backend:vmm,release_delay_ms:never,tcache:off");
    void *p, *g, *q, *r;
    CHECK_OK(cuma_alloc(h, 4 * MB, a, &p));
    CHECK_OK(cuma_alloc(h, 2 * MB, a, &g)); /* keeps p's hole from growing */
    pattern_fill(p, 4 * MB, 1);
    fakecuda_stream_hold(a);
    CHECK_OK(cuma_free(h, p, a));
    unsigned long creates0 = fakecuda_calls("cuMemCreate"), maps0 = fakecuda_calls("cuMemMap");
    unsigned long unmaps0 = fakecuda_calls("cuMemUnmap");
    long mappings0 = fakecuda_live("mappings");
    CHECK_OK(cuma_alloc(h, 6 * MB, a, &q)); /* does not fit p's hole */
    uintptr_t pa = (uintptr_t)p, qa = (uintptr_t)q;
    CHECK(qa >= pa + 4 * MB || qa + 6 * MB <= pa);
    CHECK(fakecuda_calls("cuMemCreate") == creates0 + 1);
    CHECK(fakecuda_calls("cuMemMap") == maps0 + 3 && fakecuda_calls("cuMemUnmap") == unmaps0);
    CHECK(fakecuda_live("mappings") == mappings0 + 3); /* p's two stay mapped as well */
    cuma_stats st;
    CHECK_OK(cuma_get_stats(h, &st));
    CHECK(st.early_remaps == 2 && st.remap_waits == 0);
    pattern_fill(q, 6 * MB, 2);
    CHECK_OK(cuma_validate(h));
    /* Another stream cannot share a's pending pages. */
    creates0 = fakecuda_calls("cuMemCreate");
    CHECK_OK(cuma_alloc(h, 2 * MB, b, &r));
    CHECK(fakecuda_calls("cuMemCreate") == creates0 + 1);
    /* The work completes: the next poll unmaps the old addresses. */
    fakecuda_stream_release(a);
    CHECK_OK(cuma_poll(h));
    CHECK(fakecuda_calls("cuMemUnmap") == unmaps0 + 2);
    CHECK(fakecuda_live("mappings") == mappings0 + 2); /* + q's 3 + r's 1 - p's 2 */
    CHECK(pattern_ok(q, 6 * MB, 2));
    CHECK_OK(cuma_validate(h));
    CHECK_OK(cuma_free(h, q, a));
    CHECK_OK(cuma_free(h, g, a));
    CHECK_OK(cuma_free(h, r, b));
    CHECK_OK(cuma_trim(h, 0));
    cuma_heap_destroy(h);
    check_no_driver_objects();
    CHECK_CU(cuStreamDestroy(a));
    CHECK_CU(cuStreamDestroy(b));
}

/* The release policy does not wait: a page under held work stays while the rest goes. (No
 * thread cache: it would keep both freed blocks for its own age first.) */
static void test_held_page_stays(void) {
    CUstream a = stream_new();
    cuma_heap *h = heap_make("backend:vmm,release_delay_ms:0,tcache:off");
    void *p, *q;
    CHECK_OK(cuma_alloc(h, 2 * MB, a, &p));
    CHECK_OK(cuma_alloc(h, 2 * MB, DS, &q));
    fakecuda_stream_hold(a);
    unsigned long unmaps0 = fakecuda_calls("cuMemUnmap");
    CHECK_OK(cuma_free(h, p, a));
    CHECK_OK(cuma_free(h, q, DS));
    /* release_delay 0: every idle page whose work is done goes. A lagging device answers "not
     * ready" a few times first, and a poll asks each stream once. */
    for (int k = 0; k < 10 && fakecuda_calls("cuMemUnmap") == unmaps0; k++) CHECK_OK(cuma_poll(h));
    CHECK(fakecuda_calls("cuMemUnmap") == unmaps0 + 1);
    CHECK(fakecuda_live("handles") == 1);
    fakecuda_stream_release(a);
    CHECK_OK(cuma_poll(h));
    CHECK(fakecuda_live("handles") == 0 && fakecuda_live("mappings") == 0);
    cuma_heap_destroy(h);
    check_no_driver_objects();
    CHECK_CU(cuStreamDestroy(a));
}

/* While work on a stream is held, idle pages past their release delay cannot go back; the
 * heap (and its release thread) must keep serving other calls meanwhile. */
static void test_busy_stream_does_not_block(void) {
    CUstream a = stream_new();
    cuma_heap *h = heap_make("backend:vmm,release_delay_ms:0,tcache:off");
    void *p, *q;
    CHECK_OK(cuma_alloc(h, 2 * MB, a, &p));
    fakecuda_stream_hold(a);
    CHECK_OK(cuma_free(h, p, a));
    usleep(100 * 1000); /* the page is past its delay, its fence pending */
    watchdog(20, "cuma_alloc while an idle page waits on a held stream");
    CHECK_OK(cuma_alloc(h, 2 * MB, DS, &q));
    CHECK_OK(cuma_free(h, q, DS));
    CHECK_OK(cuma_poll(h));
    watchdog(0, "");
    fakecuda_stream_release(a);
    CHECK_OK(cuma_trim(h, 0));
    CHECK(fakecuda_live("handles") == 0);
    cuma_heap_destroy(h);
    check_no_driver_objects();
    CHECK_CU(cuStreamDestroy(a));
}

/* A vmm backend made while `spec` fails driver calls: whether it may alias, and how many
 * cuMemSetAccess and cuMemUnmap calls a run of three pages then takes, while `then` fails calls
 * (counted from the first map). */
static void probe_case_then(const char *spec, const char *then, bool alias, unsigned long access,
                            unsigned long unmaps) {
    CHECK(fakecuda_set_fail(spec) == 0);
    cuma_backend *be = backend_make("vmm", 0);
    CHECK(fakecuda_set_fail(NULL) == 0);
    check_no_driver_objects(); /* the probe left nothing behind */
    CHECK(!!(be->caps & CUMA_CAP_ALIAS) == alias);
    const cuma_backend_ops *o = be->ops;
    uint64_t base, h[3];
    CHECK_OK(o->reserve(be, 16 * MB, 2 * MB, &base));
    for (int i = 0; i < 3; i++) CHECK_OK(o->page_create(be, &h[i]));
    fakecuda_reset_counters();
    CHECK(fakecuda_set_fail(then) == 0);
    CHECK_OK(o->map(be, base, h, 3));
    CHECK(fakecuda_calls("cuMemMap") == 3 && fakecuda_calls("cuMemSetAccess") == access);
    CHECK_OK(o->unmap(be, base, 3));
    CHECK(fakecuda_set_fail(NULL) == 0);
    CHECK(fakecuda_calls("cuMemUnmap") == unmaps && fakecuda_live("mappings") == 0);
    for (int i = 0; i < 3; i++) o->page_release(be, h[i]);
    o->unreserve(be, base, 16 * MB);
    be->ops->destroy(be);
    check_no_driver_objects();
}

static void probe_case(const char *spec, bool alias, unsigned long access, unsigned long unmaps) {
    probe_case_then(spec, NULL, alias, access, unmaps);
}

/* The vmm backend's probe at creation: what the driver refuses of ranges and second mappings
 * it does another way (one call a page; no early remaps); a driver that cannot map a page at
 * all fails vmm, and auto takes segments. */
static void test_vmm_probe(void) {
    probe_case(NULL, true, 1, 1);               /* the fake driver takes all of it */
    probe_case("cuMemSetAccess:1", true, 3, 1); /* no access over a range */
    probe_case("cuMemMap:3", false, 1, 1);      /* no second mapping of a page */
    probe_case("cuMemUnmap:2", true, 1, 3);     /* no unmap over a range */
    /* A device too full for the probe's pages (another program holds it) is still vmm, without
     * second mappings; its first map and unmap of a run ask the range questions by doing: the
     * fake driver takes both (one call each), and one that refuses access over a range is
     * answered a page at a time from then on (the refused call, then three). */
    probe_case("cuMemCreate:1", false, 1, 1);
    probe_case("cuMemCreate:2", false, 1, 1);
    probe_case_then("cuMemCreate:1", "cuMemSetAccess:1", false, 4, 1);
    probe_case_then("cuMemCreate:1", "cuMemUnmap:1", false, 1, 4);
    CHECK(fakecuda_set_fail("cuMemMap:*") == 0);
    cuma_settings set;
    cuma_settings_default(&set);
    snprintf(set.backend, sizeof set.backend, "vmm");
    cuma_backend *be = NULL;
    CHECK_ST(cuma_backend_create(&set, &be), CUMA_ERR_OOM);
    CHECK(be == NULL && strstr(cuma_last_error(), "cuMemMap"));
    check_no_driver_objects();
    snprintf(set.backend, sizeof set.backend, "auto");
    CHECK_OK(cuma_backend_create(&set, &be));
    CHECK(fakecuda_set_fail(NULL) == 0);
    CHECK(!strcmp(be->name, "segment") && be->kind == CUMA_BACKEND_SEGMENT);
    be->ops->destroy(be);
    check_no_driver_objects();
}

/* Released pages leave their addresses in runs: a trim of a freed 64 MiB block (32 adjacent
 * pages) is one cuMemUnmap and 32 cuMemRelease, and two blocks apart are two runs. */
static void test_release_runs(void) {
    cuma_heap *h = heap_make("backend:vmm,release_delay_ms:never,tcache:off,arenas:1");
    void *a, *b, *c;
    CHECK_OK(cuma_alloc(h, 64 * MB, 0, &a));
    CHECK_OK(cuma_alloc(h, 2 * MB, 0, &b)); /* stays: keeps a and c apart */
    CHECK_OK(cuma_alloc(h, 32 * MB, 0, &c));
    CHECK_OK(cuma_free(h, a, 0));
    CHECK_OK(cuma_free(h, c, 0));
    unsigned long un0 = fakecuda_calls("cuMemUnmap"), rel0 = fakecuda_calls("cuMemRelease");
    cuma_stats s0, s;
    CHECK_OK(cuma_get_stats(h, &s0));
    CHECK_OK(cuma_trim(h, 0));
    CHECK_OK(cuma_get_stats(h, &s));
    CHECK(fakecuda_calls("cuMemUnmap") - un0 == 2);
    CHECK(fakecuda_calls("cuMemRelease") - rel0 == 48);
    CHECK(s.unmaps - s0.unmaps == 48 && s.unmap_runs - s0.unmap_runs == 2);
    CHECK(s.reserved_bytes == 2 * MB);
    CHECK_OK(cuma_validate(h));
    CHECK_OK(cuma_free(h, b, 0));
    cuma_heap_destroy(h);
    check_no_driver_objects();
}

/* free_watermark through the driver: memory the program takes with cuMemAlloc behind cuma's back
 * lowers cuMemGetInfo's free figure, and the heap's release thread gives back just enough idle
 * pages to lift it to the watermark; nothing once the device has room again. */
static void test_watermark(void) {
    size_t fr = 0, total = 0;
    CHECK_CU(cuMemGetInfo(&fr, &total));
    CHECK(total - fr < 64 * MB); /* nothing else holds memory: the figures below are exact */
    uint64_t used0 = total - fr;
    char conf[160];
    /* Pressure once more than 500M (beyond what was used before) is in use on the device. */
    snprintf(conf, sizeof conf,
             "backend:vmm,release_delay_ms:never,tcache:off,arenas:1,free_watermark:%llu",
             (unsigned long long)(total - used0 - 500 * MB));
    cuma_heap *h = heap_make(conf);
    void *idle, *live;
    CHECK_OK(cuma_alloc(h, 300 * MB, 0, &idle));
    CHECK_OK(cuma_alloc(h, 100 * MB, 0, &live));
    CHECK_OK(cuma_free(h, idle, 0));
    cuma_stats s;
    usleep(30000);
    CHECK_OK(cuma_get_stats(h, &s));
    CHECK(s.cached_bytes == 300 * MB && s.watermark_released_bytes == 0);
    CUdeviceptr other;
    CHECK_CU(cuMemAlloc(&other, 150 * MB)); /* 550M in use: 50M under the watermark */
    for (int i = 0; i < 5000; i++) {
        CHECK_OK(cuma_get_stats(h, &s));
        if (s.cached_bytes <= 250 * MB) break;
        usleep(1000);
    }
    CHECK(s.cached_bytes == 250 * MB && s.watermark_released_bytes == 50 * MB);
    CHECK_CU(cuMemFree(other));
    usleep(30000);
    CHECK_OK(cuma_get_stats(h, &s));
    CHECK(s.cached_bytes == 250 * MB && s.watermark_released_bytes == 50 * MB);
    CHECK_OK(cuma_validate(h));
    CHECK_OK(cuma_free(h, live, 0));
    cuma_heap_destroy(h);
    check_no_driver_objects();
}

/* Backend ops one by one: a page keeps its data across unmap and remap elsewhere; events
 * follow held streams; segments, managed memory, device info. */
static void test_vmm_ops(void) {
    cuma_backend *be = backend_make("vmm", 0);
    CHECK(!strcmp(be->name, "vmm") && be->kind == CUMA_BACKEND_VMM);
    CHECK(be->caps & CUMA_CAP_VMM);
    CHECK(be->caps & CUMA_CAP_MANAGED);
    CHECK(!strncmp(be->device_id, "GPU-", 4) && strlen(be->device_id) == 40);
    CHECK(be->capacity == capacity_env());
    CHECK(be->page_size == 2 * MB);
    const cuma_backend_ops *o = be->ops;
    uint64_t base, h1, h2;
    CHECK_OK(o->reserve(be, 64 * MB, 64 * MB, &base));
    CHECK(base % (64 * MB) == 0);
    CHECK_OK(o->page_create(be, &h1));
    CHECK_OK(o->page_create(be, &h2));
    CHECK(fakecuda_live("handles") == 2);
    /* GPUDirect RDMA-capable pages (NCCL, InfiniBand) wherever the device reports support. */
    const char *no_rdma = getenv("FAKECUDA_NO_RDMA");
    CHECK(fakecuda_live("rdma_handles") == (no_rdma && *no_rdma == '1' ? 0 : 2));
    CHECK_OK(o->map(be, base, &h1, 1));
    CHECK_OK(o->map(be, base + 2 * MB, &h2, 1));
    pattern_fill((void *)(uintptr_t)base, 2 * MB, 7);
    pattern_fill((void *)(uintptr_t)(base + 2 * MB), 2 * MB, 8);
    CHECK_OK(o->unmap(be, base, 1));
    CHECK_OK(o->map(be, base + 10 * MB, &h1, 1));
    CHECK(pattern_ok((void *)(uintptr_t)(base + 10 * MB), 2 * MB, 7));
    /* Mapping over a mapped page is the driver's error, reported with its name. */
    CHECK_ST(o->map(be, base + 2 * MB, &h1, 1), CUMA_ERR_BACKEND);
    CHECK(strstr(cuma_last_error(), "cuMemMap") && strstr(cuma_last_error(), "CUDA_ERROR_"));
    CHECK_OK(o->unmap(be, base + 10 * MB, 1));
    CHECK_OK(o->unmap(be, base + 2 * MB, 1));
    o->page_release(be, h1);
    o->page_release(be, h2);
    o->unreserve(be, base, 64 * MB);
    CHECK(fakecuda_live("handles") == 0 && fakecuda_live("mappings") == 0 &&
          fakecuda_live("reservations") == 0);

    /* Events: a held stream's event stays pending; pooled events are reused, not recreated.
     * Exact answers need streams that complete at once (the lagged ctest variants set a lag). */
    CUstream a = stream_new();
    fakecuda_stream_set_lag(NULL, 0);
    fakecuda_stream_set_lag(a, 0);
    uint64_t e1, e2, e3;
    unsigned long creates0 = fakecuda_calls("cuEventCreate");
    CHECK_OK(o->event_record(be, NULL, &e1));
    CHECK(o->event_query(be, e1) == 1);
    CHECK_OK(o->event_wait(be, e1));
    fakecuda_stream_hold(a);
    CHECK_OK(o->event_record(be, a, &e2));
    CHECK(e2 != e1);
    CHECK(o->event_query(be, e2) == 0);
    fakecuda_stream_release(a);
    CHECK(o->event_query(be, e2) == 1);
    CHECK(o->event_query(be, 12345) < 0);
    o->event_release(be, e1);
    o->event_release(be, e2);
    CHECK_OK(o->event_record(be, a, &e3));
    CHECK(e3 == e1 || e3 == e2);
    o->event_release(be, e3);
    CHECK(fakecuda_calls("cuEventCreate") == creates0 + 2);
    CHECK(fakecuda_live("events") == 2);
    /* A device behind the host: the event answers "not yet" to its first two queries. */
    fakecuda_stream_set_lag(a, 2);
    CHECK_OK(o->event_record(be, a, &e3));
    CHECK(o->event_query(be, e3) == 0 && o->event_query(be, e3) == 0);
    CHECK(o->event_query(be, e3) == 1);
    CHECK_OK(o->event_record(be, a, &e3));
    CHECK_OK(o->event_wait(be, e3)); /* a wait completes it at once */
    CHECK(o->event_query(be, e3) == 1);
    o->event_release(be, e3);

    uint64_t m, fr, tot;
    CHECK_OK(o->managed_alloc(be, 3 * MB, &m));
    pattern_fill((void *)(uintptr_t)m, 3 * MB, 9);
    CHECK(fakecuda_live("managed") == 1 && fakecuda_managed_bytes() >= 3 * MB);
    CHECK_OK(o->mem_info(be, &fr, &tot)); /* device memory: managed memory is not in it */
    CHECK(tot == capacity_env() && fr == tot - fakecuda_used_bytes(0));
    o->managed_free(be, m, 3 * MB);
    CHECK(fakecuda_live("managed") == 0);
    uint64_t t0 = o->now_ns(be), t1 = o->now_ns(be);
    CHECK(t1 >= t0 && t0 > 0);
    o->destroy(be);
    check_no_driver_objects();
    CHECK_CU(cuStreamDestroy(a));
}

/* The segment and managed backends on a VMM device (they work anywhere). */
static void test_segment_ops(const char *name) {
    cuma_backend *be = backend_make(name, 0);
    CHECK(!strcmp(be->name, name));
    CHECK(be->kind == (strcmp(name, "managed") ? CUMA_BACKEND_SEGMENT : CUMA_BACKEND_MANAGED));
    CHECK((be->caps & CUMA_CAP_SEGMENTS) && !(be->caps & CUMA_CAP_VMM));
    CHECK(be->page_size == 2 * MB);
    const cuma_backend_ops *o = be->ops;
    const char *kind = strcmp(name, "managed") ? "allocs" : "managed";
    uint64_t a, b, x;
    CHECK_OK(o->seg_alloc(be, 20 * MB, &a));
    CHECK_OK(o->seg_alloc(be, 2 * MB, &b));
    CHECK(fakecuda_live(kind) == 2);
    pattern_fill((void *)(uintptr_t)a, 20 * MB, 3);
    pattern_fill((void *)(uintptr_t)b, 2 * MB, 4);
    CHECK(pattern_ok((void *)(uintptr_t)a, 20 * MB, 3));
    CHECK_ST(o->reserve(be, 64 * MB, 2 * MB, &x), CUMA_ERR_UNSUPPORTED);
    CHECK_ST(o->page_create(be, &x), CUMA_ERR_UNSUPPORTED);
    CHECK_ST(o->map(be, a, &x, 1), CUMA_ERR_UNSUPPORTED);
    CHECK_ST(o->unmap(be, a, 1), CUMA_ERR_UNSUPPORTED);
    /* Bigger than the device: the driver's OOM becomes cuma's. Managed memory may be bigger
     * than the device (the fake's host memory is 4 times it). */
    bool managed = !strcmp(name, "managed");
    if (managed) {
        CHECK_OK(o->seg_alloc(be, capacity_env() + 2 * MB, &x));
        o->seg_free(be, x, capacity_env() + 2 * MB);
    }
    CHECK_ST(o->seg_alloc(be, (managed ? 4 : 1) * capacity_env() + 2 * MB, &x), CUMA_ERR_OOM);
    CHECK(strstr(cuma_last_error(), "CUDA_ERROR_OUT_OF_MEMORY"));
    o->seg_free(be, a, 20 * MB);
    o->seg_free(be, b, 2 * MB);
    CHECK(fakecuda_live(kind) == 0);
    o->destroy(be);
    check_no_driver_objects();
}

/* cuma switches to its context for a call and puts the caller's back. */
static void test_context_restored(test_ctx *t) {
    cuma_heap *h = heap_make("backend:vmm");
    void *p;
    CUcontext cur = (CUcontext)1;
    CHECK_CU(cuCtxSetCurrent(NULL));
    CHECK_OK(cuma_alloc(h, 1 * MB, DS, &p));
    CHECK_CU(cuCtxGetCurrent(&cur));
    CHECK(cur == NULL);
    CHECK_OK(cuma_free(h, p, DS));
    CHECK_OK(cuma_trim(h, 0));
    cuma_heap_destroy(h);
    CHECK_CU(cuCtxGetCurrent(&cur));
    CHECK(cur == NULL);
    CHECK_CU(cuCtxSetCurrent(t->ctx));
    check_no_driver_objects();
}

/* page_size: the granularity, or a larger multiple of it that the settings ask for. */
static void test_page_size(void) {
    static const struct {
        uint64_t asked, got;
    } cases[] = {{2 * MB, 2 * MB}, {4 * MB, 4 * MB}, {1 * MB, 2 * MB}, {64 * 1024, 2 * MB}};
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        cuma_settings s;
        cuma_settings_default(&s);
        snprintf(s.backend, sizeof s.backend, "vmm");
        s.page_size = cases[i].asked;
        cuma_backend *be = NULL;
        CHECK_OK(cuma_backend_create(&s, &be));
        CHECK(be->page_size == cases[i].got);
        be->ops->destroy(be);
    }
    cuma_heap *h = heap_make("backend:vmm,page_size:8M");
    void *p;
    CHECK_OK(cuma_alloc(h, 1 * MB, DS, &p));
    CHECK(heap_stats(h).reserved_bytes == 8 * MB);
    CHECK(fakecuda_used_bytes(0) == 8 * MB);
    CHECK_OK(cuma_free(h, p, DS));
    cuma_heap_destroy(h);
    check_no_driver_objects();
}

typedef struct worker {
    cuma_heap *h;
    CUcontext ctx; /* current on the worker, or NULL: cuma must work either way */
    unsigned id;
} worker;

static void *churn_thread(void *arg) {
    worker *w = arg;
    CHECK_CU(cuCtxSetCurrent(w->ctx));
    enum { N = 16 };
    void *p[N] = {0};
    size_t sz[N] = {0};
    unsigned long long seed = 0x1234567ull * (w->id + 1);
    for (unsigned op = 0; op < 600; op++) {
        unsigned i = (unsigned)(rnd(&seed) % N);
        unsigned tag = w->id * 64 + i;
        if (p[i]) {
            CHECK(pattern_ok(p[i], sz[i], tag));
            CHECK_OK(cuma_free(w->h, p[i], DS));
            p[i] = NULL;
        } else {
            sz[i] = (size_t)(rnd(&seed) % (3 * MB) + 1);
            CHECK_OK(cuma_alloc(w->h, sz[i], DS, &p[i]));
            pattern_fill(p[i], sz[i], tag);
        }
        if (op % 200 == 0) CHECK_OK(cuma_trim(w->h, 0));
    }
    for (unsigned i = 0; i < N; i++)
        if (p[i]) CHECK_OK(cuma_free(w->h, p[i], DS));
    CUcontext cur = (CUcontext)1;
    CHECK_CU(cuCtxGetCurrent(&cur));
    CHECK(cur == w->ctx);
    return NULL;
}

/* Threads with and without a current context share one heap, through their thread caches (on
 * with a delay; at release_delay_ms:0 they hold nothing). */
static void test_threads(test_ctx *t) {
    cuma_heap *h = heap_make("backend:vmm,release_delay_ms:1000");
    enum { T = 4 };
    pthread_t th[T];
    worker w[T];
    for (unsigned i = 0; i < T; i++) {
        w[i] = (worker){h, i % 2 ? t->ctx : NULL, i};
        CHECK(pthread_create(&th[i], NULL, churn_thread, &w[i]) == 0);
    }
    for (unsigned i = 0; i < T; i++) CHECK(pthread_join(th[i], NULL) == 0);
    CHECK_OK(cuma_validate(h));
    CHECK_OK(cuma_trim(h, 0));
    CHECK(fakecuda_live("handles") == 0 && fakecuda_live("mappings") == 0);
    cuma_heap_destroy(h);
    check_no_driver_objects();
}

/* Per-thread default streams: every thread's is the handle CU_STREAM_PER_THREAD, but each
 * thread's is its own stream. A block one thread frees on its per-thread stream, with that
 * stream's work still running, is not another thread's to use: not at once, and not after the
 * other thread asked about it (its fence must wait for the first thread's stream, which the
 * other thread cannot name: the legacy stream's does). */
typedef struct ptds_arg {
    cuma_heap *h;
    CUcontext ctx;
    uintptr_t busy; /* the block under the first thread's work */
    void *p[2];
} ptds_arg;

static bool overlaps_4mb(uintptr_t a, const void *b) {
    uintptr_t x = (uintptr_t)b;
    return x < a + 4 * MB && a < x + 4 * MB;
}

static void *ptds_other(void *arg) {
    ptds_arg *a = arg;
    CHECK_CU(cuCtxSetCurrent(a->ctx));
    /* Asks about the busy block's fence (allocations that find no other room at once, a poll),
     * recording none: on the legacy stream, the only one this thread could record it on, it
     * would be a barrier for every thread's per-thread stream. */
    unsigned long records = fakecuda_calls("cuEventRecord");
    CHECK_OK(cuma_alloc(a->h, 4 * MB, CU_STREAM_PER_THREAD, &a->p[0]));
    CHECK(!overlaps_4mb(a->busy, a->p[0]));
    pattern_fill(a->p[0], 4 * MB, 2);
    CHECK_OK(cuma_poll(a->h));
    CHECK_OK(cuma_alloc(a->h, 4 * MB, CU_STREAM_PER_THREAD, &a->p[1]));
    CHECK(!overlaps_4mb(a->busy, a->p[1]));
    CHECK(fakecuda_calls("cuEventRecord") == records);
    return NULL;
}

static void *ptds_churn(void *arg) {
    ptds_arg *a = arg;
    CHECK_CU(cuCtxSetCurrent(a->ctx));
    void *p;
    CHECK_OK(cuma_alloc(a->h, 1 * MB, CU_STREAM_PER_THREAD, &p));
    CHECK_OK(cuma_free(a->h, p, CU_STREAM_PER_THREAD));
    return NULL;
}

static void test_per_thread_streams(test_ctx *t) {
    cuma_heap *h = heap_make("backend:vmm,release_delay_ms:never,tcache:off");
    void *p, *q;
    CHECK_OK(cuma_alloc(h, 4 * MB, CU_STREAM_PER_THREAD, &p));
    pattern_fill(p, 4 * MB, 1);
    fakecuda_stream_hold(CU_STREAM_PER_THREAD); /* this thread's: its work still runs */
    CHECK_OK(cuma_free(h, p, CU_STREAM_PER_THREAD));
    ptds_arg a = {h, t->ctx, (uintptr_t)p, {NULL, NULL}};
    pthread_t th;
    CHECK(pthread_create(&th, NULL, ptds_other, &a) == 0);
    CHECK(pthread_join(th, NULL) == 0);
    CHECK_OK(cuma_alloc(h, 4 * MB, CU_STREAM_PER_THREAD, &q));
    CHECK(q == p); /* this thread's own stream reuses it at once */
    fakecuda_stream_release(CU_STREAM_PER_THREAD);
    CHECK_OK(cuma_free(h, q, CU_STREAM_PER_THREAD));
    CHECK_OK(cuma_free(h, a.p[0], DS));
    CHECK_OK(cuma_free(h, a.p[1], DS));
    CHECK_OK(cuma_validate(h));
    /* Threads come and go, each on its own per-thread stream: more of them than the stream
     * table has slots, so each one's slot must be given back when it exits. */
    for (unsigned i = 0; i < 2 * CUMA_MAX_STREAMS; i++) {
        CHECK(pthread_create(&th, NULL, ptds_churn, &a) == 0);
        CHECK(pthread_join(th, NULL) == 0);
    }
    CHECK_OK(cuma_validate(h));
    CHECK_OK(cuma_trim(h, 0));
    cuma_heap_destroy(h);
    check_no_driver_objects();
}

/* A thread whose last use of its per-thread stream comes from a destructor of its own that runs
 * after cuma's exit hook (a key made later): that use is retired as well, so that such threads
 * do not fill the stream table either. */
static pthread_key_t late_key;

static void late_use(void *arg) {
    ptds_arg *a = arg;
    void *p;
    CHECK_OK(cuma_alloc(a->h, 1 * MB, CU_STREAM_PER_THREAD, &p));
    CHECK_OK(cuma_free(a->h, p, CU_STREAM_PER_THREAD));
}

static void *ptds_late(void *arg) {
    ptds_churn(arg); /* arms cuma's hook, whose key is older than late_key */
    CHECK(pthread_setspecific(late_key, arg) == 0);
    return NULL;
}

static void test_per_thread_late_use(test_ctx *t) {
    CHECK(pthread_key_create(&late_key, late_use) == 0);
    cuma_heap *h = heap_make("backend:vmm,release_delay_ms:never,tcache:off");
    ptds_arg a = {h, t->ctx, 0, {NULL, NULL}};
    pthread_t th;
    for (unsigned i = 0; i < 2 * CUMA_MAX_STREAMS; i++) {
        CHECK(pthread_create(&th, NULL, ptds_late, &a) == 0);
        CHECK(pthread_join(th, NULL) == 0);
    }
    CHECK_OK(cuma_validate(h));
    cuma_heap_destroy(h);
    CHECK(pthread_key_delete(late_key) == 0);
    check_no_driver_objects();
}

static void test_auto(const char *want) {
    cuma_backend *be = backend_make("auto", 0);
    CHECK(!strcmp(be->name, want));
    CHECK(be->kind == (strcmp(want, "vmm") ? CUMA_BACKEND_SEGMENT : CUMA_BACKEND_VMM));
    be->ops->destroy(be);
    check_no_driver_objects();
}

static void test_bad_device(void) {
    cuma_config cfg = {.conf = "backend:vmm", .flags = CUMA_CONFIG_NO_ENV, .device = 7};
    cuma_heap *h = NULL;
    CHECK_ST(cuma_heap_create(&cfg, &h), CUMA_ERR_NO_DEVICE);
    CHECK(h == NULL && strstr(cuma_last_error(), "device 7"));
    /* The simulated fallback is for a missing driver, never for a missing device. */
    cfg.conf = "backend_fallback:sim";
    CHECK_ST(cuma_heap_create(&cfg, &h), CUMA_ERR_NO_DEVICE);
    CHECK(h == NULL && strstr(cuma_last_error(), "device 7"));
    check_no_driver_objects();
}

static void run_novmm(void) {
    test_auto("segment");
    cuma_settings s;
    cuma_settings_default(&s);
    snprintf(s.backend, sizeof s.backend, "vmm");
    cuma_backend *be = NULL;
    CHECK_ST(cuma_backend_create(&s, &be), CUMA_ERR_UNSUPPORTED);
    CHECK(be == NULL && strstr(cuma_last_error(), "virtual memory management"));
    test_segment_ops("segment");
    test_segment_ops("managed");
    check_no_driver_objects();
}

/* No usable driver: every CUDA backend fails with CUMA_ERR_NO_DEVICE and a message that
 * contains `why` (the library path, the missing symbol, cuInit's error). */
static void run_nodriver(const char *why) {
    static const char *names[] = {"vmm", "segment", "managed", "auto"};
    for (int i = 0; i < 4; i++) {
        char conf[64];
        snprintf(conf, sizeof conf, "backend:%s", names[i]);
        cuma_config cfg = {.conf = conf, .flags = CUMA_CONFIG_NO_ENV};
        cuma_heap *h = (cuma_heap *)1;
        CHECK_ST(cuma_heap_create(&cfg, &h), CUMA_ERR_NO_DEVICE);
        CHECK(h == NULL);
        CHECK(strstr(cuma_last_error(), why));
        fprintf(stderr, "backend:%s without a driver: %s\n", names[i], cuma_last_error());
    }
    /* Nor does the default backend fall back unasked; the message says what to set. */
    cuma_config cfg = {.conf = "capacity:64M", .flags = CUMA_CONFIG_NO_ENV};
    cuma_heap *h = (cuma_heap *)1;
    CHECK_ST(cuma_heap_create(&cfg, &h), CUMA_ERR_NO_DEVICE);
    CHECK(h == NULL && strstr(cuma_last_error(), why));
    CHECK(strstr(cuma_last_error(), "backend:sim") &&
          strstr(cuma_last_error(), "backend_fallback:sim"));
    /* Asked for, every CUDA backend falls back to the simulated device, visibly. */
    for (int i = 0; i < 4; i++) {
        char conf[96];
        snprintf(conf, sizeof conf, "backend:%s,backend_fallback:sim,capacity:64M", names[i]);
        h = heap_make(conf);
        char json[8192];
        CHECK_OK(cuma_stats_json(h, json, sizeof json, NULL));
        CHECK(strstr(json, "\"backend\":\"sim\"") && strstr(json, "\"backend_fallback\":true"));
        cuma_heap_destroy(h);
    }
    /* The sim needs no driver. */
    h = heap_make("backend:sim,capacity:64M");
    cuma_heap_destroy(h);
}

/* Two devices: a heap on device 1 works in device 1's context, grants device 0 access, and
 * leaves the caller's device 0 context current. */
static void run_twodev(void) {
    test_ctx t = test_ctx_open(0);
    cuma_backend *b0 = backend_make("vmm", 0), *b1 = backend_make("vmm", 1);
    CHECK(strcmp(b0->device_id, b1->device_id) != 0);
    b0->ops->destroy(b0);
    b1->ops->destroy(b1);
    cuma_config cfg = {.conf = "backend:vmm", .flags = CUMA_CONFIG_NO_ENV, .device = 1};
    cuma_heap *h = NULL;
    CHECK_OK(cuma_heap_create(&cfg, &h));
    void *p;
    fakecuda_reset_counters();
    CHECK_OK(cuma_alloc(h, 3 * MB, DS, &p));
    pattern_fill(p, 3 * MB, 5);
    CHECK(fakecuda_used_bytes(1) == 4 * MB && fakecuda_used_bytes(0) == 0);
    CUcontext cur = NULL;
    CHECK_CU(cuCtxGetCurrent(&cur));
    CHECK(cur == t.ctx);
    CHECK(pattern_ok(p, 3 * MB, 5));
    CHECK_OK(cuma_free(h, p, DS));
    CHECK_OK(cuma_trim(h, 0));
    CHECK(fakecuda_used_bytes(1) == 0);
    cuma_heap_destroy(h);
    check_no_driver_objects();
    test_ctx_close(&t);
}

/* A context that takes device memory of its own (FAKECUDA_CONTEXT_MB, as real ones take hundreds
 * of MiB): the device reports its whole size, but the heap can hold only what is left, runs out
 * of memory cleanly there, and goes on. Both backends, since each asks the driver differently. */
static void run_context_memory(const char *backend) {
    const char *e = getenv("FAKECUDA_CONTEXT_MB");
    CHECK(e && atol(e) > 0);
    const uint64_t ctx = (uint64_t)atol(e) * MB, cap = capacity_env();
    char conf[160];
    snprintf(conf, sizeof conf, "backend:%s,ledger:off,release_delay_ms:never", backend);
    cuma_config cfg = {.conf = conf, .flags = CUMA_CONFIG_NO_ENV};
    cuma_heap *h = NULL;
    CHECK_OK(cuma_heap_create(&cfg, &h));
    cuma_stats s;
    CHECK_OK(cuma_get_stats(h, &s));
    CHECK(s.device_total_bytes == cap && s.device_free_bytes == cap - ctx);
    void *p[256];
    unsigned n = 0;
    cuma_status st = CUMA_OK;
    while (n < 256 && (st = cuma_alloc(h, 16 * MB, DS, &p[n])) == CUMA_OK) n++;
    CHECK(st == CUMA_ERR_OOM && strstr(cuma_last_error(), "out of memory"));
    CHECK_OK(cuma_get_stats(h, &s));
    /* Filled to what the context leaves (within a segment or page of it), never beyond. */
    CHECK(s.reserved_bytes <= cap - ctx && s.reserved_bytes + 32 * MB > cap - ctx);
    CHECK((uint64_t)n * 16 * MB <= cap - ctx);
    CHECK_OK(cuma_validate(h));
    for (unsigned i = 0; i < n; i++) CHECK_OK(cuma_free(h, p[i], DS));
    CHECK_OK(cuma_trim(h, 0));
    CHECK_OK(cuma_get_stats(h, &s));
    CHECK(s.reserved_bytes == 0 && s.device_free_bytes == cap - ctx);
    CHECK_OK(cuma_alloc(h, 16 * MB, DS, &p[0])); /* and goes on */
    CHECK_OK(cuma_free(h, p[0], DS));
    cuma_heap_destroy(h);
    check_no_driver_objects();
}

int main(int argc, char **argv) {
    const char *mode = argc > 1 ? argv[1] : "";
    watchdog(240, mode[0] ? mode : "the default run");
    if (!strcmp(mode, "nodriver")) {
        CHECK(argc > 2);
        run_nodriver(argv[2]);
    } else if (!strcmp(mode, "novmm")) {
        test_ctx t = test_ctx_open(0);
        run_novmm();
        test_ctx_close(&t);
    } else if (!strcmp(mode, "autofallback")) {
        test_ctx t = test_ctx_open(0);
        test_auto("segment"); /* the first granularity query fails */
        test_auto("vmm");
        test_ctx_close(&t);
    } else if (!strcmp(mode, "twodev")) {
        run_twodev();
    } else if (!strcmp(mode, "ctxmem")) {
        test_ctx t = test_ctx_open(0);
        run_context_memory("vmm");
        run_context_memory("segment");
        test_ctx_close(&t);
    } else {
        test_ctx t = test_ctx_open(0);
        test_auto("vmm");
        test_bad_device();
        test_vmm_ops();
        test_vmm_probe();
        test_segment_ops("segment");
        test_segment_ops("managed");
        test_vmm_churn();
        test_vmm_compact();
        test_busy_stream();
        test_held_page_stays();
        test_early_remap();
        test_busy_stream_does_not_block();
        test_watermark();
        test_release_runs();
        test_context_restored(&t);
        test_page_size();
        test_threads(&t);
        test_per_thread_streams(&t);
        test_per_thread_late_use(&t);
        test_ctx_close(&t);
    }
    fprintf(stderr, "test_cuda_backend %s: ok\n", mode);
    return 0;
}
