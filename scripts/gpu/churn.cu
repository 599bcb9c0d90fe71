// SPDX-License-Identifier: Apache-2.0
// churn: cuma on a real GPU, under kernels that write and verify every byte it hands out.
//
// Part 1 (churn): one heap (default conf "backend:vmm"), two non-blocking streams, a table of
// live blocks. Each iteration frees a random slot's block and allocates a new one of a random
// size (256 B .. 64 MiB, log-uniform, any byte count) on the next stream in turn, and launches
// a kernel that writes a pattern derived from each byte's address and the block's generation.
// Blocks come in three kinds:
//   0 single:  written, verified and freed on the stream they were allocated on;
//   1 handoff: written on A, verified on B (after an event), freed on B (the last user);
//   2 record:  written on A, verified on B (after an event), cuma_record_stream(B), verified
//              again and freed on A: cuma must not reuse it until B's work is done.
// Verify kernels first sleep a random 0..200 us, so freed memory is still being read on the
// GPU while the host frees it and allocates again: a block reused too early by the other
// stream is overwritten under a running verify, which counts the mismatches (per kind) in a
// device counter. The host also checks alignment, cuma_block_size and that no two live blocks
// overlap. Every 250 iterations cuma_trim(heap, 0), every 500 cuma_validate. At the end:
// mismatches == 0, no CUDA error, cuma_validate OK, nothing live, and after a trim no
// memory reserved; then the stats JSON.
//
// Part 2 (bench, --bench): medians of the driver's cuMemCreate (one page of the recommended
// granularity, 2 MiB), cuMemMap, cuMemSetAccess, cuMemUnmap, cuMemRelease, each call timed on
// its own with the device idle between phases; then cuma's alloc+free pair of a cached 4 KiB
// and 2 MiB block and an uncached 64 MiB block (cuma_trim(0) between pairs), with
// cudaMallocAsync/cudaFreeAsync and cudaMalloc/cudaFree as reference points.
//
// usage: churn [--conf STR] [--iters N] [--seed N] [--bench] [--bench-only]
// Exit status 0 when every check passed, 1 when one failed, 2 on a usage error.
// Build: scripts/gpu-check.sh (nvcc, libcuma.a, the CUDA runtime, -lcuda).
#include <cuda.h>
#include <cuda_runtime.h>

#include <cuma/cuma.h>

#include <algorithm>
#include <cinttypes>
#include <cmath>
#include <cstdarg>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <time.h>
#include <vector>

// ---- failure reporting --------------------------------------------------------------------

static int g_failures = 0;
static cuma_heap *g_heap = nullptr; // for the stats dump on a fatal error

static void print_stats_json(cuma_heap *h, const char *label) {
    if (!h) return;
    size_t need = 0;
    char probe[1];
    cuma_stats_json(h, probe, sizeof probe, &need);
    std::vector<char> buf(need + 1);
    if (cuma_stats_json(h, buf.data(), buf.size(), nullptr) == CUMA_OK)
        printf("%s %s\n", label, buf.data());
}

[[noreturn]] static void fatal(const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    fprintf(stdout, "churn: FATAL: ");
    vfprintf(stdout, fmt, ap);
    fprintf(stdout, "\n");
    va_end(ap);
    print_stats_json(g_heap, "STATS_AT_FAILURE");
    printf("CHURN RESULT: FAIL (fatal error above)\n");
    fflush(stdout);
    exit(1);
}

static void check_failed(const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    fprintf(stdout, "churn: CHECK FAILED: ");
    vfprintf(stdout, fmt, ap);
    fprintf(stdout, "\n");
    va_end(ap);
    g_failures++;
}

#define CK(call)                                                                                   \
    do {                                                                                           \
        cudaError_t e_ = (call);                                                                   \
        if (e_ != cudaSuccess)                                                                     \
            fatal("%s:%d: %s: %s (%s)", __FILE__, __LINE__, #call, cudaGetErrorName(e_),          \
                  cudaGetErrorString(e_));                                                         \
    } while (0)

#define CU(call)                                                                                   \
    do {                                                                                           \
        CUresult r_ = (call);                                                                      \
        if (r_ != CUDA_SUCCESS) {                                                                  \
            const char *n_ = nullptr;                                                              \
            cuGetErrorName(r_, &n_);                                                               \
            fatal("%s:%d: %s: %s", __FILE__, __LINE__, #call, n_ ? n_ : "?");                      \
        }                                                                                          \
    } while (0)

#define CM(call)                                                                                   \
    do {                                                                                           \
        cuma_status s_ = (call);                                                                   \
        if (s_ != CUMA_OK)                                                                         \
            fatal("%s:%d: %s: %s: %s", __FILE__, __LINE__, #call, cuma_status_string(s_),          \
                  cuma_last_error());                                                              \
    } while (0)

// ---- small helpers -------------------------------------------------------------------------

static uint64_t now_ns() {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

// xorshift64*: the host's random numbers, reproducible from --seed.
struct Rng {
    uint64_t s;
    explicit Rng(uint64_t seed) : s(seed * 0x9E3779B97F4A7C15ull + 0x1234567ull) {
        if (!s) s = 1;
    }
    uint64_t next() {
        s ^= s >> 12;
        s ^= s << 25;
        s ^= s >> 27;
        return s * 0x2545F4914F6CDD1Dull;
    }
    uint64_t below(uint64_t n) { return next() % n; }
    double unit() { return (double)(next() >> 11) / 9007199254740992.0; }
};

static double median(std::vector<double> v) {
    if (v.empty()) return 0;
    std::sort(v.begin(), v.end());
    size_t n = v.size();
    return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

static double pct(std::vector<double> v, double p) {
    if (v.empty()) return 0;
    std::sort(v.begin(), v.end());
    size_t i = (size_t)(p * (double)(v.size() - 1) + 0.5);
    return v[std::min(i, v.size() - 1)];
}

static std::string human(double bytes) {
    char b[32];
    if (bytes >= 1 << 30) snprintf(b, sizeof b, "%.2f GiB", bytes / (1 << 30));
    else if (bytes >= 1 << 20) snprintf(b, sizeof b, "%.1f MiB", bytes / (1 << 20));
    else if (bytes >= 1 << 10) snprintf(b, sizeof b, "%.1f KiB", bytes / (1 << 10));
    else snprintf(b, sizeof b, "%.0f B", bytes);
    return b;
}

// ---- kernels -------------------------------------------------------------------------------

// The expected value of the 32-bit word (or byte) at address a of a block of generation g.
__host__ __device__ static inline uint32_t pattern(uint64_t a, uint64_t g) {
    uint64_t x = (a ^ (g << 40) ^ (g >> 24)) * 0x9E3779B97F4A7C15ull;
    x ^= x >> 31;
    x *= 0xD6E8FEB86659FD93ull;
    x ^= x >> 29;
    return (uint32_t)x;
}

__device__ static inline uint64_t global_ns() {
    uint64_t t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}

__global__ void fill_kernel(uint8_t *p, size_t bytes, uint64_t gen) {
    uint32_t *w = (uint32_t *)p; // cuma hands out at least 256-byte aligned blocks
    size_t words = bytes / 4;
    size_t stride = (size_t)gridDim.x * blockDim.x;
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < words; i += stride)
        w[i] = pattern((uint64_t)(uintptr_t)&w[i], gen);
    if (blockIdx.x == 0 && threadIdx.x < bytes % 4) {
        size_t i = words * 4 + threadIdx.x;
        p[i] = (uint8_t)pattern((uint64_t)(uintptr_t)&p[i], gen);
    }
}

// Sleeps delay_ns first (every thread block), then checks every word and tail byte.
__global__ void verify_kernel(const uint8_t *p, size_t bytes, uint64_t gen, uint32_t delay_ns,
                              unsigned long long *bad) {
    if (delay_ns) {
        if (threadIdx.x == 0) {
            uint64_t t0 = global_ns();
            while (global_ns() - t0 < delay_ns) __nanosleep(2000);
        }
        __syncthreads();
    }
    const uint32_t *w = (const uint32_t *)p;
    size_t words = bytes / 4;
    size_t stride = (size_t)gridDim.x * blockDim.x;
    unsigned long long mine = 0;
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < words; i += stride)
        mine += w[i] != pattern((uint64_t)(uintptr_t)&w[i], gen);
    if (blockIdx.x == 0 && threadIdx.x < bytes % 4) {
        size_t i = words * 4 + threadIdx.x;
        mine += p[i] != (uint8_t)pattern((uint64_t)(uintptr_t)&p[i], gen);
    }
    if (mine) atomicAdd(bad, mine);
}

static unsigned grid_for(size_t bytes) {
    size_t words = bytes / 4 + 1;
    size_t blocks = (words + 255) / 256;
    return (unsigned)std::min<size_t>(std::max<size_t>(blocks, 1), 1024);
}

// ---- part 1: churn -------------------------------------------------------------------------

enum Kind { SINGLE = 0, HANDOFF = 1, RECORD = 2, NKINDS = 3 };
static const char *kind_name[NKINDS] = {"single", "handoff", "record_stream"};

struct Slot {
    uint8_t *p = nullptr;
    size_t size = 0;
    uint64_t gen = 0;
    int last = 0; // stream index that last used it (and frees it)
    Kind kind = SINGLE;
};

struct Churn {
    cuma_heap *heap = nullptr;
    cudaStream_t st[2] = {nullptr, nullptr};
    std::vector<cudaEvent_t> ev;
    std::vector<Slot> slots;
    unsigned long long *d_bad = nullptr; // NKINDS counters
    Rng rng{1};
    uint64_t gen = 0;
    uint64_t allocs = 0, frees = 0, verifies = 0, trims = 0, validates = 0, records = 0;
    uint64_t kinds[NKINDS] = {0, 0, 0};
    double bytes_written = 0, bytes_verified = 0;
    size_t max_live_bytes = 0;
};

static size_t random_size(Rng &r) {
    const double lo = std::log(256.0), hi = std::log(64.0 * 1024 * 1024);
    size_t s = (size_t)std::exp(lo + (hi - lo) * r.unit());
    s += r.below(256); // any byte count, not only powers of two or multiples of 4
    return std::min<size_t>(std::max<size_t>(s, 256), 64u << 20);
}

static void verify(Churn &c, Slot &s, int stream, uint32_t delay_ns) {
    verify_kernel<<<grid_for(s.size), 256, 0, c.st[stream]>>>(s.p, s.size, s.gen, delay_ns,
                                                              c.d_bad + s.kind);
    CK(cudaGetLastError());
    c.verifies++;
    c.bytes_verified += (double)s.size;
}

static void retire(Churn &c, Slot &s) {
    if (!s.p) return;
    verify(c, s, s.last, (uint32_t)c.rng.below(100000));
    CM(cuma_free(c.heap, s.p, c.st[s.last]));
    c.frees++;
    s = Slot();
}

static void place(Churn &c, Slot &s, int a) {
    size_t size = random_size(c.rng);
    void *p = nullptr;
    CM(cuma_alloc(c.heap, size, c.st[a], &p));
    c.allocs++;
    uint8_t *q = (uint8_t *)p;
    if ((uintptr_t)q % 256) check_failed("cuma_alloc(%zu) gave %p, not 256-byte aligned", size, p);
    size_t bsize = 0;
    CM(cuma_block_size(c.heap, p, &bsize));
    if (bsize < size) check_failed("cuma_block_size(%p) = %zu < requested %zu", p, bsize, size);
    size_t live = size;
    for (const Slot &o : c.slots) {
        if (!o.p) continue;
        live += o.size;
        if (q < o.p + o.size && o.p < q + size)
            check_failed("cuma_alloc(%zu) gave [%p, +%zu) overlapping the live block [%p, +%zu)",
                         size, p, size, (void *)o.p, o.size);
    }
    c.max_live_bytes = std::max(c.max_live_bytes, live);
    s.p = q;
    s.size = size;
    s.gen = ++c.gen;
    fill_kernel<<<grid_for(size), 256, 0, c.st[a]>>>(q, size, s.gen);
    CK(cudaGetLastError());
    c.bytes_written += (double)size;
    uint64_t k = c.rng.below(4); // half single, a quarter each of the others
    s.kind = k < 2 ? SINGLE : (k == 2 ? HANDOFF : RECORD);
    c.kinds[s.kind]++;
    s.last = a;
    if (s.kind == SINGLE) return;
    int b = 1 - a;
    size_t idx = (size_t)(&s - c.slots.data());
    CK(cudaEventRecord(c.ev[idx], c.st[a]));
    CK(cudaStreamWaitEvent(c.st[b], c.ev[idx], 0));
    verify(c, s, b, (uint32_t)c.rng.below(200000));
    if (s.kind == HANDOFF) {
        s.last = b; // b's work follows a's fill: freeing on b covers both
    } else {
        CM(cuma_record_stream(c.heap, p, c.st[b]));
        c.records++;
        s.last = a; // freed on a; b's verify may still run then
    }
}

static bool stats_of(cuma_heap *h, cuma_stats *s) {
    return cuma_get_stats(h, s) == CUMA_OK;
}

static void progress(Churn &c, uint64_t it) {
    cuma_stats s;
    if (!stats_of(c.heap, &s)) return;
    size_t fr = 0, tot = 0;
    cudaMemGetInfo(&fr, &tot);
    printf("  it %6" PRIu64 ": live %4" PRIu64 " blocks %10s, reserved %10s (mapped %s, cached %s), "
           "pages created %" PRIu64 " released %" PRIu64 ", events %" PRIu64 ", device used %s\n",
           it, s.active_allocs, human((double)s.requested_bytes).c_str(),
           human((double)s.reserved_bytes).c_str(), human((double)s.mapped_bytes).c_str(),
           human((double)s.cached_bytes).c_str(), s.page_creates, s.page_releases,
           s.events_recorded, human((double)(tot - fr)).c_str());
    fflush(stdout);
}

// Trims until nothing is cached; pages whose fences were only just recorded are kept by a
// trim, so the device is synchronised and the trim repeated. Returns the bytes left reserved.
static uint64_t trim_all(cuma_heap *h) {
    cuma_stats s{};
    for (int round = 0; round < 5; round++) {
        CM(cuma_trim(h, 0));
        if (!stats_of(h, &s) || s.cached_bytes == 0) break;
        CK(cudaDeviceSynchronize());
    }
    return s.reserved_bytes;
}

static void run_churn(const char *conf, uint64_t iters, uint64_t seed) {
    printf("== churn: conf \"%s\", %" PRIu64 " iterations, seed %" PRIu64 "\n", conf, iters, seed);
    Churn c;
    c.rng = Rng(seed);
    cuma_config cfg = {};
    cfg.conf = conf;
    cfg.flags = CUMA_CONFIG_NO_ENV;
    cfg.device = 0;
    CM(cuma_heap_create(&cfg, &c.heap));
    g_heap = c.heap;
    {
        // The heap must be on the backend the settings name, not on a fallback.
        size_t need = 0;
        char probe[1];
        cuma_stats_json(c.heap, probe, sizeof probe, &need);
        std::vector<char> js(need + 1);
        CM(cuma_stats_json(c.heap, js.data(), js.size(), nullptr));
        const char *want = strstr(conf, "backend:");
        std::string name = want ? std::string(want + 8, strcspn(want + 8, ",")) : "vmm";
        std::string key = "\"backend\":\"" + name;
        const char *b = strstr(js.data(), "\"backend\":");
        printf("  heap backend: %.*s\n", b ? (int)strcspn(b, ",}") : 4, b ? b : "none");
        if (!strstr(js.data(), key.c_str()))
            check_failed("the heap is not on backend %s", name.c_str());
    }
    const int NSLOTS = 48;
    c.slots.resize(NSLOTS);
    c.ev.resize(NSLOTS);
    for (auto &e : c.ev) CK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
    for (auto &s : c.st) CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    CK(cudaMalloc(&c.d_bad, NKINDS * sizeof(unsigned long long)));
    CK(cudaMemset(c.d_bad, 0, NKINDS * sizeof(unsigned long long)));
    CK(cudaDeviceSynchronize());

    uint64_t t0 = now_ns();
    for (uint64_t it = 0; it < iters; it++) {
        int a = (int)(it & 1);
        Slot &s = c.slots[c.rng.below(NSLOTS)];
        retire(c, s);
        place(c, s, a);
        if (c.rng.below(8) == 0) retire(c, c.slots[c.rng.below(NSLOTS)]); // the live set varies
        if (it % 250 == 249) {
            CM(cuma_trim(c.heap, 0));
            c.trims++;
        }
        if (it % 500 == 499) {
            cuma_status v = cuma_validate(c.heap);
            c.validates++;
            if (v != CUMA_OK) check_failed("cuma_validate at iteration %" PRIu64 ": %s", it, cuma_last_error());
        }
        if (it % 1000 == 999 || it + 1 == iters) progress(c, it + 1);
    }
    for (Slot &s : c.slots) retire(c, s);
    uint64_t host_done = now_ns();
    cudaError_t sync = cudaDeviceSynchronize();
    uint64_t t1 = now_ns();
    if (sync != cudaSuccess)
        fatal("kernels failed: %s (%s): a page unmapped or released under a running kernel?",
              cudaGetErrorName(sync), cudaGetErrorString(sync));
    unsigned long long bad[NKINDS];
    CK(cudaMemcpy(bad, c.d_bad, sizeof bad, cudaMemcpyDeviceToHost));

    printf("  %" PRIu64 " allocs, %" PRIu64 " frees, %" PRIu64 " verify kernels, %" PRIu64
           " record_stream, %" PRIu64 " trims, %" PRIu64 " validates; written %s, verified %s; "
           "largest live set %s\n",
           c.allocs, c.frees, c.verifies, c.records, c.trims, c.validates,
           human(c.bytes_written).c_str(), human(c.bytes_verified).c_str(),
           human((double)c.max_live_bytes).c_str());
    printf("  host loop %.2f s (%.1f us per iteration), GPU drained %.2f s later\n",
           (double)(host_done - t0) * 1e-9, (double)(host_done - t0) * 1e-3 / (double)iters,
           (double)(t1 - host_done) * 1e-9);
    unsigned long long total_bad = 0;
    for (int k = 0; k < NKINDS; k++) {
        printf("  kind %-14s %6" PRIu64 " blocks, mismatched words %llu\n", kind_name[k], c.kinds[k], bad[k]);
        total_bad += bad[k];
    }
    if (total_bad) check_failed("%llu words did not hold the pattern written to them", total_bad);
    if (!c.verifies || !c.kinds[HANDOFF] || !c.kinds[RECORD])
        check_failed("the run did not exercise every kind of block");

    cuma_status v = cuma_validate(c.heap);
    if (v != CUMA_OK) check_failed("cuma_validate at the end: %s", cuma_last_error());
    else printf("  cuma_validate: OK\n");
    cuma_stats s{};
    CM(cuma_get_stats(c.heap, &s));
    if (s.active_allocs || s.requested_bytes)
        check_failed("after freeing everything: %" PRIu64 " live allocations, %" PRIu64 " bytes requested",
                     s.active_allocs, s.requested_bytes);
    printf("  peak reserved %s, peak requested %s; pages created %" PRIu64 ", maps %" PRIu64
           ", events recorded %" PRIu64 ", failed allocs %" PRIu64 "\n",
           human((double)s.peak_reserved_bytes).c_str(), human((double)s.peak_requested_bytes).c_str(),
           s.page_creates, s.maps, s.events_recorded, s.failed_allocs);
    uint64_t left = trim_all(c.heap);
    if (left) check_failed("after cuma_trim(heap, 0) on an idle device %" PRIu64 " bytes stay reserved", left);
    else printf("  after trim on an idle device: nothing reserved\n");
    if (s.failed_allocs) check_failed("%" PRIu64 " allocations failed", s.failed_allocs);
    print_stats_json(c.heap, "STATS_JSON");

    for (auto &e : c.ev) cudaEventDestroy(e);
    for (auto &st : c.st) cudaStreamDestroy(st);
    cudaFree(c.d_bad);
    cuma_heap_destroy(c.heap);
    g_heap = nullptr;
    CK(cudaDeviceSynchronize());
}

// ---- part 2: micro-benchmarks --------------------------------------------------------------

struct Row {
    std::string name;
    std::vector<double> ns; // one sample per call (or per pair, or per batch average)
};

static void print_row(const Row &r) {
    double m = median(r.ns);
    const char *unit = m >= 10000 ? "us" : "ns";
    double div = m >= 10000 ? 1000.0 : 1.0;
    printf("  %-46s median %9.2f %s   p10 %9.2f   p90 %9.2f   n=%zu\n", r.name.c_str(), m / div, unit,
           pct(r.ns, 0.10) / div, pct(r.ns, 0.90) / div, r.ns.size());
}

static void bench_driver(std::vector<Row> &rows) {
    CUdevice dev;
    CU(cuDeviceGet(&dev, 0));
    CUcontext ctx;
    CU(cuDevicePrimaryCtxRetain(&ctx, dev));
    CU(cuCtxSetCurrent(ctx));
    CUmemAllocationProp prop = {};
    prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
    prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    prop.location.id = dev;
    size_t gran = 0;
    CU(cuMemGetAllocationGranularity(&gran, &prop, CU_MEM_ALLOC_GRANULARITY_RECOMMENDED));
    size_t page = gran;
    while (page < (2u << 20)) page += gran; // 2 MiB, or the granularity's multiple above it
    const int N = 256;
    std::vector<CUmemGenericAllocationHandle> h(N);
    Row create{"driver cuMemCreate (" + human((double)page) + ")", {}};
    Row map{"driver cuMemMap", {}}, access{"driver cuMemSetAccess", {}};
    Row mapacc{"driver cuMemMap + cuMemSetAccess", {}};
    Row unmap{"driver cuMemUnmap", {}}, release{"driver cuMemRelease", {}};
    CUdeviceptr va = 0;
    CU(cuMemAddressReserve(&va, page * N, page, 0, 0));
    CUmemAccessDesc desc = {};
    desc.location = prop.location;
    desc.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
    for (int rep = 0; rep < 2; rep++) { // the first round warms the driver up and is dropped
        bool keep = rep == 1;
        CK(cudaDeviceSynchronize());
        for (int i = 0; i < N; i++) {
            uint64_t t0 = now_ns();
            CU(cuMemCreate(&h[i], page, &prop, 0));
            if (keep) create.ns.push_back((double)(now_ns() - t0));
        }
        CK(cudaDeviceSynchronize());
        for (int i = 0; i < N; i++) {
            uint64_t t0 = now_ns();
            CU(cuMemMap(va + (CUdeviceptr)i * page, page, 0, h[i], 0));
            uint64_t t1 = now_ns();
            CU(cuMemSetAccess(va + (CUdeviceptr)i * page, page, &desc, 1));
            uint64_t t2 = now_ns();
            if (keep) {
                map.ns.push_back((double)(t1 - t0));
                access.ns.push_back((double)(t2 - t1));
                mapacc.ns.push_back((double)(t2 - t0));
            }
        }
        CK(cudaDeviceSynchronize());
        for (int i = 0; i < N; i++) {
            uint64_t t0 = now_ns();
            CU(cuMemUnmap(va + (CUdeviceptr)i * page, page));
            if (keep) unmap.ns.push_back((double)(now_ns() - t0));
        }
        CK(cudaDeviceSynchronize());
        for (int i = 0; i < N; i++) {
            uint64_t t0 = now_ns();
            CU(cuMemRelease(h[i]));
            if (keep) release.ns.push_back((double)(now_ns() - t0));
        }
        CK(cudaDeviceSynchronize());
    }
    CU(cuMemAddressFree(va, page * N));
    CU(cuDevicePrimaryCtxRelease(dev));
    for (Row *r : {&create, &map, &access, &mapacc, &unmap, &release}) rows.push_back(*r);
}

// Median over `rounds` batches of `per` alloc+free pairs of `size` on stream s: ns per pair.
static Row bench_cached_pair(cuma_heap *h, cudaStream_t s, size_t size, int rounds, int per) {
    Row r{"cuma alloc+free pair, cached " + human((double)size), {}};
    void *p;
    for (int i = 0; i < 100; i++) { // warm: pages mapped, thread cache filled
        CM(cuma_alloc(h, size, s, &p));
        CM(cuma_free(h, p, s));
    }
    for (int k = 0; k < rounds; k++) {
        uint64_t t0 = now_ns();
        for (int i = 0; i < per; i++) {
            CM(cuma_alloc(h, size, s, &p));
            CM(cuma_free(h, p, s));
        }
        r.ns.push_back((double)(now_ns() - t0) / per);
    }
    return r;
}

static void bench_cuma(const char *conf, std::vector<Row> &rows, int *uncached_ok) {
    cuma_heap *h;
    cuma_config cfg = {};
    cfg.conf = conf;
    cfg.flags = CUMA_CONFIG_NO_ENV;
    CM(cuma_heap_create(&cfg, &h));
    g_heap = h;
    cudaStream_t s;
    CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    rows.push_back(bench_cached_pair(h, s, 4096, 15, 20000));
    rows.push_back(bench_cached_pair(h, s, 2u << 20, 15, 2000));
    rows.push_back(bench_cached_pair(h, s, 64u << 20, 15, 200));

    // Uncached: every page of the block is created and mapped by the alloc; the trim before
    // each pair (not timed) gives them back.
    const size_t big = 64u << 20;
    Row a{"cuma alloc, uncached 64 MiB", {}}, f{"cuma free, 64 MiB", {}};
    Row pair{"cuma alloc+free pair, uncached 64 MiB", {}}, t{"cuma trim(0) of 64 MiB (not in the pair)", {}};
    cuma_stats before{}, after{};
    *uncached_ok = 1;
    for (int k = 0; k < 16; k++) {
        uint64_t t0 = now_ns();
        if (trim_all(h) != 0) *uncached_ok = 0;
        uint64_t t1 = now_ns();
        stats_of(h, &before);
        void *p;
        uint64_t t2 = now_ns();
        CM(cuma_alloc(h, big, s, &p));
        uint64_t t3 = now_ns();
        CM(cuma_free(h, p, s));
        uint64_t t4 = now_ns();
        stats_of(h, &after);
        if (after.page_creates - before.page_creates < big / after.page_size) *uncached_ok = 0;
        if (k == 0) continue; // warm-up
        t.ns.push_back((double)(t1 - t0));
        a.ns.push_back((double)(t3 - t2));
        f.ns.push_back((double)(t4 - t3));
        pair.ns.push_back((double)(t4 - t2));
    }
    for (Row *r : {&pair, &a, &f, &t}) rows.push_back(*r);
    trim_all(h);
    CK(cudaStreamDestroy(s));
    cuma_heap_destroy(h);
    g_heap = nullptr;
}

static void bench_reference(std::vector<Row> &rows) {
    cudaStream_t s;
    CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    for (size_t size : {(size_t)4096, (size_t)(2u << 20)}) {
        Row r{"ref cudaMallocAsync+cudaFreeAsync pair " + human((double)size), {}};
        void *p;
        for (int i = 0; i < 100; i++) {
            CK(cudaMallocAsync(&p, size, s));
            CK(cudaFreeAsync(p, s));
        }
        for (int k = 0; k < 15; k++) {
            uint64_t t0 = now_ns();
            for (int i = 0; i < 2000; i++) {
                CK(cudaMallocAsync(&p, size, s));
                CK(cudaFreeAsync(p, s));
            }
            r.ns.push_back((double)(now_ns() - t0) / 2000);
        }
        rows.push_back(r);
    }
    CK(cudaStreamSynchronize(s));
    CK(cudaStreamDestroy(s));
    Row m{"ref cudaMalloc+cudaFree pair 2 MiB", {}};
    for (int k = 0; k < 51; k++) {
        void *p;
        uint64_t t0 = now_ns();
        CK(cudaMalloc(&p, 2u << 20));
        CK(cudaFree(p));
        if (k) m.ns.push_back((double)(now_ns() - t0));
    }
    rows.push_back(m);
}

static void run_bench(const char *conf) {
    printf("== bench: medians; driver calls timed one by one (device idle between phases), cuma "
           "pairs in batches (conf \"%s\")\n", conf);
    std::vector<Row> rows;
    bench_driver(rows);
    int uncached_ok = 0;
    bench_cuma(conf, rows, &uncached_ok);
    bench_reference(rows);
    for (const Row &r : rows) print_row(r);
    if (!uncached_ok)
        check_failed("bench: a 64 MiB alloc after cuma_trim(0) did not create all its pages (the "
                     "'uncached' figures are not uncached)");
    printf("BENCH_JSON {");
    for (size_t i = 0; i < rows.size(); i++)
        printf("%s\"%s\": %.1f", i ? ", " : "", rows[i].name.c_str(), median(rows[i].ns));
    printf("}\n");
}

// ---- main ----------------------------------------------------------------------------------

static void usage() {
    printf("usage: churn [--conf STR] [--iters N] [--seed N] [--bench] [--bench-only]\n");
}

int main(int argc, char **argv) {
    const char *conf = "backend:vmm";
    uint64_t iters = 3000, seed = 1;
    bool bench = false, churn = true;
    for (int i = 1; i < argc; i++) {
        std::string a = argv[i];
        if (a == "--conf" && i + 1 < argc) conf = argv[++i];
        else if (a == "--iters" && i + 1 < argc) iters = strtoull(argv[++i], nullptr, 10);
        else if (a == "--seed" && i + 1 < argc) seed = strtoull(argv[++i], nullptr, 10);
        else if (a == "--bench") bench = true;
        else if (a == "--bench-only") bench = true, churn = false;
        else if (a == "-h" || a == "--help") return usage(), 0;
        else return usage(), 2;
    }
    int rt = 0, drv = 0;
    cudaRuntimeGetVersion(&rt);
    cudaDriverGetVersion(&drv);
    int ndev = 0;
    cudaError_t e = cudaGetDeviceCount(&ndev);
    if (e != cudaSuccess || ndev < 1) {
        printf("churn: no CUDA device: %s\nCHURN RESULT: FAIL (no device)\n",
               e != cudaSuccess ? cudaGetErrorString(e) : "0 devices");
        return 1;
    }
    CK(cudaSetDevice(0));
    CK(cudaFree(nullptr)); // the runtime owns the primary context from here; cuma shares it
    cudaDeviceProp prop;
    CK(cudaGetDeviceProperties(&prop, 0));
    printf("churn: device 0 %s, cc %d.%d, %s, runtime %d, driver %d\n", prop.name, prop.major,
           prop.minor, human((double)prop.totalGlobalMem).c_str(), rt, drv);
    if (churn) run_churn(conf, iters, seed);
    if (bench) run_bench(conf);
    printf("CHURN RESULT: %s (%d failed check%s)\n", g_failures ? "FAIL" : "PASS", g_failures,
           g_failures == 1 ? "" : "s");
    return g_failures ? 1 : 0;
}
