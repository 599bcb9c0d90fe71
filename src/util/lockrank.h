// SPDX-License-Identifier: Apache-2.0
/* Lock ranks: the one order in which a thread takes cuma's mutexes, checked in debug builds.
 *
 * Every mutex of the heaps, the ledger, the trace writers and the shim (the default heaps, the
 * LD_PRELOAD interposer) is taken through these wrappers with its rank. With CUMA_LOCK_CHECK
 * (on wherever NDEBUG is not defined: the Debug and ASan builds) a thread that blocks on a mutex
 * whose rank is not above every rank it holds aborts with a message naming both mutexes: the
 * order that would deadlock against another thread fails in any run that takes it, not only in
 * the run whose timing deadlocks. A try or a timed take cannot wait for good, so it is not
 * checked, but what the thread takes while holding it is. Arena locks share a rank and may be
 * held together (in arena order, by cuma_validate). Without CUMA_LOCK_CHECK (Release,
 * RelWithDebInfo) the wrappers are the pthread calls. The order is written out in
 * docs/DESIGN.md (lock order); fork.c's handlers take every lock of every heap, heap after heap,
 * with the check suspended. */
#ifndef CUMA_UTIL_LOCKRANK_H
#define CUMA_UTIL_LOCKRANK_H

#include <pthread.h>
#include <stdbool.h>
#include <time.h>

#ifndef CUMA_LOCK_CHECK
#ifdef NDEBUG
#define CUMA_LOCK_CHECK 0
#else
#define CUMA_LOCK_CHECK 1
#endif
#endif

/* In the order a thread takes them: a mutex is taken only with mutexes of lower ranks held. */
typedef enum cuma_rank {
    CUMA_RANK_OOM_RUN = 1, /* a heap's oom_run: its OOM callbacks run (try or timed only) */
    CUMA_RANK_COMPACT_RUN, /* a heap's compact_run: a compaction, its mover */
    /* The shim's, above the two a callback or a mover runs under (either may make a default
     * heap) and below every heap's lock (they are held around heap creation and destruction). */
    CUMA_RANK_PRELOAD_RETIRE,   /* preload_ctx.c's retire_lock: a device reset retires its heap */
    CUMA_RANK_DEFAULT_CREATE,   /* default_heap.c's create_lock: creation, retirement, shutdown */
    CUMA_RANK_DEFAULT_SETTINGS, /* default_heap.c's settings_lock: the settings string (a leaf) */
    CUMA_RANK_FORK,             /* fork.c's fork_lock: the list of live heaps */
    CUMA_RANK_ARENAS,           /* a heap's arena_lock: making arenas, settings every arena sees */
    CUMA_RANK_TCACHE_REG,       /* tcache.c's registry of heaps and thread caches */
    CUMA_RANK_ARENA,            /* an arena's lock (several at once, in arena order) */
    CUMA_RANK_OOM,              /* a heap's oom_lock: the callback lists, the mover (a leaf) */
    CUMA_RANK_MANAGED,          /* a heap's managed_lock: managed fallbacks */
    CUMA_RANK_POOL_LIST,        /* a heap's pool_lock: its list of pools */
    CUMA_RANK_POOL,             /* a pool's own lock */
    CUMA_RANK_BACKEND,          /* the lock of a backend the arenas share (backend/locked.c) */
    CUMA_RANK_LEDGER_LIST,      /* the ledger's list of open files (coord/ledger_file.c) */
    CUMA_RANK_LEDGER,           /* one ledger file's mutex: its image and slot */
    CUMA_RANK_TRACE_LIST,       /* the trace writers' list (trace/writer.c) */
    CUMA_RANK_TRACE,            /* one trace writer's mutex */
    /* preload_dl.c's owned_lock: the driver memory cuma's backend took (a leaf, taken inside the
     * backend's driver calls, under an arena's and a shared backend's locks). */
    CUMA_RANK_PRELOAD_OWNED,
    CUMA_RANK_N
} cuma_rank;

/* The checker (lockrank.c; built in every build, called only with CUMA_LOCK_CHECK). Before a
 * blocking take of m: aborts if the thread holds a mutex of rank >= r (but arena locks
 * together), else records m as held. */
void cuma_rank_take(pthread_mutex_t *m, cuma_rank r);
/* After a try or timed take of m succeeded: records it as held. */
void cuma_rank_took(pthread_mutex_t *m, cuma_rank r);
/* Before m is unlocked: forgets it. */
void cuma_rank_drop(pthread_mutex_t *m);
void cuma_rank_set_suspended(bool on);

/* fork.c: from prepare to the end of release, the thread takes every heap's locks in turn,
 * against the ranks across heaps; nothing is checked or recorded meanwhile. */
static inline void cuma_rank_suspend(bool on) {
#if CUMA_LOCK_CHECK
    cuma_rank_set_suspended(on);
#else
    (void)on;
#endif
}

static inline void cuma_mutex_lock(pthread_mutex_t *m, cuma_rank r) {
#if CUMA_LOCK_CHECK
    cuma_rank_take(m, r);
#else
    (void)r;
#endif
    pthread_mutex_lock(m);
}

/* A try or timed take's result `e`: the lock is recorded as held only when it was taken. */
static inline int cuma_rank_if_taken(pthread_mutex_t *m, cuma_rank r, int e) {
#if CUMA_LOCK_CHECK
    if (!e) cuma_rank_took(m, r);
#else
    (void)m;
    (void)r;
#endif
    return e;
}

static inline int cuma_mutex_trylock(pthread_mutex_t *m, cuma_rank r) {
    return cuma_rank_if_taken(m, r, pthread_mutex_trylock(m));
}

static inline int cuma_mutex_timedlock(pthread_mutex_t *m, const struct timespec *ts, cuma_rank r) {
    return cuma_rank_if_taken(m, r, pthread_mutex_timedlock(m, ts));
}

static inline void cuma_mutex_unlock(pthread_mutex_t *m) {
#if CUMA_LOCK_CHECK
    cuma_rank_drop(m);
#endif
    pthread_mutex_unlock(m);
}

#endif
