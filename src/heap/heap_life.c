// SPDX-License-Identifier: Apache-2.0
/* Heap life cycle: settings, backend, arenas' common parts, creation and destruction. */
#include "util/error.h"
#include "heap/heap.h"
#include "util/marks.h"
#include "heap/pools.h"
#include "trace/writer.h"

#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

void cuma_arena_refresh_limit(cuma_arena *a) {
    cuma_heap *h = a->heap;
    /* The device size, or a smaller limit; on managed memory (backend:managed) any limit the user
     * sets, since oversubscription is what it is for. Without one it stays the device size: past
     * it every page is paged over the bus, and a program that did not ask for that is better
     * told it is out of memory than slowed down many times over. */
    uint64_t lim = a->be->capacity;
    bool over = a->be->caps & CUMA_CAP_OVERSUBSCRIBE;
    if (h->set.limit != CUMA_UNLIMITED && (over || h->set.limit < lim)) lim = h->set.limit;
    if (h->set.memory_fraction > 0) {
        uint64_t f = (uint64_t)(h->set.memory_fraction * (double)a->be->capacity);
        if (f < lim) lim = f;
    }
    if (!h->set.growth && h->set.preallocate < lim) lim = h->set.preallocate;
    a->limit_bytes = lim;
    if (a == &h->first && h->peers.ops) h->peers.ops->set_limit(h->peers.ctx, lim);
    a->phys.ops->set_limit(a, lim, lim == a->be->capacity);
}

void cuma_arena_init_wake(cuma_arena *a) {
    /* The release thread's timed waits are on the monotonic clock, as the heap's time is. */
    pthread_condattr_t ca;
    pthread_condattr_init(&ca);
    pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
    pthread_cond_init(&a->wake, &ca);
    pthread_condattr_destroy(&ca);
}

/* Everything an arena needs besides its heap and backend (set by the caller):
 * placement, the physical layer (phys.h: a virtual range and pages, or segments), tables,
 * limits, the first arena's preallocation, the lock and the release thread. On failure nothing
 * is left to undo. */
cuma_status cuma_arena_build(cuma_arena *a) {
    cuma_status st;
    bool first = a == &a->heap->first;
    /* The one place the layer is chosen: everything after asks it, never which it is. */
    const cuma_phys_ops *phys = cuma_phys_choose(a->be);
    if (!phys)
        return cuma_fail(CUMA_ERR_UNSUPPORTED, "backend %s offers neither pages nor segments",
                         a->be->name);
    a->phys.ops = phys;
    bool range = phys->caps & CUMA_PHYS_RANGE;
    const cuma_policy_ops *pol = cuma_policy_find(a->heap->set.policy);
    if (!pol) return cuma_fail(CUMA_ERR_CONFIG, "policy:%s: no such policy", a->heap->set.policy);
    if (!range && (pol->flags & CUMA_POLICY_NEEDS_RANGE))
        return cuma_fail(
            CUMA_ERR_CONFIG,
            "policy:%s needs a virtual range; backend %s has segments only (use policy:tlsf)",
            pol->name, a->be->name);
    st = cuma_streams_init(&a->streams, a->be);
    if (st) return st;
    /* The tables keep their own copy of nvtx:on, the one flag their slow paths test. */
    if (a->heap->set.nvtx) cuma_marks_init();
    a->streams.marks = a->heap->set.nvtx;
    st = pol->create(&a->pol, &a->streams, range ? CUMA_POLICY_KEEP_TOP_CLEAN : 0);
    if (st) goto fail_streams;
    st = phys->init(a);
    if (st) goto fail_pol;
    /* The pages in use, so that the policy packs blocks smaller than a page onto them (the
     * layer's counts per unit; NULL where it keeps none, and the policy places as it would). */
    a->pol->hint = (cuma_place_hint){a->phys.refs, a->phys.nrefs, a->phys.shift};
    cuma_map_init(&a->live);
    a->release_delay_ns =
        a->heap->set.release_delay_ms < 0 ? -1 : a->heap->set.release_delay_ms * 1000000;
    a->tc_on = a->heap->set.tcache;
    a->tc_bytes = a->heap->set.tcache_bytes;
    a->tc_max = a->heap->set.tcache_max;
    a->idle_since = UINT64_MAX;
    a->tc_age_ns =
        a->heap->set.tcache_age_ms < 0 ? INT64_MAX : a->heap->set.tcache_age_ms * 1000000;
    /* A thread cache's idle blocks are idle memory too: none stays longer than the heap's own
     * idle pages would (their pages age from the push, cuma_arena_give_cached). */
    if (a->release_delay_ns >= 0 && a->tc_age_ns > a->release_delay_ns)
        a->tc_age_ns = a->release_delay_ns;
    a->granule_round = (pol->flags & CUMA_POLICY_GRANULE_ROUND) != 0;
    uint64_t room = phys->max_request(a);
    /* Size classes only where the slack past a request holds no memory (pages are mapped under
     * requested bytes); with segments the slack of a class would be memory. */
    a->fast_max = !a->tc_on || !a->granule_round || !(phys->caps & CUMA_PHYS_SLACK_FREE) ? 0
                  : a->tc_max < room                                                     ? a->tc_max
                                                                                         : room;
    a->max_cached_bytes =
        a->heap->set.max_cached == CUMA_UNLIMITED ? UINT64_MAX : a->heap->set.max_cached;
    cuma_arena_refresh_limit(a);
    if (a->heap->set.preallocate && first) {
        st = phys->prefill(a, a->heap->set.preallocate, cuma_arena_now(a));
        if (st) goto fail_all;
    }
    /* Adaptive: threads whose slow paths collide spin a little before sleeping, which costs
     * less than a futex sleep and wake for critical sections this short. */
    pthread_mutexattr_t ma;
    pthread_mutexattr_init(&ma);
    pthread_mutexattr_settype(&ma, PTHREAD_MUTEX_ADAPTIVE_NP);
    pthread_mutex_init(&a->lock, &ma);
    pthread_mutexattr_destroy(&ma);
    cuma_arena_init_wake(a);
    /* The thread also ages the thread caches (a batched free holds its pages mapped until then;
     * max_cached acts on them only after), answers the ledger's pressure requests and watches
     * the device's free memory (free_watermark), whatever the release delay. */
    bool thread = a->release_delay_ns >= 0 || a->tc_on ||
                  (first && (a->heap->peers.ops || a->heap->set.free_watermark));
    if (a->heap->set.release_thread && !a->heap->set.sim_clock_manual && thread) {
        if (pthread_create(&a->thread, NULL, cuma_arena_release_thread, a)) {
            st = cuma_fail(CUMA_ERR_BACKEND, "could not start the release thread");
            pthread_mutex_destroy(&a->lock);
            pthread_cond_destroy(&a->wake);
            goto fail_all;
        }
        a->thread_running = true;
    }
    atomic_store(&a->coarse_now, cuma_arena_now(a));
    a->id = cuma_tcache_register_arena(a);
    return CUMA_OK;
fail_all:
    cuma_map_destroy(&a->live);
    phys->destroy(a);
fail_pol:
    a->pol->ops->destroy(a->pol);
fail_streams:
    cuma_streams_destroy(&a->streams);
    return st;
}

/* Stops an arena's release thread (it reads every arena's published figures). */
static void stop_thread(cuma_arena *a) {
    if (!a->thread_running) return;
    cuma_mutex_lock(&a->lock, CUMA_RANK_ARENA);
    a->stopping = true;
    pthread_cond_signal(&a->wake);
    cuma_mutex_unlock(&a->lock);
    pthread_join(a->thread, NULL);
    a->thread_running = false;
}

void cuma_arena_teardown(cuma_arena *a) {
    stop_thread(a);
    cuma_tcache_unregister_arena(a);
    cuma_tcache_destroy_all(a);
    cuma_map_destroy(&a->live);
    a->phys.ops->destroy(a);
    a->pol->ops->destroy(a->pol);
    cuma_streams_destroy(&a->streams);
    pthread_mutex_destroy(&a->lock);
    pthread_cond_destroy(&a->wake);
}

cuma_status cuma_heap_create_with(const cuma_config *cfg, cuma_peers_join_fn join,
                                  cuma_heap **out) {
    cuma_clear_error();
    if (!out) return cuma_fail(CUMA_ERR_INVALID, "cuma_heap_create: out is NULL");
    *out = NULL;
    cuma_heap *h = calloc(1, sizeof *h);
    if (!h) return cuma_fail(CUMA_ERR_OOM, "no host memory for a heap");
    cuma_status st = cuma_settings_from_config(&h->set, cfg);
    if (st) goto fail_free;
    /* Thread caches whose blocks may sit for no time (cuma_arena_build caps the age by the delay)
     * hold nothing: their frees would wait for the release thread, which could only poll for
     * them, every millisecond, for ever. Off for the heap, so every arena and the stats'
     * settings agree. */
    if (h->set.tcache_age_ms == 0 || h->set.release_delay_ms == 0) h->set.tcache = false;
    st = cuma_backend_create_or_fallback(&h->set, &h->be, &h->backend_fallback);
    if (st) goto fail_free;
    /* backend_fallback:sim and no driver: the settings say the backend the heap runs on, and
     * the stats' "backend_fallback" why. */
    if (h->backend_fallback) snprintf(h->set.backend, sizeof h->set.backend, "sim");
    /* A fraction of a device that is not a page would be a limit no allocation fits (the
     * settings check `limit` so; the fraction needs the device's size). */
    if (h->set.memory_fraction > 0 &&
        h->set.memory_fraction * (double)h->be->capacity < (double)h->be->page_size) {
        st = cuma_fail(CUMA_ERR_CONFIG,
                       "memory_fraction %g of the device's %" PRIu64 " bytes is less than one page "
                       "(%" PRIu64 ")",
                       h->set.memory_fraction, h->be->capacity, h->be->page_size);
        goto fail_be;
    }
    st = join ? join(h) : CUMA_OK;
    if (st) goto fail_be;
    if (h->set.trace[0]) {
        bool tcache = h->set.tcache;
        h->set.tcache = false; /* every call takes the lock: the log sees them all, in order */
        /* The stats name the file really written (a pattern's %p and %d filled in, or a
         * numbered name when the file was taken). */
        st = cuma_trace_writer_open(h->set.trace, h->set.device, h->set.trace, sizeof h->set.trace,
                                    &h->tw);
        if (st == CUMA_ERR_CONFIG) goto fail_be;
        if (st) {
            /* A file that cannot or must not be written (a planted link, a FIFO, another
             * user's file) costs the log, not the job: said on stderr and in the stats. */
            snprintf(h->trace_error, sizeof h->trace_error, "%s", cuma_last_error());
            fprintf(stderr, "cuma: %s; the heap runs without the log\n", h->trace_error);
            h->set.trace[0] = 0;
            h->set.tcache = tcache;
            st = CUMA_OK;
        }
        if (h->tw && h->set.trace_stacks && cuma_trace_writer_keep_stacks(h->tw)) {
            fprintf(stderr, "cuma: %s; the log goes on without the stacks\n", cuma_last_error());
            cuma_clear_error();
            h->set.trace_stacks = false;
        }
    }
    if (!h->tw) h->set.trace_stacks = false;
    /* sim_lag_ms and sim_call_us count on the heap's time; the sim may be under the ledger's
     * wrapper by now. */
    if (h->set.sim_clock_manual && h->be->kind == CUMA_BACKEND_SIM)
        cuma_simbe_set_clock(cuma_backend_unwrap(h->be), &h->first.manual_now);
    /* Preallocated pages are the first arena's and never move: another arena could not
     * create a page within the limit they take. Such a heap keeps one arena. */
    if (h->set.preallocate) h->set.arenas = 1;
    const cuma_phys_ops *phys = cuma_phys_choose(h->be);
    if (h->set.arenas > 1 && phys && (phys->caps & CUMA_PHYS_RANGE)) {
        /* Arenas share the backend: its calls go through one mutex from the start. */
        cuma_backend *shared;
        st = cuma_backend_locked(h->be, &shared);
        if (st) goto fail_be;
        h->be = shared;
    }
    h->first.heap = h;
    h->first.be = h->be;
    h->arenas[0] = &h->first;
    atomic_store(&h->narenas, 1);
    cuma_map_init(&h->managed);
    pthread_mutex_init(&h->arena_lock, NULL);
    pthread_mutex_init(&h->oom_lock, NULL);
    pthread_mutex_init(&h->oom_run, NULL);
    pthread_cond_init(&h->cb_done, NULL);
    pthread_mutex_init(&h->compact_run, NULL);
    pthread_mutex_init(&h->managed_lock, NULL);
    pthread_mutex_init(&h->pool_lock, NULL);
    st = cuma_arena_build(&h->first);
    if (st) {
        pthread_mutex_destroy(&h->arena_lock);
        pthread_mutex_destroy(&h->oom_lock);
        pthread_mutex_destroy(&h->oom_run);
        pthread_cond_destroy(&h->cb_done);
        pthread_mutex_destroy(&h->compact_run);
        pthread_mutex_destroy(&h->managed_lock);
        pthread_mutex_destroy(&h->pool_lock);
        cuma_map_destroy(&h->managed);
        goto fail_be;
    }
    /* From now on its release thread answers the others: they may count on its cache. */
    if (h->peers.ops && h->first.thread_running) h->peers.ops->publish(h->peers.ctx, h);
    cuma_fork_track(h);
    *out = h;
    return CUMA_OK;
fail_be:;
    /* The backend's teardown leaves the ledger, which clears the message for its own steps. */
    cuma_error_saved why;
    cuma_error_save(&why);
    cuma_trace_writer_close(h->tw);
    h->be->ops->destroy(h->be);
    cuma_error_restore(&why);
fail_free:
    free(h);
    return st;
}

static bool free_managed(void *ctx, uint64_t key, void *val) {
    cuma_heap *h = ctx;
    h->be->ops->managed_free(h->be, key, (uint64_t)(uintptr_t)val);
    return true;
}

void cuma_heap_destroy(cuma_heap *h) {
    if (!h) return;
    cuma_fork_untrack(h);
    cuma_pools_destroy_all(h); /* host side only: the carves go with the arenas below */
    /* Every release thread first: each reads all arenas' figures (max_cached is the heap's),
     * so none may run while an arena is freed. */
    for (unsigned i = atomic_load(&h->narenas); i-- > 0;) stop_thread(h->arenas[i]);
    /* The other arenas first: their pages count against the first arena's page counter. */
    for (unsigned i = atomic_load(&h->narenas); i-- > 1;) {
        cuma_arena_teardown(h->arenas[i]);
        free(h->arenas[i]);
    }
    cuma_map_each(&h->managed, free_managed, h);
    cuma_map_destroy(&h->managed);
    cuma_arena_teardown(&h->first);
    h->be->ops->destroy(h->be);
    pthread_mutex_destroy(&h->arena_lock);
    pthread_mutex_destroy(&h->oom_lock);
    pthread_mutex_destroy(&h->oom_run);
    pthread_cond_destroy(&h->cb_done);
    pthread_mutex_destroy(&h->compact_run);
    pthread_mutex_destroy(&h->managed_lock);
    pthread_mutex_destroy(&h->pool_lock);
    cuma_trace_writer_close(h->tw);
    free(h);
}
