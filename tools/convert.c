// SPDX-License-Identifier: Apache-2.0
/* `cuma convert`: a trace (RMM CSV or PyTorch snapshot) written as a PyTorch memory snapshot
 * (cuma_trace_write_snapshot, src/trace/snapshot_writer.c), so PyTorch's memory_viz opens a
 * cuma trace. */
#include "cli.h"

#include "trace/trace.h"

#include <errno.h>
#include <stdlib.h>
#include <string.h>

int cuma_cmd_convert(int argc, char **argv) {
    if (cli_wants_help(argc, argv, CUMA_CONVERT_USAGE)) return CUMA_EXIT_OK;
    const char *out = NULL, *in = NULL;
    int device = -1;
    for (int i = 1; i < argc; i++) {
        const char *v;
        int missing = 0;
        if (argv[i][0] != '-' || !argv[i][1]) {
            if (in)
                return cli_usage_error("convert", CUMA_CONVERT_USAGE,
                                       "one trace at a time (%s and %s given)", in, argv[i]);
            in = argv[i];
        } else if ((v = cli_option(argc, argv, &i, "-o", &missing)) != NULL) {
            if (!*v) return cli_usage_error("convert", CUMA_CONVERT_USAGE, "-o wants a file name");
            out = v;
        } else if ((v = cli_option(argc, argv, &i, "--device", &missing)) != NULL) {
            char *end;
            errno = 0;
            long d = strtol(v, &end, 10);
            if (!*v || *end || errno || d < 0 || d > 1023)
                return cli_usage_error("convert", CUMA_CONVERT_USAGE,
                                       "--device wants a device number 0 to 1023, not '%s'", v);
            device = (int)d;
        } else if (missing) {
            return cli_usage_error("convert", CUMA_CONVERT_USAGE, "%s needs a value", argv[i]);
        } else {
            return cli_usage_error("convert", CUMA_CONVERT_USAGE, "unknown option '%s'", argv[i]);
        }
    }
    if (!in) return cli_usage_error("convert", CUMA_CONVERT_USAGE, "no trace given");
    if (!out) return cli_usage_error("convert", CUMA_CONVERT_USAGE, "-o OUT.pickle is needed");
    cuma_trace t;
    cuma_trace_opts o = {.device = device, .stacks = 1};
    if (cuma_trace_load_opts(in, &o, &t) != CUMA_OK) {
        cli_eprintf("cuma convert: %s\n", cuma_last_error());
        return CUMA_EXIT_USAGE;
    }
    /* A profiler trace's CPU events (device -1): a snapshot has CUDA devices only, so they are
     * written as device 0's, and said so. */
    if (t.format == CUMA_TRACE_TORCH_PROFILER && t.device < 0) {
        cli_eprintf("cuma convert: %s: no CUDA memory events: writing the CPU ones as device 0\n",
                    in);
        t.device = 0;
    }
    cuma_status st = cuma_trace_write_snapshot(&t, out);
    if (st != CUMA_OK) cli_eprintf("cuma convert: %s\n", cuma_last_error());
    cuma_trace_free(&t);
    return st == CUMA_OK ? CUMA_EXIT_OK : st == CUMA_ERR_OOM ? CUMA_EXIT_FAIL : CUMA_EXIT_USAGE;
}
