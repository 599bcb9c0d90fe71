// SPDX-License-Identifier: Apache-2.0
/* Pins: how a device reset knows that no thread still uses the heap it is about to destroy.
 *
 * A reset (cuDevicePrimaryCtxReset, preload_ctx.c) destroys the device's heap while other threads
 * may be in the shim. Those that use that device at that moment break the driver's rule (the
 * reset is valid only while no other thread uses the device), but the others must not be hurt:
 * a free probes every device's heap for its pointer, a query reads a heap's statistics. So every
 * use of a heap is bracketed by a pin of its device, and the reset waits until no thread holds
 * one before it destroys the heap.
 *
 * A pin costs its thread two plain stores to a record of its own and one fence, no shared write:
 * a counter per device that every allocation and free incremented would bounce one cache line
 * between every thread that allocates, which the core's fast paths are built to avoid. Only the
 * reset, which is rare, walks every thread's record.
 *
 * The protocol (Dekker's): a thread sets its bit, fences, then reads the device's state; the
 * retirer stores the new state, fences, then reads every bit. With sequentially consistent fences
 * on both sides, either the thread sees the device retiring and keeps off its heap, or the
 * retirer sees the bit and waits for it to clear. A record pushed after the retirer read the list
 * belongs to a thread whose fence comes after the retirer's, which therefore sees the new state.
 */
#include "preload.h"

#include "shim/default_heap.h"

#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <time.h>

_Static_assert(CUMA_MAX_DEFAULT_HEAPS <= 64, "a pin mask has one bit per device");

/* One per thread that ever pinned, reused after the thread ends, never freed (a reset may be
 * reading it), so the list only grows to the largest number of threads alive at once. */
typedef struct pin_rec {
    /* Bit d: the owning thread may be using device d's heap. Written only by the owner (plain
     * load and store); read by a retirer with acquire, which the owner's release store of the
     * cleared bit pairs with, so that the owner's use of the heap happens before its destruction.
     */
    _Atomic uint64_t mask;
    /* Whether a live thread owns the record: set by compare-and-swap when a thread claims it,
     * cleared (release) by the thread's exit, after which its mask is 0. */
    _Atomic bool taken;
    struct pin_rec *next; /* written before the record is pushed; constant afterwards */
} pin_rec;

/* The list of records: push-only (compare-and-swap on the head). */
static _Atomic(pin_rec *) recs;

/* The calling thread's record. initial-exec, as the core's per-thread slots: the shim is
 * preloaded, so it is in the initial set of libraries. */
static _Thread_local pin_rec *mine __attribute__((tls_model("initial-exec")));

/* Pins of threads that could get no record (no host memory for one): a counter per device,
 * incremented and decremented with read-modify-writes. */
static _Atomic unsigned anon_pins[CUMA_MAX_DEFAULT_HEAPS];

/* The key whose destructor hands a record back: created once under exit_once, constant after;
 * have_key (set once, release) says whether the creation worked. */
static pthread_key_t exit_key;
static pthread_once_t exit_once = PTHREAD_ONCE_INIT;
static _Atomic bool have_key;

/* A thread ends: its record is free for the next thread. A pin is only held inside a call into
 * the shim, so the mask is 0 here, unless the thread was cancelled inside one: it uses nothing
 * any more, and a bit left set would make every later reset of that device wait forever. */
static void on_thread_exit(void *arg) {
    pin_rec *r = arg;
    if (mine == r) mine = NULL;
    atomic_store_explicit(&r->mask, 0, memory_order_release);
    atomic_store_explicit(&r->taken, false, memory_order_release);
}

static void make_key(void) {
    if (pthread_key_create(&exit_key, on_thread_exit) == 0)
        atomic_store_explicit(&have_key, true, memory_order_release);
}

/* The calling thread's record, claimed on its first pin; NULL without host memory for one. */
static pin_rec *claim(void) {
    pthread_once(&exit_once, make_key);
    if (!atomic_load_explicit(&have_key, memory_order_acquire))
        return NULL; /* without a destructor a claimed record would never be handed back */
    pin_rec *r = NULL;
    for (pin_rec *q = atomic_load_explicit(&recs, memory_order_acquire); q && !r; q = q->next) {
        bool expect = false;
        if (!atomic_load_explicit(&q->taken, memory_order_relaxed) &&
            atomic_compare_exchange_strong_explicit(&q->taken, &expect, true, memory_order_acquire,
                                                    memory_order_relaxed))
            r = q;
    }
    if (!r) {
        if (!(r = calloc(1, sizeof *r))) return NULL;
        atomic_init(&r->taken, true);
        pin_rec *head = atomic_load_explicit(&recs, memory_order_relaxed);
        do {
            r->next = head;
        } while (!atomic_compare_exchange_weak_explicit(&recs, &head, r, memory_order_release,
                                                        memory_order_relaxed));
    }
    if (pthread_setspecific(exit_key, r) != 0) {
        /* No destructor would hand it back: hand it back now and pin anonymously. */
        atomic_store_explicit(&r->taken, false, memory_order_release);
        return NULL;
    }
    mine = r;
    return r;
}

void cuma_preload_pin_take(cuma_preload_pin *pin, int dev) {
    pin->dev = dev;
    pin_rec *r = mine ? mine : claim();
    pin->rec = r;
    if (r) {
        pin->prev = atomic_load_explicit(&r->mask, memory_order_relaxed);
        atomic_store_explicit(&r->mask, pin->prev | (1ull << dev), memory_order_relaxed);
    } else {
        pin->prev = 0;
        atomic_fetch_add_explicit(&anon_pins[dev], 1, memory_order_relaxed);
    }
    atomic_thread_fence(memory_order_seq_cst);
}

void cuma_preload_pin_drop(const cuma_preload_pin *pin) {
    pin_rec *r = pin->rec;
    if (r)
        atomic_store_explicit(&r->mask, pin->prev, memory_order_release);
    else
        atomic_fetch_sub_explicit(&anon_pins[pin->dev], 1, memory_order_release);
}

void cuma_preload_pins_after_fork(void) {
    /* Only the forking thread came along, and it was not inside the shim: every pin is gone. */
    for (pin_rec *r = atomic_load_explicit(&recs, memory_order_relaxed); r; r = r->next) {
        atomic_store_explicit(&r->mask, 0, memory_order_relaxed);
        if (r != mine) atomic_store_explicit(&r->taken, false, memory_order_relaxed);
    }
    for (int d = 0; d < CUMA_MAX_DEFAULT_HEAPS; d++)
        atomic_store_explicit(&anon_pins[d], 0, memory_order_relaxed);
}

void cuma_preload_pins_wait(int dev) {
    atomic_thread_fence(memory_order_seq_cst);
    const uint64_t bit = 1ull << dev;
    /* A pin lasts one allocator call; one that waits for the device (a free that synchronises, an
     * allocation out of memory that waits for other processes) may take longer, so the wait
     * sleeps rather than spins. */
    const struct timespec nap = {0, 50 * 1000};
    for (pin_rec *r = atomic_load_explicit(&recs, memory_order_acquire); r; r = r->next)
        while (atomic_load_explicit(&r->mask, memory_order_acquire) & bit) nanosleep(&nap, NULL);
    while (atomic_load_explicit(&anon_pins[dev], memory_order_acquire)) nanosleep(&nap, NULL);
}
