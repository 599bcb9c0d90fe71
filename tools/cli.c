/* What every subcommand of the `cuma` command parses and reports the same way. */
#include "cli.h"

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

int cli_usage_error(const char *cmd, const char *usage, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    fprintf(stderr, "cuma %s: ", cmd);
    vfprintf(stderr, fmt, ap);
    fprintf(stderr, "\n%s", usage);
    va_end(ap);
    return CUMA_EXIT_USAGE;
}
