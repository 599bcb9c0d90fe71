// SPDX-License-Identifier: Apache-2.0
/* The settings string parser (CUMA_CONF, cuma_config_check) on any bytes.
 *
 * Invariants checked:
 * - parsing returns CUMA_OK or CUMA_ERR_CONFIG with a message that names the string's origin;
 *   validation returns CUMA_OK or CUMA_ERR_CONFIG with a message; cuma_config_check agrees;
 * - applying the same string twice changes nothing the first application did not (the last
 *   value of a key wins, so parsing is idempotent);
 * - the JSON of parsed settings is well-formed, and written back as a settings string it parses
 *   to settings with the very same JSON (config.c keeps parsing and JSON in one table, so they
 *   must agree); fractions, which JSON prints with 6 digits, stay within that rounding;
 * - the JSON writer counts the same length whatever the buffer, and a short buffer holds a
 *   NUL-terminated prefix of the full text;
 * - a size cuma_parse_size accepts is an integer that reads back the same from its decimal;
 * - settings that validate make a heap on the simulated device (check_heap), or an error with a
 *   message;
 * - cuma_config_get and cuma_config_set agree with the parse (check_lookup).
 */
#include "fuzz.h"

#include "settings/config.h"

#include <math.h>
#include <string.h>

#define ORIGIN "fuzz"

/* The JSON text of s, in a buffer of exactly the length the writer asks for. */
static char *settings_json(const cuma_settings *s) {
    size_t need = cuma_settings_json(s, NULL, 0);
    char *full = malloc(need + 1);
    FZ_CHECK(full, "no memory for %zu bytes", need + 1);
    size_t got = cuma_settings_json(s, full, need + 1);
    FZ_CHECK(got == need && strlen(full) == need, "length %zu, then %zu and %zu", need, got,
             strlen(full));
    /* A short buffer: the same count, and what fits is the beginning of the text. */
    size_t half = need / 2 + 1;
    char *part = malloc(half);
    FZ_CHECK(part, "no memory");
    got = cuma_settings_json(s, part, half);
    FZ_CHECK(got == need && strlen(part) == half - 1 && !memcmp(part, full, half - 1),
             "a %zu-byte buffer got %zu bytes of text and a count of %zu (full: %zu)", half,
             strlen(part), got, need);
    free(part);
    return full;
}

typedef struct out {
    char *p;
    size_t n, cap;
} out;

static void put(out *o, const char *s, size_t n) {
    if (o->n + n + 1 > o->cap) {
        o->cap = (o->n + n + 1) * 2;
        o->p = realloc(o->p, o->cap);
        FZ_CHECK(o->p, "no memory");
    }
    memcpy(o->p + o->n, s, n);
    o->n += n;
    o->p[o->n] = 0;
}

/* A JSON string at *pp (after its opening quote) into o, unescaped; the escapes are the ones a
 * JSON writer may use. Moves *pp past the closing quote. */
static void json_string(const char **pp, out *o) {
    const char *p = *pp;
    for (; *p != '"'; p++) {
        FZ_CHECK(*p && (unsigned char)*p >= 0x20, "raw control byte 0x%02x in a JSON string",
                 (unsigned char)*p);
        if (*p != '\\') {
            put(o, p, 1);
            continue;
        }
        p++;
        char c;
        if (*p == '"' || *p == '\\' || *p == '/') {
            c = *p;
        } else if (*p == 'u') {
            unsigned v = 0;
            for (int i = 1; i <= 4; i++) {
                char h = p[i];
                int d = h >= '0' && h <= '9'   ? h - '0'
                        : h >= 'a' && h <= 'f' ? h - 'a' + 10
                        : h >= 'A' && h <= 'F' ? h - 'A' + 10
                                               : -1;
                FZ_CHECK(d >= 0, "bad \\u escape in JSON");
                v = v * 16 + (unsigned)d;
            }
            /* The writer escapes only control bytes; anything else goes out as it is. */
            FZ_CHECK(v > 0 && v < 0x20, "\\u%04x escape for a byte that needs none", v);
            c = (char)v;
            p += 4;
        } else {
            const char *simple = "b\bf\fn\nr\rt\t";
            const char *m = *p ? strchr(simple, *p) : NULL;
            FZ_CHECK(m && (m - simple) % 2 == 0, "bad escape \\%c in JSON", *p);
            c = m[1];
        }
        put(o, &c, 1);
    }
    *pp = p + 1;
}

/* The settings' JSON object body written back in the settings grammar. Fails the run when the
 * body is not a flat JSON object of numbers, strings, booleans and nulls. */
static char *conf_of_json(const char *json) {
    out o = {0};
    put(&o, "", 0);
    const char *p = json;
    while (*p) {
        FZ_CHECK(*p == '"', "expected a key at '%.20s'", p);
        p++;
        out key = {0};
        json_string(&p, &key);
        FZ_CHECK(key.n && *p == ':', "expected ':' after key '%s'", key.p ? key.p : "");
        p++;
        if (o.n) put(&o, ",", 1);
        put(&o, key.p, key.n);
        put(&o, ":", 1);
        if (*p == '"') {
            p++;
            out val = {0};
            json_string(&p, &val);
            /* A comma would split the item: a value that came from a parse has none. */
            FZ_CHECK(!val.p || !strchr(val.p, ','), "value of %s has a comma", key.p);
            if (val.n) put(&o, val.p, val.n);
            free(val.p);
        } else if (!strncmp(p, "null", 4)) {
            put(&o, "none", 4);
            p += 4;
        } else if (!strncmp(p, "true", 4)) {
            put(&o, "on", 2);
            p += 4;
        } else if (!strncmp(p, "false", 5)) {
            put(&o, "off", 3);
            p += 5;
        } else {
            size_t n = strspn(p, "-+.0123456789eE");
            FZ_CHECK(n, "expected a value for %s at '%.20s'", key.p, p);
            /* Durations print "never" as -1; every duration key ends in _ms. */
            size_t kn = strlen(key.p);
            if (n == 2 && !strncmp(p, "-1", 2) && kn > 3 && !strcmp(key.p + kn - 3, "_ms"))
                put(&o, "never", 5);
            else
                put(&o, p, n);
            p += n;
        }
        free(key.p);
        FZ_CHECK(*p == ',' || !*p, "expected ',' or the end at '%.20s'", p);
        if (*p) p++;
    }
    return o.p;
}

static void check_fraction(const char *what, double a, double b) {
    FZ_CHECK(fabs(a - b) <= 5e-6 * fmax(fabs(a), 1e-300) + 1e-300, "%s: %.17g read back as %.17g",
             what, a, b);
}

static void check_round_trip(const cuma_settings *s) {
    char *json = settings_json(s);
    char *conf = conf_of_json(json);
    cuma_settings t;
    cuma_settings_default(&t);
    cuma_status st = cuma_settings_parse(&t, conf, ORIGIN);
    FZ_CHECK(st == CUMA_OK, "the settings' own JSON, as a string, does not parse: %s", conf);
    char *again = settings_json(&t);
    FZ_CHECK(!strcmp(json, again), "settings changed on the way through JSON:\n%s\n%s", json,
             again);
    FZ_CHECK(cuma_settings_validate(&t) == cuma_settings_validate(s),
             "validation differs after the round trip");
    check_fraction("memory_fraction", s->memory_fraction, t.memory_fraction);
    check_fraction("fragmentation_threshold", s->fragmentation_threshold,
                   t.fragmentation_threshold);
    check_fraction("remap_threshold", s->remap_threshold, t.remap_threshold);
    check_fraction("page_call_budget", s->page_call_budget, t.page_call_budget);
    free(again);
    free(conf);
    free(json);
}

static void check_size(const char *text) {
    uint64_t v;
    if (!cuma_parse_size(text, &v)) return;
    char dec[32];
    snprintf(dec, sizeof dec, "%llu", (unsigned long long)v);
    uint64_t w;
    FZ_CHECK(cuma_parse_size(dec, &w) && w == v, "size '%s' is %s, which reads back otherwise",
             text, dec);
}

/* Settings that validate make a heap on the simulated device, whatever else they say: the
 * string is applied as given, then the keys that would reach outside the process (backend, trace
 * file, ledger) or make it depend on the wall clock are overridden. Creation may refuse a
 * combination, with a message; a heap it makes must allocate, free and validate. Devices are kept
 * small, so that host backing and page tables stay cheap. */
static void check_heap(const char *conf, const cuma_settings *s) {
    if (s->capacity > (1ull << 30) || (s->host_backing && s->capacity > (256ull << 20)) ||
        s->virtual_size > (64ull << 30) || strlen(conf) > 3800)
        return;
    char full[4097];
    snprintf(full, sizeof full,
             "%s,backend:sim,trace:none,ledger:off,sim_clock:manual,sim_call_us:0", conf);
    cuma_config cfg = {.conf = full, .flags = CUMA_CONFIG_NO_ENV};
    cuma_heap *h = NULL;
    cuma_status st = cuma_heap_create(&cfg, &h);
    if (st != CUMA_OK) {
        FZ_CHECK(!h && *cuma_last_error(), "creation failed with %d, no message or a heap",
                 (int)st);
        return;
    }
    size_t sizes[3] = {1, (size_t)s->page_size + 1, (size_t)(s->capacity / 3) + 1};
    void *p[3] = {NULL, NULL, NULL};
    for (int i = 0; i < 3; i++) {
        st = cuma_alloc(h, sizes[i], NULL, &p[i]);
        FZ_CHECK(st == CUMA_OK || st == CUMA_ERR_OOM || st == CUMA_ERR_LIMIT,
                 "allocation of %zu returned %d", sizes[i], (int)st);
        if (st) p[i] = NULL;
    }
    FZ_CHECK(cuma_validate(h) == CUMA_OK, "validate with blocks live");
    for (int i = 0; i < 3; i++) FZ_CHECK(cuma_free(h, p[i], NULL) == CUMA_OK, "free");
    FZ_CHECK(cuma_trim(h, 0) == CUMA_OK && cuma_validate(h) == CUMA_OK, "trim and validate");
    cuma_heap_destroy(h);
}

/* cuma_config_get and cuma_config_set, the grammar's reader for tools and Python, against the
 * parse: the same verdict and message; the value read is the JSON's; the rewritten string,
 * limit left out, parses to the same settings but the limit. `parsed` is conf's parse status,
 * s its settings when it parsed and msg its message when it did not. */
static void check_lookup(const char *conf, cuma_status parsed, const cuma_settings *s,
                         const char *msg) {
    size_t need = 0;
    cuma_status st = cuma_config_set(conf, ORIGIN, "limit", NULL, NULL, 0, &need);
    if (parsed != CUMA_OK) {
        FZ_CHECK(st == parsed && !strcmp(cuma_last_error(), msg),
                 "cuma_config_set says %d '%s', the parse %d '%s'", (int)st, cuma_last_error(),
                 (int)parsed, msg);
        st = cuma_config_get(conf, ORIGIN, "limit", NULL, 0, &need);
        FZ_CHECK(st == parsed && !strcmp(cuma_last_error(), msg),
                 "cuma_config_get says %d '%s', the parse %d '%s'", (int)st, cuma_last_error(),
                 (int)parsed, msg);
        return;
    }
    FZ_CHECK(st == CUMA_ERR_INVALID && need <= strlen(conf), "set measured %zu bytes (%d)", need,
             (int)st);
    char *rewritten = malloc(need + 1);
    FZ_CHECK(rewritten, "no memory");
    FZ_CHECK(cuma_config_set(conf, ORIGIN, "limit", NULL, rewritten, need + 1, NULL) == CUMA_OK,
             "set failed with room: %s", cuma_last_error());
    cuma_settings t, want;
    cuma_settings_default(&t);
    FZ_CHECK(cuma_settings_parse(&t, rewritten, ORIGIN) == CUMA_OK, "'%s' does not parse: %s",
             rewritten, cuma_last_error());
    memcpy(&want, s, sizeof want);
    want.limit = t.limit; /* the default: no limit item is left */
    char *a = settings_json(&want), *b = settings_json(&t);
    FZ_CHECK(!strcmp(a, b) && t.limit == CUMA_UNLIMITED, "'%s' rewritten as '%s' differs", conf,
             rewritten);
    char value[32];
    FZ_CHECK(cuma_config_get(conf, ORIGIN, "limit", value, sizeof value, NULL) == CUMA_OK,
             "get failed: %s", cuma_last_error());
    char expect[32];
    if (s->limit == CUMA_UNLIMITED)
        snprintf(expect, sizeof expect, "null");
    else
        snprintf(expect, sizeof expect, "%llu", (unsigned long long)s->limit);
    FZ_CHECK(!strcmp(value, expect), "get says %s, the parse %s", value, expect);
    free(a);
    free(b);
    free(rewritten);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    char *conf = malloc(size + 1);
    FZ_CHECK(conf, "no memory");
    memcpy(conf, data, size);
    conf[size] = 0;
    check_size(conf);

    cuma_settings s;
    cuma_settings_default(&s);
    cuma_status st = cuma_settings_parse(&s, conf, ORIGIN);
    cuma_status checked = cuma_config_check(conf);
    if (st != CUMA_OK) {
        FZ_CHECK(st == CUMA_ERR_CONFIG, "parse returned %d", (int)st);
        cuma_settings_parse(&s, conf, ORIGIN); /* cuma_config_check overwrote the message */
        const char *msg = cuma_last_error();
        FZ_CHECK(!strncmp(msg, ORIGIN ": ", strlen(ORIGIN) + 2),
                 "message does not name the origin: '%s'", msg);
        FZ_CHECK(checked == st, "cuma_config_check says %d, the parse %d", (int)checked, (int)st);
        char *why = strdup(msg);
        FZ_CHECK(why, "no memory");
        check_lookup(conf, st, NULL, why);
        free(why);
        free(conf);
        return 0;
    }
    cuma_status valid = cuma_settings_validate(&s);
    FZ_CHECK(valid == CUMA_OK || (valid == CUMA_ERR_CONFIG && *cuma_last_error()),
             "validate returned %d with message '%s'", (int)valid, cuma_last_error());
    FZ_CHECK(checked == valid, "cuma_config_check says %d, parse and validate %d", (int)checked,
             (int)valid);

    cuma_settings twice;
    memcpy(&twice, &s, sizeof s);
    FZ_CHECK(cuma_settings_parse(&twice, conf, ORIGIN) == CUMA_OK, "a second parse failed");
    FZ_CHECK(!memcmp(&twice, &s, sizeof s), "parsing the string again changed the settings");

    check_round_trip(&s);
    check_lookup(conf, CUMA_OK, &s, NULL);
    if (valid == CUMA_OK) check_heap(conf, &s);
    free(conf);
    return 0;
}
