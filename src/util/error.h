// SPDX-License-Identifier: Apache-2.0
/* Per-thread error messages behind cuma_last_error(). */
#ifndef CUMA_UTIL_ERROR_H
#define CUMA_UTIL_ERROR_H

#include "cuma/cuma.h"

/* Sets the calling thread's message (printf format) and returns `s`, so a failing path can
 * say `return cuma_fail(CUMA_ERR_INVALID, "size %zu overflows", n);`. Control bytes in the
 * formatted text are escaped (\x1b for ESC; see cuma_strbuf_escaped), so a message may quote
 * any input as it is. */
cuma_status cuma_fail(cuma_status s, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

/* Clears the calling thread's message. */
void cuma_clear_error(void);

/* A copy of the calling thread's message. A failure path saves it before cleaning up: cleanup
 * calls (the ledger's, say) clear or replace the message for their own best-effort steps, and
 * the caller must still learn what failed first. */
typedef struct cuma_error_saved {
    char text[512];
} cuma_error_saved;
void cuma_error_save(cuma_error_saved *out);
void cuma_error_restore(const cuma_error_saved *saved);

#endif
