// SPDX-License-Identifier: Apache-2.0
/* cuma_alloc_with_stack: in a heap logging with trace_stacks:on, the stack a caller names (the
 * Python package's frames) is the allocation's stack in LOG.stacks, read back frame for frame:
 * each distinct stack and frame written once, a malformed line taken as far as it goes, more
 * than 32 frames and names over 1024 bytes cut, "" and NULL giving the native stack. Without
 * trace_stacks it is cuma_alloc. The reader refuses F and P records in a version 1 file, a
 * stack naming a frame not given, and a later version, saying so.
 *
 *   test_stack_text DIR   (a writable folder for the logs) */
#include "check.h"
#include "cuma/cuma.h"
#include "trace/trace.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#define MB (1024u * 1024u)

static const char *text_of(const cuma_trace *t, uint32_t off) {
    return t->stacks.text + off;
}

/* Frame k of event e's stack. */
static const cuma_trace_frame *frame_at(const cuma_trace *t, size_t e, size_t k) {
    uint32_t s = t->stack[e];
    CHECK(t->stacks.start[s] + k < t->stacks.start[s + 1]);
    return &t->stacks.frame[t->stacks.ix[t->stacks.start[s] + k]];
}

static size_t depth(const cuma_trace *t, size_t e) {
    uint32_t s = t->stack[e];
    return t->stacks.start[s + 1] - t->stacks.start[s];
}

static void check_frame(const cuma_trace *t, size_t e, size_t k, const char *file, uint32_t line,
                        const char *name) {
    const cuma_trace_frame *f = frame_at(t, e, k);
    if (strcmp(text_of(t, f->file), file) || f->line != line || strcmp(text_of(t, f->name), name)) {
        fprintf(stderr, "event %zu frame %zu: %s:%u %s, wanted %s:%u %s\n", e, k,
                text_of(t, f->file), f->line, text_of(t, f->name), file, line, name);
        abort();
    }
}

static size_t count_lines(const char *path, char kind) {
    FILE *f = fopen(path, "r");
    CHECK(f);
    char line[8192];
    size_t n = 0;
    while (fgets(line, sizeof line, f)) n += line[0] == kind && line[1] == ' ';
    fclose(f);
    return n;
}

static void logged(const char *dir) {
    char log[512], stacks[600], conf[700];
    snprintf(log, sizeof log, "%s/stack_text.csv", dir);
    snprintf(stacks, sizeof stacks, "%s.stacks", log);
    unlink(log), unlink(stacks);
    snprintf(conf, sizeof conf, "backend:sim,capacity:256M,trace:%s,trace_stacks:on", log);
    cuma_config cfg = {.conf = conf, .flags = CUMA_CONFIG_NO_ENV};
    cuma_heap *h = NULL;
    CHECK_OK(cuma_heap_create(&cfg, &h));
    void *p[8] = {0};
    const char *two = "/src/app.py\t17\tleaky_cache\n/src/app.py\t30\tmain";
    CHECK_OK(cuma_alloc_with_stack(h, MB, NULL, &p[0], two));     /* event 0 */
    CHECK_OK(cuma_alloc_with_stack(h, 2 * MB, NULL, &p[1], two)); /* 1: the same stack */
    /* 2: a line without tabs is a file; one tab, a file and a line; a bad number, line 0 */
    CHECK_OK(cuma_alloc_with_stack(h, MB, NULL, &p[2], "justafile\nf.py\t9\nf.py\tx\tg\n"));
    /* 3: 40 frames, a 3000-byte name in the first */
    size_t cap = 40 * 64 + 4096;
    char *deep = malloc(cap), *at = deep;
    at += sprintf(at, "deep.py\t1\t");
    memset(at, 'n', 3000), at += 3000;
    for (int i = 2; i <= 40; i++) at += sprintf(at, "\ndeep.py\t%d\tf%d", i, i);
    CHECK_OK(cuma_alloc_with_stack(h, MB, NULL, &p[3], deep));
    free(deep);
    CHECK_OK(cuma_alloc_with_stack(h, MB, NULL, &p[4], ""));   /* 4: native */
    CHECK_OK(cuma_alloc_with_stack(h, MB, NULL, &p[5], NULL)); /* 5: native */
    CHECK_OK(cuma_alloc(h, MB, NULL, &p[6]));                  /* 6: native */
    for (int i = 0; i < 7; i++) CHECK_OK(cuma_free(h, p[i], NULL));
    cuma_heap_destroy(h);

    /* One P record a distinct named stack, one F record a distinct frame: app.py's two, the
     * three of the malformed lines, deep.py's 32. */
    CHECK(count_lines(stacks, 'P') == 3);
    CHECK(count_lines(stacks, 'F') == 2 + 3 + 32);

    cuma_trace_opts o = {.device = -1, .stacks = 1};
    cuma_trace t;
    CHECK_OK(cuma_trace_load_opts(log, &o, &t));
    CHECK_OK(cuma_trace_stacks_validate(&t));
    CHECK(t.n == 14 && t.stack);
    CHECK(t.stack[0] && t.stack[0] == t.stack[1] && depth(&t, 0) == 2);
    check_frame(&t, 0, 0, "/src/app.py", 17, "leaky_cache");
    check_frame(&t, 0, 1, "/src/app.py", 30, "main");
    CHECK(depth(&t, 2) == 3);
    check_frame(&t, 2, 0, "justafile", 0, "");
    check_frame(&t, 2, 1, "f.py", 9, "");
    check_frame(&t, 2, 2, "f.py", 0, "g");
    CHECK(depth(&t, 3) == 32);
    const cuma_trace_frame *f = frame_at(&t, 3, 0);
    CHECK(f->line == 1 && strlen(text_of(&t, f->name)) == 1024);
    check_frame(&t, 3, 31, "deep.py", 32, "f32");
    /* The native stacks: this program's own frames, symbolised, never named ones. */
    for (size_t e = 4; e <= 6; e++) {
        CHECK(t.stack[e] && depth(&t, e) > 0);
        for (size_t k = 0; k < depth(&t, e); k++)
            CHECK(!strstr(text_of(&t, frame_at(&t, e, k)->file), ".py"));
    }
    cuma_trace_free(&t);
}

/* Without trace_stacks, cuma_alloc_with_stack allocates and frees as cuma_alloc, and no stacks
 * file appears. */
static void unlogged(const char *dir) {
    char log[512], stacks[600], conf[700];
    snprintf(log, sizeof log, "%s/stack_text_off.csv", dir);
    snprintf(stacks, sizeof stacks, "%s.stacks", log);
    unlink(log), unlink(stacks);
    snprintf(conf, sizeof conf, "backend:sim,capacity:256M,trace:%s", log);
    cuma_config cfg = {.conf = conf, .flags = CUMA_CONFIG_NO_ENV};
    cuma_heap *h = NULL;
    CHECK_OK(cuma_heap_create(&cfg, &h));
    void *p = NULL;
    CHECK_OK(cuma_alloc_with_stack(h, MB, NULL, &p, "a.py\t1\tf"));
    CHECK(p);
    CHECK_OK(cuma_free(h, p, NULL));
    CHECK_ST(cuma_alloc_with_stack(h, 0, NULL, &p, "a.py\t1\tf"), CUMA_ERR_INVALID);
    cuma_heap_destroy(h);
    CHECK(access(stacks, F_OK) != 0);
}

/* Writes a log of one allocation with the stacks file `body` beside it; reads it into *t. */
static cuma_status load_written(const char *dir, const char *body, cuma_trace *t) {
    char log[512], stacks[600];
    snprintf(log, sizeof log, "%s/stack_text_file.csv", dir);
    snprintf(stacks, sizeof stacks, "%s.stacks", log);
    FILE *f = fopen(log, "w");
    CHECK(f);
    fputs("Thread,Time,Action,Pointer,Size,Stream\n1,00:00:00:000001,allocate,0x1000,256,0\n", f);
    fclose(f);
    CHECK((f = fopen(stacks, "w")));
    fputs(body, f);
    fclose(f);
    cuma_trace_opts o = {.device = -1, .stacks = 1};
    return cuma_trace_load_opts(log, &o, t);
}

/* Such a log is refused: CUMA_ERR_PARSE saying `why`. */
static void refused(const char *dir, const char *body, const char *why) {
    cuma_trace t;
    CHECK_ST(load_written(dir, body, &t), CUMA_ERR_PARSE);
    if (!strstr(cuma_last_error(), why)) {
        fprintf(stderr, "wanted \"%s\" in: %s\n", why, cuma_last_error());
        abort();
    }
}

int main(int argc, char **argv) {
    if (argc != 2) {
        fprintf(stderr, "usage: test_stack_text DIR\n");
        return 2;
    }
    logged(argv[1]);
    unlogged(argv[1]);
    refused(argv[1], "cuma-stacks 1\nF 1 3 a.py\tf\nP 1 1\nE 0 1\n", "unknown record");
    refused(argv[1], "cuma-stacks 2\nF 1 3 a.py\tf\nP 1 2\nE 0 1\n", "a frame not given");
    refused(argv[1], "cuma-stacks 2\nF 2 3 a.py\tf\n", "count up from 1");
    refused(argv[1], "cuma-stacks 2\nF 1 3 a.py f\n", "bad named frame record");
    refused(argv[1], "cuma-stacks 3\n", "later version");
    refused(argv[1], "cuma-stacks 2\nF 1 3 a.py\tf\nP 1 1\nE 5 1\n", "past the log's end");
    /* Well formed, with a name holding a tab and a version 1 file: both read. */
    cuma_trace t;
    CHECK_OK(load_written(argv[1], "cuma-stacks 2\nF 1 3 a b.py\tf\tg\nP 1 1\nE 0 1\n", &t));
    CHECK(t.stack[0] && depth(&t, 0) == 1);
    check_frame(&t, 0, 0, "a b.py", 3, "f\tg");
    cuma_trace_free(&t);
    CHECK_OK(load_written(argv[1], "cuma-stacks 1\n", &t));
    CHECK(t.stack && !t.stack[0]);
    cuma_trace_free(&t);
    puts("stack_text: all passed");
    return 0;
}
