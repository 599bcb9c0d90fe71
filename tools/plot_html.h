// SPDX-License-Identifier: Apache-2.0
/* `cuma plot --html` (plot_html.c): a trace's report as one self-contained HTML page. */
#ifndef CUMA_TOOLS_PLOT_HTML_H
#define CUMA_TOOLS_PLOT_HTML_H

#include <stdint.h>

/* Reads the trace (with its call stacks), replays it for its timeline and writes the page to out
 * (NULL: stdout). device: a snapshot's device (-1: the one with most events); max_events 0: the
 * reader's default. CUMA_EXIT_*, with a message on stderr; a failure leaves no file. */
int plot_html(const char *out, const char *title, const char *trace_path, int device,
              uint64_t max_events);

#endif
