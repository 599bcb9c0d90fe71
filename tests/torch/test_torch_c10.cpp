// SPDX-License-Identifier: Apache-2.0
// libcuma_torch_c10-<torch version>.so as PyTorch's pluggable allocator uses it (dlopen, the
// entry points looked up through its handle, called from C++): an out-of-memory, from the
// device or from cuma's limit, must arrive as PyTorch's c10::OutOfMemoryError (what cuDNN's
// workspace retry and torch.cuda.OutOfMemoryError catch) carrying libcuma_torch.so's text;
// a failure that is not memory must stay a std::runtime_error.
//
//   test_torch_c10 LIBCUMA_TORCH_C10 TORCH_VERSION   (CUMA_CONF: a 64 MiB simulated device)
#include "torch_test.h"

#include <c10/util/Exception.h>

#include <cstdio>
#include <cstdlib>
#include <dlfcn.h>
#include <stdexcept>
#include <string>

typedef const char *(*version_fn)(void);

enum caught { NOTHING, C10_OOM, RUNTIME_ERROR };

// What the allocation threw, in the order PyTorch's handlers look: its own type first.
static caught call(malloc_fn fn, size_t size, int device, void **out, std::string *text) {
    *out = nullptr;
    text->clear();
    try {
        *out = fn(size, device, nullptr);
    } catch (const c10::OutOfMemoryError &e) {
        *text = e.msg(); // what PyTorch's bindings give Python: the text without the backtrace
        return C10_OOM;
    } catch (const std::runtime_error &e) {
        *text = e.what();
        return RUNTIME_ERROR;
    }
    return NOTHING;
}

int main(int argc, char **argv) {
    if (argc != 3) {
        std::fprintf(stderr, "usage: test_torch_c10 LIBCUMA_TORCH_C10 TORCH_VERSION\n");
        return 2;
    }
    void *lib = dlopen(argv[1], RTLD_NOW | RTLD_LOCAL);
    if (!lib) std::fprintf(stderr, "dlopen: %s\n", dlerror());
    CHECK(lib);
    malloc_fn fn = (malloc_fn)dlsym(lib, "cuma_torch_raising_malloc");
    free_fn fr = (free_fn)dlsym(lib, "cuma_torch_free");
    version_fn ver = (version_fn)dlsym(lib, "cuma_torch_c10_torch_version");
    CHECK(fn && fr && ver);
    CHECK(std::string(ver()) == argv[2]);
    void *a, *b;
    std::string e;
    CHECK(call(fn, 32u << 20, 0, &a, &e) == NOTHING && a);
    CHECK(call(fn, 0, 0, &b, &e) == NOTHING && !b);
    // The device is full: PyTorch's type, PyTorch's words, cuma's reason.
    CHECK(call(fn, 48u << 20, 0, &b, &e) == C10_OOM && !b);
    std::printf("device full: %s\n", e.c_str());
    CHECK(e.rfind("CUDA out of memory. Tried to allocate 50331648 bytes on device 0 (cuma): ", 0) ==
          0);
    CHECK(e.find("out of memory", 20) != std::string::npos);
    // cuma's limit: CUMA_ERR_LIMIT is out of memory to PyTorch too.
    cuma_heap *heap = cuma_torch_created_heap(0);
    CHECK(heap && cuma_set_limit(heap, 40u << 20) == CUMA_OK);
    void *c = nullptr;
    CHECK(cuma_torch_alloc(16u << 20, 0, nullptr, &c) == CUMA_ERR_LIMIT && !c);
    CHECK(call(fn, 16u << 20, 0, &b, &e) == C10_OOM && !b);
    std::printf("over the limit: %s\n", e.c_str());
    CHECK(e.rfind("CUDA out of memory. Tried to allocate 16777216 bytes on device 0 (cuma): ", 0) ==
          0);
    // Not memory: a size PyTorch's size_t made from a negative, a device past 63.
    CHECK(call(fn, (size_t)-1, 0, &b, &e) == RUNTIME_ERROR && !b);
    std::printf("bad size: %s\n", e.c_str());
    CHECK(e.rfind("cuma: allocating -1 bytes on device 0 failed (invalid argument)", 0) == 0);
    CHECK(call(fn, 1024, 99, &b, &e) == RUNTIME_ERROR && !b);
    std::printf("bad device: %s\n", e.c_str());
    CHECK(e.find("device 99") != std::string::npos && e.find("out of memory") == std::string::npos);
    // After the failures the heap still serves within its limit.
    fr(a, 32u << 20, 0, nullptr);
    CHECK(call(fn, 32u << 20, 0, &b, &e) == NOTHING && b);
    fr(b, 32u << 20, 0, nullptr);
    std::printf("test_torch_c10: all passed\n");
    return 0;
}
