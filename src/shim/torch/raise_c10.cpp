// SPDX-License-Identifier: Apache-2.0
// libcuma_torch_c10-<torch version>.so: libcuma_torch.so's entry point (raise.cpp), throwing
// PyTorch's own c10::OutOfMemoryError when the device or cuma's limit has no room.
//
// A std::runtime_error reaches Python as a plain RuntimeError, and C++ code inside PyTorch
// that recovers from an out-of-memory (cuDNN's convolution retrying with a smaller workspace,
// for one) catches c10::OutOfMemoryError only, as do libraries that catch
// torch.cuda.OutOfMemoryError; near the limit such code would fail under cuma where it
// survives PyTorch's allocator. PyTorch's bindings raise c10::OutOfMemoryError as
// torch.cuda.OutOfMemoryError, a subclass of RuntimeError, so callers of libcuma_torch.so's
// RuntimeError keep working. Other failures (a bad size or device, a broken configuration)
// are not memory and stay std::runtime_error, like libcuma_torch.so's.
//
// This depends on the ABI of the PyTorch whose headers it was compiled against (libc10's
// constructor, the layout of c10::Error), hence the version in the file name: cuma.torch
// loads it only under that same version, and libcuma_torch.so otherwise.
#include "failure_text.h"

#include <c10/util/Exception.h>

#include <stdexcept>

extern "C" __attribute__((visibility("default"))) void *
cuma_torch_raising_malloc(ssize_t size, int device, cudaStream_t stream) {
    void *p = nullptr;
    cuma_status st = cuma_torch_alloc(size, device, stream, &p);
    if (st == CUMA_OK) return p;
    std::string text = cuma_torch_failure_text(st, size, device);
    if (!cuma_torch_is_oom(st)) throw std::runtime_error(text);
    // The SourceLocation constructor is the one every PyTorch since 1.x has kept unchanged.
    throw c10::OutOfMemoryError(c10::SourceLocation{__func__, __FILE__, __LINE__}, text);
}

// The PyTorch version this was compiled against (torch.__version__ at configure time), for
// a caller that wants to check before trusting the type.
extern "C" __attribute__((visibility("default"))) const char *cuma_torch_c10_torch_version(void) {
    return CUMA_TORCH_VERSION;
}
