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

/* ---- late completion ---------------------------------------------------------- */

static int blocking(const struct CUstream_st *st) {
    return !(st->flags & CU_STREAM_NON_BLOCKING) && st != &fc_dev[st->dev].null_stream;
}

static void complete_to(struct CUstream_st *st, uint64_t ticket) {
    if (st->completed < ticket) st->completed = ticket;
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
    if (rc == CUDA_SUCCESS) event_record(hEvent, st);
    fc_unlock();
    return rc;
}

CUresult cuEventQuery(CUevent hEvent) {
    FC_ENTER(EventQuery);
    fc_lock();
    CUresult rc = CUDA_ERROR_INVALID_HANDLE;
    if (event_valid("cuEventQuery", hEvent)) {
        rc = CUDA_SUCCESS;
        if (!event_done(hEvent)) {
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
    if (event_valid("cuEventSynchronize", hEvent)) {
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
