// SPDX-License-Identifier: Apache-2.0
/* Statistics: one snapshot struct and its JSON form. */
#include "util/error.h"
#include "util/strbuf.h"
#include "heap/heap.h"
/* Only the public entry type: the list's table says where a reader of cuma_ledger_entry finds each
 * ledger figure. The ledger itself is reached through peers.h. */
#include "cuma/ledger.h"

#include <stdarg.h>
#include <stddef.h>
#include <stdio.h>
#include <string.h>

void cuma_arena_memory(cuma_arena *a, uint64_t *reserved, uint64_t *cached, uint64_t *mapped) {
    *reserved = cuma_arena_reserved(a);
    *cached = cuma_arena_cached(a);
    *mapped = *reserved - *cached; /* pages: nreserved = nmapped + ncached */
    /* What the thread caches' blocks alone keep mapped is what a flush gives back: cached, not
     * in use (a block freed into a cache used to count as in use until its age sent it back). */
    uint64_t tc = a->tcaches ? cuma_tcache_idle_bytes(a) : 0;
    if (tc > *mapped) tc = *mapped;
    int64_t tq, ta, tn;
    uint64_t tallocs, tfrees;
    cuma_tcache_sums(a, &tq, &ta, &tn, &tallocs, &tfrees);
    atomic_store_explicit(&a->pub[CUMA_PUB_TREQ], tq, memory_order_relaxed);
    *cached += tc;
    *mapped -= tc;
    atomic_store_explicit(&a->pub[CUMA_PUB_TCACHED], (int64_t)tc, memory_order_relaxed);
}

/* Adds one arena's figures into s (the arena's lock held). */
static void add_arena(cuma_arena *a, cuma_stats *s) {
    const cuma_counters *c = &a->c;
    int64_t tq, ta, tn;
    uint64_t tallocs, tfrees;
    cuma_tcache_sums(a, &tq, &ta, &tn, &tallocs, &tfrees);
    s->requested_bytes += c->requested + (uint64_t)tq;
    s->allocated_bytes += c->allocated + (uint64_t)ta;
    uint64_t reserved, cached, mapped;
    cuma_arena_memory(a, &reserved, &cached, &mapped);
    s->reserved_bytes += reserved;
    s->cached_bytes += cached;
    s->mapped_bytes += mapped;
    s->virtual_bytes += a->va_size;
    s->active_allocs += c->active + (uint64_t)tn;
    s->num_allocs += c->allocs + tallocs;
    s->num_frees += c->frees + tfrees;
    s->failed_allocs += c->failed;
    s->alloc_retries += c->retries;
    s->ooms += c->ooms;
    s->oom_callbacks += c->oom_calls;
    uint64_t creates, releases;
    a->phys.ops->counts(a, &creates, &releases);
    s->page_creates += creates;
    s->page_releases += releases;
    s->maps += a->pages.maps;
    s->unmaps += a->pages.unmaps;
    s->map_runs += a->pages.map_runs;
    s->unmap_runs += a->pages.unmap_runs;
    s->page_call_ns += a->pages.call_ns;
    if (a->pages.keep > s->remap_keep) s->remap_keep = a->pages.keep;
    s->early_remaps += a->pages.early_remaps;
    s->remap_waits += a->pages.remap_waits;
    s->events_recorded += a->streams.events_recorded;
    s->event_queries += a->streams.event_queries;
    s->stream_waits += a->streams.stream_waits;
    s->trims += c->trims;
    s->watermark_released_bytes += c->watermark_bytes;
}

/* The whole heap: every arena in turn (one lock at a time), then what the heap keeps for all of
 * them (managed fallbacks, pools, compactions, peaks), each once. */
void cuma_heap_snapshot(cuma_heap *h, cuma_stats *s) {
    memset(s, 0, sizeof *s);
    unsigned n = atomic_load_explicit(&h->narenas, memory_order_acquire);
    for (unsigned i = 0; i < n; i++) {
        cuma_arena *a = h->arenas[i];
        cuma_mutex_lock(&a->lock, CUMA_RANK_ARENA);
        add_arena(a, s);
        if (!i) s->limit_bytes = a->limit_bytes;
        cuma_mutex_unlock(&a->lock);
    }
    cuma_mutex_lock(&h->managed_lock, CUMA_RANK_MANAGED);
    s->managed_bytes = h->managed_bytes;
    s->managed_fallbacks = h->managed_fallbacks;
    cuma_mutex_unlock(&h->managed_lock);
    s->arenas = n;
    s->pools = atomic_load(&h->pool_count);
    s->pool_bytes = atomic_load(&h->pool_bytes);
    s->pool_blocks = atomic_load(&h->pool_blocks);
    s->pool_blocks_in_use = atomic_load(&h->pool_in_use);
    s->compactions = atomic_load(&h->compactions);
    s->compact_moved_bytes = atomic_load(&h->compact_moved);
    s->compact_freed_pages = atomic_load(&h->compact_freed);
    s->page_size = h->be->page_size; /* the pages' size too (cuma_pages_init) */
    s->peak_requested_bytes = atomic_load(&h->peak_req);
    if (s->peak_requested_bytes < s->requested_bytes) s->peak_requested_bytes = s->requested_bytes;
    s->peak_allocated_bytes = atomic_load(&h->peak_alloc);
    if (s->peak_allocated_bytes < s->allocated_bytes) s->peak_allocated_bytes = s->allocated_bytes;
    s->peak_reserved_bytes = atomic_load(&h->peak_res);
    if (s->peak_reserved_bytes < s->reserved_bytes) s->peak_reserved_bytes = s->reserved_bytes;
    /* Requested bytes exceed mapped ones only in a moment between two arenas' counts. */
    s->stranded_bytes =
        s->mapped_bytes > s->requested_bytes ? s->mapped_bytes - s->requested_bytes : 0;
    s->fragmentation = s->mapped_bytes ? (double)s->stranded_bytes / (double)s->mapped_bytes : 0.0;
}

static void get_stats(cuma_heap *h, cuma_stats *out) {
    cuma_heap_snapshot(h, out);
    out->ledger_room_bytes = UINT64_MAX;
    if (h->peers.ops) h->peers.ops->stats(h->peers.ctx, out);
    /* The driver's view is read outside the locks: it may be slow and needs no heap state. */
    uint64_t fr = 0, tot = 0;
    if (h->be->ops->mem_info(h->be, &fr, &tot) == CUMA_OK)
        out->device_free_bytes = fr, out->device_total_bytes = tot;
}

cuma_status cuma_get_stats_sized(cuma_heap *h, cuma_stats *out, size_t size) {
    if (!h || !out)
        return cuma_fail(CUMA_ERR_INVALID, "cuma_get_stats: %s is NULL", h ? "out" : "heap");
    if (!size || size % sizeof(uint64_t))
        return cuma_fail(CUMA_ERR_INVALID,
                         "cuma_get_stats: size %zu is not a whole number of figures (8 bytes "
                         "each; this library's struct is %zu)",
                         size, sizeof(cuma_stats));
    if (size == sizeof(cuma_stats)) {
        get_stats(h, out);
        return CUMA_OK;
    }
    cuma_stats all;
    get_stats(h, &all);
    size_t n = size < sizeof all ? size : sizeof all;
    memcpy(out, &all, n);
    memset((char *)out + n, 0xff, size - n); /* figures of a newer header: unknown here */
    return CUMA_OK;
}

/* The figures of cuma_stats when the size was first passed: what a program built before then
 * has room for (at most; one built before stream_waits has a figure less). Never grows. */
#define UNSIZED_FIGURES 52

/* In parentheses: the name is also cuma.h's macro, which passes the size. */
cuma_status(cuma_get_stats)(cuma_heap *h, cuma_stats *out) {
    _Static_assert(sizeof(cuma_stats) >= UNSIZED_FIGURES * sizeof(uint64_t),
                   "figures are only added to cuma_stats");
    return cuma_get_stats_sized(h, out, UNSIZED_FIGURES * sizeof(uint64_t));
}

cuma_status cuma_reset_peaks(cuma_heap *h) {
    if (!h) return cuma_fail(CUMA_ERR_INVALID, "cuma_reset_peaks: heap is NULL");
    cuma_stats s;
    cuma_heap_snapshot(h, &s);
    atomic_store(&h->peak_req, s.requested_bytes);
    atomic_store(&h->peak_alloc, s.allocated_bytes);
    atomic_store(&h->peak_res, s.reserved_bytes);
    return CUMA_OK;
}

#define ULL(v) ((unsigned long long)(v))

/* The list (cuma.h) at run time. A ledger figure's word says where the slot keeps it, its
 * cuma_ledger_entry field of the same name where a reader finds it. */
#define FIELD(type, name, kind, where, help)                                                       \
    {#name,                                                                                        \
     help,                                                                                         \
     kind,                                                                                         \
     _Generic(((cuma_stats *)0)->name, double : 1u, default : 0u),                                 \
     offsetof(cuma_stats, name),                                                                   \
     CUMA_STAT_WORD(where) < 0                                                                     \
         ? SIZE_MAX                                                                                \
         : CUMA_STAT_IF_LEDGER(where, offsetof(cuma_ledger_entry, name)) + 0,                      \
     CUMA_STAT_WORD(where),                                                                        \
     CUMA_STAT_SHOWN(where)},
static const cuma_stat_field fields[] = {CUMA_STATS_FIELDS(FIELD)};
#undef FIELD

const cuma_stat_field *cuma_stat_fields(size_t *n) {
    if (n) *n = sizeof fields / sizeof fields[0];
    return fields;
}

cuma_status cuma_stats_json(cuma_heap *h, char *buf, size_t len, size_t *needed) {
    if (!h) return cuma_fail(CUMA_ERR_INVALID, "cuma_stats_json: heap is NULL");
    cuma_stats s;
    cuma_get_stats(h, &s);
    cuma_strbuf o = {buf, len, 0};
    if (buf && len) buf[0] = 0;
    cuma_strbuf_put(
        &o,
        "{\"version\":\"%d.%d.%d\",\"mode\":\"%s\",\"backend\":\"%s\",\"backend_fallback\":%s,"
        "\"page_alias\":%s,\"device\":\"%s\",\"policy\":\"%s\",",
        CUMA_VERSION_MAJOR, CUMA_VERSION_MINOR, CUMA_VERSION_PATCH, h->first.phys.ops->name,
        h->be->name, h->backend_fallback ? "true" : "false",
        (h->be->caps & CUMA_CAP_ALIAS) ? "true" : "false", h->be->device_id,
        h->first.pol->ops->name);
    for (size_t i = 0; i < sizeof fields / sizeof fields[0]; i++) {
        const char *at = (const char *)&s + fields[i].offset;
        if (fields[i].is_double) {
            cuma_strbuf_put(&o, "\"%s\":%.6f,", fields[i].name, *(const double *)at);
        } else {
            uint64_t v = *(const uint64_t *)at;
            if (v != UINT64_MAX) cuma_strbuf_put(&o, "\"%s\":%llu,", fields[i].name, ULL(v));
        }
    }
    if (h->peers.ops)
        h->peers.ops->json(h->peers.ctx, &o);
    else
        cuma_strbuf_put(&o, "\"ledger\":null,");
    if (h->ledger_error[0]) {
        cuma_strbuf_put(&o, "\"ledger_error\":");
        cuma_strbuf_json_string(&o, h->ledger_error);
        cuma_strbuf_put(&o, ",");
    }
    if (h->trace_error[0]) {
        cuma_strbuf_put(&o, "\"trace_error\":");
        cuma_strbuf_json_string(&o, h->trace_error);
        cuma_strbuf_put(&o, ",");
    }
    cuma_strbuf_put(&o, "\"config\":{");
    size_t room = cuma_strbuf_room(&o);
    o.used += cuma_settings_json(&h->set, room ? o.buf + o.used : NULL, room);
    cuma_strbuf_put(&o, "}}");
    if (needed) *needed = o.used;
    if (!buf || o.used >= len)
        return cuma_fail(CUMA_ERR_INVALID,
                         "cuma_stats_json: buffer of %zu bytes too small, %zu needed", len,
                         o.used + 1);
    return CUMA_OK;
}
