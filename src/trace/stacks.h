// SPDX-License-Identifier: Apache-2.0
/* Builder of a trace's call stacks (cuma_trace_stacks, trace.h): interns strings, frames and
 * stacks by content, so each distinct one is stored once however often the recording repeats
 * it. Internal to the trace readers.
 *
 * Lookups go through 64-bit content hashes; a hash that is taken by other content is rehashed
 * until a free or matching one is found, so a collision (even a crafted one) never merges two
 * different frames or stacks.
 */
#ifndef CUMA_TRACE_STACKS_H
#define CUMA_TRACE_STACKS_H

#include "util/hashmap.h"
#include "trace.h"

typedef struct cuma_stacks_builder {
    cuma_trace_stacks s;
    size_t text_cap, frame_cap, ix_cap, start_cap;
    uint64_t *str; /* per string: offset << 24 | length; lengths over 16 MiB are refused */
    size_t nstr, str_cap;
    cuma_map strs, frames, stacks; /* content hash -> id + 1 */
    const char *path;              /* names the file in messages */
} cuma_stacks_builder;

/* Longest file or function name kept (bytes); a longer one is cut there. */
#define CUMA_STACKS_MAX_NAME ((size_t)1 << 16)

/* Starts an empty builder that holds stack 0, the empty one. CUMA_ERR_OOM. */
cuma_status cuma_stacks_init(cuma_stacks_builder *b, const char *path);

/* The id of the frame (file, name, line), added if new. CUMA_ERR_OOM, CUMA_ERR_LIMIT (4 Gi
 * frames or text). */
cuma_status cuma_stacks_frame(cuma_stacks_builder *b, const char *file, size_t file_len,
                              const char *name, size_t name_len, uint32_t line, uint32_t *id);

/* The id of the stack frames[0..n) (frame ids, innermost first), added if new; n 0 is stack 0. */
cuma_status cuma_stacks_stack(cuma_stacks_builder *b, const uint32_t *frames, size_t n,
                              uint32_t *id);

/* Moves the table into *out (the builder is emptied). */
void cuma_stacks_finish(cuma_stacks_builder *b, cuma_trace_stacks *out);

/* Frees a builder that will not be finished. */
void cuma_stacks_discard(cuma_stacks_builder *b);

/* Frees a finished table and empties it. */
void cuma_trace_stacks_free(cuma_trace_stacks *s);

#endif
