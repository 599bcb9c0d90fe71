// SPDX-License-Identifier: Apache-2.0
/* The ledger as a heap's peers (heap/peers.h): what src/coord/pressure.c offers besides the
 * operations it fills in. */
#ifndef CUMA_COORD_PRESSURE_H
#define CUMA_COORD_PRESSURE_H

#include "cuma/ledger.h"
#include "ledger.h"

/* The heap's slot in the ledger , or NULL when it is in none. */
cuma_ledger *cuma_heap_ledger(const cuma_heap *h);

/* The release thread's poll (peers.poll; tests call it with the thread off): publishes the
 * heap's figures and answers the others' requests (first arena, its lock held, dropped
 * meanwhile). */
void cuma_heap_ledger_poll(cuma_heap *h);

#endif
