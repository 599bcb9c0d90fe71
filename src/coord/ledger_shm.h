// SPDX-License-Identifier: Apache-2.0
/* The ledger's file (internal to src/coord): its layout, shared by ledger.c (what heaps do in
 * it) and ledger_file.c (naming, creating, checking, locking and reading it).
 *
 * The file is never mapped: every process reads it with pread into a private image and writes
 * its own slots (and, under the lock, the header's counters) with pwrite. Whatever another
 * process writes into the file, or however it truncates it, a read is at worst short or full of
 * nonsense, which is checked; a mapping would have died of SIGBUS on a truncated file, and an
 * in-file mutex could be broken by any garbage written over it. */
#ifndef CUMA_COORD_LEDGER_SHM_H
#define CUMA_COORD_LEDGER_SHM_H

#include "cuma/cuma.h"

#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <time.h>

#define LEDGER_MAGIC   0x3152474c414d5543ull /* "CUMALGR1" */
#define LEDGER_VERSION 4u /* 3: no in-file mutex, a lock generation; 4: Kubernetes names */
#define LEDGER_SLOTS   256u

/* A slot's allocator figures: the figures of the list in cuma.h that name a ledger word (the
 * fields of cuma_ledger_entry of the same names). Word w is stat[w] below while w < LEDGER_ST_N,
 * else compact[w - LEDGER_ST_N] (words that came later, in what were spare words); a ratio
 * travels in parts per million. LEDGER_FIG_name is a figure's word (-1: not in the ledger). */
#define LEDGER_ST_N      21u
#define LEDGER_FIGURES_N 24u
enum {
#define LEDGER_FIG(type, name, kind, where, help) LEDGER_FIG_##name = CUMA_STAT_WORD(where),
    CUMA_STATS_FIELDS(LEDGER_FIG)
#undef LEDGER_FIG
};

/* One heap. Its owner keeps the slot in its handle and writes it whole into the file whenever
 * it changes (the handle's copy is the truth for the owner: what others write over it is
 * overwritten). A slot is taken (state 1) by a process holding the ledger lock or the slot's
 * claim lock (ledger_file.c); reserved grows under the ledger lock (admission reads every slot
 * under it) except in stale mode, and shrinks without it. A dead process's slot is cleared under
 * the ledger lock. Invariant (of a slot this build wrote): state is 0 (free, all zero) or 1
 * (live); a live slot's reserved <= capacity. Slots read from the file are trusted for nothing:
 * sums saturate, strings are cut. */
typedef struct ledger_slot {
    _Atomic uint32_t state;
    int32_t pid;
    uint64_t start; /* the process's start time (clock ticks since boot), for pid reuse */
    int32_t priority;
    _Atomic uint32_t answers; /* owner, at each publish: CUMA_LEDGER_ANSWERS_* */
    char process[32];
    char device[64];
    char backend[16];
    uint64_t capacity, guarantee;
    _Atomic uint64_t limit;
    _Atomic uint64_t reserved, peak;
    _Atomic uint64_t cached, requested;
    _Atomic uint64_t want; /* written under the lock, with seq bumped */
    /* CLOCK_MONOTONIC after which want no longer counts: a requester killed or stopped while it
     * waits (so that it never withdraws) holds nobody back for longer than its timeout. */
    _Atomic uint64_t want_until;
    _Atomic uint64_t denials, asks, given, calls;
    _Atomic uint64_t published_ns; /* CLOCK_MONOTONIC of the owner's last publish */
    uint64_t pidns; /* the PID namespace its pid means something in (inode), 0 if unknown */
    /* The owner's allocator figures (words 0 to LEDGER_ST_N - 1), each published alone: a reader
     * may see some of one publication and some of the previous (counters only grow, so a rate is
     * never negative for long). stats_ns: CLOCK_MONOTONIC of the last publication, 0 = none. */
    _Atomic uint64_t stat[LEDGER_ST_N];
    _Atomic uint64_t stats_ns;
    /* Where the process runs in Kubernetes (POD_NAME, POD_NAMESPACE, CONTAINER_NAME, which the
     * manifests set from the downward API; empty outside), written once at join, so that the
     * exporter's series join with the pod's. */
    char pod[64], pod_namespace[64], container[64];
    /* Words LEDGER_ST_N and up (the compaction figures), published with stat[] in what were
     * spare words: a build that predates them writes zeros there, so the layout (and
     * LEDGER_VERSION) stays as it was. Three more figures fit the same way: compact[] grows by
     * what spare[] shrinks (LEDGER_FIGURES_N with it), which the assert below keeps honest. */
    _Atomic uint64_t compact[LEDGER_FIGURES_N - LEDGER_ST_N];
    uint64_t spare[3];
} ledger_slot;

/* The shared file. The header is written once, under the ledger lock, when the file is made;
 * version, slot count and sizes say which layout it has, so that another build of cuma refuses
 * a ledger it would misread. `seq` changes (under the lock) whenever a pressure request is posted
 * or withdrawn: answering heaps poll it with an 8-byte pread. `lockgen` grows each time the lock
 * is taken: a waiter that sees it move knows the lock changes hands (contention, wait on), one
 * that does not for LEDGER_STALL_MS knows its holder is stuck (stale mode). */
typedef struct ledger_shm {
    _Atomic uint64_t magic;
    uint32_t version, nslots;
    uint32_t slot_size, header_size;
    uint64_t size;
    _Atomic uint64_t lockgen;
    _Atomic uint64_t seq;
    uint64_t spare[16];
    ledger_slot slot[];
} ledger_shm;

/* Slot word w of the allocator figures (of a const slot too: readers only load it). */
static inline _Atomic uint64_t *ledger_figure(const ledger_slot *s, unsigned w) {
    return (_Atomic uint64_t *)(w < LEDGER_ST_N ? &s->stat[w] : &s->compact[w - LEDGER_ST_N]);
}

/* The layout of LEDGER_VERSION 4, which every build that names that version must keep: a new
 * allocator figure needs a spare word (or a new version). */
_Static_assert(sizeof(ledger_slot) == 672 && offsetof(ledger_slot, stat) == 256 &&
                   offsetof(ledger_slot, compact) == 624,
               "ledger_slot's layout changed: bump LEDGER_VERSION");

#define LEDGER_BYTES (sizeof(ledger_shm) + LEDGER_SLOTS * sizeof(ledger_slot))
_Static_assert(offsetof(ledger_slot, state) == 0 && offsetof(ledger_slot, pid) == 4 &&
                   offsetof(ledger_slot, start) == 8,
               "cuma_ledger_test_layout promises the state, the pid, then the start time");

static inline uint64_t cuma_ledger_now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

/* How long a waiter for the ledger lock waits without seeing it change hands before it deems
 * the holder stuck (stopped, or a process that scribbled over lockgen), and how long at most
 * whatever it sees. */
#define LEDGER_STALL_MS    2000
#define LEDGER_LOCK_CAP_MS 30000

/* The process's one open ledger file per ledger (shared by its heaps and snapshots). fd, path,
 * ino and pid are constant; img and locked are under mu. The ledger lock is an OFD lock on the
 * file's byte 0 (F_OFD_SETLK): the kernel drops it when its holder dies, and nothing written into
 * the file can break it. OFD locks belong to the open file, so mu makes one thread of the process
 * at a time its holder, and a forked child (which shares the open file) opens its own. */
typedef struct ledger_file {
    char path[160];
    char note[384]; /* why the ledger is not where it would be ("" when it is) */
    int fd;
    pid_t pid; /* the process that opened it: a child of fork does not use it */
    uint64_t ino;
    unsigned refs; /* under the list's lock */
    pthread_mutex_t mu;
    ledger_shm *img; /* LEDGER_BYTES: the file as last read */
    bool locked;     /* this process holds the ledger lock */
    /* The last wait found the lock stuck with lockgen stuck_gen: until it moves, no waiting.
     * stuck_since: CLOCK_MONOTONIC ns when this process last saw the lock change hands (or
     * began to wait for it), for how long it has been stuck. Under mu. */
    bool stuck;
    uint64_t stuck_gen, stuck_since;
    struct ledger_file *next;
} ledger_file;

/* Opens the ledger of that name (`ledger` setting; NULL, "on" or "auto": the user's), creating
 * and initialising it where `create`; the process's files are shared by its heaps and counted.
 * CUMA_ERR_IO (missing, another user's, not private, not a regular file), CUMA_ERR_CORRUPT
 * (another layout, or damaged), CUMA_ERR_CONFIG (a bad name). */
cuma_status cuma_ledger_acquire(const char *name, bool create, ledger_file **out);
/* Drops one use of a file cuma_ledger_acquire gave (closed with its last). */
void cuma_ledger_release_file(ledger_file *f);

/* Takes f->mu, then the ledger lock: true once held; false (mu held, the lock not) when its
 * holder is stuck (see LEDGER_STALL_MS; f->stuck is then set, f->stuck_since says since when):
 * the caller goes on in stale mode. */
bool cuma_ledger_lock(ledger_file *f);
/* Gives the ledger lock back (if held), then mu. */
void cuma_ledger_unlock(ledger_file *f);
/* Reads the file into f->img (mu held) and checks its header: CUMA_ERR_CORRUPT naming what is
 * wrong (short: truncated; magic, version, sizes). */
cuma_status cuma_ledger_read(ledger_file *f);
/* Writes slot i (mu held). */
cuma_status cuma_ledger_write_slot(ledger_file *f, unsigned i, const ledger_slot *s);
/* Writes f->img->seq (ledger lock held). */
void cuma_ledger_write_seq(ledger_file *f);
/* The file's seq now, without a lock (UINT64_MAX when it cannot be read). */
uint64_t cuma_ledger_read_seq(ledger_file *f);
/* Claims free slot i of the file without the ledger lock (stale mode): under the slot's claim
 * lock, reads it again and writes s there if it is still free. CUMA_OK, or CUMA_ERR_LIMIT when
 * it was taken meanwhile (or its claim lock is held). */
cuma_status cuma_ledger_claim_slot(ledger_file *f, unsigned i, const ledger_slot *s);

/* Writes the header of this build's layout into m (the slots are left as they are), magic
 * last. The fuzzer writes headers this way too. */
void cuma_ledger_init_header(ledger_shm *m);
/* CUMA_OK when the header is this build's layout, else CUMA_ERR_CORRUPT naming both. */
cuma_status cuma_ledger_check_header(const ledger_shm *m, const char *path);

#endif
