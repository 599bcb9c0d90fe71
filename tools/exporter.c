// SPDX-License-Identifier: Apache-2.0
/* `cuma exporter`: the ledger as Prometheus metrics, over HTTP or once to stdout.
 *
 * This file is the metrics' text and the command. A read of the ledger is rendered once into a
 * snapshot (the device and heap families); every answer is a small head (whether this scrape's
 * read succeeded, whether the figures are stale, their age) followed by a snapshot's text. The
 * thread that reads the ledger is exporter_sampler.c, the HTTP server exporter_server.c. */
#include "cli.h"
#include "exporter.h"
#include "gpu_ids.h"

#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <netdb.h>
#include <netinet/in.h>
#include <signal.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

/* ---- a growing text buffer ------------------------------------------------------------------ */

/* Room for n more bytes and a NUL; sets oom (and returns 0) when there is none. */
static int room_for(exp_buf *b, size_t n) {
    if (b->oom) return 0;
    if (b->p && b->len + n < b->cap) return 1;
    size_t cap = b->cap ? b->cap : 4096;
    while (cap <= b->len + n) cap *= 2;
    char *p = realloc(b->p, cap);
    if (!p) {
        b->oom = 1;
        return 0;
    }
    b->p = p;
    b->cap = cap;
    return 1;
}

/* Appends n bytes as they are (what printf would cost per byte of a label, by the thousand). */
static void exp_put(exp_buf *b, const char *s, size_t n) {
    if (!room_for(b, n)) return;
    memcpy(b->p + b->len, s, n);
    b->len += n;
    b->p[b->len] = 0;
}

void exp_printf(exp_buf *b, const char *fmt, ...) {
    if (b->oom) return;
    for (;;) {
        va_list ap;
        va_start(ap, fmt);
        int n = vsnprintf(b->p ? b->p + b->len : NULL, b->p ? b->cap - b->len : 0, fmt, ap);
        va_end(ap);
        if (n < 0) {
            b->oom = 1;
            return;
        }
        if (b->p && b->len + (size_t)n < b->cap) {
            b->len += (size_t)n;
            return;
        }
        if (!room_for(b, (size_t)n)) return;
    }
}

uint64_t exp_now_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000u + (uint64_t)ts.tv_nsec / 1000000u;
}

/* ---- the metrics ---------------------------------------------------------------------------- */

/* Per-heap families, in the order they are written. Gauges are sizes now; counters count since
 * the heap joined the ledger (a new heap, a new series: its pid or slot differs). */
typedef struct heap_metric {
    const char *name, *type, *help;
    size_t off; /* of a uint64_t in cuma_ledger_entry */
} heap_metric;

#define F(field) offsetof(cuma_ledger_entry, field)
static const heap_metric heap_metrics[] = {
    {"cuma_reserved_bytes", "gauge", "Memory the heap holds from the device (ledger-admitted).",
     F(reserved)},
    {"cuma_cached_bytes", "gauge", "Of the reserved memory, what is idle in the heap's cache.",
     F(cached)},
    {"cuma_requested_bytes", "gauge", "Bytes of live allocations as the program asked for them.",
     F(requested)},
    {"cuma_guarantee_bytes", "gauge", "Memory the heap is guaranteed on its device.", F(guarantee)},
    {"cuma_limit_bytes", "gauge", "The heap's limit on reserved memory (device size if none).",
     F(limit)},
    {"cuma_peak_reserved_bytes", "gauge", "The most memory the heap has held.", F(peak_reserved)},
    {"cuma_pressure_want_bytes", "gauge",
     "Memory the heap waits for from other heaps now (a pressure request), 0 if none.", F(want)},
    {"cuma_ledger_denials_total", "counter", "Growths the ledger refused the heap.",
     F(ledger_denials)},
    {"cuma_pressure_asks_total", "counter", "Pressure requests the heap posted.", F(pressure_asks)},
    {"cuma_pressure_given_bytes_total", "counter",
     "Bytes the heap gave back on other heaps' pressure requests.", F(pressure_given_bytes)},
    {"cuma_pressure_callbacks_total", "counter", "Pressure callbacks the heap ran.",
     F(pressure_callbacks)},
};

/* The allocator's figures, as its release thread last published them (every 100 ms): those of
 * the list in cuma.h that the exporter shows, in its order, as cuma_NAME (a counter's with
 * _total, a ratio's with _ratio). A heap that has published none has no samples in these
 * families: zeros would read as an idle heap, and a counter that later jumps from 0 to its real
 * value would show as a burst in rate(). */
typedef struct alloc_metric {
    const char *name, *help;
    unsigned kind; /* CUMA_STAT_* of the list */
    size_t off;    /* of the figure in cuma_ledger_entry */
} alloc_metric;

#define A(type, name, kind, where, help)                                                           \
    CUMA_STAT_IF_LEDGER(where, {CUMA_STAT_SHOWN(where) ? #name : NULL, help, kind, F(name)}, )
static const alloc_metric alloc_metrics[] = {CUMA_STATS_FIELDS(A)};
#undef A
#undef F

static void family(exp_buf *b, const char *name, const char *type, const char *help) {
    exp_printf(b, "# HELP %s %s\n# TYPE %s %s\n", name, help, name, type);
}

/* A label value: valid UTF-8 with backslash, double quote and line feed escaped, as the text
 * format wants (view_clean already turned the line feed and other controls into '?'). */
static void label_value(exp_buf *b, const char *s) {
    char clean[256], out[2 * sizeof clean];
    view_clean(s, clean, sizeof clean);
    size_t n = 0;
    for (const char *p = clean; *p; p++) {
        if (*p == '\\' || *p == '"') out[n++] = '\\';
        out[n++] = *p;
    }
    exp_put(b, out, n);
}

/* The labels of a heap. slot makes the series unique: one process may have several heaps on a
 * device at one priority, and samples with equal label sets are rejected by Prometheus. backend
 * is fixed when the heap joins, so it adds no series; empty for a slot that names none. */
/* A label only where the heap has the value (a name from Kubernetes). */
static void opt_label(exp_buf *b, const char *name, const char *v) {
    if (!v[0]) return;
    exp_printf(b, ",%s=\"", name);
    label_value(b, v);
    exp_printf(b, "\"");
}

/* A device's labels: UUID (the device cuma names: "GPU-..." as DCGM exporter's UUID label, or
 * "sim"), then DCGM's gpu index and device node where the driver's files name the GPU. DCGM's
 * `device` is the node ("nvidia0"), so cuma's device string goes under UUID, not device. */
static void device_labels(exp_buf *b, const char *device, const gpu_table *g, int comma) {
    exp_printf(b, "%sUUID=\"", comma ? "," : "");
    label_value(b, device);
    exp_printf(b, "\"");
    const gpu_id *id = gpu_ids_find(g, device);
    if (id) exp_printf(b, ",device=\"nvidia%d\",gpu=\"%d\"", id->minor, id->index);
}

static void heap_labels(exp_buf *b, const cuma_ledger_entry *e, const gpu_table *g) {
    exp_printf(b, "{");
    device_labels(b, e->device, g, 0);
    exp_printf(b, ",backend=\"");
    label_value(b, e->backend);
    exp_printf(b, "\"");
    opt_label(b, "container", e->container);
    opt_label(b, "namespace", e->pod_namespace);
    opt_label(b, "pod", e->pod);
    exp_printf(b, ",pid=\"%d\",process=\"", e->pid);
    label_value(b, e->process);
    exp_printf(b, "\",priority=\"%d\",slot=\"%u\"}", e->priority, e->slot);
}

/* Every heap's labels, rendered once a read: each of the thirty-odd heap families repeats them
 * (rendered per family, they were most of a read's cost). Heap i's are text.p[at[i]..at[i+1]). */
typedef struct label_set {
    exp_buf text;
    size_t *at; /* nheaps + 1 offsets */
} label_set;

/* 0, or -1 when memory ran out. */
static int labels_make(label_set *ls, const ledger_view *v, const gpu_table *g) {
    *ls = (label_set){0};
    ls->at = malloc((v->nheaps + 1) * sizeof *ls->at);
    if (!ls->at) return -1;
    for (size_t i = 0; i < v->nheaps; i++) {
        ls->at[i] = ls->text.len;
        heap_labels(&ls->text, &v->heaps[i], g);
    }
    ls->at[v->nheaps] = ls->text.len;
    return ls->text.oom ? -1 : 0;
}

static void labels_free(label_set *ls) {
    free(ls->text.p);
    free(ls->at);
}

static void put_labels(exp_buf *b, const label_set *ls, size_t i) {
    exp_put(b, ls->text.p + ls->at[i], ls->at[i + 1] - ls->at[i]);
}

/* A per-heap gauge of a value computed from the entry (an age, a ratio), with `decimals`. */
static void heap_gauge(exp_buf *b, const ledger_view *v, const label_set *ls, const char *name,
                       const char *help, int published_only,
                       double (*value)(const cuma_ledger_entry *), int decimals) {
    family(b, name, "gauge", help);
    for (size_t i = 0; i < v->nheaps; i++) {
        if (published_only && !view_has_stats(&v->heaps[i])) continue;
        exp_printf(b, "%s", name);
        put_labels(b, ls, i);
        exp_printf(b, " %.*f\n", decimals, value(&v->heaps[i]));
    }
}

static double publish_age_s(const cuma_ledger_entry *e) {
    return (double)e->age_ns * 1e-9;
}
static double stats_age_s(const cuma_ledger_entry *e) {
    return (double)e->stats_age_ns * 1e-9;
}
/* From the two figures the heap publishes together (mapped and its stranded share), so that
 * they agree; the share's parts per million leave it within a millionth of the mapped bytes. */
static double stranded_bytes(const cuma_ledger_entry *e) {
    return (double)e->mapped_bytes * e->fragmentation;
}

static void heap_family(exp_buf *b, const ledger_view *v, const label_set *ls,
                        const heap_metric *hm) {
    family(b, hm->name, hm->type, hm->help);
    for (size_t i = 0; i < v->nheaps; i++) {
        exp_printf(b, "%s", hm->name);
        put_labels(b, ls, i);
        exp_printf(b, " %" PRIu64 "\n", *(const uint64_t *)((const char *)&v->heaps[i] + hm->off));
    }
}

/* A family of the list's: its name and type from the figure's kind; a ratio (the ledger keeps
 * parts per million) with six decimals, which are exact. */
static void alloc_family(exp_buf *b, const ledger_view *v, const label_set *ls,
                         const alloc_metric *am) {
    int counter = (am->kind & CUMA_STAT_COUNTER) != 0;
    int ratio = CUMA_STAT_UNIT(am->kind) == CUMA_STAT_RATIO;
    char name[128];
    snprintf(name, sizeof name, "cuma_%s%s", am->name, counter ? "_total" : ratio ? "_ratio" : "");
    family(b, name, counter ? "counter" : "gauge", am->help);
    for (size_t i = 0; i < v->nheaps; i++) {
        const cuma_ledger_entry *e = &v->heaps[i];
        if (!view_has_stats(e)) continue;
        exp_printf(b, "%s", name);
        put_labels(b, ls, i);
        const char *at = (const char *)e + am->off;
        if (ratio)
            exp_printf(b, " %.6f\n", *(const double *)at);
        else
            exp_printf(b, " %" PRIu64 "\n", *(const uint64_t *)at);
    }
}

/* device_family's `off` for the number of heaps, a size_t, not a uint64_t field. */
#define HEAP_COUNT ((size_t)-1)

/* A per-device gauge: the uint64_t at `off` in view_device, or the number of heaps. */
static void device_family(exp_buf *b, const ledger_view *v, const gpu_table *g, const char *name,
                          const char *help, size_t off) {
    family(b, name, "gauge", help);
    for (size_t k = 0; k < v->ndevices; k++) {
        const view_device *d = &v->devices[k];
        uint64_t x =
            off == HEAP_COUNT ? (uint64_t)d->count : *(const uint64_t *)((const char *)d + off);
        exp_printf(b, "%s{", name);
        device_labels(b, d->device, g, 0);
        exp_printf(b, "} %" PRIu64 "\n", x);
    }
}

void exp_render_figures(exp_buf *b, const ledger_view *v) {
    /* Read at every read of the ledger, off the server's path: a few small files. */
    gpu_table gt;
    const gpu_table *g = &gt;
    gpu_ids_read(NULL, &gt);
    device_family(b, v, g, "cuma_device_capacity_bytes", "The device's memory.",
                  offsetof(view_device, capacity));
    device_family(b, v, g, "cuma_device_reserved_bytes", "Memory all heaps hold on the device.",
                  offsetof(view_device, reserved));
    device_family(b, v, g, "cuma_device_cached_bytes", "Idle memory in all heaps' caches.",
                  offsetof(view_device, cached));
    device_family(b, v, g, "cuma_device_guaranteed_bytes", "The sum of the heaps' guarantees.",
                  offsetof(view_device, guaranteed));
    device_family(b, v, g, "cuma_device_free_bytes",
                  "Capacity minus what heaps hold or are guaranteed, as admission counts it.",
                  offsetof(view_device, free));
    device_family(b, v, g, "cuma_device_heaps", "Live heaps on the device.", HEAP_COUNT);
    label_set labels;
    if (labels_make(&labels, v, g)) {
        labels_free(&labels);
        b->oom = 1;
        return;
    }
    const label_set *ls = &labels;
    for (size_t m = 0; m < sizeof heap_metrics / sizeof heap_metrics[0]; m++)
        heap_family(b, v, ls, &heap_metrics[m]);
    heap_gauge(b, v, ls, "cuma_heap_publish_age_seconds",
               "Time since the heap last published its cached and requested bytes (as of the "
               "read).",
               0, publish_age_s, 3);
    for (size_t m = 0; m < sizeof alloc_metrics / sizeof alloc_metrics[0]; m++)
        if (alloc_metrics[m].name) alloc_family(b, v, ls, &alloc_metrics[m]);
    heap_gauge(b, v, ls, "cuma_stranded_bytes",
               "In-use (mapped) bytes that no live allocation asked for: free, but usable only "
               "by requests that fit in the gaps (cached bytes are not among them).",
               1, stranded_bytes, 0);
    heap_gauge(b, v, ls, "cuma_heap_stats_age_seconds",
               "Time since the heap last published its allocator figures (every 100 ms; as of "
               "the read).",
               1, stats_age_s, 3);
    labels_free(&labels);
}

void exp_render_head(exp_buf *b, int up, uint64_t errors, uint64_t reads, int stale,
                     const exp_snapshot *snap, uint64_t now_ms) {
    family(b, "cuma_ledger_up", "gauge",
           "Whether the ledger was read for this scrape (0: the read failed or took longer "
           "than a scrape waits, --fresh-wait, 500 ms by default, which holds up to 100 ms "
           "before a read may begin; a read without the lock, see cuma_ledger_unlocked, is one).");
    exp_printf(b, "cuma_ledger_up %d\n", up);
    family(b, "cuma_exporter_scrape_errors_total", "counter",
           "Reads of the ledger that failed (scrapes that come together share one read).");
    exp_printf(b, "cuma_exporter_scrape_errors_total %" PRIu64 "\n", errors);
    family(b, "cuma_exporter_reads_total", "counter",
           "Reads of the ledger begun (scrapes that come together share one; one in 100 ms at "
           "most).");
    exp_printf(b, "cuma_exporter_reads_total %" PRIu64 "\n", reads);
    family(b, "cuma_ledger_stale", "gauge",
           "1 when the figures below are the last good read's, this scrape's having failed or "
           "taken too long (e.g. the first read after a process stopped holding the ledger's "
           "lock, which waits 2 s for it).");
    exp_printf(b, "cuma_ledger_stale %d\n", stale);
    family(b, "cuma_ledger_snapshot_age_seconds", "gauge",
           "Time since the read the figures below come from began (no sample: no figures).");
    if (snap)
        exp_printf(b, "cuma_ledger_snapshot_age_seconds %.3f\n",
                   (double)(now_ms - (now_ms < snap->started_ms ? now_ms : snap->started_ms)) /
                       1e3);
    family(b, "cuma_ledger_unlocked", "gauge",
           "1 when the figures below were read without the ledger's lock, which a stopped "
           "process holds: current, but not guaranteed consistent (dead processes' heaps may "
           "still show).");
    exp_printf(b, "cuma_ledger_unlocked %d\n", snap && snap->unlocked);
    family(b, "cuma_ledger_lock_stuck_seconds", "gauge",
           "How long the ledger's lock had not changed hands when the figures below were read "
           "without it (at least; no sample: read under the lock).");
    if (snap && snap->unlocked)
        exp_printf(b, "cuma_ledger_lock_stuck_seconds %.3f\n", snap->stuck_s);
}

exp_snapshot *exp_snapshot_ref(exp_snapshot *s) {
    if (s) atomic_fetch_add(&s->refs, 1);
    return s;
}

void exp_snapshot_release(exp_snapshot *s) {
    if (s && atomic_fetch_sub(&s->refs, 1) == 1) {
        free(s->text);
        free(s);
    }
}

int exp_read(const char *ledger, int *was_up, exp_snapshot **out, int *missing) {
    *out = NULL;
    *missing = 0;
    uint64_t started = exp_now_ms();
    ledger_view v;
    int up = view_read(&v, ledger) == 0;
    int state = up ? 1 + v.unlocked : 0;
    if (state != *was_up) {
        if (!up)
            fprintf(stderr, "cuma exporter: %s\n", v.error);
        else if (state == 2)
            fprintf(stderr,
                    "cuma exporter: ledger %s read without its lock, which a process holds and "
                    "does not run (stopped?): cuma_ledger_unlocked 1\n",
                    v.path);
        else if (*was_up == 2)
            fprintf(stderr, "cuma exporter: ledger %s read under its lock again\n", v.path);
        else if (*was_up == 0)
            fprintf(stderr, "cuma exporter: ledger %s readable again\n", v.path);
        *was_up = state;
    }
    if (!up) {
        *missing = v.missing;
        view_free(&v);
        return 0;
    }
    exp_buf b = {0};
    exp_render_figures(&b, &v);
    view_free(&v);
    exp_snapshot *s = b.oom ? NULL : malloc(sizeof *s);
    if (!s) {
        fprintf(stderr, "cuma exporter: out of memory for the metrics of ledger %s\n",
                ledger ? ledger : "on");
        free(b.p);
        return 0;
    }
    atomic_init(&s->refs, 1);
    s->started_ms = started;
    s->unlocked = state == 2;
    s->stuck_s = (double)v.stuck_ns * 1e-9;
    s->text = b.p;
    s->seen = 0;
    s->len = b.len;
    *out = s;
    return 1;
}

/* ---- the command ---------------------------------------------------------------------------- */

/* Listens on addr:port; the bound address goes to stderr (port 0 picks a free one). */
static int listen_on(const char *addr, const char *port) {
    struct addrinfo hints = {.ai_family = AF_UNSPEC,
                             .ai_socktype = SOCK_STREAM,
                             .ai_flags = AI_PASSIVE | AI_NUMERICHOST | AI_NUMERICSERV},
                    *ai;
    int gai = getaddrinfo(addr, port, &hints, &ai);
    if (gai) {
        fprintf(stderr, "cuma exporter: --bind %s: %s (a numeric IPv4 or IPv6 address)\n", addr,
                gai_strerror(gai));
        return -2;
    }
    int fd = socket(ai->ai_family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    int one = 1;
    /* A deep backlog: a burst of new clients waits there for the server's next accept round
     * instead of being refused. */
    if (fd < 0 || setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one) ||
        bind(fd, ai->ai_addr, ai->ai_addrlen) || listen(fd, SOMAXCONN)) {
        fprintf(stderr, "cuma exporter: cannot listen on %s port %s: %s\n", addr, port,
                strerror(errno));
        if (fd >= 0) close(fd);
        freeaddrinfo(ai);
        return -1;
    }
    freeaddrinfo(ai);
    struct sockaddr_storage ss;
    socklen_t len = sizeof ss;
    char host[NI_MAXHOST] = "?", serv[NI_MAXSERV] = "?";
    if (!getsockname(fd, (struct sockaddr *)&ss, &len))
        getnameinfo((struct sockaddr *)&ss, len, host, sizeof host, serv, sizeof serv,
                    NI_NUMERICHOST | NI_NUMERICSERV);
    fprintf(stderr, "cuma exporter: serving http://%s%s%s:%s/metrics\n",
            strchr(host, ':') ? "[" : "", host, strchr(host, ':') ? "]" : "", serv);
    return fd;
}

/* --once: one read, here, and its text on stdout. */
static int print_once(const char *ledger) {
    int was_up = -1, missing;
    exp_snapshot *s;
    int up = exp_read(ledger, &was_up, &s, &missing);
    exp_buf b = {0};
    exp_render_head(&b, up, !up, 1, 0, s, s ? s->started_ms : 0);
    int rc = b.oom ? CUMA_EXIT_FAIL : CUMA_EXIT_OK;
    if (!b.oom && (fwrite(b.p, 1, b.len, stdout) != b.len ||
                   (s && fwrite(s->text, 1, s->len, stdout) != s->len) || fflush(stdout)))
        rc = CUMA_EXIT_FAIL;
    free(b.p);
    exp_snapshot_release(s);
    return rc;
}

int cuma_cmd_exporter(int argc, char **argv) {
    const char *ledger = NULL, *bind_addr = "127.0.0.1", *port = NULL;
    int once = 0;
    exp_server_conf conf = {0};
    if (cli_wants_help(argc, argv, CUMA_EXPORTER_USAGE)) return CUMA_EXIT_OK;
    for (int i = 1; i < argc; i++) {
        const char *v;
        int missing = 0;
        if ((v = cli_option(argc, argv, &i, "--ledger", &missing)) != NULL) {
            ledger = v;
        } else if ((v = cli_option(argc, argv, &i, "--port", &missing)) != NULL) {
            char *end;
            errno = 0;
            long p = strtol(v, &end, 10);
            if (errno || end == v || *end || *v < '0' || *v > '9' || p < 0 || p > 65535)
                return cli_usage_error("exporter", CUMA_EXPORTER_USAGE,
                                       "--port wants 0 to 65535, not '%s'", v);
            port = v;
        } else if ((v = cli_option(argc, argv, &i, "--connections", &missing)) != NULL) {
            char *end;
            errno = 0;
            long n = strtol(v, &end, 10);
            if (errno || end == v || *end || *v < '0' || *v > '9' || n < 1 || n > EXP_MAX_CONNS)
                return cli_usage_error("exporter", CUMA_EXPORTER_USAGE,
                                       "--connections wants 1 to %d, not '%s'", EXP_MAX_CONNS, v);
            conf.max_conns = (int)n;
        } else if ((v = cli_option(argc, argv, &i, "--fresh-wait", &missing)) != NULL) {
            char *end;
            errno = 0;
            long n = strtol(v, &end, 10);
            if (errno || end == v || *end || *v < '0' || *v > '9' || n < EXP_MIN_FRESH_WAIT_MS ||
                n > EXP_MAX_FRESH_WAIT_MS)
                return cli_usage_error("exporter", CUMA_EXPORTER_USAGE,
                                       "--fresh-wait wants %d to %d milliseconds, not '%s'",
                                       EXP_MIN_FRESH_WAIT_MS, EXP_MAX_FRESH_WAIT_MS, v);
            conf.fresh_wait_ms = (int)n;
        } else if ((v = cli_option(argc, argv, &i, "--bind", &missing)) != NULL) {
            bind_addr = v;
        } else if (!strcmp(argv[i], "--once")) {
            once = 1;
        } else if (missing) {
            return cli_usage_error("exporter", CUMA_EXPORTER_USAGE, "%s needs a value", argv[i]);
        } else {
            return cli_usage_error("exporter", CUMA_EXPORTER_USAGE, "unknown argument '%s'",
                                   argv[i]);
        }
    }
    char path[128];
    if (cuma_ledger_path(ledger, path, sizeof path) != CUMA_OK)
        return cli_usage_error("exporter", CUMA_EXPORTER_USAGE, "%s", cuma_last_error());
    if (once) return print_once(ledger);
    char defport[8];
    snprintf(defport, sizeof defport, "%d", CUMA_EXPORTER_DEFAULT_PORT);
    /* A client that hangs up mid-answer must cost a connection, not the process. */
    signal(SIGPIPE, SIG_IGN);
    sigset_t wait_mask;
    view_catch_stop(&wait_mask);
    int lfd = listen_on(bind_addr, port ? port : defport);
    if (lfd == -2) return cli_usage_error("exporter", CUMA_EXPORTER_USAGE, "bad --bind address");
    if (lfd < 0) return CUMA_EXIT_FAIL;
    fprintf(stderr, "cuma exporter: ledger %s\n", path);
    int wake[2];
    if (pipe2(wake, O_NONBLOCK | O_CLOEXEC)) {
        fprintf(stderr, "cuma exporter: pipe: %s\n", strerror(errno));
        close(lfd);
        return CUMA_EXIT_FAIL;
    }
    exp_sampler s;
    int rc = CUMA_EXIT_FAIL;
    if (!exp_sampler_start(&s, ledger, wake[1])) {
        rc = exp_serve(lfd, wake[0], &s, &conf, &wait_mask);
        exp_sampler_stop(&s);
    }
    close(wake[0]);
    close(wake[1]);
    close(lfd);
    return rc;
}
