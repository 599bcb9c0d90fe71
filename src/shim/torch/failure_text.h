// SPDX-License-Identifier: Apache-2.0
// The text of a failed allocation, shared by libcuma_torch.so (raise.cpp) and
// libcuma_torch_c10-<torch version>.so (raise_c10.cpp), so that both say exactly the same
// whichever exception type carries it.
#ifndef CUMA_SHIM_TORCH_FAILURE_TEXT_H
#define CUMA_SHIM_TORCH_FAILURE_TEXT_H

#include "cuma/torch.h"

#include <cstdio>
#include <string>

// Whether `st` means the device (or cuma's limit) had no room: the failures PyTorch's own
// allocator reports as out of memory.
static inline bool cuma_torch_is_oom(cuma_status st) {
    return st == CUMA_ERR_OOM || st == CUMA_ERR_LIMIT;
}

// "What failed: " then cuma's reason (cuma_last_error() of this thread). Out of memory is
// worded as PyTorch words its own, so that code matching "CUDA out of memory" in the text
// (and cuma.adaptive.is_oom) treats both allocators alike.
static inline std::string cuma_torch_failure_text(cuma_status st, ssize_t size, int device) {
    char head[160];
    if (cuma_torch_is_oom(st))
        std::snprintf(head, sizeof head,
                      "CUDA out of memory. Tried to allocate %zd bytes on device %d (cuma): ", size,
                      device);
    else
        std::snprintf(head, sizeof head,
                      "cuma: allocating %zd bytes on device %d failed (%s): ", size, device,
                      cuma_status_string(st));
    return std::string(head) + cuma_last_error();
}

#endif
