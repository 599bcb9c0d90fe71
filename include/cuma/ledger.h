// SPDX-License-Identifier: Apache-2.0
/* cuma's cross-process ledger: the heaps of several processes that share GPUs.
 *
 * Every heap on a CUDA device (and a heap on the simulated device that names a ledger) has a
 * slot in a ledger in POSIX shared memory, one per user (mode 0600; `ledger:@GROUP` one that the
 * members of a Unix group share, mode 0660): its process, device (by
 * UUID), priority, guarantee, limit and what it holds. A heap grows only while the device has
 * room for it next to what the others hold and the guarantees they have not used yet; one that
 * cannot grow asks the others (a pressure request): heaps of the same or lower priority give
 * their idle cache back, heaps of lower priority (or any heap, for a heap under its guarantee)
 * are asked to shrink towards their guarantee (their pressure callbacks). Settings: `ledger`,
 * `priority`, `guarantee`, `pressure_timeout_ms` (cuma config).
 *
 * This header is the read side for tools (`cuma ps`, `cuma top`, `cuma exporter`) and the
 * pressure callback of a heap. Thread-safe.
 */
#ifndef CUMA_LEDGER_H
#define CUMA_LEDGER_H

#include "cuma/cuma.h"

#ifdef __cplusplus
extern "C" {
#endif

/* One heap in the ledger, as of the snapshot. Sizes in bytes. */
typedef struct cuma_ledger_entry {
    int pid;
    int priority;      /* higher wins */
    unsigned slot;     /* index in the ledger */
    char process[32];  /* the process's name (comm) */
    char device[64];   /* the device's UUID ("GPU-..."), or "sim" */
    uint64_t capacity; /* the device's memory */
    uint64_t guarantee;
    uint64_t limit;
    uint64_t reserved; /* held from the device (what the ledger admitted) */
    uint64_t cached;   /* of which idle, thread caches' blocks included (published every few ms
                          and after each release) */
    uint64_t requested;
    uint64_t peak_reserved;
    uint64_t want; /* bytes it waits for now (a pressure request), 0 if none or
                      expired (its requester gone or stopped past its timeout) */
    /* Counted by the ledger itself; the heap's cuma_stats has them under the same names. */
    uint64_t ledger_denials;       /* growths the ledger refused */
    uint64_t pressure_asks;        /* pressure requests it posted */
    uint64_t pressure_given_bytes; /* bytes it gave back on others' requests */
    uint64_t pressure_callbacks;   /* pressure callbacks it ran */
    uint64_t age_ns;               /* since its figures were last published */
    /* The heap's allocator figures: those of the list in cuma.h that the ledger carries, under
     * the same names, published by its release thread every 100 ms: what `cuma stats`, `cuma
     * top` and `cuma exporter` show of a process from outside. stats_age_ns says how old they
     * are; UINT64_MAX while the heap has published none (a heap without a release thread never
     * does). A new figure of the list that names a ledger word needs its field here (at the
     * end: the layout is the ABI); the ledger's build fails until it has one. */
    char backend[16]; /* "vmm", "segment", "managed" or "sim" */
    uint64_t page_size;
    uint64_t allocated_bytes;
    uint64_t peak_requested_bytes;
    uint64_t mapped_bytes;
    uint64_t managed_bytes;
    uint64_t active_allocs;
    uint64_t num_allocs, num_frees, failed_allocs, alloc_retries, ooms, oom_callbacks;
    uint64_t managed_fallbacks;
    uint64_t page_creates, page_releases, maps, unmaps, trims;
    uint64_t page_call_ns;
    uint64_t arenas;
    double fragmentation;
    uint64_t stats_age_ns;
    /* Kubernetes: the process's POD_NAME, POD_NAMESPACE and CONTAINER_NAME when it joined
     * (empty outside a pod, or where the manifest does not set them). */
    char pod[64];
    char pod_namespace[64];
    char container[64];
    /* Allocator figures too (0 from a heap of a cuma build without compaction). */
    uint64_t compactions, compact_moved_bytes, compact_freed_pages;
} cuma_ledger_entry;

/* The live heaps of a ledger (name NULL, "on" or "auto": the user's ledger; else the name the
 * `ledger` setting gives). Dead processes' slots are reclaimed first. At most `max` entries go
 * to out (may be NULL when max is 0); *n gets the number of live heaps. CUMA_ERR_IO when the
 * ledger does not exist (no heap has used it) or cannot be read, with the path in the
 * message. */
cuma_status cuma_ledger_snapshot(const char *name, cuma_ledger_entry *out, size_t max, size_t *n);

/* How a snapshot was read (cuma_ledger_snapshot_info). */
#define CUMA_LEDGER_READ_UNLOCKED 1u /* without the ledger lock: see below */
typedef struct cuma_ledger_read_info {
    unsigned flags; /* CUMA_LEDGER_READ_* */
    /* With CUMA_LEDGER_READ_UNLOCKED: how long this process has seen the lock not change
     * hands, a lower bound on how long its holder has been stuck; else 0. */
    uint64_t stuck_ns;
} cuma_ledger_read_info;

/* cuma_ledger_snapshot, and how it was read into *info (may be NULL; zeros unless CUMA_OK
 * and read so). A snapshot is read under
 * the ledger lock. When a process holds that lock and does not run (stopped: Ctrl-Z, a
 * debugger), the read waits for it 2 s at most, then reads the file without the lock and
 * returns CUMA_OK with CUMA_LEDGER_READ_UNLOCKED: the figures are current, but not
 * guaranteed consistent (a heap may be halfway through an update that the lock orders), and
 * dead processes' slots are not reclaimed (they may still show). Until the lock changes hands,
 * later reads in this process do not wait again (they are unlocked at once). Tools must say
 * so, not present such a read as a normal one or as a failure. */
cuma_status cuma_ledger_snapshot_info(const char *name, cuma_ledger_entry *out, size_t max,
                                      size_t *n, cuma_ledger_read_info *info);

/* The path of a ledger (for messages and tools), into buf (NUL-terminated): /dev/shm/cuma-UID
 * [-NAME] (a group's: /dev/shm/cuma-gGID[-NAME]), or, where another user squats that name in
 * /dev/shm, the same name in /run/user/UID when that is the user's private directory. The
 * squatter's file is never used. CUMA_ERR_IO when a squatted name has nowhere else to go. */
cuma_status cuma_ledger_path(const char *name, char *buf, size_t len);

/* Why the ledger of that name is not in /dev/shm (a squatter, and where it is instead), or ""
 * into buf; on CUMA_ERR_IO (a squatted name with nowhere to go), the error. */
cuma_status cuma_ledger_notice(const char *name, char *buf, size_t len);

/* Pressure callback: another heap on the device (of higher priority, or under its guarantee)
 * needs `bytes` that this heap holds in use beyond its guarantee. Called from the heap's
 * release thread, without heap locks, once per request; the program may free memory (through
 * cuma_free on this heap, from any thread), halve its batch, or ignore it. */
typedef void (*cuma_pressure_fn)(void *user, cuma_heap *heap, uint64_t bytes);

/* Registers a pressure callback; *id (may be NULL) gets a handle for removal. At most 16.
 * A heap with pressure callbacks tells the ledger so: only such heaps' memory in use counts as
 * memory a requester may wait for. A removal returns once no run of this heap's callbacks that
 * could still call the removed one is in progress, so what it uses may be freed then; so do not
 * remove one from a thread that a running callback waits for. Removed from inside one of this
 * heap's callbacks, it may still be called once by a run already in progress. */
cuma_status cuma_add_pressure_callback(cuma_heap *heap, cuma_pressure_fn fn, void *user, int *id);
cuma_status cuma_remove_pressure_callback(cuma_heap *heap, int id);

#ifdef __cplusplus
}
#endif
#endif
