/* The ledger's file: its name in shared memory, creating it under flock, checking that it is
 * ours and of this layout, and the process's one mapping of it. */
#include "ledger_shm.h"

#include "core/error.h"
#include "cuma/ledger.h"

#include <errno.h>
#include <fcntl.h>
#include <grp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

static bool valid_name(const char *n) {
    size_t len = strlen(n);
    if (!len || len > 48) return false;
    for (const char *p = n; *p; p++)
        if (!((*p >= 'a' && *p <= 'z') || (*p >= 'A' && *p <= 'Z') || (*p >= '0' && *p <= '9') ||
              *p == '_' || *p == '-' || *p == '.'))
            return false;
    return true;
}

bool cuma_ledger_name_valid(const char *name) {
    if (name[0] != '@') return valid_name(name);
    const char *plus = strchr(name + 1, '+');
    if (!plus) return valid_name(name + 1);
    char group[49];
    size_t glen = (size_t)(plus - name - 1);
    if (!glen || glen >= sizeof group) return false;
    memcpy(group, name + 1, glen);
    group[glen] = 0;
    return valid_name(group) && valid_name(plus + 1);
}

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

cuma_status cuma_ledger_path(const char *name, char *buf, size_t len) {
    char n[72]; /* "/cuma-UID-" and a name of 48 at most */
    if (!buf || !len) return cuma_fail(CUMA_ERR_INVALID, "cuma_ledger_path: no buffer");
    cuma_status st = shm_name(name, n, sizeof n, NULL);
    if (st) return st;
    if ((size_t)snprintf(buf, len, "/dev/shm%s", n) >= len)
        return cuma_fail(CUMA_ERR_INVALID, "cuma_ledger_path: buffer of %zu bytes too small", len);
    return CUMA_OK;
}

/* ---- the file ------------------------------------------------------------------------------- */

void cuma_ledger_init_lock(ledger_shm *m) {
    pthread_mutexattr_t a;
    pthread_mutexattr_init(&a);
    pthread_mutexattr_setpshared(&a, PTHREAD_PROCESS_SHARED);
    pthread_mutexattr_setrobust(&a, PTHREAD_MUTEX_ROBUST);
    pthread_mutex_init(&m->lock, &a);
    pthread_mutexattr_destroy(&a);
}

void cuma_ledger_init_header(ledger_shm *m) {
    m->version = LEDGER_VERSION;
    m->nslots = LEDGER_SLOTS;
    m->slot_size = (uint32_t)sizeof(ledger_slot);
    m->mutex_size = (uint32_t)sizeof(pthread_mutex_t);
    m->size = LEDGER_BYTES;
    cuma_ledger_init_lock(m);
    atomic_store_explicit(&m->magic, LEDGER_MAGIC, memory_order_release);
}

cuma_status cuma_ledger_check_header(const ledger_shm *m, const char *path) {
    if (m->version != LEDGER_VERSION || m->nslots != LEDGER_SLOTS ||
        m->slot_size != sizeof(ledger_slot) || m->mutex_size != sizeof(pthread_mutex_t) ||
        m->size != LEDGER_BYTES)
        return cuma_fail(CUMA_ERR_CORRUPT,
                         "ledger %s has layout version %u (%u slots of %u bytes), this cuma uses "
                         "version %u (%u of %zu): another cuma build shares it; give this one "
                         "another ledger (ledger:NAME) or ledger:off",
                         path, m->version, m->nslots, m->slot_size, LEDGER_VERSION, LEDGER_SLOTS,
                         sizeof(ledger_slot));
    return CUMA_OK;
}

/* Makes a group's ledger file /dev/shm<n> appear whole: made under a private name, given to the
 * group with mode 0660, then linked to its name (if another process made it meanwhile, that one
 * stays). A file made in place would first be its maker's alone (the new file's group is the
 * process's, the umask may take g+rw): a member opening it then was refused, and a maker killed
 * before fixing it left a file nobody else may remove from the sticky /dev/shm. */
static cuma_status make_group_file(const char *n, long gid, const char *path) {
    static _Atomic unsigned seq;
    char tmp[128], final[96];
    snprintf(tmp, sizeof tmp, "/dev/shm/.cuma-new-%ld-%u", (long)getpid(),
             atomic_fetch_add(&seq, 1));
    snprintf(final, sizeof final, "/dev/shm%s", n);
    int fd = open(tmp, O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
    if (fd < 0)
        return cuma_fail(CUMA_ERR_IO, "ledger %s: making it in /dev/shm: %s", path,
                         strerror(errno));
    cuma_status st = CUMA_OK;
    if (fchown(fd, (uid_t)-1, (gid_t)gid) || fchmod(fd, 0660))
        st = cuma_fail(CUMA_ERR_IO, "ledger %s: giving it to group %ld: %s", path, gid,
                       strerror(errno));
    close(fd);
    if (!st && link(tmp, final) && errno != EEXIST)
        st = cuma_fail(CUMA_ERR_IO, "ledger %s: %s", path, strerror(errno));
    unlink(tmp);
    return st;
}

/* Maps the ledger, creating and initialising it where `create`. */
static cuma_status map_ledger(const char *name, bool create, ledger_shm **out, char *path,
                              size_t plen, uint64_t *ino) {
    char n[72]; /* "/cuma-UID-" and a name of 48 at most */
    long gid;
    cuma_status st = shm_name(name, n, sizeof n, &gid);
    if (st) return st;
    snprintf(path, plen, "/dev/shm%s", n);
    if (gid >= 0 && !in_group((gid_t)gid))
        return cuma_fail(CUMA_ERR_IO,
                         "ledger %s (%s): this process (uid %u) is no member of group %ld", path,
                         name, (unsigned)geteuid(), gid);
    int fd;
    if (gid >= 0) {
        fd = shm_open(n, O_RDWR | O_CLOEXEC, 0);
        if (fd < 0 && errno == ENOENT && create) {
            st = make_group_file(n, gid, path);
            if (st) return st;
            fd = shm_open(n, O_RDWR | O_CLOEXEC, 0);
        }
    } else {
        fd = shm_open(n, O_RDWR | O_CLOEXEC | (create ? O_CREAT : 0), 0600);
    }
    if (fd < 0)
        return cuma_fail(CUMA_ERR_IO, "ledger %s: %s%s", path,
                         errno == ENOENT ? "no such ledger (no heap has joined it)"
                                         : strerror(errno),
                         errno == EACCES && gid >= 0
                             ? " (a group ledger must be mode 0660 and the group's: ls -l it)"
                             : "");
    struct stat sb;
    if (fstat(fd, &sb)) {
        st = cuma_fail(CUMA_ERR_IO, "ledger %s: fstat: %s", path, strerror(errno));
        goto out_fd;
    }
    /* The ledger steers other processes' memory: only the user's own, private one, or the
     * group's shared with its members alone, will do. */
    st = check_owner(&sb, gid, path);
    if (st) goto out_fd;
    if (flock(fd, LOCK_EX)) {
        st = cuma_fail(CUMA_ERR_IO, "ledger %s: flock: %s", path, strerror(errno));
        goto out_fd;
    }
    if (fstat(fd, &sb) == 0 && sb.st_size == 0) {
        if (!create) {
            st = cuma_fail(CUMA_ERR_IO, "ledger %s is empty (no heap has joined it)", path);
            goto out_unlock;
        }
        if (ftruncate(fd, (off_t)LEDGER_BYTES)) {
            st = cuma_fail(CUMA_ERR_IO, "ledger %s: ftruncate: %s", path, strerror(errno));
            goto out_unlock;
        }
        sb.st_size = (off_t)LEDGER_BYTES;
    }
    if ((uint64_t)sb.st_size < sizeof(ledger_shm)) {
        st = cuma_fail(CUMA_ERR_CORRUPT, "ledger %s has %lld bytes, too few for a header", path,
                       (long long)sb.st_size);
        goto out_unlock;
    }
    void *p = mmap(NULL, (size_t)sb.st_size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (p == MAP_FAILED) {
        st = cuma_fail(CUMA_ERR_IO, "ledger %s: mmap: %s", path, strerror(errno));
        goto out_unlock;
    }
    ledger_shm *m = p;
    /* No magic under flock: its creator died before finishing (or it was just made). */
    if (atomic_load_explicit(&m->magic, memory_order_acquire) != LEDGER_MAGIC) {
        if ((uint64_t)sb.st_size == LEDGER_BYTES && create) {
            memset(m, 0, LEDGER_BYTES);
            cuma_ledger_init_header(m);
        } else {
            st = cuma_fail(CUMA_ERR_CORRUPT, "ledger %s is not a cuma ledger (no magic)", path);
            munmap(p, (size_t)sb.st_size);
            goto out_unlock;
        }
    }
    st = (uint64_t)sb.st_size == LEDGER_BYTES
             ? cuma_ledger_check_header(m, path)
             : cuma_fail(CUMA_ERR_CORRUPT,
                         "ledger %s has %lld bytes, this cuma's "
                         "layout has %zu: another build?",
                         path, (long long)sb.st_size, (size_t)LEDGER_BYTES);
    if (st) {
        munmap(p, (size_t)sb.st_size);
    } else {
        *out = m;
        *ino = (uint64_t)sb.st_ino;
    }
out_unlock:
    flock(fd, LOCK_UN);
out_fd:
    close(fd);
    return st;
}

/* The process's mappings, one per ledger, shared by its heaps and snapshots: one mapping however
 * many heaps, and every heap of the process sees the lock and the atomics at the same addresses
 * (two mappings of one file would be two objects to a thread checker). A mapping goes when its
 * last user does. Under maps_lock. */
typedef struct mapping {
    char path[96];
    ledger_shm *shm;
    uint64_t ino; /* the file it maps: a ledger removed and made again is another file */
    unsigned refs;
    struct mapping *next;
} mapping;

/* The inode the ledger's name leads to now (0 when none). */
static uint64_t current_ino(const char *name) {
    char n[72];
    if (shm_name(name, n, sizeof n, NULL)) return 0;
    int fd = shm_open(n, O_RDONLY | O_CLOEXEC, 0);
    if (fd < 0) return 0;
    struct stat sb;
    uint64_t ino = fstat(fd, &sb) ? 0 : (uint64_t)sb.st_ino;
    close(fd);
    return ino;
}

static pthread_mutex_t maps_lock = PTHREAD_MUTEX_INITIALIZER;
static mapping *maps;

void cuma_ledger_prefork(void) {
    pthread_mutex_lock(&maps_lock);
}

void cuma_ledger_postfork(void) {
    pthread_mutex_unlock(&maps_lock);
}

cuma_status cuma_ledger_acquire(const char *name, bool create, ledger_shm **out, char *path,
                                size_t plen) {
    cuma_status st = cuma_ledger_path(name, path, plen);
    if (st) return st;
    pthread_mutex_lock(&maps_lock);
    /* A mapping of a file that was removed (by hand, or by logind's RemoveIPC at logout) would
     * keep this process's new heaps in a ledger nobody else sees: only the file the name leads
     * to now will do. */
    uint64_t ino = current_ino(name);
    mapping *m = maps;
    while (m && (strcmp(m->path, path) || m->ino != ino)) m = m->next;
    if (m) {
        m->refs++;
        *out = m->shm;
    } else if (!(m = calloc(1, sizeof *m))) {
        st = cuma_fail(CUMA_ERR_OOM, "no host memory for a ledger mapping");
    } else if ((st = map_ledger(name, create, &m->shm, m->path, sizeof m->path, &m->ino))) {
        free(m);
    } else {
        m->refs = 1;
        m->next = maps;
        maps = m;
        *out = m->shm;
    }
    pthread_mutex_unlock(&maps_lock);
    return st;
}

void cuma_ledger_release_map(ledger_shm *shm) {
    pthread_mutex_lock(&maps_lock);
    for (mapping **pp = &maps; *pp; pp = &(*pp)->next) {
        mapping *m = *pp;
        if (m->shm != shm) continue;
        if (!--m->refs) {
            *pp = m->next;
            munmap(m->shm, LEDGER_BYTES);
            free(m);
        }
        break;
    }
    pthread_mutex_unlock(&maps_lock);
}
