// SPDX-License-Identifier: Apache-2.0
/* Stream fences: when may memory freed on one stream be reused by another, or unmapped?
 *
 * Every free gets a heap-wide sequence number (gseq) and is tagged (stream index, gseq).
 * Events are recorded lazily, only when someone needs to know whether a tag is complete, and
 * each event covers every free issued on its stream before it. So a program that frees and
 * reallocates on one stream records no event at all on its hot path.
 *
 * Streams that die: a stream the program destroys is retired (cuma_streams_retire) while its
 * handle is still valid: one last event is recorded on it, covering all the work it will ever
 * run, and its slot becomes dead. A dead slot matches no handle (the driver may hand the same
 * handle to a new stream), records no event, and tags every later free of memory allocated on
 * it with that last fence. Once the last fence is complete every tag of the slot is known done,
 * and a new stream may take the slot over: so a program that makes and destroys a stream per
 * request runs in a table of a few slots.
 *
 * Per-thread default streams: the backend's per-thread handle (CU_STREAM_PER_THREAD) names
 * each calling thread's own stream, so the table keys it by a token of the calling thread, not by
 * the handle: a block one thread frees on its per-thread stream is not another thread's to reuse
 * before that stream's work is done. Only the owner can name its stream, so an event for such a
 * slot recorded by another thread (or by the owner as it exits, when the driver may already have
 * let its stream go) is recorded on the legacy stream, which waits for every blocking stream's
 * work, the per-thread ones among them; as that is a barrier between all of them, another thread
 * records one only when it must wait, and otherwise leaves the slot's fences to its owner. No two
 * threads get the same token, and the heap retires a thread's slots when it exits
 * (heap/thread_streams.c), so that the table does not fill.
 *
 * Not thread-safe: the heap lock protects the whole table.
 */
#ifndef CUMA_PLACE_STREAMS_H
#define CUMA_PLACE_STREAMS_H

#include "backend/backend.h"

#include <stdbool.h>
#include <stdint.h>

#define CUMA_MAX_STREAMS 256
#define CUMA_FENCE_MULTI 0xFFFFu /* tag of memory freed by several streams */
/* Events in flight per stream. 16 filled on a device 20 ms behind (about 8 spread events, and
 * those that cuma_fence_order and polls record between them): a stream could then not be
 * ordered after another's newest frees, and made pages instead (the offloading trace, --seed 2,
 * stream_order:on: 1.231x the requested bytes with 16, 1.015x with 32; 64 gains nothing). */
#define CUMA_FENCE_RING 32
/* A heap with several streams keeps about CUMA_FENCE_SPREAD events in flight on a stream that
 * runs behind, at least CUMA_FENCE_GAP_NS apart (streams.c: spread_due). */
#define CUMA_FENCE_SPREAD 8
#define CUMA_FENCE_GAP_NS 500000ull
/* Waits a stream remembers having queued (cuma_fence_order), one entry per other stream. */
#define CUMA_ORDER_MEMO 8

/* Invariants: done <= fenced <= last (in gseq); the ring holds npending events with
 * non-decreasing `covers`, each > done; a dead slot has fenced == last unless its retirement
 * could record no event (then its tags never complete: memory is held, never reused early). */
typedef struct cuma_stream_slot {
    cuma_stream handle;
    uint64_t last;   /* gseq of the last free tagged with this stream */
    uint64_t fenced; /* highest gseq that a recorded event covers */
    uint64_t done;   /* every free on this stream with gseq <= done has completed */
    struct {
        uint64_t event, covers;
        uint64_t at; /* the heap's clock when it was recorded (cuma_streams.now) */
    } ring[CUMA_FENCE_RING];
    unsigned head, npending;
    /* How long the stream's events take to complete, as seen (ns, record to retire), and when
     * the newest was recorded: a heap with several streams spaces events by them (streams.c,
     * spread_due). */
    uint64_t lat_ns, last_at;
    /* The device said gseq nd_seq was not done yet during epoch nd_epoch: later tags of this
     * stream are not done either, and are not asked about again in that epoch. */
    uint64_t nd_seq, nd_epoch;
    uint64_t nq_epoch; /* the epoch in which the oldest pending event was last found not done */
    /* Waits this stream queued on the device (cuma_fence_order): its work from then on runs after
     * every free of stream memo[k].stream with gseq <= memo[k].seq. Tags only grow (gseq is
     * heap-wide), so an entry stays true when that stream's slot is retired or taken over: a new
     * stream's tags are all later. Cleared when this slot is taken over. Not an event handle: the
     * backend recycles those. */
    struct {
        uint64_t seq;
        uint16_t stream;
    } memo[CUMA_ORDER_MEMO];
    unsigned nmemo, memo_next;
    uint64_t free_epoch; /* the backend said in this epoch that the stream captures no graph */
    bool dead;           /* retired: the handle is gone (see above) */
    bool per_thread;     /* handle is a thread's token, its stream the thread's per-thread one */
} cuma_stream_slot;

typedef struct cuma_streams {
    cuma_backend *be;
    cuma_stream per_thread; /* the backend's per-thread handle, or NULL: constant */
    cuma_stream_slot *slot; /* CUMA_MAX_STREAMS entries, the first n in use */
    unsigned n;
    uint64_t gseq; /* last sequence number handed out */
    /* A device that runs behind the host leaves many idle pages and blocks with pending tags;
     * a scan over them must not ask the device once per tag. Within one epoch (one allocator
     * operation: cuma_streams_tick) each stream's pending work is asked about once. */
    uint64_t epoch;
    /* The heap's clock (ns) at its latest operation, which the heap sets (cuma_streams_tick):
     * events are stamped with it to space them on lagging streams (lat_ns above). */
    uint64_t now;
    bool marks;               /* nvtx:on: waits are NVTX ranges (marks.h); constant */
    uint64_t events_recorded; /* statistics */
    uint64_t event_queries;
    uint64_t stream_waits; /* cuma_fence_order's waits queued on the device */
} cuma_streams;

cuma_status cuma_streams_init(cuma_streams *ss, cuma_backend *be);
void cuma_streams_destroy(cuma_streams *ss);

/* The index of a stream, adding it on first sight (in a drained dead slot if there is one); -1
 * when the table is full. */
int cuma_streams_index(cuma_streams *ss, cuma_stream handle);

/* Retires the stream `handle` before the program destroys it: records its last fence and makes
 * its slot dead. False when the table has no live slot for it (nothing to do). CUMA_OK, or the
 * backend's failure to record the fence (the slot is dead all the same). */
cuma_status cuma_streams_retire(cuma_streams *ss, cuma_stream handle, bool *found);

/* The calling thread is exiting: its per-thread stream is no longer named by the handle. */
void cuma_streams_thread_exiting(void);

/* The handle to show for slot i (logs, snapshots): a thread's token is shown as the per-thread
 * handle the program passed. */
static inline cuma_stream cuma_streams_shown(const cuma_streams *ss, unsigned i) {
    return ss->slot[i].per_thread ? ss->per_thread : ss->slot[i].handle;
}

/* A handle the calling thread may issue work on that orders after slot i's work: its own
 * handle; for a per-thread slot, the per-thread handle in its owner, the legacy stream (NULL)
 * in any other thread. */
cuma_stream cuma_streams_usable(const cuma_streams *ss, unsigned i);

/* A new allocator operation at time `now` on the heap's clock (0: unknown, keep the last):
 * what the device said about pending work may have changed. */
static inline void cuma_streams_tick(cuma_streams *ss, uint64_t now) {
    ss->epoch++;
    if (now > ss->now) ss->now = now;
}

/* Tags a free on stream index i: returns its gseq. On a dead slot, its last fence: the memory's
 * work was all on the stream, which ran nothing after it. */
static inline uint64_t cuma_streams_note_free(cuma_streams *ss, unsigned i) {
    cuma_stream_slot *s = &ss->slot[i];
    if (__builtin_expect(s->dead, 0)) return s->last;
    return s->last = ++ss->gseq;
}

/* A free was tagged on stream index i at `now` (the heap's clock): with several streams, records
 * an event when the stream's newest is old enough (streams.c), so that other streams learn of
 * the free's completion about one lag after it, not one lag after they first ask. */
void cuma_streams_freed(cuma_streams *ss, unsigned i, uint64_t now);

/* Whether a tag is known complete, without asking the device. Tag (any, 0) is clean. */
static inline bool cuma_fence_known_done(const cuma_streams *ss, unsigned stream, uint64_t seq) {
    if (seq == 0) return true;
    if (stream != CUMA_FENCE_MULTI) return ss->slot[stream].done >= seq;
    for (unsigned i = 0; i < ss->n; i++) {
        const cuma_stream_slot *s = &ss->slot[i];
        if (s->done < (s->last < seq ? s->last : seq)) return false;
    }
    return true;
}

/* Whether a tag is complete now: asks the device, recording an event if none covers the
 * tag yet, unless the device said in this epoch that an earlier tag of the stream was not done.
 * With `wait`, blocks until complete where the backend can. */
bool cuma_fence_poll(cuma_streams *ss, unsigned stream, uint64_t seq, bool wait);

/* Combines two tags of memory that becomes one (a merged block, a page freed by two
 * streams). */
static inline void cuma_fence_join(const cuma_streams *ss, uint16_t *stream, uint64_t *seq,
                                   uint16_t ostream, uint64_t oseq) {
    /* One stream (the common case: a page freed again by its stream): its later tag covers
     * the earlier, done or not; for CUMA_FENCE_MULTI the later tag waits at least as long. */
    if (*stream == ostream) {
        if (oseq > *seq) *seq = oseq;
        return;
    }
    if (cuma_fence_known_done(ss, ostream, oseq)) return;
    if (cuma_fence_known_done(ss, *stream, *seq)) {
        *stream = ostream, *seq = oseq;
        return;
    }
    if (*stream != ostream) *stream = CUMA_FENCE_MULTI;
    if (oseq > *seq) *seq = oseq;
}

/* Orders stream index x after tag (y, seq) on the device (the backend's stream_wait): work
 * queued on x from now on runs after the work the tag covers, so memory under that tag may serve
 * x at once. An event of y that covers the tag is used, recorded now if there is none; no wait
 * at all where x already waited for a later tag of y and captures no graph now. CUMA_OK
 * when x is ordered (or the tag is x's own or done); otherwise (a MULTI tag, a full ring, a
 * dead x, no stream_wait, a capturing stream) a failure, and the memory waits as before. */
cuma_status cuma_fence_order(cuma_streams *ss, unsigned x, uint16_t y, uint64_t seq);

bool cuma_streams_validate(const cuma_streams *ss, const char **why);

#endif
