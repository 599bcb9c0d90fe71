#include "strbuf.h"

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
