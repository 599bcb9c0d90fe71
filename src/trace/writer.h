// SPDX-License-Identifier: Apache-2.0
/* Writer of RMM's CSV event log (the format trace.h reads): a heap with the `trace` setting
 * logs every allocation, failed allocation and free, so that a run on a GPU can be replayed
 * anywhere with `cuma replay`.
 *
 * Thread safety: events from any thread; one mutex per writer keeps lines whole and in the
 * order they were written. Files are closed at process exit if nobody closed them (the default
 * heaps are never destroyed), so a gzip log is complete; events after that are dropped.
 */
#ifndef CUMA_TRACE_WRITER_H
#define CUMA_TRACE_WRITER_H

#include "trace.h"

#include <stdbool.h>
#include <stdint.h>

typedef struct cuma_trace_writer cuma_trace_writer;

/* Longest file name of a log, its terminating NUL included. */
#define CUMA_TRACE_PATH_MAX 256

/* Whether a file setting's (`trace`, `oom_dump`) only % sequences are %p (the process id), %d
 * (the heap's device) and %% (a '%'). */
bool cuma_trace_pattern_valid(const char *pattern);

/* The file name a pattern gives (%p, %d and %% replaced), into out (len bytes); CUMA_ERR_CONFIG
 * naming the setting `key` when it has another % sequence or does not fit. */
cuma_status cuma_path_expand(const char *key, const char *pattern, int device, char *out,
                             size_t len);

/* Creates (truncates) the log named by pattern (%p and %d replaced by the process id and
 * device): gzip-compressed when the name ends in ".gz", else plain text. Writes the header.
 * When another writer, in this process or another, has the file open, or this process wrote it
 * before, the log is the first free of NAME.1.csv.gz, NAME.2.csv.gz, ... (said on stderr). The
 * name used goes to opened (len bytes; NULL is fine). The file is opened as safefile.h says
 * (never through a symlink, nothing but the user's own regular file, new ones 0600), and with
 * no lock held that the fork handlers take. CUMA_ERR_IO names the file and the cause (a refused
 * file says why); CUMA_ERR_CONFIG a bad pattern. */
cuma_status cuma_trace_writer_open(const char *pattern, int device, char *opened, size_t len,
                                   cuma_trace_writer **out);

/* Tests only: when set, called with the file name just before each open of a log, outside every
 * lock the fork handlers take (so a test can hold an open as long as it likes). */
extern void (*cuma_trace_writer_open_hook)(const char *path);

/* One line: the action, the block's address (0 for a failed allocation), its size in bytes
 * and the stream, stamped with the time since the log was opened and the calling thread. A
 * write error stops the log (said once on stderr); the program goes on. */
void cuma_trace_writer_event(cuma_trace_writer *w, cuma_trace_action action, uint64_t ptr,
                             uint64_t size, uint64_t stream);

/* Keeps the call stacks of allocations from now on in LOG.stacks (the `trace_stacks` setting;
 * src/trace/stack_log.h): events logged with cuma_trace_writer_event_stack name theirs there.
 * Call it where no lock is held (the first stack capture loads a library). CUMA_ERR_IO. */
cuma_status cuma_trace_writer_keep_stacks(cuma_trace_writer *w);

/* An event with the stack frames[0..nframes) captured by cuma_stack_capture (innermost first),
 * or, when `text` is not NULL, the stack it spells out (cuma_alloc_with_stack's format), written
 * to LOG.stacks when the writer keeps stacks. */
void cuma_trace_writer_event_stack(cuma_trace_writer *w, cuma_trace_action action, uint64_t ptr,
                                   uint64_t size, uint64_t stream, void *const *frames, int nframes,
                                   const char *text);

/* Flushes, closes and frees. NULL is fine. */
void cuma_trace_writer_close(cuma_trace_writer *w);

/* Around fork (src/heap/fork.c, after every heap's locks): every writer's lock is held across it.
 * In the child the logs are the parent's (their buffers and the file offset are shared): the
 * child's copies are dropped unwritten, and its heaps log nothing. */
void cuma_trace_writer_prefork(void);
void cuma_trace_writer_postfork(bool child);

#endif
