// SPDX-License-Identifier: Apache-2.0
#include "util/hashmap.h"

#include <stdlib.h>

/* Fibonacci hashing: keys are aligned offsets, so the low bits alone would cluster. */
static size_t slot_of(uint64_t key, size_t cap) {
    return (size_t)((key * 0x9E3779B97F4A7C15ull) >> 17) & (cap - 1);
}

void cuma_map_init(cuma_map *m) {
    m->keys = NULL, m->vals = NULL, m->cap = m->count = 0;
}

void cuma_map_destroy(cuma_map *m) {
    free(m->keys);
    free(m->vals);
    cuma_map_init(m);
}

static bool grow(cuma_map *m) {
    size_t ncap = m->cap ? m->cap * 2 : 64;
    uint64_t *nk = malloc(ncap * sizeof *nk);
    void **nv = calloc(ncap, sizeof *nv);
    if (!nk || !nv) {
        free(nk), free(nv);
        return false;
    }
    for (size_t i = 0; i < m->cap; i++) {
        if (!m->vals[i]) continue;
        size_t j = slot_of(m->keys[i], ncap);
        while (nv[j]) j = (j + 1) & (ncap - 1);
        nk[j] = m->keys[i], nv[j] = m->vals[i];
    }
    free(m->keys), free(m->vals);
    m->keys = nk, m->vals = nv, m->cap = ncap;
    return true;
}

bool cuma_map_put(cuma_map *m, uint64_t key, void *val) {
    if ((m->count + 1) * 2 > m->cap && !grow(m)) return false;
    size_t i = slot_of(key, m->cap);
    while (m->vals[i] && m->keys[i] != key) i = (i + 1) & (m->cap - 1);
    if (!m->vals[i]) m->count++;
    m->keys[i] = key, m->vals[i] = val;
    return true;
}

void *cuma_map_get(const cuma_map *m, uint64_t key) {
    if (!m->cap) return NULL;
    for (size_t i = slot_of(key, m->cap);; i = (i + 1) & (m->cap - 1)) {
        if (!m->vals[i]) return NULL;
        if (m->keys[i] == key) return m->vals[i];
    }
}

void *cuma_map_remove(cuma_map *m, uint64_t key) {
    if (!m->cap) return NULL;
    size_t mask = m->cap - 1, i = slot_of(key, m->cap);
    while (m->vals[i] && m->keys[i] != key) i = (i + 1) & mask;
    void *val = m->vals[i];
    if (!val) return NULL;
    /* Shift later entries of the run back, so no probe sequence crosses a hole. */
    for (size_t j = (i + 1) & mask; m->vals[j]; j = (j + 1) & mask) {
        size_t home = slot_of(m->keys[j], m->cap);
        /* j's entry may move to i only if its home is not in (i, j] cyclically. */
        bool stays = i <= j ? (home > i && home <= j) : (home > i || home <= j);
        if (stays) continue;
        m->keys[i] = m->keys[j], m->vals[i] = m->vals[j];
        i = j;
    }
    m->vals[i] = NULL;
    m->count--;
    return val;
}

void cuma_map_each(const cuma_map *m, bool (*fn)(void *, uint64_t, void *), void *ctx) {
    for (size_t i = 0; i < m->cap; i++)
        if (m->vals[i] && !fn(ctx, m->keys[i], m->vals[i])) return;
}

bool cuma_map_validate(const cuma_map *m, const char **why) {
    if (m->cap & (m->cap - 1)) return *why = "capacity not a power of two", false;
    if (m->count * 2 > m->cap) return *why = "load factor over 1/2", false;
    size_t n = 0;
    for (size_t i = 0; i < m->cap; i++) {
        if (!m->vals[i]) continue;
        n++;
        for (size_t j = slot_of(m->keys[i], m->cap); j != i; j = (j + 1) & (m->cap - 1))
            if (!m->vals[j]) return *why = "key unreachable from its home slot", false;
    }
    if (n != m->count) return *why = "count differs from occupied slots", false;
    return true;
}
