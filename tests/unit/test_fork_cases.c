// SPDX-License-Identifier: Apache-2.0
/* fork() cases beyond test_fork's locks, each in a child under alarm():
 *
 *   backing    a simulated device with host backing shares its pages with the child: the
 *              child's heap refuses allocations, frees and trims (CUMA_ERR_UNSUPPORTED, saying
 *              why), and destroying it leaves the parent's live data as it was
 *   create     a fork while another thread creates a default heap: the child can make one
 *   oom        a fork while another thread is inside an OOM callback: the child's allocations
 *              still reach the callbacks
 *   trace      a heap with a trace log forks and the child exits normally: the parent's log
 *              holds exactly the parent's events, once
 */
#define _DEFAULT_SOURCE
#include "check.h"

#include <pthread.h>
#include <signal.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>
#include <zlib.h>

#define MB (1024ull * 1024ull)

/* Runs fn in a child with a 10 s alarm; the child's exit status must be 0. at_exit: the child
 * ends with exit(), running the atexit handlers (trace logs) as a real child does; otherwise with
 * _exit(), since a child that inherited objects of the parent's other threads (a heap half made)
 * cannot free them, and a leak checker at exit would report them. */
static void in_child(const char *what, void (*fn)(void *), void *arg, bool at_exit) {
    fflush(stdout);
    pid_t pid = fork();
    CHECK(pid >= 0);
    if (!pid) {
        alarm(10);
        fn(arg);
        if (at_exit) exit(0);
        _exit(0);
    }
    int ws;
    CHECK(waitpid(pid, &ws, 0) == pid);
    if (!WIFEXITED(ws) || WEXITSTATUS(ws)) {
        fprintf(stderr, "test_fork_cases %s: the child %s %d\n", what,
                WIFSIGNALED(ws) ? "died of signal" : "exited with",
                WIFSIGNALED(ws) ? WTERMSIG(ws) : WEXITSTATUS(ws));
        abort();
    }
    printf("test_fork_cases %s: ok\n", what);
}

/* ---- backing ------------------------------------------------------------------------------- */

static cuma_heap *shared_heap;
static char *parent_block;

static void backing_child(void *arg) {
    (void)arg;
    void *p;
    CHECK_ST(cuma_alloc(shared_heap, MB, 0, &p), CUMA_ERR_UNSUPPORTED);
    CHECK(strstr(cuma_last_error(), "came through fork"));
    CHECK_ST(cuma_free(shared_heap, parent_block, 0), CUMA_ERR_UNSUPPORTED);
    CHECK_ST(cuma_trim(shared_heap, 0), CUMA_ERR_UNSUPPORTED);
    cuma_heap_destroy(shared_heap); /* the child's copy: must not touch the shared pages */
}

static void case_backing(void) {
    shared_heap = heap_make("backend:sim,capacity:256M,host_backing:on,tcache:off");
    void *idle;
    CHECK_OK(cuma_alloc(shared_heap, 4 * MB, 0, (void **)&parent_block));
    CHECK_OK(cuma_alloc(shared_heap, 4 * MB, 0, &idle));
    memset(parent_block, 'P', 4 * MB);
    memset(idle, 'I', 4 * MB);
    CHECK_OK(cuma_free(shared_heap, idle, 0)); /* an idle page the child's copy could hand out */
    in_child("backing", backing_child, NULL, false);
    for (size_t i = 0; i < 4 * MB; i += 4096) CHECK(parent_block[i] == 'P');
    CHECK_OK(cuma_validate(shared_heap));
    CHECK_OK(cuma_free(shared_heap, parent_block, 0));
    cuma_heap_destroy(shared_heap);
}

/* ---- create -------------------------------------------------------------------------------- */

static void *make_default(void *arg) {
    cuma_heap *h;
    CHECK_OK(cuma_default_heap(0, &h));
    *(cuma_heap **)arg = h;
    return NULL;
}

static void create_child(void *arg) {
    (void)arg;
    cuma_heap *h;
    CHECK_OK(cuma_default_heap(1, &h)); /* hung on the inherited creation lock before */
    void *p;
    CHECK_OK(cuma_alloc(h, MB, 0, &p));
    CHECK_OK(cuma_free(h, p, 0));
}

static void case_create(void) {
    /* A slow creation: 100 preallocated pages at 1 ms a page call. */
    setenv("CUMA_CONF", "backend:sim,capacity:256M,sim_call_us:1000,preallocate:200M", 1);
    cuma_heap *h0 = NULL;
    pthread_t t;
    CHECK(!pthread_create(&t, NULL, make_default, &h0));
    usleep(30000);
    in_child("create", create_child, NULL, false);
    CHECK(!pthread_join(t, NULL) && h0);
    unsetenv("CUMA_CONF");
}

/* ---- oom ----------------------------------------------------------------------------------- */

static cuma_heap *oom_heap;
static pid_t oom_parent;
static int oom_calls;

static int slow_callback(void *user, cuma_heap *h, size_t size, cuma_stream s) {
    (void)user, (void)h, (void)size, (void)s;
    oom_calls++;
    if (getpid() == oom_parent) usleep(300000); /* the parent's thread stays inside */
    return CUMA_OOM_PASS;
}

static void *oom_thread(void *arg) {
    (void)arg;
    void *p;
    CHECK_ST(cuma_alloc(oom_heap, 100 * MB, 0, &p), CUMA_ERR_OOM);
    return NULL;
}

static void oom_child(void *arg) {
    (void)arg;
    oom_calls = 0;
    void *p;
    CHECK_ST(cuma_alloc(oom_heap, 100 * MB, 0, &p), CUMA_ERR_OOM);
    CHECK(oom_calls == 1);
}

static void case_oom(void) {
    oom_parent = getpid();
    oom_heap = heap_make("backend:sim,capacity:256M,tcache:off");
    CHECK_OK(cuma_add_oom_callback(oom_heap, slow_callback, NULL, NULL));
    void *held;
    CHECK_OK(cuma_alloc(oom_heap, 200 * MB, 0, &held)); /* 100M more does not fit */
    pthread_t t;
    CHECK(!pthread_create(&t, NULL, oom_thread, NULL));
    usleep(100000); /* the thread is in the callback now */
    in_child("oom", oom_child, NULL, false);
    CHECK(!pthread_join(t, NULL));
    CHECK_OK(cuma_free(oom_heap, held, 0));
    cuma_heap_destroy(oom_heap);
}

/* ---- trace --------------------------------------------------------------------------------- */

static void nothing(void *arg) {
    (void)arg;
}

static void case_trace(void) {
    char path[64], conf[128];
    snprintf(path, sizeof path, "/tmp/cuma-test-fork-%d.csv.gz", (int)getpid());
    snprintf(conf, sizeof conf, "backend:sim,capacity:256M,trace:%s", path);
    cuma_heap *h = heap_make(conf);
    void *p;
    for (int i = 0; i < 100; i++) {
        CHECK_OK(cuma_alloc(h, 4096, 0, &p));
        CHECK_OK(cuma_free(h, p, 0));
    }
    in_child("trace", nothing, NULL, true); /* its atexit closes what it inherited */
    for (int i = 0; i < 100; i++) {
        CHECK_OK(cuma_alloc(h, 4096, 0, &p));
        CHECK_OK(cuma_free(h, p, 0));
    }
    cuma_heap_destroy(h);
    gzFile gz = gzopen(path, "rb");
    CHECK(gz);
    char line[256];
    int lines = 0, headers = 0;
    while (gzgets(gz, line, sizeof line)) {
        lines++;
        headers += !strncmp(line, "Thread,", 7);
    }
    gzclose(gz);
    unlink(path);
    printf("test_fork_cases trace: %d lines, %d header(s)\n", lines, headers);
    CHECK(lines == 401 && headers == 1);
}

/* usage: test_fork_cases [CASE...]  (all four without arguments) */
int main(int argc, char **argv) {
    static const struct {
        const char *name;
        void (*run)(void);
    } cases[] = {{"backing", case_backing},
                 {"create", case_create},
                 {"oom", case_oom},
                 {"trace", case_trace}};
    unsetenv("CUMA_CONF");
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        bool wanted = argc < 2;
        for (int a = 1; a < argc; a++) wanted |= !strcmp(argv[a], cases[i].name);
        if (wanted) cases[i].run();
    }
    puts("test_fork_cases: ok");
    return 0;
}
