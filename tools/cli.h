/* The `cuma` command: one main (cuma.c) dispatching to one function per subcommand.
 *
 * Each subcommand gets argv with argv[0] = its own name and returns the process exit status:
 * 0 success, 1 a failure while running (heap error, broken invariant), 2 bad input (usage,
 * options, configuration, unreadable or malformed files).
 */
#ifndef CUMA_TOOLS_CLI_H
#define CUMA_TOOLS_CLI_H

#define CUMA_EXIT_OK    0
#define CUMA_EXIT_FAIL  1
#define CUMA_EXIT_USAGE 2

/* Kept here so `cuma help replay` and replay's own error path print the same text. */
#define CUMA_REPLAY_USAGE                                                                          \
    "usage: cuma replay [--conf STR] [--scale K] [--policy NAME] [--json] TRACE...\n"              \
    "  Replays RMM CSV event logs (plain or .gz) on the simulated device, twice per trace:\n"      \
    "  once driving the heap's clock with the trace's timestamps to measure memory, once\n"        \
    "  without stats calls to time the alloc/free path.\n"                                         \
    "  --conf STR     settings appended after backend:sim,sim_clock:manual (they win)\n"           \
    "  --policy NAME  shorthand for --conf policy:NAME\n"                                          \
    "  --scale K      multiply every size by the positive integer K (16 brings the bundled\n"      \
    "                 traces to GPU scale)\n"                                                      \
    "  --json         one JSON object per trace and line instead of the table\n"

int cuma_cmd_replay(int argc, char **argv);

#endif
