// SPDX-License-Identifier: Apache-2.0
/* The RMM CSV trace reader (src/trace/trace.c) on any bytes, plain or gzip (bytes that look
 * like a snapshot or a profiler trace go to those readers, which fuzz_snapshot and fuzz_chrome
 * fuzz on their own; here they must only keep the invariants that are not CSV's).
 *
 * The reader takes a path only, so the input goes into an anonymous memory file, read back
 * through /proc/self/fd (no disk, nothing left behind).
 *
 * Invariants checked:
 * - a load returns CUMA_OK, or CUMA_ERR_PARSE / CUMA_ERR_IO with a message, and leaves the
 *   trace empty on failure;
 * - every accepted event has a known action; the links follow trace.h: a FREE's match is an
 *   earlier ALLOC of the same pointer that links back, an ALLOC's match a later FREE that links
 *   back, an ALLOC_FAIL has none; unmatched_frees counts the FREEs without one; and the links
 *   are exactly those of a naive model (the newest allocation of a pointer takes it over);
 * - a CSV log has no more events than lines;
 * - the events written back in the log's canonical form, plain and gzip, load as the same
 *   events.
 */
#include "fuzz.h"

#include "trace/trace.h"

#include <string.h>
#include <sys/mman.h>
#include <unistd.h>
#include <zlib.h>

/* A memory file holding the bytes; its path goes into *path. */
static int memfile(const void *data, size_t size, char *path, size_t plen) {
    int fd = memfd_create("fuzz-trace", MFD_CLOEXEC);
    FZ_CHECK(fd >= 0, "memfd_create failed");
    const char *p = data;
    while (size) {
        ssize_t w = write(fd, p, size);
        FZ_CHECK(w > 0, "write to a memory file failed");
        p += w, size -= (size_t)w;
    }
    snprintf(path, plen, "/proc/self/fd/%d", fd);
    return fd;
}

/* A gzip input of a few KiB may expand to millions of lines: the reader's limit keeps a run's
 * memory small, and is itself checked (never more events; the limit is an error, named). */
#define FUZZ_MAX_EVENTS 4096

static cuma_status load_bytes(const void *data, size_t size, cuma_trace *t) {
    char path[64];
    int fd = memfile(data, size, path, sizeof path);
    cuma_status st = cuma_trace_load_max(path, FUZZ_MAX_EVENTS, t);
    if (st == CUMA_OK)
        FZ_CHECK(t->path && !strcmp(t->path, path), "path '%s' kept as '%s'", path,
                 t->path ? t->path : "(null)");
    close(fd);
    return st;
}

static void check_links(const cuma_trace *t) {
    size_t unmatched = 0;
    FZ_CHECK(t->n <= FUZZ_MAX_EVENTS, "%zu events over the limit of %d", t->n, FUZZ_MAX_EVENTS);
    for (size_t i = 0; i < t->n; i++)
        FZ_CHECK(t->ev[i].time_us < (CUMA_TRACE_MAX_HOURS + 1ull) * 3600 * 1000000,
                 "event %zu: time %llu us over %u hours", i, (unsigned long long)t->ev[i].time_us,
                 CUMA_TRACE_MAX_HOURS);
    for (size_t i = 0; i < t->n; i++) {
        const cuma_trace_event *e = &t->ev[i];
        FZ_CHECK(e->action <= CUMA_TRACE_ALLOC_FAIL, "event %zu: action %u", i, e->action);
        FZ_CHECK(e->match >= -1 && e->match < (int64_t)t->n, "event %zu: match %lld", i,
                 (long long)e->match);
        if (e->action == CUMA_TRACE_ALLOC_FAIL) {
            FZ_CHECK(e->match == -1, "failed allocation %zu linked to %lld", i,
                     (long long)e->match);
            continue;
        }
        if (e->match < 0) {
            unmatched += e->action == CUMA_TRACE_FREE;
            continue;
        }
        const cuma_trace_event *m = &t->ev[e->match];
        uint32_t other = e->action == CUMA_TRACE_FREE ? CUMA_TRACE_ALLOC : CUMA_TRACE_FREE;
        int order_ok = e->action == CUMA_TRACE_FREE ? (size_t)e->match < i : (size_t)e->match > i;
        FZ_CHECK(m->action == other && m->match == (int64_t)i && m->ptr == e->ptr && order_ok,
                 "event %zu (%s of 0x%llx) linked to %lld (%s of 0x%llx, linked to %lld)", i,
                 cuma_trace_action_name(e->action), (unsigned long long)e->ptr, (long long)e->match,
                 cuma_trace_action_name(m->action), (unsigned long long)m->ptr,
                 (long long)m->match);
    }
    FZ_CHECK(unmatched == t->unmatched_frees, "%zu unmatched frees, the trace says %zu", unmatched,
             t->unmatched_frees);

    /* The model: for each pointer, the newest allocation not yet freed holds it. Quadratic, so
     * only on the short traces a fuzzer makes. */
    if (t->n > 2000) return;
    int64_t *holder = malloc((t->n ? t->n : 1) * sizeof *holder);
    FZ_CHECK(holder, "no memory");
    for (size_t i = 0; i < t->n; i++) {
        const cuma_trace_event *e = &t->ev[i];
        holder[i] = -1;
        if (e->action == CUMA_TRACE_ALLOC) {
            /* A newer allocation of the pointer: the older one is never freed. */
            for (size_t j = 0; j < i; j++)
                if (holder[j] == 1 && t->ev[j].ptr == e->ptr) holder[j] = 0;
            holder[i] = 1;
        } else if (e->action == CUMA_TRACE_FREE) {
            int64_t want = -1;
            for (size_t j = 0; j < i; j++)
                if (holder[j] == 1 && t->ev[j].ptr == e->ptr) want = (int64_t)j;
            if (want >= 0) holder[want] = 0;
            FZ_CHECK(e->match == want, "free %zu of 0x%llx matched %lld, the model says %lld", i,
                     (unsigned long long)e->ptr, (long long)e->match, (long long)want);
        }
    }
    free(holder);
}

/* The events as the log's own writer spells them. */
static char *canonical(const cuma_trace *t, size_t *len) {
    size_t cap = 64 + t->n * 128;
    char *buf = malloc(cap);
    FZ_CHECK(buf, "no memory");
    size_t n = (size_t)snprintf(buf, cap, "Thread,Time,Action,Pointer,Size,Stream\n");
    for (size_t i = 0; i < t->n; i++) {
        const cuma_trace_event *e = &t->ev[i];
        uint64_t us = e->time_us, s = us / 1000000;
        n += (size_t)snprintf(buf + n, cap - n,
                              "%u,%02llu:%02llu:%02llu:%06llu,%s,0x%llx,%llu,%llu\n", e->thread,
                              (unsigned long long)(s / 3600), (unsigned long long)(s / 60 % 60),
                              (unsigned long long)(s % 60), (unsigned long long)(us % 1000000),
                              cuma_trace_action_name(e->action), (unsigned long long)e->ptr,
                              (unsigned long long)e->size, (unsigned long long)e->stream);
        FZ_CHECK(n < cap, "canonical form overflows its buffer");
    }
    *len = n;
    return buf;
}

static void check_same(const cuma_trace *a, const cuma_trace *b, const char *how) {
    FZ_CHECK(a->n == b->n && a->unmatched_frees == b->unmatched_frees,
             "%s: %zu events (%zu unmatched) read back as %zu (%zu)", how, a->n, a->unmatched_frees,
             b->n, b->unmatched_frees);
    for (size_t i = 0; i < a->n; i++) {
        const cuma_trace_event *x = &a->ev[i], *y = &b->ev[i];
        FZ_CHECK(x->time_us == y->time_us && x->ptr == y->ptr && x->size == y->size &&
                     x->stream == y->stream && x->thread == y->thread && x->action == y->action &&
                     x->match == y->match,
                 "%s: event %zu differs (time %llu/%llu, ptr 0x%llx/0x%llx, size %llu/%llu)", how,
                 i, (unsigned long long)x->time_us, (unsigned long long)y->time_us,
                 (unsigned long long)x->ptr, (unsigned long long)y->ptr,
                 (unsigned long long)x->size, (unsigned long long)y->size);
    }
}

static void check_rewrite(const cuma_trace *t) {
    size_t len;
    char *text = canonical(t, &len);
    cuma_trace back;
    FZ_CHECK(load_bytes(text, len, &back) == CUMA_OK, "canonical form does not load");
    check_same(t, &back, "plain");
    cuma_trace_free(&back);

    /* The same text through gzip: one reader serves both. */
    char path[64];
    int fd = memfile("", 0, path, sizeof path);
    gzFile gz = gzdopen(dup(fd), "wb");
    FZ_CHECK(gz && gzwrite(gz, text, (unsigned)len) == (int)len && gzclose(gz) == Z_OK,
             "gzip of %zu bytes failed", len);
    FZ_CHECK(cuma_trace_load(path, &back) == CUMA_OK, "gzip canonical form does not load");
    check_same(t, &back, "gzip");
    cuma_trace_free(&back);
    close(fd);
    free(text);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    cuma_trace t;
    cuma_status st = load_bytes(data, size, &t);
    if (st != CUMA_OK) {
        FZ_CHECK(st == CUMA_ERR_PARSE || st == CUMA_ERR_IO || st == CUMA_ERR_LIMIT,
                 "load returned %d", (int)st);
        FZ_CHECK(*cuma_last_error(), "failure without a message");
        /* The CSV reader's event limit, or one of the JSON reader's (a profiler trace). */
        FZ_CHECK(st != CUMA_ERR_LIMIT || strstr(cuma_last_error(), "more than 4096 events") ||
                     strstr(cuma_last_error(), "reader's limit"),
                 "limit not named: %s", cuma_last_error());
        for (const unsigned char *c = (const unsigned char *)cuma_last_error(); *c; c++)
            FZ_CHECK(*c >= 0x20 && *c != 0x7f, "raw control byte 0x%02x in the message", *c);
        FZ_CHECK(!t.ev && !t.n && !t.path && !t.unmatched_frees, "failed load left a trace");
        return 0;
    }
    /* Each event of a CSV log takes a line; a gzip input may hold more lines than bytes, so
     * only plain. A snapshot or profiler trace (JSON) may hold many events on one line. */
    if (t.format == CUMA_TRACE_RMM_CSV && (size < 2 || data[0] != 0x1f || data[1] != 0x8b)) {
        size_t lines = 1;
        for (size_t i = 0; i < size; i++) lines += data[i] == '\n';
        FZ_CHECK(t.n < lines, "%zu events from %zu lines", t.n, lines);
    }
    check_links(&t);
    check_rewrite(&t);
    cuma_trace_free(&t);
    FZ_CHECK(!t.ev && !t.n && !t.path, "cuma_trace_free left something");
    return 0;
}
