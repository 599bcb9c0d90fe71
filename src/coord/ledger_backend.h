// SPDX-License-Identifier: Apache-2.0
/* The backend wrapper through which a heap's device memory is admitted by the ledger. */
#ifndef CUMA_COORD_LEDGER_BACKEND_H
#define CUMA_COORD_LEDGER_BACKEND_H

#include "backend/backend.h"
#include "ledger.h"

/* Wraps `inner`: pages and segments are admitted by `ledger` before they are taken and given
 * back to it after they went back. Destroying the wrapper destroys inner, then leaves the
 * ledger (the wrapper owns both). */
cuma_status cuma_backend_ledger(cuma_backend *inner, cuma_ledger *ledger, cuma_backend **out);
/* Bytes the wrapper under be (at any depth) holds admitted; 0 without one. */
uint64_t cuma_backend_ledger_held(cuma_backend *be);

#endif
