// SPDX-License-Identifier: Apache-2.0
/* Host allocators as peers. mimalloc and jemalloc replace malloc once loaded, so each peer is
 * measured in a child: this program re-executed (/proc/self/exe) with LD_PRELOAD naming the
 * library (none for glibc), a hidden --peer-child flag naming the allocator and the job, and
 * fd 3 the write end of a pipe on which the child sends its rows back. The child checks that
 * malloc really comes from the library it was told about before measuring anything. */
#include "bench.h"

#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <gnu/libc-version.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

extern char **environ;

const char *const bench_peers[] = {"glibc", "mimalloc", "jemalloc"};
const int bench_npeers = 3;

static const char *const lib_file[] = {NULL, "libmimalloc.so.2", "libjemalloc.so.2"};
static const char *const lib_env[] = {NULL, "CUMA_BENCH_MIMALLOC", "CUMA_BENCH_JEMALLOC"};
static const char *const provider_stem[] = {"libc.so", "libmimalloc", "libjemalloc"};

#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
#define BENCH_SANITIZED 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer) || __has_feature(thread_sanitizer)
#define BENCH_SANITIZED 1
#endif
#endif
#ifndef BENCH_SANITIZED
#define BENCH_SANITIZED 0
#endif

#if defined(__x86_64__)
#define MULTIARCH "x86_64-linux-gnu"
#elif defined(__aarch64__)
#define MULTIARCH "aarch64-linux-gnu"
#else
#define MULTIARCH "unknown"
#endif

static char summary[4][200];

/* Appends src to the string in dst (cap bytes), cutting it to fit. */
static void append(char *dst, size_t cap, const char *src) {
    size_t n = strlen(dst);
    while (*src && n + 1 < cap) dst[n++] = *src++;
    dst[n] = 0;
}

static int peer_index(const char *peer) {
    for (int i = 0; i < bench_npeers; i++)
        if (!strcmp(peer, bench_peers[i])) return i;
    return -1;
}

const char *bench_malloc_provider(void) {
    void *(*volatile m)(size_t) = malloc;
    Dl_info di;
    if (!dladdr((void *)m, &di) || !di.dli_fname) return "?";
    const char *slash = strrchr(di.dli_fname, '/');
    return slash ? slash + 1 : di.dli_fname;
}

/* Fills out with the real path of dir/file if that file is readable. */
static bool try_dir(const char *dir, size_t dlen, const char *file, char *out) {
    char path[PATH_MAX];
    if (dlen + strlen(file) + 2 > sizeof path) return false;
    memcpy(path, dir, dlen);
    path[dlen] = '/';
    strcpy(path + dlen + 1, file);
    return !access(path, R_OK) && realpath(path, out);
}

/* The library's real path (out holds PATH_MAX bytes): $CUMA_BENCH_<NAME> if set, else the
 * first of libc's own directory and the usual library directories that holds it. */
static bool find_lib(int pi, char *out) {
    const char *env = getenv(lib_env[pi]);
    if (env && *env) return realpath(env, out) && !access(out, R_OK);
    static const char *const fixed[] = {("/usr/lib/" MULTIARCH), "/usr/lib64", "/usr/local/lib",
                                        "/usr/lib"};
    Dl_info di;
    if (dladdr((void *)fopen, &di) && di.dli_fname && strrchr(di.dli_fname, '/')) {
        const char *dir = di.dli_fname;
        size_t dlen = (size_t)(strrchr(dir, '/') - dir);
        if (try_dir(dir, dlen, lib_file[pi], out)) return true;
        char usr[PATH_MAX]; /* /lib/x -> /usr/lib/x on a system without merged /usr */
        if (!strncmp(dir, "/lib/", 5) && dlen + 5 < sizeof usr) {
            memcpy(usr, "/usr", 4);
            memcpy(usr + 4, dir, dlen);
            if (try_dir(usr, dlen + 4, lib_file[pi], out)) return true;
        }
    }
    for (size_t i = 0; i < sizeof fixed / sizeof fixed[0]; i++)
        if (try_dir(fixed[i], strlen(fixed[i]), lib_file[pi], out)) return true;
    return false;
}

/* Starts the child: its rows come back on *res (fd 3 in the child); with `stepped`, it takes
 * commands on *ctl (fd 4 in the child). Returns the child's pid, or -1. */
static int start_child(const bench_opts *o, int pi, const char *preload, const char *job,
                       bool stepped, int *res, int *ctl) {
    char runs[32], run_ms[32], events[32];
    snprintf(runs, sizeof runs, "%d", o->runs);
    snprintf(run_ms, sizeof run_ms, "%g", o->run_ms);
    snprintf(events, sizeof events, "%zu", o->max_events);
    char *argv[] = {"cuma-bench",
                    "--runs",
                    runs,
                    "--run-ms",
                    run_ms,
                    "--events",
                    events,
                    "--peer-fd",
                    "3",
                    "--peer-child",
                    (char *)bench_peers[pi],
                    (char *)job,
                    stepped ? "--peer-ctl" : NULL,
                    "4",
                    NULL};
    size_t ne = 0;
    while (environ[ne]) ne++;
    char **envp = calloc(ne + 2, sizeof *envp);
    char pre[PATH_MAX + 16];
    if (!envp) return -1;
    size_t k = 0;
    for (size_t i = 0; i < ne; i++)
        if (strncmp(environ[i], "LD_PRELOAD=", 11)) envp[k++] = environ[i];
    if (preload) {
        snprintf(pre, sizeof pre, "LD_PRELOAD=%s", preload);
        envp[k++] = pre;
    }
    int p[2], c[2] = {-1, -1};
    if (pipe(p)) {
        free(envp);
        return -1;
    }
    if (stepped && pipe(c)) {
        close(p[0]), close(p[1]), free(envp);
        return -1;
    }
    fflush(NULL);
    pid_t pid = fork();
    if (pid == 0) {
        /* Out of the way of fds 3 and 4 first, then into place. */
        int rw = fcntl(p[1], F_DUPFD, 10), cr = stepped ? fcntl(c[0], F_DUPFD, 10) : -1;
        if (rw < 0 || dup2(rw, 3) < 0) _exit(126);
        if (stepped && (cr < 0 || dup2(cr, 4) < 0)) _exit(126);
        execve("/proc/self/exe", argv, envp);
        _exit(127);
    }
    free(envp);
    close(p[1]);
    if (stepped) close(c[0]);
    if (pid < 0) {
        close(p[0]);
        if (stepped) close(c[1]);
        return -1;
    }
    *res = p[0];
    *ctl = stepped ? c[1] : -1;
    return (int)pid;
}

/* One line from a child: its "info" line, or a row. */
static void take_line(char *line, bench_row *got, int max, int *ngot, char *info, size_t infolen) {
    if (!strncmp(line, "info\t", 5))
        snprintf(info, infolen, "%.*s", (int)strcspn(line + 5, "\n"), line + 5);
    else if (*ngot < max && bench_row_parse(line, &got[*ngot]))
        (*ngot)++;
}

static int wait_child(int pid) {
    int status = 0;
    while (waitpid(pid, &status, 0) < 0 && errno == EINTR) {
    }
    return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
}

/* Runs the child to its end; its rows go to `got` (at most max) and its last "info" line to
 * `info`. Returns its exit status (128 + signal if killed), or -1 when it could not start. */
static int spawn(const bench_opts *o, int pi, const char *preload, const char *job, bench_row *got,
                 int max, int *ngot, char *info, size_t infolen) {
    int res, ctl;
    int pid = start_child(o, pi, preload, job, false, &res, &ctl);
    if (pid < 0) return -1;
    FILE *in = fdopen(res, "r");
    char line[1024];
    while (in && fgets(line, sizeof line, in)) take_line(line, got, max, ngot, info, infolen);
    if (in)
        fclose(in);
    else
        close(res);
    return wait_child(pid);
}

/* Why a peer cannot run (empty when it can), and its library. */
static void check_peer(int pi, char *why, size_t whylen, char *lib) {
    if (pi < 0)
        snprintf(why, whylen, "unknown peer");
    else if (BENCH_SANITIZED)
        snprintf(why, whylen, "skipped: the sanitizer's malloc replaces this one");
    else if (lib_file[pi] && !find_lib(pi, lib))
        snprintf(why, whylen, "not installed (%s not found; scripts/deps.sh bench)", lib_file[pi]);
}

/* Adds the rows a peer's job should give: those it sent, the others with a note saying why
 * not. vs_mim / vs_mim_2t go into the replay and scaling rows. */
static void add_rows(int pi, const char *peer, const char *trace_name, bench_row *got, int ngot,
                     const char *why, const char *lib, const char *info, double vs_mim,
                     double vs_mim_2t) {
    char name[64];
    bench_row want[16];
    int nwant = 0;
    if (!trace_name) {
        for (int s = 0; s < bench_nfast_sizes; s++) {
            bench_size_name(bench_fast_sizes[s], name, sizeof name);
            for (int t = 1; t <= 2; t++) want[nwant++] = bench_row_make("fast", name, peer, t);
        }
    } else {
        snprintf(name, sizeof name, "%s x1", trace_name);
        want[nwant++] = bench_row_make("replay", name, peer, 1);
        want[nwant++] = bench_row_make("latency", name, peer, 1);
        want[nwant++] = bench_row_make("scaling", name, peer, 2);
    }
    if (pi >= 0 && !summary[pi][0]) {
        const char *parts[4] = {peer, ": ", why, ""};
        if (!why[0])
            parts[0] = info, parts[1] = lib[0] ? " (" : "", parts[2] = lib,
            parts[3] = lib[0] ? ")" : "";
        for (int k = 0; k < 4; k++) append(summary[pi], sizeof summary[pi], parts[k]);
    }
    for (int w = 0; w < nwant; w++) {
        bool found = false;
        for (int g = 0; g < ngot && !found; g++) {
            if (strcmp(got[g].section, want[w].section) || strcmp(got[g].name, want[w].name) ||
                got[g].threads != want[w].threads)
                continue;
            if (!strcmp(got[g].section, "replay")) got[g].vs_mim = vs_mim;
            if (!strcmp(got[g].section, "scaling")) got[g].vs_mim = vs_mim_2t;
            bench_row_add(&got[g]);
            found = true;
        }
        if (found) continue;
        snprintf(want[w].note, sizeof want[w].note, "%s",
                 why[0] ? why : "no figure from the child");
        bench_row_add(&want[w]);
    }
}

void bench_peer_run(const bench_opts *o, const char *peer, const char *job,
                    const char *trace_name) {
    int pi = peer_index(peer);
    char why[96] = "", lib[PATH_MAX] = "", info[160] = "";
    bench_row got[16];
    int ngot = 0;
    check_peer(pi, why, sizeof why, lib);
    if (!why[0]) {
        int rc = spawn(o, pi, lib_file[pi] ? lib : NULL, job, got, 16, &ngot, info, sizeof info);
        if (rc < 0)
            snprintf(why, sizeof why, "could not start the child: %s", strerror(errno));
        else if (rc) {
            snprintf(why, sizeof why, "child failed (exit %d): ", rc);
            append(why, sizeof why, info);
        }
    }
    add_rows(pi, peer, trace_name, got, ngot, why, lib, info, NAN, NAN);
}

void bench_peer_start(const bench_opts *o, const char *peer, const char *job, bench_peer_proc *p) {
    memset(p, 0, sizeof *p);
    p->pi = peer_index(peer);
    p->pid = p->ctl = p->res = -1;
    check_peer(p->pi, p->why, sizeof p->why, p->lib);
    if (p->why[0]) return;
    p->pid = start_child(o, p->pi, lib_file[p->pi] ? p->lib : NULL, job, true, &p->res, &p->ctl);
    if (p->pid < 0) {
        snprintf(p->why, sizeof p->why, "could not start the child: %s", strerror(errno));
        return;
    }
    p->in = fdopen(p->res, "r");
    char line[1024];
    /* Until "ready": the child has loaded the trace and warmed up. */
    while (p->in && fgets(line, sizeof line, p->in)) {
        if (!strcmp(line, "ready\n")) return;
        if (!strncmp(line, "info\t", 5))
            snprintf(p->info, sizeof p->info, "%.*s", (int)strcspn(line + 5, "\n"), line + 5);
    }
    snprintf(p->why, sizeof p->why, "child failed before its runs: ");
    append(p->why, sizeof p->why, p->info);
}

bool bench_peer_step(bench_peer_proc *p, bench_replay_run *out) {
    if (p->why[0] || !p->in) return false;
    char line[256];
    if (write(p->ctl, "r", 1) != 1 || !fgets(line, sizeof line, p->in)) return false;
    return sscanf(line, "run\t%lf\t%lf\t%lf\t%lf", &out->v, &out->cpu, &out->v2, &out->cpu2) == 4;
}

void bench_peer_finish(bench_peer_proc *p, const char *trace_name, double vs_mim,
                       double vs_mim_2t) {
    bench_row got[16];
    int ngot = 0;
    const char *peer = p->pi >= 0 ? bench_peers[p->pi] : "?";
    if (p->pid >= 0) {
        if (p->ctl >= 0) {
            if (write(p->ctl, "q", 1) != 1) { /* the child is gone: EOF ends its loop too */
            }
            close(p->ctl);
        }
        char line[1024];
        while (p->in && fgets(line, sizeof line, p->in))
            take_line(line, got, 16, &ngot, p->info, sizeof p->info);
        if (p->in)
            fclose(p->in);
        else
            close(p->res);
        int rc = wait_child(p->pid);
        if (rc && !p->why[0]) {
            snprintf(p->why, sizeof p->why, "child failed (exit %d): ", rc);
            append(p->why, sizeof p->why, p->info);
        }
    }
    add_rows(p->pi, peer, trace_name, got, ngot, p->why, p->lib, p->info, vs_mim, vs_mim_2t);
}

const char *bench_peer_summary(void) {
    static char out[sizeof summary + 16];
    out[0] = 0;
    for (int i = 0; i < bench_npeers; i++) {
        if (!summary[i][0]) continue;
        if (out[0]) strcat(out, "; ");
        strcat(out, summary[i]);
    }
    return out;
}

/* ---- the child ---------------------------------------------------------------------------- */

static void describe(int pi, char *buf, size_t len) {
    if (pi == 1) {
        int (*ver)(void) = (int (*)(void))dlsym(RTLD_DEFAULT, "mi_version");
        int v = ver ? ver() : 0;
        snprintf(buf, len, "mimalloc %d.%d.%d", v / 100, v / 10 % 10, v % 10);
    } else if (pi == 2) {
        typedef int (*ctl_fn)(const char *, void *, size_t *, void *, size_t);
        ctl_fn ctl = (ctl_fn)dlsym(RTLD_DEFAULT, "mallctl");
        const char *v = NULL;
        size_t sz = sizeof v;
        if (!ctl || ctl("version", &v, &sz, NULL, 0)) v = "?";
        snprintf(buf, len, "jemalloc %.*s", (int)strcspn(v, "-"), v);
    } else {
        snprintf(buf, len, "glibc %s", gnu_get_libc_version());
    }
}

/* In step with the parent (bench_peer_start): a byte 'r' on ctl runs one step, anything else
 * (or the end of the pipe) ends the runs. */
static void stepped_replay(const bench_opts *o, const bench_target *t, const bench_ops *ops, int fd,
                           int ctl) {
    bench_replay_state *s = bench_replay_begin(o, t, ops, 1);
    dprintf(fd, "ready\n");
    char c;
    while (read(ctl, &c, 1) == 1 && c == 'r') {
        bench_replay_run r = bench_replay_step(s);
        dprintf(fd, "run\t%.9g\t%.9g\t%.9g\t%.9g\n", r.v, r.cpu, r.v2, r.cpu2);
    }
    bench_replay_end(s, NAN, NAN);
}

int bench_peer_child(const bench_opts *o, const char *peer, const char *job, int fd, int ctl) {
    int pi = peer_index(peer);
    if (pi < 0) {
        dprintf(fd, "info\tunknown peer %s\n", peer);
        return 2;
    }
    const char *prov = bench_malloc_provider();
    if (strncmp(prov, provider_stem[pi], strlen(provider_stem[pi]))) {
        dprintf(fd, "info\tmalloc comes from %s, not %s\n", prov, provider_stem[pi]);
        return 3;
    }
    char info[160];
    describe(pi, info, sizeof info);
    dprintf(fd, "info\t%s\n", info);
    bench_timer_init();
    bench_target t = {peer, NULL};
    if (!strcmp(job, "fast")) {
        bench_fast(o, &t);
    } else {
        bench_ops ops;
        if (bench_ops_load(job, o->max_events, &ops)) {
            dprintf(fd, "info\tcannot load %s\n", job);
            return 4;
        }
        if (ctl >= 0)
            stepped_replay(o, &t, &ops, fd, ctl);
        else
            bench_replay(o, &t, &ops, 1);
        bench_ops_free(&ops);
    }
    for (size_t i = 0; i < bench_row_count(); i++) bench_row_write(fd, bench_row_get(i));
    bench_threads_stop();
    bench_rows_free();
    return 0;
}
