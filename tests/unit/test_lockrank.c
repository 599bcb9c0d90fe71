// SPDX-License-Identifier: Apache-2.0
/* The lock-rank checker (util/lockrank.h): a thread that takes two of cuma's mutexes against
 * their ranks aborts, naming both; the order of docs/DESIGN.md passes. The checker is compiled
 * in here whatever the build type (the library's own calls have it only without NDEBUG). */
#undef CUMA_LOCK_CHECK
#define CUMA_LOCK_CHECK 1
#include "check.h"
#include "util/lockrank.h"

#include <pthread.h>
#include <signal.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

static pthread_mutex_t oom = PTHREAD_MUTEX_INITIALIZER;
static pthread_mutex_t managed = PTHREAD_MUTEX_INITIALIZER;
static pthread_mutex_t arena0 = PTHREAD_MUTEX_INITIALIZER;
static pthread_mutex_t arena1 = PTHREAD_MUTEX_INITIALIZER;
/* Error-checking: without the checker, taking it twice fails instead of hanging the test. */
static pthread_mutex_t arena2 = PTHREAD_ERRORCHECK_MUTEX_INITIALIZER_NP;
static pthread_mutex_t create = PTHREAD_MUTEX_INITIALIZER;
static pthread_mutex_t owned = PTHREAD_MUTEX_INITIALIZER;

/* Runs fn in a child process; its wait status, and what it wrote to stderr into err. */
static int in_child(void (*fn)(void), char *err, size_t len) {
    int fds[2];
    CHECK(pipe(fds) == 0);
    pid_t pid = fork();
    CHECK(pid >= 0);
    if (pid == 0) {
        close(fds[0]);
        dup2(fds[1], 2);
        fn();
        _exit(0);
    }
    close(fds[1]);
    size_t n = 0;
    ssize_t r;
    while (n + 1 < len && (r = read(fds[0], err + n, len - 1 - n)) > 0) n += (size_t)r;
    err[n] = 0;
    close(fds[0]);
    int status;
    CHECK(waitpid(pid, &status, 0) == pid);
    return status;
}

static bool aborted(int status) {
    return WIFSIGNALED(status) && WTERMSIG(status) == SIGABRT;
}

static void wrong_order(void) {
    cuma_mutex_lock(&managed, CUMA_RANK_MANAGED);
    cuma_mutex_lock(&oom, CUMA_RANK_OOM); /* oom_lock ranks below managed_lock */
}

/* A try cannot wait, so it may take a lower rank; a blocking take under it is checked. */
static void under_a_try(void) {
    cuma_mutex_lock(&managed, CUMA_RANK_MANAGED);
    CHECK(cuma_mutex_trylock(&arena0, CUMA_RANK_ARENA) == 0);
    cuma_mutex_unlock(&managed);
    cuma_mutex_lock(&oom, CUMA_RANK_OOM); /* arena0 is held: fine */
    cuma_mutex_unlock(&oom);
    cuma_mutex_lock(&arena1, CUMA_RANK_ARENA); /* arenas together: fine */
    cuma_mutex_unlock(&arena1);
    cuma_mutex_lock(&managed, CUMA_RANK_MANAGED);
    cuma_mutex_lock(&arena1, CUMA_RANK_ARENA); /* under managed_lock: not fine */
}

static void same_arena_twice(void) {
    cuma_mutex_lock(&arena2, CUMA_RANK_ARENA);
    cuma_mutex_lock(&arena2, CUMA_RANK_ARENA); /* would wait for itself for good */
}

/* The shim's locks are ranked with the heaps': the default heaps' creation lock comes before
 * every lock of a heap (a creation takes them), so it is not taken under one. */
static void create_under_arena(void) {
    cuma_mutex_lock(&arena0, CUMA_RANK_ARENA);
    cuma_mutex_lock(&create, CUMA_RANK_DEFAULT_CREATE);
}

static void in_order(void) {
    /* A default heap's creation, whose backend calls the preload shim's table last. */
    cuma_mutex_lock(&create, CUMA_RANK_DEFAULT_CREATE);
    cuma_mutex_lock(&arena0, CUMA_RANK_ARENA);
    cuma_mutex_lock(&owned, CUMA_RANK_PRELOAD_OWNED);
    cuma_mutex_unlock(&owned);
    cuma_mutex_unlock(&arena0);
    cuma_mutex_unlock(&create);
    cuma_mutex_lock(&arena0, CUMA_RANK_ARENA);
    cuma_mutex_lock(&arena1, CUMA_RANK_ARENA);
    cuma_mutex_lock(&oom, CUMA_RANK_OOM);
    cuma_mutex_lock(&managed, CUMA_RANK_MANAGED);
    /* Given back out of order, then taken again. */
    cuma_mutex_unlock(&oom);
    cuma_mutex_unlock(&arena0);
    cuma_mutex_unlock(&managed);
    cuma_mutex_lock(&oom, CUMA_RANK_OOM);
    cuma_mutex_unlock(&oom);
    cuma_mutex_unlock(&arena1);
    /* Suspended (fork.c's handlers): nothing is checked or recorded. */
    cuma_rank_suspend(true);
    cuma_mutex_lock(&managed, CUMA_RANK_MANAGED);
    cuma_mutex_lock(&oom, CUMA_RANK_OOM);
    cuma_mutex_unlock(&oom);
    cuma_mutex_unlock(&managed);
    cuma_rank_suspend(false);
    cuma_mutex_lock(&managed, CUMA_RANK_MANAGED);
    cuma_mutex_unlock(&managed);
}

int main(void) {
    char err[1024];
    int st = in_child(wrong_order, err, sizeof err);
    CHECK(aborted(st));
    CHECK(strstr(err, "taking oom_lock") && strstr(err, "holding managed_lock"));
    st = in_child(under_a_try, err, sizeof err);
    CHECK(aborted(st));
    CHECK(strstr(err, "taking an arena's lock") && strstr(err, "holding managed_lock"));
    st = in_child(same_arena_twice, err, sizeof err);
    CHECK(aborted(st));
    CHECK(strstr(err, "taking an arena's lock") && strstr(err, "holding an arena's lock"));
    st = in_child(create_under_arena, err, sizeof err);
    CHECK(aborted(st));
    CHECK(strstr(err, "taking the default heaps' create_lock") &&
          strstr(err, "holding an arena's lock"));
    st = in_child(in_order, err, sizeof err);
    CHECK(WIFEXITED(st) && WEXITSTATUS(st) == 0 && !err[0]);
    printf("test_lockrank: ok\n");
    return 0;
}
