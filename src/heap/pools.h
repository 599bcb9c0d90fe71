// SPDX-License-Identifier: Apache-2.0
/* The heap's side of fixed-size pools (pool.c; the public surface is include/cuma/pool.h). */
#ifndef CUMA_HEAP_POOLS_H
#define CUMA_HEAP_POOLS_H

#include "cuma/pool.h"

#include <stdbool.h>
#include <stdint.h>

struct cuma_heap;

/* Frees every pool still on heap h (cuma_heap_destroy, before the arenas go): their carves go
 * with the heap's memory, only the host side is freed here. No other call may race with it. */
void cuma_pools_destroy_all(struct cuma_heap *h);

/* The heap's pool figures against its pool list (cuma_validate; no arena lock held): NULL, or
 * the broken invariant. Exact while no other thread is inside a pool call on the heap. */
const char *cuma_pools_check(struct cuma_heap *h);

/* fork(): takes h's pool list lock, then every pool's lock (fork.c, after the heap's leaf
 * locks); and lets them go again, in reverse, in the parent and the child. */
void cuma_pools_prefork(struct cuma_heap *h);
void cuma_pools_postfork(struct cuma_heap *h);

/* Whether addr is the carve of one of heap h's pools (takes its pool_lock, a leaf
 * lock, so callable with an arena lock held): compaction leaves carves where they are. */
bool cuma_pools_owns(struct cuma_heap *h, uint64_t addr);

/* Free-stack slots read or written by the pool's calls so far: one per cuma_pool_alloc or
 * cuma_pool_free that succeeded (tests: constant work per call, counted, not timed). */
uint64_t cuma_pool_steps(cuma_pool *p);

#endif
