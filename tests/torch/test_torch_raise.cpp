// SPDX-License-Identifier: Apache-2.0
// libcuma_torch.so as PyTorch's pluggable allocator uses it: opened with dlopen, both entry
// points looked up through its handle (cuma_torch_free comes from libcuma.so behind it), the
// allocation called through a function pointer from C++. A failure must arrive as a C++
// exception whose text says what PyTorch's own out-of-memory error says ("CUDA out of
// memory.") with cuma's reason; success, size 0 and frees must behave as the C entry points.
//
//   test_torch_raise LIBCUMA_TORCH   (CUMA_CONF: a 64 MiB simulated device, set by ctest)
#include "torch_test.h"

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <dlfcn.h>
#include <stdexcept>
#include <string>


// What the allocation threw (empty: it did not throw).
static std::string thrown(malloc_fn fn, size_t size, int device, void **out) {
    *out = nullptr;
    try {
        *out = fn(size, device, nullptr);
    } catch (const std::runtime_error &e) {
        return e.what();
    }
    return "";
}

int main(int argc, char **argv) {
    if (argc != 2) {
        std::fprintf(stderr, "usage: test_torch_raise LIBCUMA_TORCH\n");
        return 2;
    }
    void *lib = dlopen(argv[1], RTLD_NOW | RTLD_LOCAL);
    CHECK(lib);
    malloc_fn fn = (malloc_fn)dlsym(lib, "cuma_torch_raising_malloc");
    free_fn fr = (free_fn)dlsym(lib, "cuma_torch_free");
    CHECK(fn && fr);
    void *a, *b;
    CHECK(thrown(fn, 32u << 20, 0, &a).empty() && a);
    CHECK(thrown(fn, 0, 0, &b).empty() && !b); // an empty tensor: no storage, no error
    // More than is left: PyTorch's words, the size, and cuma's figures.
    std::string e = thrown(fn, 48u << 20, 0, &b);
    std::printf("out of memory: %s\n", e.c_str());
    CHECK(!b &&
          e.rfind("CUDA out of memory. Tried to allocate 50331648 bytes on device 0", 0) == 0);
    CHECK(e.find("(cuma): out of memory") != std::string::npos);
    // One copy of the default heaps: the C entry point of the libcuma.so this test links sees
    // the 32 MiB taken through libcuma_torch.so (NULL, not an exception, from it).
    CHECK(!cuma_torch_malloc(48u << 20, 0, nullptr));
    // Not memory: a size PyTorch's size_t made from a negative, and a device past 63.
    e = thrown(fn, (size_t)-1, 0, &b);
    std::printf("bad size: %s\n", e.c_str());
    CHECK(e.rfind("cuma: allocating -1 bytes on device 0 failed (invalid argument)", 0) == 0);
    e = thrown(fn, 1024, 99, &b);
    std::printf("bad device: %s\n", e.c_str());
    CHECK(e.find("device 99") != std::string::npos && e.find("out of memory") == std::string::npos);
    // After the failures the heap still serves, and the freed block can be had again.
    fr(a, 32u << 20, 0, nullptr);
    CHECK(thrown(fn, 48u << 20, 0, &b).empty() && b);
    fr(b, 48u << 20, 0, nullptr);
    std::printf("test_torch_raise: all passed\n");
    return 0;
}
