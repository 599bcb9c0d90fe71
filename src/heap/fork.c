// SPDX-License-Identifier: Apache-2.0
/* Heaps across fork(): the child gets a copy of every heap, but only the thread that forked.
 *
 * A lock another thread held at the fork would stay held in the child forever, and its release
 * thread's condition variable would keep a waiter that no longer exists (glibc's
 * pthread_cond_destroy then waits for it: the child hung in cuma_heap_destroy). So, as host
 * allocators do, the fork is bracketed: before it, the forking thread takes every lock of every
 * live heap in the one order the rest of cuma takes them in, so that no heap is caught in the
 * middle of a change; after it, the parent and the child release them, and the child also
 * forgets the release threads it does not have (its heaps give idle memory back from their
 * allocation and free calls only) and starts their condition variables afresh.
 *
 * Lock order (the same everywhere): fork_lock, each heap's arena_lock, the thread caches'
 * registry lock, each heap's arena locks in arena order, its oom_lock and managed_lock, its
 * pool list lock and then each of its pools' locks (pool.c), its shared backend's lock, then the
 * ledger's mapping list and the trace writers' locks (a heap logs under its arena's lock). A child
 * drops the trace logs it inherited (they are the parent's files) and logs nothing. No file is
 * opened under any of these locks (a trace log is opened between two short holds of the writers'
 * list lock, writer.c's claim), so a fork never waits for a slow open; the only system calls under
 * them are a log's writes and its close. Nothing here runs with a heap lock held; heap creation and
 * destruction take fork_lock alone. A heap's oom_run (held while a thread runs its OOM callbacks,
 * which may take long, or fork) and its compact_run (held while a compaction's mover runs) are
 * not taken: they start free in the child, whose copy of the callbacks' thread does not exist.
 * lockrank.h ranks this order, and debug builds check it (docs/DESIGN.md, lock order).
 *
 * What a child may do with an inherited heap depends on the device: a simulated heap works as
 * it did; a heap whose memory is the parent's (CUDA memory, which a forked child cannot use
 * anyway, or a simulated device with host backing, whose pages the two processes share) refuses
 * every call but cuma_heap_destroy with CUMA_ERR_UNSUPPORTED, since handing out or giving back
 * one of its pages would change the parent's memory; destroying it frees the child's copy. */
#include "util/error.h"
#include "heap/heap.h"
#include "heap/pools.h"
#include "heap/tcache.h"
#include "trace/writer.h"

#include <pthread.h>
#include <stdlib.h>

/* Under fork_lock: the live heaps, linked through fork_next / fork_prev. */
static pthread_mutex_t fork_lock = PTHREAD_MUTEX_INITIALIZER;
static cuma_heap *live_heaps;
static pthread_once_t hooks_once = PTHREAD_ONCE_INIT;
/* Under fork_lock: the layers above the heaps whose locks a fork holds after theirs
 * (cuma_fork_layer: the ledger's mapping list), in the order they were added. */
static struct { void (*prepare)(void), (*release)(void); } layers[4];
static unsigned nlayers;

static unsigned arenas_of(cuma_heap *h) {
    return atomic_load_explicit(&h->narenas, memory_order_acquire);
}

static void prepare(void) {
    /* Heap after heap: the second heap's arena locks come after the first's backend lock, which
     * ranks above them (lockrank.h). fork_lock keeps any other thread out meanwhile. */
    cuma_rank_suspend(true);
    cuma_mutex_lock(&fork_lock, CUMA_RANK_FORK);
    for (cuma_heap *h = live_heaps; h; h = h->fork_next)
        cuma_mutex_lock(&h->arena_lock, CUMA_RANK_ARENAS);
    cuma_tcache_prefork();
    for (cuma_heap *h = live_heaps; h; h = h->fork_next) {
        /* arena_lock is held: no arena is being added, narenas is final. */
        for (unsigned i = 0, n = arenas_of(h); i < n; i++)
            cuma_mutex_lock(&h->arenas[i]->lock, CUMA_RANK_ARENA);
        cuma_mutex_lock(&h->oom_lock, CUMA_RANK_OOM);
        cuma_mutex_lock(&h->managed_lock, CUMA_RANK_MANAGED);
        cuma_pools_prefork(h);
        cuma_backend_lock(h->be);
    }
    for (unsigned i = 0; i < nlayers; i++) layers[i].prepare();
    cuma_trace_writer_prefork();
}

/* Releases what prepare took, in reverse. In the child, also forgets the release threads (and an
 * OOM callback another thread was in), and retires heaps whose memory is the parent's. */
static void release(bool child) {
    cuma_trace_writer_postfork(child);
    for (unsigned i = nlayers; i-- > 0;) layers[i].release();
    for (cuma_heap *h = live_heaps; h; h = h->fork_next) {
        if (child) {
            /* A thread of the parent's may have been running the callbacks: not in the child. */
            pthread_mutex_init(&h->oom_run, NULL);
            h->cb_runs = 0; /* nor any run of a callback list (oom_lock is held here) */
            pthread_cond_init(&h->cb_done, NULL);
            pthread_mutex_init(&h->compact_run, NULL); /* likewise a compaction's mover */
            atomic_store(&h->oom_dump_at, 0); /* the parent's last dump is not the child's */
            if (!(cuma_backend_unwrap(h->be)->caps & CUMA_CAP_FORK_PRIVATE)) {
                /* Its pages are the parent's (device memory, or a simulated device's shared host
                 * backing): handing one out, or giving one back, would change the parent's. The
                 * fast paths go, so that every call reaches the check. */
                atomic_store(&h->inherited, true);
                for (unsigned i = 0, n = arenas_of(h); i < n; i++) {
                    h->arenas[i]->fast_max = 0;
                    h->arenas[i]->tc_on = false;
                }
            }
        }
        cuma_backend_unlock(h->be);
        cuma_pools_postfork(h);
        cuma_mutex_unlock(&h->managed_lock);
        cuma_mutex_unlock(&h->oom_lock);
        for (unsigned i = arenas_of(h); i-- > 0;) {
            cuma_arena *a = h->arenas[i];
            if (child && a->thread_running) {
                /* Its thread did not come along: nothing to stop or join at destroy, and the
                 * condition variable must not wait for the waiter it had in the parent. */
                a->thread_running = false;
                cuma_arena_init_wake(a);
            }
            cuma_mutex_unlock(&a->lock);
        }
    }
    cuma_tcache_postfork();
    for (cuma_heap *h = live_heaps; h; h = h->fork_next) cuma_mutex_unlock(&h->arena_lock);
    cuma_mutex_unlock(&fork_lock);
    cuma_rank_suspend(false);
}

static void parent(void) {
    release(false);
}

static void child(void) {
    release(true);
}

static void install_hooks(void) {
    pthread_atfork(prepare, parent, child);
}

cuma_status cuma_heap_inherited(cuma_heap *h, const char *call) {
    return cuma_fail(CUMA_ERR_UNSUPPORTED,
                     "%s: heap %p came through fork, and its memory is the parent's (backend %s): "
                     "only cuma_heap_destroy works in the child; make a heap of its own",
                     call, (void *)h, h->be->name);
}

void cuma_fork_layer(void (*prepare)(void), void (*release)(void)) {
    cuma_mutex_lock(&fork_lock, CUMA_RANK_FORK);
    if (nlayers < sizeof layers / sizeof layers[0]) {
        layers[nlayers].prepare = prepare;
        layers[nlayers].release = release;
        nlayers++;
    } else {
        abort(); /* a fixed handful of layers: a fifth is a bug, not a runtime condition */
    }
    cuma_mutex_unlock(&fork_lock);
}

void cuma_fork_track(cuma_heap *h) {
    pthread_once(&hooks_once, install_hooks);
    cuma_mutex_lock(&fork_lock, CUMA_RANK_FORK);
    h->fork_prev = NULL;
    h->fork_next = live_heaps;
    if (live_heaps) live_heaps->fork_prev = h;
    live_heaps = h;
    cuma_mutex_unlock(&fork_lock);
}

void cuma_fork_untrack(cuma_heap *h) {
    cuma_mutex_lock(&fork_lock, CUMA_RANK_FORK);
    if (h->fork_prev)
        h->fork_prev->fork_next = h->fork_next;
    else if (live_heaps == h)
        live_heaps = h->fork_next;
    if (h->fork_next) h->fork_next->fork_prev = h->fork_prev;
    h->fork_next = h->fork_prev = NULL;
    cuma_mutex_unlock(&fork_lock);
}

void cuma_heaps_each(void (*fn)(cuma_heap *h, void *arg), void *arg) {
    cuma_mutex_lock(&fork_lock, CUMA_RANK_FORK);
    for (cuma_heap *h = live_heaps; h; h = h->fork_next) fn(h, arg);
    cuma_mutex_unlock(&fork_lock);
}
