// SPDX-License-Identifier: Apache-2.0
/* PYTORCH_CUDA_ALLOC_CONF text for the PyTorch allocator model (torch_model.h): comma-separated
 * `key:value` items, as python/cuma/_alloc_conf.py reads them (items trimmed, empty ones
 * skipped), plus the bracketed list form of roundup_power2_divisions, whose commas are its own. */
#include "torch_model.h"

#include "util/error.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

#define MIB          ((uint64_t)1 << 20)
#define MAX_ITEM_LEN 255

void cuma_tm_conf_default(cuma_tm_conf *c) {
    memset(c, 0, sizeof *c);
    c->max_split_size = CUMA_TM_NO_SPLIT_LIMIT;
    c->max_non_split_rounding = CUMA_TM_LARGE_BUFFER;
}

static int parse_u64(const char *s, uint64_t *out) {
    char *end;
    if (*s < '0' || *s > '9') return -1;
    errno = 0;
    unsigned long long v = strtoull(s, &end, 10);
    if (*end || errno) return -1;
    *out = v;
    return 0;
}

static int parse_double(const char *s, double *out) {
    char *end;
    if (!*s) return -1;
    errno = 0;
    double v = strtod(s, &end);
    if (*end || errno || v != v) return -1;
    *out = v;
    return 0;
}

static int is_pow2(uint64_t v) {
    return v && !(v & (v - 1));
}

static unsigned log2_floor(uint64_t v) {
    return 63u - (unsigned)__builtin_clzll(v);
}

/* A division count: 0 (off) or a power of two. */
static cuma_status division(const char *key, const char *s, uint32_t *out) {
    uint64_t v;
    if (parse_u64(s, &v) || (v && !is_pow2(v)) || v > (1u << 30))
        return cuma_fail(CUMA_ERR_CONFIG, "pytorch conf: %s: '%s' is not 0 or a power of two", key,
                         s);
    *out = (uint32_t)v;
    return CUMA_OK;
}

/* "[256:1,512:2,>:8]": sizes in MiB (powers of two) to division counts; the first entry also
 * covers the sizes below it, ">" every interval after the last one named (after the first,
 * 1 MiB, when none is: as PyTorch does). */
static cuma_status division_list(char *list, uint32_t *div) {
    int first = 1;
    unsigned last = 0;
    for (char *it = list, *comma; it; it = comma ? comma + 1 : NULL) {
        comma = strchr(it, ',');
        if (comma) *comma = '\0';
        while (*it == ' ') it++;
        if (!*it) continue;
        char *colon = strchr(it, ':');
        if (!colon)
            return cuma_fail(CUMA_ERR_CONFIG,
                             "pytorch conf: roundup_power2_divisions: '%s' is not SIZE_MB:N", it);
        *colon = '\0';
        uint32_t n = 0;
        cuma_status st = division("roundup_power2_divisions", colon + 1, &n);
        if (st != CUMA_OK) return st;
        if (!strcmp(it, ">")) {
            for (unsigned i = last + 1; i < CUMA_TM_DIV_INTERVALS; i++) div[i] = n;
            continue;
        }
        uint64_t mb;
        if (parse_u64(it, &mb) || !is_pow2(mb))
            return cuma_fail(CUMA_ERR_CONFIG,
                             "pytorch conf: roundup_power2_divisions: size "
                             "'%s' is not a power of two (MiB)",
                             it);
        unsigned idx = log2_floor(mb);
        if (idx >= CUMA_TM_DIV_INTERVALS) idx = CUMA_TM_DIV_INTERVALS - 1;
        if (first)
            for (unsigned i = 0; i < idx; i++) div[i] = n;
        first = 0;
        div[idx] = n;
        last = idx;
    }
    return CUMA_OK;
}

static cuma_status apply(cuma_tm_conf *c, char *key, char *val) {
    uint64_t u;
    double d;
    if (!strcmp(key, "max_split_size_mb")) {
        if (parse_u64(val, &u) || u <= CUMA_TM_LARGE_BUFFER / MIB || u > UINT64_MAX / MIB)
            return cuma_fail(CUMA_ERR_CONFIG,
                             "pytorch conf: max_split_size_mb: '%s' is not an "
                             "integer over %llu",
                             val, (unsigned long long)(CUMA_TM_LARGE_BUFFER / MIB));
        c->max_split_size = u * MIB;
    } else if (!strcmp(key, "max_non_split_rounding_mb")) {
        if (parse_u64(val, &u) || u > UINT64_MAX / MIB)
            return cuma_fail(CUMA_ERR_CONFIG,
                             "pytorch conf: max_non_split_rounding_mb: '%s' is not an integer",
                             val);
        c->max_non_split_rounding = u * MIB;
    } else if (!strcmp(key, "garbage_collection_threshold")) {
        if (parse_double(val, &d) || !(d > 0 && d < 1))
            return cuma_fail(CUMA_ERR_CONFIG,
                             "pytorch conf: garbage_collection_threshold: '%s' "
                             "is not a number between 0 and 1",
                             val);
        c->gc_threshold = d;
    } else if (!strcmp(key, "per_process_memory_fraction")) {
        if (parse_double(val, &d) || !(d > 0 && d <= 1))
            return cuma_fail(CUMA_ERR_CONFIG,
                             "pytorch conf: per_process_memory_fraction: '%s' "
                             "is not a fraction between 0 and 1",
                             val);
        c->memory_fraction = d;
    } else if (!strcmp(key, "roundup_power2_divisions")) {
        size_t len = strlen(val);
        if (val[0] == '[') {
            if (len < 2 || val[len - 1] != ']')
                return cuma_fail(CUMA_ERR_CONFIG,
                                 "pytorch conf: roundup_power2_divisions: '%s' "
                                 "has no closing ]",
                                 val);
            val[len - 1] = '\0';
            return division_list(val + 1, c->divisions);
        }
        uint32_t n = 0;
        cuma_status st = division(key, val, &n);
        if (st != CUMA_OK) return st;
        for (unsigned i = 0; i < CUMA_TM_DIV_INTERVALS; i++) c->divisions[i] = n;
    } else if (!strcmp(key, "expandable_segments")) {
        if (!strcasecmp(val, "true") || !strcmp(val, "1"))
            c->expandable = 1;
        else if (!strcasecmp(val, "false") || !strcmp(val, "0"))
            c->expandable = 0;
        else
            return cuma_fail(CUMA_ERR_CONFIG,
                             "pytorch conf: expandable_segments: '%s' is not True or False", val);
    } else if (!strcmp(key, "backend")) {
        if (strcmp(val, "native"))
            return cuma_fail(CUMA_ERR_CONFIG,
                             "pytorch conf: backend: only 'native' is "
                             "modelled, not '%s'",
                             val);
    } else if (strncmp(key, "pinned_", 7)) {
        return cuma_fail(CUMA_ERR_CONFIG, "pytorch conf: unknown option '%s'", key);
    }
    return CUMA_OK;
}

static char *trim(char *s) {
    while (*s == ' ' || *s == '\t') s++;
    size_t n = strlen(s);
    while (n && (s[n - 1] == ' ' || s[n - 1] == '\t')) s[--n] = '\0';
    return s;
}

cuma_status cuma_tm_conf_parse(cuma_tm_conf *c, const char *text) {
    cuma_tm_conf work = *c;
    for (const char *p = text ? text : ""; *p;) {
        /* One item: up to a comma outside brackets. */
        size_t n = 0;
        int depth = 0;
        while (p[n] && (depth || p[n] != ',')) {
            depth += p[n] == '[';
            depth -= p[n] == ']' && depth;
            n++;
        }
        if (n > MAX_ITEM_LEN)
            return cuma_fail(CUMA_ERR_CONFIG,
                             "pytorch conf: an item of %zu characters (at most "
                             "%d)",
                             n, MAX_ITEM_LEN);
        char item[MAX_ITEM_LEN + 1];
        memcpy(item, p, n);
        item[n] = '\0';
        p += n + (p[n] == ',');
        char *it = trim(item);
        if (!*it) continue;
        char *colon = strchr(it, ':');
        if (!colon) return cuma_fail(CUMA_ERR_CONFIG, "pytorch conf: '%s' is not key:value", it);
        *colon = '\0';
        cuma_status st = apply(&work, trim(it), trim(colon + 1));
        if (st != CUMA_OK) return st;
    }
    *c = work;
    return CUMA_OK;
}
