// SPDX-License-Identifier: Apache-2.0
/* Snapshot: what holds a heap's memory now, block by block (cuma_snapshot_json). PyTorch's own
 * torch.cuda.memory._snapshot() does not work under a pluggable allocator, and a job that ran
 * out of memory needs to see which blocks hold it.
 *
 * The walk gathers fixed-size figures only (64 size buckets, the 32 largest blocks), so it needs
 * no memory of its own and cannot fail half-way; it is O(live blocks) per arena, each arena under
 * its own lock in turn, as cuma_heap_snapshot does. */
#include "util/error.h"
#include "heap/heap.h"
#include "util/safefile.h"
#include "util/strbuf.h"
#include "trace/writer.h"

#include <errno.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#define TOP_N    32
#define NBUCKETS 64

typedef struct snap_block {
    uint64_t addr, size, req;
    cuma_stream stream;
    unsigned arena;
} snap_block;

/* What one walk gathers.
 * Invariants: ntop <= TOP_N; top[0..ntop) is ordered by size descending, then address ascending,
 * and holds the first ntop of all live blocks seen so far in that order; bucket i holds the live
 * blocks whose size s has 2^(i-1) < s <= 2^i (the last bucket also anything larger). */
typedef struct snap {
    cuma_arena *arena; /* the arena being walked and its index */
    unsigned arena_index;
    uint64_t live_n, live_bytes, live_req;
    uint64_t bucket_n[NBUCKETS], bucket_bytes[NBUCKETS];
    snap_block top[TOP_N];
    unsigned ntop;
    uint64_t tc_n, tc_bytes;            /* freed by the program, held by a thread cache */
    uint64_t def_n, def_bytes, def_req; /* freed, waiting on record_stream fences */
    uint64_t largest_free, cached, mapped, reserved;
    uint64_t managed_n, managed_bytes;
} snap;

/* Whether block a goes before block b in the "largest" list. */
static bool before(const snap_block *a, const snap_block *b) {
    return a->size > b->size || (a->size == b->size && a->addr < b->addr);
}

/* Insertion into the bounded sorted list: O(TOP_N) at worst, one comparison for the common block
 * smaller than all 32. */
static void top_add(snap *s, const snap_block *e) {
    unsigned i;
    if (s->ntop < TOP_N) {
        i = s->ntop++;
    } else {
        if (!before(e, &s->top[TOP_N - 1])) return;
        i = TOP_N - 1; /* the old last drops out */
    }
    for (; i > 0 && before(e, &s->top[i - 1]); i--) s->top[i] = s->top[i - 1];
    s->top[i] = *e;
}

static unsigned bucket_of(uint64_t size) {
    unsigned b = size <= 1 ? 0 : 64u - (unsigned)__builtin_clzll(size - 1);
    return b < NBUCKETS ? b : NBUCKETS - 1;
}

/* cuma_map_each callback over an arena's live map (its lock held). A block whose generation is
 * even sits in a thread cache: the program freed it, and cuma_get_stats no longer counts it. */
static bool add_block(void *ctx, uint64_t addr, void *val) {
    snap *s = ctx;
    const cuma_block *b = val;
    if (!(atomic_load_explicit(&b->gen, memory_order_acquire) & 1)) {
        s->tc_n++;
        s->tc_bytes += b->size;
        return true;
    }
    const cuma_arena *a = s->arena;
    s->live_n++;
    s->live_bytes += b->size;
    s->live_req += b->req;
    unsigned k = bucket_of(b->size);
    s->bucket_n[k]++;
    s->bucket_bytes[k] += b->size;
    snap_block e = {addr, b->size, b->req,
                    b->stream < a->streams.n ? cuma_streams_shown(&a->streams, b->stream) : NULL,
                    s->arena_index};
    top_add(s, &e);
    return true;
}

/* One arena's figures (its lock held). reserved, cached and mapped as stats.c's add_arena
 * counts them, so that the totals equal cuma_get_stats's. */
static void add_arena(snap *s, cuma_arena *a, unsigned index) {
    s->arena = a, s->arena_index = index;
    cuma_map_each(&a->live, add_block, s);
    for (const cuma_block *b = a->deferred; b; b = b->fnext) {
        s->def_n++;
        s->def_bytes += b->size;
        s->def_req += b->req;
    }
    uint64_t lf = a->pol->ops->largest_free(a->pol);
    if (lf > s->largest_free) s->largest_free = lf;
    uint64_t reserved, cached, mapped;
    cuma_arena_memory(a, &reserved, &cached, &mapped);
    s->reserved += reserved;
    s->cached += cached;
    s->mapped += mapped;
}

static void put_block(cuma_strbuf *o, const snap_block *e) {
    cuma_strbuf_put(o, "{\"addr\":\"0x%llx\",\"size\":%llu,\"requested\":%llu,\"stream\":",
                    (unsigned long long)e->addr, (unsigned long long)e->size,
                    (unsigned long long)e->req);
    if (e->stream)
        cuma_strbuf_put(o, "\"0x%llx\"", (unsigned long long)(uintptr_t)e->stream);
    else
        cuma_strbuf_put(o, "0");
    cuma_strbuf_put(o, ",\"arena\":%u}", e->arena);
}

static void put_json(cuma_strbuf *o, const snap *s, unsigned narenas, uint64_t page_size) {
#define ULL(x) ((unsigned long long)(x))
    cuma_strbuf_put(o,
                    "{\"arenas\":%u,\"page_size\":%llu,\"live\":{\"count\":%llu,\"bytes\":%llu,"
                    "\"requested\":%llu,\"by_size\":[",
                    narenas, ULL(page_size), ULL(s->live_n), ULL(s->live_bytes), ULL(s->live_req));
    bool first = true;
    for (unsigned k = 0; k < NBUCKETS; k++) {
        if (!s->bucket_n[k]) continue;
        cuma_strbuf_put(o, "%s{\"le\":%llu,\"count\":%llu,\"bytes\":%llu}", first ? "" : ",",
                        ULL(1ull << k), ULL(s->bucket_n[k]), ULL(s->bucket_bytes[k]));
        first = false;
    }
    cuma_strbuf_put(o, "],\"largest\":[");
    for (unsigned i = 0; i < s->ntop; i++) {
        if (i) cuma_strbuf_put(o, ",");
        put_block(o, &s->top[i]);
    }
    cuma_strbuf_put(o,
                    "]},\"thread_cached\":{\"count\":%llu,\"bytes\":%llu},"
                    "\"deferred\":{\"count\":%llu,\"bytes\":%llu,\"requested\":%llu},"
                    "\"managed\":{\"count\":%llu,\"bytes\":%llu},"
                    "\"free\":{\"largest_block\":%llu,\"cached_bytes\":%llu,\"mapped_bytes\":%llu,"
                    "\"reserved_bytes\":%llu}}",
                    ULL(s->tc_n), ULL(s->tc_bytes), ULL(s->def_n), ULL(s->def_bytes),
                    ULL(s->def_req), ULL(s->managed_n), ULL(s->managed_bytes), ULL(s->largest_free),
                    ULL(s->cached), ULL(s->mapped), ULL(s->reserved));
#undef ULL
}

cuma_status cuma_snapshot_json(cuma_heap *h, char *buf, size_t len, size_t *needed) {
    if (!h) return cuma_fail(CUMA_ERR_INVALID, "cuma_snapshot_json: heap is NULL");
    if (atomic_load(&h->inherited)) return cuma_heap_inherited(h, "cuma_snapshot_json");
    /* About 2.5 KiB: on the stack, so that the walk needs no allocation. */
    snap s;
    memset(&s, 0, sizeof s);
    unsigned n = atomic_load_explicit(&h->narenas, memory_order_acquire);
    for (unsigned i = 0; i < n; i++) {
        cuma_arena *a = h->arenas[i];
        cuma_mutex_lock(&a->lock, CUMA_RANK_ARENA);
        add_arena(&s, a, i);
        cuma_mutex_unlock(&a->lock);
    }
    cuma_mutex_lock(&h->managed_lock, CUMA_RANK_MANAGED);
    s.managed_n = h->managed.count;
    s.managed_bytes = h->managed_bytes;
    cuma_mutex_unlock(&h->managed_lock);
    cuma_strbuf o = {buf, len, 0};
    if (buf && len) buf[0] = 0;
    put_json(&o, &s, n, h->be->page_size);
    if (needed) *needed = o.used;
    if (!buf)
        return cuma_fail(CUMA_ERR_INVALID, "cuma_snapshot_json: buf is NULL (%zu bytes needed)",
                         o.used + 1);
    if (o.used >= len)
        return cuma_fail(CUMA_ERR_INVALID,
                         "cuma_snapshot_json: buffer of %zu bytes too small, %zu needed", len,
                         o.used + 1);
    return CUMA_OK;
}

/* ---- oom_dump: the snapshot at a failure, for a job that dies of it ---------------------------
 */

#define OOM_DUMP_GAP_NS 10000000000ull

static uint64_t mono_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

/* A JSON document from one of the *_json calls, in malloc'd memory (NULL on failure). */
static char *json_of(cuma_status (*fn)(cuma_heap *, char *, size_t, size_t *), cuma_heap *h) {
    size_t need = 0;
    fn(h, NULL, 0, &need);
    for (int tries = 0; tries < 4; tries++) { /* it may grow between the two calls */
        char *buf = malloc(need + 256);
        if (!buf) return NULL;
        size_t got = 0;
        if (fn(h, buf, need + 256, &got) == CUMA_OK) return buf;
        free(buf);
        need = got;
    }
    return NULL;
}

void cuma_heap_oom_dump(cuma_heap *h, size_t size) {
    if (!h->set.oom_dump[0]) return;
    uint64_t now = mono_ns(), last = atomic_load(&h->oom_dump_at);
    if ((last && now - last < OOM_DUMP_GAP_NS) ||
        !atomic_compare_exchange_strong(&h->oom_dump_at, &last, now))
        return;
    /* The caller's error message is the failure's: kept, and the file quotes it. */
    char why[1024];
    snprintf(why, sizeof why, "%s", cuma_last_error());
    char path[512], tmp[600];
    cuma_status st = cuma_path_expand("oom_dump", h->set.oom_dump, h->set.device, path, 256);
    char *stats = st ? NULL : json_of(cuma_stats_json, h);
    char *snap = st ? NULL : json_of(cuma_snapshot_json, h);
    const char *fail = st ? cuma_last_error() : !stats || !snap ? "no host memory" : NULL;
    FILE *f = NULL;
    char refused[160] = "";
    if (!fail) {
        /* An unguessable name created exclusively beside the file (never a planted link or
         * FIFO), whose target is absent or the user's own regular file (safefile.h). */
        int fd = cuma_file_create_temp(path, tmp, sizeof tmp, refused, sizeof refused);
        if (fd < 0)
            fail = refused;
        else if (!(f = fdopen(fd, "w"))) {
            fail = "no host memory";
            close(fd);
            unlink(tmp);
        }
    }
    if (f) {
        char quoted[2200];
        cuma_strbuf q = {quoted, sizeof quoted, 0};
        cuma_strbuf_json_string(&q, why);
        struct timespec wall;
        clock_gettime(CLOCK_REALTIME, &wall);
        fprintf(f,
                "{\"pid\":%ld,\"time_unix\":%lld,\"device\":%d,\"request_bytes\":%zu,"
                "\"error\":%s,\"stats\":%s,\"snapshot\":%s}\n",
                (long)getpid(), (long long)wall.tv_sec, h->set.device, size, quoted, stats, snap);
        /* Written whole under another name, then renamed: a reader never sees half a file. */
        if (fclose(f) != 0 || rename(tmp, path) != 0) {
            fail = strerror(errno);
            unlink(tmp);
        }
    }
    char shown[600];
    if (fail)
        fprintf(stderr, "cuma: oom_dump %s: could not write what holds the memory: %s\n",
                cuma_escape(fail == refused ? path : h->set.oom_dump, shown, sizeof shown), fail);
    else
        fprintf(stderr, "cuma: out of memory: what holds the memory is in %s\n",
                cuma_escape(path, shown, sizeof shown));
    free(stats);
    free(snap);
    cuma_fail(CUMA_ERR_OOM, "%s", why); /* the failure's message again, whatever came between */
}
