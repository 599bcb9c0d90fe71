// SPDX-License-Identifier: Apache-2.0
/* How far a long command is: one line on stderr, rewritten in place, and only when stderr is a
 * terminal (nothing when it is piped or redirected, and never on stdout, where --json goes). */
#ifndef CUMA_TOOLS_PROGRESS_H
#define CUMA_TOOLS_PROGRESS_H

#include <stddef.h>

typedef struct cli_progress {
    const char *label; /* what is being done, e.g. the trace's name */
    size_t total;      /* steps in all */
    size_t next;       /* the step at which to look again */
    double last_ns;    /* when the line was last written; 0: never */
    int on;            /* stderr is a terminal */
} cli_progress;

/* Every this many steps the clock is read: the check costs nothing per step in between. */
#define CLI_PROGRESS_EVERY 65536

void cli_progress_init(cli_progress *p, const char *label, size_t total);
/* Writes the line at the first check and then at most four times a second. */
void cli_progress_slow(cli_progress *p, size_t done);
static inline void cli_progress_step(cli_progress *p, size_t done) {
    if (__builtin_expect(done >= p->next, 0)) cli_progress_slow(p, done);
}
/* Clears the line, if one was written. */
void cli_progress_done(cli_progress *p);

#endif
