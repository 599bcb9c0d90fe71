// SPDX-License-Identifier: Apache-2.0
/* The `cuma` command: one main (cuma.c) dispatching to one function per subcommand.
 *
 * Each subcommand gets argv with argv[0] = its own name and returns the process exit status:
 * 0 success, 1 a failure while running (heap error, broken invariant), 2 bad input (usage,
 * options, configuration, unreadable or malformed files).
 */
#ifndef CUMA_TOOLS_CLI_H
#define CUMA_TOOLS_CLI_H

#include <stddef.h>

#define CUMA_EXIT_OK    0
#define CUMA_EXIT_FAIL  1
#define CUMA_EXIT_USAGE 2

/* Shared by the subcommands (cli.c). The value of option `name` at argv[*i], as "NAME VALUE"
 * or, for long options, "NAME=VALUE"; NULL when argv[*i] is another option. Sets *missing when
 * the value is absent. */
const char *cli_option(int argc, char **argv, int *i, const char *name, int *missing);

/* Whether a is -h or --help. */
int cli_is_help(const char *a);

/* Whether an argument before "--" asks for help; if so `usage` went to stdout. */
int cli_wants_help(int argc, char **argv, const char *usage);

/* Prints "cuma CMD: " and the message, then `usage`, to stderr; returns CUMA_EXIT_USAGE. */
int cli_usage_error(const char *cmd, const char *usage, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

/* fprintf(stderr, ...) for every message that quotes a path, an argument or input: control bytes
 * in the text are written escaped (\x1b; cuma_strbuf_escaped), line breaks as they are. */
void cli_eprintf(const char *fmt, ...) __attribute__((format(printf, 1, 2)));

/* text escaped the same way, into buf (len bytes): for a name printed to stdout. */
const char *cli_shown(const char *text, char *buf, size_t len);

/* Kept here so `cuma help replay` and replay's own error path print the same text. */
#define CUMA_REPLAY_USAGE                                                                          \
    "usage: cuma replay [--conf STR] [--scale K] [--policy NAME] [--json] [--timeline DIR]\n"      \
    "                   [--max-events N] [--device N] [--pytorch-conf STR] [--capacity BYTES]\n"   \
    "                   [--compare P1,P2,...] TRACE...\n"                                          \
    "  Replays RMM CSV event logs, PyTorch memory snapshots (_dump_snapshot() pickles) and\n"      \
    "  torch.profiler Chrome traces with profile_memory=True (JSON; plain or .gz, told apart by\n" \
    "  content) on the simulated device, twice per trace:\n"                                       \
    "  once driving the heap's clock with the trace's timestamps to measure memory, once\n"        \
    "  without stats calls to time the alloc/free path.\n"                                         \
    "  --conf STR     settings appended after backend:sim,sim_clock:manual (they win)\n"           \
    "  --policy NAME  shorthand for --conf policy:NAME\n"                                          \
    "                 (pytorch: a model of PyTorch's caching allocator instead of a heap,\n"       \
    "                 docs/PYTORCH_MODEL.md; pytorch_expandable: with expandable_segments)\n"      \
    "  --pytorch-conf STR  the model's settings, PYTORCH_CUDA_ALLOC_CONF syntax\n"                 \
    "                 (max_split_size_mb, roundup_power2_divisions, "                              \
    "garbage_collection_threshold,\n"                                                              \
    "                 max_non_split_rounding_mb, per_process_memory_fraction)\n"                   \
    "  --capacity BYTES  the model's device size (K/M/G/T suffixes; default unlimited)\n"          \
    "  --compare LIST replay each trace once per policy in LIST (pytorch or a heap policy),\n"     \
    "                 one JSON line or row each with its policy\n"                                 \
    "  --scale K      multiply every size by the positive integer K (16 brings the bundled\n"      \
    "                 traces to GPU scale)\n"                                                      \
    "  --max-events N refuse a trace of more than N events (default 16777216, about 768 MiB\n"     \
    "                 of host memory; a small .gz can hold far more lines than memory)\n"          \
    "  --device N     a snapshot's or profiler trace's device to replay (default: the one\n"       \
    "                 with the most events; a profiler trace without CUDA events: its CPU\n"       \
    "                 ones); its recorded peak (and time-averaged) reserved bytes are\n"           \
    "                 printed too\n"                                                               \
    "  --json         one JSON object per trace and line instead of the table\n"                   \
    "  --timeline DIR also write DIR/NAME.timeline.csv per trace (NAME: the file name without\n"   \
    "                 .gz/.csv): requested, reserved, cached and mapped bytes over trace time,\n"  \
    "                 at most 3840 rows with every slice's peaks (docs/PLOTS.md); cuma plot\n"     \
    "                 draws them\n"

#define CUMA_PLOT_USAGE                                                                            \
    "usage: cuma plot [-o OUT.svg] [--title T] [--compare NAME=TIMELINE.csv]... TIMELINE.csv...\n" \
    "       cuma plot --html [-o REPORT.html] [--title T] [--device N] TRACE\n"                    \
    "  One SVG figure (no scripts, no external files) with a panel per timeline of cuma replay\n"  \
    "  --timeline: requested bytes (filled), reserved (line), cached (dashed) over trace time;\n"  \
    "  the panel's title gives peak reserved / peak requested and the time-averaged ratio,\n"      \
    "  both computed from the timeline.\n"                                                         \
    "  -o OUT.svg     write there (default: stdout)\n"                                             \
    "  --title T      the figure's title\n"                                                        \
    "  --compare NAME=TIMELINE.csv\n"                                                              \
    "                 overlay that timeline's reserved bytes, labelled NAME, on the panel\n"       \
    "                 of the same file name (in another folder); repeatable\n"                     \
    "  --html         instead: replay one TRACE (RMM CSV or PyTorch snapshot) and write one\n"     \
    "                 self-contained HTML page (inline script and data, nothing fetched): the\n"   \
    "                 series with zoom and pan, the live blocks of a hovered moment (size,\n"      \
    "                 address, call site and stack) and a map of their 2 MiB pages\n"              \
    "  --device N     (--html) a snapshot's device (default: the one with the most events)\n"

#define CUMA_PS_USAGE                                                                              \
    "usage: cuma ps [--ledger NAME] [--json]\n"                                                    \
    "  The live heaps of a ledger (every cuma heap on a CUDA device, and simulated heaps given\n"  \
    "  ledger:NAME), grouped by device with the device's totals. Sizes in MiB/GiB; exact bytes\n"  \
    "  with --json. Exit status 1 when the ledger does not exist (no heap has run as this\n"       \
    "  user).\n"                                                                                   \
    "  --ledger NAME  the ledger of the setting ledger:NAME (default: the user's ledger)\n"        \
    "  --json         one JSON object: the ledger's path, its devices and their heaps\n"

#define CUMA_TOP_USAGE                                                                             \
    "usage: cuma top [--ledger NAME] [-d SECONDS] [-n ITERATIONS]\n"                               \
    "  cuma ps refreshed, with each heap's change since the last refresh: reserved bytes,\n"       \
    "  bytes given back on others' requests per second, ledger denials per second, allocations\n"  \
    "  per second; and its OOMs so far and fragmentation (from the figures its release thread\n"   \
    "  publishes every 100 ms; cuma stats shows them all). Sorted by device, then reserved\n"      \
    "  bytes. The screen is cleared only when stdout is a terminal. Ctrl-C ends it.\n"             \
    "  --ledger NAME  as for cuma ps\n"                                                            \
    "  -d SECONDS     the refresh interval (default 1; fractions allowed)\n"                       \
    "  -n ITERATIONS  stop after this many refreshes (default: until interrupted)\n"

#define CUMA_STATS_USAGE                                                                           \
    "usage: cuma stats [--ledger NAME] [--json] [PID...]\n"                                        \
    "  Every figure the ledger has of each live heap (of the PIDs' heaps only, when PIDs are\n"    \
    "  given): settings, memory, peaks, allocations, failures, OOMs, page calls,\n"                \
    "  fragmentation, pressure, and how old the figures are. A heap's release thread publishes\n"  \
    "  its allocator figures every 100 ms; a heap without one (release_thread:off) never does.\n"  \
    "  Exit status 1 when the ledger does not exist or a PID has no heap in it (the others'\n"     \
    "  heaps are still shown).\n"                                                                  \
    "  --ledger NAME  as for cuma ps\n"                                                            \
    "  --json         one JSON object as cuma ps --json's, each heap with its allocator figures\n" \
    "                 (null when never published)\n"

#define CUMA_EXPORTER_DEFAULT_PORT 9840

#define CUMA_EXPORTER_USAGE                                                                        \
    "usage: cuma exporter [--ledger NAME] [--port PORT] [--bind ADDR] [--connections N]\n"         \
    "                     [--fresh-wait MS] [--once]\n"                                            \
    "  Prometheus metrics of the ledger's heaps and devices (text format 0.0.4) over HTTP:\n"      \
    "  GET /metrics; every other path is 404. It keeps serving while the ledger cannot be read\n"  \
    "  (cuma_ledger_up 0), e.g. before the first heap has made it, and while its lock is held\n"   \
    "  (the last good figures, with cuma_ledger_stale 1).\n"                                       \
    "  --ledger NAME    as for cuma ps\n"                                                          \
    "  --port PORT      TCP port (default 9840; 0: any free port, printed on stderr)\n"            \
    "  --bind ADDR      numeric IPv4 or IPv6 address to listen on (default 127.0.0.1)\n"           \
    "  --connections N  open connections at once (default 1024; when all are taken one that\n"     \
    "                   has its answer, else the one that has been sending its request the\n"      \
    "                   longest, is closed)\n"                                                     \
    "  --fresh-wait MS  how long a scrape waits for its read of the ledger before it is\n"         \
    "                   answered with the last good figures, marked stale (default 500, at\n"      \
    "                   least 200: reads begin 100 ms apart)\n"                                    \
    "  --once           print the metrics to stdout and exit (node-exporter's textfile\n"          \
    "                   collector)\n"

#define CUMA_LEAKS_USAGE                                                                           \
    "usage: cuma leaks [--json] [--top N] [--windows N] [--all-frames] [--device N]\n"             \
    "                  [--max-events N] TRACE...\n"                                                \
    "  What a recording still holds at its end, by call site (largest first), and the call\n"      \
    "  sites whose live bytes keep growing over it. The call site is the innermost frame of\n"     \
    "  the program's own Python code, else an installed package's, else (in the backward\n"        \
    "  pass) the autograd node; C/C++ frames, torch/ and the standard library are skipped.\n"      \
    "  Traces without stacks (RMM CSV) are grouped by power-of-two size class.\n"                  \
    "  --top N        the N largest call sites (default 20)\n"                                     \
    "  --windows N    cut the recorded events into N windows (default 4, 2 to 1000); a site\n"     \
    "                 grows when its least live bytes in each window never fall, rise in at\n"     \
    "                 least half the steps and in the last. Each window should span a whole\n"     \
    "                 iteration of the program's loop.\n"                                          \
    "  --all-frames   also print every stack of each call site's live allocations\n"               \
    "  --device N     a snapshot's device (default: the one with the most events)\n"               \
    "  --max-events N refuse a trace of more than N events (default 16777216)\n"                   \
    "  --json         one JSON object per trace and line, exact bytes\n"

#define CUMA_CONVERT_USAGE                                                                         \
    "usage: cuma convert [--device N] -o OUT.pickle TRACE\n"                                       \
    "  Writes a trace (RMM CSV or PyTorch snapshot) as a PyTorch memory snapshot pickle, the\n"    \
    "  file torch.cuda.memory._dump_snapshot() writes: its allocations, frees and call stacks\n"   \
    "  as events, the blocks live at the end as segments. PyTorch's memory_viz opens it, and\n"    \
    "  cuma replay and cuma leaks read it as they read the trace.\n"                               \
    "  -o OUT.pickle  where to write (plain, not gzip'd)\n"                                        \
    "  --device N     a snapshot's device (default: the one with the most events)\n"

int cuma_cmd_convert(int argc, char **argv);
int cuma_cmd_leaks(int argc, char **argv);
int cuma_cmd_replay(int argc, char **argv);
int cuma_cmd_plot(int argc, char **argv);
int cuma_cmd_ps(int argc, char **argv);
int cuma_cmd_top(int argc, char **argv);
int cuma_cmd_stats(int argc, char **argv);
int cuma_cmd_exporter(int argc, char **argv);

#endif
