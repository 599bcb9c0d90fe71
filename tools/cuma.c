// SPDX-License-Identifier: Apache-2.0
/* main of the `cuma` command: a table of subcommands, so adding one (stats, ...) is one
 * function and one row. */
#include "cli.h"

#include "cuma/cuma.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef struct subcommand {
    const char *name;
    int (*run)(int argc, char **argv);
    const char *summary; /* one line for the overview */
    const char *usage;   /* the full text for `cuma help NAME` */
} subcommand;

static int cmd_config(int argc, char **argv);
static int cmd_version(int argc, char **argv);
static int cmd_help(int argc, char **argv);

#define CONFIG_USAGE                                                                               \
    "usage: cuma config [--check STR]\n"                                                           \
    "  Without options: every configuration key (CUMA_CONF grammar \"key:value,...\"), its\n"      \
    "  default and its meaning.\n"                                                                 \
    "  --check STR   validate a settings string; on a bad key or value print the error and\n"      \
    "                exit with status 2\n"

static const subcommand commands[] = {
    {"replay", cuma_cmd_replay,
     "replay RMM traces, PyTorch snapshots or profiler traces on the simulated device",
     CUMA_REPLAY_USAGE},
    {"leaks", cuma_cmd_leaks,
     "allocations live at the end of a trace by call site, and growing ones", CUMA_LEAKS_USAGE},
    {"plot", cuma_cmd_plot, "draw replay timelines as an SVG figure, or a trace as an HTML report",
     CUMA_PLOT_USAGE},
    {"convert", cuma_cmd_convert, "write a trace as a PyTorch memory snapshot (for memory_viz)",
     CUMA_CONVERT_USAGE},
    {"ps", cuma_cmd_ps, "list the live heaps of the ledger, by device", CUMA_PS_USAGE},
    {"top", cuma_cmd_top, "the heaps of the ledger, refreshed, with their rates of change",
     CUMA_TOP_USAGE},
    {"stats", cuma_cmd_stats, "every figure of the ledger's heaps (or some PIDs'), one block each",
     CUMA_STATS_USAGE},
    {"exporter", cuma_cmd_exporter, "serve the ledger as Prometheus metrics (or print them once)",
     CUMA_EXPORTER_USAGE},
    {"config", cmd_config, "list the configuration keys, or check a settings string", CONFIG_USAGE},
    {"version", cmd_version, "print the version", "usage: cuma version\n"},
    {"help", cmd_help, "print this overview, or the usage of one subcommand",
     "usage: cuma help [SUBCOMMAND]\n"},
};

#define NCOMMANDS (sizeof commands / sizeof commands[0])

static const subcommand *find(const char *name) {
    for (size_t i = 0; i < NCOMMANDS; i++)
        if (!strcmp(commands[i].name, name)) return &commands[i];
    return NULL;
}

/* The overview followed by every subcommand's usage, so one `cuma --help` says everything. */
static void usage(FILE *f) {
    fprintf(f, "usage: cuma SUBCOMMAND [ARGS...]\n\nsubcommands:\n");
    for (size_t i = 0; i < NCOMMANDS; i++)
        fprintf(f, "  %-10s %s\n", commands[i].name, commands[i].summary);
    for (size_t i = 0; i < NCOMMANDS; i++) fprintf(f, "\n%s", commands[i].usage);
    fprintf(f, "\nCUMA_CONF=\"key:value,...\" sets defaults for every heap (`cuma config` lists "
               "the keys).\n");
}

static int cmd_help(int argc, char **argv) {
    if (argc < 2) {
        usage(stdout);
        return CUMA_EXIT_OK;
    }
    const subcommand *c = find(argv[1]);
    if (!c) {
        cli_eprintf("cuma help: unknown subcommand '%s'\n\n", argv[1]);
        usage(stderr);
        return CUMA_EXIT_USAGE;
    }
    fputs(c->usage, stdout);
    return CUMA_EXIT_OK;
}

static int cmd_version(int argc, char **argv) {
    if (argc == 2 && cli_is_help(argv[1])) {
        fputs("usage: cuma version\n  Prints the version of cuma.\n", stdout);
        return CUMA_EXIT_OK;
    }
    if (argc > 1) {
        fputs("usage: cuma version\n", stderr);
        return CUMA_EXIT_USAGE;
    }
    printf("cuma %d.%d.%d\n", CUMA_VERSION_MAJOR, CUMA_VERSION_MINOR, CUMA_VERSION_PATCH);
    return CUMA_EXIT_OK;
}

/* Prints cuma_config_describe()'s table, sized by a first call that only measures. */
static int print_config_table(void) {
    size_t needed = 0;
    cuma_config_describe(NULL, 0, &needed); /* fails by design: it only reports the size */
    char *buf = malloc(needed + 1);
    if (!buf) {
        cli_eprintf("cuma config: out of memory\n");
        return CUMA_EXIT_FAIL;
    }
    cuma_status st = cuma_config_describe(buf, needed + 1, NULL);
    if (st != CUMA_OK) {
        cli_eprintf("cuma config: %s\n", cuma_last_error());
        free(buf);
        return CUMA_EXIT_FAIL;
    }
    fputs(buf, stdout);
    free(buf);
    return CUMA_EXIT_OK;
}

static int cmd_config(int argc, char **argv) {
    if (argc == 1) return print_config_table();
    if (argc == 2 && cli_is_help(argv[1])) {
        fputs(CONFIG_USAGE, stdout);
        return CUMA_EXIT_OK;
    }
    const char *check = NULL;
    if (argc == 3 && !strcmp(argv[1], "--check"))
        check = argv[2];
    else if (argc == 2 && !strncmp(argv[1], "--check=", 8))
        check = argv[1] + 8;
    if (!check) {
        fputs(CONFIG_USAGE, stderr);
        return CUMA_EXIT_USAGE;
    }
    if (cuma_config_check(check) != CUMA_OK) {
        /* The library's message already starts with where the string came from. */
        cli_eprintf("cuma: %s\n", cuma_last_error());
        return CUMA_EXIT_USAGE;
    }
    printf("ok\n");
    return CUMA_EXIT_OK;
}

int main(int argc, char **argv) {
    if (argc < 2) {
        usage(stderr);
        return CUMA_EXIT_USAGE;
    }
    const char *name = argv[1];
    if (cli_is_help(name))
        name = "help";
    else if (!strcmp(name, "--version"))
        name = "version";
    const subcommand *c = find(name);
    if (!c) {
        cli_eprintf("cuma: unknown subcommand '%s'\n\n", argv[1]);
        usage(stderr);
        return CUMA_EXIT_USAGE;
    }
    /* `cuma --help` is `cuma help`: it reaches cmd_help with no further argument. */
    if (c->run == cmd_help && cli_is_help(argv[1])) return cmd_help(1, argv + 1);
    return c->run(argc - 1, argv + 1);
}
