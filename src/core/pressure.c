// SPDX-License-Identifier: Apache-2.0
/* The heap's side of the cross-process ledger (src/coord): joining it at creation, asking the
 * other heaps for memory on the out-of-memory ladder, answering their requests from the release
 * thread, and the pressure callbacks. */
#include "coord/ledger_backend.h"
#include "error.h"
#include "heap.h"
#include "marks.h"

#include <stdio.h>
#include <string.h>

cuma_status cuma_heap_join_ledger(cuma_heap *h) {
    const char *want = h->set.ledger;
    bool explicit_ = strcmp(want, "auto") != 0;
    if (!strcmp(want, "off")) return CUMA_OK;
    /* auto: the CUDA devices, which processes really share; a simulated device is each
     * process's own unless a ledger is named for a group of them. */
    if (!explicit_ && h->be->kind == CUMA_BACKEND_SIM) return CUMA_OK;
    /* A priority or guarantee only means something in the ledger: asking for one makes it
     * required; otherwise a ledger that cannot be opened (no /dev/shm in a sandbox) leaves the
     * heap on its own, with the reason in the stats. */
    bool required = explicit_ || h->set.priority || h->set.guarantee;
    if (!explicit_ && (h->set.priority || h->set.guarantee) && h->be->kind == CUMA_BACKEND_SIM)
        return cuma_fail(CUMA_ERR_CONFIG,
                         "%s needs a ledger, and a simulated device is in none unless one is "
                         "named: add ledger:NAME",
                         h->set.priority ? "priority" : "guarantee");
    if (h->set.guarantee > h->be->capacity)
        return cuma_fail(CUMA_ERR_CONFIG, "guarantee: %llu bytes, more than the device's %llu",
                         (unsigned long long)h->set.guarantee, (unsigned long long)h->be->capacity);
    if (h->set.guarantee && h->set.limit != CUMA_UNLIMITED && h->set.guarantee > h->set.limit)
        return cuma_fail(CUMA_ERR_CONFIG, "guarantee: %llu bytes, more than the limit of %llu",
                         (unsigned long long)h->set.guarantee, (unsigned long long)h->set.limit);
    cuma_ledger_join_info in = {
        .name = explicit_ ? want : "on",
        .device = h->be->device_id,
        .backend = cuma_backend_unwrap(h->be)->name,
        .capacity = h->be->capacity,
        .guarantee = h->set.guarantee,
        .limit = h->set.limit == CUMA_UNLIMITED ? 0 : h->set.limit,
        .priority = h->set.priority,
    };
    cuma_ledger *l;
    cuma_status st = cuma_ledger_join(&in, &l);
    if (st) {
        if (required) return st;
        snprintf(h->ledger_error, sizeof h->ledger_error, "%s", cuma_last_error());
        cuma_clear_error();
        return CUMA_OK;
    }
    cuma_backend *wrapped;
    st = cuma_backend_ledger(h->be, l, &wrapped);
    if (st) {
        cuma_ledger_leave(l);
        return st;
    }
    h->be = wrapped;
    h->ledger = l;
    return CUMA_OK;
}

static uint64_t device_free(void *ctx) {
    cuma_backend *be = ctx;
    uint64_t fr = 0, total = 0;
    if (be->ops->mem_info(be, &fr, &total)) return UINT64_MAX; /* unknown: the ledger decides */
    return fr;
}

bool cuma_heap_ledger_reclaim(cuma_arena *a, uint64_t n) {
    cuma_heap *h = a->heap;
    if (!h->ledger || h->set.pressure_timeout_ms <= 0) return false;
    uint64_t need = a->phys.ops->growth(a, n);
    /* What the ledger cannot see (other programs on a real GPU) shows in the driver's figure;
     * a simulated device's is the process's own and would mislead. */
    bool real = h->be->kind != CUMA_BACKEND_SIM;
    /* The attempt that failed left the pages it made idle in the cache: they count as held. */
    cuma_heap_release_idle(a, 0);
    pthread_mutex_unlock(&a->lock);
    cuma_status st = cuma_ledger_reclaim(h->ledger, need, h->set.pressure_timeout_ms,
                                         real ? device_free : NULL, h->be);
    pthread_mutex_lock(&a->lock);
    return st == CUMA_OK;
}

/* Every arena's idle memory back to the device (no lock held; each release publishes what is
 * left idle); the bytes that went. */
static uint64_t give_cache(cuma_heap *h) {
    uint64_t before = cuma_backend_ledger_held(h->be);
    cuma_heap_release_all(h, 0, false);
    uint64_t after = cuma_backend_ledger_held(h->be);
    return before > after ? before - after : 0;
}

void cuma_heap_ledger_publish(cuma_heap *h) {
    pthread_mutex_lock(&h->oom_lock);
    unsigned answers = CUMA_LEDGER_ANSWERS_CACHE | (h->pressure.n ? CUMA_LEDGER_ANSWERS_SHRINK : 0);
    pthread_mutex_unlock(&h->oom_lock);
    cuma_ledger_publish(h->ledger, cuma_heap_idle_total(h), cuma_heap_requested_total(h), answers);
}

/* The allocator figures for `cuma stats` and the other tools (no lock held: the snapshot takes
 * each arena's in turn). */
static void publish_stats(cuma_heap *h) {
    cuma_stats s;
    cuma_heap_snapshot(h, &s);
    cuma_ledger_publish_stats(h->ledger, &s);
}

void cuma_heap_ledger_poll(cuma_arena *a) {
    cuma_heap *h = a->heap;
    cuma_ledger *l = h->ledger;
    /* The release thread runs on a real clock only (never sim_clock:manual). */
    uint64_t now = cuma_heap_now(a);
    if (now >= h->stats_due) {
        h->stats_due = now + CUMA_LEDGER_STATS_NS;
        pthread_mutex_unlock(&a->lock);
        publish_stats(h);
        pthread_mutex_lock(&a->lock);
    }
    /* The first arena's idle bytes as of now (its lock is held): frees since its last release
     * policy run count, so that requesters see what they may ask for. */
    atomic_store_explicit(&a->pub[CUMA_PUB_CACHED], (int64_t)cuma_heap_cached(a),
                          memory_order_relaxed);
    uint64_t reserved, cached, mapped;
    cuma_heap_memory(a, &reserved, &cached, &mapped); /* and its thread caches' blocks */
    cuma_heap_ledger_publish(h);
    bool cache, fresh;
    uint64_t shrink;
    if (!cuma_ledger_asked(l, &cache, &shrink, &fresh)) return;
    pthread_mutex_unlock(&a->lock);
    cuma_mark_push(h->set.nvtx, CUMA_MARK_LEDGER_ANSWER);
    uint64_t gave = 0, calls = 0;
    if (cache) {
        /* Idle memory first, thread caches' pending frees included; then what is still in use
         * beyond the guarantee is what the callbacks are asked for (a request that came
         * meanwhile is as new as the first). */
        gave = give_cache(h);
        cuma_heap_ledger_publish(h);
        bool again = false;
        if (!cuma_ledger_asked(l, &cache, &shrink, &again)) shrink = 0;
        fresh |= again;
    }
    if (shrink && fresh) {
        pthread_mutex_lock(&h->oom_lock);
        cuma_cb_slot cbs[CUMA_MAX_OOM_CALLBACKS];
        int n = h->pressure.n;
        memcpy(cbs, h->pressure.s, sizeof cbs);
        pthread_mutex_unlock(&h->oom_lock);
        for (int i = 0; i < n; i++, calls++) ((cuma_pressure_fn)cbs[i].fn)(cbs[i].user, h, shrink);
        /* What the callbacks freed may sit in thread caches and the page cache: it goes too. */
        if (n) gave += give_cache(h);
    }
    cuma_heap_ledger_publish(h);
    cuma_ledger_gave(l, gave, calls);
    cuma_mark_pop(h->set.nvtx);
    pthread_mutex_lock(&a->lock);
}

cuma_status cuma_add_pressure_callback(cuma_heap *h, cuma_pressure_fn fn, void *user, int *id) {
    cuma_status st = cuma_cb_add(h, h ? &h->pressure : NULL, (cuma_any_fn)fn, user, id,
                                 "cuma_add_pressure_callback");
    if (!st && h->ledger && h->first.thread_running)
        cuma_heap_ledger_publish(h); /* it can shrink now */
    return st;
}

cuma_status cuma_remove_pressure_callback(cuma_heap *h, int id) {
    cuma_status st =
        cuma_cb_remove(h, h ? &h->pressure : NULL, id, "cuma_remove_pressure_callback");
    if (!st && h->ledger && h->first.thread_running) cuma_heap_ledger_publish(h);
    return st;
}
