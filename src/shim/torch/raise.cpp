// SPDX-License-Identifier: Apache-2.0
// libcuma_torch.so: the allocation entry point PyTorch should load (cuma.torch.enable() does).
//
// PyTorch's pluggable allocator keeps whatever its malloc function returns: a NULL becomes a
// tensor without storage, which fails later with a message that says nothing about memory,
// and torch.cuda.OutOfMemoryError is never raised for a pluggable allocator. The one way to
// fail an allocation cleanly through that interface is an exception thrown from the function
// itself (PyTorch calls it from C++ before it records anything), which PyTorch's Python
// bindings turn into a RuntimeError with the exception's text. This file is the only C++ in
// cuma, and a library of its own, so that libcuma stays plain C for every other user.
#include "cuma/torch.h"

#include <cstdio>
#include <stdexcept>
#include <string>

extern "C" __attribute__((visibility("default"))) void *
cuma_torch_raising_malloc(ssize_t size, int device, cudaStream_t stream) {
    void *p = nullptr;
    cuma_status st = cuma_torch_alloc(size, device, stream, &p);
    if (st == CUMA_OK) return p;
    char head[160];
    // Out of memory is worded as PyTorch words its own, so that code matching "CUDA out of
    // memory" in the text (and cuma.adaptive.is_oom) treats both allocators alike.
    if (st == CUMA_ERR_OOM || st == CUMA_ERR_LIMIT)
        std::snprintf(head, sizeof head,
                      "CUDA out of memory. Tried to allocate %zd bytes on device %d (cuma): ", size,
                      device);
    else
        std::snprintf(head, sizeof head,
                      "cuma: allocating %zd bytes on device %d failed (%s): ", size, device,
                      cuma_status_string(st));
    throw std::runtime_error(std::string(head) + cuma_last_error());
}
