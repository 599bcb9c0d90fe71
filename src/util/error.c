// SPDX-License-Identifier: Apache-2.0
#include "util/error.h"

#include "util/strbuf.h"

#include <stdarg.h>
#include <stdio.h>
#include <string.h>

/* One message per thread, so concurrent failures do not overwrite each other. */
static _Thread_local char last_error[512];

/* Every message passes through one escaping step: they quote settings, file names and lines of
 * input, and a control byte in one of them (ESC]0;...BEL, ESC[2J) must not reach the terminal
 * that prints the message. */
cuma_status cuma_fail(cuma_status s, const char *fmt, ...) {
    char raw[sizeof last_error];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(raw, sizeof raw, fmt, ap);
    va_end(ap);
    cuma_escape(raw, last_error, sizeof last_error);
    return s;
}

void cuma_clear_error(void) {
    last_error[0] = 0;
}

void cuma_error_save(cuma_error_saved *out) {
    _Static_assert(sizeof out->text == sizeof last_error, "one message size");
    memcpy(out->text, last_error, sizeof last_error);
}

void cuma_error_restore(const cuma_error_saved *saved) {
    memcpy(last_error, saved->text, sizeof last_error);
    last_error[sizeof last_error - 1] = 0;
}

const char *cuma_last_error(void) {
    return last_error;
}

const char *cuma_status_string(cuma_status s) {
    switch (s) {
    case CUMA_OK:
        return "ok";
    case CUMA_ERR_INVALID:
        return "invalid argument";
    case CUMA_ERR_OOM:
        return "out of memory";
    case CUMA_ERR_LIMIT:
        return "over the memory limit";
    case CUMA_ERR_BAD_POINTER:
        return "pointer not allocated by this heap";
    case CUMA_ERR_CONFIG:
        return "bad configuration";
    case CUMA_ERR_BACKEND:
        return "device backend failed";
    case CUMA_ERR_NO_DEVICE:
        return "no device or driver";
    case CUMA_ERR_UNSUPPORTED:
        return "not supported by this backend";
    case CUMA_ERR_CORRUPT:
        return "heap invariant broken";
    case CUMA_ERR_IO:
        return "input/output error";
    case CUMA_ERR_PARSE:
        return "malformed input";
    }
    return "unknown status";
}
