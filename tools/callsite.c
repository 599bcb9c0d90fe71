// SPDX-License-Identifier: Apache-2.0
/* The call-site rule (callsite.h), shared by `cuma leaks` and `cuma plot --html`.
 *
 * Call site: the innermost frame of an allocation's stack that is the program's own Python code
 * (frame_rank): a file that ends in ".py", outside a torch/ directory, Python's standard library
 * and installed packages (site-packages, dist-packages); when a stack has no such frame, the
 * innermost frame of an installed package other than torch; when it has no Python frame outside
 * torch (the backward pass runs on the autograd engine's own threads), the innermost autograd
 * node (torch::autograd::generated::MmBackward0::apply, AccumulateGrad). Other frames of C and
 * C++ code ("??", "", *.cpp, ...), of torch and of the interpreter are always skipped, so memory
 * allocated deep inside PyTorch (or einops) is charged to the program's line that asked for it.
 * In a cuma log written with trace_stacks:on: a stack of Python frames (the package records the
 * program's, cuma_alloc_with_stack) by the rule above, else its innermost frame; a native stack,
 * the innermost frame that is not the allocator's (allocator_frame), preferring one with a
 * source line.
 */
#include "callsite.h"

#include <string.h>

int callsite_ends_with(const char *s, const char *suffix) {
    size_t n = strlen(s), k = strlen(suffix);
    return n >= k && !strcmp(s + n - k, suffix);
}

/* Whether path has a directory named dir (at its start or after a '/' or '\\': Windows paths
 * come as recorded). */
static int has_dir(const char *path, const char *dir) {
    size_t n = strlen(dir);
    for (const char *p = path; (p = strstr(p, dir)) != NULL; p++)
        if ((p == path || p[-1] == '/' || p[-1] == '\\') && (p[n] == '/' || p[n] == '\\')) return 1;
    return 0;
}

/* How much a frame's file says about who asked for the memory (see the top of the file):
 * 2 the program's own Python code, 1 an installed package other than torch, 0 neither. */
static int frame_rank(const char *file) {
    if (!callsite_ends_with(file, ".py")) return 0; /* "??", "", C++ sources, <frozen ...> */
    if (has_dir(file, "torch")) return 0;
    if (has_dir(file, "site-packages") || has_dir(file, "dist-packages")) return 1;
    /* The standard library: .../lib/python3.X/... (Windows: ...\\Lib\\...) outside packages. */
    if (strstr(file, "/python3.") || has_dir(file, "Lib")) return 0;
    return 2;
}

/* Whether a C++ frame is an autograd node's apply: the backward pass runs on the autograd
 * engine's threads, whose stacks have no Python frame, and the node names what it computes. */
static int autograd_node(const char *name) {
    return !strncmp(name, "torch::autograd::generated::", 28) ||
           !strncmp(name, "torch::autograd::AccumulateGrad::", 33);
}

/* Whether a native frame (a cuma log's, trace_stacks) is cuma's own: the allocator's entry
 * points and what the shims and bindings put between the program and them. */
static int allocator_frame(const char *name) {
    static const char *const own[] = {"cuma_",      "alloc_slow",     "ffi_call",
                                      "_ctypes",    "_call_function", "cudaMalloc",
                                      "cuMemAlloc", "torch_alloc",    "default_heap"};
    for (size_t i = 0; i < sizeof own / sizeof own[0]; i++)
        if (strstr(name, own[i]) == name) return 1;
    return 0;
}

uint32_t callsite_of_stack(const cuma_trace *t, uint32_t s) {
    const cuma_trace_stacks *st = &t->stacks;
    if (st->start[s] == st->start[s + 1]) return CALLSITE_NONE;
    /* A cuma log's native frames: the innermost one not the allocator's, preferring one with
     * a source line. */
    int python = 0;
    for (size_t k = st->start[s]; k < st->start[s + 1] && !python; k++)
        python = callsite_ends_with(st->text + st->frame[st->ix[k]].file, ".py");
    if (t->format == CUMA_TRACE_RMM_CSV && !python) {
        uint32_t any = CALLSITE_UNKNOWN;
        for (size_t k = st->start[s]; k < st->start[s + 1]; k++) {
            const cuma_trace_frame *f = &st->frame[st->ix[k]];
            if (allocator_frame(st->text + f->name)) continue;
            if (f->line) return CALLSITE_FIRST + st->ix[k];
            if (any == CALLSITE_UNKNOWN) any = CALLSITE_FIRST + st->ix[k];
        }
        return any;
    }
    uint32_t package = CALLSITE_UNKNOWN, node = CALLSITE_UNKNOWN;
    for (size_t k = st->start[s]; k < st->start[s + 1]; k++) {
        const cuma_trace_frame *f = &st->frame[st->ix[k]];
        int r = frame_rank(st->text + f->file);
        if (r == 2) return CALLSITE_FIRST + st->ix[k];
        if (r == 1 && package == CALLSITE_UNKNOWN) package = CALLSITE_FIRST + st->ix[k];
        if (!r && node == CALLSITE_UNKNOWN && autograd_node(st->text + f->name))
            node = CALLSITE_FIRST + st->ix[k];
    }
    if (package != CALLSITE_UNKNOWN) return package;
    /* A cuma log's Python stack all in the standard library: its innermost frame still says
     * more than none. */
    if (t->format == CUMA_TRACE_RMM_CSV) return CALLSITE_FIRST + st->ix[st->start[s]];
    return node;
}
