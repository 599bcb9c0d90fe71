// SPDX-License-Identifier: Apache-2.0
/* Fuzzes the plain-data pickle reader and the PyTorch snapshot converter with any bytes.
 *
 * Invariants: cuma_pickle_parse under small limits returns OK, CUMA_ERR_PARSE or
 * CUMA_ERR_LIMIT (the limit named), never crashes, leaves nothing behind on failure and a tree
 * that cuma_pickle_validate accepts on success, and gives the same tree when run twice; an
 * input whose first opcode names or calls code (GLOBAL, REDUCE, ...) is refused naming it.
 * cuma_snapshot_from_bytes returns OK or a PARSE/LIMIT/INVALID error with a message; on OK
 * the events are at most the limit, linked as trace.h says (a FREE's ALLOC is earlier, of the
 * same pointer, and points back), the ALLOCs added for blocks from before recording come first
 * at time 0, and unmatched_frees counts the FREEs without an ALLOC; the segments from before
 * recording are sorted and disjoint, and the PyTorch model replays the trace from them under
 * its invariant check. Read with its call stacks,
 * the same bytes give the same events (or a PARSE/LIMIT error: frames are read then) and
 * stacks that cuma_trace_stacks_validate accepts, on ALLOCs only. */
#include "fuzz.h"
#include "trace/pickle.h"
#include "trace/snapshot_pickle.h"
#include "trace/torch_model.h"

#include <string.h>

#define FUZZ_MAX_EVENTS 4096

static const cuma_pickle_limits small = {
    .max_nodes = 1 << 16, .max_bytes = 8 << 20, .max_depth = 64, .max_stack = 1 << 12};

static void check_message(void) {
    FZ_CHECK(*cuma_last_error(), "failure without a message");
    for (const unsigned char *c = (const unsigned char *)cuma_last_error(); *c; c++)
        FZ_CHECK(*c >= 0x20 && *c != 0x7f, "raw control byte 0x%02x in the message", *c);
}

static void check_pickle(const uint8_t *data, size_t size) {
    cuma_pickle p, q;
    cuma_status st = cuma_pickle_parse(data, size, &small, &p);
    if (st != CUMA_OK) {
        FZ_CHECK(st == CUMA_ERR_PARSE || st == CUMA_ERR_LIMIT, "parse returned %d", (int)st);
        check_message();
        FZ_CHECK(!p.node && !p.n && !p.text, "failed parse left a tree");
        FZ_CHECK(st != CUMA_ERR_LIMIT || strstr(cuma_last_error(), "the reader's limit"),
                 "limit not named: %s", cuma_last_error());
        /* PROTO then an opcode that names code: refused by name, at offset 2. */
        if (size > 2 && data[0] == 0x80 && data[1] >= 2 && data[1] <= 5 &&
            (data[2] == 'c' || data[2] == 0x93 || data[2] == 'R' || data[2] == 'i')) {
            char want[64];
            snprintf(want, sizeof want, "%s (0x%02x) at offset 2", cuma_pickle_opcode_name(data[2]),
                     data[2]);
            FZ_CHECK(strstr(cuma_last_error(), want), "'%s' not in: %s", want, cuma_last_error());
        }
        return;
    }
    FZ_CHECK(cuma_pickle_validate(&p) == CUMA_OK, "tree invalid");
    FZ_CHECK(p.n <= small.max_nodes && p.n <= size, "%zu nodes from %zu bytes", p.n, size);
    FZ_CHECK(cuma_pickle_parse(data, size, &small, &q) == CUMA_OK, "second parse failed");
    FZ_CHECK(q.n == p.n && q.root == p.root && q.text_len == p.text_len &&
                 (!p.text_len || !memcmp(p.text, q.text, p.text_len)),
             "second parse differs");
    for (size_t i = 0; i < p.n; i++)
        FZ_CHECK(p.node[i].kind == q.node[i].kind && p.node[i].n == q.node[i].n, "node %zu differs",
                 i);
    cuma_pickle_free(&q);
    cuma_pickle_free(&p);
    FZ_CHECK(!p.node && !p.n, "cuma_pickle_free left something");
}

static void check_trace(const cuma_trace *t) {
    FZ_CHECK(t->n <= FUZZ_MAX_EVENTS, "%zu events over the limit", t->n);
    FZ_CHECK(t->preexisting <= t->n, "%zu blocks from before of %zu events", t->preexisting, t->n);
    FZ_CHECK(t->format == CUMA_TRACE_TORCH_SNAPSHOT && t->recorded.valid, "format %u", t->format);
    size_t unmatched = 0;
    for (size_t i = 0; i < t->n; i++) {
        const cuma_trace_event *e = &t->ev[i];
        FZ_CHECK(e->action <= CUMA_TRACE_ALLOC_FAIL, "event %zu: action %u", i, e->action);
        if (i < t->preexisting)
            FZ_CHECK(e->action == CUMA_TRACE_ALLOC && e->time_us == 0,
                     "block from before %zu: action %u at %llu", i, e->action,
                     (unsigned long long)e->time_us);
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
    FZ_CHECK(!t->npreseg == !t->preseg, "%zu segments from before at %p", t->npreseg,
             (void *)t->preseg);
    for (size_t i = 0; i < t->npreseg; i++) {
        const cuma_trace_segment *s = &t->preseg[i];
        FZ_CHECK(s->size && s->addr <= UINT64_MAX - s->size, "segment from before %zu wraps", i);
        FZ_CHECK(!i || t->preseg[i - 1].addr + t->preseg[i - 1].size <= s->addr,
                 "segments from before %zu and %zu overlap or are unsorted", i - 1, i);
    }
    /* The PyTorch model starts from those segments and places the blocks from before in them:
     * whatever the file says, it replays under its own invariant check. */
    cuma_tm_conf c;
    cuma_tm_conf_default(&c);
    cuma_tm_result r;
    cuma_status st = cuma_tm_replay(t, &c, &r);
    FZ_CHECK(st == CUMA_OK || st == CUMA_ERR_OOM, "model replay returned %d: %s", (int)st,
             cuma_last_error());
    FZ_CHECK(st != CUMA_OK || r.st.blocks_placed <= t->preexisting, "%llu blocks placed of %zu",
             (unsigned long long)r.st.blocks_placed, t->preexisting);
}

/* The same file read with its call stacks: the same events, and stacks that hold together. */
static void check_stacks(const uint8_t *data, size_t size, int device, const cuma_trace *plain) {
    cuma_trace t;
    cuma_status st = cuma_snapshot_from_bytes(data, size, "fuzz", FUZZ_MAX_EVENTS, device, 1, &t);
    if (st != CUMA_OK) {
        /* Frames are read only with stacks on, so only they may make it fail. */
        FZ_CHECK(st == CUMA_ERR_PARSE || st == CUMA_ERR_LIMIT || st == CUMA_ERR_OOM,
                 "convert with stacks returned %d", (int)st);
        check_message();
        FZ_CHECK(!t.ev && !t.n && !t.stack && !t.stacks.start, "failed conversion left a trace");
        return;
    }
    FZ_CHECK(t.n == plain->n && t.preexisting == plain->preexisting,
             "%zu events with stacks, %zu without", t.n, plain->n);
    for (size_t i = 0; i < t.n; i++)
        FZ_CHECK(!memcmp(&t.ev[i], &plain->ev[i], sizeof t.ev[i]), "event %zu differs with stacks",
                 i);
    FZ_CHECK(t.stack != NULL, "no stacks kept");
    FZ_CHECK(cuma_trace_stacks_validate(&t) == CUMA_OK, "%s", cuma_last_error());
    for (size_t i = 0; i < t.n; i++)
        FZ_CHECK(t.ev[i].action == CUMA_TRACE_ALLOC || t.stack[i] == 0,
                 "event %zu: a %u with stack %u", i, t.ev[i].action, t.stack[i]);
    cuma_trace_free(&t);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    check_pickle(data, size);
    for (int device = -1; device <= 1; device++) {
        cuma_trace t;
        cuma_status st =
            cuma_snapshot_from_bytes(data, size, "fuzz", FUZZ_MAX_EVENTS, device, 0, &t);
        if (st != CUMA_OK) {
            FZ_CHECK(st == CUMA_ERR_PARSE || st == CUMA_ERR_LIMIT || st == CUMA_ERR_INVALID,
                     "convert returned %d", (int)st);
            check_message();
            FZ_CHECK(!t.ev && !t.n && !t.path, "failed conversion left a trace");
            continue;
        }
        FZ_CHECK(t.path && !strcmp(t.path, "fuzz"), "path not kept");
        check_trace(&t);
        FZ_CHECK(!t.stack && !t.stacks.start, "stacks kept without being asked for");
        check_stacks(data, size, device, &t);
        cuma_trace_free(&t);
    }
    return 0;
}
