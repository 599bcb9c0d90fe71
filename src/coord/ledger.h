// SPDX-License-Identifier: Apache-2.0
/* The cross-process ledger (internal side): one slot per heap in POSIX shared memory, through
 * which heaps on one device admit their growth, post pressure requests and answer others'.
 * include/cuma/ledger.h is the public read side. */
#ifndef CUMA_COORD_LEDGER_H
#define CUMA_COORD_LEDGER_H

#include "cuma/ledger.h"

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

typedef struct cuma_ledger cuma_ledger;

/* What a heap brings to the ledger when it joins. */
typedef struct cuma_ledger_join_info {
    const char *name;    /* the `ledger` setting: "on" (the user's default) or a name */
    const char *device;  /* the device's UUID */
    const char *backend; /* its backend's name, for the tools (at most 15 bytes are kept) */
    uint64_t capacity;   /* the device's memory */
    uint64_t guarantee;
    uint64_t limit;
    int priority;
} cuma_ledger_join_info;

/* Takes a slot (creating the ledger if it does not exist). CUMA_ERR_LIMIT when the guarantee
 * does not fit next to the others' guarantees on the device or every slot is taken; CUMA_ERR_IO
 * when the ledger cannot be opened or belongs to another user; CUMA_ERR_CORRUPT when it has
 * another layout (version). The message names the ledger's path. */
cuma_status cuma_ledger_join(const cuma_ledger_join_info *in, cuma_ledger **out);
/* Frees the slot and the mapping (the heap's memory has gone back). NULL is a no-op. */
void cuma_ledger_leave(cuma_ledger *l);

/* The heap wants `bytes` more from the device: CUMA_OK and counted, or CUMA_ERR_OOM when they
 * do not fit next to what the others hold and the guarantees they have not used (and, above the
 * heap's guarantee, next to what heaps of higher priority wait for). */
cuma_status cuma_ledger_admit(cuma_ledger *l, uint64_t bytes);
/* How many more bytes the ledger would admit for the heap now (0 if it cannot tell). */
uint64_t cuma_ledger_room(cuma_ledger *l);
/* The heap gave `bytes` back to the device (at most what it was admitted). */
void cuma_ledger_unadmit(cuma_ledger *l, uint64_t bytes);
void cuma_ledger_set_limit(cuma_ledger *l, uint64_t limit);
/* What a heap can answer a pressure request with: a release thread that gives its idle cache
 * back, pressure callbacks that free memory in use. A requester counts on nothing else (memory
 * nobody will give is not worth waiting for). */
#define CUMA_LEDGER_ANSWERS_CACHE  1u
#define CUMA_LEDGER_ANSWERS_SHRINK 2u

/* Publishes the heap's idle and requested bytes and what it answers with (CUMA_LEDGER_ANSWERS_*)
 * (its release thread, every few ms). A heap that never publishes is counted on for nothing. */
void cuma_ledger_publish(cuma_ledger *l, uint64_t cached, uint64_t requested, unsigned answers);

/* Publishes the heap's allocator figures (its release thread, every CUMA_LEDGER_STATS_NS). */
#define CUMA_LEDGER_STATS_NS 100000000ull
void cuma_ledger_publish_stats(cuma_ledger *l, const cuma_stats *s);

/* The requester's side: posts a pressure request for `bytes` and waits (at most timeout_ms)
 * until they fit, the others having given back what they could. `device_free` (may be NULL)
 * reports the device's free memory, for memory the ledger does not see (other programs).
 * CUMA_OK when they fit (the caller retries; another heap may still be faster), CUMA_ERR_OOM
 * when the others hold nothing they would give or the time ran out. */
cuma_status cuma_ledger_reclaim(cuma_ledger *l, uint64_t bytes, int64_t timeout_ms,
                                uint64_t (*device_free)(void *), void *ctx);

/* The answering side, polled by the heap's release thread: what others ask of this heap now.
 * *cache: give the idle cache back (a heap of the same or higher priority waits); *shrink: bytes
 * in use beyond the guarantee that waiting heaps of higher priority (or under their guarantee)
 * need. *fresh: the requests changed since the last poll (callbacks run once per change).
 * False (and nothing set) when nobody waits. Lock-free: one atomic load when nothing changed. */
bool cuma_ledger_asked(cuma_ledger *l, bool *cache, uint64_t *shrink, bool *fresh);
/* Counts what the heap gave: bytes released and callbacks run. */
void cuma_ledger_gave(cuma_ledger *l, uint64_t bytes, uint64_t calls);

/* This heap's own entry (its slot as cuma_ledger_snapshot reports it). */
void cuma_ledger_self(cuma_ledger *l, cuma_ledger_entry *out);
/* The ledger's path. */
const char *cuma_ledger_where(const cuma_ledger *l);
/* Why the ledger is not where its name would put it (another user squats /dev/shm's name: see
 * cuma_ledger_notice), or "". */
const char *cuma_ledger_note(const cuma_ledger *l);
/* What went wrong with the ledger for this heap: growths admitted in stale mode (the lock's
 * holder did not run), growths denied because the file was damaged (truncated, header written
 * over), and the last damage seen ("" when none; into problem, len bytes). */
void cuma_ledger_health(cuma_ledger *l, uint64_t *stale, uint64_t *damaged, char *problem,
                        size_t len);

/* Tests: where the slots lie in the file (a slot starts with its 4-byte state, 1 = live, its
 * 4-byte pid and its 8-byte start time: field 22 of /proc/PID/stat) and where in a slot its
 * device's name (64 bytes) and its PID namespace (8 bytes, 0 = unknown) are. */
void cuma_ledger_test_layout(size_t *header, size_t *slot, size_t *device, size_t *pidns);
/* Tests and tools' fixtures: takes the ledger's lock and keeps it against the other processes
 * (a process that then dies, or stops, holding it); this process's next ledger call that takes
 * the lock gives it back. */
cuma_status cuma_ledger_test_hold_lock(cuma_ledger *l);

/* Checks the slot against what the heap says it holds (bytes admitted) and the ledger's
 * header. CUMA_ERR_CORRUPT naming what differs. */
cuma_status cuma_ledger_validate(cuma_ledger *l, uint64_t held);

#endif
