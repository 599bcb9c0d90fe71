// SPDX-License-Identifier: Apache-2.0
/*
 * fakecuda_stream.c - streams and events of the fake CUDA driver.
 *
 * Work "completes" instantly unless a test holds the stream with
 * fakecuda_stream_hold(); an event recorded on a held stream stays pending
 * (points at the stream) until fakecuda_stream_release() completes it.
 * Synchronize calls wait on fc_cv for a release, at most
 * FAKECUDA_SYNC_TIMEOUT_MS, then abort the process. See fakecuda.c.
 *
 * Late completion (FAKECUDA_EVENT_LAG=n, fakecuda_stream_set_lag): an event
 * recorded on a stream with lag n answers CUDA_ERROR_NOT_READY to its first n
 * queries and completes at the next, as a GPU that runs behind the host; its
 * completion completes every earlier record of the stream (work runs in
 * order). cuStreamQuery likewise, on the stream's own count. Synchronize calls
 * complete the work at once (it is finite): no wall clock is involved.
 *
 * Default streams as CUDA defines them: NULL and CU_STREAM_LEGACY name the
 * device's legacy stream, which synchronises with every blocking stream (not
 * CU_STREAM_NON_BLOCKING) of its device: an event recorded on it completes
 * only after the blocking streams' work recorded before it (and completing it
 * completes that work), and an event recorded on a blocking stream waits for
 * the legacy stream's earlier work the same way. CU_STREAM_PER_THREAD is one
 * blocking stream per thread and device, created on first use.
 *
 * Stream capture: cuStreamBeginCapture_v2 / cuStreamEndCapture /
 * cuStreamIsCapturing / cuThreadExchangeStreamCaptureMode with the rules of
 * cuda.h. An event recorded on a capturing stream is a graph node: every later
 * query or synchronize of it fails with CUDA_ERROR_CAPTURED_EVENT. Recording
 * on the legacy stream while a blocking stream of the device captures fails
 * with CUDA_ERROR_STREAM_CAPTURE_IMPLICIT and invalidates that capture.
 * Potentially unsafe calls (queries and synchronizes, cuMemAlloc, cuMemFree)
 * from a thread whose capture mode forbids them fail with
 * CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED and invalidate the captures that
 * forbid them; so does querying or synchronizing a capturing stream. No graph
 * is built: cuStreamEndCapture hands out a placeholder handle.
 *
 * Destroyed handles: using a stream or event after cuStreamDestroy /
 * cuEventDestroy is undefined on the real driver (it may crash, or the handle
 * may name a new object by then). The fake keeps every destroyed object as a
 * tombstone (never freed, so its address is never handed out again) and aborts
 * with a message naming the call and the handle at any use of one, so that
 * such a use is a test failure rather than a quiet CUDA_ERROR_INVALID_HANDLE.
 */
#include "fakecuda_internal.h"

#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

struct fc_ref { /* registry entry, sorted by object address */
    uint64_t key;
    void *obj;
};

/* Streams created by cuStreamCreate and events created by cuEventCreate,
 * destroyed ones included (tombstones, see above). */
static struct fc_vec g_streams = {NULL, 0, 0, sizeof(struct fc_ref)};
static struct fc_vec g_events = {NULL, 0, 0, sizeof(struct fc_ref)};

void fc_stream_init_device(struct fc_device *d, int dev) {
    d->null_stream = (struct CUstream_st){.dev = dev, .pseudo = 1, .lag = fc_cfg.event_lag};
}

/* The calling thread's per-thread default streams, one per device, in g_streams (so that
 * cuCtxSynchronize sees them) but not counted as live: the program never made them. */
static _Thread_local struct CUstream_st *tls_pt[FC_MAX_DEVICES];

static int is_pseudo(CUstream s) {
    return s == NULL || s == CU_STREAM_LEGACY || s == CU_STREAM_PER_THREAD;
}

static size_t ref_find(const struct fc_vec *v, const void *obj) {
    uint64_t key = (uint64_t)(uintptr_t)obj;
    size_t i = fc_vec_lower(v, key);
    if (i < v->n && ((const struct fc_ref *)fc_vec_at(v, i))->key == key) return i;
    return SIZE_MAX;
}

static int ref_add(struct fc_vec *v, void *obj) {
    struct fc_ref r = {(uint64_t)(uintptr_t)obj, obj};
    return fc_vec_insert(v, fc_vec_lower(v, r.key), &r);
}

/* fc_mu held. */
static struct CUstream_st *pseudo_stream(CUstream s, int dev) {
    if (s != CU_STREAM_PER_THREAD) return &fc_dev[dev].null_stream;
    if (!tls_pt[dev]) {
        struct CUstream_st *st = calloc(1, sizeof *st);
        if (!st || ref_add(&g_streams, st) != 0) fc_die("no memory for a per-thread stream");
        *st = (struct CUstream_st){.dev = dev, .pseudo = 1, .lag = fc_cfg.event_lag};
        tls_pt[dev] = st;
    }
    return tls_pt[dev];
}

/* ---- stream capture ------------------------------------------------------------ */

static CUresult stream_resolve(const char *api, CUstream s, struct CUstream_st **out);
static int blocking(const struct CUstream_st *st);

static _Thread_local CUstreamCaptureMode tls_mode = CU_STREAM_CAPTURE_MODE_GLOBAL;
static char g_graph_placeholder;

static int own_capture(const struct CUstream_st *st) {
    return st->capturing && pthread_equal(st->cap_thread, pthread_self());
}

/* Whether capture st forbids the calling thread's unsafe calls (cuda.h's three modes). */
static int forbids(const struct CUstream_st *st) {
    if (!st->capturing || tls_mode == CU_STREAM_CAPTURE_MODE_RELAXED) return 0;
    if (own_capture(st)) return st->cap_mode != CU_STREAM_CAPTURE_MODE_RELAXED;
    return tls_mode == CU_STREAM_CAPTURE_MODE_GLOBAL &&
           st->cap_mode == CU_STREAM_CAPTURE_MODE_GLOBAL;
}

CUresult fc_capture_unsafe_locked(void) {
    CUresult rc = CUDA_SUCCESS;
    for (size_t i = 0; i < g_streams.n; i++) {
        struct CUstream_st *st = ((struct fc_ref *)fc_vec_at(&g_streams, i))->obj;
        if (forbids(st)) {
            st->cap_invalid = 1;
            rc = CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED;
        }
    }
    return rc;
}

CUresult fc_capture_unsafe(void) {
    fc_lock();
    CUresult rc = fc_capture_unsafe_locked();
    fc_unlock();
    return rc;
}

/* A blocking stream of dev that captures, or NULL. */
static struct CUstream_st *blocking_capture(int dev);

/* A query or synchronize of st: not of a capturing stream, nor of the legacy stream while a
 * blocking stream captures, nor from a thread that capture forbids. */
static CUresult capture_sync_check(struct CUstream_st *st) {
    if (st->capturing) {
        st->cap_invalid = 1;
        return CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED;
    }
    struct CUstream_st *c = st == &fc_dev[st->dev].null_stream ? blocking_capture(st->dev) : NULL;
    if (c) {
        c->cap_invalid = 1;
        return CUDA_ERROR_STREAM_CAPTURE_IMPLICIT;
    }
    return fc_capture_unsafe_locked();
}

CUresult cuStreamBeginCapture_v2(CUstream hStream, CUstreamCaptureMode mode);
CUresult cuStreamBeginCapture_v2(CUstream hStream, CUstreamCaptureMode mode) {
    FC_ENTER(StreamBeginCapture);
    if ((unsigned)mode > CU_STREAM_CAPTURE_MODE_RELAXED) return CUDA_ERROR_INVALID_VALUE;
    struct CUstream_st *st;
    fc_lock();
    CUresult rc = stream_resolve("cuStreamBeginCapture", hStream, &st);
    if (rc == CUDA_SUCCESS && st == &fc_dev[st->dev].null_stream)
        rc = CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED; /* the legacy stream cannot capture */
    else if (rc == CUDA_SUCCESS && st->capturing)
        rc = CUDA_ERROR_ILLEGAL_STATE;
    if (rc == CUDA_SUCCESS) {
        st->capturing = 1;
        st->cap_invalid = 0;
        st->cap_mode = mode;
        st->cap_thread = pthread_self();
    }
    fc_unlock();
    return rc;
}

CUresult cuStreamEndCapture(CUstream hStream, CUgraph *phGraph) {
    FC_ENTER(StreamEndCapture);
    if (!phGraph) return CUDA_ERROR_INVALID_VALUE;
    struct CUstream_st *st;
    fc_lock();
    CUresult rc = stream_resolve("cuStreamEndCapture", hStream, &st);
    if (rc == CUDA_SUCCESS && !st->capturing)
        rc = CUDA_ERROR_ILLEGAL_STATE;
    else if (rc == CUDA_SUCCESS && st->cap_mode != CU_STREAM_CAPTURE_MODE_RELAXED &&
             !own_capture(st))
        rc = CUDA_ERROR_STREAM_CAPTURE_WRONG_THREAD;
    if (rc == CUDA_SUCCESS) {
        st->capturing = 0;
        *phGraph = st->cap_invalid ? NULL : (CUgraph)(void *)&g_graph_placeholder;
        if (st->cap_invalid) rc = CUDA_ERROR_STREAM_CAPTURE_INVALIDATED;
        st->cap_invalid = 0;
    }
    fc_unlock();
    return rc;
}

CUresult cuStreamIsCapturing(CUstream hStream, CUstreamCaptureStatus *captureStatus) {
    FC_ENTER(StreamIsCapturing);
    if (!captureStatus) return CUDA_ERROR_INVALID_VALUE;
    struct CUstream_st *st;
    fc_lock();
    CUresult rc = stream_resolve("cuStreamIsCapturing", hStream, &st);
    if (rc == CUDA_SUCCESS && st == &fc_dev[st->dev].null_stream && blocking_capture(st->dev))
        rc = CUDA_ERROR_STREAM_CAPTURE_IMPLICIT; /* the capture stays valid */
    else if (rc == CUDA_SUCCESS)
        *captureStatus = !st->capturing    ? CU_STREAM_CAPTURE_STATUS_NONE
                         : st->cap_invalid ? CU_STREAM_CAPTURE_STATUS_INVALIDATED
                                           : CU_STREAM_CAPTURE_STATUS_ACTIVE;
    fc_unlock();
    return rc;
}

CUresult cuThreadExchangeStreamCaptureMode(CUstreamCaptureMode *mode) {
    FC_ENTER(ThreadExchangeStreamCaptureMode);
    if (!mode || (unsigned)*mode > CU_STREAM_CAPTURE_MODE_RELAXED) return CUDA_ERROR_INVALID_VALUE;
    CUstreamCaptureMode old = tls_mode;
    tls_mode = *mode;
    *mode = old;
    return CUDA_SUCCESS;
}

/* ---- late completion ---------------------------------------------------------- */

static int blocking(const struct CUstream_st *st) {
    return !(st->flags & CU_STREAM_NON_BLOCKING) && st != &fc_dev[st->dev].null_stream;
}

static void complete_to(struct CUstream_st *st, uint64_t ticket) {
    if (st->completed < ticket) st->completed = ticket;
}

static struct CUstream_st *blocking_capture(int dev) {
    for (size_t i = 0; i < g_streams.n; i++) {
        struct CUstream_st *o = ((struct fc_ref *)fc_vec_at(&g_streams, i))->obj;
        if (o->dev == dev && o->capturing && blocking(o)) return o;
    }
    return NULL;
}

/* Whether e's work is complete: its stream's, and that of the streams it waits for. */
static int event_done(const struct CUevent_st *e) {
    if (!e->on || e->destroyed) return 1;
    if (e->pending) return 0;
    for (size_t i = 0; i < e->nsnap; i++)
        if (e->snap[i].st->held && e->snap[i].st->completed < e->snap[i].ticket) return 0;
    return e->on->completed >= e->ticket;
}

/* e completes (a query past its lag, a synchronize): so does the work it waited for. */
static void event_complete(struct CUevent_st *e) {
    complete_to(e->on, e->ticket);
    for (size_t i = 0; i < e->nsnap; i++) complete_to(e->snap[i].st, e->snap[i].ticket);
}

static void snap_add(struct CUevent_st *e, struct CUstream_st *st) {
    if (st->completed >= st->recorded && !st->held) return; /* nothing to wait for */
    if (e->nsnap == e->capsnap) {
        size_t cap = e->capsnap ? 2 * e->capsnap : 4;
        struct fc_snap *n = realloc(e->snap, cap * sizeof *n);
        if (!n) fc_die("no memory for an event's dependencies");
        e->snap = n, e->capsnap = cap;
    }
    e->snap[e->nsnap++] = (struct fc_snap){st, st->recorded};
}

/* Records e on st: the implicit synchronisation of the legacy stream decides what else it
 * waits for. */
static void event_record(struct CUevent_st *e, struct CUstream_st *st) {
    e->on = st;
    e->ticket = ++st->recorded;
    e->left = st->lag;
    e->nsnap = 0;
    e->pending = st->held ? st : NULL;
    st->qleft = st->lag;
    struct CUstream_st *legacy = &fc_dev[st->dev].null_stream;
    if (st == legacy) {
        for (size_t i = 0; i < g_streams.n; i++) {
            struct CUstream_st *o = ((struct fc_ref *)fc_vec_at(&g_streams, i))->obj;
            if (o->dev == st->dev && blocking(o)) snap_add(e, o);
        }
    } else if (blocking(st)) {
        snap_add(e, legacy);
    }
    if (!e->left && !e->pending) {
        int others_held = 0;
        for (size_t i = 0; i < e->nsnap; i++) others_held |= e->snap[i].st->held;
        if (!others_held) event_complete(e);
    }
}

static void stream_dead(const char *api, CUstream s) {
    fc_die("%s: stream %p was destroyed by cuStreamDestroy; using a destroyed stream is undefined "
           "on the real driver",
           api, (void *)s);
}

/* Resolve an API stream argument (pseudo streams need a current context); a destroyed stream
 * aborts the process. */
static CUresult stream_resolve(const char *api, CUstream s, struct CUstream_st **out) {
    if (is_pseudo(s)) {
        int dev;
        CUresult rc = fc_current_dev_locked(&dev);
        if (rc != CUDA_SUCCESS) return rc;
        *out = pseudo_stream(s, dev);
        return CUDA_SUCCESS;
    }
    if (ref_find(&g_streams, s) == SIZE_MAX) return CUDA_ERROR_INVALID_HANDLE;
    if (s->destroyed) stream_dead(api, s);
    *out = s;
    return CUDA_SUCCESS;
}

/* Whether e names an event (0: not one the fake made); a destroyed event aborts the process. */
static int event_valid(const char *api, CUevent e) {
    if (!e || ref_find(&g_events, e) == SIZE_MAX) return 0;
    if (e->destroyed)
        fc_die("%s: event %p was destroyed by cuEventDestroy; using a destroyed event is "
               "undefined on the real driver",
               api, (void *)e);
    return 1;
}

/* Wait until busy(arg) is false; abort after the configured timeout. */
static void wait_idle(const char *api, int (*busy)(const void *), const void *arg) {
    struct timespec dl;
    clock_gettime(CLOCK_MONOTONIC, &dl);
    dl.tv_sec += fc_cfg.sync_timeout_ms / 1000;
    dl.tv_nsec += (fc_cfg.sync_timeout_ms % 1000) * 1000000L;
    if (dl.tv_nsec >= 1000000000L) {
        dl.tv_sec++;
        dl.tv_nsec -= 1000000000L;
    }
    while (busy(arg)) {
        int rc = pthread_cond_timedwait(&fc_cv, &fc_mu, &dl);
        if (rc == ETIMEDOUT && busy(arg))
            fc_die("%s blocked for %ld ms on work held by fakecuda_stream_hold() and never "
                   "released: the code under test waits on in-flight work "
                   "(FAKECUDA_SYNC_TIMEOUT_MS)",
                   api, fc_cfg.sync_timeout_ms);
    }
}

static int stream_busy(const void *arg) {
    const struct CUstream_st *st = arg; /* never freed: a tombstone stays readable */
    return st->held;
}

static int event_busy(const void *arg) {
    const struct CUevent_st *e = arg; /* destroyed meanwhile: nothing left to wait for */
    if (e->destroyed || !e->on) return 0;
    if (e->pending) return 1;
    for (size_t i = 0; i < e->nsnap; i++)
        if (e->snap[i].st->held && e->snap[i].st->completed < e->snap[i].ticket) return 1;
    return 0;
}

static int device_busy(const void *arg) {
    int dev = *(const int *)arg;
    if (fc_dev[dev].null_stream.held) return 1;
    for (size_t i = 0; i < g_streams.n; i++) {
        const struct CUstream_st *st = ((const struct fc_ref *)fc_vec_at(&g_streams, i))->obj;
        if (st->dev == dev && st->held) return 1;
    }
    return 0;
}

void fc_vmm_call(const char *api, int sync) {
    if (fc_cfg.vmm_call_us > 0) {
        struct timespec ts = {fc_cfg.vmm_call_us / 1000000, (fc_cfg.vmm_call_us % 1000000) * 1000};
        while (nanosleep(&ts, &ts) != 0 && errno == EINTR) {
        }
    }
    if (!sync || !fc_cfg.sync_vmm) return;
    int dev;
    fc_lock();
    if (fc_current_dev_locked(&dev) == CUDA_SUCCESS) {
        wait_idle(api, device_busy, &dev);
        complete_to(&fc_dev[dev].null_stream, fc_dev[dev].null_stream.recorded);
        for (size_t i = 0; i < g_streams.n; i++) {
            struct CUstream_st *st = ((struct fc_ref *)fc_vec_at(&g_streams, i))->obj;
            if (st->dev == dev) complete_to(st, st->recorded);
        }
    }
    fc_unlock();
}

/* ---- streams ----------------------------------------------------------------- */

CUresult cuStreamCreate(CUstream *phStream, unsigned int Flags) {
    FC_ENTER(StreamCreate);
    if (!phStream || (Flags & ~(unsigned)CU_STREAM_NON_BLOCKING)) return CUDA_ERROR_INVALID_VALUE;
    int dev;
    fc_lock();
    CUresult rc = fc_current_dev_locked(&dev);
    if (rc == CUDA_SUCCESS) {
        struct CUstream_st *st = calloc(1, sizeof *st);
        if (!st || ref_add(&g_streams, st) != 0) {
            free(st);
            rc = CUDA_ERROR_OUT_OF_MEMORY;
        } else {
            st->dev = dev;
            st->flags = Flags;
            st->lag = fc_cfg.event_lag;
            fc_live_n.streams++;
            *phStream = st;
        }
    }
    fc_unlock();
    return rc;
}

CUresult cuStreamDestroy_v2(CUstream hStream) {
    FC_ENTER(StreamDestroy);
    CUresult rc = CUDA_ERROR_INVALID_HANDLE;
    fc_lock();
    if (!is_pseudo(hStream) && ref_find(&g_streams, hStream) != SIZE_MAX) {
        if (hStream->destroyed) stream_dead("cuStreamDestroy", hStream);
        fc_live_n.streams--;
        hStream->destroyed = 1; /* a held one's work stays in flight until released */
        rc = CUDA_SUCCESS;
    }
    fc_unlock();
    return rc;
}

CUresult cuStreamSynchronize(CUstream hStream) {
    FC_ENTER(StreamSynchronize);
    struct CUstream_st *st;
    fc_lock();
    CUresult rc = stream_resolve("cuStreamSynchronize", hStream, &st);
    if (rc == CUDA_SUCCESS) rc = capture_sync_check(st);
    if (rc == CUDA_SUCCESS) {
        wait_idle("cuStreamSynchronize", stream_busy, st);
        complete_to(st, st->recorded);
    }
    fc_unlock();
    return rc;
}

CUresult cuStreamQuery(CUstream hStream) {
    FC_ENTER(StreamQuery);
    struct CUstream_st *st;
    fc_lock();
    CUresult rc = stream_resolve("cuStreamQuery", hStream, &st);
    if (rc == CUDA_SUCCESS) rc = capture_sync_check(st);
    if (rc == CUDA_SUCCESS && st->held) {
        rc = CUDA_ERROR_NOT_READY;
    } else if (rc == CUDA_SUCCESS && st->completed < st->recorded) {
        if (st->qleft) {
            st->qleft--;
            rc = CUDA_ERROR_NOT_READY;
        } else {
            complete_to(st, st->recorded);
        }
    }
    fc_unlock();
    return rc;
}

CUresult cuStreamGetCtx(CUstream hStream, CUcontext *pctx) {
    FC_ENTER(StreamGetCtx);
    if (!pctx) return CUDA_ERROR_INVALID_VALUE;
    struct CUstream_st *st;
    fc_lock();
    CUresult rc = stream_resolve("cuStreamGetCtx", hStream, &st);
    if (rc == CUDA_SUCCESS) *pctx = &fc_dev[st->dev].ctx; /* every fake context is primary */
    fc_unlock();
    return rc;
}

CUresult fc_stream_check(const char *api, CUstream s) {
    struct CUstream_st *st;
    fc_lock();
    CUresult rc = stream_resolve(api, s, &st);
    fc_unlock();
    return rc;
}

CUresult cuStreamWaitEvent(CUstream hStream, CUevent hEvent, unsigned int Flags) {
    FC_ENTER(StreamWaitEvent);
    if (Flags & ~(unsigned)CU_EVENT_WAIT_EXTERNAL) return CUDA_ERROR_INVALID_VALUE;
    struct CUstream_st *st;
    fc_lock();
    CUresult rc = stream_resolve("cuStreamWaitEvent", hStream, &st);
    if (rc == CUDA_SUCCESS && !event_valid("cuStreamWaitEvent", hEvent))
        rc = CUDA_ERROR_INVALID_HANDLE;
    fc_unlock();
    return rc;
}

CUresult cuCtxSynchronize(void) {
    FC_ENTER(CtxSynchronize);
    int dev;
    fc_lock();
    CUresult rc = fc_current_dev_locked(&dev);
    if (rc == CUDA_SUCCESS) rc = fc_capture_unsafe_locked();
    if (rc == CUDA_SUCCESS && blocking_capture(dev)) rc = CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED;
    if (rc == CUDA_SUCCESS) {
        wait_idle("cuCtxSynchronize", device_busy, &dev);
        complete_to(&fc_dev[dev].null_stream, fc_dev[dev].null_stream.recorded);
        for (size_t i = 0; i < g_streams.n; i++) {
            struct CUstream_st *st = ((struct fc_ref *)fc_vec_at(&g_streams, i))->obj;
            if (st->dev == dev) complete_to(st, st->recorded);
        }
    }
    fc_unlock();
    return rc;
}

/* ---- events ------------------------------------------------------------------ */

CUresult cuEventCreate(CUevent *phEvent, unsigned int Flags) {
    FC_ENTER(EventCreate);
    (void)Flags; /* ignored */
    if (!phEvent) return CUDA_ERROR_INVALID_VALUE;
    int dev;
    fc_lock();
    CUresult rc = fc_current_dev_locked(&dev);
    if (rc == CUDA_SUCCESS) {
        struct CUevent_st *e = calloc(1, sizeof *e);
        if (!e || ref_add(&g_events, e) != 0) {
            free(e);
            rc = CUDA_ERROR_OUT_OF_MEMORY;
        } else {
            e->dev = dev;
            fc_live_n.events++;
            *phEvent = e;
        }
    }
    fc_unlock();
    return rc;
}

CUresult cuEventDestroy_v2(CUevent hEvent) {
    FC_ENTER(EventDestroy);
    CUresult rc = CUDA_ERROR_INVALID_HANDLE;
    fc_lock();
    if (event_valid("cuEventDestroy", hEvent)) {
        hEvent->destroyed = 1; /* a tombstone: see the top of the file */
        hEvent->pending = NULL;
        fc_live_n.events--;
        pthread_cond_broadcast(&fc_cv); /* a waiter on it must stop waiting */
        rc = CUDA_SUCCESS;
    }
    fc_unlock();
    return rc;
}

CUresult cuEventRecord(CUevent hEvent, CUstream hStream) {
    FC_ENTER(EventRecord);
    struct CUstream_st *st = NULL;
    fc_lock();
    CUresult rc = event_valid("cuEventRecord", hEvent)
                      ? stream_resolve("cuEventRecord", hStream, &st)
                      : CUDA_ERROR_INVALID_HANDLE;
    if (rc == CUDA_SUCCESS && st->dev != hEvent->dev) rc = CUDA_ERROR_INVALID_HANDLE;
    struct CUstream_st *c = NULL;
    if (rc == CUDA_SUCCESS && st == &fc_dev[st->dev].null_stream &&
        (c = blocking_capture(st->dev)) != NULL) {
        c->cap_invalid = 1; /* the legacy stream would depend on the capture */
        rc = CUDA_ERROR_STREAM_CAPTURE_IMPLICIT;
    }
    if (rc == CUDA_SUCCESS && st->capturing) {
        hEvent->captured = 1; /* a node of the graph, never complete as an event */
        hEvent->pending = NULL;
    } else if (rc == CUDA_SUCCESS) {
        hEvent->captured = 0;
        event_record(hEvent, st);
    }
    fc_unlock();
    return rc;
}

CUresult cuEventQuery(CUevent hEvent) {
    FC_ENTER(EventQuery);
    fc_lock();
    CUresult rc = CUDA_ERROR_INVALID_HANDLE;
    if (event_valid("cuEventQuery", hEvent)) {
        rc = hEvent->captured ? CUDA_ERROR_CAPTURED_EVENT : fc_capture_unsafe_locked();
        if (rc == CUDA_SUCCESS && !event_done(hEvent)) {
            if (event_busy(hEvent) || hEvent->left) {
                if (!event_busy(hEvent)) hEvent->left--;
                rc = CUDA_ERROR_NOT_READY;
            } else {
                event_complete(hEvent);
            }
        }
    }
    fc_unlock();
    return rc;
}

CUresult cuEventSynchronize(CUevent hEvent) {
    FC_ENTER(EventSynchronize);
    CUresult rc = CUDA_ERROR_INVALID_HANDLE;
    fc_lock();
    if (event_valid("cuEventSynchronize", hEvent) &&
        (rc = hEvent->captured ? CUDA_ERROR_CAPTURED_EVENT : fc_capture_unsafe_locked()) !=
            CUDA_SUCCESS) {
        /* refused */
    } else if (event_valid("cuEventSynchronize", hEvent)) {
        wait_idle("cuEventSynchronize", event_busy, hEvent);
        if (!hEvent->destroyed && hEvent->on) event_complete(hEvent);
        rc = CUDA_SUCCESS;
    }
    fc_unlock();
    return rc;
}

/* Per-thread-default-stream variants: the NULL stream means the per-thread
 * stream here. */
FC_EXPORT CUresult cuStreamQuery_ptsz(CUstream hStream);
FC_EXPORT CUresult cuStreamSynchronize_ptsz(CUstream hStream);
FC_EXPORT CUresult cuStreamWaitEvent_ptsz(CUstream hStream, CUevent hEvent, unsigned int Flags);
FC_EXPORT CUresult cuEventRecord_ptsz(CUevent hEvent, CUstream hStream);
static CUstream ptsz(CUstream s) {
    return s ? s : CU_STREAM_PER_THREAD;
}
CUresult cuStreamQuery_ptsz(CUstream hStream) {
    return cuStreamQuery(ptsz(hStream));
}
CUresult cuStreamSynchronize_ptsz(CUstream hStream) {
    return cuStreamSynchronize(ptsz(hStream));
}
CUresult cuStreamWaitEvent_ptsz(CUstream hStream, CUevent hEvent, unsigned int Flags) {
    return cuStreamWaitEvent(ptsz(hStream), hEvent, Flags);
}
CUresult cuEventRecord_ptsz(CUevent hEvent, CUstream hStream) {
    return cuEventRecord(hEvent, ptsz(hStream));
}

/* ---- test control ------------------------------------------------------------ */

static struct CUstream_st *control_stream(const char *fn, CUstream s) {
    if (!fc_initialized) fc_die("%s called before cuInit", fn);
    if (is_pseudo(s)) return pseudo_stream(s, fc_tls_ctx ? fc_tls_ctx->dev : 0);
    if (ref_find(&g_streams, s) == SIZE_MAX) fc_die("%s: %p is not a live stream", fn, (void *)s);
    /* A destroyed stream's held work may still be released; nothing else is left to do. */
    if (s->destroyed && (!s->held || strcmp(fn, "fakecuda_stream_release") != 0))
        fc_die("%s: stream %p was destroyed by cuStreamDestroy", fn, (void *)s);
    return s;
}

void fakecuda_stream_hold(CUstream s) {
    fc_config_once();
    fc_lock();
    struct CUstream_st *st = control_stream("fakecuda_stream_hold", s);
    if (!st->held) st->recorded++; /* the work in flight, numbered like a record */
    st->held = 1;
    fc_unlock();
}

void fakecuda_stream_release(CUstream s) {
    fc_config_once();
    fc_lock();
    struct CUstream_st *st = control_stream("fakecuda_stream_release", s);
    st->held = 0;
    complete_to(st, st->recorded);
    for (size_t i = 0; i < g_events.n; i++) {
        struct CUevent_st *e = ((struct fc_ref *)fc_vec_at(&g_events, i))->obj;
        if (e->pending == st) e->pending = NULL;
    }
    pthread_cond_broadcast(&fc_cv);
    fc_unlock();
}

void fakecuda_stream_set_lag(CUstream s, unsigned queries) {
    fc_config_once();
    fc_lock();
    control_stream("fakecuda_stream_set_lag", s)->lag = queries;
    fc_unlock();
}
