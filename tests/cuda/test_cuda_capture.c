// SPDX-License-Identifier: Apache-2.0
/* cuma while a stream captures a CUDA graph (the fake driver's capture rules: tests/fakecuda).
 *
 *   test_cuda_capture vmm|segment
 *
 * The program's thread begins a capture on a blocking stream in the default (global) mode, then
 * cuma allocates and frees on other streams, on the legacy stream and on the capturing stream,
 * and polls its fences. Under the rules of stream capture each of the old behaviours broke the
 * capture or cuma: a synchronous allocation or an event query in the global mode (the capture is
 * invalidated), a fence recorded on the legacy stream (CUDA_ERROR_STREAM_CAPTURE_IMPLICIT,
 * capture invalidated), a fence recorded on the capturing stream (a graph node: its event answers
 * CUDA_ERROR_CAPTURED_EVENT for ever, and memory freed on that stream is never reusable
 * elsewhere). Checked: the capture ends intact, and after it the memory freed during it is
 * reusable and can be given back.
 */
#include "cuda_test.h"

#include "cuma/cuma.h"

#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static void capture_round(const char *backend) {
    char conf[128];
    snprintf(conf, sizeof conf, "backend:%s,release_delay_ms:0,tcache:off", backend);
    cuma_heap *h = heap_make(conf);
    CUstream cap, other;
    CHECK_CU(cuStreamCreate(&cap, 0)); /* blocking: the legacy stream depends on it */
    other = stream_new();
    void *a, *b, *c, *d, *l;
    CHECK_OK(cuma_alloc(h, 4 * MB, cap, &a));
    CHECK_OK(cuma_alloc(h, 4 * MB, other, &b));
    CHECK_OK(cuma_alloc(h, 2 * MB, NULL, &l)); /* the legacy stream */
    CHECK_OK(cuma_free(h, l, NULL));

    CHECK_CU(cuStreamBeginCapture(cap, CU_STREAM_CAPTURE_MODE_GLOBAL));
    /* cuma's work while the capture runs, from the capturing thread in the global mode. */
    CHECK_OK(cuma_free(h, a, cap));
    CHECK_OK(cuma_free(h, b, other));
    CHECK_OK(cuma_alloc(h, 4 * MB, other, &c)); /* must not take a: its work is in the graph */
    CHECK(c != a);
    CHECK_OK(cuma_alloc(h, 1 * MB, cap, &d)); /* served at once, not a graph node */
    CHECK_OK(cuma_free(h, d, cap));
    CHECK_OK(cuma_poll(h)); /* asks every stream's fences: the legacy's and the capture's too */
    CHECK_OK(cuma_trim(h, 0));
    CHECK_OK(cuma_validate(h));
    CUstreamCaptureStatus cs;
    CHECK_CU(cuStreamIsCapturing(cap, &cs));
    CHECK(cs == CU_STREAM_CAPTURE_STATUS_ACTIVE);
    CUgraph g = NULL;
    CHECK_CU(cuStreamEndCapture(cap, &g));
    CHECK(g != NULL);

    /* After the capture: what was freed on the capturing stream is known done at the next poll,
     * reusable by the other stream and releasable. */
    CHECK_OK(cuma_free(h, c, other));
    CHECK_OK(cuma_poll(h));
    CHECK_OK(cuma_trim(h, 0));
    cuma_stats st;
    CHECK_OK(cuma_get_stats(h, &st));
    CHECK(st.active_allocs == 0);
    CHECK(st.reserved_bytes == 0); /* nothing held back by a fence that never completes */
    CHECK_OK(cuma_validate(h));
    cuma_heap_destroy(h);
    CHECK_CU(cuStreamDestroy(cap));
    CHECK_CU(cuStreamDestroy(other));
}

/* A thread that used its per-thread default stream exits while another thread captures on a
 * blocking stream: its slot's last fence cannot go on the legacy stream then. After the capture
 * the memory it freed is reusable and can be given back all the same. */
typedef struct exit_arg {
    cuma_heap *h;
    CUcontext ctx;
} exit_arg;

static void *exit_worker(void *arg) {
    exit_arg *e = arg;
    CHECK_CU(cuCtxSetCurrent(e->ctx));
    void *p;
    CHECK_OK(cuma_alloc(e->h, 4 * MB, CU_STREAM_PER_THREAD, &p));
    CHECK_OK(cuma_free(e->h, p, CU_STREAM_PER_THREAD));
    return NULL;
}

static void capture_thread_exit(const char *backend, CUcontext ctx) {
    char conf[128];
    /* Never released on its own: no fence is asked for before the thread exits. */
    snprintf(conf, sizeof conf, "backend:%s,release_delay_ms:never,tcache:off", backend);
    cuma_heap *h = heap_make(conf);
    CUstream cap;
    CHECK_CU(cuStreamCreate(&cap, 0)); /* blocking: the legacy stream depends on it */
    CHECK_CU(cuStreamBeginCapture(cap, CU_STREAM_CAPTURE_MODE_RELAXED));
    exit_arg e = {h, ctx};
    pthread_t th;
    CHECK(pthread_create(&th, NULL, exit_worker, &e) == 0);
    CHECK(pthread_join(th, NULL) == 0);
    CUgraph g = NULL;
    CHECK_CU(cuStreamEndCapture(cap, &g));
    CHECK_OK(cuma_poll(h));
    CHECK_OK(cuma_trim(h, 0));
    cuma_stats st;
    CHECK_OK(cuma_get_stats(h, &st));
    CHECK(st.active_allocs == 0);
    CHECK(st.reserved_bytes == 0); /* the exited thread's free is not held for good */
    CHECK_OK(cuma_validate(h));
    cuma_heap_destroy(h);
    CHECK_CU(cuStreamDestroy(cap));
}

/* stream_order:on: a stream that takes pages another stream's pending work still uses waits
 * for that work on the device (cuStreamWaitEvent), once for all the pages whose tags one wait
 * covers. A capturing stream may not: a wait queued on it before the capture does not order
 * the graph's work, which runs whenever the graph is launched. So while it captures it gets
 * none of those pages, even those an earlier wait of it covered, and new pages instead. */
static void capture_order(void) {
    cuma_heap *h = heap_make("backend:vmm,release_delay_ms:100000,tcache:off,stream_order:on");
    CUstream cap = stream_new(), other = stream_new();
    enum { N = 8 };
    void *p[N], *q, *r;
    for (int i = 0; i < N; i++) CHECK_OK(cuma_alloc(h, 2 * MB, other, &p[i]));
    fakecuda_stream_hold(other); /* its work on them still runs when it frees them */
    for (int i = 0; i < N; i++) CHECK_OK(cuma_free(h, p[i], other));
    /* Half the pages in one allocation, then one by one: a single wait covers every tag. */
    unsigned long w0 = fakecuda_calls("cuStreamWaitEvent");
    cuma_stats s0 = heap_stats(h);
    void *big;
    CHECK_OK(cuma_alloc(h, N / 2 * 2 * MB, cap, &big));
    void *one[N / 2 - 1];
    for (int i = 0; i < N / 2 - 1; i++) CHECK_OK(cuma_alloc(h, 2 * MB, cap, &one[i]));
    cuma_stats s1 = heap_stats(h);
    CHECK(s1.page_creates == s0.page_creates); /* all of them other's pages */
    CHECK(fakecuda_calls("cuStreamWaitEvent") == w0 + 1 && s1.stream_waits == s0.stream_waits + 1);
    /* The capture begins: the page left is other's, its tag covered by that wait. */
    CHECK_CU(cuStreamBeginCapture(cap, CU_STREAM_CAPTURE_MODE_GLOBAL));
    CHECK_OK(cuma_alloc(h, 2 * MB, cap, &q));
    cuma_stats s2 = heap_stats(h);
    CHECK(s2.page_creates == s1.page_creates + 1); /* a new page, not other's pending one */
    CHECK(fakecuda_calls("cuStreamWaitEvent") == w0 + 1 && s2.stream_waits == s1.stream_waits);
    CUgraph g = NULL;
    CHECK_CU(cuStreamEndCapture(cap, &g));
    CHECK(g != NULL);
    /* Captured no more: other's page serves it, under the wait it has. */
    CHECK_OK(cuma_alloc(h, 2 * MB, cap, &r));
    CHECK(heap_stats(h).page_creates == s2.page_creates);
    CHECK(fakecuda_calls("cuStreamWaitEvent") == w0 + 1);
    fakecuda_stream_release(other);
    CHECK_OK(cuma_free(h, big, cap));
    for (int i = 0; i < N / 2 - 1; i++) CHECK_OK(cuma_free(h, one[i], cap));
    CHECK_OK(cuma_free(h, q, cap));
    CHECK_OK(cuma_free(h, r, cap));
    CHECK_OK(cuma_validate(h));
    cuma_heap_destroy(h);
    CHECK_CU(cuStreamDestroy(cap));
    CHECK_CU(cuStreamDestroy(other));
}

int main(int argc, char **argv) {
    const char *backend = argc > 1 ? argv[1] : "vmm";
    test_ctx t = test_ctx_open(0);
    capture_round(backend);
    capture_thread_exit(backend, t.ctx);
    if (!strcmp(backend, "vmm")) capture_order();
    test_ctx_close(&t);
    printf("test_cuda_capture %s: all checks passed\n", backend);
    return 0;
}
