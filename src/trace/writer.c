// SPDX-License-Identifier: Apache-2.0
/* Writer of RMM's CSV event log (see writer.h). zlib writes both forms: "wb1" compresses (fast:
 * a log is written while the program runs), "wbT" passes text through. */
#include "writer.h"

#include "util/error.h"
#include "util/lockrank.h"
#include "util/safefile.h"
#include "stack_log.h"
#include "util/strbuf.h"

#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>
#include <zlib.h>

/* Invariant: gz == NULL while the writer is being started and once closed (by
 * cuma_trace_writer_close or at exit) or failed. The writer is on the open list from its
 * publication in claim (with fd, before gz exists) until cuma_trace_writer_close, exit or a
 * fork (in the child). fd is gz's descriptor (while starting, the claimed file's), -1 once
 * closed. mu guards gz, failed and fd once gz exists; before that fd is written under list_mu;
 * the fork handlers hold both. The list is guarded by list_mu (taken before mu). */
struct cuma_trace_writer {
    pthread_mutex_t mu;
    gzFile gz;
    /* In a forked child: the parent's stream, kept but never written or closed (its buffer and
     * file offset are the parent's); NULL otherwise. */
    gzFile inherited;
    bool failed;
    int fd;      /* gz's file (-1: none), which holds the writer's flock on it (see claim) */
    uint64_t t0; /* ns, monotonic, at open */
    char *path;
    cuma_trace_writer *next_open;
    /* With trace_stacks: LOG.stacks, and the number of event lines written so far (the stack
     * file names events by it). Under mu. */
    cuma_stack_log *stacks;
    uint64_t nevents;
};

static pthread_mutex_t list_mu = PTHREAD_MUTEX_INITIALIZER;
static cuma_trace_writer *open_list;

/* Every file a writer of this process has written, open or closed, never forgotten (a few
 * hundred bytes a heap that logs): a heap made again later (after cudaDeviceReset under the
 * shim, or by a program that makes heaps in a loop) logs to a new name instead of overwriting
 * the earlier log. Guarded by list_mu. */
typedef struct claimed_path {
    struct claimed_path *next;
    char path[];
} claimed_path;
static claimed_path *claimed;
/* Forks so far (counted by the prefork handler, under list_mu): see claim. */
static unsigned forks;
static bool nolock_said; /* the stderr line about a file system without locks: once */
static pthread_once_t exit_once = PTHREAD_ONCE_INIT;

static uint64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

/* Closes the file; with mu held. */
static void finish(cuma_trace_writer *w) {
    cuma_stack_log_close(w->stacks, 1);
    w->stacks = NULL;
    if (!w->gz) return;
    char shown[2 * CUMA_TRACE_PATH_MAX];
    if (gzclose(w->gz) != Z_OK && !w->failed)
        fprintf(stderr, "cuma: trace %s: closing the log failed: the file may be incomplete\n",
                cuma_escape(w->path, shown, sizeof shown));
    w->gz = NULL;
    w->fd = -1; /* gzclose closed it */
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
    cuma_mutex_lock(&list_mu, CUMA_RANK_TRACE_LIST);
    for (cuma_trace_writer *w = open_list; w; w = w->next_open) {
        cuma_mutex_lock(&w->mu, CUMA_RANK_TRACE);
        finish(w);
        cuma_mutex_unlock(&w->mu);
    }
    open_list = NULL;
    cuma_mutex_unlock(&list_mu);
}

void cuma_trace_writer_prefork(void) {
    cuma_mutex_lock(&list_mu, CUMA_RANK_TRACE_LIST);
    forks++;
    for (cuma_trace_writer *w = open_list; w; w = w->next_open)
        cuma_mutex_lock(&w->mu, CUMA_RANK_TRACE);
}

void cuma_trace_writer_postfork(bool child) {
    for (cuma_trace_writer *w = open_list; w; w = w->next_open) {
        /* gzclose would write the parent's buffered lines and a trailer into the parent's file
         * through the shared offset: the child's copy of the stream is left, unwritten. */
        if (child && w->gz) w->inherited = w->gz, w->gz = NULL;
        if (child) cuma_stack_log_close(w->stacks, 0), w->stacks = NULL;
        /* The child's reference to the file would keep the parent's flock alive after the
         * parent closed the log. The stream is never used again, so its descriptor goes (also
         * that of a writer the parent was still starting: its thread is not in the child). */
        if (child && w->fd >= 0) close(w->fd), w->fd = -1;
        cuma_mutex_unlock(&w->mu);
    }
    if (child) open_list = NULL;
    cuma_mutex_unlock(&list_mu);
}

static void register_exit(void) {
    atexit(close_all_at_exit);
}

bool cuma_trace_pattern_valid(const char *pattern) {
    for (const char *c = pattern; *c; c++)
        if (*c == '%' && (c[1] == 'p' || c[1] == 'd' || c[1] == '%'))
            c++;
        else if (*c == '%')
            return false;
    return true;
}

cuma_status cuma_path_expand(const char *key, const char *pattern, int device, char *out,
                             size_t len) {
    size_t n = 0;
    for (const char *c = pattern; *c && n < len; c++) {
        int w;
        if (*c != '%')
            w = snprintf(out + n, len - n, "%c", *c);
        else if (*++c == 'p')
            w = snprintf(out + n, len - n, "%ld", (long)getpid());
        else if (*c == 'd')
            w = snprintf(out + n, len - n, "%d", device);
        else if (*c == '%')
            w = snprintf(out + n, len - n, "%%");
        else
            return cuma_fail(CUMA_ERR_CONFIG,
                             "%s %s: '%%%c' is not %%p (pid), %%d (device) or %%%% ('%%')", key,
                             pattern, *c ? *c : ' ');
        n += (size_t)w;
    }
    if (n >= len)
        return cuma_fail(CUMA_ERR_CONFIG, "%s %s: the file name is too long", key, pattern);
    if (!n) out[0] = 0;
    return CUMA_OK;
}

/* name with ".N" before its ending (.csv.gz, .csv or .gz; else at the end): run.csv.gz is
 * followed by run.1.csv.gz, run.2.csv.gz, ... so that the name still says the format. */
static bool numbered(const char *name, unsigned k, char *out, size_t len) {
    static const char *const endings[] = {".csv.gz", ".csv", ".gz"};
    size_t n = strlen(name), stem = n;
    const char *base = strrchr(name, '/');
    size_t base_at = base ? (size_t)(base - name) + 1 : 0;
    for (size_t i = 0; i < sizeof endings / sizeof *endings; i++) {
        size_t e = strlen(endings[i]);
        if (n > base_at + e && !strcmp(name + n - e, endings[i])) {
            stem = n - e;
            break;
        }
    }
    int w = snprintf(out, len, "%.*s.%u%s", (int)stem, name, k, name + stem);
    return w > 0 && (size_t)w < len;
}

static bool is_claimed(const char *path) {
    for (claimed_path *c = claimed; c; c = c->next)
        if (!strcmp(c->path, path)) return true;
    return false;
}

/* Adds path to the claimed names; with list_mu held. */
static bool add_claim(const char *path) {
    size_t n = strlen(path);
    claimed_path *c = malloc(sizeof *c + n + 1);
    if (!c) return false;
    memcpy(c->path, path, n + 1);
    c->next = claimed;
    claimed = c;
    return true;
}

/* Takes path off the claimed names (a claim whose open failed); with list_mu held. */
static void drop_claim(const char *path) {
    for (claimed_path **pp = &claimed; *pp; pp = &(*pp)->next)
        if (!strcmp((*pp)->path, path)) {
            claimed_path *c = *pp;
            *pp = c->next;
            free(c);
            return;
        }
}

void (*cuma_trace_writer_open_hook)(const char *path);

/* Opens the log for name or, when another writer holds it (in this process or another: each
 * holds an exclusive flock on its file) or this process wrote it before, for the first
 * numbered name that is free, and puts w on the open list holding it (w->fd; the caller
 * truncates the file and starts the stream). The lock is what keeps two jobs started with the
 * same CUMA_CONF (one process per GPU, or a heap per device) from interleaving two gzip streams
 * in one file.
 *
 * The open runs without list_mu, which the fork handlers take: opening a file may block (a slow
 * or remote file system), and a fork meanwhile would wait for it. So a name is claimed under
 * list_mu (no other writer of this process tries it), opened outside, and the writer published
 * under list_mu again. A fork between the open and the publication leaves the child holding
 * the file's open description, which would share the flock taken on it later and keep it after
 * the parent closed its log: the fork count says so, and the file is opened afresh.
 * Returns the descriptor (the name in path) or -1, errno set and the reason in why. */
static int claim(cuma_trace_writer *w, const char *name, char *path, size_t len, bool *mine,
                 char *why, size_t wlen) {
    *mine = false;
    for (unsigned k = 0; k < 1000; k++) {
        if (!k)
            snprintf(path, len, "%s", name);
        else if (!numbered(name, k, path, len)) {
            errno = ENAMETOOLONG;
            return -1;
        }
        cuma_mutex_lock(&list_mu, CUMA_RANK_TRACE_LIST);
        if (is_claimed(path)) {
            cuma_mutex_unlock(&list_mu);
            *mine |= !k;
            continue;
        }
        if (!add_claim(path)) {
            cuma_mutex_unlock(&list_mu);
            errno = ENOMEM;
            return -1;
        }
        bool say_nolock = false;
        int fd = -1, e = 0;
        for (int tries = 0;; tries++) {
            unsigned gen = forks;
            cuma_mutex_unlock(&list_mu);
            if (cuma_trace_writer_open_hook) cuma_trace_writer_open_hook(path);
            fd = cuma_file_open_log(path, why, wlen);
            e = errno;
            cuma_mutex_lock(&list_mu, CUMA_RANK_TRACE_LIST);
            if (fd < 0 || gen == forks) break;
            close(fd);
            if (tries == 100) {
                fd = -1, e = EAGAIN;
                snprintf(why, wlen, "the process forked at every try to open it");
                break;
            }
        }
        if (fd < 0) {
            drop_claim(path);
            cuma_mutex_unlock(&list_mu);
            errno = e;
            return -1;
        }
        if (flock(fd, LOCK_EX | LOCK_NB) != 0) {
            if (errno == EWOULDBLOCK) {
                drop_claim(path);
                cuma_mutex_unlock(&list_mu);
                close(fd);
                continue;
            }
            /* A file system without locks (NFS mounted nolock, some cluster file systems):
             * the log is still wanted, but nothing keeps another process out of it. */
            say_nolock = !nolock_said;
            nolock_said = true;
            e = errno;
        }
        w->fd = fd;
        w->next_open = open_list;
        open_list = w;
        cuma_mutex_unlock(&list_mu);
        if (say_nolock) {
            char shown[2 * CUMA_TRACE_PATH_MAX];
            fprintf(stderr,
                    "cuma: trace %s cannot be locked (%s): another process given the same "
                    "name would write into it too; put %%p in the name\n",
                    cuma_escape(path, shown, sizeof shown), strerror(e));
        }
        return fd;
    }
    errno = EBUSY;
    return -1;
}

/* Undoes a claim whose file could not be started: off the open list, the name free again. */
static void unclaim(cuma_trace_writer *w, const char *path, bool close_fd) {
    cuma_mutex_lock(&list_mu, CUMA_RANK_TRACE_LIST);
    unlink_open(w);
    drop_claim(path);
    int fd = w->fd;
    w->fd = -1;
    cuma_mutex_unlock(&list_mu);
    if (fd >= 0 && close_fd) close(fd);
}

cuma_status cuma_trace_writer_open(const char *pattern, int device, char *opened, size_t len,
                                   cuma_trace_writer **out) {
    *out = NULL;
    char name[CUMA_TRACE_PATH_MAX], path[CUMA_TRACE_PATH_MAX], why[160] = "";
    cuma_status st = cuma_path_expand("trace", pattern, device, name, sizeof name);
    if (st) return st;
    size_t n = strlen(name);
    bool gz = n > 3 && !strcmp(name + n - 3, ".gz");
    cuma_trace_writer *w = calloc(1, sizeof *w);
    char *p = NULL;
    if (!w) return cuma_fail(CUMA_ERR_OOM, "trace %s: no host memory for the writer", name);
    pthread_mutex_init(&w->mu, NULL);
    w->fd = -1;
    errno = 0;
    bool mine;
    int fd = claim(w, name, path, sizeof path, &mine, why, sizeof why);
    if (fd < 0) {
        int e = errno;
        if (e == EBUSY)
            st = cuma_fail(CUMA_ERR_IO, "trace %s: it and its 999 numbered names are in use", name);
        else if (e == ENAMETOOLONG && strcmp(path, name))
            st = cuma_fail(CUMA_ERR_IO,
                           "trace %s is taken, and a numbered name would be longer than %d bytes: "
                           "shorten it, or put %%p in it",
                           name, CUMA_TRACE_PATH_MAX - 1);
        else
            st = cuma_fail(CUMA_ERR_IO, "trace %s: cannot create the log: %s", path,
                           why[0] ? why : strerror(e));
        pthread_mutex_destroy(&w->mu);
        free(w);
        return st;
    }
    /* Published with the descriptor only: a fork from here on closes it in the child. The stream
     * is started outside every lock (ftruncate may block), and handed over under w->mu. */
    gzFile z = NULL;
    if (ftruncate(fd, 0) != 0) {
        st = cuma_fail(CUMA_ERR_IO, "trace %s: cannot truncate the log: %s", path, strerror(errno));
        goto fail;
    }
    /* The stream takes over fd (gzclose closes it); w->fd stays the same number, which a
     * forked child closes. */
    if (!(p = strdup(path)) || !(z = gzdopen(fd, gz ? "wb1" : "wbT"))) {
        st = cuma_fail(CUMA_ERR_OOM, "trace %s: no host memory for the writer", path);
        goto fail;
    }
    gzbuffer(z, 1 << 18);
    if (gzputs(z, "Thread,Time,Action,Pointer,Size,Stream\n") <= 0) {
        st = cuma_fail(CUMA_ERR_IO, "trace %s: cannot write the header", path);
        goto fail;
    }
    if (strcmp(path, name)) {
        char shown[2][2 * CUMA_TRACE_PATH_MAX];
        fprintf(stderr, "cuma: trace %s %s: logging to %s\n",
                cuma_escape(name, shown[0], sizeof shown[0]),
                mine ? "is or was another heap's log in this process"
                     : "is being written by another process",
                cuma_escape(path, shown[1], sizeof shown[1]));
    }
    w->path = p;
    w->t0 = now_ns();
    if (opened) snprintf(opened, len, "%s", path);
    pthread_once(&exit_once, register_exit);
    cuma_mutex_lock(&w->mu, CUMA_RANK_TRACE);
    w->gz = z;
    cuma_mutex_unlock(&w->mu);
    *out = w;
    return CUMA_OK;
fail:
    unclaim(w, path, !z);
    if (z) gzclose(z);
    pthread_mutex_destroy(&w->mu);
    free(w), free(p);
    return st;
}

static __thread unsigned tid_cached;

cuma_status cuma_trace_writer_keep_stacks(cuma_trace_writer *w) {
    (void)cuma_stack_capture((void *[CUMA_STACK_FRAMES]){0}); /* loads what backtrace needs */
    cuma_mutex_lock(&w->mu, CUMA_RANK_TRACE);
    cuma_status st = w->stacks ? CUMA_OK : cuma_stack_log_open(w->path, &w->stacks);
    cuma_mutex_unlock(&w->mu);
    return st;
}

void cuma_trace_writer_event(cuma_trace_writer *w, cuma_trace_action action, uint64_t ptr,
                             uint64_t size, uint64_t stream) {
    cuma_trace_writer_event_stack(w, action, ptr, size, stream, NULL, 0, NULL);
}

void cuma_trace_writer_event_stack(cuma_trace_writer *w, cuma_trace_action action, uint64_t ptr,
                                   uint64_t size, uint64_t stream, void *const *frames, int nframes,
                                   const char *text) {
    if (!tid_cached) tid_cached = (unsigned)syscall(SYS_gettid);
    char line[160];
    cuma_mutex_lock(&w->mu, CUMA_RANK_TRACE);
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
            char shown[2 * CUMA_TRACE_PATH_MAX];
            fprintf(stderr, "cuma: trace %s: write failed (%s): the log stops here\n",
                    cuma_escape(w->path, shown, sizeof shown),
                    e == Z_ERRNO ? strerror(errno) : why);
            w->failed = true;
            finish(w);
        } else {
            if (text)
                cuma_stack_log_event_text(w->stacks, w->nevents, text);
            else if (nframes > 0)
                cuma_stack_log_event(w->stacks, w->nevents, frames, nframes);
            w->nevents++;
        }
    }
    cuma_mutex_unlock(&w->mu);
}

/* Writers a forked child closed while they held the parent's stream: kept (under list_mu), since
 * the stream can be neither written nor freed without writing. */
static cuma_trace_writer *parked;

void cuma_trace_writer_close(cuma_trace_writer *w) {
    if (!w) return;
    cuma_mutex_lock(&list_mu, CUMA_RANK_TRACE_LIST);
    unlink_open(w);
    cuma_mutex_lock(&w->mu, CUMA_RANK_TRACE);
    finish(w);
    cuma_mutex_unlock(&w->mu);
    if (w->inherited) {
        w->next_open = parked;
        parked = w;
        cuma_mutex_unlock(&list_mu);
        return;
    }
    cuma_mutex_unlock(&list_mu);
    pthread_mutex_destroy(&w->mu);
    free(w->path);
    free(w);
}
