// SPDX-License-Identifier: Apache-2.0
/* The call stacks of a trace's allocations (the `trace_stacks` setting), written beside the log
 * as LOG.stacks, raw: return addresses and the executable mappings they fall in, so that nothing
 * on the allocation path takes the dynamic loader's lock (dladdr does). They are symbolised when
 * the trace is read (stack_file.c). A caller that names its frames itself (cuma_alloc_with_stack:
 * the Python package's frames) has them written as named. The format, one record a line:
 *
 *   cuma-stacks 2
 *   M START END OFFSET PATH     an executable mapping (hex), as /proc/self/maps has it
 *   S ID ADDR ADDR ...          a stack (decimal id from 1; hex return addresses, innermost first)
 *   F ID LINE FILE<TAB>NAME     a named frame (decimal id from 1, numbered apart from stacks;
 *                               LINE decimal, 0 unknown; FILE has no tab, neither has a newline)
 *   P ID FRAME FRAME ...        a stack of named frames (an id of the S numbering; F ids,
 *                               innermost first)
 *   E EVENT ID                  the EVENTth event line of the log (from 0) has stack ID
 *
 * Each distinct stack and named frame is written once, before the first record that uses it; a
 * mapping once, before the first stack that needs it. Version 1 files (cuma before named frames)
 * are the same without F and P records.
 * Internal to the trace writer, which calls it under its lock. */
#ifndef CUMA_TRACE_STACK_LOG_H
#define CUMA_TRACE_STACK_LOG_H

#include "cuma/cuma.h"

#include <stdint.h>

/* Most frames kept of one stack. */
#define CUMA_STACK_FRAMES 32

typedef struct cuma_stack_log cuma_stack_log;

/* Creates LOG.stacks (as the log itself is created: the user's own regular file, never through
 * a link). CUMA_ERR_IO names the file and the cause. */
cuma_status cuma_stack_log_open(const char *log_path, cuma_stack_log **out);

/* Records that event `event` has the stack frames[0..n). A write error stops the file (said
 * once on stderr). */
void cuma_stack_log_event(cuma_stack_log *s, uint64_t event, void *const *frames, int n);

/* Records that event `event` has the stack `text` spells out (cuma_alloc_with_stack's format:
 * "FILE\tLINE\tNAME" lines, innermost first): at most CUMA_STACK_FRAMES frames and
 * CUMA_STACK_NAME_MAX bytes of a file or name are kept. */
void cuma_stack_log_event_text(cuma_stack_log *s, uint64_t event, const char *text);

/* Most bytes of a named frame's file or name kept. */
#define CUMA_STACK_NAME_MAX 1024

/* Writes what is buffered, closes and frees; `write` false: frees only (a forked child's copy,
 * whose buffer is its parent's to write). NULL is fine. */
void cuma_stack_log_close(cuma_stack_log *s, int write);

/* Captures the caller's caller's stack into frames (CUMA_STACK_FRAMES): the number kept. Loads
 * what backtrace() needs on its first call: call it once where no lock is held. */
int cuma_stack_capture(void **frames);

#endif
