// SPDX-License-Identifier: Apache-2.0
/* Child processes of tests: a fork with a pipe from the child to the parent, and a function run
 * in a child whose stderr the parent reads (what an abort said). */
#ifndef CUMA_TESTS_CHILD_H
#define CUMA_TESTS_CHILD_H

#include "check.h"

#include <signal.h>
#include <stdbool.h>
#include <stddef.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>

/* fork() with a pipe from the child to the parent: 0 in the child, where *fd is the pipe's write
 * end; the child's pid in the parent, where *fd is its read end. The test fails if either call
 * does. */
static inline pid_t child_fork(int *fd) {
    int fds[2];
    CHECK(pipe(fds) == 0);
    pid_t pid = fork();
    CHECK(pid >= 0);
    close(fds[pid == 0 ? 0 : 1]);
    *fd = fds[pid == 0 ? 1 : 0];
    return pid;
}

/* Runs fn in a child process whose stderr goes into a pipe: its wait status, and what it wrote
 * to stderr in err (at most len - 1 bytes, NUL-terminated). */
static inline int child_run(void (*fn)(void), char *err, size_t len) {
    int fd;
    pid_t pid = child_fork(&fd);
    if (pid == 0) {
        dup2(fd, 2);
        fn();
        _exit(0);
    }
    size_t n = 0;
    ssize_t r;
    while (n + 1 < len && (r = read(fd, err + n, len - 1 - n)) > 0) n += (size_t)r;
    err[n] = 0;
    close(fd);
    int status;
    CHECK(waitpid(pid, &status, 0) == pid);
    return status;
}

/* Whether a child's wait status is an abort (a failed CHECK, the lock-rank checker). */
static inline bool child_aborted(int status) {
    return WIFSIGNALED(status) && WTERMSIG(status) == SIGABRT;
}

#endif
