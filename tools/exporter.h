// SPDX-License-Identifier: Apache-2.0
/* `cuma exporter` inside: the metrics' text (exporter.c), the thread that reads the ledger
 * (exporter_sampler.c) and the HTTP server (exporter_server.c). The server never reads the
 * ledger itself: a read can wait seconds for the ledger's lock (a process stopped while holding
 * it), and the server must keep answering everyone meanwhile. */
#ifndef CUMA_TOOLS_EXPORTER_H
#define CUMA_TOOLS_EXPORTER_H

#include "ledger_view.h"

#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>

#define EXP_CONTENT_TYPE "text/plain; version=0.0.4; charset=utf-8"

/* A growing text buffer; oom is set (and the text left short) when memory ran out. */
typedef struct exp_buf {
    char *p;
    size_t len, cap;
    int oom;
} exp_buf;

void exp_printf(exp_buf *b, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

/* The device and heap families of one successful read of the ledger, rendered.
 * Invariants: text holds len bytes and is never changed once published; refs counts the
 * holders (the sampler's "last good" pointer, answers being written); the last release frees
 * it. */
typedef struct exp_snapshot {
    atomic_uint refs;
    uint64_t started_ms; /* CLOCK_MONOTONIC when the read began: the figures are this old */
    int unlocked;        /* read without the ledger's lock (its holder does not run) */
    double stuck_s;      /* then: how long the lock had stood still */
    char *text;
    size_t len;
    uint64_t
        seen; /* the server thread's only: the round that last counted it (exporter_server.c) */
} exp_snapshot;

exp_snapshot *exp_snapshot_ref(exp_snapshot *s);
void exp_snapshot_release(exp_snapshot *s);

/* Renders the families of a read ledger (device and heap figures), after the head. */
void exp_render_figures(exp_buf *b, const ledger_view *v);

/* Renders the head families: cuma_ledger_up, the failed reads, whether the figures that follow
 * are stale, their age, and whether they were read without the lock (snap's; snap NULL: there
 * are none). now_ms: the answer's time. */
void exp_render_head(exp_buf *b, int up, uint64_t errors, uint64_t reads, int stale,
                     const exp_snapshot *snap, uint64_t now_ms);

uint64_t exp_now_ms(void);

/* The thread that reads the ledger when the server asks, and keeps the last good read.
 * Invariant: done <= started <= asked, started - done <= 1. Fields marked (mu) are read and written
 * under mu only. */
typedef struct exp_sampler {
    const char *ledger; /* the --ledger name (NULL: the user's default); fixed */
    int wake_fd;        /* written after every read, so that the server's poll wakes; fixed */
    pthread_mutex_t mu;
    pthread_cond_t cv;  /* (mu) signalled when asked grows or stop is set */
    uint64_t asked;     /* (mu) reads the server asked for (a number, not a count of them) */
    uint64_t started;   /* (mu) the asked value the latest read began under */
    uint64_t done;      /* (mu) the asked value the latest finished read began under */
    int last_ok;        /* (mu) whether that read succeeded */
    uint64_t errors;    /* (mu) reads that failed */
    uint64_t reads;     /* (mu) reads begun */
    uint64_t last_ms;   /* (mu) when the latest read began (exp_now_ms) */
    exp_snapshot *good; /* (mu) the last successful read (NULL: none, or the ledger went) */
    int stop;           /* (mu) the thread ends */
    int was_up;         /* the thread's only: exp_read's *was_up */
    pthread_t thread;
} exp_sampler;

/* Reads of the ledger begin at most this often, however many scrapes come: each takes the
 * ledger's lock, which the heaps' admissions of memory wait for, and a client that scrapes
 * back to back must not make the jobs' allocations contend with it. An answer still waits for
 * a read that began after its request (up to this much longer). */
#define EXP_READ_INTERVAL_MS 100

/* Starts the thread; 0, or -1 with a message on stderr. Call after view_catch_stop (the thread
 * inherits the blocked stop signals, so they reach the server's ppoll). */
int exp_sampler_start(exp_sampler *s, const char *ledger, int wake_fd);
/* Stops it (waits for a read in progress, which the ledger's lock wait bounds). */
void exp_sampler_stop(exp_sampler *s);
/* Asks for a read that begins after now; returns the number an answer waits for (done >= it). */
uint64_t exp_sampler_ask(exp_sampler *s);

/* Reads the ledger once, here (--once, and the sampler's thread). Reports a change of
 * readability on stderr (*was_up: -1 at first, 0 after a failed read, 1 after a read, 2 after
 * one without the lock). 1 and *out set (a new snapshot, one ref) on success, also without
 * the lock; 0 on failure, with *missing set when the ledger does not exist. */
int exp_read(const char *ledger, int *was_up, exp_snapshot **out, int *missing);

/* The server's settings; zero = defaults. */
typedef struct exp_server_conf {
    int max_conns;     /* open connections at once (0: EXP_DEFAULT_CONNS) */
    int fresh_wait_ms; /* a scrape's wait for its read (0: EXP_DEFAULT_FRESH_WAIT_MS) */
} exp_server_conf;

#define EXP_DEFAULT_CONNS         1024
#define EXP_MAX_CONNS             65536
#define EXP_DEFAULT_FRESH_WAIT_MS 500
#define EXP_MAX_FRESH_WAIT_MS     60000
/* A scrape's wait holds the pacing of reads (up to EXP_READ_INTERVAL_MS) and the read: shorter
 * waits would answer scrapes that come 100 ms apart as stale (cuma_ledger_up 0) however fast
 * the read. */
#define EXP_MIN_FRESH_WAIT_MS (2 * EXP_READ_INTERVAL_MS)

/* Serves GET /metrics on the listening socket until view_stop; wake_fd is the read end of the
 * sampler's wake_fd. CUMA_EXIT_OK, or CUMA_EXIT_FAIL with a message on stderr. */
int exp_serve(int lfd, int wake_fd, exp_sampler *s, const exp_server_conf *conf,
              const sigset_t *wait_mask);

#endif
