// SPDX-License-Identifier: Apache-2.0
/* Arenas: more locks for threads whose slow paths keep colliding on one.
 *
 * Thread caches serve most calls without a lock, but a request of a size no cache holds, a free
 * that does not fit a cache and every page change take the heap's lock. When two threads do
 * that often at the same time, they wait for each other, and two threads run no faster than one.
 * Such a thread moves to another arena: a heap of its own over its own virtual range (lock,
 * placement, pages, streams, caches), sharing the backend, the limit and the statistics of the
 * first. A free goes to the arena whose range holds the pointer, whichever thread calls it.
 *
 * Memory is the price: pages idle in one arena serve another only after they were given back
 * (release_delay_ms, or at once on the out-of-memory path, which empties every arena's cache).
 * So arenas are made only for threads that collide persistently, not for an occasional overlap:
 * a single thread, or a training loop whose threads take turns, keeps one arena and the memory
 * figures of a single heap.
 */
#include "util/error.h"
#include "heap/heap.h"

#include <stdlib.h>

/* Collisions weigh COLLIDE_STEP, clean acquisitions take 1 off, and a thread moves when the sum
 * reaches COLLIDE_MOVE: more than one slow call in nine colliding, sustained over tens of
 * calls. */
#define COLLIDE_STEP 8
#define COLLIDE_MOVE 64

/* The calling thread's arena in the last multi-arena heap it allocated from (a thread that
 * alternates between several such heaps starts over at their first arenas). */
static _Thread_local struct {
    cuma_heap *heap;
    uint64_t id; /* the first arena's registry id: a new heap at the same address is another */
    cuma_arena *arena;
    int score;
} tl __attribute__((tls_model("initial-exec"))); /* as cuma_tl_last (tcache.h) */

cuma_arena *cuma_arena_mine_slow(cuma_heap *h) {
    if (tl.heap == h && tl.id == h->first.id && tl.arena) return tl.arena;
    return &h->first;
}

cuma_arena *cuma_arena_of_slow(cuma_heap *h, uint64_t addr) {
    unsigned n = atomic_load_explicit(&h->narenas, memory_order_acquire);
    for (unsigned i = 1; i < n; i++) {
        cuma_arena *a = h->arenas[i];
        if (addr - a->base < a->va_size) return a;
    }
    return &h->first;
}

static unsigned index_of(cuma_heap *h, cuma_arena *a, unsigned n) {
    for (unsigned i = 0; i < n; i++)
        if (h->arenas[i] == a) return i;
    return 0;
}

/* The thread collided on arena a once too often: the next of its slow calls goes to an arena
 * nobody holds right now, or to a new one, or (all made and all busy) to the next in turn. */
static void move(cuma_heap *h, cuma_arena *a) {
    unsigned n = atomic_load_explicit(&h->narenas, memory_order_acquire);
    unsigned at = index_of(h, a, n);
    for (unsigned k = 1; k < n; k++) {
        cuma_arena *o = h->arenas[(at + k) % n];
        if (cuma_mutex_trylock(&o->lock, CUMA_RANK_ARENA)) continue;
        cuma_mutex_unlock(&o->lock);
        tl.arena = o;
        return;
    }
    cuma_arena *o = NULL;
    if (n < (unsigned)h->set.arenas && cuma_arena_add(h, &o) == CUMA_OK) {
        tl.arena = o;
        return;
    }
    cuma_clear_error(); /* no new arena (no virtual range left, say): this call still succeeds */
    if (n > 1) tl.arena = h->arenas[(at + 1) % n];
}

void cuma_arena_lock(cuma_heap *h, cuma_arena *a) {
    bool mine = tl.heap == h && tl.id == h->first.id;
    if (!cuma_mutex_trylock(&a->lock, CUMA_RANK_ARENA)) {
        if (mine && tl.score > 0) tl.score--;
        return;
    }
    if (h->set.arenas > 1 && (a->phys.ops->caps & CUMA_PHYS_RANGE)) {
        if (!mine) tl.heap = h, tl.id = h->first.id, tl.arena = a, tl.score = 0;
        tl.score += COLLIDE_STEP;
        if (tl.score >= COLLIDE_MOVE) {
            tl.score = 0;
            move(h, a);
        }
    }
    cuma_mutex_lock(&a->lock, CUMA_RANK_ARENA);
}

cuma_status cuma_arena_add(cuma_heap *h, cuma_arena **out) {
    *out = NULL;
    if (!(h->first.phys.ops->caps & CUMA_PHYS_RANGE))
        return cuma_fail(CUMA_ERR_UNSUPPORTED, "arenas need a virtual range (pages)");
    cuma_mutex_lock(&h->arena_lock, CUMA_RANK_ARENAS);
    cuma_status st = CUMA_OK;
    unsigned n = atomic_load(&h->narenas);
    cuma_arena *a = NULL;
    if (n >= (unsigned)h->set.arenas) {
        st = cuma_fail(CUMA_ERR_LIMIT, "the heap has its %d arenas already", h->set.arenas);
        goto out;
    }
    a = calloc(1, sizeof *a);
    if (!a) {
        st = cuma_fail(CUMA_ERR_OOM, "no host memory for an arena");
        goto out;
    }
    /* The heap's settings as they are now (a lowered limit included): changes of them walk the
     * arenas under arena_lock, which this holds. */
    cuma_mutex_lock(&h->first.lock, CUMA_RANK_ARENA);
    cuma_backend_share(h->be); /* the first arena's calls, under this lock, take the mutex now */
    cuma_mutex_unlock(&h->first.lock);
    a->be = h->be;
    a->heap = h;
    atomic_store(&a->manual_now, atomic_load(&h->first.manual_now));
    st = cuma_arena_build(a);
    if (st) {
        free(a);
        goto out;
    }
    h->arenas[n] = a;
    atomic_store_explicit(&h->narenas, n + 1, memory_order_release);
    *out = a;
out:
    cuma_mutex_unlock(&h->arena_lock);
    return st;
}

cuma_status cuma_arena_use(cuma_heap *h, unsigned index) {
    if (index >= (unsigned)h->set.arenas)
        return cuma_fail(CUMA_ERR_INVALID, "arena %u: the heap may have %d", index, h->set.arenas);
    while (atomic_load_explicit(&h->narenas, memory_order_acquire) <= index) {
        cuma_arena *a;
        cuma_status st = cuma_arena_add(h, &a);
        /* LIMIT: another thread made the last one meanwhile; the loop sees it. */
        if (st && st != CUMA_ERR_LIMIT) return st;
    }
    tl.heap = h, tl.id = h->first.id, tl.score = 0;
    tl.arena = h->arenas[index];
    cuma_clear_error();
    return CUMA_OK;
}
