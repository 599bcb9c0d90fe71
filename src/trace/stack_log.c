// SPDX-License-Identifier: Apache-2.0
/* LOG.stacks, written (stack_log.h has the format). Stacks (and named frames) are told apart by
 * their content's hash and compared in full, so two stacks never share an id. The file is written
 * through its own buffer with write(2), not stdio: a forked child's exit would flush a copy of a
 * FILE's buffer into the parent's file. */
#include "stack_log.h"

#include "util/error.h"
#include "util/hashmap.h"
#include "util/safefile.h"

#include <errno.h>
#include <execinfo.h>
#include <inttypes.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

/* One distinct stack; chained per hash in the map. */
typedef struct known_stack {
    struct known_stack *next;
    uint32_t id;
    int n;
    void *frames[];
} known_stack;

/* One distinct named stack (or named frame): its text as given, chained per hash. */
typedef struct known_text {
    struct known_text *next;
    uint32_t id;
    size_t len;
    char text[];
} known_text;

/* An executable mapping already written. */
typedef struct mapping {
    uint64_t start, end;
} mapping;

struct cuma_stack_log {
    int fd;
    int failed;
    char *path;
    char buf[1 << 16];
    size_t len;
    cuma_map stacks; /* frames' hash -> known_stack chain */
    cuma_map texts;  /* named stacks: text's hash -> known_text chain */
    cuma_map named;  /* named frames: line's hash -> known_text chain */
    uint32_t nstacks, nnamed;
    mapping *maps;
    size_t nmaps, maps_cap;
};

static void flush(cuma_stack_log *s) {
    size_t off = 0;
    while (!s->failed && off < s->len) {
        ssize_t r = write(s->fd, s->buf + off, s->len - off);
        if (r < 0 && errno == EINTR) continue;
        if (r <= 0) {
            fprintf(stderr, "cuma: trace stacks %s: write failed (%s): the stacks stop here\n",
                    s->path, r < 0 ? strerror(errno) : "no space");
            s->failed = 1;
        } else {
            off += (size_t)r;
        }
    }
    s->len = 0;
}

static void put(cuma_stack_log *s, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void put(cuma_stack_log *s, const char *fmt, ...) {
    if (s->failed) return;
    /* Room for the longest record (a named frame: two names of CUMA_STACK_NAME_MAX). */
    if (sizeof s->buf - s->len < 4096) flush(s);
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(s->buf + s->len, sizeof s->buf - s->len, fmt, ap);
    va_end(ap);
    if (n > 0)
        s->len += (size_t)n < sizeof s->buf - s->len ? (size_t)n : sizeof s->buf - s->len - 1;
}

cuma_status cuma_stack_log_open(const char *log_path, cuma_stack_log **out) {
    *out = NULL;
    cuma_stack_log *s = calloc(1, sizeof *s);
    size_t plen = strlen(log_path) + sizeof ".stacks";
    if (!s || !(s->path = malloc(plen))) {
        free(s);
        return cuma_fail(CUMA_ERR_OOM, "trace stacks: no host memory");
    }
    snprintf(s->path, plen, "%s.stacks", log_path);
    char why[256];
    s->fd = cuma_file_open_log(s->path, why, sizeof why);
    if (s->fd < 0) {
        cuma_status st = cuma_fail(CUMA_ERR_IO, "trace stacks %s: %s", s->path, why);
        free(s->path);
        free(s);
        return st;
    }
    if (ftruncate(s->fd, 0)) {
        cuma_status st =
            cuma_fail(CUMA_ERR_IO, "trace stacks %s: truncating: %s", s->path, strerror(errno));
        close(s->fd);
        free(s->path);
        free(s);
        return st;
    }
    cuma_map_init(&s->stacks);
    cuma_map_init(&s->texts);
    cuma_map_init(&s->named);
    put(s, "cuma-stacks 2\n");
    *out = s;
    return CUMA_OK;
}

static int mapped(const cuma_stack_log *s, uint64_t a) {
    for (size_t i = 0; i < s->nmaps; i++)
        if (a >= s->maps[i].start && a < s->maps[i].end) return 1;
    return 0;
}

/* Writes the executable mappings not written yet (a library loaded since, or the first look). */
static void write_maps(cuma_stack_log *s) {
    FILE *f = fopen("/proc/self/maps", "re");
    if (!f) return;
    char line[4096 + 128];
    while (fgets(line, sizeof line, f)) {
        unsigned long long start, end, off;
        char perms[8];
        int at = 0;
        if (sscanf(line, "%llx-%llx %7s %llx %*s %*s %n", &start, &end, perms, &off, &at) < 4 ||
            perms[2] != 'x' || !at)
            continue;
        char *path = line + at;
        path[strcspn(path, "\n")] = 0;
        if (path[0] != '/' || mapped(s, start)) continue;
        if (s->nmaps == s->maps_cap) {
            size_t cap = s->maps_cap ? 2 * s->maps_cap : 32;
            mapping *m = realloc(s->maps, cap * sizeof *m);
            if (!m) break;
            s->maps = m;
            s->maps_cap = cap;
        }
        s->maps[s->nmaps++] = (mapping){start, end};
        put(s, "M %llx %llx %llx %s\n", start, end, off, path);
    }
    fclose(f);
}

static uint64_t hash_frames(void *const *frames, int n) {
    uint64_t h = 0x9E3779B97F4A7C15ull ^ (uint64_t)n;
    for (int i = 0; i < n; i++) {
        h ^= (uint64_t)(uintptr_t)frames[i];
        h *= 0xff51afd7ed558ccdull;
        h ^= h >> 33;
    }
    return h;
}

void cuma_stack_log_event(cuma_stack_log *s, uint64_t event, void *const *frames, int n) {
    if (!s || s->failed || n <= 0) return;
    uint64_t h = hash_frames(frames, n);
    known_stack *head = cuma_map_get(&s->stacks, h), *k = head;
    while (k && (k->n != n || memcmp(k->frames, frames, (size_t)n * sizeof *frames))) k = k->next;
    if (!k) {
        if (!(k = malloc(sizeof *k + (size_t)n * sizeof *frames))) return;
        k->n = n;
        k->id = ++s->nstacks;
        memcpy(k->frames, frames, (size_t)n * sizeof *frames);
        k->next = head;
        if (!cuma_map_put(&s->stacks, h, k)) {
            free(k);
            s->nstacks--;
            return;
        }
        for (int i = 0; i < n; i++)
            if (!mapped(s, (uint64_t)(uintptr_t)frames[i])) {
                write_maps(s);
                break;
            }
        put(s, "S %" PRIu32, k->id);
        for (int i = 0; i < n; i++) put(s, " %" PRIxPTR, (uintptr_t)frames[i]);
        put(s, "\n");
    }
    put(s, "E %" PRIu64 " %" PRIu32 "\n", event, k->id);
}

static uint64_t hash_bytes(const char *p, size_t n) {
    uint64_t h = 0xcbf29ce484222325ull;
    for (size_t i = 0; i < n; i++) h = (h ^ (unsigned char)p[i]) * 0x100000001b3ull;
    return h;
}

/* The entry of map m whose text is p[0..n), added with the next of *count's ids when new (*added
 * says so); NULL without host memory. */
static known_text *intern_text(cuma_map *m, uint32_t *count, const char *p, size_t n, int *added) {
    uint64_t h = hash_bytes(p, n);
    known_text *head = cuma_map_get(m, h), *k = head;
    while (k && (k->len != n || memcmp(k->text, p, n))) k = k->next;
    *added = 0;
    if (k) return k;
    if (!(k = malloc(sizeof *k + n))) return NULL;
    k->len = n;
    memcpy(k->text, p, n);
    k->next = head;
    if (!cuma_map_put(m, h, k)) {
        free(k);
        return NULL;
    }
    k->id = ++*count;
    *added = 1;
    return k;
}

/* The id of the named frame on line p[0..n) ("FILE\tLINE\tNAME"), its F record written when
 * new; 0 without host memory. */
static uint32_t named_frame(cuma_stack_log *s, const char *p, size_t n) {
    int added;
    known_text *k = intern_text(&s->named, &s->nnamed, p, n, &added);
    if (!k || !added) return k ? k->id : 0;
    const char *end = p + n, *tab = memchr(p, '\t', n);
    const char *file_end = tab ? tab : end, *q = tab ? tab + 1 : end;
    uint64_t line = 0; /* past 32 bits: unknown */
    while (q < end && *q >= '0' && *q <= '9' && line <= UINT32_MAX)
        line = line * 10 + (uint64_t)(*q++ - '0');
    if (line > UINT32_MAX) line = 0;
    const char *name = memchr(q, '\t', (size_t)(end - q));
    name = name ? name + 1 : end;
    int flen = (int)(file_end - p), nlen = (int)(end - name);
    if (flen > CUMA_STACK_NAME_MAX) flen = CUMA_STACK_NAME_MAX;
    if (nlen > CUMA_STACK_NAME_MAX) nlen = CUMA_STACK_NAME_MAX;
    put(s, "F %" PRIu32 " %" PRIu64 " %.*s\t%.*s\n", k->id, line, flen, p, nlen, name);
    return k->id;
}

void cuma_stack_log_event_text(cuma_stack_log *s, uint64_t event, const char *text) {
    if (!s || s->failed || !text || !*text) return;
    /* The text up to its CUMA_STACK_FRAMES'th line: longer stacks are cut there. */
    size_t n = 0;
    for (int lines = 0; text[n] && lines < CUMA_STACK_FRAMES; lines++) {
        const char *nl = strchr(text + n, '\n');
        n = nl ? (size_t)(nl - text) + 1 : n + strlen(text + n);
    }
    int added;
    known_text *k = intern_text(&s->texts, &s->nstacks, text, n, &added);
    if (!k) return;
    if (added) {
        uint32_t ids[CUMA_STACK_FRAMES];
        int nids = 0;
        for (size_t at = 0; at < n && nids < CUMA_STACK_FRAMES;) {
            const char *nl = memchr(text + at, '\n', n - at);
            size_t len = nl ? (size_t)(nl - (text + at)) : n - at;
            uint32_t id = named_frame(s, text + at, len);
            if (!id) break; /* no host memory: the frames so far */
            ids[nids++] = id;
            at += len + 1;
        }
        put(s, "P %" PRIu32, k->id);
        for (int i = 0; i < nids; i++) put(s, " %" PRIu32, ids[i]);
        put(s, "\n");
    }
    put(s, "E %" PRIu64 " %" PRIu32 "\n", event, k->id);
}

static bool free_text_chain(void *ctx, uint64_t key, void *val) {
    (void)ctx, (void)key;
    for (known_text *k = val, *next; k; k = next) {
        next = k->next;
        free(k);
    }
    return true;
}

static bool free_chain(void *ctx, uint64_t key, void *val) {
    (void)ctx, (void)key;
    for (known_stack *k = val, *next; k; k = next) {
        next = k->next;
        free(k);
    }
    return true;
}

void cuma_stack_log_close(cuma_stack_log *s, int write) {
    if (!s) return;
    if (write) flush(s);
    close(s->fd);
    cuma_map_each(&s->stacks, free_chain, NULL);
    cuma_map_destroy(&s->stacks);
    cuma_map_each(&s->texts, free_text_chain, NULL);
    cuma_map_destroy(&s->texts);
    cuma_map_each(&s->named, free_text_chain, NULL);
    cuma_map_destroy(&s->named);
    free(s->maps);
    free(s->path);
    free(s);
}

__attribute__((noinline)) int cuma_stack_capture(void **frames) {
    void *all[CUMA_STACK_FRAMES + 2];
    int n = backtrace(all, CUMA_STACK_FRAMES + 2);
    /* Frame 0 is this function, frame 1 its caller (the allocator's slow path). */
    int skip = n < 2 ? n : 2;
    memcpy(frames, all + skip, (size_t)(n - skip) * sizeof *frames);
    return n - skip;
}
