// SPDX-License-Identifier: Apache-2.0
/* Safe opening of the files that settings name (see safefile.h). The pre-check with lstat keeps
 * a device or FIFO at the name from being opened at all (opening a device can act on it); the
 * open itself (O_NOFOLLOW, O_NONBLOCK) and fstat on the descriptor settle what was really
 * opened, whatever was swapped in between. */
#include "util/safefile.h"

#include <errno.h>
#include <fcntl.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

static const char *kind_of(mode_t m) {
    if (S_ISLNK(m)) return "a symbolic link (not followed)";
    if (S_ISFIFO(m)) return "a FIFO, not a regular file";
    if (S_ISCHR(m) || S_ISBLK(m)) return "a device, not a regular file";
    if (S_ISDIR(m)) return "a directory";
    if (S_ISSOCK(m)) return "a socket, not a regular file";
    return "not a regular file";
}

/* Whether st is something this process may write into; the reason in why when not. */
static int acceptable(const struct stat *st, int links_matter, char *why, size_t wlen) {
    if (!S_ISREG(st->st_mode)) {
        snprintf(why, wlen, "it is %s: refused", kind_of(st->st_mode));
        return 0;
    }
    if (st->st_uid != geteuid()) {
        snprintf(why, wlen, "it belongs to uid %ld, not to this user (uid %ld): refused",
                 (long)st->st_uid, (long)geteuid());
        return 0;
    }
    if (links_matter && st->st_nlink > 1) {
        snprintf(why, wlen, "it has %lu other names (hard links): refused",
                 (unsigned long)st->st_nlink - 1);
        return 0;
    }
    return 1;
}

static int fail(int e, char *why, size_t wlen, const char *what) {
    if (what) snprintf(why, wlen, "%s", what);
    errno = e;
    return -1;
}

int cuma_file_open_log(const char *path, char *why, size_t wlen) {
    struct stat st;
    if (lstat(path, &st) == 0 && !acceptable(&st, 1, why, wlen)) return fail(EPERM, why, wlen, 0);
    int fd = open(path, O_WRONLY | O_CREAT | O_NOFOLLOW | O_NONBLOCK | O_NOCTTY | O_CLOEXEC, 0600);
    if (fd < 0) {
        int e = errno;
        if (e == ELOOP) return fail(e, why, wlen, "it is a symbolic link (not followed): refused");
        if (e == ENXIO) return fail(e, why, wlen, "it is a FIFO, not a regular file: refused");
        return fail(e, why, wlen, strerror(e));
    }
    int e = 0;
    if (fstat(fd, &st) != 0)
        e = errno, snprintf(why, wlen, "%s", strerror(e));
    else if (!acceptable(&st, 1, why, wlen))
        e = EPERM;
    else if (fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) & ~O_NONBLOCK) != 0)
        e = errno, snprintf(why, wlen, "%s", strerror(e));
    if (!e) return fd;
    close(fd);
    errno = e;
    return -1;
}

/* 64 bits no other user can predict: the kernel's generator, or (where it is missing) the clock
 * mixed with the process id and a counter. Exclusive creation makes any guess harmless anyway;
 * the randomness only keeps a planted name from refusing every try. */
static uint64_t random64(void) {
    uint64_t r;
    if (getrandom(&r, sizeof r, GRND_NONBLOCK) == (ssize_t)sizeof r) return r;
    static _Atomic uint64_t ctr;
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    r = (uint64_t)ts.tv_nsec ^ (uint64_t)ts.tv_sec << 30 ^ (uint64_t)getpid() << 20 ^
        atomic_fetch_add(&ctr, 0x9e3779b97f4a7c15ull);
    r ^= r >> 31, r *= 0xbf58476d1ce4e5b9ull, r ^= r >> 27;
    return r;
}

int cuma_file_create_temp(const char *target, char *tmp, size_t tlen, char *why, size_t wlen) {
    struct stat st;
    mode_t mode = 0600;
    if (lstat(target, &st) == 0) {
        if (!acceptable(&st, 0, why, wlen)) return fail(EPERM, why, wlen, 0);
        mode = st.st_mode & 0777;
    } else if (errno != ENOENT) {
        return fail(errno, why, wlen, strerror(errno));
    }
    for (int tries = 0; tries < 32; tries++) {
        int w = snprintf(tmp, tlen, "%s.tmp-%016llx", target, (unsigned long long)random64());
        if (w < 0 || (size_t)w >= tlen) return fail(ENAMETOOLONG, why, wlen, "name too long");
        int fd = open(tmp, O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_NOCTTY | O_CLOEXEC, 0600);
        if (fd < 0 && errno == EEXIST) continue;
        if (fd < 0) return fail(errno, why, wlen, strerror(errno));
        /* The user's chosen mode of the file being replaced; umask had its say at its creation. */
        if (mode != 0600 && fchmod(fd, mode) != 0) {
            int e = errno;
            close(fd);
            unlink(tmp);
            return fail(e, why, wlen, strerror(e));
        }
        return fd;
    }
    return fail(EEXIST, why, wlen, "32 random temporary names were all taken");
}
