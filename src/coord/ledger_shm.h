/* The ledger's file (internal to src/coord): its layout, shared by ledger.c (what heaps do in
 * it) and ledger_file.c (naming, creating, checking and mapping it). */
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
#define LEDGER_VERSION 2u
#define LEDGER_SLOTS   256u

/* The allocator figures of a slot's stat[] (cuma_ledger_entry's of the same names); fragmentation
 * in parts per million. */
enum {
    LEDGER_ST_PAGE_SIZE,
    LEDGER_ST_ALLOCATED,
    LEDGER_ST_PEAK_REQUESTED,
    LEDGER_ST_MAPPED,
    LEDGER_ST_MANAGED,
    LEDGER_ST_ACTIVE,
    LEDGER_ST_ALLOCS,
    LEDGER_ST_FREES,
    LEDGER_ST_FAILED,
    LEDGER_ST_RETRIES,
    LEDGER_ST_OOMS,
    LEDGER_ST_OOM_CALLS,
    LEDGER_ST_MANAGED_FALLBACKS,
    LEDGER_ST_CREATES,
    LEDGER_ST_RELEASES,
    LEDGER_ST_MAPS,
    LEDGER_ST_UNMAPS,
    LEDGER_ST_TRIMS,
    LEDGER_ST_CALL_NS,
    LEDGER_ST_ARENAS,
    LEDGER_ST_FRAG_PPM,
    LEDGER_ST_N
};

/* One heap. state, pid, start, priority, process, device, backend, capacity and guarantee are
 * written under the ledger lock while the slot is taken (state last, release) and constant until it
 * is freed. reserved grows under the lock (admission reads every slot's under it) and shrinks
 * without it (a heap gives back only what it was given, so it cannot wrap). The rest is the
 * owner's, written without the lock, read by anyone. Invariant: state is 0 (free, all zero)
 * or 1 (live); a live slot's reserved <= capacity. */
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
    /* The owner's allocator figures (LEDGER_ST_*), each published alone: a reader may see some
     * of one publication and some of the previous (counters only grow, so a rate is never
     * negative for long). stats_ns: CLOCK_MONOTONIC of the last publication, 0 = none. */
    _Atomic uint64_t stat[LEDGER_ST_N];
    _Atomic uint64_t stats_ns;
    uint64_t spare[6];
} ledger_slot;

/* The shared file. The header is written once, under flock, before magic is set (release);
 * version, slot count and sizes say which layout it has, so that another build of cuma refuses
 * a ledger it would misread. `seq` changes (under the lock) whenever a pressure request is posted
 * or withdrawn: answering heaps poll it. */
typedef struct ledger_shm {
    _Atomic uint64_t magic;
    uint32_t version, nslots;
    uint32_t slot_size, mutex_size;
    uint64_t size;
    pthread_mutex_t lock;
    _Atomic uint64_t seq;
    uint64_t spare[16];
    ledger_slot slot[];
} ledger_shm;

#define LEDGER_BYTES (sizeof(ledger_shm) + LEDGER_SLOTS * sizeof(ledger_slot))
_Static_assert(offsetof(ledger_slot, state) == 0 && offsetof(ledger_slot, pid) == 4 &&
                   offsetof(ledger_slot, start) == 8,
               "cuma_ledger_test_layout promises the state, the pid, then the start time");

static inline uint64_t cuma_ledger_now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

/* Maps the ledger of that name (`ledger` setting; NULL, "on" or "auto": the user's), creating
 * and initialising it where `create`; the process's mappings are shared by its heaps and
 * counted. path (plen bytes) gets its /dev/shm path. CUMA_ERR_IO (missing, another user's or
 * not private), CUMA_ERR_CORRUPT (another layout), CUMA_ERR_CONFIG (a bad name). */
cuma_status cuma_ledger_acquire(const char *name, bool create, ledger_shm **out, char *path,
                                size_t plen);
/* Drops one use of a mapping cuma_ledger_acquire gave (unmapped with its last). */
void cuma_ledger_release_map(ledger_shm *shm);
/* Writes the header of this build's layout (the slots are left as they are), its robust
 * process-shared lock, then the magic (release). The fuzzer writes headers this way too. */
void cuma_ledger_init_header(ledger_shm *m);
void cuma_ledger_init_lock(ledger_shm *m);
/* CUMA_OK when the header is this build's layout, else CUMA_ERR_CORRUPT naming both. */
cuma_status cuma_ledger_check_header(const ledger_shm *m, const char *path);

#endif
