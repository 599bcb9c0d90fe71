// SPDX-License-Identifier: Apache-2.0
/* `cuma plot --html`: one self-contained HTML report of a trace (docs/TOOLS.md, "cuma plot").
 *
 * The page is tools/report.html, built in as a string (cmake/embed.cmake); this file puts one
 * JavaScript object in it at the CUMA_DATA mark:
 *   series  the timeline `cuma replay --timeline` would write for the trace on the default
 *           settings (replay_timeline): at most 3840 rows, already a per-pixel sampling with
 *           every slice's peaks, so the page draws them as they are;
 *   blocks  every allocation of more than 0 bytes, column by column: alloc and free times (us;
 *           -1: never freed), size, recorded address, stack. The page rebuilds the live set at
 *           a hovered moment from these, so no moment is missing;
 *   frames, stacks, site  the call stacks of a snapshot read with its stacks, each once, and
 *           per stack its call site by callsite.c's rule (-1: none), as `cuma leaks` names it.
 * Times are made monotonic as the replay makes them (threads interleave in a log). Strings are
 * JSON with '<' escaped, so no text of the trace can end the script element.
 */
#include "callsite.h"
#include "cli.h"
#include "plot_html.h"
#include "replay.h"
#include "timeline.h"

#include "trace/trace.h"

#include <errno.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

extern const char cuma_report_html[]; /* tools/report.html (generated report_html.c) */

#define DATA_MARK "/*@CUMA_DATA@*/"

static void json_str(FILE *f, const char *s) {
    fputc('"', f);
    for (const unsigned char *p = (const unsigned char *)s; *p; p++) {
        if (*p == '"' || *p == '\\')
            fprintf(f, "\\%c", *p);
        else if (*p < 0x20 || *p == 0x7f || *p == '<' || *p == '>' || *p == '&')
            fprintf(f, "\\u%04x", *p);
        else
            fputc(*p, f);
    }
    fputc('"', f);
}

/* One column of the timeline: 0 requested, 1 reserved, 2 cached; whole bytes. */
static void series_column(FILE *f, const char *name, const tl_series *s, int col) {
    fprintf(f, ",\"%s\":[", name);
    for (size_t k = 0; k < s->n; k++) {
        const tl_row *r = &s->rows[k];
        double v = col == 0 ? r->requested : col == 1 ? r->reserved : r->cached;
        fprintf(f, "%s%.0f", k ? "," : "", v);
    }
    fputc(']', f);
}

/* The allocations' columns; mono[i] is event i's time made monotonic. */
static void blocks(FILE *f, const cuma_trace *t, const uint64_t *mono) {
    static const char *const names[] = {"a", "f", "size", "addr", "stack"};
    fputs(",\"blocks\":{", f);
    for (int c = 0; c < 5; c++) {
        fprintf(f, "%s\"%s\":[", c ? "," : "", names[c]);
        int first = 1;
        for (size_t i = 0; i < t->n; i++) {
            const cuma_trace_event *e = &t->ev[i];
            if (e->action != CUMA_TRACE_ALLOC || !e->size) continue;
            if (!first) fputc(',', f);
            first = 0;
            if (c == 0) fprintf(f, "%" PRIu64, mono[i]);
            if (c == 1) {
                if (e->match < 0)
                    fputs("-1", f);
                else
                    fprintf(f, "%" PRIu64, mono[e->match]);
            }
            if (c == 2) fprintf(f, "%" PRIu64, e->size);
            /* Addresses above 2^53 would lose bits as JavaScript numbers: device addresses are
             * 48-bit, and a wider one is only an identifier, so it is folded. */
            if (c == 3) fprintf(f, "%" PRIu64, e->ptr & ((UINT64_C(1) << 53) - 1));
            if (c == 4) fprintf(f, "%" PRIu32, t->stack ? t->stack[i] : 0);
        }
        fputc(']', f);
    }
    fputc('}', f);
}

static void stacks(FILE *f, const cuma_trace *t) {
    const cuma_trace_stacks *st = &t->stacks;
    fputs(",\"frames\":[", f);
    for (uint32_t k = 0; t->stack && k < st->nframes; k++) {
        const cuma_trace_frame *fr = &st->frame[k];
        fputs(k ? ",[" : "[", f);
        json_str(f, st->text + fr->file);
        fprintf(f, ",%" PRIu32 ",", fr->line);
        json_str(f, st->text + fr->name);
        fputc(']', f);
    }
    fputs("],\"stacks\":[[]", f); /* stack 0, the empty one, also for a trace without stacks */
    for (uint32_t s = 1; t->stack && s < st->nstacks; s++) {
        fputs(",[", f);
        for (size_t k = st->start[s]; k < st->start[s + 1]; k++)
            fprintf(f, "%s%" PRIu32, k > st->start[s] ? "," : "", st->ix[k]);
        fputc(']', f);
    }
    fputs("],\"site\":[-1", f);
    for (uint32_t s = 1; t->stack && s < st->nstacks; s++) {
        uint32_t site = callsite_of_stack(t, s);
        fprintf(f, ",%" PRId64, site >= CALLSITE_FIRST ? (int64_t)(site - CALLSITE_FIRST) : -1);
    }
    fputc(']', f);
}

static int write_data(FILE *f, const char *title, const cuma_trace *t, const tl_series *s) {
    uint64_t *mono = malloc((t->n ? t->n : 1) * sizeof *mono);
    if (!mono) {
        cli_eprintf("cuma plot: %s: out of memory\n", t->path);
        return CUMA_EXIT_FAIL;
    }
    uint64_t now = 0;
    for (size_t i = 0; i < t->n; i++)
        mono[i] = now = t->ev[i].time_us > now ? t->ev[i].time_us : now;
    fputs("const CUMA = {\"title\":", f);
    json_str(f, title);
    fputs(",\"trace\":", f);
    json_str(f, replay_base_name(t->path));
    fprintf(f, ",\"format\":\"%s\",\"events\":%zu,\"series\":{\"t\":[",
            t->format == CUMA_TRACE_TORCH_SNAPSHOT   ? "PyTorch snapshot"
            : t->format == CUMA_TRACE_TORCH_PROFILER ? "PyTorch profiler trace"
                                                     : "RMM CSV",
            t->n);
    for (size_t k = 0; k < s->n; k++) fprintf(f, "%s%.6f", k ? "," : "", s->rows[k].t);
    fputc(']', f);
    series_column(f, "req", s, 0);
    series_column(f, "res", s, 1);
    series_column(f, "cached", s, 2);
    fputc('}', f);
    blocks(f, t, mono);
    stacks(f, t);
    fputs("};", f);
    free(mono);
    return CUMA_EXIT_OK;
}

static int write_page(const char *out, const char *title, const cuma_trace *t, const tl_series *s) {
    const char *mark = strstr(cuma_report_html, DATA_MARK);
    if (!mark) {
        cli_eprintf("cuma plot: the built-in report page has no %s mark\n", DATA_MARK);
        return CUMA_EXIT_FAIL;
    }
    FILE *f = out ? fopen(out, "w") : stdout;
    if (!f) {
        cli_eprintf("cuma plot: cannot write %s: %s\n", out, strerror(errno));
        return CUMA_EXIT_USAGE;
    }
    fwrite(cuma_report_html, 1, (size_t)(mark - cuma_report_html), f);
    int rc = write_data(f, title, t, s);
    fputs(mark + strlen(DATA_MARK), f);
    int bad = ferror(f);
    if (out ? fclose(f) != 0 : fflush(f) != 0) bad = 1;
    if (bad && rc == CUMA_EXIT_OK) {
        cli_eprintf("cuma plot: error writing %s\n", out ? out : "stdout");
        rc = CUMA_EXIT_FAIL;
    }
    if (rc != CUMA_EXIT_OK && out) remove(out); /* no half-written report */
    return rc;
}

int plot_html(const char *out, const char *title, const char *trace_path, int device,
              uint64_t max_events) {
    cuma_trace t;
    cuma_trace_opts o = {.max_events = (size_t)max_events, .device = device, .stacks = 1};
    cuma_status st = cuma_trace_load_opts(trace_path, &o, &t);
    if (st != CUMA_OK) {
        cli_eprintf("cuma plot: %s\n", cuma_last_error());
        return st == CUMA_ERR_OOM ? CUMA_EXIT_FAIL : CUMA_EXIT_USAGE;
    }
    if (cuma_trace_stacks_validate(&t) != CUMA_OK) {
        cli_eprintf("cuma plot: %s\n", cuma_last_error());
        cuma_trace_free(&t);
        return CUMA_EXIT_FAIL;
    }
    tl_series s;
    int rc = replay_timeline(&t, &s);
    if (rc == CUMA_EXIT_OK) {
        rc = write_page(out, title, &t, &s);
        tl_series_free(&s);
    }
    cuma_trace_free(&t);
    return rc;
}
