// SPDX-License-Identifier: Apache-2.0
/* The heap's peers: the other heaps it shares its device with, as the heap sees them.
 *
 * The heap does not know how the peers are reached (src/coord's cross-process ledger is the one
 * implementation). It calls the operations below, and the layer that reaches them fills in
 * cuma_heap.peers when the heap joins it; a heap with none (peers.ops NULL) is on its own. The
 * peers admit the heap's growth without a call from here: the joiner wraps the heap's backend,
 * so that every page and segment passes through it (backend.h's interface). This is the
 * failure-callback adaptor pattern: when the device is full, ask someone else, then retry.
 *
 * Every operation takes the heap h; poll runs on its first arena's release thread. */
#ifndef CUMA_HEAP_PEERS_H
#define CUMA_HEAP_PEERS_H

#include "cuma/cuma.h"
#include "util/strbuf.h"

#include <stdbool.h>
#include <stdint.h>

/* How often the release thread of a heap with peers polls them (peers.poll). */
#define CUMA_LEDGER_POLL_NS 5000000ull

typedef struct cuma_peers_ops {
    /* The out-of-memory ladder: asks the peers for `bytes` (whole pages or segments) and waits
     * for them (no lock held); true when they should now fit. */
    bool (*ask)(void *ctx, cuma_heap *h, uint64_t bytes);
    /* The first arena's release thread, every CUMA_LEDGER_POLL_NS (h->first's lock held, may
     * be dropped meanwhile): publishes the heap's figures and answers the peers' requests. */
    void (*poll)(void *ctx, cuma_heap *h);
    /* Publishes what the heap holds and can give now (its release thread has started; any lock
     * or none but oom_lock). */
    void (*publish)(void *ctx, cuma_heap *h);
    /* The heap's limit on reserved bytes changed to `limit` (the first arena's lock held). */
    void (*set_limit)(void *ctx, uint64_t limit);
    /* cuma_get_stats: the peers' fields of *out (ledger_room_bytes, ledger_denials,
     * pressure_*). */
    void (*stats)(void *ctx, cuma_stats *out);
    /* cuma_stats_json: the "ledger" member and the comma after it. */
    void (*json)(void *ctx, cuma_strbuf *o);
    /* cuma_validate (every arena lock held): what the peers' figures of the heap get wrong,
     * or NULL. */
    const char *(*validate)(void *ctx, cuma_heap *h);
} cuma_peers_ops;

/* Constant after creation; ops NULL when the heap has no peers. */
typedef struct cuma_peers {
    const cuma_peers_ops *ops;
    void *ctx;
} cuma_peers;

/* Joins the peers as the heap's settings say (at creation, before any arena
 * shares the backend): fills in h->peers and wraps h->be, or leaves both (CUMA_OK, alone). */
typedef cuma_status (*cuma_peers_join_fn)(cuma_heap *h);

/* cuma_heap_create with the peers that `join` (NULL: none) finds; cuma_heap_create is this
 * with the ledger's joiner (src/coord/pressure.c). */
cuma_status cuma_heap_create_with(const cuma_config *cfg, cuma_peers_join_fn join, cuma_heap **out);

/* fork.c: a layer above the heaps (the ledger's list of mapped files) whose locks a fork must
 * hold too, taken after every heap's: prepare takes them, release gives them back (in the parent
 * and the child). At most 4 layers. */
void cuma_fork_layer(void (*prepare)(void), void (*release)(void));

#endif
