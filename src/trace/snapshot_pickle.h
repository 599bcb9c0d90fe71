// SPDX-License-Identifier: Apache-2.0
/* PyTorch CUDA memory snapshots (torch.cuda.memory._dump_snapshot()) as a cuma_trace: the
 * converter behind cuma_trace_load_opts for files that start with pickle's PROTO byte.
 * The rules (which events become what, blocks alive before recording, the recorded reserved
 * figures) are those trace.h gives at cuma_trace_load_opts. Internal to the trace reader. */
#ifndef CUMA_TRACE_SNAPSHOT_PICKLE_H
#define CUMA_TRACE_SNAPSHOT_PICKLE_H

#include <stddef.h>
#include <zlib.h>

#include "trace.h"

/* The most bytes a decompressed snapshot may have (a compressed file can expand a
 * thousandfold): 2 GiB. */
#define CUMA_SNAPSHOT_MAX_BYTES ((size_t)2 << 30)

/* Fields an event, segment or block dict may have at most (PyTorch writes about ten). */
#define CUMA_SNAPSHOT_MAX_FIELDS 64u

/* Reads the rest of gz (opened on path) as a snapshot into *out, which is empty on entry and
 * on failure; links the events (cuma_trace_link) and copies the path. device -1: the device
 * with the most events. stacks: also keep the allocations' call stacks (cuma_trace.stack). */
cuma_status cuma_snapshot_read(gzFile gz, const char *path, size_t max_events, int device,
                               int stacks, cuma_trace *out);

/* cuma_snapshot_read on bytes already in memory (the fuzz target's way in); path names them in
 * messages. */
cuma_status cuma_snapshot_from_bytes(const uint8_t *buf, size_t len, const char *path,
                                     size_t max_events, int device, int stacks, cuma_trace *out);

/* Reads the rest of gz into a malloc'ed *out (*out_len bytes; free it). CUMA_ERR_LIMIT past
 * max_bytes ("the WHAT reader's limit"), CUMA_ERR_IO naming the path, CUMA_ERR_OOM. */
cuma_status cuma_gz_read_all(gzFile gz, const char *path, size_t max_bytes, const char *what,
                             uint8_t **out, size_t *out_len);

#endif
