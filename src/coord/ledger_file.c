// SPDX-License-Identifier: Apache-2.0
/* The ledger's file: its name in shared memory, creating it, checking that it is ours and of
 * this layout, its lock, reading and writing it, and the process's one open file of it. */
#include "ledger_shm.h"

#include "settings/config.h"
#include "util/error.h"
#include "util/lockrank.h"
#include "heap/peers.h"
#include "cuma/ledger.h"

#include <errno.h>
#include <fcntl.h>
#include <grp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <unistd.h>

/* shm_open's name: /cuma-UID for the user's ledger, /cuma-UID-NAME for a named one, /cuma-gGID
 * for the ledger of a Unix group ("@GROUP": the jobs of every member share it) and /cuma-gGID-NAME
 * for a named one of a group ("@GROUP+NAME"). *gid (may be NULL) gets the group's id, or -1 for a
 * ledger of the user's own. */
static cuma_status shm_name(const char *name, char *buf, size_t len, long *gid) {
    if (gid) *gid = -1;
    if (!name || !*name || !strcmp(name, "on") || !strcmp(name, "auto")) {
        snprintf(buf, len, "/cuma-%u", (unsigned)geteuid());
        return CUMA_OK;
    }
    if (!strcmp(name, "off") || !strcmp(name, "none"))
        return cuma_fail(CUMA_ERR_CONFIG,
                         "ledger '%s' means no ledger: there is no file to name or read", name);
    if (!cuma_ledger_name_valid(name))
        return cuma_fail(CUMA_ERR_CONFIG,
                         "ledger: bad name '%s': 1 to 48 letters, digits, '_', '-' or '.', "
                         "@GROUP or @GROUP+NAME",
                         name);
    if (name[0] == '@') {
        char group[49]; /* valid: 1 to 48 characters */
        const char *plus = strchr(name, '+');
        size_t glen = plus ? (size_t)(plus - name - 1) : strlen(name + 1);
        snprintf(group, sizeof group, "%.*s", (int)glen, name + 1);
        /* The entry's size is the group's (its members): the buffer grows until it fits. */
        struct group gr, *found = NULL;
        long gr_gid = -1;
        int err = ERANGE;
        for (size_t cap = 4096; err == ERANGE && cap <= (64u << 20); cap *= 4) {
            char *tmp = malloc(cap);
            if (!tmp) return cuma_fail(CUMA_ERR_OOM, "ledger %s: no host memory", name);
            err = getgrnam_r(group, &gr, tmp, cap, &found);
            if (!err && found) gr_gid = (long)found->gr_gid;
            free(tmp);
        }
        if (err)
            return cuma_fail(CUMA_ERR_CONFIG, "ledger %s: looking up group '%s': %s", name, group,
                             strerror(err));
        if (gr_gid < 0)
            return cuma_fail(CUMA_ERR_CONFIG, "ledger %s: no such group '%s'", name, group);
        if (plus)
            snprintf(buf, len, "/cuma-g%ld-%s", gr_gid, plus + 1);
        else
            snprintf(buf, len, "/cuma-g%ld", gr_gid);
        if (gid) *gid = gr_gid;
        return CUMA_OK;
    }
    snprintf(buf, len, "/cuma-%u-%s", (unsigned)geteuid(), name);
    return CUMA_OK;
}

/* Whether the process is a member of group gid (its effective or a supplementary group). */
static bool in_group(gid_t gid) {
    if (getegid() == gid) return true;
    int n = getgroups(0, NULL);
    gid_t *list = n > 0 ? malloc((size_t)n * sizeof *list) : NULL;
    bool in = false;
    if (list && (n = getgroups(n, list)) > 0)
        for (int i = 0; i < n && !in; i++) in = list[i] == gid;
    free(list);
    return in;
}

/* Whether the file may steer this process's memory: the user's own ledger is the user's, mode
 * 0600; a group's is shared by the group's members, group read-write and nothing for others
 * (any member may own it), and the process must be a member. */
static cuma_status check_owner(const struct stat *sb, long gid, const char *path) {
    if (gid < 0) {
        if (sb->st_uid == geteuid() && !(sb->st_mode & 077)) return CUMA_OK;
        return cuma_fail(CUMA_ERR_IO,
                         "ledger %s belongs to uid %u with mode %03o: it must be this user's (%u) "
                         "with mode 0600",
                         path, (unsigned)sb->st_uid, (unsigned)(sb->st_mode & 0777),
                         (unsigned)geteuid());
    }
    if (sb->st_gid == (gid_t)gid && (sb->st_mode & 0060) == 0060 && !(sb->st_mode & 007) &&
        in_group((gid_t)gid))
        return CUMA_OK;
    return cuma_fail(CUMA_ERR_IO,
                     "ledger %s has group %u and mode %03o: a group ledger must have group %ld, "
                     "mode 0660, and this process (uid %u) must be a member of it",
                     path, (unsigned)sb->st_gid, (unsigned)(sb->st_mode & 0777), gid,
                     (unsigned)geteuid());
}

/* Where the ledger of that name is: /dev/shm<n>, unless another user holds that name there (in
 * the sticky /dev/shm anyone may make any name first). A user's ledger then moves to the same
 * name in /run/user/UID, where that is the user's private directory, and note says so; a
 * group's ledger (which its members must find in one place) or a user's without such a
 * directory fails with CUMA_ERR_IO naming the squatter. Either is said once on stderr. *gid: as
 * shm_name's; n (72 bytes) gets the shm name. */
static cuma_status locate(const char *name, char *path, size_t plen, long *gid, char *n, char *note,
                          size_t nlen) {
    static _Atomic bool said;
    if (nlen) note[0] = 0;
    cuma_status st = shm_name(name, n, 72, gid);
    if (st) return st;
    if ((size_t)snprintf(path, plen, "/dev/shm%s", n) >= plen)
        return cuma_fail(CUMA_ERR_INVALID, "ledger path: buffer of %zu bytes too small", plen);
    struct stat sb;
    if (lstat(path, &sb)) return CUMA_OK; /* nothing there yet */
    bool squat =
        *gid < 0 ? sb.st_uid != geteuid() : sb.st_uid != geteuid() && sb.st_gid != (gid_t)*gid;
    if (!squat) return CUMA_OK;
    char msg[256];
    snprintf(msg, sizeof msg,
             "ledger %s is squatted: %s there belongs to uid %u (group %u, mode %03o), not to "
             "this user (uid %u)%s",
             path,
             S_ISLNK(sb.st_mode)   ? "a symbolic link"
             : S_ISREG(sb.st_mode) ? "a file"
                                   : "a node",
             (unsigned)sb.st_uid, (unsigned)sb.st_gid, (unsigned)(sb.st_mode & 07777),
             (unsigned)geteuid(), *gid >= 0 ? " nor to the group" : "");
    char dir[64];
    snprintf(dir, sizeof dir, "/run/user/%u", (unsigned)geteuid());
    struct stat db;
    bool private_dir = *gid < 0 && !lstat(dir, &db) && S_ISDIR(db.st_mode) &&
                       db.st_uid == geteuid() && !(db.st_mode & 077);
    if (!private_dir) {
        if (!atomic_exchange(&said, true))
            fprintf(stderr, "cuma: %s; no private place to move to (%s)\n", msg,
                    *gid >= 0 ? "a group's ledger stays in /dev/shm" : dir);
        return cuma_fail(CUMA_ERR_IO,
                         "%s: remove it (as root) or name another ledger (ledger:NAME)%s", msg,
                         *gid >= 0 ? "" : "; with a private /run/user/UID cuma moves there");
    }
    char fallback[160];
    if ((size_t)snprintf(fallback, sizeof fallback, "%s%s", dir, n) >= plen)
        return cuma_fail(CUMA_ERR_INVALID, "ledger path: buffer of %zu bytes too small", plen);
    snprintf(path, plen, "%s", fallback);
    if (nlen) snprintf(note, nlen, "%s; this user's ledger is %s instead", msg, fallback);
    if (!atomic_exchange(&said, true))
        fprintf(stderr, "cuma: %s; this user's ledger is %s instead\n", msg, fallback);
    return CUMA_OK;
}

cuma_status cuma_ledger_path(const char *name, char *buf, size_t len) {
    char n[72];
    long gid;
    if (!buf || !len) return cuma_fail(CUMA_ERR_INVALID, "cuma_ledger_path: no buffer");
    return locate(name, buf, len, &gid, n, NULL, 0);
}

cuma_status cuma_ledger_notice(const char *name, char *buf, size_t len) {
    char n[72], path[160];
    long gid;
    if (!buf || !len) return cuma_fail(CUMA_ERR_INVALID, "cuma_ledger_notice: no buffer");
    cuma_status st = locate(name, path, sizeof path, &gid, n, buf, len);
    if (st) snprintf(buf, len, "%s", cuma_last_error());
    return st;
}

/* ---- the file ------------------------------------------------------------------------------- */

void cuma_ledger_init_header(ledger_shm *m) {
    m->version = LEDGER_VERSION;
    m->nslots = LEDGER_SLOTS;
    m->slot_size = (uint32_t)sizeof(ledger_slot);
    m->header_size = (uint32_t)sizeof(ledger_shm);
    m->size = LEDGER_BYTES;
    atomic_store_explicit(&m->magic, LEDGER_MAGIC, memory_order_release);
}

cuma_status cuma_ledger_check_header(const ledger_shm *m, const char *path) {
    if (atomic_load(&m->magic) != LEDGER_MAGIC)
        return cuma_fail(CUMA_ERR_CORRUPT, "ledger %s is not a cuma ledger (no magic)", path);
    if (m->version != LEDGER_VERSION || m->nslots != LEDGER_SLOTS ||
        m->slot_size != sizeof(ledger_slot) || m->header_size != sizeof(ledger_shm) ||
        m->size != LEDGER_BYTES)
        return cuma_fail(CUMA_ERR_CORRUPT,
                         "ledger %s has layout version %u (%u slots of %u bytes), this cuma uses "
                         "version %u (%u of %zu): another cuma build shares it, or a process "
                         "wrote over it; give this one another ledger (ledger:NAME) or ledger:off",
                         path, m->version, m->nslots, m->slot_size, LEDGER_VERSION, LEDGER_SLOTS,
                         sizeof(ledger_slot));
    return CUMA_OK;
}

/* Reads len bytes at off; the bytes read (short at the file's end, 0 on error). */
static size_t read_at(int fd, void *buf, size_t len, off_t off) {
    size_t got = 0;
    while (got < len) {
        ssize_t r = pread(fd, (char *)buf + got, len - got, off + (off_t)got);
        if (r < 0 && errno == EINTR) continue;
        if (r <= 0) break;
        got += (size_t)r;
    }
    return got;
}

static bool write_at(int fd, const void *buf, size_t len, off_t off) {
    size_t put = 0;
    while (put < len) {
        ssize_t r = pwrite(fd, (const char *)buf + put, len - put, off + (off_t)put);
        if (r < 0 && errno == EINTR) continue;
        if (r <= 0) return false;
        put += (size_t)r;
    }
    return true;
}

cuma_status cuma_ledger_read(ledger_file *f) {
    size_t got = read_at(f->fd, f->img, LEDGER_BYTES, 0);
    if (got < LEDGER_BYTES) {
        memset((char *)f->img + got, 0, LEDGER_BYTES - got);
        return cuma_fail(CUMA_ERR_CORRUPT,
                         "ledger %s has %zu bytes, this cuma's layout %zu: truncated by a process "
                         "that shares it, or another build",
                         f->path, got, (size_t)LEDGER_BYTES);
    }
    return cuma_ledger_check_header(f->img, f->path);
}

cuma_status cuma_ledger_write_slot(ledger_file *f, unsigned i, const ledger_slot *s) {
    off_t off = (off_t)(sizeof(ledger_shm) + (size_t)i * sizeof(ledger_slot));
    if (write_at(f->fd, s, sizeof *s, off)) return CUMA_OK;
    return cuma_fail(CUMA_ERR_IO, "ledger %s: writing slot %u: %s", f->path, i, strerror(errno));
}

void cuma_ledger_write_seq(ledger_file *f) {
    uint64_t v = atomic_load(&f->img->seq);
    (void)write_at(f->fd, &v, sizeof v, (off_t)offsetof(ledger_shm, seq));
}

uint64_t cuma_ledger_read_seq(ledger_file *f) {
    uint64_t v;
    return read_at(f->fd, &v, sizeof v, (off_t)offsetof(ledger_shm, seq)) == sizeof v ? v
                                                                                      : UINT64_MAX;
}

/* ---- the lock ------------------------------------------------------------------------------- */

/* Byte 0 is the ledger lock; byte LEDGER_CLAIM_BASE + i slot i's claim lock (locks need no
 * bytes in the file). */
#define LEDGER_CLAIM_BASE (1ll << 40)

static int ofd_lock(int fd, short type, off_t at) {
    struct flock fl = {.l_type = type, .l_whence = SEEK_SET, .l_start = at, .l_len = 1};
    int r;
    while ((r = fcntl(fd, F_OFD_SETLK, &fl)) && errno == EINTR) {
    }
    return r ? errno : 0;
}

static uint64_t now_ms(void) {
    return cuma_ledger_now_ns() / 1000000u;
}

static uint64_t read_gen(int fd) {
    uint64_t v = 0;
    (void)read_at(fd, &v, sizeof v, (off_t)offsetof(ledger_shm, lockgen));
    return v;
}

/* Takes the lock on byte `at` (mu held): true once held; false when it did not change hands
 * for LEDGER_STALL_MS (lockgen still), or LEDGER_LOCK_CAP_MS went by, or locks fail; *moved_ms
 * then gets when it was last seen changing hands (or the wait began). The lock is held for
 * microseconds: short naps, growing to a millisecond, keep hundreds of waiters from taking the
 * CPU its holder needs. */
static bool lock_byte(int fd, off_t at, uint64_t *moved_ms) {
    int r = ofd_lock(fd, F_WRLCK, at);
    if (!r) return true;
    uint64_t start = now_ms(), moved = start, gen = read_gen(fd);
    *moved_ms = start;
    long nap = 20000;
    while (r == EAGAIN || r == EACCES) {
        uint64_t now = now_ms();
        if (now - moved >= LEDGER_STALL_MS || now - start >= LEDGER_LOCK_CAP_MS) return false;
        struct timespec ts = {0, nap};
        nanosleep(&ts, NULL);
        if (nap < 1000000) nap *= 2;
        uint64_t g = read_gen(fd);
        if (g != gen) gen = g, moved = now_ms();
        *moved_ms = moved;
        r = ofd_lock(fd, F_WRLCK, at);
    }
    return !r;
}

bool cuma_ledger_lock(ledger_file *f) {
    cuma_mutex_lock(&f->mu, CUMA_RANK_LEDGER);
    /* Found stuck before, and nobody has taken the lock since: one try, no second wait (every
     * page of an allocation would wait LEDGER_STALL_MS again). */
    uint64_t moved_ms = 0;
    if (f->stuck && read_gen(f->fd) == f->stuck_gen) {
        if (ofd_lock(f->fd, F_WRLCK, 0)) return false;
    } else if (!lock_byte(f->fd, 0, &moved_ms)) {
        f->stuck = true;
        f->stuck_gen = read_gen(f->fd);
        f->stuck_since = moved_ms * 1000000u;
        return false;
    }
    f->stuck = false;
    f->locked = true;
    /* Not past the end of a short file: a damaged ledger is left as it is. */
    uint64_t g;
    if (read_at(f->fd, &g, sizeof g, (off_t)offsetof(ledger_shm, lockgen)) == sizeof g) {
        g++;
        (void)write_at(f->fd, &g, sizeof g, (off_t)offsetof(ledger_shm, lockgen));
    }
    return true;
}

void cuma_ledger_unlock(ledger_file *f) {
    if (f->locked) ofd_lock(f->fd, F_UNLCK, 0);
    f->locked = false;
    cuma_mutex_unlock(&f->mu);
}

static bool slot_free(const ledger_slot *s) {
    return atomic_load(&s->state) != 1;
}

cuma_status cuma_ledger_claim_slot(ledger_file *f, unsigned i, const ledger_slot *s) {
    off_t at = LEDGER_CLAIM_BASE + (off_t)i;
    if (ofd_lock(f->fd, F_WRLCK, at))
        return cuma_fail(CUMA_ERR_LIMIT, "ledger %s: slot %u is being claimed", f->path, i);
    ledger_slot now;
    off_t off = (off_t)(sizeof(ledger_shm) + (size_t)i * sizeof(ledger_slot));
    cuma_status st = CUMA_OK;
    if (read_at(f->fd, &now, sizeof now, off) != sizeof now || !slot_free(&now))
        st = cuma_fail(CUMA_ERR_LIMIT, "ledger %s: slot %u was taken meanwhile", f->path, i);
    else
        st = cuma_ledger_write_slot(f, i, s);
    ofd_lock(f->fd, F_UNLCK, at);
    return st;
}

/* ---- opening -------------------------------------------------------------------------------- */

/* Makes the ledger file at path appear whole, its header written: made under a private, random
 * name in the same directory (O_EXCL: a file planted at a guessed name is never used), given to
 * the group with mode 0660 for a group's ledger (gid >= 0), given this layout's size and header,
 * then linked to its name (if another process made it meanwhile, that one stays). A file made in
 * place was seen by readers before its header was written (they took it for a file that is no
 * ledger), and a group's was first its maker's alone (the new file's group is the process's, the
 * umask may take g+rw): a member opening it then was refused, and a maker killed before fixing it
 * left a file nobody else may remove from the sticky /dev/shm. */
static cuma_status make_file(const char *path, long gid) {
    char tmp[192];
    uint64_t r[2] = {0, 0};
    if (getrandom(r, sizeof r, 0) != (ssize_t)sizeof r)
        r[0] = cuma_ledger_now_ns() ^ ((uint64_t)getpid() << 32), r[1] = (uint64_t)(uintptr_t)tmp;
    const char *slash = strrchr(path, '/');
    int dlen = slash ? (int)(slash - path) : 0;
    if ((size_t)snprintf(tmp, sizeof tmp, "%.*s/.cuma-new-%016llx%016llx", dlen, path,
                         (unsigned long long)r[0], (unsigned long long)r[1]) >= sizeof tmp)
        return cuma_fail(CUMA_ERR_INVALID, "ledger %s: its path is too long", path);
    int fd = open(tmp, O_RDWR | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0600);
    if (fd < 0)
        return cuma_fail(CUMA_ERR_IO, "ledger %s: making it (%s): %s", path, tmp, strerror(errno));
    cuma_status st = CUMA_OK;
    if (gid >= 0 && (fchown(fd, (uid_t)-1, (gid_t)gid) || fchmod(fd, 0660)))
        st = cuma_fail(CUMA_ERR_IO, "ledger %s: giving it to group %ld: %s", path, gid,
                       strerror(errno));
    ledger_shm *h = st ? NULL : calloc(1, sizeof *h);
    if (!st && !h) st = cuma_fail(CUMA_ERR_OOM, "ledger %s: no host memory for its header", path);
    if (!st) {
        cuma_ledger_init_header(h);
        if (ftruncate(fd, (off_t)LEDGER_BYTES) || !write_at(fd, h, sizeof *h, 0))
            st = cuma_fail(CUMA_ERR_IO, "ledger %s: writing its header: %s", path, strerror(errno));
    }
    free(h);
    close(fd);
    if (!st && link(tmp, path) && errno != EEXIST)
        st = cuma_fail(CUMA_ERR_IO, "ledger %s: %s", path, strerror(errno));
    unlink(tmp);
    return st;
}

static bool all_zero(const void *p, size_t n) {
    const unsigned char *b = p;
    for (size_t i = 0; i < n; i++)
        if (b[i]) return false;
    return true;
}

/* Makes the file's header where it has none (the ledger lock held): a file of zeros (made in
 * place by an older cuma, which may have died before writing the header; the lock's generation
 * aside) of this layout's
 * size at most is given the layout. Anything else without a header is refused and left as it
 * is: live heaps may use its slots (a process that zeroed the magic under them must not have the
 * next joiner wipe them). */
static cuma_status init_file(ledger_file *f) {
    if (!cuma_ledger_read(f)) return CUMA_OK; /* another process made it meanwhile */
    struct stat sb;
    if (fstat(f->fd, &sb))
        return cuma_fail(CUMA_ERR_IO, "ledger %s: fstat: %s", f->path, strerror(errno));
    size_t got = read_at(f->fd, f->img, LEDGER_BYTES, 0);
    atomic_store(&f->img->lockgen, 0);
    if ((uint64_t)sb.st_size > LEDGER_BYTES || !all_zero(f->img, got)) {
        cuma_status st = cuma_ledger_read(f);
        if (atomic_load(&f->img->magic) != LEDGER_MAGIC)
            return cuma_fail(CUMA_ERR_CORRUPT,
                             "ledger %s is not a cuma ledger (no magic) but holds data: left as it "
                             "is (heaps may still use it); remove it once they are gone",
                             f->path);
        return st;
    }
    if (ftruncate(f->fd, (off_t)LEDGER_BYTES))
        return cuma_fail(CUMA_ERR_IO, "ledger %s: ftruncate: %s", f->path, strerror(errno));
    memset(f->img, 0, LEDGER_BYTES);
    cuma_ledger_init_header(f->img);
    atomic_store(&f->img->lockgen, read_gen(f->fd));
    if (!write_at(f->fd, f->img, sizeof(ledger_shm), 0))
        return cuma_fail(CUMA_ERR_IO, "ledger %s: writing its header: %s", f->path,
                         strerror(errno));
    return CUMA_OK;
}

/* Opens the ledger, creating and initialising it where `create`. */
static cuma_status open_ledger(const char *name, bool create, ledger_file *f) {
    char n[72]; /* "/cuma-UID-" and a name of 48 at most */
    long gid;
    cuma_status st = locate(name, f->path, sizeof f->path, &gid, n, f->note, sizeof f->note);
    if (st) return st;
    const char *path = f->path;
    if (gid >= 0 && !in_group((gid_t)gid))
        return cuma_fail(CUMA_ERR_IO,
                         "ledger %s (%s): this process (uid %u) is no member of group %ld", path,
                         name, (unsigned)geteuid(), gid);
    /* O_NOFOLLOW: a link planted at the name leads nowhere of another's choosing. */
    int flags = O_RDWR | O_CLOEXEC | O_NOFOLLOW;
    int fd = open(path, flags);
    if (fd < 0 && errno == ENOENT && create) {
        st = make_file(path, gid);
        if (st) return st;
        fd = open(path, flags);
    }
    if (fd < 0)
        return cuma_fail(CUMA_ERR_IO, "ledger %s: %s%s", path,
                         errno == ENOENT  ? "no such ledger (no heap has joined it)"
                         : errno == ELOOP ? "a symbolic link is there, not a ledger"
                                          : strerror(errno),
                         errno == EACCES && gid >= 0
                             ? " (a group ledger must be mode 0660 and the group's: ls -l it)"
                             : "");
    f->fd = fd;
    struct stat sb;
    if (fstat(fd, &sb))
        return cuma_fail(CUMA_ERR_IO, "ledger %s: fstat: %s", path, strerror(errno));
    if (!S_ISREG(sb.st_mode))
        return cuma_fail(CUMA_ERR_IO, "ledger %s is not a regular file", path);
    /* The ledger steers other processes' memory: only the user's own, private one, or the
     * group's shared with its members alone, will do. */
    st = check_owner(&sb, gid, path);
    if (st) return st;
    f->ino = (uint64_t)sb.st_ino;
    if (!(f->img = calloc(1, LEDGER_BYTES)))
        return cuma_fail(CUMA_ERR_OOM, "ledger %s: no host memory for its image", path);
    /* A file with this layout's header is used as it is (without the lock: the header is
     * written once); one without is made under the lock, if it may be. */
    st = cuma_ledger_read(f);
    if (!st) return CUMA_OK;
    if (sb.st_size == 0 && !create)
        return cuma_fail(CUMA_ERR_IO, "ledger %s is empty (no heap has joined it)", path);
    /* Zeros of this layout's size at most: made in place by an older cuma that has not written
     * the header yet (or died first); the next heap to join makes it. */
    atomic_store(&f->img->lockgen, 0); /* a joiner's lock may have counted in the zeros */
    if (!create && (uint64_t)sb.st_size <= LEDGER_BYTES && all_zero(f->img, (size_t)sb.st_size))
        return cuma_fail(CUMA_ERR_IO, "ledger %s has no header yet (being made)", path);
    if (!create || atomic_load(&f->img->magic) == LEDGER_MAGIC) return st;
    cuma_clear_error();
    if (!cuma_ledger_lock(f)) {
        cuma_ledger_unlock(f);
        return cuma_fail(CUMA_ERR_IO,
                         "ledger %s is being made by a process that holds its lock and does not "
                         "run (stopped?) for %d ms: try again once it runs, or remove the file",
                         path, LEDGER_STALL_MS);
    }
    st = init_file(f);
    cuma_ledger_unlock(f);
    return st;
}

static void close_file(ledger_file *f) {
    if (f->fd >= 0) close(f->fd);
    pthread_mutex_destroy(&f->mu);
    free(f->img);
    free(f);
}

/* The process's open files, one per ledger, shared by its heaps and snapshots. A file goes when
 * its last user does. Under files_lock. */
static pthread_mutex_t files_lock = PTHREAD_MUTEX_INITIALIZER;
static ledger_file *files;

/* The last file closed while its lock was found stuck: a process that reads a ledger now and
 * then (the exporter, top) opens it afresh each time, and would otherwise wait LEDGER_STALL_MS
 * at every read while the same holder stays stopped. Under files_lock. */
static struct {
    char path[160];
    uint64_t ino, gen, since;
} last_stuck;

/* The inode the ledger's path leads to now (0 when none). */
static uint64_t current_ino(const char *path) {
    struct stat sb;
    return lstat(path, &sb) ? 0 : (uint64_t)sb.st_ino;
}

/* Around fork: no thread holds the list or a file's mu while the process is copied, so that a
 * child's heaps (inherited, their slots their parent's) can still be read. */
static void prefork(void) {
    cuma_mutex_lock(&files_lock, CUMA_RANK_LEDGER_LIST);
    for (ledger_file *f = files; f; f = f->next) cuma_mutex_lock(&f->mu, CUMA_RANK_LEDGER);
}

static void postfork(void) {
    for (ledger_file *f = files; f; f = f->next) cuma_mutex_unlock(&f->mu);
    cuma_mutex_unlock(&files_lock);
}

static void fork_hooks(void) {
    cuma_fork_layer(prefork, postfork);
}

cuma_status cuma_ledger_acquire(const char *name, bool create, ledger_file **out) {
    char path[160];
    cuma_status st = cuma_ledger_path(name, path, sizeof path);
    if (st) return st;
    static pthread_once_t hooks_once = PTHREAD_ONCE_INIT;
    pthread_once(&hooks_once, fork_hooks);
    cuma_mutex_lock(&files_lock, CUMA_RANK_LEDGER_LIST);
    /* A file that was removed (by hand, or by logind's RemoveIPC at logout) would keep this
     * process's new heaps in a ledger nobody else sees: only the file the name leads to now
     * will do. A child of fork shares its parent's open files, and with them their locks: it
     * opens its own. */
    uint64_t ino = current_ino(path);
    ledger_file *f = files;
    while (f && (strcmp(f->path, path) || f->ino != ino || f->pid != getpid())) f = f->next;
    if (f) {
        f->refs++;
        *out = f;
    } else if (!(f = calloc(1, sizeof *f))) {
        st = cuma_fail(CUMA_ERR_OOM, "no host memory for a ledger");
    } else {
        f->fd = -1;
        f->pid = getpid();
        pthread_mutex_init(&f->mu, NULL);
        if ((st = open_ledger(name, create, f))) {
            close_file(f);
        } else {
            if (last_stuck.ino == f->ino && !strcmp(last_stuck.path, f->path)) {
                f->stuck = true;
                f->stuck_gen = last_stuck.gen;
                f->stuck_since = last_stuck.since;
            }
            f->refs = 1;
            f->next = files;
            files = f;
            *out = f;
        }
    }
    cuma_mutex_unlock(&files_lock);
    return st;
}

void cuma_ledger_release_file(ledger_file *f) {
    cuma_mutex_lock(&files_lock, CUMA_RANK_LEDGER_LIST);
    for (ledger_file **pp = &files; *pp; pp = &(*pp)->next) {
        if (*pp != f) continue;
        if (!--f->refs) {
            *pp = f->next;
            cuma_mutex_lock(&f->mu, CUMA_RANK_LEDGER);
            bool stuck = f->stuck;
            uint64_t gen = f->stuck_gen, since = f->stuck_since;
            cuma_mutex_unlock(&f->mu);
            if (stuck) {
                snprintf(last_stuck.path, sizeof last_stuck.path, "%s", f->path);
                last_stuck.ino = f->ino;
                last_stuck.gen = gen;
                last_stuck.since = since;
            } else if (last_stuck.ino == f->ino && !strcmp(last_stuck.path, f->path)) {
                last_stuck.ino = 0;
            }
            close_file(f);
        }
        break;
    }
    cuma_mutex_unlock(&files_lock);
}
