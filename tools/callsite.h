// SPDX-License-Identifier: Apache-2.0
/* The call site of an allocation's stack: the one frame `cuma leaks` and `cuma plot --html` charge
 * its memory to (callsite.c says which frame that is and why). */
#ifndef CUMA_TOOLS_CALLSITE_H
#define CUMA_TOOLS_CALLSITE_H

#include "trace/trace.h"

#include <stdint.h>

/* What callsite_of_stack returns: CALLSITE_NONE for the empty stack (none recorded),
 * CALLSITE_UNKNOWN for a stack without a frame the rule accepts, else CALLSITE_FIRST + the
 * frame's id in t->stacks.frame. */
#define CALLSITE_NONE    0u
#define CALLSITE_UNKNOWN 1u
#define CALLSITE_FIRST   2u

/* The call site of stack s of t (s < t->stacks.nstacks). */
uint32_t callsite_of_stack(const cuma_trace *t, uint32_t s);

/* Whether path ends with suffix. */
int callsite_ends_with(const char *s, const char *suffix);

#endif
