// SPDX-License-Identifier: Apache-2.0
/* The plain-data pickle reader (see pickle.h).
 *
 * One pass over the bytes with a value stack, a stack of MARK positions and the memo, as the
 * pickle virtual machine has, but every value is a node in one growable array and containers
 * hold node indices, so sharing through the memo costs nothing and freeing is a walk over the
 * array. Every byte of memory taken is counted against the limit before it is taken.
 */
#include "pickle.h"

#include "util/error.h"

#include <stdlib.h>
#include <string.h>

const cuma_pickle_limits cuma_pickle_default_limits = {
    .max_nodes = (size_t)1 << 26,
    .max_bytes = (size_t)4 << 30,
    .max_depth = 1000,
    .max_stack = (size_t)1 << 24,
};

/* The opcodes' names, as Python's pickletools spells them. */
static const struct {
    uint8_t op;
    const char *name;
} opnames[] = {
    {'(', "MARK"},
    {'.', "STOP"},
    {'0', "POP"},
    {'1', "POP_MARK"},
    {'2', "DUP"},
    {'F', "FLOAT"},
    {'I', "INT"},
    {'J', "BININT"},
    {'K', "BININT1"},
    {'L', "LONG"},
    {'M', "BININT2"},
    {'N', "NONE"},
    {'P', "PERSID"},
    {'Q', "BINPERSID"},
    {'R', "REDUCE"},
    {'S', "STRING"},
    {'T', "BINSTRING"},
    {'U', "SHORT_BINSTRING"},
    {'V', "UNICODE"},
    {'X', "BINUNICODE"},
    {'a', "APPEND"},
    {'b', "BUILD"},
    {'c', "GLOBAL"},
    {'d', "DICT"},
    {'}', "EMPTY_DICT"},
    {'e', "APPENDS"},
    {'g', "GET"},
    {'h', "BINGET"},
    {'i', "INST"},
    {'j', "LONG_BINGET"},
    {'l', "LIST"},
    {']', "EMPTY_LIST"},
    {'o', "OBJ"},
    {'p', "PUT"},
    {'q', "BINPUT"},
    {'r', "LONG_BINPUT"},
    {'s', "SETITEM"},
    {'t', "TUPLE"},
    {')', "EMPTY_TUPLE"},
    {'u', "SETITEMS"},
    {'G', "BINFLOAT"},
    {0x80, "PROTO"},
    {0x81, "NEWOBJ"},
    {0x82, "EXT1"},
    {0x83, "EXT2"},
    {0x84, "EXT4"},
    {0x85, "TUPLE1"},
    {0x86, "TUPLE2"},
    {0x87, "TUPLE3"},
    {0x88, "NEWTRUE"},
    {0x89, "NEWFALSE"},
    {0x8a, "LONG1"},
    {0x8b, "LONG4"},
    {'B', "BINBYTES"},
    {'C', "SHORT_BINBYTES"},
    {0x8c, "SHORT_BINUNICODE"},
    {0x8d, "BINUNICODE8"},
    {0x8e, "BINBYTES8"},
    {0x8f, "EMPTY_SET"},
    {0x90, "ADDITEMS"},
    {0x91, "FROZENSET"},
    {0x92, "NEWOBJ_EX"},
    {0x93, "STACK_GLOBAL"},
    {0x94, "MEMOIZE"},
    {0x95, "FRAME"},
    {0x96, "BYTEARRAY8"},
    {0x97, "NEXT_BUFFER"},
    {0x98, "READONLY_BUFFER"},
};

const char *cuma_pickle_opcode_name(uint8_t op) {
    for (size_t i = 0; i < sizeof opnames / sizeof opnames[0]; i++)
        if (opnames[i].op == op) return opnames[i].name;
    return NULL;
}

#define NO_MEMO UINT32_MAX

typedef struct vm {
    const uint8_t *buf;
    size_t len, pos;
    size_t op_at; /* offset of the opcode being run */
    uint8_t op;
    cuma_pickle_limits lim;
    size_t bytes; /* memory taken, counted against lim.max_bytes */
    cuma_pickle *p;
    size_t node_cap, text_cap;
    uint32_t *stack;
    size_t sp, stack_cap;
    size_t *marks;
    size_t nmarks, marks_cap;
    uint32_t *memo;    /* NO_MEMO where unset */
    size_t memo_count; /* entries set */
    size_t memo_cap;
} vm;

static const char *op_name(uint8_t op) {
    const char *n = cuma_pickle_opcode_name(op);
    return n ? n : "unknown opcode";
}

static cuma_status bad(const vm *v, const char *what) {
    return cuma_fail(CUMA_ERR_PARSE, "pickle: %s (0x%02x) at offset %zu: %s", op_name(v->op), v->op,
                     v->op_at, what);
}

static cuma_status over(const vm *v, const char *what, size_t limit) {
    return cuma_fail(CUMA_ERR_LIMIT,
                     "pickle: %s (0x%02x) at offset %zu: more than %zu %s, the reader's limit",
                     op_name(v->op), v->op, v->op_at, limit, what);
}

/* Grows *arr (elements of `elem` bytes, capacity *cap) to hold `need`, counting the memory. */
static cuma_status grow(vm *v, void **arr, size_t *cap, size_t need, size_t elem) {
    if (need <= *cap) return CUMA_OK;
    size_t ncap = *cap ? *cap : 16;
    while (ncap < need) {
        if (ncap > SIZE_MAX / 2 / elem) return over(v, "bytes of memory", v->lim.max_bytes);
        ncap *= 2;
    }
    size_t add = (ncap - *cap) * elem;
    if (add > v->lim.max_bytes - v->bytes) return over(v, "bytes of memory", v->lim.max_bytes);
    void *a = realloc(*arr, ncap * elem);
    if (!a) return cuma_fail(CUMA_ERR_OOM, "pickle: out of host memory at offset %zu", v->op_at);
    *arr = a;
    *cap = ncap;
    v->bytes += add;
    return CUMA_OK;
}

static cuma_status need(const vm *v, size_t n) {
    if (v->len - v->pos < n) return bad(v, "the pickle ends inside its argument (truncated)");
    return CUMA_OK;
}

static uint64_t le(const uint8_t *b, size_t n) {
    uint64_t x = 0;
    for (size_t i = n; i-- > 0;) x = x << 8 | b[i];
    return x;
}

/* A new node of `kind`; its index in *idx. */
static cuma_status new_node(vm *v, uint32_t kind, uint32_t *idx) {
    cuma_pickle *p = v->p;
    if (p->n >= v->lim.max_nodes || p->n >= UINT32_MAX - 1)
        return over(v, "values", v->lim.max_nodes);
    cuma_status st = grow(v, (void **)&p->node, &v->node_cap, p->n + 1, sizeof *p->node);
    if (st != CUMA_OK) return st;
    cuma_pickle_node *nd = &p->node[p->n];
    memset(nd, 0, sizeof *nd);
    nd->kind = kind;
    *idx = (uint32_t)p->n++;
    return CUMA_OK;
}

static cuma_status push(vm *v, uint32_t idx) {
    if (v->sp >= v->lim.max_stack) return over(v, "values on the stack", v->lim.max_stack);
    cuma_status st = grow(v, (void **)&v->stack, &v->stack_cap, v->sp + 1, sizeof *v->stack);
    if (st != CUMA_OK) return st;
    v->stack[v->sp++] = idx;
    return CUMA_OK;
}

static cuma_status push_new(vm *v, uint32_t kind, uint32_t *idx) {
    cuma_status st = new_node(v, kind, idx);
    return st != CUMA_OK ? st : push(v, *idx);
}

static cuma_status push_int(vm *v, uint32_t kind, int64_t x) {
    uint32_t i = 0; /* set when push_new succeeds; 0 keeps gcc's Release build quiet */
    cuma_status st = push_new(v, kind, &i);
    if (st == CUMA_OK) v->p->node[i].u.i = x;
    return st;
}

static cuma_status push_text(vm *v, uint32_t kind, size_t n) {
    cuma_status st = need(v, n);
    if (st != CUMA_OK) return st;
    cuma_pickle *p = v->p;
    if ((st = grow(v, (void **)&p->text, &v->text_cap, p->text_len + n + 1, 1)) != CUMA_OK)
        return st;
    uint32_t i = 0;
    if ((st = push_new(v, kind, &i)) != CUMA_OK) return st;
    memcpy(p->text + p->text_len, v->buf + v->pos, n);
    p->node[i].u.s.off = p->text_len;
    p->node[i].u.s.len = n;
    p->text_len += n;
    v->pos += n;
    return CUMA_OK;
}

/* The top `count` stack values appended to container c (which must not be among them). */
static cuma_status add_items(vm *v, uint32_t c, size_t from) {
    cuma_pickle_node *nd = &v->p->node[c];
    size_t count = v->sp - from;
    if (count == 0) return CUMA_OK; /* an empty APPENDS, SETITEMS, TUPLE, LIST or DICT */
    if (count > UINT32_MAX - 2 * (size_t)nd->n)
        return over(v, "items in one container", UINT32_MAX / 2);
    size_t have = nd->kind == CUMA_PK_DICT ? 2 * (size_t)nd->n : nd->n;
    size_t cap = nd->u.c.cap;
    cuma_status st = grow(v, (void **)&nd->u.c.items, &cap, have + count, sizeof(uint32_t));
    if (st != CUMA_OK) return st;
    nd = &v->p->node[c];
    nd->u.c.cap = (uint32_t)(cap > UINT32_MAX ? UINT32_MAX : cap);
    memcpy(nd->u.c.items + have, v->stack + from, count * sizeof(uint32_t));
    nd->n += (uint32_t)(nd->kind == CUMA_PK_DICT ? count / 2 : count);
    v->sp = from;
    return CUMA_OK;
}

/* The stack position of the innermost MARK, popped. */
static cuma_status pop_mark(vm *v, size_t *at) {
    if (!v->nmarks) return bad(v, "no MARK before it");
    *at = v->marks[--v->nmarks];
    return CUMA_OK;
}

/* APPEND(S)/SETITEM(S): the values since `from` go into the container just below them. */
static cuma_status fill(vm *v, size_t from, uint32_t want) {
    if (from == 0) return bad(v, "no container on the stack");
    uint32_t c = v->stack[from - 1];
    if (v->p->node[c].kind != want)
        return bad(v,
                   want == CUMA_PK_DICT ? "the target is not a dict" : "the target is not a list");
    if (want == CUMA_PK_DICT && (v->sp - from) % 2) return bad(v, "a key without its value");
    return add_items(v, c, from);
}

/* A tuple or list made of the values since `from`. */
static cuma_status collect(vm *v, size_t from, uint32_t kind) {
    uint32_t t = 0;
    cuma_status st = new_node(v, kind, &t);
    if (st != CUMA_OK) return st;
    if (kind == CUMA_PK_DICT && (v->sp - from) % 2) return bad(v, "a key without its value");
    if ((st = add_items(v, t, from)) != CUMA_OK) return st;
    return push(v, t);
}

static cuma_status memo_put(vm *v, uint64_t id) {
    if (!v->sp) return bad(v, "nothing on the stack to remember");
    /* Python numbers memo entries from 0 as values are made, so an id is never beyond the
     * values made so far; a larger one would only make the memo's array huge. */
    if (id > v->p->n) return bad(v, "memo id beyond the values made so far");
    size_t old = v->memo_cap;
    cuma_status st = grow(v, (void **)&v->memo, &v->memo_cap, (size_t)id + 1, sizeof *v->memo);
    if (st != CUMA_OK) return st;
    for (size_t i = old; i < v->memo_cap; i++) v->memo[i] = NO_MEMO;
    if (v->memo[id] == NO_MEMO) v->memo_count++;
    v->memo[id] = v->stack[v->sp - 1];
    return CUMA_OK;
}

static cuma_status memo_get(vm *v, uint64_t id) {
    if (id >= v->memo_cap || v->memo[id] == NO_MEMO) return bad(v, "memo entry never set");
    return push(v, v->memo[id]);
}

/* LONG1/LONG4: little-endian two's complement of n bytes. */
static cuma_status push_long(vm *v, size_t n) {
    cuma_status st = need(v, n);
    if (st != CUMA_OK) return st;
    const uint8_t *b = v->buf + v->pos;
    v->pos += n;
    if (n == 0) return push_int(v, CUMA_PK_INT, 0);
    /* Wider than 8 bytes fits only when the extra bytes are sign extension. */
    uint8_t ext = (b[n - 1] & 0x80) ? 0xff : 0;
    size_t keep = n < 8 ? n : 8;
    for (size_t i = 8; i < n; i++)
        if (b[i] != ext) return push_int(v, CUMA_PK_BIGINT, 0);
    uint64_t x = le(b, keep);
    if (keep < 8 && ext) x |= ~(uint64_t)0 << (8 * keep);
    if (n > 8 && ((x >> 63) != (ext & 1))) return push_int(v, CUMA_PK_BIGINT, 0);
    return push_int(v, CUMA_PK_INT, (int64_t)x);
}

static cuma_status step(vm *v, int *done) {
    v->op_at = v->pos;
    v->op = v->buf[v->pos++];
    cuma_status st = CUMA_OK;
    size_t at = 0;
    switch (v->op) {
    case 0x80: /* PROTO */
        if ((st = need(v, 1)) != CUMA_OK) return st;
        if (v->buf[v->pos] < 2 || v->buf[v->pos] > 5) return bad(v, "protocol not from 2 to 5");
        v->pos++;
        return CUMA_OK;
    case 0x95: /* FRAME: a length only; the bytes that follow are read as they come */
        if ((st = need(v, 8)) != CUMA_OK) return st;
        v->pos += 8;
        return CUMA_OK;
    case '.':
        if (v->sp != 1 || v->nmarks) return bad(v, "the stack does not hold exactly one value");
        v->p->root = v->stack[0];
        *done = 1;
        return CUMA_OK;
    case '(':
        if (v->nmarks >= v->lim.max_depth) return over(v, "open MARKs", v->lim.max_depth);
        if ((st = grow(v, (void **)&v->marks, &v->marks_cap, v->nmarks + 1, sizeof *v->marks)))
            return st;
        v->marks[v->nmarks++] = v->sp;
        return CUMA_OK;
    case '0':
        if (!v->sp) return bad(v, "the stack is empty");
        if (v->nmarks && v->marks[v->nmarks - 1] == v->sp) return bad(v, "pops past a MARK");
        v->sp--;
        return CUMA_OK;
    case '1':
        if ((st = pop_mark(v, &at)) != CUMA_OK) return st;
        v->sp = at;
        return CUMA_OK;
    case '2':
        if (!v->sp) return bad(v, "the stack is empty");
        return push(v, v->stack[v->sp - 1]);
    case 'N':
        return push_int(v, CUMA_PK_NONE, 0);
    case 0x88:
    case 0x89:
        return push_int(v, CUMA_PK_BOOL, v->op == 0x88);
    case 'J':
        if ((st = need(v, 4)) != CUMA_OK) return st;
        v->pos += 4;
        return push_int(v, CUMA_PK_INT, (int32_t)(uint32_t)le(v->buf + v->pos - 4, 4));
    case 'K':
        if ((st = need(v, 1)) != CUMA_OK) return st;
        return push_int(v, CUMA_PK_INT, v->buf[v->pos++]);
    case 'M':
        if ((st = need(v, 2)) != CUMA_OK) return st;
        v->pos += 2;
        return push_int(v, CUMA_PK_INT, (int64_t)le(v->buf + v->pos - 2, 2));
    case 0x8a:
        if ((st = need(v, 1)) != CUMA_OK) return st;
        return push_long(v, v->buf[v->pos++]);
    case 0x8b:
        if ((st = need(v, 4)) != CUMA_OK) return st;
        v->pos += 4;
        return push_long(v, (size_t)le(v->buf + v->pos - 4, 4));
    case 'G': {
        if ((st = need(v, 8)) != CUMA_OK) return st;
        uint64_t bits = 0;
        for (int i = 0; i < 8; i++) bits = bits << 8 | v->buf[v->pos + (size_t)i];
        v->pos += 8;
        double d;
        memcpy(&d, &bits, sizeof d);
        uint32_t i;
        if ((st = push_new(v, CUMA_PK_FLOAT, &i)) == CUMA_OK) v->p->node[i].u.f = d;
        return st;
    }
    case 0x8c: /* SHORT_BINUNICODE */
    case 'U':  /* SHORT_BINSTRING */
    case 'C':  /* SHORT_BINBYTES */
        if ((st = need(v, 1)) != CUMA_OK) return st;
        return push_text(v, v->op == 0x8c ? CUMA_PK_STR : CUMA_PK_BYTES, v->buf[v->pos++]);
    case 'X': /* BINUNICODE */
    case 'B': /* BINBYTES */
    case 'T': /* BINSTRING (a signed length; negative is malformed) */
        if ((st = need(v, 4)) != CUMA_OK) return st;
        v->pos += 4;
        if (v->op == 'T' && (v->buf[v->pos - 1] & 0x80)) return bad(v, "negative length");
        return push_text(v, v->op == 'X' ? CUMA_PK_STR : CUMA_PK_BYTES,
                         (size_t)le(v->buf + v->pos - 4, 4));
    case 0x8d: /* BINUNICODE8 */
    case 0x8e: /* BINBYTES8 */ {
        if ((st = need(v, 8)) != CUMA_OK) return st;
        v->pos += 8;
        uint64_t n = le(v->buf + v->pos - 8, 8);
        if (n > v->len - v->pos) return bad(v, "the pickle ends inside its argument (truncated)");
        return push_text(v, v->op == 0x8d ? CUMA_PK_STR : CUMA_PK_BYTES, (size_t)n);
    }
    case '}':
    case ']':
    case ')': {
        uint32_t i;
        return push_new(v,
                        v->op == '}'   ? CUMA_PK_DICT
                        : v->op == ']' ? CUMA_PK_LIST
                                       : CUMA_PK_TUPLE,
                        &i);
    }
    case 't':
    case 'l':
    case 'd':
        if ((st = pop_mark(v, &at)) != CUMA_OK) return st;
        return collect(v, at,
                       v->op == 't'   ? CUMA_PK_TUPLE
                       : v->op == 'l' ? CUMA_PK_LIST
                                      : CUMA_PK_DICT);
    case 0x85:
    case 0x86:
    case 0x87: {
        size_t k = (size_t)(v->op - 0x84);
        if (v->sp < k || (v->nmarks && v->sp - k < v->marks[v->nmarks - 1]))
            return bad(v, "too few values on the stack");
        return collect(v, v->sp - k, CUMA_PK_TUPLE);
    }
    case 'a':
        if (v->sp < 2 || (v->nmarks && v->marks[v->nmarks - 1] > v->sp - 2))
            return bad(v, "too few values on the stack");
        return fill(v, v->sp - 1, CUMA_PK_LIST);
    case 's':
        if (v->sp < 3 || (v->nmarks && v->marks[v->nmarks - 1] > v->sp - 3))
            return bad(v, "too few values on the stack");
        return fill(v, v->sp - 2, CUMA_PK_DICT);
    case 'e':
    case 'u':
        if ((st = pop_mark(v, &at)) != CUMA_OK) return st;
        return fill(v, at, v->op == 'e' ? CUMA_PK_LIST : CUMA_PK_DICT);
    case 0x94: /* MEMOIZE: the id is the number of entries set, as Python counts them */
        return memo_put(v, v->memo_count);
    case 'q':
        if ((st = need(v, 1)) != CUMA_OK) return st;
        return memo_put(v, v->buf[v->pos++]);
    case 'r':
        if ((st = need(v, 4)) != CUMA_OK) return st;
        v->pos += 4;
        return memo_put(v, le(v->buf + v->pos - 4, 4));
    case 'h':
        if ((st = need(v, 1)) != CUMA_OK) return st;
        return memo_get(v, v->buf[v->pos++]);
    case 'j':
        if ((st = need(v, 4)) != CUMA_OK) return st;
        v->pos += 4;
        return memo_get(v, le(v->buf + v->pos - 4, 4));
    case 'c':
    case 0x93:
    case 'R':
    case 'b':
    case 'i':
    case 'o':
    case 0x81:
    case 0x92:
    case 'P':
    case 'Q':
    case 0x82:
    case 0x83:
    case 0x84:
        return bad(v,
                   "refused: it names or calls Python code, and a snapshot holds plain data only");
    default:
        if (cuma_pickle_opcode_name(v->op))
            return bad(v, "refused: not an opcode of the plain-data subset this reader takes");
        return bad(v, "not a pickle opcode");
    }
}

static void vm_free(vm *v) {
    free(v->stack);
    free(v->marks);
    free(v->memo);
}

cuma_status cuma_pickle_parse(const uint8_t *buf, size_t len, const cuma_pickle_limits *lim,
                              cuma_pickle *out) {
    if (!out) return cuma_fail(CUMA_ERR_INVALID, "cuma_pickle_parse: out is NULL");
    memset(out, 0, sizeof *out);
    if (!buf && len) return cuma_fail(CUMA_ERR_INVALID, "cuma_pickle_parse: buf is NULL");
    vm v = {.buf = buf, .len = len, .lim = lim ? *lim : cuma_pickle_default_limits, .p = out};
    int done = 0;
    cuma_status st = CUMA_OK;
    while (st == CUMA_OK && !done) {
        if (v.pos >= v.len) {
            st = cuma_fail(CUMA_ERR_PARSE, "pickle: ends at offset %zu without STOP (truncated)",
                           v.len);
            break;
        }
        st = step(&v, &done);
    }
    vm_free(&v);
    if (st != CUMA_OK) {
        cuma_pickle_free(out);
        return st;
    }
#ifndef NDEBUG
    if (cuma_pickle_validate(out) != CUMA_OK) {
        cuma_pickle_free(out);
        return CUMA_ERR_CORRUPT;
    }
#endif
    return CUMA_OK;
}

void cuma_pickle_free(cuma_pickle *p) {
    if (!p) return;
    for (size_t i = 0; i < p->n; i++) {
        uint32_t k = p->node[i].kind;
        if (k == CUMA_PK_LIST || k == CUMA_PK_TUPLE || k == CUMA_PK_DICT)
            free(p->node[i].u.c.items);
    }
    free(p->node);
    free(p->text);
    memset(p, 0, sizeof *p);
}

cuma_status cuma_pickle_validate(const cuma_pickle *p) {
    if (!p) return cuma_fail(CUMA_ERR_INVALID, "cuma_pickle_validate: p is NULL");
    if (p->n && p->root >= p->n)
        return cuma_fail(CUMA_ERR_CORRUPT, "pickle: root %u of %zu nodes", p->root, p->n);
    for (size_t i = 0; i < p->n; i++) {
        const cuma_pickle_node *nd = &p->node[i];
        if (nd->kind > CUMA_PK_DICT)
            return cuma_fail(CUMA_ERR_CORRUPT, "pickle: node %zu of kind %u", i, nd->kind);
        if (nd->kind == CUMA_PK_STR || nd->kind == CUMA_PK_BYTES) {
            if (nd->u.s.off > p->text_len || nd->u.s.len > p->text_len - nd->u.s.off)
                return cuma_fail(CUMA_ERR_CORRUPT, "pickle: node %zu's text runs past the end", i);
            continue;
        }
        if (nd->kind < CUMA_PK_LIST) continue;
        size_t items = nd->kind == CUMA_PK_DICT ? 2 * (size_t)nd->n : nd->n;
        if (items > nd->u.c.cap)
            return cuma_fail(CUMA_ERR_CORRUPT, "pickle: node %zu holds %zu items in room for %u", i,
                             items, nd->u.c.cap);
        for (size_t j = 0; j < items; j++)
            if (nd->u.c.items[j] >= p->n)
                return cuma_fail(CUMA_ERR_CORRUPT, "pickle: node %zu item %zu is node %u of %zu", i,
                                 j, nd->u.c.items[j], p->n);
    }
    return CUMA_OK;
}

int64_t cuma_pickle_dict_get(const cuma_pickle *p, uint32_t d, const char *key, uint32_t max_items,
                             int *too_big) {
    if (too_big) *too_big = 0;
    if (d >= p->n || p->node[d].kind != CUMA_PK_DICT) return -1;
    const cuma_pickle_node *nd = &p->node[d];
    if (nd->n > max_items) {
        if (too_big) *too_big = 1;
        return -1;
    }
    size_t klen = strlen(key);
    for (size_t j = nd->n; j-- > 0;) {
        const cuma_pickle_node *k = &p->node[nd->u.c.items[2 * j]];
        if (k->kind == CUMA_PK_STR && k->u.s.len == klen &&
            !memcmp(p->text + k->u.s.off, key, klen))
            return nd->u.c.items[2 * j + 1];
    }
    return -1;
}
