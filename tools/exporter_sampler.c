// SPDX-License-Identifier: Apache-2.0
/* The exporter's reader of the ledger: one thread that reads it when the server asks and keeps
 * the last good read's rendering. A read waits for the ledger's lock; when a process stopped
 * while holding it (Ctrl-Z, a debugger), the first read waits 2 s before it reads without the
 * lock (the next ones do not wait, until the lock moves): only this thread waits then; the
 * server answers from the last good read and says it is stale, and the unlocked reads that
 * follow are served fresh, marked unlocked.
 *
 * Reads are asked for, not timed: the exporter costs nothing between scrapes, and an answer
 * waits for a read that began after its request came (the figures are as fresh as before, when
 * every scrape read the ledger itself). Requests that come while a read runs share the next,
 * which begins EXP_READ_INTERVAL_MS after the one before at the earliest. */
#include "exporter.h"

#include <assert.h>
#include <stdio.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

/* Waits (mu held) until EXP_READ_INTERVAL_MS after the latest read began, or stop. */
static void pace(exp_sampler *s) {
    for (;;) {
        uint64_t now = exp_now_ms(), at = s->last_ms + EXP_READ_INTERVAL_MS;
        if (s->stop || !s->reads || now >= at) return;
        struct timespec ts;
        clock_gettime(CLOCK_MONOTONIC, &ts); /* the condition variable's clock (start) */
        uint64_t ns = (uint64_t)ts.tv_nsec + (at - now) * 1000000ull;
        ts.tv_sec += (time_t)(ns / 1000000000ull);
        ts.tv_nsec = (long)(ns % 1000000000ull);
        pthread_cond_timedwait(&s->cv, &s->mu, &ts);
    }
}

static void *run(void *arg) {
    exp_sampler *s = arg;
    pthread_mutex_lock(&s->mu);
    for (;;) {
        while (!s->stop && s->started == s->asked) pthread_cond_wait(&s->cv, &s->mu);
        pace(s); /* requests that come meanwhile share this read: it has not begun */
        if (s->stop) break;
        uint64_t target = s->started = s->asked;
        s->reads++;
        s->last_ms = exp_now_ms();
        pthread_mutex_unlock(&s->mu);
        exp_snapshot *snap;
        int missing;
        int ok = exp_read(s->ledger, &s->was_up, &snap, &missing);
        pthread_mutex_lock(&s->mu);
        s->done = target;
        s->last_ok = ok;
        if (!ok) s->errors++;
        /* A ledger that is gone has no heaps: its last figures are not served as stale ones. */
        if (ok || missing) {
            exp_snapshot_release(s->good);
            s->good = snap;
        }
        /* Wakes the server's poll; a full pipe already will. */
        char one = 1;
        ssize_t w = write(s->wake_fd, &one, 1);
        (void)w;
    }
    pthread_mutex_unlock(&s->mu);
    return NULL;
}

int exp_sampler_start(exp_sampler *s, const char *ledger, int wake_fd) {
    *s = (exp_sampler){.ledger = ledger, .wake_fd = wake_fd, .was_up = -1};
    pthread_mutex_init(&s->mu, NULL);
    pthread_condattr_t ca;
    pthread_condattr_init(&ca);
    pthread_condattr_setclock(&ca, CLOCK_MONOTONIC); /* pace's waits: not moved by the date */
    pthread_cond_init(&s->cv, &ca);
    pthread_condattr_destroy(&ca);
    int r = pthread_create(&s->thread, NULL, run, s);
    if (r) {
        fprintf(stderr, "cuma exporter: cannot start the ledger's reader: %s\n", strerror(r));
        pthread_cond_destroy(&s->cv);
        pthread_mutex_destroy(&s->mu);
        return -1;
    }
    return 0;
}

void exp_sampler_stop(exp_sampler *s) {
    pthread_mutex_lock(&s->mu);
    s->stop = 1;
    pthread_cond_signal(&s->cv);
    pthread_mutex_unlock(&s->mu);
    pthread_join(s->thread, NULL);
    exp_snapshot_release(s->good);
    s->good = NULL;
    pthread_cond_destroy(&s->cv);
    pthread_mutex_destroy(&s->mu);
}

uint64_t exp_sampler_ask(exp_sampler *s) {
    pthread_mutex_lock(&s->mu);
    /* Once the read of `asked` has begun it may have read the ledger before this request came:
     * the request asks for the next. Until then, requests share the one asked for. */
    if (s->started == s->asked) {
        s->asked++;
        pthread_cond_signal(&s->cv);
    }
    uint64_t want = s->asked;
    assert(s->done <= s->started && s->started <= s->asked && s->started - s->done <= 1);
    pthread_mutex_unlock(&s->mu);
    return want;
}
