// SPDX-License-Identifier: Apache-2.0
/* A bounded text buffer that counts what it could not hold, for the snprintf-style calls
 * (cuma_stats_json, cuma_config_describe) that report the length they needed. */
#ifndef CUMA_UTIL_STRBUF_H
#define CUMA_UTIL_STRBUF_H

#include <stddef.h>

/* Invariant: the text in buf is NUL-terminated and at most len - 1 bytes; used counts every
 * byte appended, also those that did not fit. buf may be NULL (then only used moves). */
typedef struct cuma_strbuf {
    char *buf;
    size_t len, used;
} cuma_strbuf;

void cuma_strbuf_put(cuma_strbuf *o, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

/* Appends v as a JSON string: quotes, backslashes and control characters escaped. */
void cuma_strbuf_json_string(cuma_strbuf *o, const char *v);

/* Appends v with every byte a terminal would act on written as \xHH (C0 controls, DEL, and
 * the C1 controls U+0080..U+009F in their UTF-8 form): for quoting a file name, a setting or
 * a line of input in a message, so that ESC sequences in them reach no terminal. Other bytes
 * (UTF-8 text too) pass unchanged. */
void cuma_strbuf_escaped(cuma_strbuf *o, const char *v);

/* v escaped as cuma_strbuf_escaped does, into buf (len bytes, truncated to fit); returns buf. */
const char *cuma_escape(const char *v, char *buf, size_t len);

/* The room left at the end of the text (0 when full or without a buffer). */
static inline size_t cuma_strbuf_room(const cuma_strbuf *o) {
    return o->buf && o->used < o->len ? o->len - o->used : 0;
}

#endif
