// SPDX-License-Identifier: Apache-2.0
/* torch.profiler Chrome traces (prof.export_chrome_trace() after profile(profile_memory=True))
 * as a cuma_trace: the converter behind cuma_trace_load_opts for files whose first byte after a
 * UTF-8 byte-order mark and white space is '{' or '['. Internal to the trace reader.
 *
 * The file is JSON: an object whose "traceEvents" is an array of event objects (kineto's
 * layout), or that array alone (Chrome's array form). Only the events named "[memory]" and
 * "[OutOfMemory]" are kept, and of them only "ts" (microseconds, a fraction allowed) and the
 * "args" numbers "Addr" (an intptr_t: a negative one is taken as its bits), "Bytes" (negative
 * for a free), "Total Reserved", "Device Type" (0 CPU, 1 CUDA) and "Device Id". Everything else
 * is checked to be JSON and skipped; the bytes of strings are not checked to be UTF-8, as no
 * text is kept (only keys and names are compared with ASCII ones).
 *
 * The JSON reader is written for hostile input: CUMA_CHROME_MAX_BYTES decompressed at most,
 * CUMA_CHROME_MAX_DEPTH levels of nesting, CUMA_CHROME_MAX_STRING bytes a string,
 * CUMA_CHROME_MAX_NUMBER characters a number, and max_events memory events. Every error is
 * CUMA_ERR_PARSE or CUMA_ERR_LIMIT and reads "FILE:LINE: what is wrong (offset N)", N being
 * the byte offset in the decompressed file.
 *
 * The events (trace.h, cuma_trace_load_opts, says how they map) are sorted by time, ties kept
 * in file order. */
#ifndef CUMA_TRACE_CHROME_TRACE_H
#define CUMA_TRACE_CHROME_TRACE_H

#include <stddef.h>
#include <stdint.h>
#include <zlib.h>

#include "trace.h"

#define CUMA_CHROME_MAX_BYTES  ((size_t)2 << 30) /* decompressed, as for snapshots */
#define CUMA_CHROME_MAX_DEPTH  64u               /* kineto writes 5 levels */
#define CUMA_CHROME_MAX_STRING ((size_t)4 << 20) /* bytes of one string as written */
#define CUMA_CHROME_MAX_NUMBER 256u              /* characters of one number */

/* Reads the rest of gz (opened on path) as a Chrome trace into *out, which is empty on entry
 * and on failure; skipped bytes (a byte-order mark and white space, holding `lines` newlines)
 * were read before, so that messages give the file's own offsets and lines. device -1: the CUDA
 * device with the most memory events, or the CPU's events when there are no CUDA ones
 * (out->device is then -1). */
cuma_status cuma_chrome_read(gzFile gz, const char *path, size_t skipped, size_t lines,
                             size_t max_events, int device, cuma_trace *out);

/* cuma_chrome_read on bytes already in memory (the fuzz target's way in); a leading byte-order
 * mark and white space are skipped here. path names them in messages. */
cuma_status cuma_chrome_from_bytes(const uint8_t *buf, size_t len, const char *path,
                                   size_t max_events, int device, cuma_trace *out);

#endif
