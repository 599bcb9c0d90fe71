// SPDX-License-Identifier: Apache-2.0
/* Timelines: what a replay's heap held over the trace's time, as a small CSV file.
 *
 *   time_s,requested_bytes,reserved_bytes,cached_bytes,mapped_bytes
 *   0.000098,7552,2097152,0,2097152
 *
 * The writer (`cuma replay --timeline DIR`) is fed every state of the measuring pass (after
 * each event and each release between events) and keeps, for each of TL_BUCKETS equal slices
 * of the trace's time span, the first and the last state, the state with the most requested
 * bytes and the one that ends it (the next with other requested bytes), and the same for
 * reserved bytes: at most 6 rows a slice, 3840 in all. docs/PLOTS.md says why that set. The reader
 * (`cuma plot`) accepts any file of that form.
 */
#ifndef CUMA_TOOLS_TIMELINE_H
#define CUMA_TOOLS_TIMELINE_H

#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#define TL_HEADER  "time_s,requested_bytes,reserved_bytes,cached_bytes,mapped_bytes"
#define TL_BUCKETS 640 /* slices of the time span; about one per pixel column of a plot */
#define TL_KEEP    6   /* states kept per slice: first, last, two peaks and their ends */

typedef struct tl_state {
    uint64_t time_us;
    uint64_t requested, reserved, cached, mapped;
    uint64_t seq; /* order of arrival: ties in time keep their order, one state is one row */
} tl_state;

typedef struct tl_writer {
    FILE *f;
    char *path;
    uint64_t t0_us, span_us; /* the slices cover [t0, t0 + span] */
    uint64_t bucket;         /* slice of the states in keep[]; UINT64_MAX before the first */
    tl_state keep[TL_KEEP];  /* first, last, max req, its end, max res, its end */
    int open_end[2];         /* the slice's peak of requested [0] / reserved [1] still lasts */
    uint64_t seq;
    size_t rows;
} tl_writer;

/* The stem of a trace's timeline file: its base name without .gz and .csv (*len bytes from the
 * returned pointer, inside trace_path). */
const char *tl_stem(const char *trace_path, size_t *len);
/* Opens DIR/<stem>.timeline.csv for the trace at trace_path (stem: its base name without .gz
 * and .csv) for times in [t0_us, t0_us + span_us]. 0, or -1 with a message on stderr naming
 * the file. */
int tl_open(tl_writer *w, const char *dir, const char *trace_path, uint64_t t0_us,
            uint64_t span_us);
/* One state of the heap. Times must not go back. */
void tl_add(tl_writer *w, uint64_t time_us, uint64_t requested, uint64_t reserved, uint64_t cached,
            uint64_t mapped);
/* Writes the last slice and closes the file: 0, or -1 with a message naming the file (a
 * write error). ok = 0 discards the file (the replay failed). */
int tl_close(tl_writer *w, int ok);

/* ---- reading -------------------------------------------------------------------------------- */

typedef struct tl_row {
    double t; /* seconds */
    double requested, reserved, cached, mapped;
} tl_row;

typedef struct tl_series {
    char *path;
    tl_row *rows;
    size_t n;
} tl_series;

/* Reads a timeline file. CUMA_EXIT_OK; CUMA_EXIT_USAGE with a message on stderr
 * "PROG: FILE:LINE: what" (or "PROG: FILE: what") for an unreadable or empty file, a wrong
 * header, a line without 5 fields, a field that is not a finite non-negative number (times) or
 * a decimal integer that fits 64 bits (bytes), a time that goes back, no row at all;
 * CUMA_EXIT_FAIL when memory runs out. Blank lines are skipped. */
int tl_read(const char *prog, const char *path, tl_series *out);
void tl_series_free(tl_series *s);

#endif
