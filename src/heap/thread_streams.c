// SPDX-License-Identifier: Apache-2.0
/* Per-thread default streams end with their threads. The stream table keys a thread's
 * per-thread stream by a token of the thread (place/streams.h). When a thread that used its
 * per-thread stream exits, that stream is retired in every live heap, as cuma_stream_retire
 * retires a stream the program destroys: one last fence (on the legacy stream, which waits for
 * it), and the slot is free for another stream once the fence is done. Without it a pool of
 * threads that turns over would fill the table (256 streams), and allocations would then be
 * refused. */
#include "heap/heap.h"

#include <pthread.h>

static pthread_key_t exit_key;
static pthread_once_t key_once = PTHREAD_ONCE_INIT;
static _Thread_local bool armed;

static void retire_in(cuma_heap *h, void *arg) {
    (void)arg;
    /* Every arena shares the heap's backend kind, so the first says whether it has the handle. */
    cuma_stream pt = h->arenas[0]->streams.per_thread;
    if (pt && !atomic_load(&h->inherited)) (void)cuma_stream_retire(h, pt);
}

static void on_thread_exit(void *value) {
    (void)value;
    /* A destructor that runs after this one (a key made later) may use the per-thread stream
     * again: armed anew, the key's value is set again and glibc runs this once more after it
     * (up to PTHREAD_DESTRUCTOR_ITERATIONS rounds), so that slot is retired too. */
    armed = false;
    cuma_streams_thread_exiting();
    cuma_heaps_each(retire_in, NULL);
}

static void make_key(void) {
    if (pthread_key_create(&exit_key, on_thread_exit) != 0) exit_key = (pthread_key_t)-1;
}

void cuma_thread_streams_arm(void) {
    if (armed) return;
    armed = true;
    pthread_once(&key_once, make_key);
    /* Without a key (the process ran out of them) the thread's slots stay live after it: the
     * table fills sooner, but no token is reused, so nothing is reused early. */
    if (exit_key != (pthread_key_t)-1) pthread_setspecific(exit_key, (void *)1);
}
