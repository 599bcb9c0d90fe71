// SPDX-License-Identifier: Apache-2.0
#include "util/strbuf.h"

#include <stdarg.h>
#include <stdio.h>

void cuma_strbuf_put(cuma_strbuf *o, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    size_t room = cuma_strbuf_room(o);
    int n = vsnprintf(room ? o->buf + o->used : NULL, room, fmt, ap);
    va_end(ap);
    if (n > 0) o->used += (size_t)n;
}

void cuma_strbuf_json_string(cuma_strbuf *o, const char *v) {
    cuma_strbuf_put(o, "\"");
    for (const unsigned char *c = (const unsigned char *)v; *c; c++) {
        if (*c == '"' || *c == '\\')
            cuma_strbuf_put(o, "\\%c", *c);
        else if (*c < 0x20)
            cuma_strbuf_put(o, "\\u%04x", *c);
        else
            cuma_strbuf_put(o, "%c", *c);
    }
    cuma_strbuf_put(o, "\"");
}

void cuma_strbuf_escaped(cuma_strbuf *o, const char *v) {
    for (const unsigned char *c = (const unsigned char *)v; *c; c++) {
        if (*c < 0x20 || *c == 0x7f)
            cuma_strbuf_put(o, "\\x%02x", *c);
        else if (*c == 0xc2 && c[1] >= 0x80 && c[1] <= 0x9f)
            cuma_strbuf_put(o, "\\xc2\\x%02x", *++c);
        else
            cuma_strbuf_put(o, "%c", *c);
    }
}

const char *cuma_escape(const char *v, char *buf, size_t len) {
    cuma_strbuf o = {buf, len, 0};
    if (buf && len) buf[0] = 0;
    cuma_strbuf_escaped(&o, v);
    return buf;
}
