// SPDX-License-Identifier: Apache-2.0
/* Pieces `cuma replay` (replay.c) shares with its PyTorch-model engine (replay_torch.c). */
#ifndef CUMA_TOOLS_REPLAY_H
#define CUMA_TOOLS_REPLAY_H

#include "timeline.h"
#include "trace/trace.h"
#include "trace/torch_model.h"

#include <stdint.h>

/* s as a JSON string on stdout. */
void replay_json_string(const char *s);

/* The JSON fields that say where trace t came from and what a snapshot or profiler trace
 * recorded, with the replay's own time-averaged reserved bytes (each field preceded by a
 * comma). */
void replay_json_source(const cuma_trace *t, uint64_t time_avg_reserved);

/* The file name part of a path. */
const char *replay_base_name(const char *path);

/* Replays t on the PyTorch allocator model with settings *c (conf_text: the text they came
 * from, for the output) and prints one JSON line (json) or a table row. CUMA_EXIT_*. */
int replay_torch(const cuma_trace *t, const cuma_tm_conf *c, const char *conf_text, int json,
                 int *header_done);

/* The timeline `cuma replay --timeline` would write for t on the default settings, read into
 * *out (tl_series_free it). CUMA_EXIT_*, with a message on stderr. */
int replay_timeline(const cuma_trace *t, tl_series *out);

#endif
