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
    static const char *const fixed[] = {"/usr/lib/" MULTIARCH, "/usr/lib64", "/usr/local/lib",
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

/* Runs the child; its rows go to `got` (at most max) and its last "info" line to `info`.
 * Returns its exit status (128 + signal if killed), or -1 when it could not be started. */
static int spawn(const bench_opts *o, int pi, const char *preload, const char *job, bench_row *got,
                 int max, int *ngot, char *info, size_t infolen) {
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
    int p[2];
    if (pipe(p)) {
        free(envp);
        return -1;
    }
    fflush(NULL);
    pid_t pid = fork();
    if (pid == 0) {
        close(p[0]);
        if (p[1] == 3)
            fcntl(3, F_SETFD, 0);
        else if (dup2(p[1], 3) < 0)
            _exit(126);
        execve("/proc/self/exe", argv, envp);
        _exit(127);
    }
    free(envp);
    close(p[1]);
    if (pid < 0) {
        close(p[0]);
        return -1;
    }
    size_t cap = 4096, n = 0;
    char *buf = malloc(cap);
    for (;;) {
        if (buf && n + 1024 > cap) {
            char *nb = realloc(buf, cap *= 2);
            if (!nb) free(buf);
            buf = nb;
        }
        if (!buf) break;
        ssize_t r = read(p[0], buf + n, cap - n - 1);
        if (r < 0 && errno == EINTR) continue;
        if (r <= 0) break;
        n += (size_t)r;
    }
    close(p[0]);
    int status = 0;
    while (waitpid(pid, &status, 0) < 0 && errno == EINTR) {
    }
    for (char *line = buf, *next; buf && line < buf + n; line = next) {
        buf[n] = 0;
        next = strchr(line, '\n');
        next = next ? next + 1 : buf + n;
        if (!strncmp(line, "info\t", 5)) {
            snprintf(info, infolen, "%.*s", (int)strcspn(line + 5, "\n"), line + 5);
        } else if (*ngot < max && bench_row_parse(line, &got[*ngot])) {
            (*ngot)++;
        }
    }
    free(buf);
    return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
}

void bench_peer_run(const bench_opts *o, const char *peer, const char *job,
                    const char *trace_name) {
    int pi = peer_index(peer);
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
    char why[96] = "", lib[PATH_MAX] = "", info[160] = "";
    bench_row got[16];
    int ngot = 0;
    if (pi < 0) {
        snprintf(why, sizeof why, "unknown peer");
    } else if (BENCH_SANITIZED) {
        snprintf(why, sizeof why, "skipped: the sanitizer's malloc replaces this one");
    } else if (lib_file[pi] && !find_lib(pi, lib)) {
        snprintf(why, sizeof why, "not installed (%s not found; scripts/deps.sh bench)",
                 lib_file[pi]);
    } else {
        int rc = spawn(o, pi, lib_file[pi] ? lib : NULL, job, got, 16, &ngot, info, sizeof info);
        if (rc < 0)
            snprintf(why, sizeof why, "could not start the child: %s", strerror(errno));
        else if (rc) {
            snprintf(why, sizeof why, "child failed (exit %d): ", rc);
            append(why, sizeof why, info);
        }
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
            bench_row_add(&got[g]);
            found = true;
        }
        if (found) continue;
        snprintf(want[w].note, sizeof want[w].note, "%s",
                 why[0] ? why : "no figure from the child");
        bench_row_add(&want[w]);
    }
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

int bench_peer_child(const bench_opts *o, const char *peer, const char *job, int fd) {
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
        bench_replay(o, &t, &ops, 1);
        bench_ops_free(&ops);
    }
    for (size_t i = 0; i < bench_row_count(); i++) bench_row_write(fd, bench_row_get(i));
    bench_threads_stop();
    bench_rows_free();
    return 0;
}
