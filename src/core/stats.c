/* Statistics: one snapshot struct and its JSON form. */
#include "error.h"
#include "strbuf.h"
#include "heap.h"

#include <stdarg.h>
#include <stdio.h>
#include <string.h>

static void snapshot(cuma_heap *h, cuma_stats *s) {
    const cuma_counters *c = &h->c;
    int64_t tq, ta, tn;
    uint64_t tallocs, tfrees;
    cuma_tcache_sums(h, &tq, &ta, &tn, &tallocs, &tfrees);
    uint64_t ps = h->vmm ? h->pages.page_size : h->be->page_size;
    memset(s, 0, sizeof *s);
    s->requested_bytes = c->requested + (uint64_t)tq;
    s->peak_requested_bytes = atomic_load(&h->peak_req);
    if (s->peak_requested_bytes < s->requested_bytes) s->peak_requested_bytes = s->requested_bytes;
    s->allocated_bytes = c->allocated + (uint64_t)ta;
    s->peak_allocated_bytes =
        c->peak_allocated > s->allocated_bytes ? c->peak_allocated : s->allocated_bytes;
    s->reserved_bytes = cuma_heap_reserved(h);
    s->peak_reserved_bytes =
        c->peak_reserved > s->reserved_bytes ? c->peak_reserved : s->reserved_bytes;
    s->cached_bytes = cuma_heap_cached(h);
    s->mapped_bytes = h->vmm ? h->pages.nmapped * ps : s->reserved_bytes - s->cached_bytes;
    s->managed_bytes = c->managed;
    s->virtual_bytes = h->va_size;
    s->limit_bytes = h->limit_bytes;
    s->page_size = ps;
    s->active_allocs = c->active + (uint64_t)tn;
    s->num_allocs = c->allocs + tallocs;
    s->num_frees = c->frees + tfrees;
    s->failed_allocs = c->failed;
    s->num_alloc_retries = c->retries;
    s->num_ooms = c->ooms;
    s->oom_callbacks = c->oom_calls;
    s->managed_fallbacks = c->managed_fallbacks;
    s->page_creates = h->vmm ? h->pages.creates : h->segs.creates;
    s->page_releases = h->vmm ? h->pages.releases : h->segs.releases;
    s->maps = h->pages.maps;
    s->unmaps = h->pages.unmaps;
    s->events_recorded = h->streams.events_recorded;
    s->trims = c->trims;
    s->fragmentation =
        s->mapped_bytes ? 1.0 - (double)s->requested_bytes / (double)s->mapped_bytes : 0.0;
    if (s->fragmentation < 0) s->fragmentation = 0;
}

cuma_status cuma_get_stats(cuma_heap *h, cuma_stats *out) {
    if (!h || !out)
        return cuma_fail(CUMA_ERR_INVALID, "cuma_get_stats: %s is NULL", h ? "out" : "heap");
    pthread_mutex_lock(&h->lock);
    snapshot(h, out);
    pthread_mutex_unlock(&h->lock);
    /* The driver's view is read outside the lock: it may be slow and needs no heap state. */
    uint64_t fr = 0, tot = 0;
    if (h->be->ops->mem_info(h->be, &fr, &tot) == CUMA_OK)
        out->device_free_bytes = fr, out->device_total_bytes = tot;
    return CUMA_OK;
}

cuma_status cuma_reset_peaks(cuma_heap *h) {
    if (!h) return cuma_fail(CUMA_ERR_INVALID, "cuma_reset_peaks: heap is NULL");
    pthread_mutex_lock(&h->lock);
    cuma_stats s;
    snapshot(h, &s);
    atomic_store(&h->peak_req, s.requested_bytes);
    h->c.peak_allocated = s.allocated_bytes;
    h->c.peak_reserved = cuma_heap_reserved(h);
    pthread_mutex_unlock(&h->lock);
    return CUMA_OK;
}

cuma_status cuma_stats_json(cuma_heap *h, char *buf, size_t len, size_t *needed) {
    if (!h) return cuma_fail(CUMA_ERR_INVALID, "cuma_stats_json: heap is NULL");
    cuma_stats s;
    cuma_get_stats(h, &s);
    cuma_strbuf o = {buf, len, 0};
    if (buf && len) buf[0] = 0;
#define U(name) cuma_strbuf_put(&o, "\"" #name "\":%llu,", (unsigned long long)s.name)
    cuma_strbuf_put(
        &o,
        "{\"version\":\"%d.%d.%d\",\"mode\":\"%s\",\"backend\":\"%s\",\"backend_fallback\":%s,"
        "\"device\":\"%s\",\"policy\":\"%s\",",
        CUMA_VERSION_MAJOR, CUMA_VERSION_MINOR, CUMA_VERSION_PATCH, h->vmm ? "pages" : "segments",
        h->be->name, h->backend_fallback ? "true" : "false", h->be->device_id, h->pol->ops->name);
    U(requested_bytes);
    U(peak_requested_bytes);
    U(allocated_bytes);
    U(peak_allocated_bytes);
    U(reserved_bytes);
    U(peak_reserved_bytes);
    U(mapped_bytes);
    U(cached_bytes);
    U(managed_bytes);
    U(virtual_bytes);
    U(limit_bytes);
    U(device_total_bytes);
    U(device_free_bytes);
    U(page_size);
    U(active_allocs);
    U(num_allocs);
    U(num_frees);
    U(failed_allocs);
    U(num_alloc_retries);
    U(num_ooms);
    U(oom_callbacks);
    U(managed_fallbacks);
    U(page_creates);
    U(page_releases);
    U(maps);
    U(unmaps);
    U(events_recorded);
    U(trims);
#undef U
    cuma_strbuf_put(&o, "\"fragmentation\":%.6f,\"config\":{", s.fragmentation);
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
