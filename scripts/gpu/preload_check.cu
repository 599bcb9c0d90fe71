// SPDX-License-Identifier: Apache-2.0
// A plain CUDA runtime program for the GPU check's LD_PRELOAD step: it knows nothing of cuma.
// Run under LD_PRELOAD=libcuma_preload.so with CUMA_CONF=limit:SIZE it must see the limit as the
// device's memory (cudaMemGetInfo), be refused beyond it (cudaErrorMemoryAllocation, no crash),
// and get memory that kernels can write and read back: cudaMalloc, cudaMallocAsync on a stream,
// cudaMallocPitch. Run without the shim it reports the device as the driver sees it.
//
// usage: preload_check [EXPECTED_TOTAL_BYTES]   (0 or absent: do not check the total)
// Prints one line "PRELOAD RESULT: ..."; exit status 0 when every check held.
#include <cuda_runtime.h>

#include <cstdio>
#include <cstdlib>
#include <vector>

static int failures = 0;

#define CHECK(cond, ...)                                                                           \
    do {                                                                                           \
        if (!(cond)) {                                                                             \
            std::printf("FAIL %s:%d: %s: ", __FILE__, __LINE__, #cond);                            \
            std::printf(__VA_ARGS__);                                                              \
            std::printf("\n");                                                                     \
            failures++;                                                                            \
        }                                                                                          \
    } while (0)

__global__ void fill(unsigned *p, size_t n, unsigned seed) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
         i += (size_t)gridDim.x * blockDim.x)
        p[i] = (unsigned)i * 2654435761u ^ seed;
}

__global__ void verify(const unsigned *p, size_t n, unsigned seed, unsigned long long *bad) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
         i += (size_t)gridDim.x * blockDim.x)
        if (p[i] != ((unsigned)i * 2654435761u ^ seed)) atomicAdd(bad, 1ull);
}

// Writes and verifies a pattern in n words at p on stream s; the count of wrong words.
static unsigned long long pattern(unsigned *p, size_t n, unsigned seed, cudaStream_t s,
                                  unsigned long long *bad) {
    cudaMemsetAsync(bad, 0, sizeof *bad, s);
    fill<<<256, 256, 0, s>>>(p, n, seed);
    verify<<<256, 256, 0, s>>>(p, n, seed, bad);
    unsigned long long h = ~0ull;
    cudaMemcpyAsync(&h, bad, sizeof h, cudaMemcpyDeviceToHost, s);
    cudaStreamSynchronize(s);
    return h;
}

int main(int argc, char **argv) {
    size_t expect_total = argc > 1 ? std::strtoull(argv[1], nullptr, 10) : 0;
    size_t fr = 0, total = 0;
    cudaError_t e = cudaMemGetInfo(&fr, &total);
    if (e != cudaSuccess) {
        std::printf("PRELOAD RESULT: FAIL: cudaMemGetInfo: %s\n", cudaGetErrorString(e));
        return 1;
    }
    std::printf("cudaMemGetInfo: free %.2f GiB of %.2f GiB\n", fr / 1073741824.0,
                total / 1073741824.0);
    if (expect_total) CHECK(total == expect_total, "total %zu, expected %zu", total, expect_total);
    cudaDeviceProp prop;
    cudaGetDeviceProperties(&prop, 0);
    std::printf("device 0: %s, totalGlobalMem %.2f GiB\n", prop.name, prop.totalGlobalMem / 1073741824.0);

    unsigned long long *bad = nullptr;
    CHECK(cudaMalloc(&bad, sizeof *bad) == cudaSuccess, "cudaMalloc of 8 bytes");
    cudaStream_t s;
    cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking);

    // Blocks of 256 MiB until the device (or the limit) says no: with a limit that is the limit.
    const size_t block = 256ull << 20;
    std::vector<unsigned *> blocks;
    size_t cap = expect_total ? expect_total / block + 4 : 16;
    for (size_t i = 0; i < cap; i++) {
        unsigned *p = nullptr;
        e = cudaMalloc(&p, block);
        if (e != cudaSuccess) {
            CHECK(e == cudaErrorMemoryAllocation, "a refused cudaMalloc said %s", cudaGetErrorString(e));
            cudaGetLastError(); // the refusal is this thread's last error: clear it
            break;
        }
        blocks.push_back(p);
    }
    size_t taken = blocks.size();
    std::printf("cudaMalloc: %zu blocks of 256 MiB (%.2f GiB)\n", blocks.size(),
                blocks.size() * (double)block / 1073741824.0);
    if (expect_total) {
        CHECK(blocks.size() * block <= expect_total, "%zu blocks beyond the limit", blocks.size());
        CHECK(blocks.size() + 2 >= expect_total / block, "only %zu blocks under the limit", blocks.size());
    }
    unsigned long long wrong = 0;
    for (size_t i = 0; i < blocks.size(); i++)
        wrong += pattern(blocks[i], block / sizeof(unsigned), (unsigned)i, s, bad);
    CHECK(wrong == 0, "%llu words read back wrong", wrong);
    for (unsigned *p : blocks) CHECK(cudaFree(p) == cudaSuccess, "cudaFree");
    blocks.clear();

    // Stream-ordered allocations, and a pitched one.
    unsigned *a = nullptr;
    e = cudaMallocAsync(&a, 64 << 20, s);
    CHECK(e == cudaSuccess, "cudaMallocAsync: %s", cudaGetErrorString(e));
    if (e == cudaSuccess) {
        CHECK(pattern(a, (64 << 20) / sizeof(unsigned), 7, s, bad) == 0, "cudaMallocAsync memory");
        CHECK(cudaFreeAsync(a, s) == cudaSuccess, "cudaFreeAsync");
    }
    void *pp = nullptr;
    size_t pitch = 0;
    e = cudaMallocPitch(&pp, &pitch, 1000, 1000);
    CHECK(e == cudaSuccess && pitch >= 1000 && pitch % 256 == 0, "cudaMallocPitch: %s, pitch %zu",
          cudaGetErrorString(e), pitch);
    if (e == cudaSuccess) {
        CHECK(cudaMemset2D(pp, pitch, 0x5a, 1000, 1000) == cudaSuccess, "cudaMemset2D");
        CHECK(cudaFree(pp) == cudaSuccess, "cudaFree of the pitched block");
    }
    CHECK(cudaFree(bad) == cudaSuccess, "cudaFree");
    cudaStreamSynchronize(s);
    cudaStreamDestroy(s);
    cudaMemGetInfo(&fr, &total);
    std::printf("after: free %.2f GiB of %.2f GiB\n", fr / 1073741824.0, total / 1073741824.0);
    std::printf("PRELOAD RESULT: %s: total %.2f GiB, %.2f GiB taken in 256 MiB blocks, %d failed "
                "checks\n",
                failures ? "FAIL" : "ok", total / 1073741824.0, taken * (double)block / 1073741824.0,
                failures);
    return failures ? 1 : 0;
}
