// SPDX-License-Identifier: Apache-2.0
/* The CUMA_CONF grammar (src/settings/config.c): every key of the table, sizes, bad values and the
 * messages that name them, none/never, whitespace, the order in which settings apply (defaults,
 * CUMA_CONF, cfg->conf), cuma_config_describe, cuma_config_check and cuma_settings_validate. */
#include "check.h"
#include "settings/config.h"
#include "util/marks.h"

#include <stdbool.h>
#include <stdint.h>
#include <string.h>

#define KB (1024ull)
#define MB (1024ull * 1024)
#define GB (1024ull * 1024 * 1024)
#define TB (1024ull * 1024 * 1024 * 1024)

/* Settings compare by their JSON dump, which holds every key of the table (the char arrays
 * in cuma_settings have undefined bytes after their NUL, so memcmp would not do). */
typedef struct json {
    char text[4096];
} json;

static json json_of(const cuma_settings *s) {
    json j;
    size_t n = cuma_settings_json(s, j.text, sizeof j.text);
    CHECK(n < sizeof j.text && strlen(j.text) == n);
    return j;
}

static bool same_settings(const cuma_settings *a, const cuma_settings *b) {
    json ja = json_of(a), jb = json_of(b);
    return !strcmp(ja.text, jb.text);
}

/* The keys and defaults as cuma_config_describe lists them ("KEY DEFAULT MEANING" lines). */
typedef struct keyrow {
    char key[64], def[64];
} keyrow;

static char *describe_all(size_t *len) {
    size_t need = 0;
    CHECK_ST(cuma_config_describe(NULL, 0, &need), CUMA_ERR_INVALID);
    CHECK(need > 0);
    char *buf = malloc(need + 1);
    CHECK(buf);
    size_t need2 = 0;
    CHECK_OK(cuma_config_describe(buf, need + 1, &need2));
    CHECK(need2 == need && strlen(buf) == need);
    if (len) *len = need;
    return buf;
}

static int table_keys(keyrow *rows, int max) {
    char *buf = describe_all(NULL);
    int n = 0;
    char *save = NULL;
    bool header = true;
    for (char *line = strtok_r(buf, "\n", &save); line; line = strtok_r(NULL, "\n", &save)) {
        keyrow r;
        CHECK(sscanf(line, "%63s %63s", r.key, r.def) == 2);
        if (header) {
            CHECK(!strcmp(r.key, "KEY") && !strcmp(r.def, "DEFAULT"));
            header = false;
            continue;
        }
        CHECK(n < max);
        rows[n++] = r;
    }
    free(buf);
    return n;
}

static void test_defaults(void) {
    cuma_settings d;
    cuma_settings_default(&d);
    CHECK(!strcmp(d.backend, "auto") && !d.backend_named && !strcmp(d.policy, "tlsf"));
    CHECK(d.capacity == 80 * GB && d.page_size == 2 * MB);
    CHECK(d.limit == CUMA_UNLIMITED && d.max_cached == CUMA_UNLIMITED);
    CHECK(d.memory_fraction == 0 && d.fragmentation_threshold == 0.05);
    CHECK(d.release_delay_ms == 1000 && d.growth && d.preallocate == 0 && d.virtual_size == 0);
    CHECK(d.segment_size == 20 * MB && !d.host_backing && !d.sim_clock_manual);
    CHECK(!d.managed_fallback && d.device == 0);
    CHECK(d.remap_threshold == 0 && d.early_remap && d.sim_lag_ms == 0);
    CHECK(!d.nvtx);
    CHECK_OK(cuma_settings_validate(&d));

    /* Every key of the table parses its own default: onto defaults (no change), onto a value
     * of its own that differs (back to the default), and all keys at once onto a zeroed
     * struct give the defaults. */
    keyrow rows[64];
    int n = table_keys(rows, 64);
    CHECK(n >= 15);
    char all[4096] = "";
    static const char *candidates[] = {"1",  "0",    "on",    "off",   "4K",     "0.5",     "7",
                                       "3G", "none", "never", "buddy", "manual", "segment", "sim"};
    for (int i = 0; i < n; i++) {
        for (int j = 0; j < i; j++) CHECK(strcmp(rows[i].key, rows[j].key)); /* listed once */
        char item[160];
        snprintf(item, sizeof item, "%.63s:%.63s", rows[i].key, rows[i].def);
        cuma_settings s;
        cuma_settings_default(&s);
        cuma_status st = cuma_settings_parse(&s, item, "test");
        if (st)
            fprintf(stderr, "default of key %s does not parse: %s\n", rows[i].key,
                    cuma_last_error());
        CHECK_OK(st);
        CHECK(same_settings(&s, &d));
        CHECK_OK(cuma_config_check(item));
        bool moved = false;
        for (size_t c = 0; c < sizeof candidates / sizeof candidates[0]; c++) {
            char other[160];
            snprintf(other, sizeof other, "%.63s:%s", rows[i].key, candidates[c]);
            cuma_settings_default(&s);
            if (cuma_settings_parse(&s, other, "test") != CUMA_OK || same_settings(&s, &d))
                continue;
            moved = true;
            CHECK_OK(cuma_settings_parse(&s, item, "test"));
            CHECK(same_settings(&s, &d));
        }
        if (!moved) fprintf(stderr, "key %s: no other value tried\n", rows[i].key);
        CHECK(moved);
        /* Mixed case keys are not keys. */
        snprintf(item, sizeof item, "%c%.62s:%.63s", rows[i].key[0] - 32, rows[i].key + 1,
                 rows[i].def);
        CHECK_ST(cuma_config_check(item), CUMA_ERR_CONFIG);
        CHECK(strlen(all) + strlen(rows[i].key) + strlen(rows[i].def) + 3 < sizeof all);
        if (i) strcat(all, ",");
        strcat(all, rows[i].key);
        strcat(all, ":");
        strcat(all, rows[i].def);
    }
    cuma_settings s;
    memset(&s, 0, sizeof s);
    CHECK(!same_settings(&s, &d));
    CHECK_OK(cuma_settings_parse(&s, all, "test"));
    CHECK(same_settings(&s, &d));

    /* The JSON dump names the same keys, and only those. */
    char json[4096];
    size_t jn = cuma_settings_json(&d, json, sizeof json);
    CHECK(jn == strlen(json) && jn < sizeof json);
    int quoted_keys = 0;
    for (const char *p = json; (p = strstr(p, "\":")); p += 2) quoted_keys++;
    CHECK(quoted_keys == n);
    for (int i = 0; i < n; i++) {
        char k[80];
        snprintf(k, sizeof k, "\"%s\":", rows[i].key);
        CHECK(strstr(json, k));
    }
    CHECK(strstr(json, "\"limit\":null") && strstr(json, "\"sim_clock\":\"real\""));
    CHECK(strstr(json, "\"capacity\":85899345920") && strstr(json, "\"release_delay_ms\":1000"));
    /* Truncation: the needed length, a NUL-terminated prefix. */
    char small[16];
    CHECK(cuma_settings_json(&d, small, sizeof small) == jn);
    CHECK(strlen(small) == sizeof small - 1 && !strncmp(small, json, sizeof small - 1));
}

static uint64_t size_of(const char *text) {
    uint64_t v = 12345;
    if (!cuma_parse_size(text, &v)) {
        fprintf(stderr, "size '%s' did not parse\n", text);
        CHECK(0);
    }
    return v;
}

static void test_sizes(void) {
    CHECK(size_of("0") == 0);
    CHECK(size_of("1") == 1);
    CHECK(size_of("512") == 512);
    CHECK(size_of("64K") == 64 * KB && size_of("64k") == 64 * KB);
    CHECK(size_of("2M") == 2 * MB && size_of("2m") == 2 * MB);
    CHECK(size_of("80G") == 80 * GB && size_of("80g") == 80 * GB);
    CHECK(size_of("1T") == TB && size_of("3t") == 3 * TB);
    CHECK(size_of("1.5G") == 3 * GB / 2);
    CHECK(size_of("0.5K") == 512);
    CHECK(size_of("2.25M") == 2 * MB + MB / 4);
    CHECK(size_of("2MiB") == 2 * MB && size_of("2MB") == 2 * MB && size_of("2mb") == 2 * MB);
    CHECK(size_of("4KiB") == 4 * KB && size_of("1GiB") == GB && size_of("1TiB") == TB);
    CHECK(size_of("16383T") == 16383 * TB);
    /* Exact in integers, where a double would round. */
    CHECK(size_of("9007199254740993") == 9007199254740993ull);
    CHECK(size_of("18446744073709551614") == UINT64_MAX - 1);
    CHECK(size_of("0.0009765625K") == 1 && size_of("1.50G") == 3 * GB / 2);
    CHECK(size_of("007M") == 7 * MB && size_of("16777215.5T") == 16777215 * TB + TB / 2);
    static const char *bad[] = {
        "", "-1", "-0", "-1G", "1.3", "1.1K", "2X", "K", "G", "2KK", "2 M", "2Mi", "2MiBs", "abc",
        "nan", "inf", "1e400", "16E", "2MBB", "0.1", "20000000T", " ", "2M ", "2iB", "1.5", "-1.5G",
        "1G1", "--1",
        /* What strtod/strtoull take that no size means: hex (floats
         * too), exponents, a sign, whitespace, a wrapped negative,
         * values past 64 bits or at the "unlimited" marker. */
        "0x1p30", "0X1P30", "0x10", "0x10M", "1e3", "1E3K", "+1M", " 1M", "\t1M", "1.", ".5G",
        "1.M", "infinity", "NAN", "18446744073709551615", "18446744073709551616",
        "99999999999999999999999", "16777216T", "0.00000000000000000001G", "1.3T"};
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        uint64_t v = 777;
        if (cuma_parse_size(bad[i], &v)) {
            fprintf(stderr, "size '%s' parsed as %llu\n", bad[i], (unsigned long long)v);
            CHECK(0);
        }
        CHECK(v == 777); /* untouched on failure */
    }
    CHECK(!cuma_parse_size(NULL, &(uint64_t){0}));

    /* Through the grammar. */
    cuma_settings s;
    cuma_settings_default(&s);
    CHECK_OK(
        cuma_settings_parse(&s, "capacity:1.5G,page_size:4K,limit:2MiB,segment_size:3MB", "test"));
    CHECK(s.capacity == 3 * GB / 2 && s.page_size == 4 * KB && s.limit == 2 * MB);
    CHECK(s.segment_size == 3 * MB);
    CHECK_OK(cuma_settings_parse(&s, "capacity:2T,virtual_size:8T,preallocate:0", "test"));
    CHECK(s.capacity == 2 * TB && s.virtual_size == 8 * TB && s.preallocate == 0);
    /* The other numbers' documented forms still read. */
    CHECK_OK(cuma_settings_parse(&s, "page_call_budget:1e-3,memory_fraction:.5,priority:-5", "t"));
    CHECK(s.page_call_budget == 1e-3 && s.memory_fraction == 0.5 && s.priority == -5);
    CHECK_OK(cuma_settings_parse(&s, "remap_threshold:1,release_delay_ms:007,arenas:2", "t"));
    CHECK(s.remap_threshold == 1 && s.release_delay_ms == 7 && s.arenas == 2);
}

/* Parses conf onto defaults, expects CUMA_ERR_CONFIG and a message holding every `want`. */
static void bad_conf(const char *conf, const char *want1, const char *want2) {
    cuma_settings s;
    cuma_settings_default(&s);
    cuma_status st = cuma_settings_parse(&s, conf, "origin_x");
    if (st != CUMA_ERR_CONFIG) {
        fprintf(stderr, "'%s' gave %s, wanted a configuration error\n", conf,
                cuma_status_string(st));
        CHECK(0);
    }
    const char *e = cuma_last_error();
    if (!strstr(e, "origin_x") || (want1 && !strstr(e, want1)) || (want2 && !strstr(e, want2))) {
        fprintf(stderr, "'%s': message '%s' lacks '%s' or '%s' or the origin\n", conf, e,
                want1 ? want1 : "", want2 ? want2 : "");
        CHECK(0);
    }
    /* The public check says the same. */
    CHECK_ST(cuma_config_check(conf), CUMA_ERR_CONFIG);
    if (want1) CHECK(strstr(cuma_last_error(), want1));
    if (want2) CHECK(strstr(cuma_last_error(), want2));
}

static void test_bad_values(void) {
    bad_conf("bogus:1", "bogus", NULL);
    bad_conf("capacity:1G,bogus_key:1", "bogus_key", NULL);
    bad_conf(":5", "unknown key", NULL);
    bad_conf("capacity", "capacity", "key:value");
    bad_conf("policy:tlsf,capacity 1G", "capacity 1G", "key:value");
    bad_conf("capacity:-1G", "capacity", "-1G");
    bad_conf("page_size:-2M", "page_size", "-2M");
    bad_conf("capacity:", "capacity", "''");
    bad_conf("capacity:12Q", "capacity", "12Q");
    bad_conf("capacity:1.1K", "capacity", "1.1K");
    bad_conf("limit:lots", "limit", "lots");
    bad_conf("max_cached:-1", "max_cached", "-1");
    bad_conf("memory_fraction:1.5", "memory_fraction", "1.5");
    bad_conf("memory_fraction:-0.1", "memory_fraction", "-0.1");
    bad_conf("memory_fraction:half", "memory_fraction", "half");
    bad_conf("memory_fraction:nan", "memory_fraction", "nan");
    bad_conf("fragmentation_threshold:2", "fragmentation_threshold", "'2'");
    bad_conf("remap_threshold:-0.5", "remap_threshold", "'-0.5'");
    bad_conf("early_remap:sometimes", "early_remap", "sometimes");
    bad_conf("sim_lag_ms:5000", "sim_lag_ms", "5000");
    bad_conf("growth:maybe", "growth", "maybe");
    bad_conf("host_backing:2", "host_backing", "'2'");
    bad_conf("managed_fallback:", "managed_fallback", "''");
    bad_conf("policy:firstfit", "policy", "firstfit");
    bad_conf("policy:TLSF", "policy", "TLSF"); /* names are case-sensitive */
    bad_conf("backend:cuda", "backend", "cuda");
    bad_conf("sim_clock:fast", "sim_clock", "fast");
    bad_conf("release_delay_ms:-5", "release_delay_ms", "-5");
    bad_conf("release_delay_ms:1.5", "release_delay_ms", "1.5");
    bad_conf("release_delay_ms:soon", "release_delay_ms", "soon");
    bad_conf("release_delay_ms:1s", "release_delay_ms", "1s");
    bad_conf("device:-1", "device", "-1");
    bad_conf("device:gpu0", "device", "gpu0");
    bad_conf("device:1024", "device", "1024");
    bad_conf("preallocate:none", "preallocate", "none"); /* none only where the table allows it */
    bad_conf("capacity:never", "capacity", "never");
    bad_conf("policy:tlsf:buddy", "policy", "tlsf:buddy");
    /* Numbers strtod/strtol would take and no key documents (issue 13). */
    bad_conf("limit:0x1p30", "limit", "0x1p30");
    bad_conf("capacity:0x40000000", "capacity", "0x40000000");
    bad_conf("capacity:1e9", "capacity", "1e9");
    bad_conf("limit:+1G", "limit", "+1G");
    bad_conf("memory_fraction:0x0.8p0", "memory_fraction", "0x0.8p0");
    bad_conf("memory_fraction:+0.5", "memory_fraction", "+0.5");
    bad_conf("memory_fraction:inf", "memory_fraction", "inf");
    bad_conf("remap_threshold:1e", "remap_threshold", "1e");
    bad_conf("release_delay_ms:+5", "release_delay_ms", "+5");
    bad_conf("release_delay_ms:0x10", "release_delay_ms", "0x10");
    bad_conf("release_delay_ms:-0", "release_delay_ms", "-0");
    bad_conf("release_delay_ms:99999999999999999999", "release_delay_ms", "99999999999999999999");
    bad_conf("device:+1", "device", "+1");
    bad_conf("arenas:0x2", "arenas", "0x2");
    bad_conf("priority:+5", "priority", "+5");
    bad_conf("priority:--1", "priority", "--1");
    bad_conf("priority:-", "priority", "-");
    /* The name list is in the message of a bad name. */
    bad_conf("policy:x", "tlsf|buddy|bestfit", NULL);
    /* A bad item after good ones still fails, and names the bad one. */
    bad_conf("capacity:1G, page_size:4M , growth:perhaps", "growth", "perhaps");
    /* Too long a string. */
    char *longconf = malloc(5000);
    CHECK(longconf);
    memset(longconf, ',', 4999);
    longconf[4999] = 0;
    CHECK_ST(cuma_config_check(longconf), CUMA_ERR_CONFIG);
    CHECK(strstr(cuma_last_error(), "4096"));
    memset(longconf, ',', 4096);
    longconf[4096] = 0;
    CHECK_OK(cuma_config_check(longconf)); /* exactly the longest string allowed */
    free(longconf);
}

static void test_special_values(void) {
    cuma_settings s;
    cuma_settings_default(&s);
    CHECK_OK(cuma_settings_parse(&s, "limit:4G,max_cached:1G,release_delay_ms:5", "test"));
    CHECK(s.limit == 4 * GB && s.max_cached == GB && s.release_delay_ms == 5);
    CHECK_OK(cuma_settings_parse(&s, "limit:none,max_cached:none,release_delay_ms:never", "test"));
    CHECK(s.limit == CUMA_UNLIMITED && s.max_cached == CUMA_UNLIMITED && s.release_delay_ms == -1);
    CHECK_OK(cuma_settings_parse(&s, "limit:1G,max_cached:0,release_delay_ms:0", "test"));
    CHECK(s.limit == GB && s.max_cached == 0 && s.release_delay_ms == 0);
    CHECK_OK(
        cuma_settings_parse(&s, "limit:NONE,max_cached:Unlimited,release_delay_ms:Never", "t"));
    CHECK(s.limit == CUMA_UNLIMITED && s.max_cached == CUMA_UNLIMITED && s.release_delay_ms == -1);
    /* Fractions in the JSON read back exactly, in their shortest form. */
    CHECK_OK(cuma_settings_parse(&s, "remap_threshold:0.1234567,memory_fraction:0.1", "test"));
    json j = json_of(&s);
    CHECK(strstr(j.text, "\"remap_threshold\":0.1234567,"));
    CHECK(strstr(j.text, "\"memory_fraction\":0.1,"));
    /* Ledger names: a group's with a name, of the longest parts (48 + 48), is kept whole, not cut
     * to a shorter one that another long name could share. */
    char longest[128];
    snprintf(longest, sizeof longest, "ledger:@%048d+%048d", 7, 9);
    CHECK_OK(cuma_settings_parse(&s, longest, "test"));
    CHECK(!strcmp(s.ledger, longest + strlen("ledger:")));
    static const char *bad_ledgers[] = {"ledger:@",      "ledger:@+x", "ledger:@g+",
                                        "ledger:@g+a+b", "ledger:a+b", "ledger:@g h"};
    for (size_t i = 0; i < sizeof bad_ledgers / sizeof bad_ledgers[0]; i++)
        CHECK_ST(cuma_settings_parse(&s, bad_ledgers[i], "test"), CUMA_ERR_CONFIG);
    /* Booleans in every spelling. */
    static const char *yes[] = {"on", "true", "1", "yes", "ON", "True", "YES"};
    static const char *no[] = {"off", "false", "0", "no", "OFF", "False", "No"};
    for (int i = 0; i < 7; i++) {
        char c[64];
        snprintf(c, sizeof c, "host_backing:%s", yes[i]);
        CHECK_OK(cuma_settings_parse(&s, c, "test"));
        CHECK(s.host_backing);
        snprintf(c, sizeof c, "host_backing:%s", no[i]);
        CHECK_OK(cuma_settings_parse(&s, c, "test"));
        CHECK(!s.host_backing);
    }
    /* Names. */
    CHECK_OK(cuma_settings_parse(&s, "policy:buddy,backend:auto,sim_clock:manual", "test"));
    CHECK(!strcmp(s.policy, "buddy") && !strcmp(s.backend, "auto") && s.sim_clock_manual);
    CHECK_OK(cuma_settings_parse(&s, "policy:bestfit,sim_clock:real", "test"));
    CHECK(!strcmp(s.policy, "tlsf") && !s.sim_clock_manual); /* bestfit is an alias */
    CHECK_OK(cuma_settings_parse(&s, "backend:segment,backend:vmm", "test"));
    CHECK(!strcmp(s.backend, "vmm"));
    CHECK_OK(cuma_settings_parse(&s, "memory_fraction:0,fragmentation_threshold:1", "test"));
    CHECK(s.memory_fraction == 0 && s.fragmentation_threshold == 1);
    CHECK_OK(cuma_settings_parse(&s, "remap_threshold:0.1,early_remap:off,sim_lag_ms:7", "test"));
    CHECK(s.remap_threshold == 0.1 && !s.early_remap && s.sim_lag_ms == 7);
    CHECK_OK(cuma_settings_parse(&s, "memory_fraction:0.25,device:1023", "test"));
    CHECK(s.memory_fraction == 0.25 && s.device == 1023);
}

static void test_whitespace_and_order(void) {
    cuma_settings d, s;
    cuma_settings_default(&d);
    s = d;
    CHECK_OK(cuma_settings_parse(&s, NULL, "test"));
    CHECK_OK(cuma_settings_parse(&s, "", "test"));
    CHECK_OK(cuma_settings_parse(&s, ",,, ,\t,", "test"));
    CHECK_OK(cuma_settings_parse(&s, "   ", "test"));
    CHECK(same_settings(&s, &d));
    CHECK_OK(cuma_settings_parse(
        &s, "  capacity : 1G , page_size:4M ,, ,\tpolicy:\tbuddy\t,limit : none ,", "test"));
    CHECK(s.capacity == GB && s.page_size == 4 * MB && !strcmp(s.policy, "buddy"));
    CHECK(s.limit == CUMA_UNLIMITED);
    /* Later items win, also within one string. */
    CHECK_OK(cuma_settings_parse(&s, "capacity:1G,capacity:2G,policy:buddy,policy:tlsf", "test"));
    CHECK(s.capacity == 2 * GB && !strcmp(s.policy, "tlsf"));
    CHECK_OK(cuma_settings_parse(&s,
                                 "limit:1G,limit:none,release_delay_ms:never,"
                                 "release_delay_ms:20",
                                 "test"));
    CHECK(s.limit == CUMA_UNLIMITED && s.release_delay_ms == 20);
    /* A later string applies on top of an earlier one and keeps what it does not name. */
    CHECK_OK(cuma_settings_parse(&s, "page_size:64K", "test"));
    CHECK(s.capacity == 2 * GB && s.page_size == 64 * KB && s.release_delay_ms == 20);
    CHECK_OK(cuma_config_check(" capacity:1G , page_size : 4M "));
    CHECK_OK(cuma_config_check(NULL));
    CHECK_OK(cuma_config_check(""));
}

static void test_environment(void) {
    cuma_settings s;
    cuma_config cfg = {0};
    CHECK(!setenv("CUMA_CONF", "capacity:1G,page_size:4M,policy:buddy", 1));
    CHECK_OK(cuma_settings_from_config(&s, NULL));
    CHECK(s.capacity == GB && s.page_size == 4 * MB && !strcmp(s.policy, "buddy"));
    CHECK_OK(cuma_settings_from_config(&s, &cfg));
    CHECK(s.capacity == GB && s.page_size == 4 * MB);
    /* NO_ENV: defaults only. */
    cfg.flags = CUMA_CONFIG_NO_ENV;
    CHECK_OK(cuma_settings_from_config(&s, &cfg));
    CHECK(s.capacity == 80 * GB && s.page_size == 2 * MB && !strcmp(s.policy, "tlsf"));
    /* cfg->conf wins over CUMA_CONF; what it does not name comes from CUMA_CONF. */
    cfg.flags = 0;
    cfg.conf = "capacity:2G,policy:tlsf";
    CHECK_OK(cuma_settings_from_config(&s, &cfg));
    CHECK(s.capacity == 2 * GB && s.page_size == 4 * MB && !strcmp(s.policy, "tlsf"));
    cfg.flags = CUMA_CONFIG_NO_ENV;
    CHECK_OK(cuma_settings_from_config(&s, &cfg));
    CHECK(s.capacity == 2 * GB && s.page_size == 2 * MB);
    /* cfg->device applies when set. */
    cfg.device = 5;
    CHECK_OK(cuma_settings_from_config(&s, &cfg));
    CHECK(s.device == 5);
    cfg.device = 0;
    /* A bad CUMA_CONF is an error that names the variable and the key, unless ignored. */
    CHECK(!setenv("CUMA_CONF", "capacity:1G,bogus_env_key:1", 1));
    CHECK_ST(cuma_settings_from_config(&s, NULL), CUMA_ERR_CONFIG);
    CHECK(strstr(cuma_last_error(), "CUMA_CONF") && strstr(cuma_last_error(), "bogus_env_key"));
    cfg.flags = 0;
    cfg.conf = "capacity:2G";
    CHECK_ST(cuma_settings_from_config(&s, &cfg), CUMA_ERR_CONFIG);
    cfg.flags = CUMA_CONFIG_NO_ENV;
    CHECK_OK(cuma_settings_from_config(&s, &cfg));
    /* A bad cfg->conf names its origin, not CUMA_CONF. */
    CHECK(!setenv("CUMA_CONF", "capacity:1G", 1));
    cfg.flags = 0;
    cfg.conf = "growth:sometimes";
    CHECK_ST(cuma_settings_from_config(&s, &cfg), CUMA_ERR_CONFIG);
    CHECK(strstr(cuma_last_error(), "growth") && strstr(cuma_last_error(), "sometimes"));
    CHECK(!strstr(cuma_last_error(), "CUMA_CONF"));
    /* The combination is validated: each part alone is fine, together they are not. */
    CHECK(!setenv("CUMA_CONF", "page_size:4M", 1));
    cfg.conf = "capacity:6M";
    CHECK_ST(cuma_settings_from_config(&s, &cfg), CUMA_ERR_CONFIG);
    CHECK(strstr(cuma_last_error(), "capacity"));
    /* Heaps read it too. */
    CHECK(!setenv("CUMA_CONF", "capacity:64M,sim_clock:manual,bogus_heap_key:1", 1));
    cuma_heap *h = NULL;
    CHECK_ST(cuma_heap_create(NULL, &h), CUMA_ERR_CONFIG);
    CHECK(!h && strstr(cuma_last_error(), "bogus_heap_key"));
    cuma_config heapcfg = {.conf = "backend:sim,capacity:64M,sim_clock:manual",
                           .flags = CUMA_CONFIG_NO_ENV};
    CHECK_OK(cuma_heap_create(&heapcfg, &h));
    cuma_heap_destroy(h);
    CHECK(!unsetenv("CUMA_CONF"));
    CHECK_OK(cuma_settings_from_config(&s, NULL));
    CHECK(s.capacity == 80 * GB);
}

static void test_describe(void) {
    size_t need;
    char *full = describe_all(&need);
    keyrow rows[64];
    int n = table_keys(rows, 64);
    /* Every key on a line of its own with its default and a meaning. */
    for (int i = 0; i < n; i++) {
        char *line = full;
        bool found = false;
        size_t kl = strlen(rows[i].key);
        for (; line && *line; line = strchr(line, '\n'), line = line ? line + 1 : NULL) {
            if (!strncmp(line, rows[i].key, kl) && line[kl] == ' ') {
                found = true;
                const char *eol = strchr(line, '\n');
                CHECK(eol && eol - line > (long)(kl + strlen(rows[i].def) + 8));
                break;
            }
        }
        CHECK(found);
    }
    static const char *expect[] = {"backend",
                                   "policy",
                                   "capacity",
                                   "page_size",
                                   "limit",
                                   "memory_fraction",
                                   "max_cached",
                                   "release_delay_ms",
                                   "fragmentation_threshold",
                                   "growth",
                                   "preallocate",
                                   "virtual_size",
                                   "segment_size",
                                   "host_backing",
                                   "sim_clock",
                                   "managed_fallback",
                                   "device"};
    for (size_t i = 0; i < sizeof expect / sizeof expect[0]; i++) {
        bool found = false;
        for (int j = 0; j < n; j++) found |= !strcmp(rows[j].key, expect[i]);
        if (!found) fprintf(stderr, "key %s is not described\n", expect[i]);
        CHECK(found);
    }
    CHECK(strstr(full, "tlsf|buddy|bestfit") && strstr(full, "real|manual"));

    /* Too small a buffer: CUMA_ERR_INVALID, the needed size in *needed and in the message,
     * and a NUL-terminated prefix. */
    char needed_text[32];
    snprintf(needed_text, sizeof needed_text, "%zu needed", need + 1);
    size_t sizes[] = {1, 2, 10, 100, need / 2, need - 1, need};
    for (size_t k = 0; k < sizeof sizes / sizeof sizes[0]; k++) {
        size_t len = sizes[k];
        char *buf = malloc(len + 8);
        CHECK(buf);
        memset(buf, 'Z', len + 8);
        size_t got = 0;
        CHECK_ST(cuma_config_describe(buf, len, &got), CUMA_ERR_INVALID);
        CHECK(got == need);
        CHECK(strstr(cuma_last_error(), needed_text));
        CHECK(strlen(buf) == len - 1 && !strncmp(buf, full, len - 1));
        CHECK(buf[len] == 'Z'); /* nothing written past len */
        free(buf);
    }
    CHECK_ST(cuma_config_describe(NULL, 0, NULL), CUMA_ERR_INVALID);
    char *big = malloc(need + 100);
    CHECK(big);
    CHECK_OK(cuma_config_describe(big, need + 100, NULL));
    CHECK(!strcmp(big, full));
    free(big);
    free(full);
    /* config.c put(): with buf == NULL and len > 0 it hands vsnprintf a NULL buffer of len
     * bytes and crashes, where cuma_config_describe means to report the needed size. */
    size_t got = 0;
    CHECK_ST(cuma_config_describe(NULL, 100, &got), CUMA_ERR_INVALID);
    CHECK(got == need);
}

static void test_check_and_validate(void) {
    CHECK_OK(cuma_config_check("policy:buddy,capacity:1G,page_size:64K"));
    CHECK_OK(cuma_config_check("growth:off,preallocate:1G"));
    CHECK_OK(cuma_config_check("page_size:4K,capacity:4K"));
    CHECK_OK(cuma_config_check("virtual_size:80G"));
    CHECK_OK(cuma_config_check("limit:2M"));
    CHECK_OK(cuma_config_check("capacity:64T"));
    struct {
        const char *conf, *want;
    } bad[] = {
        {"page_size:3M", "page_size"},
        {"page_size:2K", "page_size"},
        {"page_size:0", "page_size"},
        {"page_size:6K,capacity:6K", "page_size"},
        {"capacity:3M", "capacity"},
        {"capacity:0", "capacity"},
        {"capacity:1M", "capacity"}, /* smaller than a page */
        {"capacity:65T", "capacity"},
        {"growth:off", "growth"},
        {"growth:off,preallocate:0", "growth"},
        {"virtual_size:1G", "virtual_size"},
        {"virtual_size:129T", "virtual_size"},
        {"limit:1M", "limit"},
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        cuma_status st = cuma_config_check(bad[i].conf);
        if (st != CUMA_ERR_CONFIG || !strstr(cuma_last_error(), bad[i].want)) {
            fprintf(stderr, "'%s': %s, '%s'\n", bad[i].conf, cuma_status_string(st),
                    cuma_last_error());
            CHECK(0);
        }
    }
    /* cuma_settings_validate on hand-made settings. */
    cuma_settings s;
    cuma_settings_default(&s);
    CHECK_OK(cuma_settings_validate(&s));
    s.page_size = 3 * MB;
    CHECK_ST(cuma_settings_validate(&s), CUMA_ERR_CONFIG);
    CHECK(strstr(cuma_last_error(), "page_size") && strstr(cuma_last_error(), "power of two"));
    s.page_size = (2 * MB) | 1;
    CHECK_ST(cuma_settings_validate(&s), CUMA_ERR_CONFIG);
    s.page_size = 2 * MB;
    s.capacity = 80 * GB + 4096;
    CHECK_ST(cuma_settings_validate(&s), CUMA_ERR_CONFIG);
    CHECK(strstr(cuma_last_error(), "capacity") && strstr(cuma_last_error(), "page_size"));
    s.capacity = 80 * GB + 2 * MB;
    CHECK_OK(cuma_settings_validate(&s));
    s.growth = false;
    CHECK_ST(cuma_settings_validate(&s), CUMA_ERR_CONFIG);
    CHECK(strstr(cuma_last_error(), "growth:off") && strstr(cuma_last_error(), "preallocate"));
    s.preallocate = 2 * MB;
    CHECK_OK(cuma_settings_validate(&s));
    s.virtual_size = s.capacity - 2 * MB;
    CHECK_ST(cuma_settings_validate(&s), CUMA_ERR_CONFIG);
    s.virtual_size = s.capacity;
    CHECK_OK(cuma_settings_validate(&s));
    /* A heap refuses the same settings. */
    cuma_config cfg = {.conf = "capacity:64M,page_size:3M", .flags = CUMA_CONFIG_NO_ENV};
    cuma_heap *h = (cuma_heap *)&cfg;
    CHECK_ST(cuma_heap_create(&cfg, &h), CUMA_ERR_CONFIG);
    CHECK(!h && strstr(cuma_last_error(), "page_size"));
}

/* nvtx:on parses anywhere; only a libcuma built with the nvtx3 headers takes it, and one built
 * without says why (tests/nvtx checks the ranges themselves). */
static void test_nvtx(void) {
    cuma_settings s;
    cuma_settings_default(&s);
    CHECK_OK(cuma_settings_parse(&s, "nvtx:on", "test"));
    CHECK(s.nvtx);
    CHECK_OK(cuma_settings_parse(&s, "nvtx:off", "test"));
    CHECK(!s.nvtx);
    CHECK_ST(cuma_config_check("nvtx:maybe"), CUMA_ERR_CONFIG);
    CHECK(strstr(cuma_last_error(), "nvtx") && strstr(cuma_last_error(), "on or off"));
    if (cuma_marks_missing()) {
        CHECK_ST(cuma_config_check("nvtx:on"), CUMA_ERR_CONFIG);
        CHECK(strstr(cuma_last_error(), "nvtx:on") && strstr(cuma_last_error(), "without NVTX"));
    } else {
        CHECK_OK(cuma_config_check("nvtx:on"));
    }
}

/* config.c accepts any int64 of milliseconds, and heap.c multiplies release_delay_ms by 10^6
 * in int64_t: 10^13 ms overflows (undefined behaviour; it wraps to a bogus delay, and UBSan
 * builds abort). Expected: the key rejects what cannot be held in nanoseconds. */
static void test_ms_overflow(void) {
    CHECK_ST(cuma_config_check("release_delay_ms:10000000000000"), CUMA_ERR_CONFIG);
    CHECK(strstr(cuma_last_error(), "release_delay_ms"));
}

int main(void) {
    unsetenv("CUMA_CONF");
    test_defaults();
    test_sizes();
    test_bad_values();
    test_special_values();
    test_whitespace_and_order();
    test_environment();
    test_describe();
    test_check_and_validate();
    test_ms_overflow();
    test_nvtx();
    printf("test_config: all passed\n");
    return 0;
}
