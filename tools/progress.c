// SPDX-License-Identifier: Apache-2.0
#include "progress.h"

#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

static double mono_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec * 1e9 + (double)ts.tv_nsec;
}

void cli_progress_init(cli_progress *p, const char *label, size_t total) {
    /* CUMA_PROGRESS=off silences it on a terminal too (a screen recording, say). */
    const char *env = getenv("CUMA_PROGRESS");
    p->label = label;
    p->total = total;
    p->next = CLI_PROGRESS_EVERY;
    p->last_ns = 0;
    bool off = env && (!strcmp(env, "off") || !strcmp(env, "0"));
    p->on = !off && isatty(STDERR_FILENO);
    if (!p->on) p->next = (size_t)-1;
}

void cli_progress_slow(cli_progress *p, size_t done) {
    p->next = done + CLI_PROGRESS_EVERY;
    double now = mono_ns();
    if (p->last_ns && now - p->last_ns < 250e6) return;
    p->last_ns = now;
    /* \r and erase to the end of the line: the next write replaces this one. */
    fprintf(stderr, "\r\033[K%s: %zu of %zu events (%.0f%%)", p->label, done, p->total,
            p->total ? 100.0 * (double)done / (double)p->total : 100.0);
    fflush(stderr);
}

void cli_progress_done(cli_progress *p) {
    if (!p->last_ns) return;
    fputs("\r\033[K", stderr);
    fflush(stderr);
    p->last_ns = 0;
}
