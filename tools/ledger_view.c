// SPDX-License-Identifier: Apache-2.0
/* One read of a ledger for the operator's views (ps, top, stats, exporter) and their shared
 * helpers. */
#include "ledger_view.h"

#include "cli.h"

#include <errno.h>
#include <inttypes.h>
#include <signal.h>
#include <stdbool.h>
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

/* A first guess at the number of live heaps; the ledger says how many there were and the read
 * is repeated with room for them (heaps come and go between two reads). */
#define FIRST_GUESS 64

static int by_device_then_reserved(const void *pa, const void *pb) {
    const cuma_ledger_entry *a = pa, *b = pb;
    int c = strcmp(a->device, b->device);
    if (c) return c;
    if (a->reserved != b->reserved) return a->reserved > b->reserved ? -1 : 1;
    if (a->pid != b->pid) return a->pid < b->pid ? -1 : 1;
    return a->slot < b->slot ? -1 : a->slot > b->slot;
}

static uint64_t max64(uint64_t a, uint64_t b) {
    return a > b ? a : b;
}

/* Groups the sorted heaps by device and sums them. Free memory is counted as admission counts
 * it (src/coord/ledger.c): each heap claims what it holds or its guarantee, whichever is more. */
static int group(ledger_view *v) {
    v->devices = calloc(v->nheaps ? v->nheaps : 1, sizeof *v->devices);
    if (!v->devices) return -1;
    for (size_t i = 0; i < v->nheaps; i++) {
        const cuma_ledger_entry *e = &v->heaps[i];
        view_device *d = v->ndevices ? &v->devices[v->ndevices - 1] : NULL;
        if (!d || strcmp(d->device, e->device)) {
            d = &v->devices[v->ndevices++];
            d->device = e->device;
            d->first = i;
        }
        d->count++;
        d->capacity = max64(d->capacity, e->capacity);
        d->reserved += e->reserved;
        d->cached += e->cached < e->reserved ? e->cached : e->reserved;
        d->guaranteed += e->guarantee;
    }
    for (size_t k = 0; k < v->ndevices; k++) {
        view_device *d = &v->devices[k];
        uint64_t claimed = 0;
        for (size_t i = d->first; i < d->first + d->count; i++)
            claimed += max64(v->heaps[i].reserved, v->heaps[i].guarantee);
        d->free = claimed < d->capacity ? d->capacity - claimed : 0;
    }
    return 0;
}

/* The ledger's path is a symbolic link (cuma never makes one, and opens it without following
 * it): say where it leads, so that a dangling one is not taken for "no ledger". */
static void describe_link(ledger_view *v) {
    char target[256];
    ssize_t n = readlink(v->path, target, sizeof target - 1);
    if (n < 0) n = 0;
    target[n] = 0;
    char clean[256];
    view_clean(target, clean, sizeof clean);
    struct stat sb;
    bool dangling = stat(v->path, &sb) != 0;
    snprintf(v->error, sizeof v->error,
             "ledger %s is a symbolic link to '%s'%s, not a ledger (cuma opens no link there: "
             "remove it)",
             v->path, clean, dangling ? ", which does not exist" : "");
}

int view_read(ledger_view *v, const char *name) {
    memset(v, 0, sizeof *v);
    cuma_status pst = cuma_ledger_path(name, v->path, sizeof v->path);
    if (pst != CUMA_OK) {
        snprintf(v->error, sizeof v->error, "%s", cuma_last_error());
        return pst == CUMA_ERR_CONFIG ? -2 : -1; /* a bad name, or a squatted one */
    }
    (void)cuma_ledger_notice(name, v->notice, sizeof v->notice);
    size_t max = FIRST_GUESS, n = 0;
    for (;;) {
        cuma_ledger_entry *e = realloc(v->heaps, max * sizeof *e);
        if (!e) {
            snprintf(v->error, sizeof v->error, "out of memory for %zu ledger entries", max);
            return -1;
        }
        v->heaps = e;
        cuma_ledger_read_info info;
        if (cuma_ledger_snapshot_info(name, v->heaps, max, &n, &info) != CUMA_OK) {
            struct stat sb;
            v->missing = lstat(v->path, &sb) != 0 && errno == ENOENT;
            if (!v->missing && S_ISLNK(sb.st_mode))
                describe_link(v);
            else if (v->missing)
                snprintf(v->error, sizeof v->error,
                         "no ledger at %s: no cuma heap has run as this user (uid %u)%s", v->path,
                         (unsigned)geteuid(), name && strcmp(name, "on") ? " in this ledger" : "");
            else
                snprintf(v->error, sizeof v->error, "%s", cuma_last_error());
            return -1;
        }
        v->unlocked = (info.flags & CUMA_LEDGER_READ_UNLOCKED) != 0;
        v->stuck_ns = info.stuck_ns;
        if (n <= max) break;
        max = n + FIRST_GUESS;
    }
    v->nheaps = n;
    /* Devices are grouped, and shown, by the name as printed: two names a writer of the ledger
     * made differ only in bytes that print as '?' would otherwise be two devices of one name
     * (and twice the same series, which Prometheus drops). */
    for (size_t i = 0; i < n; i++) {
        char clean[sizeof v->heaps[i].device];
        view_clean(v->heaps[i].device, clean, sizeof clean);
        memcpy(v->heaps[i].device, clean, sizeof clean);
    }
    qsort(v->heaps, n, sizeof *v->heaps, by_device_then_reserved);
    if (group(v)) {
        snprintf(v->error, sizeof v->error, "out of memory");
        return -1;
    }
    return 0;
}

void view_free(ledger_view *v) {
    free(v->heaps);
    free(v->devices);
    v->heaps = NULL;
    v->devices = NULL;
    v->nheaps = v->ndevices = 0;
}

void view_print_warnings(FILE *f, const ledger_view *v) {
    if (v->notice[0]) fprintf(f, "warning: %s\n", v->notice);
    if (v->unlocked)
        fprintf(f,
                "warning: read without the ledger's lock, which a process holds and does not run "
                "(stopped?) for %.1f s or more: the figures are current but may be inconsistent, "
                "and dead processes' heaps may still show\n",
                (double)v->stuck_ns * 1e-9);
}

uint64_t view_in_use(const cuma_ledger_entry *e) {
    return e->reserved > e->cached ? e->reserved - e->cached : 0;
}

int view_has_stats(const cuma_ledger_entry *e) {
    return e->stats_age_ns != UINT64_MAX;
}

static void json_heap(FILE *f, const cuma_ledger_entry *e,
                      void (*extra)(FILE *f, const cuma_ledger_entry *e)) {
    fprintf(f, "{\"pid\":%d,\"process\":", e->pid);
    view_json_string(f, e->process);
    fprintf(f,
            ",\"slot\":%u,\"priority\":%d,\"guarantee\":%" PRIu64 ",\"limit\":%" PRIu64
            ",\"reserved\":%" PRIu64 ",\"cached\":%" PRIu64 ",\"in_use\":%" PRIu64
            ",\"requested\":%" PRIu64 ",\"peak_reserved\":%" PRIu64 ",\"want\":%" PRIu64
            ",\"pressure_given_bytes\":%" PRIu64 ",\"pressure_asks\":%" PRIu64
            ",\"pressure_callbacks\":%" PRIu64 ",\"ledger_denials\":%" PRIu64
            ",\"age_ns\":%" PRIu64,
            e->slot, e->priority, e->guarantee, e->limit, e->reserved, e->cached, view_in_use(e),
            e->requested, e->peak_reserved, e->want, e->pressure_given_bytes, e->pressure_asks,
            e->pressure_callbacks, e->ledger_denials, e->age_ns);
    if (extra) extra(f, e);
    fputc('}', f);
}

void view_json(FILE *f, const ledger_view *v, const unsigned char *keep,
               void (*extra)(FILE *f, const cuma_ledger_entry *e)) {
    size_t shown = 0;
    for (size_t i = 0; i < v->nheaps; i++) shown += !keep || keep[i];
    fprintf(f, "{\"ledger\":");
    view_json_string(f, v->path);
    if (v->notice[0]) {
        fprintf(f, ",\"notice\":");
        view_json_string(f, v->notice);
    }
    fprintf(f, ",\"unlocked\":%s", v->unlocked ? "true" : "false");
    if (v->unlocked) fprintf(f, ",\"lock_stuck_ns\":%" PRIu64, v->stuck_ns);
    fprintf(f, ",\"uid\":%u,\"heaps\":%zu,\"devices\":[", (unsigned)geteuid(), shown);
    int first_device = 1;
    for (size_t k = 0; k < v->ndevices; k++) {
        const view_device *d = &v->devices[k];
        size_t n = 0;
        for (size_t i = d->first; i < d->first + d->count; i++) n += !keep || keep[i];
        if (!n) continue;
        fprintf(f, "%s{\"device\":", first_device ? "" : ",");
        first_device = 0;
        view_json_string(f, d->device);
        fprintf(f,
                ",\"capacity\":%" PRIu64 ",\"reserved\":%" PRIu64 ",\"cached\":%" PRIu64
                ",\"guaranteed\":%" PRIu64 ",\"free\":%" PRIu64 ",\"heaps\":[",
                d->capacity, d->reserved, d->cached, d->guaranteed, d->free);
        int first_heap = 1;
        for (size_t i = d->first; i < d->first + d->count; i++) {
            if (keep && !keep[i]) continue;
            if (!first_heap) fputc(',', f);
            first_heap = 0;
            json_heap(f, &v->heaps[i], extra);
        }
        fprintf(f, "]}");
    }
    fprintf(f, "]}\n");
}

const char *view_size(uint64_t bytes, char *buf, size_t len) {
    static const char *const units[] = {"KiB", "MiB", "GiB", "TiB", "PiB", "EiB"};
    if (bytes < 1024) {
        snprintf(buf, len, "%" PRIu64 " B", bytes);
        return buf;
    }
    double x = (double)bytes / 1024.0;
    unsigned u = 0;
    while (x >= 1024.0 && u + 1 < sizeof units / sizeof units[0]) x /= 1024.0, u++;
    /* Two decimals from GiB on: a tenth of a GiB is 100 MiB, too coarse for a GPU. */
    snprintf(buf, len, u >= 2 ? "%.2f %s" : "%.1f %s", x, units[u]);
    return buf;
}

const char *view_delta(int64_t bytes, char *buf, size_t len) {
    if (!bytes) {
        snprintf(buf, len, "0");
        return buf;
    }
    char tmp[32];
    uint64_t mag = bytes < 0 ? (uint64_t)0 - (uint64_t)bytes : (uint64_t)bytes;
    snprintf(buf, len, "%c%s", bytes < 0 ? '-' : '+', view_size(mag, tmp, sizeof tmp));
    return buf;
}

/* Length of the valid UTF-8 sequence at s (1 to 4), or 0 when s does not start one. Overlong
 * forms, surrogates and code points above U+10FFFF are invalid. */
static size_t utf8_len(const unsigned char *s) {
    unsigned c = s[0];
    if (c < 0x80) return 1;
    size_t n;
    unsigned cp;
    if (c >= 0xc2 && c <= 0xdf)
        n = 2, cp = c & 0x1f;
    else if (c >= 0xe0 && c <= 0xef)
        n = 3, cp = c & 0x0f;
    else if (c >= 0xf0 && c <= 0xf4)
        n = 4, cp = c & 0x07;
    else
        return 0;
    for (size_t i = 1; i < n; i++) {
        if ((s[i] & 0xc0) != 0x80) return 0;
        cp = cp << 6 | (s[i] & 0x3f);
    }
    if ((n == 3 && (cp < 0x800 || (cp >= 0xd800 && cp <= 0xdfff))) ||
        (n == 4 && (cp < 0x10000 || cp > 0x10ffff)))
        return 0;
    return n;
}

void view_clean(const char *in, char *out, size_t len) {
    const unsigned char *s = (const unsigned char *)in;
    size_t o = 0;
    while (*s && o + 1 < len) {
        size_t n = utf8_len(s);
        if (n == 1 && (*s < 0x20 || *s == 0x7f)) n = 0;
        if (!n || o + n >= len) {
            out[o++] = '?';
            s += n ? n : 1;
            continue;
        }
        memcpy(out + o, s, n);
        o += n;
        s += n;
    }
    out[o] = 0;
}

void view_json_string(FILE *f, const char *s) {
    char clean[512];
    view_clean(s, clean, sizeof clean);
    fputc('"', f);
    for (const char *p = clean; *p; p++) {
        if (*p == '"' || *p == '\\') fputc('\\', f);
        fputc(*p, f);
    }
    fputc('"', f);
}

volatile sig_atomic_t view_stop;

static void on_stop(int sig) {
    (void)sig;
    view_stop = 1;
}

void view_catch_stop(sigset_t *wait_mask) {
    struct sigaction sa = {.sa_handler = on_stop};
    sigemptyset(&sa.sa_mask);
    sigaction(SIGINT, &sa, NULL);
    sigaction(SIGTERM, &sa, NULL);
    sigset_t stop_sigs;
    sigemptyset(&stop_sigs);
    sigaddset(&stop_sigs, SIGINT);
    sigaddset(&stop_sigs, SIGTERM);
    sigprocmask(SIG_BLOCK, &stop_sigs, wait_mask);
    sigdelset(wait_mask, SIGINT);
    sigdelset(wait_mask, SIGTERM);
}
