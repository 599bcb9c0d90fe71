// SPDX-License-Identifier: Apache-2.0
/* Shared by the fuzz harnesses: an invariant that breaks aborts, so that libFuzzer saves the
 * input as a crash and the replay test (standalone_main.c) fails on it. */
#ifndef CUMA_TESTS_FUZZ_H
#define CUMA_TESTS_FUZZ_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

#include "cuma/cuma.h"

/* The first variadic argument is a printf format saying what was seen. */
#define FZ_CHECK(cond, ...)                                                                        \
    do {                                                                                           \
        if (!(cond)) {                                                                             \
            fprintf(stderr, "%s:%d: invariant broken: %s: ", __FILE__, __LINE__, #cond);           \
            fprintf(stderr, __VA_ARGS__);                                                          \
            fprintf(stderr, " (last error: %s)\n", cuma_last_error());                             \
            abort();                                                                               \
        }                                                                                          \
    } while (0)

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

/* Reads the input front to back; past its end every byte reads as zero, so that any input
 * decodes to a finite, well-defined sequence. */
typedef struct fz_reader {
    const uint8_t *p;
    size_t n, at;
} fz_reader;

static inline int fz_more(const fz_reader *r) {
    return r->at < r->n;
}

static inline uint8_t fz_u8(fz_reader *r) {
    return r->at < r->n ? r->p[r->at++] : 0;
}

static inline uint32_t fz_u16(fz_reader *r) {
    uint32_t lo = fz_u8(r);
    return lo | (uint32_t)fz_u8(r) << 8;
}

static inline uint32_t fz_u32(fz_reader *r) {
    uint32_t lo = fz_u16(r);
    return lo | fz_u16(r) << 16;
}

#endif
