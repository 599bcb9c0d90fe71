// SPDX-License-Identifier: Apache-2.0
/* Per-thread caches: the fast path.
 *
 * A training loop frees and reallocates the same sizes over and over. A thread's cache keeps
 * blocks it freed, by exact rounded size and stream, with their pages still mapped, and hands
 * them out again without the arena lock, the policy or the page table: an alloc+free pair
 * costs a few loads and stores, one atomic exchange and one compare-and-swap.
 *
 * Ownership: a cache belongs to one thread (its owner) and one arena of a heap. Only the owner
 * pushes to and pops from its bins and touches its pointer table. Any thread holding the arena lock
 * may flush a cache (to give memory back: trim, out-of-memory, idle age, limit): it takes blocks
 * out of the slots with atomic exchanges, so owner and flusher never both get a block.
 *
 * Block generations (cuma_block.gen): odd while the program holds the block, even otherwise;
 * each hand-over bumps it. The owner's pointer table remembers the generation it handed out, so
 * a stale entry (the block freed meanwhile by another thread) is recognised, and a free racing
 * another free of the same pointer loses a compare-and-swap instead of corrupting the heap.
 *
 * Memory: a cache holds at most `tcache_bytes` per thread, blocks of at most `tcache_max` bytes,
 * and its blocks go back to the heap when they have sat longer than `tcache_age_ms`, at most
 * `release_delay_ms` (the release thread and every slow path check), so it costs memory only
 * for a moment. Their pages age from the block's push, not from the flush: memory idle in a
 * cache is idle memory, and the release delay counts from when the program freed it.
 */
#ifndef CUMA_HEAP_TCACHE_H
#define CUMA_HEAP_TCACHE_H

#include "place/block.h"
#include "cuma/cuma.h"

#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>

#define CUMA_TC_BINS    128
#define CUMA_TC_DEPTH   16
#define CUMA_TC_STREAMS 8
/* 16: a batch amortises the lock over its frees, and giving back 32 at once made the slowest
 * 0.1 % of calls on lstm_phases twice as slow (the drain is that call's work). */
#define CUMA_TC_PENDING 16

struct cuma_arena;
typedef struct cuma_arena cuma_arena;

/* Invariants: every non-NULL slot lies in [0, n); all its blocks have `size` bytes, stream
 * `stream` and an even generation. size, stream, n and stamp are the owner's; slots are
 * shared (atomic). */
typedef struct cuma_tc_bin {
    uint64_t size;
    uint16_t stream;
    unsigned n;
    _Atomic uint64_t stamp; /* coarse time of the last push (owner writes, flushers read) */
    _Atomic(cuma_block *) slot[CUMA_TC_DEPTH];
} cuma_tc_bin;

typedef struct cuma_tc_entry {
    uint64_t key; /* address; 0 = empty */
    cuma_block *b;
    uint64_t gen;
} cuma_tc_entry;

/* Owner-only fields are marked; the counters are written by the owner alone (plain stores to
 * atomics) and read by snapshots; `next` is under the arena lock. */
typedef struct cuma_tcache {
    struct cuma_arena *arena; /* the arena it caches blocks of */
    uint64_t arena_id;
    /* The heap, and the arena's settings the fast paths read, copied here (constant) so that a
     * call touches the cache's own lines rather than the arena's. */
    struct cuma_heap *heap;
    uint64_t base, max_block, max_bytes;
    unsigned page_shift; /* 0: no page references to keep (a layer without refs, phys.h) */
    cuma_tc_bin bins[CUMA_TC_BINS];
    cuma_tc_entry *tab; /* owner: pointer table, 4-way sets, tabcap a power of two */
    uint32_t tabcap, tabn;
    uint32_t tabgen; /* owner: bumped when the table is rebuilt (slots move) */
    struct {
        cuma_stream handle;
        uint16_t index;
    } streams[CUMA_TC_STREAMS]; /* owner: stream handle -> heap stream index */
    unsigned nstreams;
    uint64_t stream_gen; /* owner: the arena's stream_gen that `streams` is valid for */
    uint64_t held;       /* owner: bytes it believes its bins hold */
    /* owner: the other arenas' published requested bytes as of this thread's last slow call.
     * The fast path's peak check reads them from here rather than from lines that threads in
     * those arenas keep writing. */
    int64_t others_req;
    /* Frees the bins refuse (too big, bin taken, full): batched, so that one acquisition of the
     * arena lock returns up to CUMA_TC_PENDING of them. Slots like a bin's: the owner pushes,
     * the owner's next slow call (or any flusher) takes them. */
    _Atomic(cuma_block *) pending[CUMA_TC_PENDING];
    unsigned npending;              /* owner */
    _Atomic uint64_t pending_stamp; /* coarse time of the first pending free */
    _Atomic int64_t requested, allocated;
    _Atomic uint64_t allocs, frees;
    struct cuma_tcache *next;
} cuma_tcache;

/* The calling thread's most recently used cache, checked inline on every call. */
typedef struct cuma_tl_slot {
    struct cuma_arena *arena;
    uint64_t arena_id;
    cuma_tcache *tc;
} cuma_tl_slot;
/* initial-exec: a fixed offset from the thread pointer, where the default model for a shared
 * library calls __tls_get_addr on every access (twice per alloc+free pair). It takes a few bytes
 * of the static TLS space that glibc keeps for libraries loaded later (dlopen, ctypes). */
extern _Thread_local cuma_tl_slot cuma_tl_last
    __attribute__((visibility("hidden"), tls_model("initial-exec")));

cuma_tcache *cuma_tcache_get_slow(cuma_arena *a);

/* The calling thread's cache for arena a (whose id is `id`), created on first use; NULL if the
 * heap disables caches or no memory could be had (the caller then takes the slow path). */
static inline cuma_tcache *cuma_tcache_get(cuma_arena *a, uint64_t id) {
    if (cuma_tl_last.arena == a && cuma_tl_last.arena_id == id && cuma_tl_last.tc)
        return cuma_tl_last.tc;
    return cuma_tcache_get_slow(a);
}

/* Fast paths (tcache_fast.h, inline). cuma_tcache_alloc: true when done, false to take the
 * slow path (nothing changed then). cuma_tcache_free: MISS takes the slow path (nothing
 * changed); DONE is done; DRAIN is done and the batch of pending frees is full: the caller
 * drains it under the arena lock. */
typedef enum { CUMA_TC_MISS = 0, CUMA_TC_DONE = 1, CUMA_TC_DRAIN = 2 } cuma_tc_result;

/* Returns the owner's pending frees to the arena (arena lock held, owner thread). */
/* give(a, block, since): since is when the block went idle in the cache (coarse time), or
 * UINT64_MAX for now. */
typedef void (*cuma_tc_give)(cuma_arena *, cuma_block *, uint64_t since);
void cuma_tcache_drain(cuma_arena *a, cuma_tcache *tc, cuma_tc_give give);

/* Slow-path hooks for the calling thread (arena lock held): remember a block it was handed and
 * the index of a stream it used, so that its next free and alloc can go fast (a stream map from
 * before a stream's retirement is dropped first). */
void cuma_tcache_note_alloc(cuma_tcache *tc, cuma_block *b, uint64_t addr);
void cuma_tcache_note_stream(cuma_tcache *tc, cuma_stream handle, unsigned index);

/* Takes blocks out of every cache of the arena (arena lock held): all of them, or those idle
 * since before `older_than` (coarse time). Calls give(h, block, since) for each, since the
 * stamp of its bin's last push. */
void cuma_tcache_flush_all(cuma_arena *a, uint64_t older_than, cuma_tc_give give);

/* Oldest stamp among non-empty bins of the arena's caches (UINT64_MAX if none). Arena lock held;
 * a racing owner may make it stale, which only moves a flush a little. */
uint64_t cuma_tcache_oldest(cuma_arena *a);

/* What the blocks in the arena's caches alone hold (arena lock held): on pages, the bytes of the
 * pages no live block overlaps; in segment mode, the blocks' bytes. Reads every slot (a few
 * thousand loads a cache) and no fast-path state, so the fast paths keep no count; an owner that
 * moves a block meanwhile makes it off by that block for a moment. */
uint64_t cuma_tcache_idle_bytes(cuma_arena *a);

/* Frees every cache of a heap being destroyed (arena lock held, no other thread inside). */
void cuma_tcache_destroy_all(cuma_arena *a);

/* Arena registry, so that a thread's exit can tell whether an arena it cached still lives. */
uint64_t cuma_tcache_register_arena(cuma_arena *a);
void cuma_tcache_unregister_arena(cuma_arena *a);
/* fork.c: the registry's lock is held across a fork (taken before, released after in both). */
void cuma_tcache_prefork(void);
void cuma_tcache_postfork(void);

/* A cache leaves its arena (its thread ended; arena lock held): its counters join the arena's. */
void cuma_tcache_sums_retire(cuma_arena *a, cuma_tcache *tc);

/* Sums of the caches' counters (arena lock held). */
void cuma_tcache_sums(cuma_arena *a, int64_t *requested, int64_t *allocated, int64_t *active,
                      uint64_t *allocs, uint64_t *frees);

#endif
