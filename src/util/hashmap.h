// SPDX-License-Identifier: Apache-2.0
/* An open-addressing hash map from 64-bit keys to pointers (linear probing, backward-shift
 * deletion, so there are no tombstones and lookups stay short after heavy churn).
 * Not thread-safe: the owner's lock protects it. */
#ifndef CUMA_UTIL_HASHMAP_H
#define CUMA_UTIL_HASHMAP_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

/* Invariants (cuma_map_validate): cap is a power of two or 0; count <= cap / 2; every key
 * is reachable from its home slot without crossing an empty slot; an empty slot has
 * value NULL. Values are never NULL. */
typedef struct cuma_map {
    uint64_t *keys;
    void **vals;
    size_t cap, count;
} cuma_map;

void cuma_map_init(cuma_map *m);
void cuma_map_destroy(cuma_map *m);
/* Inserts or replaces; false when memory for growing could not be had. */
bool cuma_map_put(cuma_map *m, uint64_t key, void *val);
void *cuma_map_get(const cuma_map *m, uint64_t key);
/* Removes and returns the value, or NULL if absent. */
void *cuma_map_remove(cuma_map *m, uint64_t key);
/* Calls fn for every entry (order unspecified); stops when fn returns false. */
void cuma_map_each(const cuma_map *m, bool (*fn)(void *ctx, uint64_t key, void *val), void *ctx);
bool cuma_map_validate(const cuma_map *m, const char **why);

#endif
