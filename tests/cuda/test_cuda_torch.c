// SPDX-License-Identifier: Apache-2.0
/* PyTorch's entry points (include/cuma/torch.h) on the CUDA backend over the fake driver.
 *
 *   test_cuda_torch   (CUMA_CONF: backend:vmm, set by ctest)
 *
 * Graph capture: PyTorch keeps the memory a graph uses in pools of its own allocator, and cuma
 * implements none of the pluggable allocator's pool hooks. An allocation made while the stream
 * captured was served from the heap (this test's check failed: CUMA_OK), and what the capture
 * freed could be handed out again once it ended, while the graph's replays still write it. Now
 * an allocation on a capturing stream fails, saying why, and allocations on other streams, and
 * on the same one after the capture, go on.
 *
 * A free in a forked child of the parent's memory says why it is refused.
 */
#include "cuda_test.h"

#include "cuma/cuma.h"
#include "cuma/torch.h"

#include <stdio.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

static void test_capture_refused(void) {
    test_ctx t = test_ctx_open(0);
    CUstream cap, other = stream_new();
    CHECK_CU(cuStreamCreate(&cap, CU_STREAM_NON_BLOCKING));
    void *before, *p = NULL, *q;
    CHECK_OK(cuma_torch_alloc(1 * MB, 0, (cudaStream_t)cap, &before));
    CHECK_CU(cuStreamBeginCapture(cap, CU_STREAM_CAPTURE_MODE_RELAXED));
    cuma_status st = cuma_torch_alloc(1 * MB, 0, (cudaStream_t)cap, &p);
    printf("during a capture: %s\n", cuma_last_error());
    CHECK(st == CUMA_ERR_UNSUPPORTED && !p && strstr(cuma_last_error(), "CUDA graph"));
    /* Frees go on (PyTorch's free cannot fail), and so do other streams. */
    cuma_torch_free(before, 1 * MB, 0, (cudaStream_t)cap);
    CHECK_OK(cuma_torch_alloc(1 * MB, 0, (cudaStream_t)other, &q));
    cuma_torch_free(q, 1 * MB, 0, (cudaStream_t)other);
    CUgraph g = NULL;
    CHECK_CU(cuStreamEndCapture(cap, &g));
    CHECK(g != NULL); /* the fake's placeholder: no graph to destroy */
    /* After the capture the stream allocates again. */
    CHECK_OK(cuma_torch_alloc(1 * MB, 0, (cudaStream_t)cap, &p));
    CHECK(p != NULL);
    cuma_torch_free(p, 1 * MB, 0, (cudaStream_t)cap);
    cuma_heap *h = cuma_torch_created_heap(0);
    CHECK(h != NULL);
    CHECK_OK(cuma_validate(h));
    CHECK_CU(cuStreamDestroy(cap));
    CHECK_CU(cuStreamDestroy(other));
    test_ctx_close(&t);
}

/* A forked child's free of the parent's tensor: refused, because the heap came through fork,
 * and that is the reason left (it used to be replaced by "not a live allocation of any default
 * heap", after a search of the other heaps). */
static void test_free_in_child_says_why(void) {
    void *p;
    CHECK_OK(cuma_torch_alloc(1 * MB, 0, NULL, &p));
    pid_t c = fork();
    CHECK(c >= 0);
    if (c == 0) {
        cuma_torch_free(p, 1 * MB, 0, NULL);
        const char *why = cuma_last_error();
        fprintf(stderr, "child's free: %s\n", why);
        _exit(strstr(why, "came through fork") && !strstr(why, "not a live allocation") ? 0 : 1);
    }
    int ws;
    CHECK(waitpid(c, &ws, 0) == c);
    CHECK(WIFEXITED(ws) && WEXITSTATUS(ws) == 0);
    cuma_torch_free(p, 1 * MB, 0, NULL);
}

int main(void) {
    test_capture_refused();
    test_free_in_child_says_why();
    printf("test_cuda_torch: all passed\n");
    return 0;
}
