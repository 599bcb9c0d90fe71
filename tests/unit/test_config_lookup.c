// SPDX-License-Identifier: Apache-2.0
/* cuma_config_get and cuma_config_set, the reader of the settings grammar that tools and the
 * Python package use instead of splitting a string themselves: every key of the table read
 * back as the stats spell it, the grammar's rules (whitespace, the last item wins, none, the
 * spellings of on and off), a bad string refused with cuma_config_check's very message, a key
 * rewritten, and the buffer protocol of cuma_config_describe. */
#include "check.h"
#include "settings/config.h"

#include <stdbool.h>
#include <stdlib.h>
#include <string.h>

static char text[4200];

/* cuma_config_get's value, checked to have needed its own length. */
static const char *get(const char *conf, const char *key) {
    size_t needed = 0;
    CHECK_OK(cuma_config_get(conf, NULL, key, text, sizeof text, &needed));
    CHECK(needed == strlen(text));
    return text;
}

static const char *set(const char *conf, const char *key, const char *value) {
    size_t needed = 0;
    CHECK_OK(cuma_config_set(conf, NULL, key, value, text, sizeof text, &needed));
    CHECK(needed == strlen(text));
    return text;
}

/* The text after `"key":` in the settings JSON, up to the next top-level comma. */
static void json_field(const char *json, const char *key, char *out, size_t len) {
    char pat[80];
    snprintf(pat, sizeof pat, "\"%s\":", key);
    const char *p = strstr(json, pat);
    CHECK(p);
    p += strlen(pat);
    size_t n = 0;
    for (bool in_str = false; p[n] && (in_str || p[n] != ','); n++)
        if (p[n] == '"' && (n == 0 || p[n - 1] != '\\')) in_str = !in_str;
    CHECK(n < len);
    memcpy(out, p, n);
    out[n] = 0;
}

/* Every key of the table, found through `cuma config`'s listing, reads back as the settings
 * JSON shows it: a new key needs nothing here, nor in any reader. */
static void test_every_key(void) {
    size_t need = 0;
    CHECK_ST(cuma_config_describe(NULL, 0, &need), CUMA_ERR_INVALID);
    char *table = malloc(need + 1);
    CHECK(table);
    CHECK_OK(cuma_config_describe(table, need + 1, NULL));
    cuma_settings s;
    cuma_settings_default(&s);
    static char json[8192];
    CHECK(cuma_settings_json(&s, json, sizeof json) < sizeof json);
    int keys = 0;
    char *save = NULL;
    strtok_r(table, "\n", &save); /* the header */
    for (char *line = strtok_r(NULL, "\n", &save); line; line = strtok_r(NULL, "\n", &save)) {
        char key[64], want[300];
        if (sscanf(line, "%63s", key) != 1) continue;
        json_field(json, key, want, sizeof want);
        if (strcmp(get(NULL, key), want)) {
            fprintf(stderr, "key %s: cuma_config_get says %s, the JSON %s\n", key, text, want);
            CHECK(0);
        }
        keys++;
    }
    CHECK(keys > 30);
    free(table);
}

static void test_grammar(void) {
    CHECK(!strcmp(get(NULL, "limit"), "null"));
    CHECK(!strcmp(get("", "growth"), "true"));
    CHECK(!strcmp(get(" limit : 8G ", "limit"), "8589934592"));
    CHECK(!strcmp(get("limit:8G,,limit:none", "limit"), "null"));        /* the last one wins */
    CHECK(!strcmp(get("limit:unlimited,limit:1M", "limit"), "1048576")); /* either way */
    CHECK(!strcmp(get("growth:NO", "growth"), "false"));
    CHECK(!strcmp(get("growth:False,growth:yes", "growth"), "true"));
    CHECK(!strcmp(get("release_delay_ms:never", "release_delay_ms"), "-1"));
    CHECK(!strcmp(get("policy:bestfit", "policy"), "\"tlsf\""));
    CHECK(!strcmp(get("trace:none", "trace"), "null"));
    CHECK(!strcmp(get("trace:/tmp/x:%p.csv", "trace"), "\"/tmp/x:%p.csv\""));
    CHECK(!strcmp(get("sim_clock:manual", "sim_clock"), "\"manual\""));
    /* Cross-key rules are the heap's (cuma_settings_validate): one key can be read alone. */
    CHECK(!strcmp(get("growth:off", "growth"), "false"));
}

/* Each bad string is refused by the lookup, by a rewrite and by cuma_config_check with the
 * same message, and a given origin takes the place of "config" in it. */
static void test_refused_alike(void) {
    static const char *bad[] = {
        "bogus",        "limit:lots",     "no_such_key:1",
        "growth:maybe", "capacity:1G,:1", "policy:first,limit:1G",
        "trace:a,b%q",
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        char want[512], msg[600];
        CHECK_ST(cuma_config_check(bad[i]), CUMA_ERR_CONFIG);
        snprintf(want, sizeof want, "%s", cuma_last_error());
        CHECK(!strncmp(want, "config: ", 8));
        size_t needed = 1;
        CHECK_ST(cuma_config_get(bad[i], NULL, "limit", text, sizeof text, &needed),
                 CUMA_ERR_CONFIG);
        CHECK(needed == 0 && !text[0] && !strcmp(cuma_last_error(), want));
        CHECK_ST(cuma_config_set(bad[i], NULL, "capacity", "1G", text, sizeof text, NULL),
                 CUMA_ERR_CONFIG);
        CHECK(!strcmp(cuma_last_error(), want));
        /* Even the key being replaced is checked: a typo is never dropped unseen. */
        CHECK_ST(cuma_config_set(bad[i], NULL, "limit", "1G", text, sizeof text, NULL),
                 CUMA_ERR_CONFIG);
        CHECK(!strcmp(cuma_last_error(), want));
        CHECK_ST(cuma_config_get(bad[i], "CUMA_CONF", "limit", text, sizeof text, NULL),
                 CUMA_ERR_CONFIG);
        snprintf(msg, sizeof msg, "CUMA_CONF: %s", want + 8);
        CHECK(!strcmp(cuma_last_error(), msg));
        /* A heap reading the string from the environment says the same. */
        setenv("CUMA_CONF", bad[i], 1);
        cuma_heap *h = NULL;
        cuma_config cfg = {.conf = "backend:sim"};
        CHECK_ST(cuma_heap_create(&cfg, &h), CUMA_ERR_CONFIG);
        CHECK(!strcmp(cuma_last_error(), msg));
        unsetenv("CUMA_CONF");
    }
    /* The key asked for is checked against the same table. */
    CHECK_ST(cuma_config_get("", NULL, "no_such_key", text, sizeof text, NULL), CUMA_ERR_CONFIG);
    CHECK(strstr(cuma_last_error(), "unknown key 'no_such_key'"));
    CHECK_ST(cuma_config_set("", NULL, "no_such_key", "1", text, sizeof text, NULL),
             CUMA_ERR_CONFIG);
    CHECK(strstr(cuma_last_error(), "unknown key 'no_such_key'"));
    CHECK_ST(cuma_config_get("", NULL, NULL, text, sizeof text, NULL), CUMA_ERR_INVALID);
}

static void test_set(void) {
    CHECK(!strcmp(set(NULL, "limit", "1G"), "limit:1G"));
    CHECK(!strcmp(set("", "preallocate", NULL), ""));
    CHECK(!strcmp(set(" capacity : 1G ,limit:2G,,limit:3G", "limit", " 4G "),
                  "capacity:1G,limit:4G"));
    CHECK(!strcmp(set("growth:off,preallocate:1G,capacity:2G", "preallocate", NULL),
                  "growth:off,capacity:2G"));
    CHECK(!strcmp(set("trace:/tmp/a:b.csv", "growth", "on"), "trace:/tmp/a:b.csv,growth:on"));
    /* The new value is checked too, and is one item: a comma cannot bring in another key. */
    CHECK_ST(cuma_config_set("", NULL, "limit", "lots", text, sizeof text, NULL), CUMA_ERR_CONFIG);
    CHECK(strstr(cuma_last_error(), "bad value 'lots' for key 'limit'"));
    CHECK_ST(cuma_config_set("", NULL, "limit", "1G,capacity:2G", text, sizeof text, NULL),
             CUMA_ERR_CONFIG);
    CHECK(strstr(cuma_last_error(), "key 'limit'") && strstr(cuma_last_error(), "commas"));
}

/* As cuma_config_describe: the length needed without the NUL, CUMA_ERR_INVALID until it fits. */
static void test_buffers(void) {
    size_t needed = 0;
    CHECK_ST(cuma_config_get("limit:8G", NULL, "limit", NULL, 0, &needed), CUMA_ERR_INVALID);
    CHECK(needed == 10);
    char small[10];
    CHECK_ST(cuma_config_get("limit:8G", NULL, "limit", small, sizeof small, &needed),
             CUMA_ERR_INVALID);
    char fits[11];
    CHECK_OK(cuma_config_get("limit:8G", NULL, "limit", fits, sizeof fits, &needed));
    CHECK(!strcmp(fits, "8589934592"));
    CHECK_ST(cuma_config_set("capacity:1G", NULL, "limit", "2G", NULL, 0, &needed),
             CUMA_ERR_INVALID);
    CHECK(needed == strlen("capacity:1G,limit:2G"));
}

int main(void) {
    unsetenv("CUMA_CONF");
    test_every_key();
    test_grammar();
    test_refused_alike();
    test_set();
    test_buffers();
    printf("test_config_lookup: all passed\n");
    return 0;
}
