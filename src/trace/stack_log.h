// SPDX-License-Identifier: Apache-2.0
/* The call stacks of a trace's allocations (the `trace_stacks` setting), written beside the log
 * as LOG.stacks, raw: return addresses and the executable mappings they fall in, so that nothing
 * on the allocation path takes the dynamic loader's lock (dladdr does). They are symbolised when
 * the trace is read (stack_file.c). The format, one record a line:
 *
 *   cuma-stacks 1
 *   M START END OFFSET PATH     an executable mapping (hex), as /proc/self/maps has it
 *   S ID ADDR ADDR ...          a stack (decimal id from 1; hex return addresses, innermost first)
 *   E EVENT ID                  the EVENTth event line of the log (from 0) has stack ID
 *
 * Each distinct stack is written once; a mapping once, before the first stack that needs it.
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

/* Writes what is buffered, closes and frees; `write` false: frees only (a forked child's copy,
 * whose buffer is its parent's to write). NULL is fine. */
void cuma_stack_log_close(cuma_stack_log *s, int write);

/* Captures the caller's caller's stack into frames (CUMA_STACK_FRAMES): the number kept. Loads
 * what backtrace() needs on its first call: call it once where no lock is held. */
int cuma_stack_capture(void **frames);

#endif
