// SPDX-License-Identifier: Apache-2.0
/* Interned call stacks (stacks.h). */
#include "stacks.h"

#include "util/error.h"

#include <stdlib.h>
#include <string.h>

#define FNV_OFFSET 0xcbf29ce484222325ull
#define FNV_PRIME  0x100000001b3ull

static uint64_t fnv(uint64_t h, const void *p, size_t n) {
    const unsigned char *c = p;
    for (size_t i = 0; i < n; i++) h = (h ^ c[i]) * FNV_PRIME;
    return h;
}

/* The next key to try when h is taken by other content. */
static uint64_t rehash(uint64_t h) {
    return h * 0x9e3779b97f4a7c15ull + 1;
}

static cuma_status oom(const cuma_stacks_builder *b) {
    return cuma_fail(CUMA_ERR_OOM, "%s: out of host memory for the call stacks", b->path);
}

/* Room for one more of `size`-byte items in *v (cap items now), doubling. */
static int grow(void *vp, size_t *cap, size_t need, size_t size) {
    void **v = vp;
    if (need <= *cap) return 0;
    size_t c = *cap ? *cap : 64;
    while (c < need) c *= 2;
    void *n = realloc(*v, c * size);
    if (!n) return -1;
    *v = n;
    *cap = c;
    return 0;
}

cuma_status cuma_stacks_init(cuma_stacks_builder *b, const char *path) {
    memset(b, 0, sizeof *b);
    b->path = path;
    cuma_map_init(&b->strs);
    cuma_map_init(&b->frames);
    cuma_map_init(&b->stacks);
    if (grow(&b->s.start, &b->start_cap, 2, sizeof *b->s.start)) return oom(b);
    b->s.start[0] = b->s.start[1] = 0;
    b->s.nstacks = 1;
    return CUMA_OK;
}

static uint32_t str_off(const cuma_stacks_builder *b, uint32_t id) {
    return (uint32_t)(b->str[id] >> 24);
}

static cuma_status intern_str(cuma_stacks_builder *b, const char *p, size_t n, uint32_t *out) {
    if (n > CUMA_STACKS_MAX_NAME) n = CUMA_STACKS_MAX_NAME;
    uint64_t h = fnv(FNV_OFFSET, p, n);
    for (;;) {
        uintptr_t v = (uintptr_t)cuma_map_get(&b->strs, h);
        if (!v) break;
        uint32_t id = (uint32_t)(v - 1);
        if ((b->str[id] & 0xffffff) == n && !memcmp(b->s.text + str_off(b, id), p, n)) {
            *out = id;
            return CUMA_OK;
        }
        h = rehash(h);
    }
    if (b->s.text_len + n + 1 > UINT32_MAX || b->nstr >= UINT32_MAX - 1)
        return cuma_fail(CUMA_ERR_LIMIT,
                         "%s: more than 4 GiB of call-stack text, the reader's limit", b->path);
    if (grow(&b->s.text, &b->text_cap, b->s.text_len + n + 1, 1) ||
        grow(&b->str, &b->str_cap, b->nstr + 1, sizeof *b->str))
        return oom(b);
    memcpy(b->s.text + b->s.text_len, p, n);
    b->s.text[b->s.text_len + n] = 0;
    uint32_t id = (uint32_t)b->nstr++;
    b->str[id] = (uint64_t)b->s.text_len << 24 | n;
    b->s.text_len += n + 1;
    if (!cuma_map_put(&b->strs, h, (void *)(uintptr_t)(id + 1))) return oom(b);
    *out = id;
    return CUMA_OK;
}

cuma_status cuma_stacks_frame(cuma_stacks_builder *b, const char *file, size_t file_len,
                              const char *name, size_t name_len, uint32_t line, uint32_t *id) {
    uint32_t fs, ns;
    cuma_status st = intern_str(b, file, file_len, &fs);
    if (st == CUMA_OK) st = intern_str(b, name, name_len, &ns);
    if (st != CUMA_OK) return st;
    cuma_trace_frame f = {str_off(b, fs), str_off(b, ns), line};
    uint64_t h = fnv(FNV_OFFSET, &f, sizeof f);
    for (;;) {
        uintptr_t v = (uintptr_t)cuma_map_get(&b->frames, h);
        if (!v) break;
        const cuma_trace_frame *g = &b->s.frame[v - 1];
        if (g->file == f.file && g->name == f.name && g->line == f.line) {
            *id = (uint32_t)(v - 1);
            return CUMA_OK;
        }
        h = rehash(h);
    }
    if (b->s.nframes >= UINT32_MAX - 1)
        return cuma_fail(CUMA_ERR_LIMIT, "%s: more than 4 Gi distinct frames, the reader's limit",
                         b->path);
    if (grow(&b->s.frame, &b->frame_cap, (size_t)b->s.nframes + 1, sizeof *b->s.frame))
        return oom(b);
    b->s.frame[b->s.nframes] = f;
    if (!cuma_map_put(&b->frames, h, (void *)(uintptr_t)(b->s.nframes + 1))) return oom(b);
    *id = b->s.nframes++;
    return CUMA_OK;
}

cuma_status cuma_stacks_stack(cuma_stacks_builder *b, const uint32_t *frames, size_t n,
                              uint32_t *id) {
    if (!n) {
        *id = 0;
        return CUMA_OK;
    }
    uint64_t h = fnv(FNV_OFFSET, frames, n * sizeof *frames);
    for (;;) {
        uintptr_t v = (uintptr_t)cuma_map_get(&b->stacks, h);
        if (!v) break;
        uint32_t s = (uint32_t)(v - 1);
        size_t at = b->s.start[s], len = b->s.start[s + 1] - at;
        if (len == n && !memcmp(b->s.ix + at, frames, n * sizeof *frames)) {
            *id = s;
            return CUMA_OK;
        }
        h = rehash(h);
    }
    if (b->s.nstacks >= UINT32_MAX - 1)
        return cuma_fail(CUMA_ERR_LIMIT, "%s: more than 4 Gi distinct stacks, the reader's limit",
                         b->path);
    if (grow(&b->s.ix, &b->ix_cap, b->s.nix + n, sizeof *b->s.ix) ||
        grow(&b->s.start, &b->start_cap, (size_t)b->s.nstacks + 2, sizeof *b->s.start))
        return oom(b);
    memcpy(b->s.ix + b->s.nix, frames, n * sizeof *frames);
    b->s.nix += n;
    b->s.start[b->s.nstacks + 1] = b->s.nix;
    if (!cuma_map_put(&b->stacks, h, (void *)(uintptr_t)(b->s.nstacks + 1))) return oom(b);
    *id = b->s.nstacks++;
    return CUMA_OK;
}

static void drop_maps(cuma_stacks_builder *b) {
    cuma_map_destroy(&b->strs);
    cuma_map_destroy(&b->frames);
    cuma_map_destroy(&b->stacks);
    free(b->str);
    b->str = NULL;
}

void cuma_stacks_finish(cuma_stacks_builder *b, cuma_trace_stacks *out) {
    drop_maps(b);
    if (!b->s.text_len) { /* frames of no strings still need a "" to point at */
        if (!grow(&b->s.text, &b->text_cap, 1, 1)) b->s.text[b->s.text_len++] = 0;
    }
    *out = b->s;
    memset(b, 0, sizeof *b);
}

void cuma_stacks_discard(cuma_stacks_builder *b) {
    drop_maps(b);
    cuma_trace_stacks_free(&b->s);
    memset(b, 0, sizeof *b);
}

void cuma_trace_stacks_free(cuma_trace_stacks *s) {
    free(s->text);
    free(s->frame);
    free(s->ix);
    free(s->start);
    memset(s, 0, sizeof *s);
}

cuma_status cuma_trace_stacks_validate(const cuma_trace *t) {
    const cuma_trace_stacks *s = &t->stacks;
    if (!t->stack && !s->start) return CUMA_OK;
    if (!t->stack || !s->start || s->nstacks < 1 || !s->text || !s->text_len)
        return cuma_fail(CUMA_ERR_CORRUPT, "%s: stacks half there (stack %p, start %p, %u stacks)",
                         t->path, (void *)t->stack, (void *)s->start, s->nstacks);
    if (s->text[s->text_len - 1])
        return cuma_fail(CUMA_ERR_CORRUPT, "%s: stack text does not end in NUL", t->path);
    if (s->start[0] || s->start[1] || s->start[s->nstacks] != s->nix)
        return cuma_fail(CUMA_ERR_CORRUPT, "%s: stack starts %zu, %zu, end %zu of %zu frames",
                         t->path, s->start[0], s->start[1], s->start[s->nstacks], s->nix);
    for (uint32_t i = 0; i < s->nstacks; i++)
        if (s->start[i] > s->start[i + 1])
            return cuma_fail(CUMA_ERR_CORRUPT, "%s: stack %u starts after stack %u", t->path, i,
                             i + 1);
    for (size_t i = 0; i < s->nix; i++)
        if (s->ix[i] >= s->nframes)
            return cuma_fail(CUMA_ERR_CORRUPT, "%s: stack entry %zu names frame %u of %u", t->path,
                             i, s->ix[i], s->nframes);
    for (uint32_t i = 0; i < s->nframes; i++)
        if (s->frame[i].file >= s->text_len || s->frame[i].name >= s->text_len)
            return cuma_fail(CUMA_ERR_CORRUPT, "%s: frame %u's text beyond the %zu bytes", t->path,
                             i, s->text_len);
    for (size_t i = 0; i < t->n; i++)
        if (t->stack[i] >= s->nstacks)
            return cuma_fail(CUMA_ERR_CORRUPT, "%s: event %zu has stack %u of %u", t->path, i,
                             t->stack[i], s->nstacks);
    return CUMA_OK;
}
