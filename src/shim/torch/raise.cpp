// SPDX-License-Identifier: Apache-2.0
// libcuma_torch.so: the allocation entry point PyTorch should load (cuma.torch.enable() does).
//
// PyTorch's pluggable allocator keeps whatever its malloc function returns: a NULL becomes a
// tensor without storage, which fails later with a message that says nothing about memory,
// and torch.cuda.OutOfMemoryError is never raised for a pluggable allocator. The one way to
// fail an allocation cleanly through that interface is an exception thrown from the function
// itself (PyTorch calls it from C++ before it records anything), which PyTorch's Python
// bindings turn into a RuntimeError with the exception's text. This library is C++, and a
// library of its own, so that libcuma stays plain C for every other user; it needs no PyTorch
// to build or load. Where PyTorch's headers were found, raise_c10.cpp builds the same entry
// point throwing PyTorch's own out-of-memory type, and cuma.torch prefers that one.
#include "failure_text.h"

#include <stdexcept>

extern "C" __attribute__((visibility("default"))) void *
cuma_torch_raising_malloc(ssize_t size, int device, cudaStream_t stream) {
    void *p = nullptr;
    cuma_status st = cuma_torch_alloc(size, device, stream, &p);
    if (st == CUMA_OK) return p;
    throw std::runtime_error(cuma_torch_failure_text(st, size, device));
}
