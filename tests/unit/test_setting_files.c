// SPDX-License-Identifier: Apache-2.0
/* The files that settings name (`trace:FILE`, `oom_dump:FILE`), often under a shared /tmp: what
 * another user planted at the name is never followed, opened or overwritten. A symbolic link
 * at the name (the file it points to stays as it was), a FIFO (nothing hangs: every case runs
 * under alarm), a device, another user's file: refused, the heap works on without the log, and
 * the stats and stderr say why. oom_dump's temporary file has an unguessable name (symlinks and
 * FIFOs planted at the old predictable PATH.tmpPID.SEQ names are never touched). New files are
 * 0600. A fork while a log is being opened does not wait for the open. Error messages quote
 * control bytes escaped (\x1b), never raw.
 *
 * Files are planted by a child running as uid 65534 where the test runs as root (as CI does);
 * as another user the "another user's file" cases are skipped, said on stdout. */
#include "check.h"
#include "cuma/cuma.h"
#include "trace/trace.h"

#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <signal.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/sysmacros.h>
#include <sys/wait.h>
#include <unistd.h>

#define MB     (1024ull * 1024)
#define NOBODY 65534

/* Set by the trace writer before each open (trace/writer.h); weak so that the FIFO cases of
 * this file also build against a writer without it. */
extern void (*cuma_trace_writer_open_hook)(const char *path) __attribute__((weak));

static char dir[64];
static const char secret[] = "the victim's own data\n";

static void write_file(const char *path, const char *text, mode_t mode) {
    int fd = open(path, O_WRONLY | O_CREAT | O_TRUNC, mode);
    CHECK(fd >= 0);
    CHECK(write(fd, text, strlen(text)) == (ssize_t)strlen(text));
    CHECK(fchmod(fd, mode) == 0);
    close(fd);
}

static bool file_is(const char *path, const char *text) {
    char buf[256] = "";
    int fd = open(path, O_RDONLY);
    if (fd < 0) return false;
    ssize_t n = read(fd, buf, sizeof buf - 1);
    close(fd);
    return n == (ssize_t)strlen(text) && !memcmp(buf, text, (size_t)n);
}

/* Runs fn(arg) in a child as uid/gid 65534 (another user); false when the test is not root. */
static bool as_other_user(void (*fn)(const char *), const char *arg) {
    if (geteuid() != 0) return false;
    pid_t pid = fork();
    CHECK(pid >= 0);
    if (!pid) {
        if (setresgid(NOBODY, NOBODY, NOBODY) || setresuid(NOBODY, NOBODY, NOBODY)) _exit(3);
        fn(arg);
        _exit(0);
    }
    int status;
    CHECK(waitpid(pid, &status, 0) == pid && WIFEXITED(status) && WEXITSTATUS(status) == 0);
    return true;
}

static char plant_target[256];
static void plant_symlink(const char *at) {
    if (symlink(plant_target, at) != 0) _exit(4);
}
static void plant_file(const char *at) {
    int fd = open(at, O_WRONLY | O_CREAT | O_EXCL, 0666);
    if (fd < 0 || fchmod(fd, 0666) != 0) _exit(5);
    close(fd);
}

/* stderr into a file for the length of a call, and the text read back. */
static int saved_err = -1;
static char err_path[128];
static void capture_start(void) {
    snprintf(err_path, sizeof err_path, "%s/stderr.txt", dir);
    fflush(stderr);
    saved_err = dup(2);
    int fd = open(err_path, O_WRONLY | O_CREAT | O_TRUNC, 0600);
    CHECK(fd >= 0 && saved_err >= 0 && dup2(fd, 2) == 2);
    close(fd);
}
static char *capture_end(void) {
    static char text[4096];
    fflush(stderr);
    CHECK(dup2(saved_err, 2) == 2);
    close(saved_err);
    int fd = open(err_path, O_RDONLY);
    CHECK(fd >= 0);
    ssize_t n = read(fd, text, sizeof text - 1);
    close(fd);
    text[n > 0 ? n : 0] = 0;
    unlink(err_path);
    fputs(text, stderr); /* still shown */
    return text;
}

static char *stats_of(cuma_heap *h) {
    static char buf[16384];
    CHECK_OK(cuma_stats_json(h, buf, sizeof buf, NULL));
    return buf;
}

/* A heap logging to path that must refuse it: made (under alarm, so that a FIFO cannot hang the
 * test), working, and saying `reason` on stderr and in its stats. */
static void trace_refused(const char *path, const char *reason, const char *victim) {
    char conf[512];
    snprintf(conf, sizeof conf, "backend:sim,capacity:64M,trace:%s", path);
    capture_start();
    alarm(20);
    cuma_config cfg = {.conf = conf, .flags = CUMA_CONFIG_NO_ENV};
    cuma_heap *h = NULL;
    cuma_status st = cuma_heap_create(&cfg, &h);
    alarm(0);
    char *err = capture_end();
    CHECK_OK(st);
    if (victim) CHECK(file_is(victim, secret)); /* the file a planted link points to */
    CHECK(strstr(err, reason) && strstr(err, "the heap runs without the log"));
    char *js = stats_of(h);
    CHECK(strstr(js, "\"trace_error\":") && strstr(js, reason));
    void *p;
    CHECK_OK(cuma_alloc(h, MB, NULL, &p));
    CHECK_OK(cuma_free(h, p, NULL));
    cuma_heap_destroy(h);
}

static void test_trace_symlink(void) {
    char victim[128], at[128];
    snprintf(victim, sizeof victim, "%s/victim", dir);
    snprintf(at, sizeof at, "%s/run.csv", dir);
    write_file(victim, secret, 0600);
    snprintf(plant_target, sizeof plant_target, "%s", victim);
    if (!as_other_user(plant_symlink, at)) CHECK(symlink(victim, at) == 0);
    trace_refused(at, "symbolic link", victim);
    CHECK(file_is(victim, secret));
    unlink(at), unlink(victim);
}

static void test_trace_fifo_and_device(void) {
    char at[128];
    snprintf(at, sizeof at, "%s/fifo.csv", dir);
    CHECK(mkfifo(at, 0666) == 0);
    trace_refused(at, "FIFO", NULL);
    unlink(at);
    trace_refused("/dev/null", "a device", NULL);
    snprintf(at, sizeof at, "%s/null.csv", dir);
    if (mknod(at, S_IFCHR | 0666, makedev(1, 3)) == 0) {
        trace_refused(at, "a device", NULL);
        unlink(at);
    } else {
        printf("test_setting_files: mknod not permitted (%s): /dev/null alone checked\n",
               strerror(errno));
    }
}

static void test_trace_other_users_file(void) {
    char at[128];
    snprintf(at, sizeof at, "%s/theirs.csv", dir);
    if (!as_other_user(plant_file, at)) {
        printf("test_setting_files: not root: another user's trace file not checked\n");
        return;
    }
    trace_refused(at, "belongs to uid 65534", NULL);
    struct stat st;
    CHECK(stat(at, &st) == 0 && st.st_size == 0); /* not written */
    unlink(at);
}

static void test_trace_mode(void) {
    char at[128], conf[256];
    snprintf(at, sizeof at, "%s/mine.csv.gz", dir);
    snprintf(conf, sizeof conf, "backend:sim,capacity:64M,trace:%s", at);
    mode_t old = umask(022);
    cuma_heap *h = heap_make(conf);
    umask(old);
    struct stat st;
    CHECK(stat(at, &st) == 0 && (st.st_mode & 0777) == 0600);
    CHECK(!strstr(stats_of(h), "trace_error"));
    cuma_heap_destroy(h);
    unlink(at);
}

/* ---- a fork while a log is being opened ---------------------------------------------------- */

static pthread_mutex_t hook_mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t hook_cv = PTHREAD_COND_INITIALIZER;
static int hook_state; /* 1: the open is held in the hook; 2: let it go */
static int hook_calls;

/* Holds the first open until told; a later one (the file opened afresh) goes through. */
static void hold_open(const char *path) {
    (void)path;
    pthread_mutex_lock(&hook_mu);
    if (hook_calls++) {
        pthread_mutex_unlock(&hook_mu);
        return;
    }
    hook_state = 1;
    pthread_cond_broadcast(&hook_cv);
    while (hook_state != 2) pthread_cond_wait(&hook_cv, &hook_mu);
    pthread_mutex_unlock(&hook_mu);
}

static void *make_logging_heap(void *arg) {
    char conf[256];
    snprintf(conf, sizeof conf, "backend:sim,capacity:64M,trace:%s", (const char *)arg);
    cuma_config cfg = {.conf = conf, .flags = CUMA_CONFIG_NO_ENV};
    cuma_heap *h = NULL;
    cuma_heap_create(&cfg, &h); /* the FIFO case: refused, or (before) blocked */
    return h;
}

/* Forks (a child that exits at once) within 20 s, or the alarm ends the test. */
static void fork_now(void) {
    alarm(20);
    pid_t pid = fork();
    CHECK(pid >= 0);
    if (!pid) _exit(0);
    int status;
    CHECK(waitpid(pid, &status, 0) == pid && WIFEXITED(status));
    alarm(0);
}

static void test_fork_during_open(void) {
    /* A FIFO with no reader: an open that blocks for good, unless it is refused first. A heap of
     * another thread logs to it; the fork must not wait for that open. */
    char at[128];
    snprintf(at, sizeof at, "%s/blocking.csv", dir);
    CHECK(mkfifo(at, 0666) == 0);
    pthread_t t;
    CHECK(pthread_create(&t, NULL, make_logging_heap, at) == 0);
    usleep(100 * 1000); /* let it reach the open (a later start would only make the test pass) */
    fork_now();
    alarm(20);
    void *h;
    CHECK(pthread_join(t, &h) == 0);
    alarm(0);
    cuma_heap_destroy(h);
    unlink(at);

    /* An open held for as long as the test wants (the writer's hook): fork meanwhile, then let
     * the open finish; the log works in the parent. */
    CHECK(&cuma_trace_writer_open_hook != NULL);
    snprintf(at, sizeof at, "%s/held.csv", dir);
    cuma_trace_writer_open_hook = hold_open;
    CHECK(pthread_create(&t, NULL, make_logging_heap, at) == 0);
    pthread_mutex_lock(&hook_mu);
    while (hook_state != 1) pthread_cond_wait(&hook_cv, &hook_mu);
    pthread_mutex_unlock(&hook_mu);
    fork_now(); /* the thread is inside the open (the hook) */
    pthread_mutex_lock(&hook_mu);
    hook_state = 2;
    pthread_cond_broadcast(&hook_cv);
    pthread_mutex_unlock(&hook_mu);
    CHECK(pthread_join(t, &h) == 0 && h);
    cuma_trace_writer_open_hook = NULL;
    /* The fork came after the first open: that descriptor was the child's too (it would have
     * shared the log's flock), so the file was opened again. */
    CHECK(hook_calls == 2);
    void *p;
    CHECK_OK(cuma_alloc(h, MB, NULL, &p));
    CHECK_OK(cuma_free(h, p, NULL));
    CHECK(!strstr(stats_of(h), "trace_error"));
    cuma_heap_destroy(h);
    cuma_trace t2;
    CHECK_OK(cuma_trace_load(at, &t2));
    CHECK(t2.n == 2);
    cuma_trace_free(&t2);
    unlink(at);
}

/* ---- oom_dump -------------------------------------------------------------------------------- */

/* A heap with oom_dump:path fails an allocation (under alarm); returns its stderr. */
static char *dump_once(const char *path) {
    char conf[512];
    snprintf(conf, sizeof conf, "backend:sim,capacity:16M,tcache:off,oom_dump:%s", path);
    cuma_heap *h = heap_make(conf);
    void *a, *b;
    CHECK_OK(cuma_alloc(h, 12 * MB, NULL, &a));
    capture_start();
    alarm(20);
    CHECK_ST(cuma_alloc(h, 8 * MB, NULL, &b), CUMA_ERR_OOM);
    alarm(0);
    char *err = capture_end();
    CHECK(strstr(cuma_last_error(), "out of memory")); /* the failure's message, kept */
    CHECK_OK(cuma_free(h, a, NULL));
    cuma_heap_destroy(h);
    return err;
}

static bool is_dump(const char *path) {
    char buf[64] = "";
    int fd = open(path, O_RDONLY | O_NOFOLLOW);
    if (fd < 0) return false;
    ssize_t n = read(fd, buf, sizeof buf - 1);
    close(fd);
    return n > 8 && !strncmp(buf, "{\"pid\":", 7);
}

static void test_oom_dump_predictable_names(void) {
    /* Before: the temporary file was PATH.tmpPID.SEQ, SEQ counting from 0 in the process. */
    char victim[128], at[128], tmp[200];
    snprintf(victim, sizeof victim, "%s/victim", dir);
    snprintf(at, sizeof at, "%s/oom.json", dir);
    write_file(victim, secret, 0600);
    snprintf(plant_target, sizeof plant_target, "%s", victim);
    for (unsigned seq = 0; seq < 64; seq++) {
        snprintf(tmp, sizeof tmp, "%s.tmp%ld.%u", at, (long)getpid(), seq);
        if (!as_other_user(plant_symlink, tmp)) CHECK(symlink(victim, tmp) == 0);
    }
    char *err = dump_once(at);
    CHECK(file_is(victim, secret));
    CHECK(is_dump(at) && strstr(err, "what holds the memory is in"));
    struct stat st;
    CHECK(stat(at, &st) == 0 && (st.st_mode & 0777) == 0600);
    for (unsigned seq = 0; seq < 64; seq++) {
        snprintf(tmp, sizeof tmp, "%s.tmp%ld.%u", at, (long)getpid(), seq);
        CHECK(lstat(tmp, &st) == 0 && S_ISLNK(st.st_mode)); /* never touched */
        unlink(tmp);
    }
    unlink(at);

    /* FIFOs at those names: nothing blocks on one. */
    for (unsigned seq = 0; seq < 64; seq++) {
        snprintf(tmp, sizeof tmp, "%s.tmp%ld.%u", at, (long)getpid(), seq);
        CHECK(mkfifo(tmp, 0666) == 0);
    }
    dump_once(at);
    CHECK(is_dump(at));
    for (unsigned seq = 0; seq < 64; seq++) {
        snprintf(tmp, sizeof tmp, "%s.tmp%ld.%u", at, (long)getpid(), seq);
        unlink(tmp);
    }
    unlink(at), unlink(victim);
}

static void test_oom_dump_refused_targets(void) {
    char victim[128], at[128];
    snprintf(victim, sizeof victim, "%s/victim", dir);
    snprintf(at, sizeof at, "%s/oom.json", dir);
    write_file(victim, secret, 0600);
    snprintf(plant_target, sizeof plant_target, "%s", victim);
    if (!as_other_user(plant_symlink, at)) CHECK(symlink(victim, at) == 0);
    char *err = dump_once(at);
    CHECK(strstr(err, "symbolic link") && strstr(err, "could not write"));
    struct stat st;
    CHECK(lstat(at, &st) == 0 && S_ISLNK(st.st_mode)); /* left as it was, not replaced */
    CHECK(file_is(victim, secret));
    unlink(at), unlink(victim);

    CHECK(mkfifo(at, 0666) == 0);
    err = dump_once(at);
    CHECK(strstr(err, "FIFO") && lstat(at, &st) == 0 && S_ISFIFO(st.st_mode));
    unlink(at);

    if (mknod(at, S_IFCHR | 0666, makedev(1, 3)) == 0) {
        err = dump_once(at);
        CHECK(strstr(err, "a device") && lstat(at, &st) == 0 && S_ISCHR(st.st_mode));
        unlink(at);
    }

    if (as_other_user(plant_file, at)) {
        err = dump_once(at);
        CHECK(strstr(err, "belongs to uid 65534") && stat(at, &st) == 0 && st.st_size == 0);
        unlink(at);
    }

    /* The user's own file keeps the mode the user gave it. */
    write_file(at, "old\n", 0644);
    dump_once(at);
    CHECK(is_dump(at) && stat(at, &st) == 0 && (st.st_mode & 0777) == 0644);
    unlink(at);
}

/* ---- control bytes in messages --------------------------------------------------------------- */

static void test_messages_escaped(void) {
    cuma_config cfg = {.conf = "policy:\x1b]0;owned\x07\x1b[2J", .flags = CUMA_CONFIG_NO_ENV};
    cuma_heap *h = NULL;
    CHECK_ST(cuma_heap_create(&cfg, &h), CUMA_ERR_CONFIG);
    const char *m = cuma_last_error();
    CHECK(!strchr(m, '\x1b') && !strchr(m, '\x07'));
    CHECK(strstr(m, "\\x1b]0;owned\\x07\\x1b[2J"));
    cfg.conf = "\x1b[31mred:1";
    CHECK_ST(cuma_heap_create(&cfg, &h), CUMA_ERR_CONFIG);
    CHECK(!strchr(cuma_last_error(), '\x1b') && strstr(cuma_last_error(), "\\x1b[31mred"));
    /* A refused trace file whose name holds control bytes: escaped on stderr and in the stats. */
    char at[128];
    snprintf(at, sizeof at, "%s/\x1b[2Jfifo", dir);
    CHECK(mkfifo(at, 0666) == 0);
    char conf[256];
    snprintf(conf, sizeof conf, "backend:sim,capacity:64M,trace:%s", at);
    capture_start();
    h = heap_make(conf);
    char *err = capture_end();
    CHECK(!strchr(err, '\x1b') && strstr(err, "\\x1b[2Jfifo"));
    CHECK(!strchr(stats_of(h), '\x1b'));
    cuma_heap_destroy(h);
    unlink(at);
}

static const struct {
    const char *name;
    void (*fn)(void);
} cases[] = {
    {"trace_symlink", test_trace_symlink},
    {"trace_fifo_and_device", test_trace_fifo_and_device},
    {"trace_other_users_file", test_trace_other_users_file},
    {"trace_mode", test_trace_mode},
    {"oom_dump_predictable_names", test_oom_dump_predictable_names},
    {"oom_dump_refused_targets", test_oom_dump_refused_targets},
    {"messages_escaped", test_messages_escaped},
    {"fork_during_open", test_fork_during_open},
};

/* test_setting_files [CASE]: every case, or the one named. */
int main(int argc, char **argv) {
    snprintf(dir, sizeof dir, "/tmp/cuma-files-XXXXXX");
    CHECK(mkdtemp(dir));
    CHECK(chmod(dir, 01777) == 0); /* shared and sticky, as /tmp is */
    bool ran = false;
    for (size_t i = 0; i < sizeof cases / sizeof *cases; i++)
        if (argc < 2 || !strcmp(argv[1], cases[i].name)) cases[i].fn(), ran = true;
    CHECK(ran);
    CHECK(rmdir(dir) == 0);
    printf("test_setting_files: ok\n");
    return 0;
}
