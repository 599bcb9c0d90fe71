// SPDX-License-Identifier: Apache-2.0
/* Events of the right context (FAKECUDA_DEVICES=2): an event can only be recorded on a stream of
 * its own context (the fake refuses others with CUDA_ERROR_INVALID_HANDLE, as the driver does).
 * A block of device 0's heap that the program also uses on a stream of device 1
 * (cuma_record_stream) must be fenced with an event of device 1's context: with the heap's own
 * events the record failed, the fence never completed and the block stayed deferred for good.
 *
 *   test_cuda_contexts
 */
#include "cuda_test.h"

#include "cuma/cuma.h"

#include <stdio.h>

int main(void) {
    test_ctx t0 = test_ctx_open(0);
    CUdevice dev1;
    CUcontext ctx1;
    CHECK_CU(cuDeviceGet(&dev1, 1));
    CHECK_CU(cuDevicePrimaryCtxRetain(&ctx1, dev1));
    CHECK_CU(cuCtxSetCurrent(ctx1));
    CUstream s1 = stream_new(); /* a stream of device 1 */
    CHECK_CU(cuCtxSetCurrent(t0.ctx));
    CUstream s0 = stream_new();

    cuma_heap *h = heap_make("backend:vmm,device:0,release_delay_ms:0,tcache:off");
    void *p, *q;
    CHECK_OK(cuma_alloc(h, 4 * MB, s0, &p));
    CHECK_OK(cuma_record_stream(h, p, s1)); /* a peer copy on device 1's stream */
    fakecuda_stream_hold(s1);
    CHECK_OK(cuma_free(h, p, s0));
    CHECK_OK(cuma_poll(h));
    cuma_stats st;
    CHECK_OK(cuma_get_stats(h, &st));
    CHECK(st.active_allocs == 1); /* deferred: device 1's work still runs */
    fakecuda_stream_release(s1);
    CHECK_OK(cuma_poll(h));
    CHECK_OK(cuma_get_stats(h, &st));
    CHECK(st.active_allocs == 0); /* the fence on device 1's stream completed */
    CHECK_OK(cuma_alloc(h, 4 * MB, s0, &q));
    CHECK_OK(cuma_free(h, q, s0));
    CHECK_OK(cuma_trim(h, 0));
    CHECK_OK(cuma_get_stats(h, &st));
    CHECK(st.reserved_bytes == 0);
    CHECK_OK(cuma_validate(h));
    cuma_heap_destroy(h);
    CHECK(fakecuda_live("events") == 0); /* both contexts' events went with the heap */
    CHECK_CU(cuStreamDestroy(s0));
    CHECK_CU(cuCtxSetCurrent(ctx1));
    CHECK_CU(cuStreamDestroy(s1));
    CHECK_CU(cuCtxSetCurrent(t0.ctx));
    CHECK_CU(cuDevicePrimaryCtxRelease(dev1));
    test_ctx_close(&t0);
    printf("test_cuda_contexts: all checks passed\n");
    return 0;
}
