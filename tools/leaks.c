// SPDX-License-Identifier: Apache-2.0
/* `cuma leaks`: what a recording still holds at its end, by call site, and which call sites
 * keep growing over it (docs/TOOLS.md, "cuma leaks").
 *
 * Call site: the rule of callsite.c (the innermost frame of the program's own Python code, else
 * of an installed package, else in the backward pass the autograd node). A trace without stacks
 * (RMM CSV) is grouped by power-of-two size class.
 *
 * Growth: the recorded events (not the blocks alive before recording) are cut into W windows
 * of equal event counts, and each site's low point (its least live bytes) in each window is
 * taken. A site is growing when its low points never fall from one window to the next, rise
 * in at least half of the W - 1 steps, and rise in the last one (still growing at the end). Why
 * this does not trip on a steady training loop: a site whose live bytes repeat with each iteration
 * has the same low point in every window that spans at least one whole iteration (the window holds
 * the whole cycle, so its minimum is the cycle's), so its low points are flat; memory made once
 * (optimizer state in the first step) rises in one step only, and memory built up over the first
 * windows and then held (state made layer by layer) stops rising before the end. A leak of every
 * iteration rises in every window. The premise is that windows are at least an iteration long: with
 * fewer iterations recorded than windows, lower --windows.
 */
#include "callsite.h"
#include "cli.h"

#include "trace/trace.h"

#include <inttypes.h>
#include <limits.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define DEFAULT_TOP     20
#define DEFAULT_WINDOWS 4
#define MAX_WINDOWS     1000
#define SIZE_CLASSES    65 /* bit widths 0..64 of a size */

typedef struct options {
    int json, all_frames, device;
    uint64_t top, windows, max_events;
} options;

/* One live allocation at the end: its group (site or size class) and stack. */
typedef struct live {
    uint32_t group, stack;
    uint64_t size;
} live;

/* A group's figures. */
typedef struct group {
    uint32_t key;
    uint64_t bytes, allocs;
} group;

typedef struct ctx {
    const cuma_trace *t;
    const options *o;
    uint32_t ngroups;  /* stacks: distinct sites (at most nstacks); else SIZE_CLASSES */
    uint32_t *site_of; /* stacks: per stack its group */
    uint32_t *key_of;  /* stacks: per group its site (NO_STACK, NO_SITE, FIRST_SITE + frame) */
} ctx;

static const char *text(const cuma_trace *t, uint32_t off) {
    return t->stacks.text + off;
}

/* Groups of a trace with stacks: NO_STACK, NO_SITE, then FIRST_SITE + frame id (callsite.h). */
#define NO_STACK   CALLSITE_NONE
#define NO_SITE    CALLSITE_UNKNOWN
#define FIRST_SITE CALLSITE_FIRST

static uint32_t bit_width(uint64_t v) {
    uint32_t w = 0;
    while (v) w++, v >>= 1;
    return w;
}

static uint32_t group_of(const ctx *c, size_t i) {
    if (c->t->stack) return c->site_of[c->t->stack[i]];
    return bit_width(c->t->ev[i].size);
}

static void fmt_bytes(uint64_t b, char *out, size_t len) {
    static const char *unit[] = {"B", "KiB", "MiB", "GiB", "TiB"};
    double v = (double)b;
    int u = 0;
    while (v >= 1024 && u < 4) v /= 1024, u++;
    if (!u)
        snprintf(out, len, "%" PRIu64 " B", b);
    else
        snprintf(out, len, "%.1f %s", v, unit[u]);
}

/* The group's label for the table: "FILE:LINE NAME", or a size class. */
static void label(const ctx *c, uint32_t g, char *out, size_t len) {
    char a[64], b[64], shown[1024];
    if (c->key_of) g = c->key_of[g];
    if (!c->t->stack) {
        if (g == 0) {
            snprintf(out, len, "size 0");
            return;
        }
        fmt_bytes(g == 1 ? 1 : (uint64_t)1 << (g - 1), a, sizeof a);
        fmt_bytes(g >= 64 ? UINT64_MAX : ((uint64_t)1 << g) - 1, b, sizeof b);
        snprintf(out, len, "size %s to %s", a, b);
        return;
    }
    if (g == NO_STACK) {
        snprintf(out, len, "(no stack recorded%s)",
                 c->t->preexisting ? "; blocks alive before recording have none" : "");
        return;
    }
    if (g == NO_SITE) {
        snprintf(out, len, "%s",
                 c->t->format == CUMA_TRACE_RMM_CSV
                     ? "(no frame outside the allocator; --all-frames shows them)"
                     : "(no Python frame outside torch; --all-frames shows the "
                       "stacks)");
        return;
    }
    const cuma_trace_frame *f = &c->t->stacks.frame[g - FIRST_SITE];
    char line[1100];
    const char *name = text(c->t, f->name);
    if (c->t->format == CUMA_TRACE_RMM_CSV) {
        if (f->line)
            snprintf(line, sizeof line, "%s:%u %s", text(c->t, f->file), f->line, name);
        else
            snprintf(line, sizeof line, "%s", name);
    } else if (!callsite_ends_with(text(c->t, f->file), ".py")) {
        /* an autograd node: its C++ name without the argument list, which says nothing here */
        int n = (int)strcspn(name, "(");
        snprintf(line, sizeof line, "%.*s (backward pass)", n, name);
    } else {
        snprintf(line, sizeof line, "%s:%u %s", text(c->t, f->file), f->line, name);
    }
    snprintf(out, len, "%s", cli_shown(line, shown, sizeof shown));
}

static int by_group_stack(const void *x, const void *y) {
    const live *a = x, *b = y;
    if (a->group != b->group) return a->group < b->group ? -1 : 1;
    return a->stack < b->stack ? -1 : a->stack > b->stack;
}

static int by_bytes(const void *x, const void *y) {
    const group *a = x, *b = y;
    if (a->bytes != b->bytes) return a->bytes > b->bytes ? -1 : 1;
    return a->key < b->key ? -1 : a->key > b->key;
}

static void json_str(const char *s) {
    putchar('"');
    for (const unsigned char *p = (const unsigned char *)s; *p; p++) {
        if (*p == '"' || *p == '\\')
            printf("\\%c", *p);
        else if (*p < 0x20 || *p == 0x7f)
            printf("\\u%04x", *p);
        else
            putchar(*p);
    }
    putchar('"');
}

static void json_frame(const cuma_trace *t, uint32_t f) {
    const cuma_trace_frame *fr = &t->stacks.frame[f];
    printf("{\"file\":");
    json_str(text(t, fr->file));
    printf(",\"line\":%u,\"name\":", fr->line);
    json_str(text(t, fr->name));
    putchar('}');
}

static void json_site(const ctx *c, uint32_t g) {
    if (c->key_of) g = c->key_of[g];
    if (!c->t->stack) {
        printf("\"size_class\":{\"min\":%" PRIu64 ",\"max\":%" PRIu64 "}",
               g == 0   ? 0
               : g == 1 ? 1
                        : (uint64_t)1 << (g - 1),
               g == 0    ? 0
               : g >= 64 ? UINT64_MAX
                         : ((uint64_t)1 << g) - 1);
    } else if (g < FIRST_SITE) {
        printf("\"site\":null,\"stack_recorded\":%s", g == NO_STACK ? "false" : "true");
    } else {
        printf("\"site\":");
        json_frame(c->t, g - FIRST_SITE);
    }
}

/* The stacks of group g's live allocations v[0..n) (sorted by stack), largest first. */
static void print_stacks(const ctx *c, const live *v, size_t n) {
    const cuma_trace_stacks *st = &c->t->stacks;
    group *s = malloc((n ? n : 1) * sizeof *s);
    if (!s) return;
    size_t k = 0;
    for (size_t i = 0; i < n; i++) {
        if (!k || s[k - 1].key != v[i].stack) s[k++] = (group){v[i].stack, 0, 0};
        s[k - 1].bytes += v[i].size;
        s[k - 1].allocs++;
    }
    qsort(s, k, sizeof *s, by_bytes);
    for (size_t j = 0; j < k; j++) {
        char b[64], shown[1024];
        fmt_bytes(s[j].bytes, b, sizeof b);
        if (c->o->json) {
            printf("%s{\"bytes\":%" PRIu64 ",\"allocs\":%" PRIu64 ",\"frames\":[", j ? "," : "",
                   s[j].bytes, s[j].allocs);
            for (size_t f = st->start[s[j].key]; f < st->start[s[j].key + 1]; f++) {
                if (f > st->start[s[j].key]) putchar(',');
                json_frame(c->t, st->ix[f]);
            }
            printf("]}");
            continue;
        }
        printf("      stack of %s in %" PRIu64 " allocations:\n", b, s[j].allocs);
        if (st->start[s[j].key] == st->start[s[j].key + 1]) printf("        (none recorded)\n");
        for (size_t f = st->start[s[j].key]; f < st->start[s[j].key + 1]; f++) {
            const cuma_trace_frame *fr = &st->frame[st->ix[f]];
            char line[1100];
            snprintf(line, sizeof line, "%s:%u %s", text(c->t, fr->file), fr->line,
                     text(c->t, fr->name));
            printf("        #%zu %s\n", f - st->start[s[j].key],
                   cli_shown(line, shown, sizeof shown));
        }
    }
    free(s);
}

/* Part (a): the allocations live at the end, by group. */
static int report_live(const ctx *c) {
    const cuma_trace *t = c->t;
    size_t n = 0;
    for (size_t i = 0; i < t->n; i++)
        n += t->ev[i].action == CUMA_TRACE_ALLOC && t->ev[i].match < 0;
    live *v = malloc((n ? n : 1) * sizeof *v);
    group *g = malloc((n ? n : 1) * sizeof *g);
    size_t *first = malloc((n ? n : 1) * sizeof *first);
    if (!v || !g || !first) {
        free(v), free(g), free(first);
        cli_eprintf("cuma leaks: out of host memory\n");
        return CUMA_EXIT_FAIL;
    }
    n = 0;
    uint64_t total = 0;
    for (size_t i = 0; i < t->n; i++)
        if (t->ev[i].action == CUMA_TRACE_ALLOC && t->ev[i].match < 0) {
            v[n++] = (live){group_of(c, i), t->stack ? t->stack[i] : 0, t->ev[i].size};
            total += t->ev[i].size;
        }
    qsort(v, n, sizeof *v, by_group_stack);
    size_t ng = 0;
    for (size_t i = 0; i < n; i++) {
        if (!ng || g[ng - 1].key != v[i].group) first[ng] = i, g[ng++] = (group){v[i].group, 0, 0};
        g[ng - 1].bytes += v[i].size;
        g[ng - 1].allocs++;
    }
    group *gs = malloc((ng ? ng : 1) * sizeof *gs);
    if (!gs) {
        free(v), free(g), free(first);
        cli_eprintf("cuma leaks: out of host memory\n");
        return CUMA_EXIT_FAIL;
    }
    memcpy(gs, g, ng * sizeof *gs);
    qsort(gs, ng, sizeof *gs, by_bytes);
    char b[64], lab[1200];
    fmt_bytes(total, b, sizeof b);
    if (c->o->json) {
        printf(",\"live\":{\"bytes\":%" PRIu64 ",\"allocs\":%zu,\"groups\":%zu,\"by_site\":[",
               total, n, ng);
    } else {
        printf("  live at the end: %zu allocations, %s, %s %zu %s\n", n, b, t->stack ? "at" : "in",
               ng, t->stack ? "call sites" : "size classes");
        if (ng) printf("  %12s %8s  %s\n", "bytes", "allocs", t->stack ? "call site" : "size");
    }
    for (size_t j = 0; j < ng && j < c->o->top; j++) {
        /* the group's run in v: found by key (groups are few, and this is printing) */
        size_t at = 0;
        for (size_t k = 0; k < ng; k++)
            if (g[k].key == gs[j].key) at = first[k];
        if (c->o->json) {
            printf("%s{", j ? "," : "");
            json_site(c, gs[j].key);
            printf(",\"bytes\":%" PRIu64 ",\"allocs\":%" PRIu64, gs[j].bytes, gs[j].allocs);
            if (c->o->all_frames && t->stack) {
                printf(",\"stacks\":[");
                print_stacks(c, v + at, gs[j].allocs);
                putchar(']');
            }
            putchar('}');
            continue;
        }
        fmt_bytes(gs[j].bytes, b, sizeof b);
        label(c, gs[j].key, lab, sizeof lab);
        printf("  %12s %8" PRIu64 "  %s\n", b, gs[j].allocs, lab);
        if (c->o->all_frames && t->stack) print_stacks(c, v + at, gs[j].allocs);
    }
    if (c->o->json)
        printf("]}");
    else if (ng > c->o->top)
        printf("  (%zu more; --top N shows more)\n", ng - (size_t)c->o->top);
    free(v), free(g), free(first), free(gs);
    return CUMA_EXIT_OK;
}

/* Part (b): the groups whose low points rise window by window (see the top of the file). */
static int report_growth(const ctx *c) {
    const cuma_trace *t = c->t;
    size_t W = (size_t)c->o->windows, recorded = t->n - t->preexisting;
    if (recorded < 2 * W) {
        if (c->o->json)
            printf(",\"windows\":null,\"growing\":null");
        else
            printf("  growth: %zu recorded events are too few for %zu windows\n", recorded, W);
        return CUMA_EXIT_OK;
    }
    size_t G = c->ngroups;
    uint64_t *level = calloc(G, sizeof *level), *low = calloc(G, W * sizeof *low);
    if (!level || !low) {
        free(level), free(low);
        cli_eprintf("cuma leaks: out of host memory\n");
        return CUMA_EXIT_FAIL;
    }
    for (size_t i = 0; i < t->preexisting; i++) level[group_of(c, i)] += t->ev[i].size;
    size_t w = SIZE_MAX;
    for (size_t i = t->preexisting; i < t->n; i++) {
        size_t wi = (i - t->preexisting) * W / recorded;
        if (wi != w) {
            w = wi;
            for (size_t g = 0; g < G; g++) low[g * W + w] = level[g];
        }
        const cuma_trace_event *e = &t->ev[i];
        if (e->action == CUMA_TRACE_ALLOC) {
            level[group_of(c, i)] += e->size;
        } else if (e->action == CUMA_TRACE_FREE && e->match >= 0) {
            size_t g = group_of(c, (size_t)e->match);
            level[g] -= t->ev[e->match].size;
            if (level[g] < low[g * W + w]) low[g * W + w] = level[g];
        }
    }
    if (c->o->json)
        printf(",\"windows\":%zu,\"window_events\":%zu,\"growing\":[", W, recorded / W);
    else
        printf("  growing %s (low point of live bytes in each of %zu windows of ~%zu events "
               "never falls, rises in half the steps and the last):\n",
               t->stack ? "call sites" : "size classes", W, recorded / W);
    /* The growing groups, most growth first (group.bytes: the growth). */
    group *hit = malloc(G * sizeof *hit);
    if (!hit) {
        free(level), free(low);
        cli_eprintf("cuma leaks: out of host memory\n");
        return CUMA_EXIT_FAIL;
    }
    size_t nhit = 0;
    for (size_t g = 0; g < G; g++) {
        const uint64_t *f = low + g * W;
        size_t rises = 0;
        int falls = 0;
        for (size_t k = 0; k + 1 < W; k++) rises += f[k + 1] > f[k], falls |= f[k + 1] < f[k];
        if (falls || 2 * rises < W - 1 || f[W - 1] == f[W - 2]) continue;
        hit[nhit++] = (group){(uint32_t)g, f[W - 1] - f[0], 0};
    }
    qsort(hit, nhit, sizeof *hit, by_bytes);
    size_t shown = 0;
    for (size_t h = 0; h < nhit; h++) {
        size_t g = hit[h].key;
        const uint64_t *f = low + g * W;
        char lab[1200], b[64];
        if (c->o->json) {
            printf("%s{", shown ? "," : "");
            json_site(c, (uint32_t)g);
            printf(",\"growth_bytes\":%" PRIu64 ",\"low_points\":[", f[W - 1] - f[0]);
            for (size_t k = 0; k < W; k++) printf("%s%" PRIu64, k ? "," : "", f[k]);
            printf("]}");
        } else {
            label(c, (uint32_t)g, lab, sizeof lab);
            fmt_bytes(f[W - 1] - f[0], b, sizeof b);
            printf("  %12s more  %s  (low points:", b, lab);
            for (size_t k = 0; k < W; k++) {
                fmt_bytes(f[k], b, sizeof b);
                printf(" %s", b);
            }
            printf(")\n");
        }
        shown++;
    }
    if (c->o->json)
        putchar(']');
    else if (!shown)
        printf("  (none)\n");
    free(level), free(low), free(hit);
    return CUMA_EXIT_OK;
}

static int leaks_one(const char *path, const options *o) {
    cuma_trace t;
    cuma_trace_opts lo = {.max_events = (size_t)o->max_events, .device = o->device, .stacks = 1};
    if (cuma_trace_load_opts(path, &lo, &t) != CUMA_OK) {
        cli_eprintf("cuma leaks: %s\n", cuma_last_error());
        return CUMA_EXIT_USAGE;
    }
    ctx c = {.t = &t, .o = o, .ngroups = SIZE_CLASSES};
    if (t.stack) {
        /* Groups are numbered densely, in the order stacks first name them: there are at most
         * as many as stacks, however many frames the file has. */
        uint32_t *dense = calloc((size_t)t.stacks.nframes + FIRST_SITE, sizeof *dense);
        c.site_of = malloc((size_t)t.stacks.nstacks * sizeof *c.site_of);
        c.key_of = malloc((size_t)t.stacks.nstacks * sizeof *c.key_of);
        if (!dense || !c.site_of || !c.key_of) {
            free(dense), free(c.site_of), free(c.key_of);
            cuma_trace_free(&t);
            cli_eprintf("cuma leaks: out of host memory\n");
            return CUMA_EXIT_FAIL;
        }
        c.ngroups = 0;
        for (uint32_t s = 0; s < t.stacks.nstacks; s++) {
            uint32_t k = callsite_of_stack(&t, s);
            if (!dense[k]) c.key_of[c.ngroups] = k, dense[k] = ++c.ngroups;
            c.site_of[s] = dense[k] - 1;
        }
        free(dense);
    }
    char shown[1024];
    if (o->json) {
        printf("{\"trace\":");
        json_str(path);
        printf(",\"format\":\"%s\",\"device\":%d,\"events\":%zu,\"stacks\":%s",
               t.format == CUMA_TRACE_TORCH_SNAPSHOT   ? "pytorch_snapshot"
               : t.format == CUMA_TRACE_TORCH_PROFILER ? "pytorch_profiler"
                                                       : "rmm_csv",
               t.device, t.n, t.stack ? "true" : "false");
    } else {
        printf("%s: %s, device %d, %zu events\n", cli_shown(path, shown, sizeof shown),
               t.format == CUMA_TRACE_TORCH_SNAPSHOT   ? "PyTorch snapshot"
               : t.format == CUMA_TRACE_TORCH_PROFILER ? "PyTorch profiler trace"
                                                       : "RMM CSV log",
               t.device, t.n);
        if (!t.stack && t.format == CUMA_TRACE_TORCH_PROFILER)
            printf("  no call sites recorded (a profiler trace's memory events have none): "
                   "grouped by size\n");
        else if (!t.stack)
            printf("  no call sites recorded (a log written with trace_stacks:on has them): "
                   "grouped by size\n");
    }
    int rc = report_live(&c);
    if (rc == CUMA_EXIT_OK) rc = report_growth(&c);
    if (o->json) printf("}\n");
    free(c.site_of);
    free(c.key_of);
    cuma_trace_free(&t);
    return rc;
}

static int parse_count(const char *s, uint64_t lo, uint64_t hi, uint64_t *out) {
    char *end;
    if (*s < '0' || *s > '9') return -1;
    unsigned long long v = strtoull(s, &end, 10);
    if (*end || v < lo || v > hi) return -1;
    *out = v;
    return 0;
}

int cuma_cmd_leaks(int argc, char **argv) {
    if (cli_wants_help(argc, argv, CUMA_LEAKS_USAGE)) return CUMA_EXIT_OK;
    options o = {.device = -1,
                 .top = DEFAULT_TOP,
                 .windows = DEFAULT_WINDOWS,
                 .max_events = CUMA_TRACE_MAX_EVENTS};
    char **traces = calloc((size_t)argc, sizeof *traces);
    if (!traces) return CUMA_EXIT_FAIL;
    int ntraces = 0, only_traces = 0;
    for (int i = 1; i < argc; i++) {
        int missing = 0;
        const char *v;
        uint64_t dev;
        if (only_traces || argv[i][0] != '-' || !argv[i][1]) {
            traces[ntraces++] = argv[i];
        } else if (!strcmp(argv[i], "--")) {
            only_traces = 1;
        } else if (!strcmp(argv[i], "--json")) {
            o.json = 1;
        } else if (!strcmp(argv[i], "--all-frames")) {
            o.all_frames = 1;
        } else if ((v = cli_option(argc, argv, &i, "--top", &missing)) != NULL) {
            if (parse_count(v, 1, UINT32_MAX, &o.top)) goto bad_value;
        } else if ((v = cli_option(argc, argv, &i, "--windows", &missing)) != NULL) {
            if (parse_count(v, 2, MAX_WINDOWS, &o.windows)) goto bad_value;
        } else if ((v = cli_option(argc, argv, &i, "--max-events", &missing)) != NULL) {
            if (parse_count(v, 1, 1ull << 32, &o.max_events)) goto bad_value;
        } else if ((v = cli_option(argc, argv, &i, "--device", &missing)) != NULL) {
            if (parse_count(v, 0, INT_MAX, &dev)) goto bad_value;
            o.device = (int)dev;
        } else if (missing) {
            free(traces);
            return cli_usage_error("leaks", CUMA_LEAKS_USAGE, "%s wants a value", argv[i]);
        } else {
            free(traces);
            return cli_usage_error("leaks", CUMA_LEAKS_USAGE, "unknown option '%s'", argv[i]);
        }
        continue;
    bad_value:
        free(traces);
        return cli_usage_error("leaks", CUMA_LEAKS_USAGE, "bad value '%s' for %s", v, argv[i - 1]);
    }
    if (!ntraces) {
        free(traces);
        return cli_usage_error("leaks", CUMA_LEAKS_USAGE, "no trace given");
    }
    int worst = CUMA_EXIT_OK;
    for (int k = 0; k < ntraces; k++) {
        int rc = leaks_one(traces[k], &o);
        if (rc > worst) worst = rc;
    }
    free(traces);
    return worst;
}
