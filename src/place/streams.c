// SPDX-License-Identifier: Apache-2.0
#include "place/streams.h"
#include "util/error.h"
#include "util/marks.h"

#include <stdatomic.h>
#include <stdlib.h>

/* A thread's token: a number no other thread of the process ever gets (so a token outlives its
 * thread harmlessly), odd and above the driver's special handles, so never a stream object's
 * address either. 0 until the thread first uses its per-thread stream. */
static _Thread_local uintptr_t thread_token;
static _Thread_local bool thread_exiting;
static _Atomic uintptr_t tokens_given;

/* The calling thread's token, as the table keys its per-thread stream. */
static cuma_stream thread_token_get(void) {
    if (!thread_token) thread_token = (atomic_fetch_add(&tokens_given, 1) + 1) << 4 | 9;
    return (cuma_stream)thread_token;
}

void cuma_streams_thread_exiting(void) {
    thread_exiting = true;
}

cuma_stream cuma_streams_usable(const cuma_streams *ss, unsigned i) {
    const cuma_stream_slot *s = &ss->slot[i];
    if (!s->per_thread) return s->handle;
    return s->handle == (cuma_stream)thread_token && !thread_exiting ? ss->per_thread : NULL;
}

/* The key of a handle in the table: a per-thread handle is the calling thread's token. */
static cuma_stream key_of(const cuma_streams *ss, cuma_stream handle, bool *per_thread) {
    *per_thread = handle && handle == ss->per_thread;
    return *per_thread ? thread_token_get() : handle;
}

cuma_status cuma_streams_init(cuma_streams *ss, cuma_backend *be) {
    ss->be = be;
    ss->per_thread = be->per_thread_stream;
    ss->n = 0;
    ss->gseq = 0;
    ss->epoch = 1; /* slots start at nd_epoch 0: nothing remembered */
    ss->events_recorded = 0;
    ss->event_queries = 0;
    ss->stream_waits = 0;
    ss->marks = false; /* the heap sets it after; a table made alone has no ranges */
    ss->slot = calloc(CUMA_MAX_STREAMS, sizeof *ss->slot);
    if (!ss->slot) return cuma_fail(CUMA_ERR_OOM, "no host memory for the stream table");
    return CUMA_OK;
}

void cuma_streams_destroy(cuma_streams *ss) {
    if (!ss->slot) return;
    for (unsigned i = 0; i < ss->n; i++) {
        cuma_stream_slot *s = &ss->slot[i];
        for (unsigned k = 0; k < s->npending; k++)
            ss->be->ops->event_release(ss->be, s->ring[(s->head + k) % CUMA_FENCE_RING].event);
    }
    free(ss->slot);
    ss->slot = NULL;
}

static void retire(cuma_streams *ss, cuma_stream_slot *s, uint64_t wait_until);

/* Records an event on the stream covering every tag so far (the ring has room), on the handle
 * the calling thread may use for it (cuma_streams_usable). */
static cuma_status record(cuma_streams *ss, cuma_stream_slot *s) {
    uint64_t ev;
    cuma_status st =
        ss->be->ops->event_record(ss->be, cuma_streams_usable(ss, (unsigned)(s - ss->slot)), &ev);
    if (st) return st;
    unsigned k = (s->head + s->npending) % CUMA_FENCE_RING;
    s->ring[k].event = ev;
    s->ring[k].covers = s->last;
    s->ring[k].at = s->last_at = ss->now;
    s->npending++;
    s->fenced = s->last;
    ss->events_recorded++;
    return CUMA_OK;
}

int cuma_streams_index(cuma_streams *ss, cuma_stream handle) {
    bool per_thread;
    handle = key_of(ss, handle, &per_thread);
    int reuse = -1;
    for (unsigned i = 0; i < ss->n; i++) {
        cuma_stream_slot *s = &ss->slot[i];
        if (!s->dead) {
            if (s->handle == handle) return (int)i;
        } else if (s->fenced == s->last) {
            /* Every dead slot is asked, not only up to the first drained one: a slot nobody
             * asks about would never drain, and the table would grow with the device's lag. */
            if (s->done < s->last) retire(ss, s, 0);
            if (reuse < 0 && s->done == s->last) reuse = (int)i;
        }
    }
    if (reuse >= 0) {
        /* Every tag of the old stream is done (done == last): they stay known done for the new
         * one, whose tags are all later. */
        cuma_stream_slot *s = &ss->slot[reuse];
        s->dead = false;
        s->handle = handle;
        s->per_thread = per_thread;
        s->nd_seq = s->nd_epoch = 0;
        s->nmemo = s->memo_next = 0; /* the new stream has waited for nothing */
        s->free_epoch = 0;
        return reuse;
    }
    if (ss->n == CUMA_MAX_STREAMS) return -1;
    ss->slot[ss->n].handle = handle;
    ss->slot[ss->n].per_thread = per_thread;
    return (int)ss->n++;
}

cuma_status cuma_streams_retire(cuma_streams *ss, cuma_stream handle, bool *found) {
    *found = false;
    bool per_thread;
    handle = key_of(ss, handle, &per_thread);
    cuma_stream_slot *s = NULL;
    for (unsigned i = 0; i < ss->n && !s; i++)
        if (!ss->slot[i].dead && ss->slot[i].handle == handle) s = &ss->slot[i];
    if (!s) return CUMA_OK;
    *found = true;
    /* The last fence covers the work still to come from memory the program holds, or that thread
     * caches keep, which no tag counts: so it is recorded even when every tag is done. */
    retire(ss, s, 0);
    if (s->npending == CUMA_FENCE_RING) retire(ss, s, s->ring[s->head].covers);
    s->dead = true;
    s->last = ++ss->gseq;
    if (s->npending == CUMA_FENCE_RING)
        return cuma_fail(CUMA_ERR_BACKEND,
                         "retiring stream %p: its fence ring stays full; memory freed on it is "
                         "held for good",
                         cuma_streams_shown(ss, (unsigned)(s - ss->slot)));
    cuma_status st = record(ss, s);
    if (st) return st;
    retire(ss, s, 0);
    return CUMA_OK;
}

/* Retires completed events from the front of the ring, waiting for those that cover tags up to
 * wait_until (0: none); the work after that tag may go on. */
static void retire(cuma_streams *ss, cuma_stream_slot *s, uint64_t wait_until) {
    cuma_backend *be = ss->be;
    while (s->npending) {
        uint64_t ev = s->ring[s->head].event;
        int q = be->ops->event_query(be, ev);
        ss->event_queries++;
        if (q == 0 && s->done < wait_until) {
            cuma_mark_push(ss->marks, CUMA_MARK_FENCE_WAIT);
            if (be->ops->event_wait(be, ev) == CUMA_OK) q = 1;
            cuma_mark_pop(ss->marks);
        }
        if (q <= 0) { /* an error counts as not done: memory stays held, never reused early */
            s->nq_epoch = ss->epoch; /* poll_one does not ask again in this operation */
            return;
        }
        /* Seen late when nobody asked for a while: the estimate follows a shorter latency at
         * once and a longer one slowly. */
        uint64_t t = ss->now, at = s->ring[s->head].at, lat = t > at ? t - at : 0;
        s->lat_ns = lat < s->lat_ns ? lat : s->lat_ns + (lat - s->lat_ns) / 8;
        s->done = s->ring[s->head].covers;
        be->ops->event_release(be, ev);
        s->head = (s->head + 1) % CUMA_FENCE_RING;
        s->npending--;
    }
}

/* Whether a fence may still be recorded for slot s. A retired stream's handle is gone; a thread's
 * per-thread slot is fenced on the legacy stream once its owner is gone, which any thread can
 * name: so a last fence its owner could not record as it exited (a blocking stream was capturing
 * a graph) is recorded at a later poll, and the memory freed there is not held for good. */
static bool can_fence(const cuma_stream_slot *s) {
    return !s->dead || s->per_thread;
}

/* Whether this call may record a fence for slot s now. A live thread's per-thread slot is fenced
 * by its owner, on its own stream, whenever the owner asks. Another thread's fence for it would
 * go on the legacy stream, and an operation there is a barrier between every blocking stream
 * (every thread's per-thread stream among them): so it records one only when it must wait (a
 * trim, the last rungs before out-of-memory), and meanwhile takes the memory for not done. */
static bool may_record(const cuma_stream_slot *s, bool wait) {
    if (!can_fence(s)) return false;
    if (!s->per_thread || s->dead || wait) return true;
    return s->handle == (cuma_stream)thread_token && !thread_exiting;
}

/* Events are recorded when somebody asks, and one covers every earlier free of its stream. On a
 * device that runs behind, a burst of demand (a copy stream prefetching a layer's weights) then
 * found everything freed since the stream's newest event pending, until an event recorded only
 * then completed one lag later: pages idled 100 ms and more on a device 20 ms behind. So on a
 * heap with several streams, a stream with frees newer than its newest event records one once
 * that is lat_ns / CUMA_FENCE_SPREAD old (at least CUMA_FENCE_GAP_NS): about that many events
 * in flight, and a free is known done about one lag after it (scripts/gen_stream_trace.py
 * --seed 1 --free-main 1, 20 ms behind: peak 7.38x the requested bytes before, 2.85x after). A
 * heap with one stream records as before: only when asked, which a single stream rarely is. */
static bool spread_due(const cuma_streams *ss, const cuma_stream_slot *s) {
    if (ss->n < 2 || s->dead || s->fenced >= s->last || s->npending == CUMA_FENCE_RING ||
        !may_record(s, false))
        return false;
    uint64_t gap = s->lat_ns / CUMA_FENCE_SPREAD;
    if (gap < CUMA_FENCE_GAP_NS) gap = CUMA_FENCE_GAP_NS;
    return ss->now >= s->last_at + gap;
}

void cuma_streams_freed(cuma_streams *ss, unsigned i, uint64_t now) {
    if (now > ss->now) ss->now = now;
    cuma_stream_slot *s = &ss->slot[i];
    if (spread_due(ss, s)) record(ss, s);
}

static bool poll_one(cuma_streams *ss, unsigned i, uint64_t seq, bool wait) {
    cuma_stream_slot *s = &ss->slot[i];
    if (s->done >= seq) return true;
    if (!wait && s->nd_epoch == ss->epoch && seq >= s->nd_seq) return false;
    /* The stream's oldest event was found not done earlier in this operation: neither is it
     * now, for an older tag either (ghosts and idle pages of many streams are polled in one
     * operation: 4 to 10 times fewer queries on the offloading traces). */
    bool asked = !wait && s->nq_epoch == ss->epoch;
    if (!asked) retire(ss, s, 0);
    if (s->done >= seq) return true;
    /* A full ring has no event for this tag yet: a wait first waits for the oldest event,
     * which frees a place for one that covers the tag. */
    if (wait && s->fenced < seq && s->npending == CUMA_FENCE_RING && can_fence(s))
        retire(ss, s, s->ring[s->head].covers);
    if (s->fenced < seq && s->npending < CUMA_FENCE_RING && may_record(s, wait)) record(ss, s);
    if (!asked) retire(ss, s, wait ? seq : 0);
    if (s->done >= seq) return true;
    if (spread_due(ss, s)) record(ss, s);
    if (!wait && (s->nd_epoch != ss->epoch || seq < s->nd_seq))
        s->nd_seq = seq, s->nd_epoch = ss->epoch;
    return false;
}

bool cuma_fence_poll(cuma_streams *ss, unsigned stream, uint64_t seq, bool wait) {
    if (cuma_fence_known_done(ss, stream, seq)) return true;
    if (stream != CUMA_FENCE_MULTI) return poll_one(ss, stream, seq, wait);
    bool all = true;
    for (unsigned i = 0; i < ss->n; i++) {
        cuma_stream_slot *s = &ss->slot[i];
        all &= poll_one(ss, i, s->last < seq ? s->last : seq, wait);
    }
    return all;
}

/* The index of slot sx's memo entry for stream y; sx->nmemo if it has none. */
static unsigned memo_find(const cuma_stream_slot *sx, uint16_t y) {
    unsigned k = 0;
    while (k < sx->nmemo && sx->memo[k].stream != y) k++;
    return k;
}

/* Whether x's earlier waits order it after tag (y, seq) already. Events of one stream complete
 * in order, so a wait for an event covering a later tag covers this one. Not while x captures a
 * graph: the graph's work is not ordered by a wait queued on the stream before, and a new wait
 * is refused (the memory then waits, as with no memo). Asked once an epoch (one allocator
 * operation, under the heap lock): a multi-stream trace orders a stream after the same other
 * stream's tags several times in one allocation (its pages, their ghosts). */
static bool memo_covers(cuma_streams *ss, unsigned x, uint16_t y, uint64_t seq) {
    cuma_stream_slot *sx = &ss->slot[x];
    unsigned k = memo_find(sx, y);
    if (k == sx->nmemo || sx->memo[k].seq < seq) return false;
    if (sx->free_epoch == ss->epoch || !ss->be->ops->stream_capturing) return true;
    if (ss->be->ops->stream_capturing(ss->be, cuma_streams_usable(ss, x))) return false;
    sx->free_epoch = ss->epoch;
    return true;
}

/* x waits on the device for y's frees up to gseq `covers`: remembered, in y's entry or, with
 * the memo full, in place of one whose tag is known done (no longer asked about), else of the
 * entry after the last one replaced. */
static void memo_note(const cuma_streams *ss, cuma_stream_slot *sx, uint16_t y, uint64_t covers) {
    unsigned k = memo_find(sx, y);
    if (k == sx->nmemo) {
        if (sx->nmemo < CUMA_ORDER_MEMO) {
            sx->nmemo++;
        } else {
            k = 0;
            while (k < CUMA_ORDER_MEMO &&
                   !cuma_fence_known_done(ss, sx->memo[k].stream, sx->memo[k].seq))
                k++;
            if (k == CUMA_ORDER_MEMO) {
                k = sx->memo_next;
                sx->memo_next = (k + 1) % CUMA_ORDER_MEMO;
            }
        }
        sx->memo[k].stream = y;
        sx->memo[k].seq = 0;
    }
    if (covers > sx->memo[k].seq) sx->memo[k].seq = covers;
}

cuma_status cuma_fence_order(cuma_streams *ss, unsigned x, uint16_t y, uint64_t seq) {
    if (cuma_fence_known_done(ss, y, seq) || y == x) return CUMA_OK;
    if (y == CUMA_FENCE_MULTI || !ss->be->ops->stream_wait || ss->slot[x].dead)
        return cuma_fail(CUMA_ERR_UNSUPPORTED, "no device-side order for this tag");
    if (memo_covers(ss, x, y, seq)) return CUMA_OK;
    cuma_stream_slot *s = &ss->slot[y];
    if (s->nq_epoch != ss->epoch) retire(ss, s, 0); /* not asked yet in this operation */
    if (s->done >= seq) return CUMA_OK;
    /* The oldest event that covers the tag: x waits for as little of y's work as it can. */
    unsigned k = 0;
    while (k < s->npending && s->ring[(s->head + k) % CUMA_FENCE_RING].covers < seq) k++;
    if (k == s->npending) {
        if (s->dead || s->npending == CUMA_FENCE_RING || !may_record(s, false))
            return cuma_fail(CUMA_ERR_UNSUPPORTED, "no event can cover the tag");
        cuma_status st = record(ss, s);
        if (st) return st;
    }
    unsigned r = (s->head + k) % CUMA_FENCE_RING;
    cuma_status st = ss->be->ops->stream_wait(ss->be, cuma_streams_usable(ss, x), s->ring[r].event);
    if (st) return st; /* refused (a capturing stream): nothing remembered */
    ss->stream_waits++;
    memo_note(ss, &ss->slot[x], y, s->ring[r].covers);
    ss->slot[x].free_epoch = ss->epoch; /* the backend queues no wait on a capturing stream */
    return CUMA_OK;
}

bool cuma_streams_validate(const cuma_streams *ss, const char **why) {
    if (ss->n > CUMA_MAX_STREAMS) return *why = "stream count over the table size", false;
    for (unsigned i = 0; i < ss->n; i++) {
        const cuma_stream_slot *s = &ss->slot[i];
        if (s->done > s->fenced || s->fenced > s->last || s->last > ss->gseq)
            return *why = "stream fence counters out of order (done <= fenced <= last <= gseq)",
                   false;
        if (s->npending > CUMA_FENCE_RING) return *why = "stream fence ring overfull", false;
        uint64_t prev = s->done;
        for (unsigned k = 0; k < s->npending; k++) {
            uint64_t c = s->ring[(s->head + k) % CUMA_FENCE_RING].covers;
            if (c < prev || c <= s->done) return *why = "stream fence ring not increasing", false;
            prev = c;
        }
        for (unsigned j = 0; j < i && !s->dead; j++)
            if (!ss->slot[j].dead && ss->slot[j].handle == s->handle)
                return *why = "stream listed twice", false;
    }
    return true;
}
