// SPDX-License-Identifier: Apache-2.0
/* The ledger as the heap's peers (heap/peers.h): joining it at creation (cuma_heap_create),
 * asking the other heaps for memory on the out-of-memory ladder, answering their requests from
 * the release thread, the ledger's figures in the stats and the pressure callbacks. The heap
 * calls these through h->peers only. */
#include "pressure.h"

#include "util/error.h"
#include "heap/heap.h"
#include "util/marks.h"
#include "ledger_backend.h"

#include <stdio.h>
#include <string.h>

static const cuma_peers_ops ledger_peers;

static cuma_status join(cuma_heap *h) {
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
    h->peers.ops = &ledger_peers;
    h->peers.ctx = l;
    return CUMA_OK;
}

cuma_status cuma_heap_create(const cuma_config *cfg, cuma_heap **out) {
    return cuma_heap_create_with(cfg, join, out);
}

cuma_ledger *cuma_heap_ledger(const cuma_heap *h) {
    return h->peers.ops == &ledger_peers ? h->peers.ctx : NULL;
}

static uint64_t device_free(void *ctx) {
    cuma_backend *be = ctx;
    uint64_t fr = 0, total = 0;
    if (be->ops->mem_info(be, &fr, &total)) return UINT64_MAX; /* unknown: the ledger decides */
    return fr;
}

static bool ask(void *ctx, cuma_heap *h, uint64_t bytes) {
    /* What the ledger cannot see (other programs on a real GPU) shows in the driver's figure;
     * a simulated device's is the process's own and would mislead. */
    bool real = h->be->kind != CUMA_BACKEND_SIM;
    return cuma_ledger_reclaim(ctx, bytes, h->set.pressure_timeout_ms, real ? device_free : NULL,
                               h->be) == CUMA_OK;
}

/* Every arena's idle memory back to the device (no lock held; each release publishes what is
 * left idle); the bytes that went. */
static uint64_t give_cache(cuma_heap *h) {
    uint64_t before = cuma_backend_ledger_held(h->be);
    cuma_heap_release_all(h, 0, false);
    uint64_t after = cuma_backend_ledger_held(h->be);
    return before > after ? before - after : 0;
}

/* The heap's figures into its slot, and what it answers with (any lock or none but oom_lock). */
static void publish(cuma_heap *h) {
    cuma_mutex_lock(&h->oom_lock, CUMA_RANK_OOM);
    unsigned answers = CUMA_LEDGER_ANSWERS_CACHE | (h->pressure.n ? CUMA_LEDGER_ANSWERS_SHRINK : 0);
    cuma_mutex_unlock(&h->oom_lock);
    cuma_ledger_publish(cuma_heap_ledger(h), cuma_heap_idle_total(h), cuma_heap_requested_total(h),
                        answers);
}

/* The allocator figures for `cuma stats` and the other tools (no lock held: the snapshot takes
 * each arena's in turn). */
static void publish_stats(cuma_heap *h) {
    cuma_stats s;
    cuma_heap_snapshot(h, &s);
    cuma_ledger_publish_stats(cuma_heap_ledger(h), &s);
}

void cuma_heap_ledger_poll(cuma_heap *h) {
    cuma_arena *a = &h->first;
    cuma_ledger *l = cuma_heap_ledger(h);
    /* The release thread runs on a real clock only (never sim_clock:manual). */
    uint64_t now = cuma_arena_now(a);
    if (now >= h->stats_due) {
        h->stats_due = now + CUMA_LEDGER_STATS_NS;
        cuma_mutex_unlock(&a->lock);
        publish_stats(h);
        cuma_mutex_lock(&a->lock, CUMA_RANK_ARENA);
    }
    /* The first arena's idle bytes as of now (its lock is held): frees since its last release
     * policy run count, so that requesters see what they may ask for. */
    atomic_store_explicit(&a->pub[CUMA_PUB_CACHED], (int64_t)cuma_arena_cached(a),
                          memory_order_relaxed);
    uint64_t reserved, cached, mapped;
    cuma_arena_memory(a, &reserved, &cached, &mapped); /* and its thread caches' blocks */
    publish(h);
    bool cache, fresh;
    uint64_t shrink;
    if (!cuma_ledger_asked(l, &cache, &shrink, &fresh)) return;
    cuma_mutex_unlock(&a->lock);
    cuma_mark_push(h->set.nvtx, CUMA_MARK_LEDGER_ANSWER);
    uint64_t gave = 0, calls = 0;
    if (cache) {
        /* Idle memory first, thread caches' pending frees included; then what is still in use
         * beyond the guarantee is what the callbacks are asked for (a request that came
         * meanwhile is as new as the first). */
        gave = give_cache(h);
        publish(h);
        bool again = false;
        if (!cuma_ledger_asked(l, &cache, &shrink, &again)) shrink = 0;
        fresh |= again;
    }
    if (shrink && fresh) {
        cuma_cb_slot cbs[CUMA_MAX_OOM_CALLBACKS];
        cuma_cb_run run;
        int n = cuma_cb_run_begin(h, &h->pressure, cbs, &run);
        for (int i = 0; i < n; i++, calls++) ((cuma_pressure_fn)cbs[i].fn)(cbs[i].user, h, shrink);
        cuma_cb_run_end(h, &run);
        /* What the callbacks freed may sit in thread caches and the page cache: it goes too. */
        if (n) gave += give_cache(h);
    }
    publish(h);
    cuma_ledger_gave(l, gave, calls);
    cuma_mark_pop(h->set.nvtx);
    cuma_mutex_lock(&a->lock, CUMA_RANK_ARENA);
}

cuma_status cuma_add_pressure_callback(cuma_heap *h, cuma_pressure_fn fn, void *user, int *id) {
    cuma_status st = cuma_cb_add(h, h ? &h->pressure : NULL, (cuma_any_fn)fn, user, id,
                                 "cuma_add_pressure_callback");
    if (!st && cuma_heap_ledger(h) && h->first.thread_running) publish(h); /* it can shrink now */
    return st;
}

cuma_status cuma_remove_pressure_callback(cuma_heap *h, int id) {
    cuma_status st =
        cuma_cb_remove(h, h ? &h->pressure : NULL, id, "cuma_remove_pressure_callback");
    if (!st && cuma_heap_ledger(h) && h->first.thread_running) publish(h);
    return st;
}

static void poll_op(void *ctx, cuma_heap *h) {
    (void)ctx;
    cuma_heap_ledger_poll(h);
}

static void publish_op(void *ctx, cuma_heap *h) {
    (void)ctx;
    publish(h);
}

static void set_limit(void *ctx, uint64_t limit) {
    cuma_ledger_set_limit(ctx, limit);
}

static void stats(void *ctx, cuma_stats *out) {
    out->ledger_room_bytes = cuma_ledger_room(ctx);
    cuma_ledger_entry e;
    cuma_ledger_self(ctx, &e);
    out->ledger_denials = e.ledger_denials;
    out->pressure_asks = e.pressure_asks;
    out->pressure_given_bytes = e.pressure_given_bytes;
    out->pressure_callbacks = e.pressure_callbacks;
}

static void json(void *ctx, cuma_strbuf *o) {
    cuma_ledger *l = ctx;
    cuma_ledger_entry e;
    cuma_ledger_self(l, &e);
    cuma_strbuf_put(o, "\"ledger\":{\"path\":");
    cuma_strbuf_json_string(o, cuma_ledger_where(l));
    uint64_t stale, damaged;
    char problem[320];
    cuma_ledger_health(l, &stale, &damaged, problem, sizeof problem);
    cuma_strbuf_put(o,
                    ",\"slot\":%u,\"priority\":%d,\"guarantee\":%llu,\"stale_admissions\":%llu,"
                    "\"damaged_denials\":%llu,\"problem\":",
                    e.slot, e.priority, (unsigned long long)e.guarantee, (unsigned long long)stale,
                    (unsigned long long)damaged);
    if (problem[0])
        cuma_strbuf_json_string(o, problem);
    else
        cuma_strbuf_put(o, "null");
    if (*cuma_ledger_note(l)) {
        cuma_strbuf_put(o, ",\"notice\":");
        cuma_strbuf_json_string(o, cuma_ledger_note(l));
    }
    cuma_strbuf_put(o, "},");
}

static const char *validate(void *ctx, cuma_heap *h) {
    uint64_t held = 0;
    /* Oversubscribed memory (backend:managed) is not the device's: the ledger admits none. */
    if (!(h->be->caps & CUMA_CAP_OVERSUBSCRIBE))
        for (unsigned i = 0, n = atomic_load(&h->narenas); i < n; i++)
            held += cuma_arena_reserved(h->arenas[i]);
    if (held != cuma_backend_ledger_held(h->be))
        return "the bytes the ledger admitted differ from the arenas' reserved bytes";
    if (cuma_ledger_validate(ctx, held)) {
        /* The message is formatted into the thread's error text again: copy it first. */
        static _Thread_local char why[256];
        snprintf(why, sizeof why, "%s", cuma_last_error());
        return why;
    }
    return NULL;
}

static const cuma_peers_ops ledger_peers = {
    .ask = ask,
    .poll = poll_op,
    .publish = publish_op,
    .set_limit = set_limit,
    .stats = stats,
    .json = json,
    .validate = validate,
};
