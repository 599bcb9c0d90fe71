// SPDX-License-Identifier: Apache-2.0
/* What every subcommand of the `cuma` command parses and reports the same way. */
#include "cli.h"

#include "util/strbuf.h"

#include <stdarg.h>
#include <stdio.h>
#include <string.h>

const char *cli_option(int argc, char **argv, int *i, const char *name, int *missing) {
    size_t n = strlen(name);
    if (strncmp(argv[*i], name, n)) return NULL;
    if (argv[*i][n] == '=' && name[1] == '-') return argv[*i] + n + 1;
    if (argv[*i][n] != 0) return NULL;
    if (*i + 1 >= argc) {
        *missing = 1;
        return NULL;
    }
    return argv[++*i];
}

int cli_is_help(const char *a) {
    return !strcmp(a, "-h") || !strcmp(a, "--help");
}

int cli_wants_help(int argc, char **argv, const char *usage) {
    for (int i = 1; i < argc && strcmp(argv[i], "--"); i++)
        if (cli_is_help(argv[i])) {
            fputs(usage, stdout);
            return 1;
        }
    return 0;
}

static void put_escaped(FILE *f, const char *text) {
    char piece[8192];
    for (const char *p = text; *p;) {
        size_t n = strcspn(p, "\n");
        char raw[2048];
        size_t k = n < sizeof raw - 1 ? n : sizeof raw - 1;
        memcpy(raw, p, k);
        raw[k] = 0;
        fputs(cuma_escape(raw, piece, sizeof piece), f);
        p += k;
        if (k == n && *p == '\n') fputc('\n', f), p++;
    }
}

void cli_eprintf(const char *fmt, ...) {
    char text[8192];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(text, sizeof text, fmt, ap);
    va_end(ap);
    put_escaped(stderr, text);
}

const char *cli_shown(const char *text, char *buf, size_t len) {
    return cuma_escape(text, buf, len);
}

int cli_usage_error(const char *cmd, const char *usage, const char *fmt, ...) {
    char text[8192];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(text, sizeof text, fmt, ap);
    va_end(ap);
    fprintf(stderr, "cuma %s: ", cmd);
    put_escaped(stderr, text);
    fprintf(stderr, "\n%s", usage);
    return CUMA_EXIT_USAGE;
}
