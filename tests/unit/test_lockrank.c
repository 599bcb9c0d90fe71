// SPDX-License-Identifier: Apache-2.0
/* The lock-rank checker (util/lockrank.h): a thread that takes two of cuma's mutexes against
 * their ranks aborts, naming both; the order of docs/DESIGN.md passes. The checker is compiled
 * in here whatever the build type (the library's own calls have it only without NDEBUG). */
#undef CUMA_LOCK_CHECK
#define CUMA_LOCK_CHECK 1
#include "child.h"
#include "util/lockrank.h"

#include <pthread.h>
#include <string.h>

static pthread_mutex_t oom = PTHREAD_MUTEX_INITIALIZER;
static pthread_mutex_t managed = PTHREAD_MUTEX_INITIALIZER;
static pthread_mutex_t arena0 = PTHREAD_MUTEX_INITIALIZER;
static pthread_mutex_t arena1 = PTHREAD_MUTEX_INITIALIZER;
/* Error-checking: without the checker, taking it twice fails instead of hanging the test. */
static pthread_mutex_t arena2 = PTHREAD_ERRORCHECK_MUTEX_INITIALIZER_NP;
static pthread_mutex_t create = PTHREAD_MUTEX_INITIALIZER;
static pthread_mutex_t owned = PTHREAD_MUTEX_INITIALIZER;

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
    int st = child_run(wrong_order, err, sizeof err);
    CHECK(child_aborted(st));
    CHECK(strstr(err, "taking oom_lock") && strstr(err, "holding managed_lock"));
    st = child_run(under_a_try, err, sizeof err);
    CHECK(child_aborted(st));
    CHECK(strstr(err, "taking an arena's lock") && strstr(err, "holding managed_lock"));
    st = child_run(same_arena_twice, err, sizeof err);
    CHECK(child_aborted(st));
    CHECK(strstr(err, "taking an arena's lock") && strstr(err, "holding an arena's lock"));
    st = child_run(create_under_arena, err, sizeof err);
    CHECK(child_aborted(st));
    CHECK(strstr(err, "taking the default heaps' create_lock") &&
          strstr(err, "holding an arena's lock"));
    st = child_run(in_order, err, sizeof err);
    CHECK(WIFEXITED(st) && WEXITSTATUS(st) == 0 && !err[0]);
    printf("test_lockrank: ok\n");
    return 0;
}
