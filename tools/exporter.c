/* `cuma exporter`: the ledger as Prometheus metrics, over HTTP or once to stdout.
 *
 * The server is one thread with ppoll(): several connections are read at once, each with a
 * deadline, so a client that connects and sends nothing (or trickles bytes) delays nobody and
 * is dropped when its time is up. Each connection carries one request (Connection: close),
 * which is all Prometheus needs. Requests are capped in size; anything that is not a well-formed
 * GET or HEAD gets a 4xx answer and the connection is closed. The ledger is read afresh for
 * every scrape: a snapshot is a few system calls and 256 slots at most. */
#include "cli.h"
#include "ledger_view.h"

#include <errno.h>
#include <inttypes.h>
#include <netdb.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#define MAX_CONNS       32    /* open connections at once; more wait in the listen backlog */
#define REQUEST_MAX     8192  /* bytes of request line and headers; larger is refused */
#define CONN_TIMEOUT_MS 10000 /* from accept to the last byte of the answer */
#define CONTENT_TYPE    "text/plain; version=0.0.4; charset=utf-8"

/* ---- a growing text buffer ------------------------------------------------------------------ */

typedef struct sbuf {
    char *p;
    size_t len, cap;
    int oom;
} sbuf;

static void sb_printf(sbuf *b, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void sb_printf(sbuf *b, const char *fmt, ...) {
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
        size_t cap = b->cap ? b->cap : 4096;
        while (cap <= b->len + (size_t)n) cap *= 2;
        char *p = realloc(b->p, cap);
        if (!p) {
            b->oom = 1;
            return;
        }
        b->p = p;
        b->cap = cap;
    }
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
    {"cuma_ledger_denials_total", "counter", "Growths the ledger refused the heap.", F(denials)},
    {"cuma_pressure_asks_total", "counter", "Pressure requests the heap posted.", F(pressure_asks)},
    {"cuma_pressure_given_bytes_total", "counter",
     "Bytes the heap gave back on other heaps' pressure requests.", F(pressure_given)},
    {"cuma_pressure_callbacks_total", "counter", "Pressure callbacks the heap ran.",
     F(pressure_calls)},
};

/* The allocator's figures, as its release thread last published them (every 100 ms). A heap
 * that has published none has no samples in these families: zeros would read as an idle heap,
 * and a counter that later jumps from 0 to its real value would show as a burst in rate(). */
static const heap_metric alloc_metrics[] = {
    {"cuma_allocs_total", "counter", "Successful allocations.", F(num_allocs)},
    {"cuma_frees_total", "counter", "Frees.", F(num_frees)},
    {"cuma_failed_allocs_total", "counter", "Allocations that returned an error.",
     F(failed_allocs)},
    {"cuma_alloc_retries_total", "counter",
     "Allocations that did not fit at once and went down the out-of-memory ladder (cache "
     "released, then the others' memory, callbacks, managed memory).",
     F(alloc_retries)},
    {"cuma_ooms_total", "counter", "Allocations that reached the heap's OOM callbacks.", F(ooms)},
    {"cuma_oom_callbacks_total", "counter", "OOM callback invocations.", F(oom_callbacks)},
    {"cuma_managed_fallbacks_total", "counter", "Allocations served from managed memory.",
     F(managed_fallbacks)},
    {"cuma_page_creates_total", "counter", "Physical pages (or segments) obtained from the device.",
     F(page_creates)},
    {"cuma_page_releases_total", "counter", "Physical pages (or segments) given back.",
     F(page_releases)},
    {"cuma_active_allocations", "gauge", "Live allocations.", F(active_allocs)},
    {"cuma_allocated_bytes", "gauge", "Bytes of live allocations after rounding.", F(allocated)},
    {"cuma_mapped_bytes", "gauge", "Bytes of pages under at least one live byte.", F(mapped)},
    {"cuma_managed_bytes", "gauge", "Bytes of live allocations served from managed memory.",
     F(managed)},
};
#undef F

static void family(sbuf *b, const char *name, const char *type, const char *help) {
    sb_printf(b, "# HELP %s %s\n# TYPE %s %s\n", name, help, name, type);
}

/* A label value: valid UTF-8 with backslash, double quote and line feed escaped, as the text
 * format wants (view_clean already turned the line feed and other controls into '?'). */
static void label_value(sbuf *b, const char *s) {
    char clean[256];
    view_clean(s, clean, sizeof clean);
    for (const char *p = clean; *p; p++)
        sb_printf(b, "%s%c", *p == '\\' || *p == '"' ? "\\" : "", *p);
}

/* The labels of a heap. slot makes the series unique: one process may have several heaps on a
 * device at one priority, and samples with equal label sets are rejected by Prometheus. backend
 * is fixed when the heap joins, so it adds no series; empty for a slot that names none. */
static void heap_labels(sbuf *b, const cuma_ledger_entry *e) {
    sb_printf(b, "{backend=\"");
    label_value(b, e->backend);
    sb_printf(b, "\",device=\"");
    label_value(b, e->device);
    sb_printf(b, "\",pid=\"%d\",process=\"", e->pid);
    label_value(b, e->process);
    sb_printf(b, "\",priority=\"%d\",slot=\"%u\"}", e->priority, e->slot);
}

/* A per-heap gauge of a value computed from the entry (an age, a ratio), with `decimals`. */
static void heap_gauge(sbuf *b, const ledger_view *v, const char *name, const char *help,
                       int published_only, double (*value)(const cuma_ledger_entry *),
                       int decimals) {
    family(b, name, "gauge", help);
    for (size_t i = 0; i < v->nheaps; i++) {
        if (published_only && !view_has_stats(&v->heaps[i])) continue;
        sb_printf(b, "%s", name);
        heap_labels(b, &v->heaps[i]);
        sb_printf(b, " %.*f\n", decimals, value(&v->heaps[i]));
    }
}

static double publish_age_s(const cuma_ledger_entry *e) {
    return (double)e->age_ns * 1e-9;
}
static double stats_age_s(const cuma_ledger_entry *e) {
    return (double)e->stats_age_ns * 1e-9;
}
static double fragmentation(const cuma_ledger_entry *e) {
    return e->fragmentation;
}

static void heap_family(sbuf *b, const ledger_view *v, const heap_metric *hm, int published_only) {
    family(b, hm->name, hm->type, hm->help);
    for (size_t i = 0; i < v->nheaps; i++) {
        if (published_only && !view_has_stats(&v->heaps[i])) continue;
        sb_printf(b, "%s", hm->name);
        heap_labels(b, &v->heaps[i]);
        sb_printf(b, " %" PRIu64 "\n", *(const uint64_t *)((const char *)&v->heaps[i] + hm->off));
    }
}

/* device_family's `off` for the number of heaps, a size_t, not a uint64_t field. */
#define HEAP_COUNT ((size_t)-1)

/* A per-device gauge: the uint64_t at `off` in view_device, or the number of heaps. */
static void device_family(sbuf *b, const ledger_view *v, const char *name, const char *help,
                          size_t off) {
    family(b, name, "gauge", help);
    for (size_t k = 0; k < v->ndevices; k++) {
        const view_device *d = &v->devices[k];
        uint64_t x =
            off == HEAP_COUNT ? (uint64_t)d->count : *(const uint64_t *)((const char *)d + off);
        sb_printf(b, "%s{device=\"", name);
        label_value(b, d->device);
        sb_printf(b, "\"} %" PRIu64 "\n", x);
    }
}

/* The whole exposition. *errors counts the scrapes that could not read the ledger; a failed
 * read is reported (once per change) on stderr and as cuma_ledger_up 0, never fatal. */
static void render(sbuf *b, const char *ledger, uint64_t *errors, int *was_up) {
    ledger_view v;
    int up = view_read(&v, ledger) == 0;
    if (!up) (*errors)++;
    if (up != *was_up) {
        if (!up)
            fprintf(stderr, "cuma exporter: %s\n", v.error);
        else if (*was_up == 0)
            fprintf(stderr, "cuma exporter: ledger %s readable again\n", v.path);
        *was_up = up;
    }
    family(b, "cuma_ledger_up", "gauge", "Whether the ledger could be read at this scrape.");
    sb_printf(b, "cuma_ledger_up %d\n", up);
    family(b, "cuma_exporter_scrape_errors_total", "counter",
           "Scrapes at which the ledger could not be read.");
    sb_printf(b, "cuma_exporter_scrape_errors_total %" PRIu64 "\n", *errors);
    if (up) {
        device_family(b, &v, "cuma_device_capacity_bytes", "The device's memory.",
                      offsetof(view_device, capacity));
        device_family(b, &v, "cuma_device_reserved_bytes", "Memory all heaps hold on the device.",
                      offsetof(view_device, reserved));
        device_family(b, &v, "cuma_device_cached_bytes", "Idle memory in all heaps' caches.",
                      offsetof(view_device, cached));
        device_family(b, &v, "cuma_device_guaranteed_bytes", "The sum of the heaps' guarantees.",
                      offsetof(view_device, guaranteed));
        device_family(b, &v, "cuma_device_free_bytes",
                      "Capacity minus what heaps hold or are guaranteed, as admission counts it.",
                      offsetof(view_device, free));
        device_family(b, &v, "cuma_device_heaps", "Live heaps on the device.", HEAP_COUNT);
        for (size_t m = 0; m < sizeof heap_metrics / sizeof heap_metrics[0]; m++)
            heap_family(b, &v, &heap_metrics[m], 0);
        heap_gauge(b, &v, "cuma_heap_publish_age_seconds",
                   "Time since the heap last published its cached and requested bytes.", 0,
                   publish_age_s, 3);
        for (size_t m = 0; m < sizeof alloc_metrics / sizeof alloc_metrics[0]; m++)
            heap_family(b, &v, &alloc_metrics[m], 1);
        /* The ledger keeps parts per million: six decimals are exact. */
        heap_gauge(b, &v, "cuma_fragmentation_ratio",
                   "Share of the mapped bytes not under live allocations (0 to 1).", 1,
                   fragmentation, 6);
        heap_gauge(b, &v, "cuma_heap_stats_age_seconds",
                   "Time since the heap last published its allocator figures (every 100 ms).", 1,
                   stats_age_s, 3);
    }
    view_free(&v);
}

/* ---- HTTP ----------------------------------------------------------------------------------- */

typedef struct conn {
    int fd;
    uint64_t deadline_ms;
    size_t in_len;
    char in[REQUEST_MAX + 1];
    char *out; /* the answer, once the request is complete */
    size_t out_len, out_off;
} conn;

static uint64_t now_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000u + (uint64_t)ts.tv_nsec / 1000000u;
}

static void respond(conn *c, int code, const char *reason, const char *extra, const char *type,
                    const char *body, size_t body_len, int head) {
    sbuf b = {0};
    sb_printf(&b,
              "HTTP/1.1 %d %s\r\nContent-Type: %s\r\nContent-Length: %zu\r\n%sConnection: "
              "close\r\n\r\n",
              code, reason, type, body_len, extra);
    if (!head && body_len && !b.oom) {
        char *p = realloc(b.p, b.len + body_len);
        if (p) {
            memcpy(p + b.len, body, body_len);
            b.p = p;
            b.len += body_len;
        } else {
            b.oom = 1;
        }
    }
    if (b.oom) {
        free(b.p);
        b.p = NULL;
        b.len = 0; /* nothing to say: the connection just closes */
    }
    c->out = b.p;
    c->out_len = b.len;
    c->out_off = 0;
}

static void error_page(conn *c, int code, const char *reason, const char *extra, int head) {
    char body[96];
    int n = snprintf(body, sizeof body, "%d %s\n", code, reason);
    respond(c, code, reason, extra, "text/plain; charset=utf-8", body, (size_t)n, head);
}

/* The end of the request head ("\r\n\r\n", or "\n\n" from lax clients), or NULL. */
static const char *head_end(const conn *c) {
    const char *a = strstr(c->in, "\r\n\r\n"), *b = strstr(c->in, "\n\n");
    return a && (!b || a < b) ? a : b;
}

/* Answers a complete request head: only GET/HEAD of /metrics (a query string is ignored). */
static void handle(conn *c, const char *ledger, uint64_t *errors, int *was_up) {
    size_t line = strcspn(c->in, "\r\n");
    c->in[line] = 0;
    char method[16], target[2048], version[16], rest;
    /* Exactly three tokens separated by single spaces, none too long (RFC 9112's form). */
    int n = sscanf(c->in, "%15[A-Z] %2047[^ ] %15[^ ]%c", method, target, version, &rest);
    int spaces = 0;
    for (const char *p = c->in; *p; p++) spaces += *p == ' ';
    if (n != 3 || spaces != 2 || strncmp(version, "HTTP/1.", 7) || !version[7] || version[8]) {
        error_page(c, 400, "Bad Request", "", 0);
        return;
    }
    int head = !strcmp(method, "HEAD");
    if (!head && strcmp(method, "GET")) {
        error_page(c, 405, "Method Not Allowed", "Allow: GET, HEAD\r\n", 0);
        return;
    }
    target[strcspn(target, "?#")] = 0;
    if (strcmp(target, "/metrics")) {
        error_page(c, 404, "Not Found", "", head);
        return;
    }
    sbuf b = {0};
    render(&b, ledger, errors, was_up);
    if (b.oom)
        error_page(c, 500, "Internal Server Error", "", head);
    else
        respond(c, 200, "OK", "", CONTENT_TYPE, b.p, b.len, head);
    free(b.p);
}

static void close_conn(conn *c) {
    close(c->fd);
    free(c->out);
    c->fd = -1;
    c->out = NULL;
}

/* Reads what the client sent; answers when the head is complete or too large. */
static void on_readable(conn *c, const char *ledger, uint64_t *errors, int *was_up) {
    ssize_t r = recv(c->fd, c->in + c->in_len, REQUEST_MAX - c->in_len, 0);
    if (r < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) return;
    if (r <= 0) {
        close_conn(c); /* gone before asking anything complete */
        return;
    }
    c->in_len += (size_t)r;
    c->in[c->in_len] = 0;
    /* A NUL byte is not HTTP; strstr would also stop at it. */
    if (memchr(c->in, 0, c->in_len)) {
        error_page(c, 400, "Bad Request", "", 0);
    } else if (head_end(c)) {
        handle(c, ledger, errors, was_up);
    } else if (c->in_len == REQUEST_MAX) {
        error_page(c, 431, "Request Header Fields Too Large", "", 0);
    } else {
        return;
    }
    /* Whatever else the client sends is not read: stop taking it. */
    shutdown(c->fd, SHUT_RD);
    if (!c->out) close_conn(c);
}

static void on_writable(conn *c) {
    ssize_t w = send(c->fd, c->out + c->out_off, c->out_len - c->out_off, MSG_NOSIGNAL);
    if (w < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) return;
    if (w < 0) {
        close_conn(c);
        return;
    }
    c->out_off += (size_t)w;
    if (c->out_off == c->out_len) close_conn(c);
}

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
    if (fd < 0 || setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one) ||
        bind(fd, ai->ai_addr, ai->ai_addrlen) || listen(fd, 64)) {
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

/* Serves until SIGINT or SIGTERM. They are blocked except inside ppoll, so one that comes
 * between the check of view_stop and the wait still ends the wait (with plain poll it could come
 * just before, and an idle server would wait forever). */
static int serve(int lfd, const char *ledger, const sigset_t *wait_mask) {
    conn *conns = calloc(MAX_CONNS, sizeof *conns);
    if (!conns) {
        fprintf(stderr, "cuma exporter: out of memory\n");
        return CUMA_EXIT_FAIL;
    }
    for (int i = 0; i < MAX_CONNS; i++) conns[i].fd = -1;
    struct pollfd pfd[MAX_CONNS + 1];
    int slot_of[MAX_CONNS + 1];
    uint64_t errors = 0;
    int was_up = -1, rc = CUMA_EXIT_OK;
    while (!view_stop) {
        uint64_t now = now_ms(), next = UINT64_MAX;
        int n = 0, open = 0;
        for (int i = 0; i < MAX_CONNS; i++) {
            conn *c = &conns[i];
            if (c->fd < 0) continue;
            if (now >= c->deadline_ms) { /* too slow to ask or to take the answer */
                close_conn(c);
                continue;
            }
            open++;
            if (c->deadline_ms < next) next = c->deadline_ms;
            pfd[n] = (struct pollfd){.fd = c->fd, .events = c->out ? POLLOUT : POLLIN};
            slot_of[n++] = i;
        }
        if (open < MAX_CONNS) {
            pfd[n] = (struct pollfd){.fd = lfd, .events = POLLIN};
            slot_of[n++] = -1;
        }
        uint64_t wait_ms = next == UINT64_MAX ? 0 : next - now + 1;
        struct timespec ts = {(time_t)(wait_ms / 1000), (long)(wait_ms % 1000) * 1000000L};
        int r = ppoll(pfd, (nfds_t)n, next == UINT64_MAX ? NULL : &ts, wait_mask);
        if (r < 0) {
            if (errno == EINTR) continue;
            fprintf(stderr, "cuma exporter: ppoll: %s\n", strerror(errno));
            rc = CUMA_EXIT_FAIL;
            break;
        }
        for (int k = 0; k < n; k++) {
            if (!pfd[k].revents) continue;
            if (slot_of[k] < 0) {
                int fd = accept4(lfd, NULL, NULL, SOCK_NONBLOCK | SOCK_CLOEXEC);
                if (fd < 0) {
                    /* Out of descriptors or a client gone before accept: try again later, but
                     * not in a busy loop. */
                    if (errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR &&
                        errno != ECONNABORTED)
                        usleep(100000);
                    continue;
                }
                for (int i = 0; i < MAX_CONNS; i++)
                    if (conns[i].fd < 0) {
                        conns[i] = (conn){.fd = fd, .deadline_ms = now_ms() + CONN_TIMEOUT_MS};
                        break;
                    }
                continue;
            }
            conn *c = &conns[slot_of[k]];
            if (c->fd < 0) continue;
            if (c->out)
                on_writable(c);
            else
                on_readable(c, ledger, &errors, &was_up);
        }
    }
    for (int i = 0; i < MAX_CONNS; i++)
        if (conns[i].fd >= 0) close_conn(&conns[i]);
    free(conns);
    return rc;
}

/* ---- the command ---------------------------------------------------------------------------- */

int cuma_cmd_exporter(int argc, char **argv) {
    const char *ledger = NULL, *bind_addr = "127.0.0.1", *port = NULL;
    int once = 0;
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
    if (once) {
        sbuf b = {0};
        uint64_t errors = 0;
        int was_up = -1;
        render(&b, ledger, &errors, &was_up);
        int rc = b.oom ? CUMA_EXIT_FAIL : CUMA_EXIT_OK;
        if (!b.oom && (fwrite(b.p, 1, b.len, stdout) != b.len || fflush(stdout)))
            rc = CUMA_EXIT_FAIL;
        free(b.p);
        return rc;
    }
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
    int rc = serve(lfd, ledger, &wait_mask);
    close(lfd);
    return rc;
}
