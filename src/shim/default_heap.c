// SPDX-License-Identifier: Apache-2.0
/* The process-wide default heaps: one per device ordinal, created on first use.
 *
 * Framework entry points (the PyTorch allocator hooks, the LD_PRELOAD interposer, the Python
 * package's module-level helpers) have no place to keep a heap handle, so they share these.
 *
 * Thread safety: cuma_default_heap may be called from any thread at any time. A created heap
 * is published with a release store and read with an acquire load, so the fast path (every
 * allocation after the first) is one atomic load and no lock. Creation takes `create_lock`, so
 * two threads that race to create the same device's heap create it once.
 * cuma_default_heaps_shutdown must not race with any other use of a default heap, nor
 * cuma_default_heap_retire with any use of that device's heap (like cuma_heap_destroy).
 */
#include "default_heap.h"

#include "util/error.h"
#include "util/lockrank.h"
#include "heap/heap.h"
#ifdef CUMA_HAVE_CUDA
#include "backend/cuda_driver.h"
#endif

#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* Written under create_lock (creation, retirement, shutdown); read by anyone without it. */
static _Atomic(cuma_heap *) heaps[CUMA_MAX_DEFAULT_HEAPS];
static pthread_mutex_t create_lock = PTHREAD_MUTEX_INITIALIZER;

/* cuma_default_settings_set's string: the default heaps' settings in place of CUMA_CONF while
 * settings_given. Under settings_lock, a lock of its own that is held only to copy the string,
 * so that cuma_default_heap_load_driver (which must take no lock that a dlopen could wait on)
 * can read it too. The longest string leaves room for the backend and device added to it. */
#define SETTINGS_MAX 4000
static pthread_mutex_t settings_lock = PTHREAD_MUTEX_INITIALIZER;
static char settings[SETTINGS_MAX + 1];
static bool settings_given;

static pthread_once_t fork_once;
static void watch_forks(void);

/* The settings string the default heaps read now (copied into buf), or NULL for CUMA_CONF. */
static const char *given_settings(char buf[SETTINGS_MAX + 1]) {
    pthread_once(&fork_once, watch_forks);
    cuma_mutex_lock(&settings_lock, CUMA_RANK_DEFAULT_SETTINGS);
    bool given = settings_given;
    if (given) memcpy(buf, settings, sizeof settings);
    cuma_mutex_unlock(&settings_lock);
    return given ? buf : NULL;
}

/* Creates the heap of `device`. Called with create_lock held. Like any heap: without a usable
 * CUDA driver it is CUMA_ERR_NO_DEVICE unless the settings say backend:sim or
 * backend_fallback:sim (a framework given simulated addresses for a GPU would crash far from
 * here). */
static cuma_status create_default(int device, cuma_heap **out) {
    /* The ordinal goes into the settings string as well as cfg.device: the string is applied
     * after CUMA_CONF (or the given settings), so a "device:N" there cannot send every default
     * heap to one device. */
    char given_buf[SETTINGS_MAX + 1], conf[SETTINGS_MAX + 64];
    const char *given = given_settings(given_buf);
    snprintf(conf, sizeof conf, "%s%sdevice:%d", given ? given : "", given ? "," : "", device);
    cuma_config cfg = {.conf = conf, .flags = given ? CUMA_CONFIG_NO_ENV : 0, .device = device};
    return cuma_heap_create(&cfg, out);
}

/* A fork while another thread was creating a heap (create_lock held) would leave the lock held in
 * the child for good: the child starts with it free. The heaps array needs nothing: entries are
 * published whole (atomic), and a heap half made by a thread the child does not have is just not
 * there. Registered once, before the lock is first taken. */
static pthread_once_t fork_once = PTHREAD_ONCE_INIT;

static void child_after_fork(void) {
    pthread_mutex_t fresh = PTHREAD_MUTEX_INITIALIZER;
    memcpy(&create_lock, &fresh, sizeof fresh);
    memcpy(&settings_lock, &fresh, sizeof fresh);
}

static void watch_forks(void) {
    pthread_atfork(NULL, NULL, child_after_fork);
}

static void lock_create(void) {
    pthread_once(&fork_once, watch_forks);
    cuma_mutex_lock(&create_lock, CUMA_RANK_DEFAULT_CREATE);
}

void cuma_default_heap_load_driver(void) {
#ifdef CUMA_HAVE_CUDA
    /* Loading takes no lock of cuma's; a failure is the heap creation's to report. */
    char given_buf[SETTINGS_MAX + 1];
    const char *given = given_settings(given_buf);
    cuma_config cfg = {.conf = given, .flags = given ? CUMA_CONFIG_NO_ENV : 0, .device = 0};
    cuma_settings set;
    bool sim = cuma_settings_from_config(&set, &cfg) == CUMA_OK && set.backend_named &&
               !strcmp(set.backend, "sim");
    const cuma_cuda_api *api;
    if (!sim && cuma_cuda_load(&api)) cuma_clear_error();
    cuma_clear_error();
#endif
}

cuma_status cuma_default_heap(int device, cuma_heap **out) {
    if (!out) return cuma_fail(CUMA_ERR_INVALID, "cuma_default_heap: out is NULL");
    *out = NULL;
    if (device < 0 || device >= CUMA_MAX_DEFAULT_HEAPS)
        return cuma_fail(CUMA_ERR_INVALID, "cuma_default_heap: device %d is not in 0..%d", device,
                         CUMA_MAX_DEFAULT_HEAPS - 1);
    cuma_heap *h = atomic_load_explicit(&heaps[device], memory_order_acquire);
    if (h) {
        *out = h;
        return CUMA_OK;
    }
    cuma_default_heap_load_driver();
    lock_create();
    cuma_status st = CUMA_OK;
    h = atomic_load_explicit(&heaps[device], memory_order_relaxed); /* another thread won */
    if (!h) {
        st = create_default(device, &h);
        /* A failure is not remembered: the next call tries again, so a program can fix
         * CUMA_CONF (or load a driver) and retry without restarting. */
        if (st == CUMA_OK) atomic_store_explicit(&heaps[device], h, memory_order_release);
    }
    cuma_mutex_unlock(&create_lock);
    *out = h;
    return st;
}

cuma_status cuma_default_settings_set(const char *conf) {
    if (conf) {
        if (strlen(conf) > SETTINGS_MAX)
            return cuma_fail(CUMA_ERR_CONFIG,
                             "cuma_default_settings_set: settings string longer than %d bytes",
                             SETTINGS_MAX);
        /* The whole of the heaps' settings (CUMA_CONF is not read under them): checked as
         * cuma_config_check checks a string, so that a bad one fails here, not at first use. */
        cuma_status st = cuma_config_check(conf);
        if (st) return st;
    }
    pthread_once(&fork_once, watch_forks);
    cuma_mutex_lock(&settings_lock, CUMA_RANK_DEFAULT_SETTINGS);
    settings_given = conf != NULL;
    snprintf(settings, sizeof settings, "%s", conf ? conf : "");
    cuma_mutex_unlock(&settings_lock);
    return CUMA_OK;
}

cuma_heap *cuma_default_heap_peek(int device) {
    if (device < 0 || device >= CUMA_MAX_DEFAULT_HEAPS) return NULL;
    return atomic_load_explicit(&heaps[device], memory_order_acquire);
}

bool cuma_default_heap_retire(int device) {
    if (device < 0 || device >= CUMA_MAX_DEFAULT_HEAPS) return false;
    /* Unpublished under create_lock, so that a creation under way for this device (which holds
     * it) publishes first and is the one destroyed here. The destruction itself runs without the
     * lock: it waits for the heap's release thread, and other devices' heaps may be created
     * meanwhile. */
    lock_create();
    cuma_heap *h = atomic_exchange_explicit(&heaps[device], NULL, memory_order_acq_rel);
    cuma_mutex_unlock(&create_lock);
    cuma_heap_destroy(h);
    return h != NULL;
}

/* Not registered with atexit, on purpose: a framework may still free memory while the process
 * exits (C++ static destructors run interleaved with atexit handlers, in reverse order of
 * registration, and Python frees tensors during interpreter finalization), and a free into a
 * destroyed heap is a use-after-free. The operating system and the driver take every page
 * back at exit anyway; an owner that knows every user is done (a test, a framework's orderly
 * shutdown) calls this. */
void cuma_default_heaps_shutdown(void) {
    lock_create();
    for (int i = 0; i < CUMA_MAX_DEFAULT_HEAPS; i++) {
        cuma_heap *h = atomic_exchange_explicit(&heaps[i], NULL, memory_order_acq_rel);
        cuma_heap_destroy(h);
    }
    cuma_mutex_unlock(&create_lock);
}
