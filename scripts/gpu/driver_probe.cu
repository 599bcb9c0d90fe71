// SPDX-License-Identifier: Apache-2.0
// driver_probe: two questions about the real driver that cuma's design rests on and that the
// fake driver (tests/fakecuda) can only assume. Nothing of cuma is linked in.
//
// 1. A thread's per-thread default stream after the thread exits. cuma fences memory freed on
//    a dead thread's per-thread stream on the legacy default stream (src/heap/thread_streams.c),
//    which is right only if work queued on the legacy stream still waits for the work that
//    thread left queued. A thread queues a ~200 ms kernel on cudaStreamPerThread that sets a
//    flag (in mapped host memory) at its end, and exits without synchronising; the main thread
//    then records an event on the legacy stream (what cuma's fence is) and queues a kernel there
//    that copies the flag. The flag read by the host once the event completes, and the kernel's
//    copy, are 1 when the legacy stream waited, 0 when it did not (cuma's fence is wrong). Both
//    answer the question only if the thread's kernel was still running after they were queued
//    (the host reads the flag then): when the thread's exit waited for its stream, the case is
//    reported untested, not passed. The same with the thread still alive is the control.
// 2. Whether cuMemCreate, cuMemMap, cuMemSetAccess, cuMemUnmap and cuMemRelease wait for work
//    on other streams. Each call is timed with the device idle (median of 5) and once while a
//    ~300 ms kernel runs on a non-blocking stream, a kernel of its own for each call (a call
//    that waited would leave the device idle for the calls after it, hiding their waits). A
//    call that takes about the kernel's time waits for it (the fake driver's FAKECUDA_SYNC_VMM=1
//    models that for unmap and set-access); the heap's early remaps and its release thread
//    assume these calls do not stall the host behind unrelated work.
//
// usage: driver_probe [--device N]
// Prints one "PROBE ..." line per finding and a last "PROBE RESULT: ..." line. Exit status 0
// when the legacy stream waited for the dead thread's work (or the case could not be made: the
// exit waited, which the result line says), 1 when it did not or a CUDA call failed, 2 on a
// usage error.
// Build: scripts/gpu-check.sh (nvcc, the CUDA runtime, -lcuda).
#include <cuda.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <thread>
#include <time.h>
#include <vector>

static double now_ms() {
    timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1e3 + ts.tv_nsec / 1e6;
}

static void die(const char *what, const char *why) {
    printf("PROBE RESULT: FAIL: %s: %s\n", what, why);
    exit(1);
}

#define RT(call)                                                                                   \
    do {                                                                                           \
        cudaError_t e_ = (call);                                                                   \
        if (e_ != cudaSuccess) die(#call, cudaGetErrorString(e_));                                 \
    } while (0)

#define CU(call)                                                                                   \
    do {                                                                                           \
        CUresult r_ = (call);                                                                      \
        if (r_ != CUDA_SUCCESS) {                                                                  \
            const char *s_ = "?";                                                                  \
            cuGetErrorString(r_, &s_);                                                             \
            die(#call, s_);                                                                        \
        }                                                                                          \
    } while (0)

// Spins for `cycles` SM clocks, then sets *flag (one thread: the device stays mostly idle, so
// the kernel's duration is what the clock says).
__global__ void spin_then_set(long long cycles, volatile int *flag, int value) {
    long long t0 = clock64();
    while (clock64() - t0 < cycles) {
    }
    __threadfence_system();
    *flag = value;
}

__global__ void copy_flag(const volatile int *flag, int *out) {
    *out = *flag;
}

static long long g_cycles_per_ms;
static int g_ordinal; // --device: each thread sets it, the current device being per thread

// Question 1, one case: the legacy stream's view of the flag (its event's and its kernel's),
// whether the thread's kernel was still running after both were queued, the join time and the
// time until the legacy kernel finished, both from the start of the thread's kernel.
struct ptds_case {
    int seen, at_event, pending;
    double join_ms, done_ms;
};

static ptds_case ptds_run(volatile int *h_flag, int *d_flag, int *d_out, bool thread_exits) {
    RT(cudaDeviceSynchronize());
    *h_flag = 0;
    RT(cudaMemset(d_out, -1, sizeof(int)));
    RT(cudaDeviceSynchronize());
    cudaEvent_t ev;
    RT(cudaEventCreateWithFlags(&ev, cudaEventDisableTiming));
    std::atomic<bool> launched{false}, release{false};
    std::atomic<double> t0{0};
    std::thread t([&] {
        if (cudaSetDevice(g_ordinal) != cudaSuccess) die("cudaSetDevice in the thread", "failed");
        t0 = now_ms();
        spin_then_set<<<1, 1, 0, cudaStreamPerThread>>>(200 * g_cycles_per_ms, d_flag, 1);
        if (cudaGetLastError() != cudaSuccess) die("spin on cudaStreamPerThread", "launch failed");
        launched = true;
        while (!thread_exits && !release) std::this_thread::yield();
    });
    while (!launched) std::this_thread::yield();
    ptds_case c{};
    if (thread_exits) {
        t.join();
        c.join_ms = now_ms() - t0.load();
    }
    RT(cudaEventRecord(ev, cudaStreamLegacy)); // cuma's fence: an event on the legacy stream
    copy_flag<<<1, 1, 0, cudaStreamLegacy>>>(d_flag, d_out);
    RT(cudaGetLastError());
    c.pending = *h_flag == 0; // both were queued while the thread's kernel still ran
    RT(cudaEventSynchronize(ev));
    c.at_event = *h_flag;
    RT(cudaStreamSynchronize(cudaStreamLegacy));
    c.done_ms = now_ms() - t0.load();
    if (!thread_exits) {
        release = true;
        t.join();
        c.join_ms = now_ms() - t0.load();
    }
    RT(cudaMemcpy(&c.seen, d_out, sizeof(int), cudaMemcpyDeviceToHost));
    RT(cudaDeviceSynchronize());
    RT(cudaEventDestroy(ev));
    return c;
}

// "waited", "did NOT wait" or "untested" for one case.
static const char *ptds_verdict(const ptds_case &c) {
    if (c.seen != 1 || c.at_event != 1) return "did NOT wait";
    return c.pending ? "waited" : "untested (the thread's kernel was done before)";
}

static double median(std::vector<double> v) {
    std::sort(v.begin(), v.end());
    return v.empty() ? 0 : v[v.size() / 2];
}

enum { CREATE, MAP, ACCESS, UNMAP, RELEASE, NCALLS };
static const char *call_names[NCALLS] = {"cuMemCreate", "cuMemMap", "cuMemSetAccess", "cuMemUnmap",
                                         "cuMemRelease"};

// One page through the five calls, each timed. With busy set, a ~300 ms kernel is queued on
// it just before call `beside`, and *kernel_ms is how long that kernel took from its launch.
static void vmm_cycle(CUdevice dev, CUdeviceptr va, size_t page, double ms[NCALLS],
                      cudaStream_t busy = nullptr, int beside = -1, int *d_flag = nullptr,
                      double *kernel_ms = nullptr) {
    CUmemAllocationProp prop = {};
    prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
    prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    prop.location.id = (int)dev;
    CUmemAccessDesc desc = {};
    desc.location = prop.location;
    desc.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
    CUmemGenericAllocationHandle h;
    double k0 = 0;
    for (int k = 0; k < NCALLS; k++) {
        if (busy && k == beside) {
            k0 = now_ms();
            spin_then_set<<<1, 1, 0, busy>>>(300 * g_cycles_per_ms, d_flag, 2);
            RT(cudaGetLastError());
        }
        double t = now_ms();
        switch (k) {
        case CREATE:
            CU(cuMemCreate(&h, page, &prop, 0));
            break;
        case MAP:
            CU(cuMemMap(va, page, 0, h, 0));
            break;
        case ACCESS:
            CU(cuMemSetAccess(va, page, &desc, 1));
            break;
        case UNMAP:
            CU(cuMemUnmap(va, page));
            break;
        case RELEASE:
            CU(cuMemRelease(h));
            break;
        }
        ms[k] = now_ms() - t;
        if (busy && k == beside) {
            RT(cudaStreamSynchronize(busy));
            *kernel_ms = now_ms() - k0;
        }
    }
}

int main(int argc, char **argv) {
    int ordinal = 0;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--device") && i + 1 < argc) {
            ordinal = atoi(argv[++i]);
        } else {
            fprintf(stderr, "usage: driver_probe [--device N]\n");
            return 2;
        }
    }
    g_ordinal = ordinal;
    RT(cudaSetDevice(ordinal));
    RT(cudaFree(nullptr)); // the primary context, which the driver API calls below use
    int khz = 0;
    RT(cudaDeviceGetAttribute(&khz, cudaDevAttrClockRate, ordinal));
    g_cycles_per_ms = khz > 0 ? khz : 1500000;
    CUdevice dev;
    CU(cuDeviceGet(&dev, ordinal));

    int *h_flag, *d_flag, *d_out;
    RT(cudaHostAlloc(&h_flag, sizeof(int), cudaHostAllocMapped));
    RT(cudaHostGetDevicePointer(&d_flag, h_flag, 0));
    RT(cudaMalloc(&d_out, sizeof(int)));
    ptds_case alive = ptds_run(h_flag, d_flag, d_out, false);
    ptds_case dead = ptds_run(h_flag, d_flag, d_out, true);
    printf("PROBE ptds alive: legacy %s: its event saw %d, its kernel %d, after %.1f ms (the "
           "control)\n",
           ptds_verdict(alive), alive.at_event, alive.seen, alive.done_ms);
    printf("PROBE ptds exited: legacy %s: its event saw %d, its kernel %d, after %.1f ms; the "
           "thread's join took %.1f ms (%s)\n",
           ptds_verdict(dead), dead.at_event, dead.seen, dead.done_ms, dead.join_ms,
           dead.pending ? "it exited with its kernel still running"
                        : "its exit waited for its stream");

    size_t page = 0;
    CUmemAllocationProp prop = {};
    prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
    prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    prop.location.id = ordinal;
    CU(cuMemGetAllocationGranularity(&page, &prop, CU_MEM_ALLOC_GRANULARITY_RECOMMENDED));
    CUdeviceptr va;
    CU(cuMemAddressReserve(&va, page, 0, 0, 0));
    std::vector<double> idle[NCALLS];
    for (int r = 0; r < 6; r++) {
        double ms[NCALLS];
        vmm_cycle(dev, va, page, ms);
        if (r == 0) continue; // the first touches the driver's own first-use paths
        for (int k = 0; k < NCALLS; k++) idle[k].push_back(ms[k]);
    }
    cudaStream_t busy;
    RT(cudaStreamCreateWithFlags(&busy, cudaStreamNonBlocking));
    RT(cudaDeviceSynchronize());
    int stalled = 0;
    for (int k = 0; k < NCALLS; k++) {
        double ms[NCALLS], kernel_ms = 0;
        vmm_cycle(dev, va, page, ms, busy, k, d_flag, &kernel_ms);
        bool waits = ms[k] > 0.5 * kernel_ms && ms[k] > 20 * (median(idle[k]) + 0.01);
        stalled += waits;
        printf("PROBE vmm %-15s idle median %.3f ms, beside a %.1f ms kernel on another stream "
               "%.3f ms%s\n",
               call_names[k], median(idle[k]), kernel_ms, ms[k], waits ? " (waited for it)" : "");
    }
    CU(cuMemAddressFree(va, page));
    RT(cudaStreamDestroy(busy));
    RT(cudaFreeHost(h_flag));
    RT(cudaFree(d_out));

    bool ok = dead.seen == 1 && dead.at_event == 1 && alive.seen == 1 && alive.at_event == 1;
    printf("PROBE RESULT: %s: legacy stream after a thread's exit %s (alive: %s), join %.0f ms; "
           "%d of 5 VMM calls waited for another stream's kernel%s\n",
           ok ? "ok" : "FAIL", ptds_verdict(dead), ptds_verdict(alive), dead.join_ms, stalled,
           stalled ? " (the fake driver models that with FAKECUDA_SYNC_VMM=1)"
                   : " (as the fake driver does by default)");
    return ok ? 0 : 1;
}
