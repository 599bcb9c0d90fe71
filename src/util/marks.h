// SPDX-License-Identifier: Apache-2.0
/* Marks: the slow paths as NVTX ranges in a "cuma" domain (nvtx:on), so that Nsight Systems
 * shows page calls, releases, the out-of-memory ladder, fence waits and ledger requests beside
 * the kernels (docs/NSIGHT.md).
 *
 * The core includes no CUDA header: the ranges are pushed by src/backend/nvtx.c, the one file
 * that includes the toolkit's header-only NVTX v3 (a no-op there unless a tool such as nsys
 * attached itself through NVTX_INJECTION64_PATH). A libcuma built without those headers has
 * stubs, and nvtx:on is refused (cuma_marks_missing).
 *
 * Cost with nvtx:off: one test of a flag the caller keeps (the heap's settings, or the copy a
 * pages, segments or streams table holds), on slow paths only; nothing on the fast path. Every
 * push is popped on the same thread before the caller returns. */
#ifndef CUMA_UTIL_MARKS_H
#define CUMA_UTIL_MARKS_H

#include <stdbool.h>

/* The ranges; their names are in src/backend/nvtx.c and docs/NSIGHT.md. */
enum cuma_mark {
    CUMA_MARK_PAGE_CREATE,
    CUMA_MARK_PAGE_MAP,
    CUMA_MARK_PAGE_UNMAP,
    CUMA_MARK_PAGE_RELEASE,
    CUMA_MARK_SEG_ALLOC,
    CUMA_MARK_SEG_FREE,
    CUMA_MARK_RELEASE,       /* idle memory back to the device (every caller) */
    CUMA_MARK_RELEASE_PASS,  /* the release thread's run of the release policy */
    CUMA_MARK_TRIM,          /* cuma_trim */
    CUMA_MARK_FENCE_WAIT,    /* the host waits for a stream's work (an event) */
    CUMA_MARK_OOM,           /* the out-of-memory ladder; its rungs nest inside */
    CUMA_MARK_OOM_CACHE,     /* rung: this arena's cache released, then a retry */
    CUMA_MARK_OOM_ARENAS,    /* rung: the other arenas' caches, then a retry */
    CUMA_MARK_OOM_LEDGER,    /* rung: the other heaps in the ledger asked, then a retry */
    CUMA_MARK_OOM_CALLBACKS, /* rung: the OOM callbacks and their retries */
    CUMA_MARK_OOM_MANAGED,   /* rung: managed memory */
    CUMA_MARK_LEDGER_ANSWER, /* the release thread gives memory another heap asked for */
    CUMA_MARK_N
};

/* Implemented in src/backend/nvtx.c. */
/* NULL when this libcuma can push ranges; otherwise why it cannot (for nvtx:on's error). */
const char *cuma_marks_missing(void);
/* Creates the domain (once a process; loads the tool NVTX_INJECTION64_PATH names, if any). */
void cuma_marks_init(void);
void cuma_marks_push(enum cuma_mark m);
void cuma_marks_pop(void);

static inline void cuma_mark_push(bool on, enum cuma_mark m) {
    if (__builtin_expect(on, 0)) cuma_marks_push(m);
}
static inline void cuma_mark_pop(bool on) {
    if (__builtin_expect(on, 0)) cuma_marks_pop();
}

#endif
