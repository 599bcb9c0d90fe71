#!/usr/bin/python3
# SPDX-License-Identifier: Apache-2.0
"""A markdown table of `cuma replay` against the ideal cache, one row per trace.

usage: goals_table.py --cuma BIN [--scale 16] [--delay-ms 1000] [--conf STR] TRACE...

Uses tests/replay/check_goals.py's ideal cache and goals (time-averaged ratio at most the ideal
+ 0.03, page creates at most 1.25x the ideal's, peak reserved at most 1.02x peak requested) and
marks each missed goal with "MISS". --conf adds settings after release_delay_ms, to try a knob.
"""
import argparse
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "tests", "replay"))
import check_goals as cg  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cuma", required=True)
    ap.add_argument("--scale", type=int, default=16)
    ap.add_argument("--delay-ms", type=int, default=1000)
    ap.add_argument("--conf", default="", help="extra settings, e.g. tcache:off")
    ap.add_argument("traces", nargs="+")
    opts = ap.parse_args()
    if opts.conf:
        # check_goals builds the --conf string itself; ride on its lag field's format.
        orig = cg.subprocess.run

        def run(cmd, **kw):
            i = cmd.index("--conf") + 1
            cmd = cmd[:i] + [cmd[i] + "," + opts.conf] + cmd[i + 1:]
            return orig(cmd, **kw)

        cg.subprocess.run = run
    print("| trace | peak requested | time-avg (ideal) | page creates (ideal) | peak ratio |")
    print("|---|---|---|---|---|")
    missed = 0
    for path in opts.traces:
        times, levels = cg.requested_levels(path, opts.scale)
        ratio, creates, _, _ = cg.ideal_cache(times, levels, opts.delay_ms * 1000)
        r = cg.run_replay(opts.cuma, path, opts.scale, opts.delay_ms, None)
        miss_t = r["time_avg_ratio"] > ratio + cg.GOAL_TIME_AVG_SLACK
        miss_c = r["page_creates"] > cg.GOAL_CREATES_FACTOR * creates
        miss_p = r["overhead_ratio"] > cg.GOAL_OVERHEAD
        missed += miss_t + miss_c + miss_p
        name = os.path.basename(path).split(".")[0]
        print("| %s | %.0f MiB | %.3f (%.3f)%s | %d (%d, %.2fx)%s | %.4f%s |" % (
            name, r["peak_requested_bytes"] / 2**20, r["time_avg_ratio"], ratio,
            " MISS" if miss_t else "", r["page_creates"], creates,
            r["page_creates"] / creates if creates else 0, " MISS" if miss_c else "",
            r["overhead_ratio"], " MISS" if miss_p else ""))
        sys.stdout.flush()
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
