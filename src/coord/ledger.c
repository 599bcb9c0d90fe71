// SPDX-License-Identifier: Apache-2.0
/* The cross-process ledger: a file in POSIX shared memory, one per user, with a slot per heap
 * (its file, layout and lock: ledger_file.c, ledger_shm.h); what heaps do in it.
 *
 * Why it is built this way (lessons from HAMi-core's shared region, and from members that write
 * nonsense into it):
 * - The file is read with pread into a private image and written with pwrite, never mapped: a
 *   process that truncates it or writes garbage over it makes reads short or wrong, which are
 *   checked (growth is denied and the heap says so once), never a SIGBUS or a broken mutex.
 * - The lock is an OFD lock, which the kernel drops when its holder dies. A waiter waits as long
 *   as the lock changes hands (contention never fails anything); a holder that stops (Ctrl-Z,
 *   a debugger) turns the others to stale mode after LEDGER_STALL_MS: growth is admitted
 *   against an unlocked read of the file, counted and said once, and never fails for the lock.
 * - A slot is reclaimed when its process is gone or its pid was reused (start time differs).
 * - Usage is never a running total that can wrap: each heap counts its own bytes in its slot
 *   (it only ever gives back what it was given), and totals are summed when needed.
 * - Opening is a handful of system calls; nothing scans /proc beyond the ledger's own slots.
 */
#include "ledger.h"
#include "ledger_shm.h"

#include "util/error.h"
#include "util/lockrank.h"

#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

/* A heap's handle: its mapping and slot. seen_seq and active belong to the thread that polls
 * cuma_ledger_asked (the heap's release thread); the rest is constant. */
struct cuma_ledger {
    ledger_file *f;
    unsigned slot;
    pid_t owner; /* the process that joined: a child made by fork has no slot of its own */
    uint64_t seen_seq;
    bool active;
    char path[160];
    ledger_slot mine; /* the slot as this heap has it (under f->mu), written whole to the file */
    /* Growths admitted without the lock (its holder stuck), and denied because the file was
     * damaged; problem: the last damage seen (under f->mu), said once on stderr. */
    _Atomic uint64_t stale, damaged;
    _Atomic bool said_stale, said_damaged;
    char problem[320];
};

/* Whether the calling process is the one that joined (a heap inherited through fork is not: its
 * slot is its parent's, which the child must neither change nor free). */
static bool owned(const cuma_ledger *l) {
    return getpid() == l->owner;
}

/* ---- processes ------------------------------------------------------------------------------ */

/* Field 22 of /proc/PID/stat (after the parenthesised name, which may hold spaces), and field 3
 * (the state letter) into *state where not NULL; 0 when it cannot be read. */
static uint64_t proc_start(int pid, char *state) {
    char path[64], buf[1024];
    snprintf(path, sizeof path, "/proc/%d/stat", pid);
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) return 0;
    ssize_t n = read(fd, buf, sizeof buf - 1);
    close(fd);
    if (n <= 0) return 0;
    buf[n] = 0;
    char *p = strrchr(buf, ')');
    if (!p) return 0;
    /* p + 2 is field 3 (state); the start time is field 22: 19 fields further. */
    p += 2;
    if (state) *state = *p;
    for (int f = 3; f < 22 && p; f++) {
        p = strchr(p, ' ');
        if (p) p++;
    }
    return p ? strtoull(p, NULL, 10) : 0;
}

/* The PID namespace of this process (the inode of /proc/self/ns/pid), 0 if unknown: pids in
 * the ledger mean something only in the namespace of the process that wrote them. */
static uint64_t my_pidns(void) {
    static _Atomic uint64_t ns = UINT64_MAX;
    uint64_t v = atomic_load_explicit(&ns, memory_order_relaxed);
    if (v == UINT64_MAX) {
        struct stat sb;
        v = stat("/proc/self/ns/pid", &sb) ? 0 : (uint64_t)sb.st_ino;
        atomic_store_explicit(&ns, v, memory_order_relaxed);
    }
    return v;
}

static bool alive(const ledger_slot *s) {
    /* Another PID namespace's pid cannot be judged from here: such a slot is left to the
     * processes of its own namespace (a reader in a container would otherwise erase the host's
     * live jobs). */
    uint64_t ns = my_pidns();
    if (s->pidns && ns && s->pidns != ns) return true;
    /* kill(0 or -n, 0) asks about process groups, which always answer: such a pid is no heap's. */
    if (s->pid <= 0) return false;
    if (kill(s->pid, 0) && errno == ESRCH) return false;
    char state = 0;
    uint64_t st = proc_start(s->pid, &state);
    /* A zombie (killed, not yet waited for by its parent) holds no memory any more. */
    if (state == 'Z' || state == 'X') return false;
    return !st || !s->start || st == s->start; /* unreadable: trust kill */
}

/* A name from the environment, cut to fit (Kubernetes names are at most 63 bytes). */
static void env_name(char *out, size_t n, const char *var) {
    const char *v = getenv(var);
    snprintf(out, n, "%s", v ? v : "");
}

static void clear_slot(ledger_slot *s) {
    atomic_store_explicit(&s->state, 0, memory_order_release);
    s->pid = 0;
    s->start = 0;
    s->pidns = 0;
    s->priority = 0;
    memset(s->process, 0, sizeof s->process);
    memset(s->device, 0, sizeof s->device);
    memset(s->backend, 0, sizeof s->backend);
    memset(s->pod, 0, sizeof s->pod);
    memset(s->pod_namespace, 0, sizeof s->pod_namespace);
    memset(s->container, 0, sizeof s->container);
    s->capacity = s->guarantee = 0;
    atomic_store(&s->limit, 0);
    atomic_store(&s->reserved, 0);
    atomic_store(&s->peak, 0);
    atomic_store(&s->cached, 0);
    atomic_store(&s->requested, 0);
    atomic_store(&s->want, 0);
    atomic_store(&s->want_until, 0);
    atomic_store(&s->answers, 0);
    atomic_store(&s->denials, 0);
    atomic_store(&s->asks, 0);
    atomic_store(&s->given, 0);
    atomic_store(&s->calls, 0);
    atomic_store(&s->published_ns, 0);
    for (unsigned w = 0; w < LEDGER_FIGURES_N; w++) atomic_store(ledger_figure(s, w), 0);
    atomic_store(&s->stats_ns, 0);
}

/* Frees the slots of dead processes (the ledger lock held, f->img fresh). A dead requester's
 * want goes with its slot. */
static unsigned reap(ledger_file *f) {
    ledger_shm *m = f->img;
    unsigned n = 0;
    bool seq = false;
    for (unsigned i = 0; i < LEDGER_SLOTS; i++) {
        ledger_slot *s = &m->slot[i];
        if (atomic_load(&s->state) != 1 || alive(s)) continue;
        if (atomic_load(&s->want)) seq = true;
        clear_slot(s);
        memset(s, 0, sizeof *s);
        (void)cuma_ledger_write_slot(f, i, s);
        cuma_clear_error();
        n++;
    }
    if (seq) {
        atomic_fetch_add(&m->seq, 1);
        cuma_ledger_write_seq(f);
    }
    return n;
}

/* Reads the file into the image (f->mu held) and lays this heap's own slot over its place. A
 * damaged file is kept in l->problem and said once. */
static cuma_status refresh(cuma_ledger *l) {
    cuma_status st = cuma_ledger_read(l->f);
    if (st) {
        snprintf(l->problem, sizeof l->problem, "%s", cuma_last_error());
        if (!atomic_exchange(&l->said_damaged, true))
            fprintf(stderr, "cuma: %s; this heap's growth is denied until it is whole again\n",
                    l->problem);
        return st;
    }
    if (getpid() == l->owner) memcpy(&l->f->img->slot[l->slot], &l->mine, sizeof l->mine);
    return CUMA_OK;
}

/* A growth admitted in stale mode. */
static void note_stale(cuma_ledger *l) {
    atomic_fetch_add(&l->stale, 1);
    if (!atomic_exchange(&l->said_stale, true))
        fprintf(stderr,
                "cuma: ledger %s: its lock has not changed hands for %d ms (a process holding it "
                "is stopped?): growth is admitted against an unlocked read of the ledger "
                "(ledger_stale_admissions in the stats counts it)\n",
                l->path, LEDGER_STALL_MS);
}

/* Writes this heap's slot (f->mu held). */
static void write_mine(cuma_ledger *l) {
    if (cuma_ledger_write_slot(l->f, l->slot, &l->mine)) cuma_clear_error();
}

/* ---- admission --------------------------------------------------------------------------------
 */

static bool same_device(const ledger_slot *a, const ledger_slot *b) {
    return atomic_load_explicit(&b->state, memory_order_acquire) == 1 && a != b &&
           !strncmp(a->device, b->device, sizeof a->device);
}

static uint64_t max64(uint64_t a, uint64_t b) {
    return a > b ? a : b;
}

/* Sums of other processes' figures saturate: a slot written by a broken process must make the
 * device look full, never let a wrapped sum make it look empty. */
static uint64_t add_sat(uint64_t a, uint64_t b) {
    return a + b < a ? UINT64_MAX : a + b;
}

/* What a slot waits for now: nothing once its request expired. */
static uint64_t want_of(const ledger_slot *o, uint64_t now) {
    uint64_t w = atomic_load(&o->want);
    return w && now < atomic_load(&o->want_until) ? w : 0;
}

/* What the other heaps on me's device claim: what they hold or their guarantee, whichever is
 * more; and what heaps of higher priority wait for. */
static void claims(const ledger_shm *m, const ledger_slot *me, uint64_t *held, uint64_t *higher) {
    *held = *higher = 0;
    uint64_t now = cuma_ledger_now_ns();
    for (unsigned i = 0; i < LEDGER_SLOTS; i++) {
        const ledger_slot *o = &m->slot[i];
        if (!same_device(me, o)) continue;
        *held = add_sat(*held, max64(atomic_load(&o->reserved), o->guarantee));
        if (o->priority > me->priority) *higher = add_sat(*higher, want_of(o, now));
    }
}

/* How many bytes more me may hold (lock held). Up to its guarantee a heap competes only with
 * what the others hold; above it, also with what heaps of higher priority wait for, so that a
 * heap asked to give memory back does not take it again at once. */
static uint64_t room_of(const ledger_shm *m, const ledger_slot *me) {
    uint64_t held, higher;
    claims(m, me, &held, &higher);
    uint64_t mine = atomic_load(&me->reserved), cap = me->capacity;
    uint64_t used = add_sat(held, mine), room = 0;
    if (add_sat(used, higher) < cap) room = cap - add_sat(used, higher);
    if (mine < me->guarantee && used < cap) {
        uint64_t up_to_g = me->guarantee - mine, free_now = cap - used;
        uint64_t r2 = up_to_g < free_now ? up_to_g : free_now;
        if (r2 > room) room = r2;
    }
    return room;
}

static bool fits(const ledger_shm *m, const ledger_slot *me, uint64_t bytes) {
    return bytes <= room_of(m, me);
}

static ledger_slot *my_slot(cuma_ledger *l) {
    return &l->f->img->slot[l->slot];
}

uint64_t cuma_ledger_room(cuma_ledger *l) {
    if (!owned(l)) return 0;
    cuma_ledger_lock(l->f);
    uint64_t room = refresh(l) ? 0 : room_of(l->f->img, my_slot(l));
    cuma_ledger_unlock(l->f);
    cuma_clear_error();
    return room;
}

cuma_status cuma_ledger_admit(cuma_ledger *l, uint64_t bytes) {
    if (!owned(l))
        return cuma_fail(
            CUMA_ERR_UNSUPPORTED,
            "ledger %s: this heap came through fork from process %d, whose slot it is; "
            "a child process makes heaps of its own",
            l->path, (int)l->owner);
    ledger_file *f = l->f;
    bool locked = cuma_ledger_lock(f);
    if (refresh(l)) {
        atomic_fetch_add(&l->damaged, 1);
        cuma_ledger_unlock(f);
        return cuma_fail(CUMA_ERR_OOM, "device %s: growth denied: %s", l->mine.device, l->problem);
    }
    ledger_slot *me = my_slot(l);
    bool ok = fits(f->img, me, bytes);
    if (!ok && locked && reap(f)) ok = fits(f->img, me, bytes);
    uint64_t held = 0, higher = 0;
    if (ok) {
        uint64_t r = atomic_fetch_add(&me->reserved, bytes) + bytes;
        if (r > atomic_load(&me->peak)) atomic_store(&me->peak, r);
        if (!locked) note_stale(l);
    } else {
        claims(f->img, me, &held, &higher);
        atomic_fetch_add(&me->denials, 1);
    }
    memcpy(&l->mine, me, sizeof l->mine);
    write_mine(l);
    uint64_t reserved = atomic_load(&me->reserved);
    cuma_ledger_unlock(f);
    if (ok) return CUMA_OK;
    return cuma_fail(CUMA_ERR_OOM,
                     "device %s is taken (ledger %s): other heaps hold or are guaranteed %" PRIu64
                     " bytes and heaps of higher priority wait for %" PRIu64
                     "; this one holds %" PRIu64 " of %" PRIu64 " and asked for %" PRIu64 " more",
                     l->mine.device, l->path, held, higher, reserved, l->mine.capacity, bytes);
}

/* The owner's changes of its own slot need no ledger lock: f->mu orders them with the
 * process's other writers of the slot, and nobody else writes a live slot. */
void cuma_ledger_unadmit(cuma_ledger *l, uint64_t bytes) {
    if (!owned(l)) return;
    cuma_mutex_lock(&l->f->mu, CUMA_RANK_LEDGER);
    uint64_t r = atomic_load(&l->mine.reserved);
    /* Only ever what was admitted; never below zero, whatever a caller does. */
    atomic_store(&l->mine.reserved, r > bytes ? r - bytes : 0);
    write_mine(l);
    cuma_mutex_unlock(&l->f->mu);
}

void cuma_ledger_set_limit(cuma_ledger *l, uint64_t limit) {
    if (!owned(l)) return;
    cuma_mutex_lock(&l->f->mu, CUMA_RANK_LEDGER);
    atomic_store(&l->mine.limit, limit);
    write_mine(l);
    cuma_mutex_unlock(&l->f->mu);
}

void cuma_ledger_publish(cuma_ledger *l, uint64_t cached, uint64_t requested, unsigned answers) {
    if (!owned(l)) return;
    cuma_mutex_lock(&l->f->mu, CUMA_RANK_LEDGER);
    ledger_slot *me = &l->mine;
    atomic_store_explicit(&me->answers, answers, memory_order_relaxed);
    atomic_store_explicit(&me->cached, cached, memory_order_relaxed);
    atomic_store_explicit(&me->requested, requested, memory_order_relaxed);
    atomic_store_explicit(&me->published_ns, cuma_ledger_now_ns(), memory_order_relaxed);
    write_mine(l);
    cuma_mutex_unlock(&l->f->mu);
}

/* Where each of a slot's allocator figures comes from (a field of cuma_stats) and goes to (the
 * cuma_ledger_entry field of the same name), by its word in the slot: the list of cuma.h. */
static const struct {
    size_t from, to;
    bool ratio; /* a double from 0 to 1, in parts per million */
} figures[LEDGER_FIGURES_N] = {
#define FIG(type, name, kind, where, help)                                                         \
    CUMA_STAT_IF_LEDGER(where,                                                                     \
                        [CUMA_STAT_WORD(where)] = {offsetof(cuma_stats, name),                     \
                                                   offsetof(cuma_ledger_entry, name),              \
                                                   CUMA_STAT_UNIT(kind) == CUMA_STAT_RATIO}, )
    CUMA_STATS_FIELDS(FIG)
#undef FIG
};
/* Every word is some figure's, none two figures': LEDGER_FIGURES_N distinct powers of two, and
 * nothing else, sum to 2^LEDGER_FIGURES_N - 1. */
#define FIG_COUNT(type, name, kind, where, help) +(CUMA_STAT_WORD(where) >= 0)
#define FIG_BIT(type, name, kind, where, help)                                                     \
    +(CUMA_STAT_WORD(where) >= 0 ? 1ull << CUMA_STAT_WORD(where) : 0)
_Static_assert(0 CUMA_STATS_FIELDS(FIG_COUNT) == LEDGER_FIGURES_N &&
                   0 CUMA_STATS_FIELDS(FIG_BIT) == (1ull << LEDGER_FIGURES_N) - 1,
               "each ledger word 0 to LEDGER_FIGURES_N - 1 belongs to one figure of the list");
#undef FIG_COUNT
#undef FIG_BIT

/* A ratio (a double), clamped to [0, 1], in parts per million. */
static uint64_t to_ppm(double x) {
    return (uint64_t)((x < 0 ? 0 : x > 1 ? 1 : x) * 1e6 + 0.5);
}

void cuma_ledger_publish_stats(cuma_ledger *l, const cuma_stats *s) {
    if (!owned(l)) return;
    cuma_mutex_lock(&l->f->mu, CUMA_RANK_LEDGER);
    ledger_slot *me = &l->mine;
    for (unsigned w = 0; w < LEDGER_FIGURES_N; w++) {
        const char *from = (const char *)s + figures[w].from;
        uint64_t v = figures[w].ratio ? to_ppm(*(const double *)from) : *(const uint64_t *)from;
        atomic_store_explicit(ledger_figure(me, w), v, memory_order_relaxed);
    }
    atomic_store_explicit(&me->stats_ns, cuma_ledger_now_ns(), memory_order_release);
    write_mine(l);
    cuma_mutex_unlock(&l->f->mu);
}

/* ---- joining -------------------------------------------------------------------------------- */

static void read_comm(char *buf, size_t len) {
    memset(buf, 0, len);
    int fd = open("/proc/self/comm", O_RDONLY | O_CLOEXEC);
    if (fd < 0) return;
    ssize_t n = read(fd, buf, len - 1);
    close(fd);
    if (n > 0 && buf[n - 1] == '\n') buf[n - 1] = 0;
}

cuma_status cuma_ledger_join(const cuma_ledger_join_info *in, cuma_ledger **out) {
    *out = NULL;
    cuma_ledger *l = calloc(1, sizeof *l);
    if (!l) return cuma_fail(CUMA_ERR_OOM, "no host memory for a ledger handle");
    cuma_status st = cuma_ledger_acquire(in->name, true, &l->f);
    if (st) {
        free(l);
        return st;
    }
    ledger_file *f = l->f;
    snprintf(l->path, sizeof l->path, "%s", f->path);
    /* Contention only makes this wait; a holder that does not run makes it join without the
     * lock (the guarantee check then races with other such joins: said once). */
    bool locked = cuma_ledger_lock(f);
    st = cuma_ledger_read(f);
    if (st) goto fail_unlock;
    if (locked) reap(f);
    uint64_t guaranteed = 0;
    for (unsigned i = 0; i < LEDGER_SLOTS; i++) {
        ledger_slot *o = &f->img->slot[i];
        if (atomic_load(&o->state) == 1 && !strncmp(o->device, in->device, sizeof o->device))
            guaranteed = add_sat(guaranteed, o->guarantee);
    }
    if (in->guarantee && add_sat(guaranteed, in->guarantee) > in->capacity) {
        st = cuma_fail(CUMA_ERR_LIMIT,
                       "guarantee: %" PRIu64 " bytes asked on device %s, but other heaps are "
                       "guaranteed %" PRIu64 " of its %" PRIu64 " (ledger %s)",
                       in->guarantee, in->device, guaranteed, in->capacity, l->path);
        goto fail_unlock;
    }
    ledger_slot *s = &l->mine;
    clear_slot(s);
    s->pid = (int32_t)getpid();
    s->start = proc_start(s->pid, NULL);
    s->pidns = my_pidns();
    s->priority = in->priority;
    read_comm(s->process, sizeof s->process);
    snprintf(s->device, sizeof s->device, "%s", in->device);
    snprintf(s->backend, sizeof s->backend, "%s", in->backend ? in->backend : "");
    env_name(s->pod, sizeof s->pod, "POD_NAME");
    env_name(s->pod_namespace, sizeof s->pod_namespace, "POD_NAMESPACE");
    env_name(s->container, sizeof s->container, "CONTAINER_NAME");
    s->capacity = in->capacity;
    s->guarantee = in->guarantee;
    atomic_store(&s->limit, in->limit);
    atomic_store(&s->published_ns, cuma_ledger_now_ns());
    atomic_store(&s->state, 1);
    /* Each free slot in turn, under its claim lock: a joiner in stale mode may take one at the
     * same time. */
    unsigned slot = LEDGER_SLOTS;
    for (unsigned i = 0; i < LEDGER_SLOTS && slot == LEDGER_SLOTS; i++) {
        if (atomic_load(&f->img->slot[i].state) == 1) continue;
        if (!cuma_ledger_claim_slot(f, i, s)) slot = i;
        cuma_clear_error();
    }
    if (slot == LEDGER_SLOTS) {
        st = cuma_fail(CUMA_ERR_LIMIT, "ledger %s: all %u slots are taken by live heaps", l->path,
                       LEDGER_SLOTS);
        goto fail_unlock;
    }
    if (!locked)
        fprintf(stderr,
                "cuma: ledger %s: its lock has not changed hands for %d ms (a process holding it "
                "is stopped?): this heap joined without it\n",
                l->path, LEDGER_STALL_MS);
    l->slot = slot;
    l->owner = getpid();
    l->seen_seq = atomic_load(&f->img->seq);
    memcpy(&f->img->slot[slot], s, sizeof *s);
    cuma_ledger_unlock(f);
    *out = l;
    return CUMA_OK;
fail_unlock:
    cuma_ledger_unlock(f);
    cuma_ledger_release_file(f);
    free(l);
    return st;
}

void cuma_ledger_leave(cuma_ledger *l) {
    if (!l) return;
    if (owned(l)) {
        bool locked = cuma_ledger_lock(l->f);
        bool want = atomic_load(&l->mine.want) != 0;
        memset(&l->mine, 0, sizeof l->mine);
        write_mine(l);
        /* A withdrawn request wakes the heaps that answer it (in stale mode it expires). */
        if (want && locked && !cuma_ledger_read(l->f)) {
            atomic_fetch_add(&l->f->img->seq, 1);
            cuma_ledger_write_seq(l->f);
        }
        cuma_clear_error();
        cuma_ledger_unlock(l->f);
    }
    cuma_ledger_release_file(l->f);
    free(l);
}

/* ---- pressure ------------------------------------------------------------------------------- */

/* What the others on me's device could give it (lock held): idle cache of heaps of the same or
 * lower priority; memory in use beyond their guarantee of heaps of lower priority, or of any
 * heap when me is under its guarantee; and what is free. */
static uint64_t could_have(const ledger_shm *m, const ledger_slot *me, uint64_t bytes) {
    uint64_t held, higher, g = 0;
    claims(m, me, &held, &higher);
    bool under = add_sat(atomic_load(&me->reserved), bytes) <= me->guarantee;
    for (unsigned i = 0; i < LEDGER_SLOTS; i++) {
        const ledger_slot *o = &m->slot[i];
        if (!same_device(me, o)) continue;
        unsigned answers = atomic_load(&o->answers);
        if (!(answers & CUMA_LEDGER_ANSWERS_CACHE)) continue; /* nobody there to answer */
        uint64_t res = atomic_load(&o->reserved), cached = atomic_load(&o->cached);
        if (cached > res) cached = res;
        if (o->priority <= me->priority || under) g = add_sat(g, cached);
        if ((o->priority < me->priority || under) && (answers & CUMA_LEDGER_ANSWERS_SHRINK)) {
            uint64_t used = res - cached;
            if (used > o->guarantee) g = add_sat(g, used - o->guarantee);
        }
    }
    uint64_t used = add_sat(held, atomic_load(&me->reserved));
    return add_sat(g, used < me->capacity ? me->capacity - used : 0);
}

static void sleep_ms(int ms) {
    struct timespec ts = {0, ms * 1000000L};
    while (nanosleep(&ts, &ts) && errno == EINTR) {
    }
}

/* Posts (want > 0) or withdraws the heap's request (ledger lock held, image fresh). */
static void post(cuma_ledger *l, uint64_t want, uint64_t until) {
    atomic_store(&l->mine.want_until, until);
    atomic_store(&l->mine.want, want);
    if (want) atomic_fetch_add(&l->mine.asks, 1);
    write_mine(l);
    atomic_fetch_add(&l->f->img->seq, 1);
    cuma_ledger_write_seq(l->f);
}

cuma_status cuma_ledger_reclaim(cuma_ledger *l, uint64_t bytes, int64_t timeout_ms,
                                uint64_t (*device_free)(void *), void *ctx) {
    if (!owned(l))
        return cuma_fail(CUMA_ERR_OOM, "ledger %s: a heap inherited through fork", l->path);
    ledger_file *f = l->f;
    /* A request is posted under the lock only: in stale mode nobody could be sure to see it. */
    if (!cuma_ledger_lock(f)) {
        cuma_ledger_unlock(f);
        return cuma_fail(CUMA_ERR_OOM,
                         "device %s (ledger %s): no pressure request posted: the ledger's lock "
                         "has not changed hands for %d ms (a process holding it is stopped?)",
                         l->mine.device, l->path, LEDGER_STALL_MS);
    }
    if (refresh(l)) {
        cuma_ledger_unlock(f);
        return cuma_fail(CUMA_ERR_OOM, "device %s: no pressure request posted: %s", l->mine.device,
                         l->problem);
    }
    reap(f);
    uint64_t could = could_have(f->img, my_slot(l), bytes);
    if (could < bytes || timeout_ms <= 0) {
        cuma_ledger_unlock(f);
        return cuma_fail(CUMA_ERR_OOM,
                         "device %s (ledger %s): the other heaps could give %" PRIu64
                         " bytes at most, %" PRIu64 " needed",
                         l->mine.device, l->path, could, bytes);
    }
    uint64_t deadline = cuma_ledger_now_ns() + (uint64_t)timeout_ms * 1000000ull;
    /* The request outlives the wait a little (the last recheck), not more. */
    post(l, bytes, deadline + 50000000ull);
    cuma_ledger_unlock(f);
    bool ok = false;
    for (;;) {
        sleep_ms(1);
        cuma_ledger_lock(f); /* stale or not: a read is what is needed */
        ok = !refresh(l) && fits(f->img, my_slot(l), bytes);
        cuma_ledger_unlock(f);
        if (ok && device_free) ok = device_free(ctx) >= bytes;
        if (ok || cuma_ledger_now_ns() >= deadline) break;
    }
    bool locked = cuma_ledger_lock(f);
    if (locked && !refresh(l)) {
        post(l, 0, 0);
    } else {
        atomic_store(&l->mine.want, 0); /* withdrawn; the others see it expire */
        write_mine(l);
    }
    cuma_ledger_unlock(f);
    cuma_clear_error();
    if (ok) return CUMA_OK;
    return cuma_fail(CUMA_ERR_OOM,
                     "device %s (ledger %s): %" PRIu64 " bytes asked of the other heaps, not "
                     "given within %" PRId64 " ms",
                     l->mine.device, l->path, bytes, timeout_ms);
}

bool cuma_ledger_asked(cuma_ledger *l, bool *cache, uint64_t *shrink, bool *fresh) {
    if (!owned(l)) return false;
    ledger_file *f = l->f;
    uint64_t seq = cuma_ledger_read_seq(f);
    if (seq == l->seen_seq && !l->active) return false;
    cuma_mutex_lock(&f->mu, CUMA_RANK_LEDGER);
    if (refresh(l)) {
        cuma_mutex_unlock(&f->mu);
        cuma_clear_error();
        return false;
    }
    const ledger_shm *m = f->img;
    *fresh = seq != l->seen_seq;
    l->seen_seq = seq;
    const ledger_slot *me = my_slot(l);
    bool c = false;
    uint64_t want = 0, now = cuma_ledger_now_ns();
    for (unsigned i = 0; i < LEDGER_SLOTS; i++) {
        const ledger_slot *o = &m->slot[i];
        if (!same_device(me, o)) continue;
        uint64_t w = want_of(o, now);
        if (!w) continue;
        /* A heap under its guarantee is owed the memory, whatever its priority. */
        bool under = add_sat(atomic_load(&o->reserved), w) <= o->guarantee;
        if (o->priority >= me->priority || under) c = true;
        /* Only what the requester still lacks: memory free now, or given since it asked (this
         * heap's cache first), is not asked of the callbacks. */
        uint64_t room = room_of(m, o), lack = w > room ? w - room : 0;
        if (o->priority > me->priority || under) want = add_sat(want, lack);
    }
    uint64_t res = atomic_load(&me->reserved), cached = atomic_load(&me->cached);
    cuma_mutex_unlock(&f->mu);
    uint64_t used = res > cached ? res - cached : 0;
    uint64_t over = used > l->mine.guarantee ? used - l->mine.guarantee : 0;
    *cache = c;
    *shrink = want < over ? want : over;
    l->active = c || want;
    return l->active;
}

void cuma_ledger_gave(cuma_ledger *l, uint64_t bytes, uint64_t calls) {
    if (!owned(l)) return;
    cuma_mutex_lock(&l->f->mu, CUMA_RANK_LEDGER);
    ledger_slot *me = &l->mine;
    if (bytes) atomic_fetch_add(&me->given, bytes);
    if (calls) atomic_fetch_add(&me->calls, calls);
    write_mine(l);
    cuma_mutex_unlock(&l->f->mu);
}

/* ---- reading -------------------------------------------------------------------------------- */

static void entry_of(const ledger_slot *s, unsigned i, uint64_t now, cuma_ledger_entry *e) {
    memset(e, 0, sizeof *e);
    e->pid = s->pid;
    e->priority = s->priority;
    e->slot = i;
    memcpy(e->process, s->process, sizeof e->process);
    e->process[sizeof e->process - 1] = 0;
    memcpy(e->device, s->device, sizeof e->device);
    e->device[sizeof e->device - 1] = 0;
    memcpy(e->pod, s->pod, sizeof e->pod);
    e->pod[sizeof e->pod - 1] = 0;
    memcpy(e->pod_namespace, s->pod_namespace, sizeof e->pod_namespace);
    e->pod_namespace[sizeof e->pod_namespace - 1] = 0;
    memcpy(e->container, s->container, sizeof e->container);
    e->container[sizeof e->container - 1] = 0;
    e->capacity = s->capacity;
    e->guarantee = s->guarantee;
    e->limit = atomic_load(&s->limit);
    e->reserved = atomic_load(&s->reserved);
    e->cached = atomic_load(&s->cached);
    e->requested = atomic_load(&s->requested);
    e->peak_reserved = atomic_load(&s->peak);
    e->want = want_of(s, now);
    e->ledger_denials = atomic_load(&s->denials);
    e->pressure_asks = atomic_load(&s->asks);
    e->pressure_given_bytes = atomic_load(&s->given);
    e->pressure_callbacks = atomic_load(&s->calls);
    uint64_t p = atomic_load(&s->published_ns);
    e->age_ns = now > p ? now - p : 0;
    memcpy(e->backend, s->backend, sizeof e->backend);
    e->backend[sizeof e->backend - 1] = 0;
    uint64_t at = atomic_load_explicit(&s->stats_ns, memory_order_acquire);
    e->stats_age_ns = !at ? UINT64_MAX : now > at ? now - at : 0;
    for (unsigned w = 0; w < LEDGER_FIGURES_N; w++) {
        uint64_t v = atomic_load_explicit(ledger_figure(s, w), memory_order_relaxed);
        char *to = (char *)e + figures[w].to;
        if (figures[w].ratio) /* A scribbled slot must not print a share above one. */
            *(double *)to = v > 1000000 ? 1.0 : (double)v / 1e6;
        else
            *(uint64_t *)to = v;
    }
}

void cuma_ledger_self(cuma_ledger *l, cuma_ledger_entry *out) {
    cuma_mutex_lock(&l->f->mu, CUMA_RANK_LEDGER);
    entry_of(&l->mine, l->slot, cuma_ledger_now_ns(), out);
    cuma_mutex_unlock(&l->f->mu);
}

const char *cuma_ledger_where(const cuma_ledger *l) {
    return l->path;
}

const char *cuma_ledger_note(const cuma_ledger *l) {
    return l->f->note;
}

void cuma_ledger_health(cuma_ledger *l, uint64_t *stale, uint64_t *damaged, char *problem,
                        size_t len) {
    *stale = atomic_load(&l->stale);
    *damaged = atomic_load(&l->damaged);
    if (!len) return;
    cuma_mutex_lock(&l->f->mu, CUMA_RANK_LEDGER);
    snprintf(problem, len, "%s", *damaged ? l->problem : "");
    cuma_mutex_unlock(&l->f->mu);
}

cuma_status cuma_ledger_snapshot(const char *name, cuma_ledger_entry *out, size_t max, size_t *n) {
    return cuma_ledger_snapshot_info(name, out, max, n, NULL);
}

cuma_status cuma_ledger_snapshot_info(const char *name, cuma_ledger_entry *out, size_t max,
                                      size_t *n, cuma_ledger_read_info *info) {
    cuma_clear_error();
    if (info) *info = (cuma_ledger_read_info){0};
    if (!n || (max && !out))
        return cuma_fail(CUMA_ERR_INVALID, "cuma_ledger_snapshot: %s is NULL", n ? "out" : "n");
    *n = 0;
    ledger_file *f;
    cuma_status st = cuma_ledger_acquire(name, false, &f);
    if (st) return st;
    /* A holder that does not run: the file as it is, the dead left for later, and the caller
     * told so (its figures may be halfway through an update). */
    bool locked = cuma_ledger_lock(f);
    if (!locked && info) {
        uint64_t now = cuma_ledger_now_ns();
        info->flags |= CUMA_LEDGER_READ_UNLOCKED;
        info->stuck_ns = now > f->stuck_since ? now - f->stuck_since : 0;
    }
    st = cuma_ledger_read(f);
    if (!st) {
        if (locked) reap(f);
        uint64_t now = cuma_ledger_now_ns();
        for (unsigned i = 0; i < LEDGER_SLOTS; i++) {
            const ledger_slot *s = &f->img->slot[i];
            if (atomic_load(&s->state) != 1) continue;
            if (*n < max) entry_of(s, i, now, &out[*n]);
            (*n)++;
        }
    }
    cuma_ledger_unlock(f);
    cuma_ledger_release_file(f);
    return st;
}

void cuma_ledger_test_layout(size_t *header, size_t *slot, size_t *device, size_t *pidns) {
    *header = sizeof(ledger_shm);
    *slot = sizeof(ledger_slot);
    *device = offsetof(ledger_slot, device);
    *pidns = offsetof(ledger_slot, pidns);
}

cuma_status cuma_ledger_test_hold_lock(cuma_ledger *l) {
    bool ok = cuma_ledger_lock(l->f);
    /* Held against the other processes; this one's next lock and unlock end it. */
    l->f->locked = false;
    cuma_mutex_unlock(&l->f->mu);
    return ok ? CUMA_OK : cuma_fail(CUMA_ERR_BACKEND, "ledger %s: lock not taken", l->path);
}

cuma_status cuma_ledger_validate(cuma_ledger *l, uint64_t held) {
    cuma_mutex_lock(&l->f->mu, CUMA_RANK_LEDGER);
    cuma_status st = cuma_ledger_read(l->f);
    ledger_slot file;
    memcpy(&file, &l->f->img->slot[l->slot], sizeof file);
    ledger_slot me;
    memcpy(&me, &l->mine, sizeof me);
    cuma_mutex_unlock(&l->f->mu);
    if (st) return cuma_fail(CUMA_ERR_CORRUPT, "ledger %s: %s", l->path, cuma_last_error());
    /* A heap that came through fork has no slot to compare with: the slot is its parent's. */
    if (!owned(l)) return CUMA_OK;
    if (atomic_load(&file.state) != 1 || file.pid != (int32_t)getpid())
        return cuma_fail(CUMA_ERR_CORRUPT,
                         "ledger %s: slot %u is no longer this heap's in the file (state %u, pid "
                         "%d)",
                         l->path, l->slot, (unsigned)atomic_load(&file.state), file.pid);
    uint64_t r = atomic_load(&me.reserved);
    if (r != held)
        return cuma_fail(CUMA_ERR_CORRUPT,
                         "ledger %s: slot %u says the heap holds %" PRIu64
                         " bytes, the heap %" PRIu64,
                         l->path, l->slot, r, held);
    if (r > me.capacity)
        return cuma_fail(CUMA_ERR_CORRUPT,
                         "ledger %s: slot %u holds %" PRIu64 " bytes of a %" PRIu64 "-byte device",
                         l->path, l->slot, r, me.capacity);
    return CUMA_OK;
}
