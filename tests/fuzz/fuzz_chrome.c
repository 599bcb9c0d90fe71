// SPDX-License-Identifier: Apache-2.0
/* Fuzzes the torch.profiler Chrome trace reader (JSON) with any bytes.
 *
 * Invariants: cuma_chrome_from_bytes returns OK or a PARSE/LIMIT/INVALID error whose message
 * names the input ("fuzz:") and has no raw control byte, a JSON error giving a line and an
 * offset inside the input; a failure leaves the trace empty. On OK, for the default device and
 * devices 0 and 1: the format is the profiler's and the device the one asked for (-1, CPU,
 * only by default); at most the limit of events; the blocks from before profiling first, as
 * ALLOCs at time 0, then times that never go back; free/alloc links as trace.h says, and
 * unmatched_frees counting the FREEs without an ALLOC; recorded figures only for a CUDA device;
 * the same bytes read again give the same events; and the PyTorch model replays the trace
 * under its invariant check. */
#include "fuzz.h"
#include "trace/chrome_trace.h"
#include "trace/torch_model.h"

#include <string.h>

#define FUZZ_MAX_EVENTS 4096

static void check_message(size_t size) {
    const char *m = cuma_last_error();
    FZ_CHECK(!strncmp(m, "fuzz:", 5), "message does not name the input: %s", m);
    for (const unsigned char *c = (const unsigned char *)m; *c; c++)
        FZ_CHECK(*c >= 0x20 && *c != 0x7f, "raw control byte 0x%02x in the message", *c);
    const char *off = strstr(m, "(offset ");
    if (off) {
        unsigned long long at = strtoull(off + 8, NULL, 10);
        FZ_CHECK(at <= size, "offset %llu past the input's %zu bytes", at, size);
        FZ_CHECK(m[5] >= '1' && m[5] <= '9', "an offset without a line: %s", m);
    }
}

static void check_trace(const cuma_trace *t, int device) {
    FZ_CHECK(t->format == CUMA_TRACE_TORCH_PROFILER, "format %u", t->format);
    FZ_CHECK(device < 0 ? t->device >= -1 && t->device < 1024 : t->device == device,
             "device %d for %d", t->device, device);
    FZ_CHECK(!t->recorded.valid || t->device >= 0, "recorded figures for the CPU");
    FZ_CHECK(t->n <= FUZZ_MAX_EVENTS, "%zu events over the limit", t->n);
    FZ_CHECK(t->preexisting <= t->n, "%zu blocks from before of %zu events", t->preexisting, t->n);
    FZ_CHECK(!t->synthetic_times && !t->preseg && !t->stack, "snapshot-only fields set");
    size_t unmatched = 0;
    for (size_t i = 0; i < t->n; i++) {
        const cuma_trace_event *e = &t->ev[i];
        FZ_CHECK(e->action <= CUMA_TRACE_ALLOC_FAIL, "event %zu: action %u", i, e->action);
        if (i < t->preexisting)
            FZ_CHECK(e->action == CUMA_TRACE_ALLOC && e->time_us == 0,
                     "block from before %zu: action %u at %llu", i, e->action,
                     (unsigned long long)e->time_us);
        else if (i > t->preexisting)
            FZ_CHECK(e->time_us >= t->ev[i - 1].time_us, "event %zu goes back in time", i);
        FZ_CHECK(e->action == CUMA_TRACE_ALLOC_FAIL || e->size, "event %zu of 0 bytes", i);
        FZ_CHECK(e->match >= -1 && e->match < (int64_t)t->n, "event %zu: match %lld", i,
                 (long long)e->match);
        if (e->action == CUMA_TRACE_FREE && e->match < 0) unmatched++;
        if (e->match < 0) continue;
        FZ_CHECK(e->action != CUMA_TRACE_ALLOC_FAIL, "failed allocation %zu linked", i);
        const cuma_trace_event *m = &t->ev[e->match];
        int ok =
            m->match == (int64_t)i && m->ptr == e->ptr &&
            (e->action == CUMA_TRACE_FREE ? m->action == CUMA_TRACE_ALLOC && e->match < (int64_t)i
                                          : m->action == CUMA_TRACE_FREE && e->match > (int64_t)i);
        FZ_CHECK(ok, "event %zu linked to %lld, which does not link back", i, (long long)e->match);
    }
    FZ_CHECK(unmatched == t->unmatched_frees, "%zu unmatched frees, the trace says %zu", unmatched,
             t->unmatched_frees);
    cuma_tm_conf c;
    cuma_tm_conf_default(&c);
    cuma_tm_result r;
    cuma_status st = cuma_tm_replay(t, &c, &r);
    FZ_CHECK(st == CUMA_OK || st == CUMA_ERR_OOM, "model replay returned %d: %s", (int)st,
             cuma_last_error());
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    for (int device = -1; device <= 1; device++) {
        cuma_trace t, u;
        cuma_status st = cuma_chrome_from_bytes(data, size, "fuzz", FUZZ_MAX_EVENTS, device, &t);
        if (st != CUMA_OK) {
            FZ_CHECK(st == CUMA_ERR_PARSE || st == CUMA_ERR_LIMIT || st == CUMA_ERR_INVALID,
                     "read returned %d", (int)st);
            check_message(size);
            FZ_CHECK(st != CUMA_ERR_INVALID || device >= 0, "INVALID without a device asked");
            FZ_CHECK(!t.ev && !t.n && !t.path, "failed read left a trace");
            continue;
        }
        FZ_CHECK(t.path && !strcmp(t.path, "fuzz"), "path not kept");
        check_trace(&t, device);
        FZ_CHECK(cuma_chrome_from_bytes(data, size, "fuzz", FUZZ_MAX_EVENTS, device, &u) == CUMA_OK,
                 "second read failed");
        FZ_CHECK(u.n == t.n && u.preexisting == t.preexisting && u.device == t.device &&
                     (!t.n || !memcmp(u.ev, t.ev, t.n * sizeof *t.ev)),
                 "second read differs");
        cuma_trace_free(&u);
        cuma_trace_free(&t);
    }
    return 0;
}
