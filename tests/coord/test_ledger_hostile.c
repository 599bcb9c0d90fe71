// SPDX-License-Identifier: Apache-2.0
/* A ledger that other processes write nonsense into, truncate, or crowd: nothing they do to the
 * file crashes or hangs a heap; the worst is growth denied, which the heap counts and says.
 *
 * - truncated under a live heap (by another process): the heap's next growth is denied
 *   (CUMA_ERR_OOM naming the damage), counted in its stats; no SIGBUS (it had the file mapped);
 * - a slot count of 0xffffffff written into a live ledger's header: denied, no SIGSEGV;
 * - the magic zeroed under a live heap: a new joiner is refused and the slots stay (a joiner
 *   wiped the file);
 * - garbage over the bytes that held the lock (an in-file mutex before): heaps go on;
 * - another user's file at the ledger's name, or at a group ledger's temporary name: not used,
 *   said; the ledger moves to /run/user/UID;
 * - 300 processes joining at once on this machine: every creation succeeds (3 to 81 failed
 *   with "lock has been held").
 * The heaps live in children, so that a crash is seen as a child's signal. */
#include "check.h"
#include "coord/ledger_shm.h"
#include "cuma/ledger.h"

#include <errno.h>
#include <fcntl.h>
#include <grp.h>
#include <signal.h>
#include <stdio.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#define MB (1024ull * 1024ull)

static char name[64], path[128];

static cuma_heap *heap_in_ledger(void) {
    char conf[256];
    snprintf(conf, sizeof conf,
             "backend:sim,capacity:256M,ledger:%s,release_delay_ms:100000,tcache:off,arenas:1",
             name);
    cuma_config cfg = {.conf = conf, .flags = CUMA_CONFIG_NO_ENV};
    cuma_heap *h = NULL;
    return cuma_heap_create(&cfg, &h) == CUMA_OK ? h : NULL;
}

/* The stats JSON's figure `key` (a number) of the heap's ledger object. */
static unsigned long long json_figure(cuma_heap *h, const char *key, char *js, size_t len) {
    CHECK_OK(cuma_stats_json(h, js, len, NULL));
    char k[64];
    snprintf(k, sizeof k, "\"%s\":", key);
    const char *p = strstr(js, k);
    CHECK(p);
    return strtoull(p + strlen(k), NULL, 10);
}

/* A child with a heap in the ledger holding 8M; it tells the parent (ready), waits for the
 * parent to spoil the file (a byte on `go`), then tries to grow. Exit status: 0 when the growth
 * was denied with a message naming the damage and counted, 1 when it succeeded, 2 when the
 * heap could not be made. */
static pid_t spoiled_child(int *go_fd) {
    int ready[2], go[2];
    CHECK(pipe(ready) == 0 && pipe(go) == 0);
    pid_t pid = fork();
    CHECK(pid >= 0);
    if (pid == 0) {
        close(ready[0]);
        close(go[1]);
        cuma_heap *h = heap_in_ledger();
        if (!h) _exit(2);
        void *p, *q;
        if (cuma_alloc(h, 8 * MB, NULL, &p)) _exit(2);
        char c = 1;
        if (write(ready[1], &c, 1) != 1 || read(go[0], &c, 1) != 1) _exit(2);
        usleep(20000); /* the release thread publishes into the spoiled file meanwhile */
        cuma_status st = cuma_alloc(h, 64 * MB, NULL, &q);
        if (!st) _exit(1);
        char why[512];
        snprintf(why, sizeof why, "%s", cuma_last_error());
        char js[8192];
        unsigned long long damaged = json_figure(h, "damaged_denials", js, sizeof js);
        fprintf(stderr, "child: growth denied (%s); damaged_denials %llu\n", why, damaged);
        bool named = strstr(js, "\"problem\":\"ledger ") != NULL;
        if (st != CUMA_ERR_OOM || !damaged || !named) _exit(3);
        CHECK_OK(cuma_free(h, p, NULL)); /* the heap goes on */
        cuma_heap_destroy(h);
        _exit(0);
    }
    close(ready[1]);
    close(go[0]);
    char c;
    CHECK(read(ready[0], &c, 1) == 1);
    close(ready[0]);
    *go_fd = go[1];
    return pid;
}

static int finish(pid_t pid, int go_fd) {
    char c = 1;
    CHECK(write(go_fd, &c, 1) == 1);
    close(go_fd);
    int wst;
    CHECK(waitpid(pid, &wst, 0) == pid);
    if (WIFSIGNALED(wst)) {
        fprintf(stderr, "child killed by signal %d\n", WTERMSIG(wst));
        return -WTERMSIG(wst);
    }
    return WEXITSTATUS(wst);
}

static void pwrite_at(const void *buf, size_t len, off_t off) {
    int fd = open(path, O_RDWR);
    CHECK(fd >= 0);
    CHECK(pwrite(fd, buf, len, off) == (ssize_t)len);
    close(fd);
}

static void test_truncated(void) {
    for (int how = 0; how < 2; how++) {
        unlink(path);
        int go;
        pid_t c = spoiled_child(&go);
        /* Another process (this one) truncates it: to nothing, or into the slots. */
        CHECK(truncate(path, how ? (off_t)(sizeof(ledger_shm) + 10) : 0) == 0);
        int r = finish(c, go);
        CHECK(r == 0);
    }
    unlink(path);
}

static void test_slot_count(void) {
    unlink(path);
    int go;
    pid_t c = spoiled_child(&go);
    uint32_t v = 0xffffffffu;
    pwrite_at(&v, sizeof v, (off_t)offsetof(ledger_shm, nslots));
    CHECK(finish(c, go) == 0);
    size_t n;
    CHECK_ST(cuma_ledger_snapshot(name, NULL, 0, &n), CUMA_ERR_CORRUPT);
    CHECK(strstr(cuma_last_error(), path));
    unlink(path);
}

/* Zeroed magic under a live heap: the next joiner (another process) is refused, and the live
 * heap's slot is still in the file. */
static void test_zeroed_magic(void) {
    unlink(path);
    int go;
    pid_t c = spoiled_child(&go);
    uint64_t zero = 0;
    pwrite_at(&zero, sizeof zero, 0);
    pid_t j = fork();
    CHECK(j >= 0);
    if (j == 0) _exit(heap_in_ledger() ? 1 : 0); /* refused: 0 */
    int wst;
    CHECK(waitpid(j, &wst, 0) == j && WIFEXITED(wst));
    CHECK(WEXITSTATUS(wst) == 0);
    int fd = open(path, O_RDONLY);
    CHECK(fd >= 0);
    bool found = false;
    for (unsigned i = 0; i < LEDGER_SLOTS && !found; i++) {
        ledger_slot s;
        CHECK(pread(fd, &s, sizeof s, (off_t)(sizeof(ledger_shm) + i * sizeof s)) ==
              (ssize_t)sizeof s);
        found = atomic_load(&s.state) == 1 && s.pid == c;
    }
    close(fd);
    CHECK(found); /* not wiped */
    CHECK(finish(c, go) == 0);
    unlink(path);
}

/* Garbage over the bytes after the layout fields (where the lock was): the heap still grows,
 * and another process still joins. */
static void test_garbage_lock(void) {
    unlink(path);
    int go;
    pid_t c = spoiled_child(&go);
    unsigned char junk[64];
    for (size_t i = 0; i < sizeof junk; i++) junk[i] = (unsigned char)(0xa5 ^ (i * 37));
    pwrite_at(junk, sizeof junk, (off_t)(offsetof(ledger_shm, size) + 8));
    pid_t j = fork();
    CHECK(j >= 0);
    if (j == 0) {
        cuma_heap *h = heap_in_ledger();
        void *p;
        _exit(h && !cuma_alloc(h, 16 * MB, NULL, &p) ? 0 : 1);
    }
    int wst;
    CHECK(waitpid(j, &wst, 0) == j && WIFEXITED(wst) && WEXITSTATUS(wst) == 0);
    /* The child's growth succeeds: its status says so (1), the ledger being whole. */
    CHECK(finish(c, go) == 1);
    unlink(path);
}

/* Makes `file` as uid/gid 65534 (nobody) in a child: another user's squat. False when this
 * process may not switch users (not root). */
static bool plant_as_nobody(const char *file) {
    if (geteuid() != 0) return false;
    pid_t c = fork();
    CHECK(c >= 0);
    if (c == 0) {
        if (setresgid(65534, 65534, 65534) || setresuid(65534, 65534, 65534)) _exit(1);
        int fd = open(file, O_RDWR | O_CREAT | O_EXCL, 0600);
        _exit(fd >= 0 ? 0 : 2);
    }
    int wst;
    CHECK(waitpid(c, &wst, 0) == c && WIFEXITED(wst) && WEXITSTATUS(wst) == 0);
    return true;
}

/* Another user made the ledger's name in /dev/shm first: a heap of this user does not use that
 * file; it moves to /run/user/UID (made here for the test where the system has none) and says
 * so in its stats and in the notice the tools print; without such a directory, a named ledger
 * fails naming the squatter (it failed with "belongs to uid 65534", and ledger:auto went
 * without a ledger, saying so in one stats field only). */
static void test_squatted(void) {
    unlink(path);
    if (!plant_as_nobody(path)) {
        fprintf(stderr, "squatted: not root, left out\n");
        return;
    }
    char dir[64];
    snprintf(dir, sizeof dir, "/run/user/%u", (unsigned)geteuid());
    bool made_dir = false;
    struct stat sb;
    if (stat(dir, &sb)) {
        CHECK(mkdir("/run/user", 0755) == 0 || errno == EEXIST);
        CHECK(mkdir(dir, 0700) == 0);
        made_dir = true;
    }
    char moved[160], note[512];
    CHECK_OK(cuma_ledger_path(name, moved, sizeof moved));
    CHECK(!strncmp(moved, dir, strlen(dir)));
    CHECK_OK(cuma_ledger_notice(name, note, sizeof note));
    CHECK(strstr(note, "squatted") && strstr(note, "uid 65534") && strstr(note, moved));
    cuma_heap *h = heap_in_ledger();
    CHECK(h);
    char js[8192];
    CHECK_OK(cuma_stats_json(h, js, sizeof js, NULL));
    CHECK(strstr(js, moved) && strstr(js, "\"notice\":\"ledger ") && strstr(js, "squatted"));
    size_t n;
    CHECK_OK(cuma_ledger_snapshot(name, NULL, 0, &n));
    CHECK(n == 1);
    CHECK(stat(path, &sb) == 0 && sb.st_size == 0); /* the squatter's file is untouched */
    cuma_heap_destroy(h);
    unlink(moved);
    if (made_dir) {
        CHECK(rmdir(dir) == 0);
        /* Nowhere to move: refused, naming the squatter. */
        CHECK(!heap_in_ledger());
        CHECK(strstr(cuma_last_error(), "squatted") && strstr(cuma_last_error(), "uid 65534"));
    }
    unlink(path);
}

/* A group ledger is made under a temporary name, then linked: names planted where the old
 * predictable temporary names were (.cuma-new-PID-SEQ) do not stop it (it failed with "File
 * exists"). */
static void test_group_temp(void) {
    struct group *gr = getgrgid(getegid());
    if (!gr || geteuid() != 0) {
        fprintf(stderr, "group temp: not root or no group name, left out\n");
        return;
    }
    char planted[4][96];
    for (int i = 0; i < 4; i++) {
        snprintf(planted[i], sizeof planted[i], "/dev/shm/.cuma-new-%d-%d", (int)getpid(), i);
        unlink(planted[i]);
        CHECK(plant_as_nobody(planted[i]));
    }
    char gname[160], gpath[160];
    snprintf(gname, sizeof gname, "@%s+tmp-%d", gr->gr_name, (int)getpid());
    CHECK_OK(cuma_ledger_path(gname, gpath, sizeof gpath));
    unlink(gpath);
    char conf[256];
    snprintf(conf, sizeof conf, "backend:sim,capacity:64M,ledger:%s,tcache:off", gname);
    cuma_config cfg = {.conf = conf, .flags = CUMA_CONFIG_NO_ENV};
    cuma_heap *h = NULL;
    CHECK_OK(cuma_heap_create(&cfg, &h));
    cuma_heap_destroy(h);
    unlink(gpath);
    for (int i = 0; i < 4; i++) unlink(planted[i]);
}

/* NPROC processes, released at once, each make a heap in the ledger, grow it and leave. More
 * processes than slots: how many are live at once is the scheduler's choice (under ASan beside
 * a CPU hog, 37 of 300 once found all 256 slots taken), so a join may be refused for that and
 * nothing else, and at most NPROC - LEDGER_SLOTS can be (a refused one never holds a slot, and
 * each refusal saw LEDGER_SLOTS others holding one). */
#define NPROC 300
static void test_crowd(void) {
    unlink(path);
    int go[2];
    CHECK(pipe(go) == 0);
    pid_t kids[NPROC];
    for (int i = 0; i < NPROC; i++) {
        kids[i] = fork();
        CHECK(kids[i] >= 0);
        if (kids[i] == 0) {
            close(go[1]);
            char c;
            (void)!read(go[0], &c, 1); /* EOF: all go */
            char conf[256];
            snprintf(conf, sizeof conf,
                     "backend:sim,capacity:64G,ledger:%s,release_thread:off,tcache:off,arenas:1",
                     name);
            cuma_config cfg = {.conf = conf, .flags = CUMA_CONFIG_NO_ENV};
            cuma_heap *h = NULL;
            if (cuma_heap_create(&cfg, &h)) {
                fprintf(stderr, "crowd %d: %s\n", i, cuma_last_error());
                _exit(strstr(cuma_last_error(), "slots are taken") ? 2 : 1);
            }
            void *p;
            int rc = cuma_alloc(h, 4 * MB, NULL, &p) ? 3 : 0;
            cuma_heap_destroy(h);
            _exit(rc);
        }
    }
    close(go[0]);
    close(go[1]);
    int failed = 0, full = 0;
    for (int i = 0; i < NPROC; i++) {
        int wst;
        CHECK(waitpid(kids[i], &wst, 0) == kids[i]);
        int r = WIFEXITED(wst) ? WEXITSTATUS(wst) : 100;
        failed += r == 1 || r == 3 || r == 100;
        full += r == 2;
    }
    fprintf(stderr, "crowd: %d processes, %d failed, %d found all %u slots taken\n", NPROC, failed,
            full, LEDGER_SLOTS);
    CHECK(failed == 0 && full <= NPROC - (int)LEDGER_SLOTS);
    unlink(path);
}

/* NALIVE processes, released at once, join and stay until all have joined: each join then
 * reclaims among up to NALIVE live slots under the lock (a /proc read each), so the lock is
 * held for milliseconds and waited for long; every join must still succeed. */
#define NALIVE 250
static void test_crowd_alive(void) {
    unlink(path);
    int go[2], joined[2], leave[2];
    CHECK(pipe(go) == 0 && pipe(joined) == 0 && pipe(leave) == 0);
    pid_t kids[NALIVE];
    for (int i = 0; i < NALIVE; i++) {
        kids[i] = fork();
        CHECK(kids[i] >= 0);
        if (kids[i] == 0) {
            close(go[1]);
            close(joined[0]);
            close(leave[1]);
            char c = 1;
            (void)!read(go[0], &c, 1);
            char conf[256];
            snprintf(conf, sizeof conf, "backend:sim,capacity:64G,ledger:%s,tcache:off,arenas:1",
                     name);
            cuma_config cfg = {.conf = conf, .flags = CUMA_CONFIG_NO_ENV};
            cuma_heap *h = NULL;
            int rc = 0;
            void *p = NULL;
            if (cuma_heap_create(&cfg, &h)) {
                fprintf(stderr, "crowd %d: %s\n", i, cuma_last_error());
                rc = 1;
            } else if (cuma_alloc(h, 4 * MB, NULL, &p)) {
                fprintf(stderr, "crowd %d: alloc: %s\n", i, cuma_last_error());
                rc = 3;
            }
            c = (char)rc;
            (void)!write(joined[1], &c, 1);
            (void)!read(leave[0], &c, 1); /* EOF: leave */
            if (h) cuma_heap_destroy(h);
            _exit(rc);
        }
    }
    close(go[0]);
    close(joined[1]);
    close(leave[0]);
    close(go[1]); /* all go */
    int got = 0;
    char c;
    while (got < NALIVE && read(joined[0], &c, 1) == 1) got++;
    close(leave[1]);
    int failed = 0;
    for (int i = 0; i < NALIVE; i++) {
        int wst;
        CHECK(waitpid(kids[i], &wst, 0) == kids[i]);
        failed += !WIFEXITED(wst) || WEXITSTATUS(wst) != 0;
    }
    close(joined[0]);
    fprintf(stderr, "crowd staying: %d processes, %d joined and said so, %d failed\n", NALIVE, got,
            failed);
    CHECK(failed == 0 && got == NALIVE);
    unlink(path);
}

static pid_t main_pid;

/* A failed check leaves no file behind (a child's failure is the parent's to see). */
static void on_abort(int sig) {
    if (getpid() == main_pid) unlink(path);
    signal(sig, SIG_DFL);
    raise(sig);
}

/* usage: test_ledger_hostile [TEST]: one of truncated, slot_count, zeroed_magic, garbage_lock,
 * squatted, group_temp, crowd, crowd_alive; all without one. */
int main(int argc, char **argv) {
    snprintf(name, sizeof name, "hostile-%d", (int)getpid());
    CHECK_OK(cuma_ledger_path(name, path, sizeof path));
    main_pid = getpid();
    signal(SIGABRT, on_abort);
    static const struct {
        const char *name;
        void (*fn)(void);
    } tests[] = {{"truncated", test_truncated},
                 {"slot_count", test_slot_count},
                 {"zeroed_magic", test_zeroed_magic},
                 {"garbage_lock", test_garbage_lock},
                 {"squatted", test_squatted},
                 {"group_temp", test_group_temp},
                 {"crowd", test_crowd},
                 {"crowd_alive", test_crowd_alive}};
    for (size_t i = 0; i < sizeof tests / sizeof tests[0]; i++)
        if (argc < 2 || !strcmp(argv[1], tests[i].name)) tests[i].fn();
    printf("test_ledger_hostile: ok\n");
    return 0;
}
