// SPDX-License-Identifier: Apache-2.0
/* Reading LOG.stacks (stack_log.h has the format) into a trace read from LOG: each allocation's
 * stack, symbolised here (function, file and line from addr2line where binutils is installed;
 * else the module and the address in it). Internal to the trace reader. */
#ifndef CUMA_TRACE_STACK_FILE_H
#define CUMA_TRACE_STACK_FILE_H

#include "trace.h"

/* Fills t->stack and t->stacks from log_path's .stacks file, when there is one (none: t is left
 * without stacks, CUMA_OK). CUMA_ERR_PARSE names the line of a bad record; CUMA_ERR_OOM. */
cuma_status cuma_stack_file_read(const char *log_path, cuma_trace *t);

#endif
