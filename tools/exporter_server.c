// SPDX-License-Identifier: Apache-2.0
/* The exporter's HTTP server: one thread with ppoll() over non-blocking sockets, so that no
 * client delays another, and no read of the ledger in it (exporter_sampler.c reads).
 *
 * A connection carries one request (Connection: close), which is all Prometheus needs, and goes
 * through four states, each with a deadline:
 *   reading  the request head, at most REQUEST_MAX bytes, within HEAD_TIMEOUT_MS of the accept
 *            (a client that sends nothing or trickles bytes is closed then, unanswered);
 *   waiting  a scrape, for a read of the ledger that began after it came, at most fresh_wait_ms
 *            (--fresh-wait, default EXP_DEFAULT_FRESH_WAIT_MS);
 *            then it is answered from the last good read, marked stale;
 *   writing  the answer, as fast as the client takes it, within WRITE_TIMEOUT_MS;
 *   draining once all of it is with the kernel: the server's side is shut (the client sees the
 *            end after the answer) and what the client still sends (a second request, the rest
 *            of a head too large) is read and dropped, DRAIN_MAX bytes at most, until the client
 *            closes or DRAIN_TIMEOUT_MS pass. Closed with bytes unread, the socket would send a
 *            reset, which throws away the part of the answer the kernel still holds.
 * When every slot is taken a new client still gets in: the connection that has been draining
 * the longest is closed for it (else the one reading the longest, else the one writing the
 * longest; waiting ones end soon on their own), once it is EVICT_GRACE_MS old, so that a flood
 * of new clients cannot push out one that sent its request at once. Slow or idle clients can
 * therefore cost a probe nothing but a slot it takes from them, and at most a wait in the
 * backlog for one to come of age. Anything that is not a well-formed GET or HEAD gets a 4xx
 * answer; a body is never taken for one.
 *
 * An answer being written holds its read's figures; answers of one read share them, but a client
 * that asks, takes nothing, and asks again after the next read holds a copy of every read it saw
 * until its write times out. The figures answers hold are kept under a budget (PINNED_MAX, or
 * four of the largest answer): over it, the answers of the oldest read still held are cut off,
 * oldest first. */
#include "cli.h"
#include "exporter.h"

#include <assert.h>
#include <errno.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <time.h>
#include <unistd.h>

#define REQUEST_MAX      8192         /* bytes of request line and headers; larger is refused */
#define HEAD_TIMEOUT_MS  2000         /* from accept to the end of the request head */
#define WRITE_TIMEOUT_MS 10000        /* for the client to take the answer */
#define DRAIN_TIMEOUT_MS 2000         /* for the client to close once it has the answer */
#define DRAIN_MAX        (256u << 10) /* bytes read and dropped while draining */
#define ACCEPT_BATCH     16           /* accepts per round, so that reading and writing go on */
#define EVICT_GRACE_MS   250          /* a new connection is not pushed out before this age */
#define SEND_BUFFER      16384 /* the kernel's buffer for an answer, per connection (see below) */
#define PINNED_MAX       (8u << 20) /* bytes of figures answers being written may hold (above) */
#define SPARE_FDS        32  /* descriptors kept for the rest (stdio, the ledger, the pipe) */
#define PAUSE_MS         100 /* accepting rests this long when descriptors or memory run out */

enum conn_state { C_FREE, C_READING, C_WAITING, C_WRITING, C_DRAINING };

/* One client. Invariants: fd >= 0 exactly when state != C_FREE; in is set while reading;
 * out (and body, which may be NULL) only while writing, out_off <= out_len, body_off <=
 * body->len, and the body is sent only after all of out; drained <= DRAIN_MAX while draining. */
typedef struct conn {
    int fd;
    enum conn_state state;
    int head;             /* a HEAD request: no body */
    uint64_t accepted_ms; /* for choosing whom to close when the slots are full */
    uint64_t deadline_ms; /* of the current state */
    uint64_t need;        /* waiting: the sampler's read number the answer waits for */
    char *in;             /* REQUEST_MAX + 1 bytes */
    size_t in_len;
    char *out; /* status line, headers, and for a scrape the head families */
    size_t out_len, out_off;
    exp_snapshot *body; /* a scrape's figures, after out */
    size_t body_off;
    size_t drained; /* draining: bytes read and dropped */
} conn;

/* The invariants above (debug builds check them at every round). */
__attribute__((unused)) static inline int conn_valid(const conn *c) {
    if ((c->fd >= 0) != (c->state != C_FREE)) return 0;
    if ((c->in != NULL) != (c->state == C_READING) || c->in_len > REQUEST_MAX) return 0;
    if (c->state == C_DRAINING && c->drained > DRAIN_MAX) return 0;
    if (c->state != C_WRITING) return !c->out && !c->body;
    return c->out && c->out_off <= c->out_len && (!c->body || c->body_off <= c->body->len) &&
           (c->body_off == 0 || c->out_off == c->out_len);
}

typedef struct server {
    conn *conns;
    int nconns;
    uint64_t round; /* of the loop: marks the figures counted in it (exp_snapshot.seen) */
    exp_sampler *sampler;
    uint64_t paused_until_ms; /* accepting rests until then */
    uint64_t fresh_wait_ms;   /* a scrape's wait for its read of the ledger: constant */
} server;

static void close_conn(conn *c) {
    if (c->state == C_FREE) return;
    close(c->fd);
    free(c->in);
    free(c->out);
    exp_snapshot_release(c->body);
    *c = (conn){.fd = -1, .state = C_FREE};
}

/* ---- answers -------------------------------------------------------------------------------- */

/* Makes the answer and starts writing it. head_text (may be NULL) and body follow the headers
 * unless the request was HEAD; body's reference passes to the connection. */
static void start_answer(conn *c, int code, const char *reason, const char *extra, const char *type,
                         const char *head_text, size_t head_len, exp_snapshot *body, uint64_t now) {
    exp_buf b = {0};
    size_t body_len = head_len + (body ? body->len : 0);
    exp_printf(&b,
               "HTTP/1.1 %d %s\r\nContent-Type: %s\r\nContent-Length: %zu\r\n%sConnection: "
               "close\r\n\r\n",
               code, reason, type, body_len, extra);
    if (!c->head && head_len && !b.oom) {
        char *p = realloc(b.p, b.len + head_len);
        if (p) {
            memcpy(p + b.len, head_text, head_len);
            b.p = p;
            b.len += head_len;
        } else {
            b.oom = 1;
        }
    }
    free(c->in);
    c->in = NULL;
    if (b.oom || c->head) {
        exp_snapshot_release(body);
        body = NULL;
    }
    if (b.oom) {
        free(b.p);
        close_conn(c); /* nothing to say: the connection just closes */
        return;
    }
    c->state = C_WRITING;
    c->deadline_ms = now + WRITE_TIMEOUT_MS;
    c->out = b.p;
    c->out_len = b.len;
    c->out_off = 0;
    c->body = body;
    c->body_off = 0;
}

static void error_page(conn *c, int code, const char *reason, const char *extra, uint64_t now) {
    char text[96];
    int n = snprintf(text, sizeof text, "%d %s\n", code, reason);
    start_answer(c, code, reason, extra, "text/plain; charset=utf-8", text, (size_t)n, NULL, now);
}

/* A waiting scrape's answer: fresh when its read has finished and succeeded, else the last
 * good read's figures marked stale (or none, when there is none or the ledger is gone). */
static void answer_scrape(conn *c, exp_sampler *s, uint64_t now) {
    pthread_mutex_lock(&s->mu);
    int up = s->done >= c->need && s->last_ok;
    uint64_t errors = s->errors, reads = s->reads;
    exp_snapshot *snap = exp_snapshot_ref(s->good);
    pthread_mutex_unlock(&s->mu);
    exp_buf h = {0};
    exp_render_head(&h, up, errors, reads, snap && !up, snap, now);
    if (h.oom) {
        free(h.p);
        exp_snapshot_release(snap);
        error_page(c, 500, "Internal Server Error", "", now);
        return;
    }
    start_answer(c, 200, "OK", "", EXP_CONTENT_TYPE, h.p, h.len, snap, now);
    free(h.p);
}

/* The end of the request head ("\r\n\r\n", or "\n\n" from lax clients), or NULL. */
static const char *head_end(const conn *c) {
    const char *a = strstr(c->in, "\r\n\r\n"), *b = strstr(c->in, "\n\n");
    return a && (!b || a < b) ? a : b;
}

/* A complete request head: only GET/HEAD of /metrics (a query string is ignored). A scrape
 * asks the sampler for a read and waits for it. */
static void handle(server *sv, conn *c, uint64_t now) {
    size_t line = strcspn(c->in, "\r\n");
    c->in[line] = 0;
    char method[16], target[2048], version[16], rest;
    /* Exactly three tokens separated by single spaces, none too long (RFC 9112's form). */
    int n = sscanf(c->in, "%15[A-Z] %2047[^ ] %15[^ ]%c", method, target, version, &rest);
    int spaces = 0;
    for (const char *p = c->in; *p; p++) spaces += *p == ' ';
    if (n != 3 || spaces != 2 || strncmp(version, "HTTP/1.", 7) || !version[7] || version[8]) {
        error_page(c, 400, "Bad Request", "", now);
        return;
    }
    c->head = !strcmp(method, "HEAD");
    if (!c->head && strcmp(method, "GET")) {
        error_page(c, 405, "Method Not Allowed", "Allow: GET, HEAD\r\n", now);
        return;
    }
    target[strcspn(target, "?#")] = 0;
    if (strcmp(target, "/metrics")) {
        error_page(c, 404, "Not Found", "", now);
        return;
    }
    free(c->in);
    c->in = NULL;
    c->state = C_WAITING;
    c->deadline_ms = now + sv->fresh_wait_ms;
    c->need = exp_sampler_ask(sv->sampler);
}

/* Reads and drops what the client sends; closes at its end, or when it sends too much. */
static void on_drainable(conn *c) {
    char sink[4096];
    for (;;) {
        ssize_t r = recv(c->fd, sink, sizeof sink, 0);
        if (r < 0 && errno == EINTR) continue;
        if (r < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return;
        if (r <= 0 || (c->drained += (size_t)r) > DRAIN_MAX) {
            close_conn(c);
            return;
        }
    }
}

/* Closes c before its time (a deadline, a new client): a draining one first takes what came
 * since the last poll, so that the close is no reset (the top). */
static void give_up(conn *c) {
    if (c->state == C_DRAINING) on_drainable(c); /* closes it itself at the client's end */
    close_conn(c);
}

/* All of the answer is with the kernel: shuts the server's side and drains (the top). */
static void start_draining(conn *c, uint64_t now) {
    free(c->out);
    c->out = NULL;
    exp_snapshot_release(c->body);
    c->body = NULL;
    c->state = C_DRAINING;
    c->deadline_ms = now + DRAIN_TIMEOUT_MS;
    c->drained = 0;
    if (shutdown(c->fd, SHUT_WR)) {
        close_conn(c);
        return;
    }
    on_drainable(c);
}

/* Sends what the client takes now; drains when all is sent, closes when the client is gone. */
static void on_writable(conn *c) {
    for (;;) {
        struct iovec iov[2];
        int n = 0;
        if (c->out_off < c->out_len)
            iov[n++] = (struct iovec){c->out + c->out_off, c->out_len - c->out_off};
        if (c->body && c->body_off < c->body->len)
            iov[n++] = (struct iovec){c->body->text + c->body_off, c->body->len - c->body_off};
        if (!n) {
            start_draining(c, exp_now_ms());
            return;
        }
        struct msghdr msg = {.msg_iov = iov, .msg_iovlen = (size_t)n};
        ssize_t w = sendmsg(c->fd, &msg, MSG_NOSIGNAL);
        if (w < 0 && errno == EINTR) continue;
        if (w < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return;
        if (w < 0) {
            close_conn(c);
            return;
        }
        size_t k = (size_t)w, head_left = c->out_len - c->out_off;
        size_t from_head = k < head_left ? k : head_left;
        c->out_off += from_head;
        c->body_off += k - from_head;
    }
}

/* Reads what the client sent; handles the head when it is complete or too large. */
static void on_readable(server *sv, conn *c, uint64_t now) {
    ssize_t r = recv(c->fd, c->in + c->in_len, REQUEST_MAX - c->in_len, 0);
    if (r < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) return;
    if (r <= 0) {
        close_conn(c); /* gone before asking anything complete */
        return;
    }
    c->in_len += (size_t)r;
    c->in[c->in_len] = 0;
    /* A NUL byte is not HTTP; strstr would also stop at it. */
    if (memchr(c->in, 0, c->in_len))
        error_page(c, 400, "Bad Request", "", now);
    else if (head_end(c))
        handle(sv, c, now);
    else if (c->in_len == REQUEST_MAX)
        error_page(c, 431, "Request Header Fields Too Large", "", now);
    else
        return;
    /* Whatever else the client sends stays unread until the answer is out (draining). */
    if (c->state == C_WRITING) on_writable(c);
}

/* Keeps the figures that answers being written hold within the budget (the comment at the top):
 * counts each read's figures once, then cuts off the answers of the oldest reads until the rest
 * fit. The newest read's answers are never cut: the budget is at least four of the largest. */
static void trim_pinned(server *sv) {
    sv->round++;
    size_t held = 0, largest = 0;
    for (int i = 0; i < sv->nconns; i++) {
        exp_snapshot *b = sv->conns[i].state == C_WRITING ? sv->conns[i].body : NULL;
        if (!b || b->seen == sv->round) continue;
        b->seen = sv->round;
        held += b->len;
        if (b->len > largest) largest = b->len;
    }
    size_t budget = largest > PINNED_MAX / 4 ? 4 * largest : PINNED_MAX;
    while (held > budget) {
        exp_snapshot *oldest = NULL;
        for (int i = 0; i < sv->nconns; i++) {
            exp_snapshot *b = sv->conns[i].state == C_WRITING ? sv->conns[i].body : NULL;
            if (b && (!oldest || b->started_ms < oldest->started_ms)) oldest = b;
        }
        if (!oldest) break;
        size_t len = oldest->len;
        for (int i = 0; i < sv->nconns; i++)
            if (sv->conns[i].state == C_WRITING && sv->conns[i].body == oldest)
                close_conn(&sv->conns[i]); /* the last of them frees it */
        held -= len;
    }
}

/* ---- accepting ------------------------------------------------------------------------------ */

/* Whether c may be closed for a new client: it reads, writes or drains, and it has had
 * EVICT_GRACE_MS to send its request (a client that sends it at once is never pushed out by a
 * flood). */
static int evictable(const conn *c, uint64_t now) {
    return (c->state == C_READING || c->state == C_WRITING || c->state == C_DRAINING) &&
           now - c->accepted_ms >= EVICT_GRACE_MS;
}

/* Which state's connections go first for a new client: one that has its answer, then one that
 * has not finished asking, then one taking its answer. */
static int evict_rank(enum conn_state s) {
    return s == C_DRAINING ? 0 : s == C_READING ? 1 : 2;
}

/* Whom to close for a new client when every slot is taken: of the evictable connections of the
 * first rank, the oldest; NULL when there is none (the new client waits in the backlog until a
 * connection ends or comes of age). */
static conn *victim(server *sv, uint64_t now) {
    conn *best = NULL;
    for (int i = 0; i < sv->nconns; i++) {
        conn *c = &sv->conns[i];
        if (!evictable(c, now)) continue;
        int r = evict_rank(c->state), rb = best ? evict_rank(best->state) : 3;
        if (r < rb || (r == rb && c->accepted_ms < best->accepted_ms)) best = c;
    }
    return best;
}

static conn *free_slot(server *sv) {
    for (int i = 0; i < sv->nconns; i++)
        if (sv->conns[i].state == C_FREE) return &sv->conns[i];
    return NULL;
}

static void accept_some(server *sv, int lfd) {
    for (int k = 0; k < ACCEPT_BATCH; k++) {
        uint64_t now = exp_now_ms();
        conn *c = free_slot(sv), *v = c ? NULL : victim(sv, now);
        if (!c && !v) return;
        int fd = accept4(lfd, NULL, NULL, SOCK_NONBLOCK | SOCK_CLOEXEC);
        if (fd < 0) {
            if (errno == EINTR || errno == ECONNABORTED) continue;
            /* Out of descriptors or memory: rest instead of spinning on a ready socket. */
            if (errno != EAGAIN && errno != EWOULDBLOCK) sv->paused_until_ms = now + PAUSE_MS;
            return;
        }
        /* A fixed send buffer: what a client that does not read costs the kernel stays small
         * (by default it grows to megabytes; the kernel doubles the figure set, so 32 KiB a
         * connection, 32 MiB for 1024), and the rest of its answer is its read's figures, under
         * the budget of trim_pinned. */
        int sndbuf = SEND_BUFFER;
        setsockopt(fd, SOL_SOCKET, SO_SNDBUF, &sndbuf, sizeof sndbuf);
        char *in = malloc(REQUEST_MAX + 1);
        if (!in) {
            close(fd);
            sv->paused_until_ms = now + PAUSE_MS;
            return;
        }
        /* A slow client's slot is taken only now that there is a client to give it to. */
        if (!c) {
            give_up(v);
            c = v;
        }
        *c = (conn){.fd = fd,
                    .state = C_READING,
                    .accepted_ms = now,
                    .deadline_ms = now + HEAD_TIMEOUT_MS,
                    .in = in};
        /* The request is often there already: taking it now makes this connection one that
         * waits or writes, not one that a later client may push out. */
        on_readable(sv, c, now);
    }
}

/* Room for the connections in the descriptor limit (raised toward its hard limit as needed). */
static int fit_fd_limit(int want) {
    struct rlimit rl;
    if (getrlimit(RLIMIT_NOFILE, &rl)) return want;
    rlim_t need = (rlim_t)want + SPARE_FDS;
    if (rl.rlim_cur < need) {
        rl.rlim_cur = rl.rlim_max == RLIM_INFINITY || rl.rlim_max >= need ? need : rl.rlim_max;
        setrlimit(RLIMIT_NOFILE, &rl);
        getrlimit(RLIMIT_NOFILE, &rl);
    }
    if (rl.rlim_cur >= need) return want;
    int n = rl.rlim_cur > SPARE_FDS ? (int)(rl.rlim_cur - SPARE_FDS) : 1;
    fprintf(stderr,
            "cuma exporter: %d connections at once, not %d (the descriptor limit is %llu)\n", n,
            want, (unsigned long long)rl.rlim_cur);
    return n;
}

/* ---- the loop ------------------------------------------------------------------------------- */

/* Serves until SIGINT or SIGTERM. They are blocked except inside ppoll, so one that comes
 * between the check of view_stop and the wait still ends the wait (with plain poll it could come
 * just before, and an idle server would wait forever). */
int exp_serve(int lfd, int wake_fd, exp_sampler *s, const exp_server_conf *conf,
              const sigset_t *wait_mask) {
    server sv = {.sampler = s,
                 .fresh_wait_ms = conf->fresh_wait_ms > 0 ? (uint64_t)conf->fresh_wait_ms
                                                          : EXP_DEFAULT_FRESH_WAIT_MS};
    sv.nconns = fit_fd_limit(conf->max_conns > 0 ? conf->max_conns : EXP_DEFAULT_CONNS);
    sv.conns = calloc((size_t)sv.nconns, sizeof *sv.conns);
    struct pollfd *pfd = calloc((size_t)sv.nconns + 2, sizeof *pfd);
    int *slot_of = calloc((size_t)sv.nconns + 2, sizeof *slot_of);
    if (!sv.conns || !pfd || !slot_of) {
        fprintf(stderr, "cuma exporter: out of memory for %d connections\n", sv.nconns);
        free(sv.conns);
        free(pfd);
        free(slot_of);
        return CUMA_EXIT_FAIL;
    }
    for (int i = 0; i < sv.nconns; i++) sv.conns[i] = (conn){.fd = -1, .state = C_FREE};
    int rc = CUMA_EXIT_OK;
    while (!view_stop) {
        uint64_t now = exp_now_ms(), next = UINT64_MAX;
        int n = 0, nopen = 0, victims = 0;
        pfd[n] = (struct pollfd){.fd = wake_fd, .events = POLLIN};
        slot_of[n++] = -2;
        for (int i = 0; i < sv.nconns; i++) {
            conn *c = &sv.conns[i];
            assert(conn_valid(c));
            if (c->state == C_FREE) continue;
            if (now >= c->deadline_ms) {
                if (c->state == C_WAITING) {
                    answer_scrape(c, s, now); /* its read is late: the last good one */
                    if (c->state == C_WRITING) on_writable(c);
                } else {
                    give_up(c); /* too slow to ask, to take the answer, or to close */
                }
                if (c->state == C_FREE) continue;
            }
            nopen++;
            if (c->deadline_ms < next) next = c->deadline_ms;
            if (c->state == C_WAITING) continue; /* the wake pipe says when */
            if (evictable(c, now))
                victims++;
            else if (c->accepted_ms + EVICT_GRACE_MS < next)
                next = c->accepted_ms + EVICT_GRACE_MS;
            pfd[n] =
                (struct pollfd){.fd = c->fd, .events = c->state == C_WRITING ? POLLOUT : POLLIN};
            slot_of[n++] = i;
        }
        if (now < sv.paused_until_ms) {
            if (sv.paused_until_ms < next) next = sv.paused_until_ms;
        } else if (nopen < sv.nconns || victims) {
            pfd[n] = (struct pollfd){.fd = lfd, .events = POLLIN};
            slot_of[n++] = -1;
        }
        uint64_t wait_ms = next == UINT64_MAX ? 0 : next > now ? next - now + 1 : 0;
        struct timespec ts = {(time_t)(wait_ms / 1000), (long)(wait_ms % 1000) * 1000000L};
        int r = ppoll(pfd, (nfds_t)n, next == UINT64_MAX ? NULL : &ts, wait_mask);
        if (r < 0) {
            if (errno == EINTR) continue;
            fprintf(stderr, "cuma exporter: ppoll: %s\n", strerror(errno));
            rc = CUMA_EXIT_FAIL;
            break;
        }
        now = exp_now_ms();
        int listen_ready = 0;
        for (int k = 0; k < n; k++) {
            if (!pfd[k].revents) continue;
            if (slot_of[k] == -1) {
                listen_ready = 1;
                continue;
            }
            if (slot_of[k] == -2) {
                char drain[256];
                while (read(wake_fd, drain, sizeof drain) > 0) {
                }
                continue;
            }
            conn *c = &sv.conns[slot_of[k]];
            if (c->state == C_WRITING)
                on_writable(c);
            else if (c->state == C_READING)
                on_readable(&sv, c, now);
            else if (c->state == C_DRAINING)
                on_drainable(c);
        }
        /* Scrapes whose read has finished (the pipe woke us, or it finished meanwhile). */
        pthread_mutex_lock(&s->mu);
        uint64_t done = s->done;
        pthread_mutex_unlock(&s->mu);
        for (int i = 0; i < sv.nconns; i++) {
            conn *c = &sv.conns[i];
            if (c->state != C_WAITING || c->need > done) continue;
            answer_scrape(c, s, now);
            if (c->state == C_WRITING) on_writable(c);
        }
        trim_pinned(&sv);
        if (listen_ready) accept_some(&sv, lfd);
    }
    for (int i = 0; i < sv.nconns; i++) close_conn(&sv.conns[i]);
    free(sv.conns);
    free(pfd);
    free(slot_of);
    return rc;
}
