/*
 * fakecuda_stream.c - streams and events of the fake CUDA driver.
 *
 * Work "completes" instantly unless a test holds the stream with
 * fakecuda_stream_hold(); an event recorded on a held stream stays pending
 * (points at the stream) until fakecuda_stream_release() completes it.
 * Synchronize calls wait on fc_cv for a release, at most
 * FAKECUDA_SYNC_TIMEOUT_MS, then abort the process. See fakecuda.c.
 */
#include "fakecuda_internal.h"

#include <errno.h>
#include <stdlib.h>
#include <time.h>

struct fc_ref { /* registry entry, sorted by object address */
    uint64_t key;
    void *obj;
};

/* Streams created by cuStreamCreate (including ones destroyed while held,
 * which stay until released) and events created by cuEventCreate. */
static struct fc_vec g_streams = {NULL, 0, 0, sizeof(struct fc_ref)};
static struct fc_vec g_events = {NULL, 0, 0, sizeof(struct fc_ref)};

void fc_stream_init_device(struct fc_device *d, int dev) {
    d->null_stream = (struct CUstream_st){.dev = dev, .pseudo = 1};
    d->pt_stream = (struct CUstream_st){.dev = dev, .pseudo = 1};
}

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

static void ref_remove(struct fc_vec *v, const void *obj) {
    size_t i = ref_find(v, obj);
    if (i != SIZE_MAX) fc_vec_erase(v, i, 1);
}

static struct CUstream_st *pseudo_stream(CUstream s, int dev) {
    return s == CU_STREAM_PER_THREAD ? &fc_dev[dev].pt_stream : &fc_dev[dev].null_stream;
}

/* Resolve an API stream argument (pseudo streams need a current context). */
static CUresult stream_resolve(CUstream s, struct CUstream_st **out) {
    if (is_pseudo(s)) {
        int dev;
        CUresult rc = fc_current_dev_locked(&dev);
        if (rc != CUDA_SUCCESS) return rc;
        *out = pseudo_stream(s, dev);
        return CUDA_SUCCESS;
    }
    if (ref_find(&g_streams, s) == SIZE_MAX || s->destroyed) return CUDA_ERROR_INVALID_HANDLE;
    *out = s;
    return CUDA_SUCCESS;
}

static int event_valid(CUevent e) {
    return e && ref_find(&g_events, e) != SIZE_MAX;
}

/* Without dereferencing st: a waiter's stream may have been freed meanwhile
 * (destroyed while held, then released). */
static int stream_alive(const struct CUstream_st *st) {
    uintptr_t a = (uintptr_t)st;
    if (a >= (uintptr_t)fc_dev && a < (uintptr_t)(fc_dev + FC_MAX_DEVICES)) return 1; /* pseudo */
    return ref_find(&g_streams, st) != SIZE_MAX;
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
    const struct CUstream_st *st = arg;
    return stream_alive(st) && st->held;
}

static int event_busy(const void *arg) {
    const struct CUevent_st *e = arg;
    return event_valid((CUevent)e) && e->pending;
}

static int device_busy(const void *arg) {
    int dev = *(const int *)arg;
    if (fc_dev[dev].null_stream.held || fc_dev[dev].pt_stream.held) return 1;
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
    if (!is_pseudo(hStream) && ref_find(&g_streams, hStream) != SIZE_MAX && !hStream->destroyed) {
        fc_live_n.streams--;
        if (hStream->held) {
            hStream->destroyed = 1; /* its work is still in flight */
        } else {
            ref_remove(&g_streams, hStream);
            free(hStream);
        }
        rc = CUDA_SUCCESS;
    }
    fc_unlock();
    return rc;
}

CUresult cuStreamSynchronize(CUstream hStream) {
    FC_ENTER(StreamSynchronize);
    struct CUstream_st *st;
    fc_lock();
    CUresult rc = stream_resolve(hStream, &st);
    if (rc == CUDA_SUCCESS) wait_idle("cuStreamSynchronize", stream_busy, st);
    fc_unlock();
    return rc;
}

CUresult cuStreamQuery(CUstream hStream) {
    FC_ENTER(StreamQuery);
    struct CUstream_st *st;
    fc_lock();
    CUresult rc = stream_resolve(hStream, &st);
    if (rc == CUDA_SUCCESS && st->held) rc = CUDA_ERROR_NOT_READY;
    fc_unlock();
    return rc;
}

CUresult cuStreamGetCtx(CUstream hStream, CUcontext *pctx) {
    FC_ENTER(StreamGetCtx);
    if (!pctx) return CUDA_ERROR_INVALID_VALUE;
    struct CUstream_st *st;
    fc_lock();
    CUresult rc = stream_resolve(hStream, &st);
    if (rc == CUDA_SUCCESS) *pctx = &fc_dev[st->dev].ctx; /* every fake context is primary */
    fc_unlock();
    return rc;
}

CUresult fc_stream_check(CUstream s) {
    struct CUstream_st *st;
    fc_lock();
    CUresult rc = stream_resolve(s, &st);
    fc_unlock();
    return rc;
}

CUresult cuStreamWaitEvent(CUstream hStream, CUevent hEvent, unsigned int Flags) {
    FC_ENTER(StreamWaitEvent);
    if (Flags & ~(unsigned)CU_EVENT_WAIT_EXTERNAL) return CUDA_ERROR_INVALID_VALUE;
    struct CUstream_st *st;
    fc_lock();
    CUresult rc = stream_resolve(hStream, &st);
    if (rc == CUDA_SUCCESS && !event_valid(hEvent)) rc = CUDA_ERROR_INVALID_HANDLE;
    fc_unlock();
    return rc;
}

CUresult cuCtxSynchronize(void) {
    FC_ENTER(CtxSynchronize);
    int dev;
    fc_lock();
    CUresult rc = fc_current_dev_locked(&dev);
    if (rc == CUDA_SUCCESS) wait_idle("cuCtxSynchronize", device_busy, &dev);
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
    if (event_valid(hEvent)) {
        ref_remove(&g_events, hEvent);
        free(hEvent);
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
    CUresult rc = event_valid(hEvent) ? stream_resolve(hStream, &st) : CUDA_ERROR_INVALID_HANDLE;
    if (rc == CUDA_SUCCESS && st->dev != hEvent->dev) rc = CUDA_ERROR_INVALID_HANDLE;
    if (rc == CUDA_SUCCESS) hEvent->pending = st->held ? st : NULL;
    fc_unlock();
    return rc;
}

CUresult cuEventQuery(CUevent hEvent) {
    FC_ENTER(EventQuery);
    fc_lock();
    CUresult rc = !event_valid(hEvent) ? CUDA_ERROR_INVALID_HANDLE
                  : hEvent->pending    ? CUDA_ERROR_NOT_READY
                                       : CUDA_SUCCESS;
    fc_unlock();
    return rc;
}

CUresult cuEventSynchronize(CUevent hEvent) {
    FC_ENTER(EventSynchronize);
    CUresult rc = CUDA_ERROR_INVALID_HANDLE;
    fc_lock();
    if (event_valid(hEvent)) {
        wait_idle("cuEventSynchronize", event_busy, hEvent);
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
    return s;
}

void fakecuda_stream_hold(CUstream s) {
    fc_config_once();
    fc_lock();
    control_stream("fakecuda_stream_hold", s)->held = 1;
    fc_unlock();
}

void fakecuda_stream_release(CUstream s) {
    fc_config_once();
    fc_lock();
    struct CUstream_st *st = control_stream("fakecuda_stream_release", s);
    st->held = 0;
    for (size_t i = 0; i < g_events.n; i++) {
        struct CUevent_st *e = ((struct fc_ref *)fc_vec_at(&g_events, i))->obj;
        if (e->pending == st) e->pending = NULL;
    }
    if (st->destroyed) {
        ref_remove(&g_streams, st);
        free(st);
    }
    pthread_cond_broadcast(&fc_cv);
    fc_unlock();
}
