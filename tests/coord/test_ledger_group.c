// SPDX-License-Identifier: Apache-2.0
/* A group's ledger (ledger:@GROUP+NAME): the jobs of several users on one device share it. The
 * file is the group's (mode 0660), another member's process joins it and sees the others' heaps
 * (admission counts them), a process outside the group is refused naming it, and a file that
 * others could write is refused. The cross-user part switches users in children, so it needs root
 * (CI runs as root); without it that part is said to be left out and the rest still runs. */
#include "check.h"
#include "cuma/ledger.h"

#include <grp.h>
#include <signal.h>
#include <stdbool.h>
#include <stdio.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#define MB (1024ull * 1024ull)

static char ledger[112], path[160];
static pid_t main_pid;

/* A failed check leaves no file in /dev/shm behind (a child's failure is the parent's to see). */
static void on_abort(int sig) {
    if (getpid() == main_pid && path[0]) unlink(path);
    signal(sig, SIG_DFL);
    raise(sig);
}

static cuma_heap *group_heap(cuma_status *st) {
    char conf[256];
    snprintf(conf, sizeof conf,
             "backend:sim,capacity:64M,tcache:off,release_delay_ms:never,pressure_timeout_ms:0,"
             "ledger:%s",
             ledger);
    cuma_config c = {.conf = conf, .flags = CUMA_CONFIG_NO_ENV};
    cuma_heap *h = NULL;
    *st = cuma_heap_create(&c, &h);
    return h;
}

static size_t heaps_in(void) {
    cuma_ledger_entry e[8];
    size_t n = 0;
    CHECK_OK(cuma_ledger_snapshot(ledger, e, 8, &n));
    return n;
}

/* A child as another user (nobody), a member of the group or not. Exit status: 0 as expected. */
static int as_other_user(gid_t group, bool member) {
    pid_t pid = fork();
    CHECK(pid >= 0);
    if (pid) {
        int ws;
        CHECK(waitpid(pid, &ws, 0) == pid);
        return WIFEXITED(ws) ? WEXITSTATUS(ws) : 100 + WTERMSIG(ws);
    }
    alarm(20);
    gid_t groups[1] = {group};
    if (setgroups(member ? 1 : 0, groups) || setgid(65534) || setuid(65534)) _exit(10);
    if (geteuid() != 65534) _exit(11);
    cuma_status st;
    cuma_heap *h = group_heap(&st);
    if (!member) {
        /* Refused, saying why. */
        if (st != CUMA_ERR_IO || !strstr(cuma_last_error(), "member")) _exit(12);
        _exit(0);
    }
    if (st != CUMA_OK) {
        fprintf(stderr, "child: %s\n", cuma_last_error());
        _exit(13);
    }
    if (heaps_in() != 2) _exit(14); /* the parent's heap and this one */
    /* The parent holds 16M of the 64M device: 48M fit, 4M more do not (nobody gives). */
    void *p, *q;
    if (cuma_alloc(h, 48 * MB, 0, &p) != CUMA_OK) _exit(15);
    if (cuma_alloc(h, 4 * MB, 0, &q) != CUMA_ERR_OOM) _exit(16);
    cuma_stats s;
    CHECK_OK(cuma_get_stats(h, &s));
    if (s.ledger_denials == 0) _exit(17);
    cuma_free(h, p, 0);
    cuma_heap_destroy(h);
    _exit(0);
}

int main(void) {
    gid_t gid = getegid();
    struct group *gr = getgrgid(gid);
    CHECK(gr);
    /* A long name (48 characters) is the file's whole name, not cut short. */
    snprintf(ledger, sizeof ledger, "@%s+test-group-%08d-%s", gr->gr_name, (int)getpid(),
             "abcdefghijklmnopqrstuvwxyzAB");
    CHECK(strlen(strchr(ledger, '+') + 1) == 48);
    CHECK_OK(cuma_ledger_path(ledger, path, sizeof path));
    main_pid = getpid();
    signal(SIGABRT, on_abort);
    printf("test_ledger_group: ledger %s at %s\n", ledger, path);
    CHECK(strstr(path, strchr(ledger, '+') + 1));
    /* The file is the group's, mode 0660, whatever the umask of the process that makes it. */
    mode_t old_mask = umask(077);
    cuma_status st;
    cuma_heap *h = group_heap(&st);
    umask(old_mask);
    CHECK_OK(st);
    void *p;
    CHECK_OK(cuma_alloc(h, 16 * MB, 0, &p));
    struct stat sb;
    CHECK(stat(path, &sb) == 0);
    CHECK((sb.st_mode & 0777) == 0660 && sb.st_gid == gid);
    CHECK(heaps_in() == 1);

    if (geteuid() == 0) {
        CHECK(as_other_user(gid, true) == 0);
        CHECK(as_other_user(gid, false) == 0);
        printf("test_ledger_group: a member of another uid shared the device; a non-member was "
               "refused\n");
    } else {
        printf("test_ledger_group: not root: the part with other users is left out (it needs to "
               "switch users)\n");
    }

    /* Names: a group that does not exist, a bad name. */
    cuma_config c = {.conf = "backend:sim,ledger:@no-such-group-cuma", .flags = CUMA_CONFIG_NO_ENV};
    cuma_heap *none = NULL;
    CHECK_ST(cuma_heap_create(&c, &none), CUMA_ERR_CONFIG);
    CHECK(strstr(cuma_last_error(), "no such group"));
    CHECK_ST(cuma_config_check("ledger:@root+"), CUMA_ERR_CONFIG);

    CHECK_OK(cuma_free(h, p, 0));
    CHECK_OK(cuma_validate(h));
    cuma_heap_destroy(h); /* the process's mapping goes with its last heap: the file is read anew */

    /* A file others may write is nobody's to trust. */
    CHECK(chmod(path, 0666) == 0);
    cuma_heap *bad = group_heap(&st);
    CHECK(st == CUMA_ERR_IO && !bad && strstr(cuma_last_error(), "0660"));
    cuma_ledger_entry e[1];
    size_t n;
    CHECK_ST(cuma_ledger_snapshot(ledger, e, 1, &n), CUMA_ERR_IO);
    CHECK(chmod(path, 0660) == 0);
    CHECK(heaps_in() == 0);
    unlink(path);
    puts("test_ledger_group: ok");
    return 0;
}
