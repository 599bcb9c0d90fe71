// SPDX-License-Identifier: Apache-2.0
/* A block of the heap's address space: the unit the placement policies split and merge, and
 * the record behind every live pointer. Block metadata lives in host memory, never in the
 * device memory it describes. */
#ifndef CUMA_PLACE_BLOCK_H
#define CUMA_PLACE_BLOCK_H

#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>

#define CUMA_NO_STREAM 0xFFFFu

/* Invariants (checked by the policies' validate):
 * - a range's blocks tile it exactly: b->next->off == b->off + b->size, prev/next agree;
 * - a free block is on exactly one free list, a live block on none;
 * - live: req <= size, stream is a valid stream index; free: req == 0;
 * - off and size are multiples of the policy's granule (512 B);
 * - gen is odd while the program holds the block, even otherwise (see tcache.h);
 * - live: mapped_len is the length from off whose pages it references (<= size);
 * - extra[] holds the streams cuma_record_stream added (CUMA_NO_STREAM = empty slot);
 *   extra_all means "more than fit": wait for every stream. */
/* Aligned to a cache line: blocks of different threads' caches sit next to each other in the
 * descriptor pool, and their generations are written on every fast-path call. */
typedef struct __attribute__((aligned(64))) cuma_block {
    uint64_t off, size;
    struct cuma_block *prev, *next;   /* address neighbours in the same range */
    struct cuma_block *fprev, *fnext; /* free list (policy-owned) */
    uint64_t req;                     /* live: bytes requested */
    uint64_t mapped_len;              /* live or cached: bytes from off whose pages it holds */
    _Atomic uint64_t gen;             /* hand-over count; survives descriptor recycling */
    uint64_t fence_seq;               /* free: gseq of the last free in it (0 = clean) */
    uint16_t fence_stream;            /* free: stream index of that free, or FENCE_MULTI */
    uint16_t stream;                  /* live: stream index it was allocated on */
    uint16_t extra[2];                /* live: streams added by record_stream */
    uint8_t is_free;
    uint8_t extra_all;
    uint8_t bin_or_order;        /* policy-owned */
    uint8_t range_end;           /* last block of its range (segments) */
    uint32_t tc_slot, tc_tabgen; /* in a thread cache: its pointer-table slot (tcache.c) */
} cuma_block;

#endif
