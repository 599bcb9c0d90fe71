// SPDX-License-Identifier: Apache-2.0
/*
 * test_fakecuda_streams.c - self test of the fake CUDA driver, continued:
 * streams and events, cuGetProcAddress, exported symbols and call counters,
 * threads, and the modes that re-execute this binary with a different
 * environment ("no-vmm", "no-peer", "no-device", "bad-env"). main() and the
 * other sections are in test_fakecuda.c.
 */
#include "test_fakecuda.h"

/* ---- streams and events --------------------------------------------------- */

struct delayed {
    CUstream s;
    int ms;
};

static void *release_later(void *arg) {
    struct delayed *d = arg;
    struct timespec ts = {0, d->ms * 1000000L};
    nanosleep(&ts, NULL);
    fakecuda_stream_release(d->s);
    return NULL;
}

static void *destroy_then_release_later(void *arg) {
    struct delayed *d = arg;
    struct timespec ts = {0, d->ms * 1000000L};
    nanosleep(&ts, NULL);
    if (cuCtxSetCurrent(g_ctx0) != CUDA_SUCCESS || cuStreamDestroy(d->s) != CUDA_SUCCESS)
        return (void *)1;
    nanosleep(&ts, NULL);
    fakecuda_stream_release(d->s); /* frees the stream the main thread waits on */
    return NULL;
}

/* Hold s, run sync() while another thread releases s after 50 ms. */
static void check_blocks_until_release(CUstream s, CUevent e, int which) {
    fakecuda_stream_hold(s);
    OK(cuEventRecord(e, s));
    struct delayed d = {s, 50};
    pthread_t t;
    double t0 = now_ms();
    CHECK(pthread_create(&t, NULL, release_later, &d) == 0);
    if (which == 0) OK(cuEventSynchronize(e));
    if (which == 1) OK(cuStreamSynchronize(s));
    if (which == 2) OK(cuCtxSynchronize());
    double waited = now_ms() - t0;
    /* It waited for the release. That the release woke it, and not the sync timeout, needs no
     * bound on wall time: a timeout aborts the process (fc_die). */
    CHECK(waited >= 40);
    CHECK(pthread_join(t, NULL) == 0);
    OK(cuEventQuery(e));
}

/* The uses of a destroyed handle that child_aborts tries. */
enum dead_use {
    USE_RELEASE,
    USE_STREAM_QUERY,
    USE_STREAM_SYNC,
    USE_STREAM_DESTROY,
    USE_RECORD_ON,
    USE_WAIT_ON,
    USE_ALLOC_ASYNC,
    USE_EVENT_QUERY,
    USE_EVENT_RECORD,
    USE_EVENT_DESTROY,
};

/* Does `use` of stream s (or event e) abort the process, with a message naming `call`? */
static int child_aborts(enum dead_use use, CUstream s, CUevent e, const char *call) {
    fflush(NULL);
    int fd[2];
    CHECK(pipe(fd) == 0);
    pid_t pid = fork();
    CHECK(pid >= 0);
    if (pid == 0) {
        struct rlimit no_core = {0, 0};
        setrlimit(RLIMIT_CORE, &no_core);
        close(fd[0]);
        if (dup2(fd[1], 2) < 0) _exit(3);
        CUevent live = NULL;
        CUdeviceptr p;
        if (cuCtxSetCurrent(g_ctx0) != CUDA_SUCCESS || cuEventCreate(&live, 0) != CUDA_SUCCESS)
            _exit(4);
        switch (use) {
        case USE_RELEASE:
            fakecuda_stream_release(s);
            break;
        case USE_STREAM_QUERY:
            cuStreamQuery(s);
            break;
        case USE_STREAM_SYNC:
            cuStreamSynchronize(s);
            break;
        case USE_STREAM_DESTROY:
            cuStreamDestroy(s);
            break;
        case USE_RECORD_ON:
            cuEventRecord(live, s);
            break;
        case USE_WAIT_ON:
            cuStreamWaitEvent(s, live, 0);
            break;
        case USE_ALLOC_ASYNC:
            cuMemAllocAsync(&p, 4096, s);
            break;
        case USE_EVENT_QUERY:
            cuEventQuery(e);
            break;
        case USE_EVENT_RECORD:
            cuEventRecord(e, NULL);
            break;
        case USE_EVENT_DESTROY:
            cuEventDestroy(e);
            break;
        }
        _exit(0);
    }
    close(fd[1]);
    char msg[512] = "";
    size_t n = 0;
    ssize_t r;
    while (n < sizeof msg - 1 && (r = read(fd[0], msg + n, sizeof msg - 1 - n)) > 0) n += (size_t)r;
    close(fd[0]);
    int st;
    CHECK(waitpid(pid, &st, 0) == pid);
    char handle[32];
    snprintf(handle, sizeof handle, "%p", use >= USE_EVENT_QUERY ? (void *)e : (void *)s);
    return WIFSIGNALED(st) && WTERMSIG(st) == SIGABRT && strstr(msg, call) && strstr(msg, handle);
}

static int child_release_aborts(CUstream s) {
    return child_aborts(USE_RELEASE, s, NULL, "fakecuda_stream_release");
}

void test_streams(void) {
    g_section = "streams/events";
    CUstream s, s2;
    CUevent e, e2;
    CHECK_RC(cuStreamCreate(&s, 4), CUDA_ERROR_INVALID_VALUE);
    OK(cuStreamCreate(&s, 0));
    OK(cuStreamCreate(&s2, CU_STREAM_NON_BLOCKING));
    OK(cuEventCreate(&e, 0));
    OK(cuEventCreate(&e2, CU_EVENT_DISABLE_TIMING));
    CHECK(fakecuda_live("streams") == 2 && fakecuda_live("events") == 2);
    OK(cuEventQuery(e)); /* never recorded: complete */
    OK(cuEventSynchronize(e));
    OK(cuEventRecord(e, s));
    OK(cuEventQuery(e));
    OK(cuStreamQuery(s));

    fakecuda_stream_hold(s);
    CHECK_RC(cuStreamQuery(s), CUDA_ERROR_NOT_READY);
    OK(cuEventRecord(e, s));
    OK(cuEventRecord(e2, s2));
    CHECK_RC(cuEventQuery(e), CUDA_ERROR_NOT_READY);
    OK(cuEventQuery(e2));
    OK(cuStreamWaitEvent(s2, e, 0));
    fakecuda_stream_release(s);
    OK(cuEventQuery(e));
    OK(cuStreamQuery(s));
    /* re-recording on an idle stream replaces the pending record */
    fakecuda_stream_hold(s);
    OK(cuEventRecord(e, s));
    OK(cuEventRecord(e, s2));
    OK(cuEventQuery(e));
    fakecuda_stream_release(s);

    /* pseudo streams: NULL == CU_STREAM_LEGACY, per-thread is separate */
    fakecuda_stream_hold(NULL);
    OK(cuEventRecord(e, NULL));
    CHECK_RC(cuEventQuery(e), CUDA_ERROR_NOT_READY);
    CHECK_RC(cuStreamQuery(CU_STREAM_LEGACY), CUDA_ERROR_NOT_READY);
    OK(cuStreamQuery(CU_STREAM_PER_THREAD));
    fakecuda_stream_release(CU_STREAM_LEGACY);
    OK(cuEventQuery(e));
    CUresult (*query_ptsz)(CUstream) =
        (CUresult(*)(CUstream))dlsym(RTLD_DEFAULT, "cuStreamQuery_ptsz");
    CHECK(query_ptsz != NULL);
    fakecuda_stream_hold(CU_STREAM_PER_THREAD);
    CHECK_RC(query_ptsz(NULL), CUDA_ERROR_NOT_READY);
    OK(cuStreamQuery(NULL));
    fakecuda_stream_release(CU_STREAM_PER_THREAD);

    /* handle validation */
    int junk;
    CHECK_RC(cuStreamWaitEvent(s, (CUevent)&junk, 0), CUDA_ERROR_INVALID_HANDLE);
    CHECK_RC(cuStreamWaitEvent((CUstream)&junk, e, 0), CUDA_ERROR_INVALID_HANDLE);
    CHECK_RC(cuStreamWaitEvent(s, e, 2), CUDA_ERROR_INVALID_VALUE);
    CHECK_RC(cuEventRecord((CUevent)&junk, s), CUDA_ERROR_INVALID_HANDLE);
    CHECK_RC(cuStreamQuery((CUstream)&junk), CUDA_ERROR_INVALID_HANDLE);
    CHECK_RC(cuStreamDestroy(NULL), CUDA_ERROR_INVALID_HANDLE);
    CHECK_RC(cuStreamDestroy(CU_STREAM_LEGACY), CUDA_ERROR_INVALID_HANDLE);
    OK(cuCtxSetCurrent(g_ctx1));
    CUevent e1;
    OK(cuEventCreate(&e1, 0));
    CHECK_RC(cuEventRecord(e1, s), CUDA_ERROR_INVALID_HANDLE); /* other device's stream */
    OK(cuStreamWaitEvent(NULL, e, 0));                         /* cross-device wait is fine */
    OK(cuEventDestroy(e1));
    OK(cuCtxSetCurrent(g_ctx0));

    /* synchronize blocks until another thread releases the stream */
    check_blocks_until_release(s, e, 0);
    check_blocks_until_release(s, e, 1);
    check_blocks_until_release(s2, e, 2);

    /* a waiter survives its stream being destroyed and freed meanwhile */
    CUstream s3;
    OK(cuStreamCreate(&s3, 0));
    fakecuda_stream_hold(s3);
    struct delayed d3 = {s3, 30};
    pthread_t t3;
    void *res3 = (void *)1;
    CHECK(pthread_create(&t3, NULL, destroy_then_release_later, &d3) == 0);
    OK(cuStreamSynchronize(s3));
    CHECK(pthread_join(t3, &res3) == 0 && res3 == NULL);

    /* destroying a held stream keeps its work in flight until release */
    fakecuda_stream_hold(s2);
    OK(cuEventRecord(e2, s2));
    OK(cuStreamDestroy(s2));
    CHECK(fakecuda_live("streams") == 1);
    CHECK(child_aborts(USE_STREAM_QUERY, s2, NULL, "cuStreamQuery"));
    CHECK_RC(cuEventQuery(e2), CUDA_ERROR_NOT_READY);
    fakecuda_stream_release(s2);
    OK(cuEventQuery(e2));
    CHECK(child_release_aborts(s2)); /* destroyed and no longer held: nothing to release */

    /* waiting on held work that is never released aborts the process */
    fakecuda_stream_hold(s);
    OK(cuEventRecord(e, s));
    fflush(NULL);
    pid_t pid = fork();
    CHECK(pid >= 0);
    if (pid == 0) {
        struct rlimit no_core = {0, 0};
        setrlimit(RLIMIT_CORE, &no_core);
        if (!freopen("/dev/null", "w", stderr)) _exit(3);
        cuEventSynchronize(e);
        _exit(0);
    }
    int st;
    CHECK(waitpid(pid, &st, 0) == pid);
    CHECK(WIFSIGNALED(st) && WTERMSIG(st) == SIGABRT);
    fakecuda_stream_release(s);

    OK(cuStreamDestroy(s));
    OK(cuEventDestroy(e));
    OK(cuEventDestroy(e2));
    /* Every use of a destroyed handle aborts, naming the call and the handle. */
    CHECK(child_aborts(USE_STREAM_DESTROY, s, NULL, "cuStreamDestroy"));
    CHECK(child_aborts(USE_STREAM_SYNC, s, NULL, "cuStreamSynchronize"));
    CHECK(child_aborts(USE_RECORD_ON, s, NULL, "cuEventRecord"));
    CHECK(child_aborts(USE_WAIT_ON, s, NULL, "cuStreamWaitEvent"));
    CHECK(child_aborts(USE_ALLOC_ASYNC, s, NULL, "cuMemAllocAsync"));
    CHECK(child_aborts(USE_EVENT_QUERY, NULL, e, "cuEventQuery"));
    CHECK(child_aborts(USE_EVENT_RECORD, NULL, e, "cuEventRecord"));
    CHECK(child_aborts(USE_EVENT_DESTROY, NULL, e, "cuEventDestroy"));
    CHECK(fakecuda_live("streams") == 0 && fakecuda_live("events") == 0);
}

static CUstream g_other_stream;

static void *pt_other_thread(void *arg) {
    CUevent e = arg;
    if (cuCtxSetCurrent(g_ctx0) != CUDA_SUCCESS) return (void *)1;
    /* This thread's per-thread stream is not the main thread's (which is held). */
    if (cuStreamQuery(CU_STREAM_PER_THREAD) != CUDA_SUCCESS) return (void *)2;
    if (cuEventRecord(e, CU_STREAM_PER_THREAD) != CUDA_SUCCESS) return (void *)3;
    if (cuEventQuery(e) != CUDA_SUCCESS) return (void *)4;
    return NULL;
}

void test_lag_and_default_streams(void) {
    g_section = "late completion, default streams";
    CUstream s, nb;
    CUevent e, e2;
    OK(cuStreamCreate(&s, 0));
    OK(cuStreamCreate(&nb, CU_STREAM_NON_BLOCKING));
    OK(cuEventCreate(&e, 0));
    OK(cuEventCreate(&e2, 0));

    /* A lag of 2: two "not ready" answers, then complete; completing a later record completes
     * the earlier ones; synchronize calls complete at once. */
    fakecuda_stream_set_lag(s, 2);
    OK(cuEventRecord(e, s));
    OK(cuEventRecord(e2, s));
    CHECK_RC(cuEventQuery(e2), CUDA_ERROR_NOT_READY);
    CHECK_RC(cuEventQuery(e2), CUDA_ERROR_NOT_READY);
    OK(cuEventQuery(e2));
    OK(cuEventQuery(e)); /* earlier work on the stream is done too */
    OK(cuEventRecord(e, s));
    CHECK_RC(cuStreamQuery(s), CUDA_ERROR_NOT_READY);
    OK(cuStreamSynchronize(s));
    OK(cuEventQuery(e));
    OK(cuEventRecord(e, s));
    OK(cuEventSynchronize(e));
    OK(cuEventQuery(e));
    OK(cuEventRecord(e, s));
    OK(cuCtxSynchronize());
    OK(cuEventQuery(e));
    fakecuda_stream_set_lag(s, 0);
    OK(cuEventRecord(e, s));
    OK(cuEventQuery(e));

    /* The legacy stream waits for blocking streams' earlier work, not for non-blocking ones. */
    fakecuda_stream_hold(s);
    fakecuda_stream_hold(nb);
    OK(cuEventRecord(e, CU_STREAM_LEGACY));
    CHECK_RC(cuEventQuery(e), CUDA_ERROR_NOT_READY);
    fakecuda_stream_release(s);
    OK(cuEventQuery(e)); /* nb is still held: it does not count */
    /* ... and a blocking stream's later work waits for the legacy stream. */
    fakecuda_stream_hold(CU_STREAM_LEGACY);
    OK(cuEventRecord(e, s));
    CHECK_RC(cuEventQuery(e), CUDA_ERROR_NOT_READY);
    OK(cuEventRecord(e2, nb));
    fakecuda_stream_release(nb);
    OK(cuEventQuery(e2)); /* non-blocking: on its own */
    fakecuda_stream_release(CU_STREAM_LEGACY);
    OK(cuEventQuery(e));
    /* A lagging blocking stream: the legacy event completes its work when it completes. */
    fakecuda_stream_set_lag(s, 5);
    OK(cuEventRecord(e2, s));
    OK(cuEventRecord(e, NULL));
    OK(cuEventQuery(e)); /* the legacy stream itself has no lag */
    OK(cuEventQuery(e2));
    fakecuda_stream_set_lag(s, 0);

    /* CU_STREAM_PER_THREAD: one stream per thread. */
    fakecuda_stream_hold(CU_STREAM_PER_THREAD);
    CHECK_RC(cuStreamQuery(CU_STREAM_PER_THREAD), CUDA_ERROR_NOT_READY);
    pthread_t t;
    void *res = (void *)1;
    CHECK(pthread_create(&t, NULL, pt_other_thread, e) == 0);
    CHECK(pthread_join(t, &res) == 0 && res == NULL);
    /* A per-thread stream is blocking: the legacy stream waits for it. */
    OK(cuEventRecord(e, CU_STREAM_LEGACY));
    CHECK_RC(cuEventQuery(e), CUDA_ERROR_NOT_READY);
    fakecuda_stream_release(CU_STREAM_PER_THREAD);
    OK(cuEventQuery(e));
    CHECK(fakecuda_live("streams") == 2); /* per-thread streams are not the program's */

    OK(cuEventDestroy(e));
    OK(cuEventDestroy(e2));
    OK(cuStreamDestroy(s));
    OK(cuStreamDestroy(nb));
}

static CUstreamCaptureMode set_mode(CUstreamCaptureMode m) {
    OK(cuThreadExchangeStreamCaptureMode(&m));
    return m;
}

static void *capture_other_thread(void *arg) {
    (void)arg;
    if (cuCtxSetCurrent(g_ctx0) != CUDA_SUCCESS) return (void *)1;
    CUevent e;
    if (cuEventCreate(&e, 0) != CUDA_SUCCESS) return (void *)2;
    if (cuEventRecord(e, g_other_stream) != CUDA_SUCCESS) return (void *)3;
    /* Another thread's global capture forbids this thread's unsafe calls in the global mode. */
    if (cuEventQuery(e) != CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED) return (void *)4;
    CUstreamCaptureMode m = CU_STREAM_CAPTURE_MODE_THREAD_LOCAL;
    cuThreadExchangeStreamCaptureMode(&m);
    CUresult r = cuEventQuery(e); /* thread-local: other threads' captures do not count */
    cuThreadExchangeStreamCaptureMode(&m);
    cuEventDestroy(e);
    return r == CUDA_SUCCESS ? NULL : (void *)5;
}

void test_capture(void) {
    g_section = "stream capture";
    CUstream s, nb;
    CUevent e, e2;
    OK(cuStreamCreate(&s, 0));
    OK(cuStreamCreate(&nb, CU_STREAM_NON_BLOCKING));
    g_other_stream = nb;
    OK(cuEventCreate(&e, 0));
    OK(cuEventCreate(&e2, 0));
    CUstreamCaptureStatus cs;
    CUgraph g = NULL;
    CHECK_RC(cuStreamBeginCapture(NULL, CU_STREAM_CAPTURE_MODE_GLOBAL),
             CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED);
    CHECK_RC(cuStreamEndCapture(s, &g), CUDA_ERROR_ILLEGAL_STATE);

    /* An intact capture: events recorded in it are graph nodes, never complete. */
    OK(cuStreamBeginCapture(s, CU_STREAM_CAPTURE_MODE_GLOBAL));
    OK(cuStreamIsCapturing(s, &cs));
    CHECK(cs == CU_STREAM_CAPTURE_STATUS_ACTIVE);
    OK(cuStreamIsCapturing(nb, &cs));
    CHECK(cs == CU_STREAM_CAPTURE_STATUS_NONE);
    CHECK_RC(cuStreamIsCapturing(NULL, &cs), CUDA_ERROR_STREAM_CAPTURE_IMPLICIT);
    OK(cuEventRecord(e, s));
    CUstreamCaptureMode prev = set_mode(CU_STREAM_CAPTURE_MODE_RELAXED);
    CHECK(prev == CU_STREAM_CAPTURE_MODE_GLOBAL);
    CHECK_RC(cuEventQuery(e), CUDA_ERROR_CAPTURED_EVENT); /* even relaxed */
    OK(cuEventRecord(e2, nb));
    OK(cuEventQuery(e2)); /* relaxed: an unsafe call is allowed */
    CUdeviceptr p;
    OK(cuMemAlloc(&p, 4096));
    OK(cuMemFree(p));
    set_mode(prev);
    OK(cuStreamEndCapture(s, &g));
    CHECK(g != NULL);
    /* Another thread's unsafe call in the global mode fails and invalidates the capture. */
    OK(cuStreamBeginCapture(s, CU_STREAM_CAPTURE_MODE_GLOBAL));
    pthread_t t;
    void *res = (void *)1;
    CHECK(pthread_create(&t, NULL, capture_other_thread, NULL) == 0);
    CHECK(pthread_join(t, &res) == 0 && res == NULL);
    OK(cuStreamIsCapturing(s, &cs));
    CHECK(cs == CU_STREAM_CAPTURE_STATUS_INVALIDATED);
    CHECK_RC(cuStreamEndCapture(s, &g), CUDA_ERROR_STREAM_CAPTURE_INVALIDATED);
    CHECK(g == NULL);
    CHECK_RC(cuEventQuery(e), CUDA_ERROR_CAPTURED_EVENT); /* for good */
    CHECK_RC(cuEventSynchronize(e), CUDA_ERROR_CAPTURED_EVENT);
    OK(cuEventRecord(e, s)); /* recorded again outside a capture: an event again */
    OK(cuEventQuery(e));

    /* The global mode: this thread's own unsafe call invalidates its capture. */
    OK(cuStreamBeginCapture(s, CU_STREAM_CAPTURE_MODE_GLOBAL));
    CHECK_RC(cuMemAlloc(&p, 4096), CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED);
    OK(cuStreamIsCapturing(s, &cs));
    CHECK(cs == CU_STREAM_CAPTURE_STATUS_INVALIDATED);
    CHECK_RC(cuStreamEndCapture(s, &g), CUDA_ERROR_STREAM_CAPTURE_INVALIDATED);
    CHECK(g == NULL);
    /* ... and so does managed memory's (cuma's last rung of the out-of-memory ladder). */
    OK(cuStreamBeginCapture(s, CU_STREAM_CAPTURE_MODE_GLOBAL));
    CHECK_RC(cuMemAllocManaged(&p, 4096, CU_MEM_ATTACH_GLOBAL),
             CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED);
    OK(cuStreamIsCapturing(s, &cs));
    CHECK(cs == CU_STREAM_CAPTURE_STATUS_INVALIDATED);
    CHECK_RC(cuStreamEndCapture(s, &g), CUDA_ERROR_STREAM_CAPTURE_INVALIDATED);

    /* A record on the legacy stream while a blocking stream captures. */
    OK(cuStreamBeginCapture(s, CU_STREAM_CAPTURE_MODE_RELAXED));
    CHECK_RC(cuEventRecord(e2, CU_STREAM_LEGACY), CUDA_ERROR_STREAM_CAPTURE_IMPLICIT);
    CHECK_RC(cuStreamEndCapture(s, &g), CUDA_ERROR_STREAM_CAPTURE_INVALIDATED);
    /* ... a non-blocking stream's capture leaves the legacy stream alone. */
    OK(cuStreamBeginCapture(nb, CU_STREAM_CAPTURE_MODE_RELAXED));
    OK(cuEventRecord(e2, CU_STREAM_LEGACY));
    OK(cuEventQuery(e2)); /* relaxed capture: not forbidden */
    CHECK_RC(cuStreamSynchronize(nb), CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED);
    CHECK_RC(cuStreamEndCapture(nb, &g), CUDA_ERROR_STREAM_CAPTURE_INVALIDATED);

    OK(cuEventDestroy(e));
    OK(cuEventDestroy(e2));
    OK(cuStreamDestroy(s));
    OK(cuStreamDestroy(nb));
}

void test_proc_address(void) {
    g_section = "cuGetProcAddress";
    void *fn = NULL;
    CUdriverProcAddressQueryResult st = CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND;
    OK(cuGetProcAddress("cuMemGetInfo", &fn, 13000, CU_GET_PROC_ADDRESS_DEFAULT, &st));
    CHECK(fn == (void *)cuMemGetInfo_v2 && st == CU_GET_PROC_ADDRESS_SUCCESS);
    size_t fr = 0, tot = 0;
    OK(((CUresult(*)(size_t *, size_t *))fn)(&fr, &tot));
    CHECK(tot == CAP);
    OK(cuGetProcAddress("cuMemCreate", &fn, 12000, CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM,
                        &st));
    CHECK(fn == (void *)cuMemCreate && st == CU_GET_PROC_ADDRESS_SUCCESS);
    OK(cuGetProcAddress("cuMemCreate", &fn, 10000, 0, &st));
    CHECK(fn == NULL && st == CU_GET_PROC_ADDRESS_VERSION_NOT_SUFFICIENT);
    OK(cuGetProcAddress("cuStreamDestroy", &fn, 3000, 0, &st));
    CHECK(fn && fn == dlsym(RTLD_DEFAULT, "cuStreamDestroy") && st == CU_GET_PROC_ADDRESS_SUCCESS);
    OK(cuGetProcAddress("cuStreamDestroy", &fn, 13000, 0, &st));
    CHECK(fn == (void *)cuStreamDestroy_v2);
    OK(cuGetProcAddress("cuDeviceGetUuid", &fn, 11040, 0, &st));
    CHECK(fn == (void *)cuDeviceGetUuid_v2);
    OK(cuGetProcAddress("cuDevicePrimaryCtxReset", &fn, 11000, 0, &st));
    CHECK(fn == (void *)cuDevicePrimaryCtxReset_v2);
    OK(cuGetProcAddress("cuDevicePrimaryCtxReset", &fn, 10020, 0, &st));
    CHECK(fn && fn == dlsym(RTLD_DEFAULT, "cuDevicePrimaryCtxReset") &&
          fn != (void *)cuDevicePrimaryCtxReset_v2);
    OK(cuGetProcAddress("cuGetProcAddress", &fn, 12000, 0, NULL));
    CHECK(fn == (void *)cuGetProcAddress_v2);
    OK(cuGetProcAddress("cuNoSuchFunction", &fn, 13000, 0, &st));
    CHECK(fn == NULL && st == CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND);
    OK(cuGetProcAddress("cuMemAlloc_v2", &fn, 13000, 0, &st)); /* base names only */
    CHECK(fn == NULL && st == CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND);
    CHECK_RC(cuGetProcAddress("cuMemAlloc", &fn, 13010, 0, &st), CUDA_ERROR_INVALID_VALUE);
    CHECK_RC(cuGetProcAddress("cuMemAlloc", &fn, 13000, 8, &st), CUDA_ERROR_INVALID_VALUE);
    CHECK_RC(cuGetProcAddress(NULL, &fn, 13000, 0, &st), CUDA_ERROR_INVALID_VALUE);
}

void test_exports_and_counters(void) {
    g_section = "exports/counters";
    char present[] =
        "cuInit cuDriverGetVersion cuDeviceGet cuDeviceGetCount cuDeviceGetName "
        "cuDeviceGetUuid cuDeviceGetUuid_v2 cuDeviceGetAttribute cuDeviceTotalMem_v2 "
        "cuDeviceCanAccessPeer cuDevicePrimaryCtxRetain cuDevicePrimaryCtxRelease "
        "cuDevicePrimaryCtxRelease_v2 cuDevicePrimaryCtxReset cuDevicePrimaryCtxReset_v2 "
        "cuCtxSetCurrent cuCtxGetCurrent cuCtxGetDevice "
        "cuCtxSynchronize cuMemGetInfo_v2 cuMemAlloc_v2 cuMemFree_v2 cuMemAllocManaged "
        "cuMemAddressReserve cuMemAddressFree cuMemCreate cuMemRelease cuMemMap "
        "cuMemUnmap cuMemSetAccess cuMemGetAllocationGranularity cuStreamCreate "
        "cuStreamDestroy cuStreamDestroy_v2 cuStreamSynchronize cuStreamQuery "
        "cuStreamWaitEvent cuEventCreate cuEventDestroy cuEventDestroy_v2 cuEventRecord "
        "cuEventQuery cuEventSynchronize cuMemsetD8_v2 cuMemcpyHtoD_v2 cuMemcpyDtoH_v2 "
        "cuGetErrorString cuGetErrorName cuGetProcAddress_v2 cuStreamSynchronize_ptsz "
        "cuEventRecord_ptsz cuMemcpyHtoD_v2_ptds fakecuda_stream_hold "
        "fakecuda_stream_release fakecuda_set_fail fakecuda_calls "
        "fakecuda_reset_counters fakecuda_live fakecuda_reclaimed fakecuda_used_bytes ";
    for (char *save = NULL, *name = strtok_r(present, " ", &save); name;
         name = strtok_r(NULL, " ", &save)) {
        if (!dlsym(RTLD_DEFAULT, name)) fail(__LINE__, "exported symbol missing", name);
    }
    /* legacy 32-bit ABI names and internals are not exported */
    static const char *const absent[] = {"cuMemAlloc", "cuMemGetInfo", "cuMemFree", "fc_enter",
                                         "fc_cfg"};
    for (size_t i = 0; i < sizeof absent / sizeof absent[0]; i++) {
        if (dlsym(RTLD_DEFAULT, absent[i]))
            fail(__LINE__, "symbol must not be exported", absent[i]);
    }

    fakecuda_reset_counters();
    CHECK(fakecuda_calls("cuMemAlloc") == 0 && fakecuda_calls("cuStreamDestroy") == 0);
    CUdeviceptr p;
    for (int i = 0; i < 3; i++) CHECK_RC(cuMemAlloc(&p, 0), CUDA_ERROR_INVALID_VALUE);
    CHECK(fakecuda_calls("cuMemAlloc") == 3 && fakecuda_calls("cuMemAlloc_v2") == 3);
    CUresult (*plain_destroy)(CUstream) =
        (CUresult(*)(CUstream))dlsym(RTLD_DEFAULT, "cuStreamDestroy");
    CHECK_RC(plain_destroy(NULL), CUDA_ERROR_INVALID_HANDLE);
    CHECK(fakecuda_calls("cuStreamDestroy") == 1); /* alias counted once */
    fakecuda_reset_counters();
    CHECK(fakecuda_calls("cuMemAlloc") == 0);
}

struct worker_arg {
    int id;
};

static void *worker(void *arg) {
    int id = ((struct worker_arg *)arg)->id;
    if (cuCtxSetCurrent(g_ctx0) != CUDA_SUCCESS) return (void *)1;
    CUmemAllocationProp prop = prop_for(0);
    CUmemAccessDesc d = {{CU_MEM_LOCATION_TYPE_DEVICE, 0}, CU_MEM_ACCESS_FLAGS_PROT_READWRITE};
    for (int it = 0; it < 100; it++) {
        CUdeviceptr r;
        CUmemGenericAllocationHandle h;
        CUstream s;
        CUevent e;
        if (cuMemAddressReserve(&r, 2 * GRAN, 0, 0, 0) || cuMemCreate(&h, GRAN, &prop, 0) ||
            cuMemMap(r + GRAN, GRAN, 0, h, 0) || cuMemSetAccess(r + GRAN, GRAN, &d, 1))
            return (void *)2;
        H(r + GRAN)[it] = (unsigned char)id;
        if (H(r + GRAN)[it] != (unsigned char)id) return (void *)3;
        if (cuMemUnmap(r + GRAN, GRAN) || cuMemRelease(h) || cuMemAddressFree(r, 2 * GRAN))
            return (void *)4;
        if (cuStreamCreate(&s, 0) || cuEventCreate(&e, 0)) return (void *)5;
        fakecuda_stream_hold(s);
        if (cuEventRecord(e, s) != CUDA_SUCCESS || cuEventQuery(e) != CUDA_ERROR_NOT_READY)
            return (void *)6;
        fakecuda_stream_release(s);
        if (cuEventSynchronize(e) || cuEventDestroy(e) || cuStreamDestroy(s)) return (void *)7;
    }
    return NULL;
}

void test_threads(void) {
    g_section = "threads";
    enum { T = 4 };
    pthread_t t[T];
    struct worker_arg a[T];
    for (int i = 0; i < T; i++) {
        a[i].id = i + 1;
        CHECK(pthread_create(&t[i], NULL, worker, &a[i]) == 0);
    }
    for (int i = 0; i < T; i++) {
        void *res = (void *)-1;
        CHECK(pthread_join(t[i], &res) == 0);
        CHECK(res == NULL);
    }
}

/* ---- modes run in a re-executed child with a different environment ------- */

int run_mode(const char *mode) {
    if (strcmp(mode, "no-vmm") == 0) {
        g_section = "FAKECUDA_NO_VMM";
        OK(cuInit(0));
        int v = -1;
        OK(cuDeviceGetAttribute(&v, CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED, 0));
        CHECK(v == 0);
        CUmemAllocationProp prop = prop_for(0);
        CUmemGenericAllocationHandle h;
        size_t g;
        CHECK_RC(cuMemCreate(&h, GRAN, &prop, 0), CUDA_ERROR_NOT_SUPPORTED);
        CHECK_RC(cuMemGetAllocationGranularity(&g, &prop, 0), CUDA_ERROR_NOT_SUPPORTED);
        return 0;
    }
    if (strcmp(mode, "no-peer") == 0) {
        g_section = "FAKECUDA_NO_PEER";
        OK(cuInit(0));
        int can = -1;
        OK(cuDeviceCanAccessPeer(&can, 0, 1));
        CHECK(can == 0);
        return 0;
    }
    if (strcmp(mode, "no-device") == 0) {
        g_section = "FAKECUDA_DEVICES=0";
        CHECK_RC(cuInit(0), CUDA_ERROR_NO_DEVICE);
        int n;
        CHECK_RC(cuDeviceGetCount(&n), CUDA_ERROR_NOT_INITIALIZED);
        return 0;
    }
    if (strcmp(mode, "bad-env") == 0) {
        cuInit(0); /* must abort on FAKECUDA_CAPACITY=12Q */
        return 0;
    }
    fprintf(stderr, "unknown mode %s\n", mode);
    return 2;
}

/* Re-execute this binary in `mode` with one extra environment variable;
 * returns the wait status. */
static int spawn_mode(const char *mode, const char *var, const char *val) {
    fflush(NULL);
    pid_t pid = fork();
    CHECK(pid >= 0);
    if (pid == 0) {
        struct rlimit no_core = {0, 0};
        setrlimit(RLIMIT_CORE, &no_core);
        unsetenv("FAKECUDA_FAIL");
        setenv(var, val, 1);
        if (strcmp(mode, "bad-env") == 0 && !freopen("/dev/null", "w", stderr)) _exit(3);
        execl("/proc/self/exe", "test_fakecuda", mode, (char *)NULL);
        _exit(127);
    }
    int st;
    CHECK(waitpid(pid, &st, 0) == pid);
    return st;
}

void test_env_modes(void) {
    g_section = "environment modes";
    int st = spawn_mode("no-vmm", "FAKECUDA_NO_VMM", "1");
    CHECK(WIFEXITED(st) && WEXITSTATUS(st) == 0);
    st = spawn_mode("no-peer", "FAKECUDA_NO_PEER", "1");
    CHECK(WIFEXITED(st) && WEXITSTATUS(st) == 0);
    st = spawn_mode("no-device", "FAKECUDA_DEVICES", "0");
    CHECK(WIFEXITED(st) && WEXITSTATUS(st) == 0);
    st = spawn_mode("bad-env", "FAKECUDA_CAPACITY", "12Q");
    CHECK(WIFSIGNALED(st) && WTERMSIG(st) == SIGABRT);
}
