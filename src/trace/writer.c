/* Writer of RMM's CSV event log (see writer.h). zlib writes both forms: "wb1" compresses (fast:
 * a log is written while the program runs), "wbT" passes text through. */
#include "writer.h"

#include "core/error.h"

#include <errno.h>
#include <pthread.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>
#include <zlib.h>

/* Invariant: gz == NULL once closed (by cuma_trace_writer_close or at exit) or failed; the
 * writer is on the open list while gz != NULL. mu guards gz and failed; the list is
 * guarded by list_mu (taken before mu). */
struct cuma_trace_writer {
    pthread_mutex_t mu;
    gzFile gz;
    /* In a forked child: the parent's stream, kept but never written or closed (its buffer and
     * file offset are the parent's); NULL otherwise. */
    gzFile inherited;
    bool failed;
    uint64_t t0; /* ns, monotonic, at open */
    char *path;
    cuma_trace_writer *next_open;
};

static pthread_mutex_t list_mu = PTHREAD_MUTEX_INITIALIZER;
static cuma_trace_writer *open_list;
static pthread_once_t exit_once = PTHREAD_ONCE_INIT;

static uint64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

/* Closes the file; with mu held. */
static void finish(cuma_trace_writer *w) {
    if (!w->gz) return;
    if (gzclose(w->gz) != Z_OK && !w->failed)
        fprintf(stderr, "cuma: trace %s: closing the log failed: the file may be incomplete\n",
                w->path);
    w->gz = NULL;
}

static void unlink_open(cuma_trace_writer *w) {
    for (cuma_trace_writer **pp = &open_list; *pp; pp = &(*pp)->next_open)
        if (*pp == w) {
            *pp = w->next_open;
            return;
        }
}

/* The default heaps outlive main: their logs are closed here, complete. */
static void close_all_at_exit(void) {
    pthread_mutex_lock(&list_mu);
    for (cuma_trace_writer *w = open_list; w; w = w->next_open) {
        pthread_mutex_lock(&w->mu);
        finish(w);
        pthread_mutex_unlock(&w->mu);
    }
    open_list = NULL;
    pthread_mutex_unlock(&list_mu);
}

void cuma_trace_writer_prefork(void) {
    pthread_mutex_lock(&list_mu);
    for (cuma_trace_writer *w = open_list; w; w = w->next_open) pthread_mutex_lock(&w->mu);
}

void cuma_trace_writer_postfork(bool child) {
    for (cuma_trace_writer *w = open_list; w; w = w->next_open) {
        /* gzclose would write the parent's buffered lines and a trailer into the parent's file
         * through the shared offset: the child's copy of the stream is left, unwritten. */
        if (child && w->gz) w->inherited = w->gz, w->gz = NULL;
        pthread_mutex_unlock(&w->mu);
    }
    if (child) open_list = NULL;
    pthread_mutex_unlock(&list_mu);
}

static void register_exit(void) {
    atexit(close_all_at_exit);
}

cuma_status cuma_trace_writer_open(const char *path, cuma_trace_writer **out) {
    *out = NULL;
    size_t n = strlen(path);
    bool gz = n > 3 && !strcmp(path + n - 3, ".gz");
    cuma_trace_writer *w = calloc(1, sizeof *w);
    char *p = strdup(path);
    if (!w || !p) {
        free(w), free(p);
        return cuma_fail(CUMA_ERR_OOM, "trace %s: no host memory for the writer", path);
    }
    errno = 0;
    w->gz = gzopen(path, gz ? "wb1" : "wbT");
    if (!w->gz) {
        int e = errno;
        free(w), free(p);
        return cuma_fail(CUMA_ERR_IO, "trace %s: cannot create the log: %s", path,
                         e ? strerror(e) : "zlib could not open it");
    }
    gzbuffer(w->gz, 1 << 18);
    pthread_mutex_init(&w->mu, NULL);
    w->path = p;
    w->t0 = now_ns();
    if (gzputs(w->gz, "Thread,Time,Action,Pointer,Size,Stream\n") <= 0) {
        gzclose(w->gz);
        pthread_mutex_destroy(&w->mu);
        free(w), free(p);
        return cuma_fail(CUMA_ERR_IO, "trace %s: cannot write the header", path);
    }
    pthread_once(&exit_once, register_exit);
    pthread_mutex_lock(&list_mu);
    w->next_open = open_list;
    open_list = w;
    pthread_mutex_unlock(&list_mu);
    *out = w;
    return CUMA_OK;
}

static __thread unsigned tid_cached;

void cuma_trace_writer_event(cuma_trace_writer *w, cuma_trace_action action, uint64_t ptr,
                             uint64_t size, uint64_t stream) {
    if (!tid_cached) tid_cached = (unsigned)syscall(SYS_gettid);
    char line[160];
    pthread_mutex_lock(&w->mu);
    if (w->gz) {
        /* Stamped under the lock, so that times never go backwards in the file. */
        uint64_t us = (now_ns() - w->t0) / 1000;
        int len = snprintf(
            line, sizeof line, "%u,%02llu:%02llu:%02llu:%06llu,%s,0x%llx,%llu,", tid_cached,
            (unsigned long long)(us / 3600000000ull), (unsigned long long)(us / 60000000ull % 60),
            (unsigned long long)(us / 1000000ull % 60), (unsigned long long)(us % 1000000ull),
            cuma_trace_action_name(action), (unsigned long long)ptr, (unsigned long long)size);
        len += snprintf(line + len, sizeof line - (size_t)len, stream ? "0x%llx\n" : "%llu\n",
                        (unsigned long long)stream);
        if (gzwrite(w->gz, line, (unsigned)len) != len) {
            int e;
            const char *why = gzerror(w->gz, &e);
            fprintf(stderr, "cuma: trace %s: write failed (%s): the log stops here\n", w->path,
                    e == Z_ERRNO ? strerror(errno) : why);
            w->failed = true;
            finish(w);
        }
    }
    pthread_mutex_unlock(&w->mu);
}

/* Writers a forked child closed while they held the parent's stream: kept (under list_mu), since
 * the stream can be neither written nor freed without writing. */
static cuma_trace_writer *parked;

void cuma_trace_writer_close(cuma_trace_writer *w) {
    if (!w) return;
    pthread_mutex_lock(&list_mu);
    unlink_open(w);
    pthread_mutex_lock(&w->mu);
    finish(w);
    pthread_mutex_unlock(&w->mu);
    if (w->inherited) {
        w->next_open = parked;
        parked = w;
        pthread_mutex_unlock(&list_mu);
        return;
    }
    pthread_mutex_unlock(&list_mu);
    pthread_mutex_destroy(&w->mu);
    free(w->path);
    free(w);
}
