// SPDX-License-Identifier: Apache-2.0
/* A reader of Python pickles that holds plain data only: None, bool, int, float, str, bytes,
 * list, tuple and dict, as pickle protocols 2 to 5 write them (what torch.cuda.memory.
 * _dump_snapshot() writes). It builds a tree of values and never runs anything: every opcode
 * that names a class or calls one (GLOBAL, STACK_GLOBAL, REDUCE, BUILD, INST, OBJ, NEWOBJ,
 * PERSID, EXT*, ...) is refused with an error naming the opcode and its offset, as is every
 * opcode this reader does not know.
 *
 * The input is untrusted: the reader is bounded by cuma_pickle_limits (nodes, memory, depth of
 * open MARKs, stack height) and fails with a message naming the limit instead of growing
 * without end. Values shared through the memo (BINGET) are shared in the tree, not copied, so
 * the tree may hold cycles (a list appended to itself): a consumer walks known paths only.
 *
 * Thread safety: a parse touches only its arguments.
 */
#ifndef CUMA_TRACE_PICKLE_H
#define CUMA_TRACE_PICKLE_H

#include <stddef.h>
#include <stdint.h>

#include "cuma/cuma.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef enum {
    CUMA_PK_NONE = 0,
    CUMA_PK_BOOL,
    CUMA_PK_INT,    /* fits int64_t */
    CUMA_PK_BIGINT, /* an int too wide for int64_t: its value is not kept */
    CUMA_PK_FLOAT,
    CUMA_PK_STR,   /* UTF-8 as written (not checked), not NUL-terminated */
    CUMA_PK_BYTES, /* BINSTRING and BINBYTES variants */
    CUMA_PK_LIST,
    CUMA_PK_TUPLE,
    CUMA_PK_DICT, /* items are key, value, key, value, ... in insertion order */
} cuma_pickle_kind;

/* One value. For STR/BYTES, off/len locate the text in cuma_pickle.text; for containers,
 * items[0..n) are node indices (2n of them for a dict). Invariant: every index in items is
 * below cuma_pickle.n; n <= cap; off + len <= text_len. */
typedef struct cuma_pickle_node {
    uint32_t kind; /* cuma_pickle_kind */
    uint32_t n;    /* container: items (pairs for a dict); string: unused */
    union {
        int64_t i; /* BOOL (0/1), INT */
        double f;  /* FLOAT */
        struct {
            uint64_t off, len;
        } s;
        struct {
            uint32_t *items;
            uint32_t cap;
        } c;
    } u;
} cuma_pickle_node;

typedef struct cuma_pickle {
    cuma_pickle_node *node; /* node[root] is the value STOP returned */
    size_t n;
    uint32_t root;
    char *text; /* every string's bytes, back to back */
    size_t text_len;
} cuma_pickle;

typedef struct cuma_pickle_limits {
    size_t max_nodes; /* values created (BINGET reuses one and creates none) */
    size_t max_bytes; /* host memory for nodes, items, text, memo and stack together */
    size_t max_depth; /* MARKs open at once */
    size_t max_stack; /* values on the stack at once */
} cuma_pickle_limits;

/* 64 Mi nodes, 4 GiB, 1000 MARKs, 16 Mi stack entries: a snapshot of several hundred MB
 * (frames included) fits; a hostile file stops there. */
extern const cuma_pickle_limits cuma_pickle_default_limits;

/* Parses buf[0..len) into *out (overwritten; free with cuma_pickle_free). lim NULL: the
 * defaults. CUMA_ERR_PARSE: a refused or unknown opcode, a truncated or malformed pickle
 * ("pickle: OPCODE (0xNN) at offset N: what is wrong"); CUMA_ERR_LIMIT: a limit was reached
 * (named); CUMA_ERR_OOM. On failure *out is empty. */
cuma_status cuma_pickle_parse(const uint8_t *buf, size_t len, const cuma_pickle_limits *lim,
                              cuma_pickle *out);

void cuma_pickle_free(cuma_pickle *p);

/* Checks the invariants above; CUMA_ERR_CORRUPT naming the first broken one. */
cuma_status cuma_pickle_validate(const cuma_pickle *p);

/* The value of the str key `key` in dict node d (the last one when repeated), scanning at most
 * max_items pairs; -1 when d is not a dict, the key is absent, or d has more pairs than
 * max_items (*too_big set to 1 then, if given). */
int64_t cuma_pickle_dict_get(const cuma_pickle *p, uint32_t d, const char *key, uint32_t max_items,
                             int *too_big);

/* "NONE", "GLOBAL", ... for an opcode byte, or NULL when the byte is no pickle opcode. */
const char *cuma_pickle_opcode_name(uint8_t op);

#ifdef __cplusplus
}
#endif
#endif
