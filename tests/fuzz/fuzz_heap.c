// SPDX-License-Identifier: Apache-2.0
/* A heap on the simulated device driven by a sequence of calls decoded from the input, checked
 * against a model of what is live.
 *
 * The first two bytes choose the heap: policy (tlsf, buddy; segment mode has no virtual range for
 * the buddy, so tlsf there), page size (64K, 2M), thread caches on or off, host backing, segment
 * mode, a device running behind the host, early remaps, the release delay and a cache cap. The
 * rest is operations: allocate, free the k-th live block, trim, move the manual clock, record a
 * stream, hold or release a simulated stream, reset the peaks, poll, set a limit, let another
 * program take device memory, bad frees, lookups, validate and compact (cuma/compact.h: the
 * model's mover checks a block's tags, moves it and writes them anew at its new place).
 *
 * Invariants checked, besides cuma_validate every few operations and at the end:
 * - a successful allocation is 256-byte aligned, overlaps no live block, and its block size
 *   covers it; with host backing, tags written into every block (at its ends and at each page
 *   boundary inside) are intact when it is freed and at the end;
 * - the figures a single thread gets exactly (cuma.h): requested_bytes is the sum of the live
 *   sizes, active_allocs their count, num_allocs / num_frees / failed_allocs count the calls,
 *   peak_requested_bytes is the highest sum since creation or the last reset, allocated_bytes
 *   the sum of the live blocks' sizes; reserved = mapped + cached <= the device, mapped covers
 *   the requested bytes. A block freed after cuma_record_stream counts as live until the heap
 *   sees the other streams' work done, so until then the figures may hold it;
 * - a failed allocation says CUMA_ERR_OOM or CUMA_ERR_LIMIT (or, with a stream held,
 *   CUMA_ERR_BACKEND: see op_alloc) with a message; with no stream held, no lag, no limit and no
 *   memory taken, it fails only when the pages the live blocks touch leave no room for the
 *   request's pages;
 * - a bad free (inside a block, or of a freed pointer) gives CUMA_ERR_BAD_POINTER and changes
 *   no figure;
 * - after everything is freed, the streams released, the clock moved past any lag and the
 *   cache trimmed, nothing is reserved and every page created was released.
 */
#include "fuzz.h"

#include "cuma/compact.h"
#include "cuma/sim.h"

#include <string.h>

#define MB        (1024ull * 1024)
#define CAPACITY  (64 * MB)
#define MAX_LIVE  128
#define NSTREAMS  4
#define MAX_FREED 16

typedef struct blk {
    uintptr_t p;
    size_t size;
    uint64_t tag;
    bool recorded;      /* used on another stream too (cuma_record_stream) */
    cuma_stream stream; /* allocated on */
    bool other;         /* recorded on a stream other than its own: it never moves */
} blk;

typedef struct model {
    cuma_heap *h;
    uint64_t page_size;
    bool backing, segments, lag, tcache, buddy;
    blk live[MAX_LIVE];
    size_t nlive;
    uintptr_t freed[MAX_FREED]; /* recently freed pointers, for double frees */
    size_t nfreed;
    uint64_t requested, peak, allocs, frees, failed;
    /* Blocks freed after a record_stream stay counted as live until the heap sees the other
     * streams' work done (as PyTorch counts them): figures between the exact ones and these. */
    uint64_t deferred_req, deferred_size, peak_hi;
    size_t ndeferred;
    bool held[NSTREAMS];
    bool limited, taken;
    uint64_t now;
    int ops;
} model;

/* CUMA_FUZZ_VERBOSE=1 prints each call, to read a reproducer. */
static bool verbose;
#define SAY(...)                                                                                   \
    do {                                                                                           \
        if (verbose) fprintf(stderr, __VA_ARGS__);                                                 \
    } while (0)

static cuma_stream stream_of(unsigned i) {
    return (cuma_stream)(uintptr_t)((i % NSTREAMS) * 0x100);
}

/* Tags at the start, at every page boundary inside, and at the end (when the block has room for
 * more than one): a block sharing memory with another finds one changed. */
static int tags(const model *m, const blk *b, bool write) {
    if (!m->backing || b->size < 8) return 0;
    int bad = 0;
    uintptr_t end = b->p + ((b->size - 8) & ~(size_t)7);
    for (uintptr_t at = b->p;;) {
        uint64_t want = b->tag ^ at;
        if (write)
            memcpy((void *)at, &want, 8);
        else
            bad += memcmp((void *)at, &want, 8) != 0;
        if (at == end) break;
        uintptr_t next = (at / m->page_size + 1) * m->page_size;
        at = next < end ? next : end;
    }
    return bad;
}

static size_t page_of(const model *m, uintptr_t a) {
    return (size_t)(a / m->page_size);
}

static bool within(uint64_t v, uint64_t lo, uint64_t extra) {
    return v >= lo && v - lo <= extra;
}

static void check_stats(model *m) {
    cuma_stats s;
    FZ_CHECK(cuma_get_stats(m->h, &s) == CUMA_OK, "cuma_get_stats failed");
    SAY("  requested %llu active %llu allocated %llu reserved %llu\n",
        (unsigned long long)s.requested_bytes, (unsigned long long)s.active_allocs,
        (unsigned long long)s.allocated_bytes, (unsigned long long)s.reserved_bytes);
    /* Once the count is exact, every deferred block has gone: none can come back. */
    if (s.active_allocs == m->nlive) m->ndeferred = 0, m->deferred_req = m->deferred_size = 0;
    FZ_CHECK(within(s.requested_bytes, m->requested, m->deferred_req),
             "requested %llu, live blocks sum to %llu (+%llu freed, not yet done)",
             (unsigned long long)s.requested_bytes, (unsigned long long)m->requested,
             (unsigned long long)m->deferred_req);
    FZ_CHECK(within(s.active_allocs, m->nlive, m->ndeferred),
             "active_allocs %llu, %zu live (+%zu freed, not yet done)",
             (unsigned long long)s.active_allocs, m->nlive, m->ndeferred);
    FZ_CHECK(s.num_allocs == m->allocs && s.num_frees == m->frees && s.failed_allocs == m->failed,
             "allocs/frees/failed %llu/%llu/%llu, calls made %llu/%llu/%llu",
             (unsigned long long)s.num_allocs, (unsigned long long)s.num_frees,
             (unsigned long long)s.failed_allocs, (unsigned long long)m->allocs,
             (unsigned long long)m->frees, (unsigned long long)m->failed);
    FZ_CHECK(within(s.peak_requested_bytes, m->peak, m->peak_hi - m->peak),
             "peak_requested %llu, model %llu to %llu", (unsigned long long)s.peak_requested_bytes,
             (unsigned long long)m->peak, (unsigned long long)m->peak_hi);
    uint64_t blocks = 0;
    for (size_t i = 0; i < m->nlive; i++) {
        size_t bs = 0;
        FZ_CHECK(cuma_block_size(m->h, (void *)m->live[i].p, &bs) == CUMA_OK &&
                     bs >= m->live[i].size,
                 "live block %p of %zu bytes: block size %zu", (void *)m->live[i].p,
                 m->live[i].size, bs);
        blocks += bs;
    }
    FZ_CHECK(within(s.allocated_bytes, blocks, m->deferred_size),
             "allocated %llu, live blocks' sizes sum to %llu (+%llu)",
             (unsigned long long)s.allocated_bytes, (unsigned long long)blocks,
             (unsigned long long)m->deferred_size);
    FZ_CHECK(s.reserved_bytes == s.mapped_bytes + s.cached_bytes,
             "reserved %llu != mapped %llu + cached %llu", (unsigned long long)s.reserved_bytes,
             (unsigned long long)s.mapped_bytes, (unsigned long long)s.cached_bytes);
    FZ_CHECK(s.reserved_bytes <= CAPACITY && s.mapped_bytes >= s.requested_bytes,
             "reserved %llu of a %llu device, mapped %llu under %llu requested",
             (unsigned long long)s.reserved_bytes, (unsigned long long)CAPACITY,
             (unsigned long long)s.mapped_bytes, (unsigned long long)s.requested_bytes);
    FZ_CHECK(s.peak_reserved_bytes >= s.reserved_bytes &&
                 s.peak_allocated_bytes >= s.allocated_bytes &&
                 s.allocated_bytes >= s.requested_bytes,
             "peaks below the current figures");
    FZ_CHECK(s.fragmentation >= 0 && s.fragmentation <= 1, "fragmentation %g", s.fragmentation);
    FZ_CHECK(s.page_creates >= s.page_releases, "%llu pages created, %llu released",
             (unsigned long long)s.page_creates, (unsigned long long)s.page_releases);
}

static void validate(model *m) {
    FZ_CHECK(cuma_validate(m->h) == CUMA_OK, "cuma_validate after %d operations", m->ops);
}

static int cmp_span(const void *x, const void *y) {
    size_t a = ((const size_t *)x)[0], b = ((const size_t *)y)[0];
    return a < b ? -1 : a > b;
}

/* Whether the device had room: the pages the live blocks touch (each counted once) plus the
 * most pages a block of `size` can touch. */
static bool had_room(const model *m, size_t size) {
    size_t span[MAX_LIVE][2], used = 0, upto = 0;
    for (size_t i = 0; i < m->nlive; i++) {
        span[i][0] = page_of(m, m->live[i].p);
        span[i][1] = page_of(m, m->live[i].p + m->live[i].size - 1);
    }
    qsort(span, m->nlive, sizeof span[0], cmp_span);
    for (size_t i = 0; i < m->nlive; i++) {
        size_t first = span[i][0] > upto || !i ? span[i][0] : upto + 1;
        if (i && span[i][0] <= upto && span[i][1] <= upto) continue;
        used += span[i][1] - first + 1;
        upto = span[i][1];
    }
    size_t need = (size + m->page_size - 1) / m->page_size + 1;
    return used + need <= CAPACITY / m->page_size;
}

static void op_alloc(model *m, fz_reader *r) {
    uint8_t c = fz_u8(r);
    uint32_t v = fz_u16(r);
    size_t size;
    switch (c % 4) {
    case 0:
        size = 1 + v % 4096;
        break;
    case 1:
        size = 1 + (size_t)v * 16;
        break;
    case 2:
        size = 1 + (size_t)v * 256;
        break;
    default: /* whole pages and their neighbours */
        size = (size_t)(v % 256 + 1) * 64 * 1024 + (size_t)(c >> 2) % 3 - 1;
    }
    cuma_stream s = stream_of(c >> 4);
    if (m->nlive == MAX_LIVE) return;
    void *p = NULL;
    cuma_status st = cuma_alloc(m->h, size, s, &p);
    SAY("alloc %zu on %p: %d %p\n", size, s, (int)st, p);
    if (st != CUMA_OK) {
        bool held = false;
        for (unsigned i = 0; i < NSTREAMS; i++) held = held || m->held[i];
        /* A page whose old mapping still has work pending (an early remap's ghost) makes the
         * heap wait for the device; the simulator cannot wait for a held stream (its work would
         * never end) and says so, where a GPU would block until the work is done. */
        FZ_CHECK((st == CUMA_ERR_OOM || st == CUMA_ERR_LIMIT || (held && st == CUMA_ERR_BACKEND)) &&
                     *cuma_last_error(),
                 "allocation of %zu returned %d", size, (int)st);
        bool strict = !m->segments && !m->lag && !m->limited && !m->taken && !m->ndeferred && !held;
        FZ_CHECK(!strict || !had_room(m, size),
                 "allocation of %zu failed with %zu live blocks (%llu bytes) on a %llu-byte device",
                 size, m->nlive, (unsigned long long)m->requested, (unsigned long long)CAPACITY);
        m->failed++;
        return;
    }
    uintptr_t a = (uintptr_t)p;
    FZ_CHECK(p && a % 256 == 0, "allocation of %zu at %p", size, p);
    for (size_t i = 0; i < m->nlive; i++) {
        const blk *b = &m->live[i];
        FZ_CHECK(a + size <= b->p || b->p + b->size <= a,
                 "new block %p+%zu overlaps live block %p+%zu", p, size, (void *)b->p, b->size);
    }
    blk *b = &m->live[m->nlive++];
    *b = (blk){a, size, 0x9E3779B97F4A7C15ull * (m->allocs + 1), false, s, false};
    tags(m, b, true);
    m->allocs++;
    m->requested += size;
    if (m->requested > m->peak) m->peak = m->requested;
    if (m->requested + m->deferred_req > m->peak_hi) m->peak_hi = m->requested + m->deferred_req;
    for (size_t i = 0; i < m->nfreed; i++)
        if (m->freed[i] == a) m->freed[i] = m->freed[--m->nfreed];
}

static void free_at(model *m, size_t k, cuma_stream s) {
    blk b = m->live[k];
    int bad = tags(m, &b, false);
    FZ_CHECK(!bad, "block %p of %zu bytes: %d tags overwritten", (void *)b.p, b.size, bad);
    size_t bs = 0;
    FZ_CHECK(cuma_block_size(m->h, (void *)b.p, &bs) == CUMA_OK, "block size of %p", (void *)b.p);
    SAY("free %p (%zu) on %p%s\n", (void *)b.p, b.size, s, b.recorded ? " (recorded)" : "");
    FZ_CHECK(cuma_free(m->h, (void *)b.p, s) == CUMA_OK, "free of live block %p", (void *)b.p);
    if (b.recorded) m->ndeferred++, m->deferred_req += b.size, m->deferred_size += bs;
    m->live[k] = m->live[--m->nlive];
    m->frees++;
    m->requested -= b.size;
    if (m->nfreed == MAX_FREED) m->nfreed--;
    m->freed[m->nfreed++] = b.p;
}

static bool is_live(const model *m, uintptr_t a) {
    for (size_t i = 0; i < m->nlive; i++)
        if (m->live[i].p == a) return true;
    return false;
}

/* A free the heap must refuse without changing anything. */
static void op_bad_free(model *m, fz_reader *r) {
    uint8_t c = fz_u8(r);
    uintptr_t a = 0;
    if (c & 1 && m->nlive) {
        const blk *b = &m->live[(c >> 1) % m->nlive];
        if (b->size <= 256) return;
        a = b->p + 256 * (1 + (c >> 1) % ((b->size - 1) / 256));
    } else if (m->nfreed) {
        a = m->freed[(c >> 1) % m->nfreed];
    }
    if (!a || is_live(m, a)) return;
    cuma_stats before, after;
    FZ_CHECK(cuma_get_stats(m->h, &before) == CUMA_OK, "stats");
    cuma_status st = cuma_free(m->h, (void *)a, stream_of(c >> 4));
    FZ_CHECK(st == CUMA_ERR_BAD_POINTER && *cuma_last_error(), "bad free of %p returned %d",
             (void *)a, (int)st);
    size_t bs;
    FZ_CHECK(cuma_block_size(m->h, (void *)a, &bs) == CUMA_ERR_BAD_POINTER,
             "block size of a pointer that is no block");
    FZ_CHECK(cuma_record_stream(m->h, (void *)a, stream_of(1)) == CUMA_ERR_BAD_POINTER,
             "record_stream of a pointer that is no block");
    FZ_CHECK(cuma_get_stats(m->h, &after) == CUMA_OK, "stats");
    FZ_CHECK(before.requested_bytes == after.requested_bytes &&
                 before.active_allocs == after.active_allocs &&
                 before.num_frees == after.num_frees &&
                 before.reserved_bytes == after.reserved_bytes,
             "a refused free of %p changed the figures", (void *)a);
}

static void op_time(model *m, fz_reader *r) {
    uint32_t v = fz_u16(r);
    /* Microseconds to about a minute: release delays and lags are milliseconds. */
    m->now += v & 0x8000 ? (uint64_t)(v & 0x7fff) * 2000000 : (uint64_t)v * 1000;
    FZ_CHECK(cuma_sim_set_time(m->h, m->now) == CUMA_OK, "set time %llu",
             (unsigned long long)m->now);
}

/* The model's mover: a block it holds, never one with record_stream streams, keeps its data up to
 * the move (tags checked) and gets them written at the new place. */
static bool move_block(void *user, void *old_ptr, void *new_ptr, size_t size, cuma_stream s) {
    model *m = user;
    (void)s;
    for (size_t i = 0; i < m->nlive; i++) {
        blk *b = &m->live[i];
        if (b->p != (uintptr_t)old_ptr) continue;
        FZ_CHECK(!b->other, "compaction offered %p, which record_stream gave another stream",
                 old_ptr);
        FZ_CHECK(size == b->size, "compaction offered %zu bytes of the %zu-byte block %p", size,
                 b->size, old_ptr);
        FZ_CHECK(tags(m, b, false) == 0, "block %p changed before its move", old_ptr);
        if (m->backing) memcpy(new_ptr, old_ptr, size);
        b->p = (uintptr_t)new_ptr;
        tags(m, b, true);
        return true;
    }
    FZ_CHECK(false, "compaction offered %p, which is no live block", old_ptr);
    return false;
}

static void op_compact(model *m) {
    cuma_compact_result res;
    cuma_status st = cuma_compact(m->h, move_block, m, &res);
    FZ_CHECK(st == CUMA_OK || (st == CUMA_ERR_UNSUPPORTED && (m->segments || m->buddy)),
             "compact: %d (%s)", (int)st, cuma_last_error());
    SAY("  compact: %llu moved, %llu refused, %llu pages emptied\n",
        (unsigned long long)res.blocks_moved, (unsigned long long)res.blocks_refused,
        (unsigned long long)res.pages_emptied);
    FZ_CHECK(res.blocks_refused == 0, "the model's mover refused nothing");
}

static void step(model *m, fz_reader *r) {
    uint8_t op = fz_u8(r);
    if (op % 16 > 4) SAY("op %d\n", op % 16);
    switch (op % 16) {
    case 0:
    case 1:
    case 2:
        op_alloc(m, r);
        break;
    case 3:
    case 4: {
        uint8_t c = fz_u8(r);
        if (m->nlive) free_at(m, c % m->nlive, c & 0x80 ? NULL : stream_of(c >> 5));
        break;
    }
    case 5: {
        uint8_t c = fz_u8(r);
        FZ_CHECK(cuma_trim(m->h, c & 1 ? 0 : (size_t)c * MB / 4) == CUMA_OK, "trim");
        break;
    }
    case 6:
        op_time(m, r);
        break;
    case 7: {
        uint8_t c = fz_u8(r);
        if (m->nlive) {
            blk *b = &m->live[c % m->nlive];
            FZ_CHECK(cuma_record_stream(m->h, (void *)b->p, stream_of(c >> 6)) == CUMA_OK,
                     "record_stream");
            b->recorded = true;
            b->other |= stream_of(c >> 6) != b->stream;
        }
        break;
    }
    case 8: {
        uint8_t c = fz_u8(r);
        unsigned i = c % NSTREAMS;
        bool on = c & 0x80;
        cuma_status st = on ? cuma_sim_hold_stream(m->h, stream_of(i))
                            : cuma_sim_release_stream(m->h, stream_of(i));
        FZ_CHECK(st == CUMA_OK, "%s stream %u", on ? "hold" : "release", i);
        m->held[i] = on;
        break;
    }
    case 9:
        FZ_CHECK(cuma_reset_peaks(m->h) == CUMA_OK, "reset peaks");
        m->peak = m->requested;
        m->peak_hi = m->requested + m->deferred_req;
        break;
    case 10:
        FZ_CHECK(cuma_poll(m->h) == CUMA_OK, "poll");
        break;
    case 11: {
        uint8_t c = fz_u8(r);
        m->limited = c != 0;
        FZ_CHECK(cuma_set_limit(m->h, (uint64_t)c * MB) == CUMA_OK, "set limit %u M", c);
        break;
    }
    case 12: {
        uint8_t c = fz_u8(r);
        cuma_status st = cuma_sim_take_memory(m->h, (uint64_t)(c % 64) * MB);
        FZ_CHECK(st == CUMA_OK || st == CUMA_ERR_OOM, "take memory: %d", (int)st);
        if (st == CUMA_OK) m->taken = c % 64 != 0;
        break;
    }
    case 13:
        op_bad_free(m, r);
        break;
    case 14: {
        /* What a program without a release thread does: poll when the heap says. */
        uint64_t due;
        FZ_CHECK(cuma_next_release(m->h, &due) == CUMA_OK, "next release");
        if (due != UINT64_MAX && due >= m->now && due - m->now < 3600 * 1000000000ull) {
            m->now = due;
            FZ_CHECK(cuma_sim_set_time(m->h, m->now) == CUMA_OK, "set time");
            FZ_CHECK(cuma_poll(m->h) == CUMA_OK, "poll");
        }
        break;
    }
    default:
        validate(m);
        op_compact(m);
    }
    check_stats(m);
    if (++m->ops % 4 == 0) validate(m);
}

static void finish(model *m) {
    validate(m);
    for (unsigned i = 0; i < NSTREAMS; i++)
        FZ_CHECK(cuma_sim_release_stream(m->h, stream_of(i)) == CUMA_OK, "release stream");
    while (m->nlive) free_at(m, m->nlive - 1, NULL);
    check_stats(m);
    /* Past any lag (at most 3 ms) and any thread cache's age. */
    m->now += 10 * 1000000000ull;
    FZ_CHECK(cuma_sim_set_time(m->h, m->now) == CUMA_OK, "set time");
    FZ_CHECK(cuma_trim(m->h, 0) == CUMA_OK, "final trim");
    validate(m);
    /* The trim waited for every stream: nothing freed is still counted. */
    m->ndeferred = 0, m->deferred_req = m->deferred_size = 0;
    check_stats(m);
    cuma_stats s;
    FZ_CHECK(cuma_get_stats(m->h, &s) == CUMA_OK, "stats");
    FZ_CHECK(
        s.reserved_bytes == 0 && s.page_creates == s.page_releases,
        "after freeing everything and a trim: %llu reserved, %llu pages created, %llu released",
        (unsigned long long)s.reserved_bytes, (unsigned long long)s.page_creates,
        (unsigned long long)s.page_releases);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    fz_reader r = {data, size, 0};
    verbose = getenv("CUMA_FUZZ_VERBOSE") != NULL;
    uint8_t a = fz_u8(&r), b = fz_u8(&r);
    static model m;
    memset(&m, 0, sizeof m);
    m.page_size = a & 2 ? 2 * MB : 64 * 1024;
    m.tcache = a & 4;
    m.backing = !(a & 8);
    m.segments = a & 16;
    m.lag = a & 32;
    m.buddy = a & 1 && !m.segments;
    static const char *delays[4] = {"0", "5", "1000", "never"};
    char conf[512];
    snprintf(conf, sizeof conf,
             "backend:sim,capacity:64M,sim_clock:manual,policy:%s,page_size:%s,tcache:%s,"
             "host_backing:%s,sim_segments:%s,sim_lag_ms:%d,early_remap:%s,release_delay_ms:%s,"
             "max_cached:%s,arenas:1,ledger:off",
             a & 1 && !m.segments ? "buddy" : "tlsf", a & 2 ? "2M" : "64K", m.tcache ? "on" : "off",
             m.backing ? "on" : "off", m.segments ? "on" : "off", m.lag ? 3 : 0,
             a & 64 ? "off" : "on", delays[b % 4], b & 4 ? "4M" : "none");
    cuma_config cfg = {.conf = conf, .flags = CUMA_CONFIG_NO_ENV};
    FZ_CHECK(cuma_heap_create(&cfg, &m.h) == CUMA_OK, "create %s", conf);
    SAY("heap %s\n", conf);
    while (fz_more(&r)) step(&m, &r);
    finish(&m);
    cuma_heap_destroy(m.h);
    return 0;
}
