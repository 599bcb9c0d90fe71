// SPDX-License-Identifier: Apache-2.0
// What the C++ tests of the PyTorch entry points share: a check that aborts, and the entry
// points' types as PyTorch's pluggable allocator declares them.
#ifndef CUMA_TESTS_TORCH_TEST_H
#define CUMA_TESTS_TORCH_TEST_H

#include "cuma/torch.h"

#include <cstdio>
#include <cstdlib>

#define CHECK(c)                                                                                   \
    do {                                                                                           \
        if (!(c)) {                                                                                \
            std::fprintf(stderr, "%s:%d: CHECK failed: %s\n", __FILE__, __LINE__, #c);             \
            std::abort();                                                                          \
        }                                                                                          \
    } while (0)

typedef void *(*malloc_fn)(size_t, int, cudaStream_t); // PyTorch's declaration
typedef void (*free_fn)(void *, size_t, int, cudaStream_t);

#endif
