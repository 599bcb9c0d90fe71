// SPDX-License-Identifier: Apache-2.0
/* The process-wide default heaps and the PyTorch entry points (src/shim): creation on first
 * use from many threads at once, no simulated device unasked without a driver (and the
 * backend_fallback:sim that asks for it), the hooks' edge cases, shutdown. */
#include "child.h"
#include "cuma/torch.h"
#include "heap/heap.h"

#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#define NTHREADS   16
#define PER_THREAD 200

static pthread_barrier_t start;
static cuma_heap *seen[NTHREADS];
static void *ptrs[NTHREADS][PER_THREAD];

static void *racer(void *arg) {
    int id = (int)(intptr_t)arg;
    pthread_barrier_wait(&start);
    CHECK_OK(cuma_default_heap(0, &seen[id]));
    for (int i = 0; i < PER_THREAD; i++) {
        ptrs[id][i] = cuma_torch_malloc(512 + 64 * i + id, 0, NULL);
        CHECK(ptrs[id][i] != NULL);
    }
    for (int i = 0; i < PER_THREAD; i += 2) cuma_torch_free(ptrs[id][i], 0, 0, NULL);
    return NULL;
}

static void test_first_use_race(void) {
    setenv("CUMA_CONF", "backend:sim,capacity:1G", 1);
    cuma_default_heaps_shutdown();
    CHECK(cuma_torch_created_heap(0) == NULL);
    pthread_t t[NTHREADS];
    pthread_barrier_init(&start, NULL, NTHREADS);
    for (int i = 0; i < NTHREADS; i++)
        CHECK(pthread_create(&t[i], NULL, racer, (void *)(intptr_t)i) == 0);
    for (int i = 0; i < NTHREADS; i++) pthread_join(t[i], NULL);
    pthread_barrier_destroy(&start);
    for (int i = 1; i < NTHREADS; i++) CHECK(seen[i] == seen[0]); /* created once */
    CHECK(cuma_torch_created_heap(0) == seen[0]);
    for (int i = 0; i < NTHREADS; i++)
        for (int j = 1; j < PER_THREAD; j += 2) cuma_torch_free(ptrs[i][j], 0, 0, NULL);
    cuma_stats s;
    CHECK_OK(cuma_get_stats(seen[0], &s));
    CHECK(s.active_allocs == 0 && s.requested_bytes == 0);
    CHECK_OK(cuma_validate(seen[0]));
    cuma_default_heaps_shutdown();
    CHECK(cuma_torch_created_heap(0) == NULL);
}

/* Without a usable driver (CUMA_CUDA_LIBRARY names none, so this holds on a GPU machine too)
 * a default heap that names no backend is an error that says how to get the simulated device,
 * never simulated memory unasked; backend_fallback:sim gives it, visibly, on every device. */
static void test_no_driver_is_an_error_unless_asked(void) {
    setenv("CUMA_CUDA_LIBRARY", "/nonexistent/libcuda.so.1", 1);
    setenv("CUMA_CONF", "capacity:256M", 1); /* no backend named: auto */
    cuma_default_heaps_shutdown();
    cuma_heap *h = (cuma_heap *)1;
    CHECK_ST(cuma_default_heap(0, &h), CUMA_ERR_NO_DEVICE);
    CHECK(h == NULL && cuma_torch_created_heap(0) == NULL);
    const char *why = cuma_last_error();
    CHECK(strstr(why, "no usable CUDA driver") && strstr(why, "/nonexistent/libcuda.so.1"));
    CHECK(strstr(why, "backend:sim") && strstr(why, "backend_fallback:sim"));
    CHECK(cuma_torch_malloc(4096, 0, NULL) == NULL);
    CHECK(strstr(cuma_last_error(), "no usable CUDA driver"));
    /* Asked for: the simulated device, said in the stats; CUMA_CONF's other keys apply. */
    setenv("CUMA_CONF", "capacity:256M,backend_fallback:sim", 1);
    CHECK_OK(cuma_default_heap(0, &h));
    char buf[8192];
    CHECK(cuma_torch_stats_json(0, buf, sizeof buf) > 0);
    CHECK(strstr(buf, "\"backend\":\"sim\"") && strstr(buf, "\"backend_fallback\":true"));
    cuma_stats s;
    CHECK_OK(cuma_get_stats(h, &s));
    CHECK(s.device_total_bytes == 256u << 20);
    cuma_heap *h3;
    CHECK_OK(cuma_default_heap(3, &h3));
    CHECK(h3 != h);
    /* A named backend falls back only when asked as well. */
    setenv("CUMA_CONF", "backend:auto", 1);
    cuma_default_heaps_shutdown();
    CHECK_ST(cuma_default_heap(0, &h), CUMA_ERR_NO_DEVICE);
    CHECK(h == NULL);
    setenv("CUMA_CONF", "backend:segment,backend_fallback:sim", 1);
    CHECK_OK(cuma_default_heap(0, &h));
    CHECK(cuma_torch_stats_json(0, buf, sizeof buf) > 0);
    CHECK(strstr(buf, "\"backend_fallback\":true"));
    cuma_default_heaps_shutdown();
}

static void test_entry_point_edges(void) {
    setenv("CUMA_CONF", "backend:sim,capacity:64M", 1);
    cuma_default_heaps_shutdown();
    cuma_heap *h;
    CHECK_ST(cuma_default_heap(64, &h), CUMA_ERR_INVALID);
    CHECK_ST(cuma_default_heap(-1, &h), CUMA_ERR_INVALID);
    CHECK(cuma_torch_malloc(0, 0, NULL) == NULL && cuma_last_error()[0] == 0);
    CHECK(cuma_torch_malloc(-1, 0, NULL) == NULL && strstr(cuma_last_error(), "negative"));
    CHECK(cuma_torch_malloc(1 << 20, 64, NULL) == NULL && strstr(cuma_last_error(), "device 64"));
    void *p = cuma_torch_malloc(4 << 20, 1, NULL);
    CHECK(p != NULL);
    cuma_torch_record_stream(p, (cudaStream_t)(uintptr_t)5);
    cuma_torch_free(p, 4 << 20, 1, NULL);
    cuma_torch_reset();
    CHECK_OK(cuma_default_heap(1, &h));
    cuma_stats s;
    CHECK_OK(cuma_get_stats(h, &s));
    CHECK(s.reserved_bytes == 0 && s.active_allocs == 0);
    cuma_torch_memory_fraction(0.5, 1);
    CHECK_OK(cuma_get_stats(h, &s));
    CHECK(s.limit_bytes == 32 << 20);
    char small[8];
    int n = cuma_torch_stats_json(1, small, sizeof small);
    CHECK(n > (int)sizeof small);
    cuma_default_heaps_shutdown();
}

/* cuma_torch_disown: the next cuma_torch_free of that pointer is skipped (cuma.torch.compact
 * moved the block; cuma frees the old place itself), the one after frees; slots run out. */
static void test_disown(void) {
    setenv("CUMA_CONF", "backend:sim,capacity:64M", 1);
    cuma_default_heaps_shutdown();
    void *p = cuma_torch_malloc(4096, 0, NULL), *q = cuma_torch_malloc(4096, 0, NULL);
    CHECK(p && q);
    cuma_heap *h;
    CHECK_OK(cuma_default_heap(0, &h));
    CHECK_ST(cuma_torch_disown(NULL), CUMA_ERR_INVALID);
    CHECK(!cuma_torch_disowned(p));
    CHECK_OK(cuma_torch_disown(p));
    CHECK(cuma_torch_disowned(p) && !cuma_torch_disowned(q));
    cuma_torch_free(q, 4096, 0, NULL); /* another pointer: freed as ever */
    cuma_torch_free(p, 4096, 0, NULL); /* skipped */
    size_t bs;
    CHECK_OK(cuma_block_size(h, p, &bs));
    CHECK_ST(cuma_block_size(h, q, &bs), CUMA_ERR_BAD_POINTER);
    CHECK(!cuma_torch_disowned(p));
    cuma_torch_free(p, 4096, 0, NULL);
    CHECK_ST(cuma_block_size(h, p, &bs), CUMA_ERR_BAD_POINTER);
    int n = 0;
    while (cuma_torch_disown((void *)(uintptr_t)(0x1000 + 256 * n)) == CUMA_OK) n++;
    CHECK(n == 64 && strstr(cuma_last_error(), "64 pointers"));
    for (int i = 0; i < n; i++) {
        CHECK(cuma_torch_disowned((void *)(uintptr_t)(0x1000 + 256 * i)));
        cuma_torch_free((void *)(uintptr_t)(0x1000 + 256 * i), 0, 0, NULL); /* each taken back */
    }
    CHECK(!cuma_torch_disowned((void *)(uintptr_t)0x1000));
    cuma_default_heaps_shutdown();
}

/* cuma_default_settings_set: the default heaps' settings without touching CUMA_CONF, so that
 * a heap made with cuma_heap_create keeps what CUMA_CONF says (issue 13: a limit meant for the
 * default heaps made an unrelated heap fail at 50 pages). */
static void test_default_settings(void) {
    setenv("CUMA_CONF", "backend:sim,capacity:256M", 1);
    cuma_default_heaps_shutdown();
    CHECK_OK(cuma_default_settings_set("backend:sim,capacity:128M,limit:8M"));
    CHECK(!strcmp(getenv("CUMA_CONF"), "backend:sim,capacity:256M")); /* left as it was */
    cuma_heap *d, *d2, *own;
    cuma_stats s;
    CHECK_OK(cuma_default_heap(0, &d));
    CHECK_OK(cuma_get_stats(d, &s));
    CHECK(s.limit_bytes == 8 << 20 && s.device_total_bytes == 128 << 20);
    CHECK_OK(cuma_default_heap(2, &d2)); /* every device's, with its own ordinal */
    CHECK_OK(cuma_get_stats(d2, &s));
    CHECK(s.limit_bytes == 8 << 20 && d2 != d);
    cuma_config cfg = {.conf = "limit:100M"};
    CHECK_OK(cuma_heap_create(&cfg, &own)); /* CUMA_CONF, then its own settings: no 8M */
    CHECK_OK(cuma_get_stats(own, &s));
    CHECK(s.limit_bytes == 100 << 20 && s.device_total_bytes == 256 << 20);
    void *p;
    CHECK_OK(cuma_alloc(own, 64 << 20, NULL, &p));
    CHECK_OK(cuma_free(own, p, NULL));
    cuma_heap_destroy(own);
    /* Checked, naming the key; a refused string changes nothing. */
    CHECK_ST(cuma_default_settings_set("limit:lots"), CUMA_ERR_CONFIG);
    CHECK(strstr(cuma_last_error(), "limit") && strstr(cuma_last_error(), "lots"));
    CHECK_ST(cuma_default_settings_set("growth:off"), CUMA_ERR_CONFIG); /* checked whole */
    CHECK(strstr(cuma_last_error(), "preallocate"));
    char *longconf = malloc(4002);
    CHECK(longconf);
    memset(longconf, ',', 4001);
    longconf[4001] = 0;
    CHECK_ST(cuma_default_settings_set(longconf), CUMA_ERR_CONFIG);
    free(longconf);
    cuma_default_heaps_shutdown();
    CHECK_OK(cuma_default_heap(0, &d));
    CHECK_OK(cuma_get_stats(d, &s));
    CHECK(s.limit_bytes == 8 << 20); /* still the given settings */
    /* No backend named: backend:auto, here (no driver) the sim fallback the settings ask for,
     * with the given settings either way. */
    cuma_default_heaps_shutdown();
    CHECK_OK(cuma_default_settings_set("limit:4M,backend_fallback:sim"));
    CHECK_OK(cuma_default_heap(0, &d));
    CHECK_OK(cuma_get_stats(d, &s));
    CHECK(s.limit_bytes == 4 << 20);
    /* NULL: CUMA_CONF again, for heaps created from then on. */
    CHECK_OK(cuma_default_settings_set(NULL));
    CHECK_OK(cuma_get_stats(d, &s));
    CHECK(s.limit_bytes == 4 << 20); /* an existing heap keeps its settings */
    cuma_default_heaps_shutdown();
    CHECK_OK(cuma_default_heap(0, &d));
    CHECK_OK(cuma_get_stats(d, &s));
    CHECK(s.limit_bytes == 256 << 20 && s.device_total_bytes == 256 << 20);
    cuma_default_heaps_shutdown();
}

#ifndef NDEBUG
/* Makes a default heap while holding another heap's arena lock: against the lock order (the
 * creation takes fork_lock, which a fork's handlers hold while they take every arena lock). */
static void create_under_arena_lock(void) {
    cuma_heap *h = heap_make("backend:sim,capacity:64M");
    cuma_mutex_lock(&h->first.lock, CUMA_RANK_ARENA);
    cuma_heap *d;
    cuma_default_heap(3, &d);
}
#endif

/* The shim's locks are in the lock order that debug builds check (util/lockrank.h): making a
 * default heap under a heap's lock aborts, naming both locks. The other tests here take the
 * shim's locks in the order of the real calls, checked in the same builds. */
static void test_shim_locks_ranked(void) {
#ifdef NDEBUG
    printf("test_default_heap: lock order not checked in this build (NDEBUG)\n");
#else
    setenv("CUMA_CONF", "backend:sim,capacity:64M", 1);
    cuma_default_heaps_shutdown();
    char err[1024];
    int status = child_run(create_under_arena_lock, err, sizeof err);
    CHECK(child_aborted(status));
    /* The settings lock where the driver is loaded first (a CUDA build), else create_lock. */
    CHECK(strstr(err, "taking the default heaps' ") && strstr(err, "holding an arena's lock"));
#endif
}

int main(void) {
    test_shim_locks_ranked();
    test_first_use_race();
    test_no_driver_is_an_error_unless_asked();
    test_entry_point_edges();
    test_disown();
    test_default_settings();
    unsetenv("CUMA_CONF");
    printf("test_default_heap: ok\n");
    return 0;
}
