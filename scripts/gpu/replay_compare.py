#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Prints `cuma replay --json` output as a table and compares one run against a reference.

    replay_compare.py table RUN.jsonl [--label NAME]
    replay_compare.py compare REF.jsonl RUN.jsonl [--tol 0.001] [--info] [--ref-label sim]
                                                  [--label vmm]

`table` prints one row per trace. `compare` matches traces by name and prints, per trace,
both runs' overhead_ratio (peak reserved / peak requested) and time_avg_ratio with their
difference. It exits 1 when a trace is missing from either run, when RUN had failed
allocations, or (unless --info) when either ratio differs by more than --tol; else 0.
Standard library only.
"""

import argparse
import json
import sys

KEYS = ("overhead_ratio", "time_avg_ratio")


def load(path):
    rows = {}
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            line = line.strip()
            if not line.startswith("{"):
                continue  # anything else the command printed
            try:
                d = json.loads(line)
            except ValueError as e:
                raise SystemExit("%s:%d: not JSON: %s" % (path, n, e))
            rows[d["trace"]] = d
    return rows


def mib(n):
    return n / 2**20


def cmd_table(a):
    rows = load(a.run)
    if not rows:
        print("%s: no replay results in %s" % (a.label, a.run))
        return 1
    print("%-22s %9s %9s %9s %9s %8s %8s %7s %9s" % (
        "trace [" + a.label + "]", "req MiB", "res MiB", "overhead", "time-avg", "creates",
        "maps", "failed", "ns/op"))
    for name in sorted(rows):
        d = rows[name]
        print("%-22s %9.1f %9.1f %9.4f %9.4f %8d %8d %7d %9.1f" % (
            name.replace(".csv.gz", ""), mib(d["peak_requested_bytes"]), mib(d["peak_reserved_bytes"]),
            d["overhead_ratio"], d["time_avg_ratio"], d["page_creates"], d["maps"],
            d["failed_allocs"], d["ns_per_op"]))
    return 0


def cmd_compare(a):
    ref, run = load(a.ref), load(a.run)
    bad = []
    names = sorted(set(ref) | set(run))
    if not names:
        print("no replay results in %s or %s" % (a.ref, a.run))
        return 1
    hdr = "%-16s | %8s %8s %8s | %8s %8s %8s | %6s %6s | %s"
    print(hdr % ("trace", "ovh " + a.ref_label[:4], "ovh " + a.label[:4], "diff",
                 "tavg " + a.ref_label[:3], "tavg " + a.label[:3], "diff",
                 "cr " + a.ref_label[:3], "cr " + a.label[:3], "verdict"))
    worst = 0.0
    for name in names:
        short = name.replace(".csv.gz", "")
        if name not in ref or name not in run:
            missing = a.ref_label if name not in ref else a.label
            print("%-16s | missing from the %s run" % (short, missing))
            bad.append("%s: missing from the %s run" % (short, missing))
            continue
        r, t = ref[name], run[name]
        diffs = [t[k] - r[k] for k in KEYS]
        worst = max(worst, max(abs(x) for x in diffs))
        problems = []
        if t.get("failed_allocs", 0):
            problems.append("%d failed allocs" % t["failed_allocs"])
        off = [k for k, x in zip(KEYS, diffs) if abs(x) > a.tol + 1e-12]
        if off and not a.info:
            problems.append("differs by more than %g" % a.tol)
        verdict = "; ".join(problems) if problems else ("differs (info)" if off else "same")
        print("%-16s | %8.4f %8.4f %+8.4f | %8.4f %8.4f %+8.4f | %6d %6d | %s" % (
            short, r["overhead_ratio"], t["overhead_ratio"], diffs[0], r["time_avg_ratio"],
            t["time_avg_ratio"], diffs[1], r["page_creates"], t["page_creates"], verdict))
        if problems:
            bad.append("%s: %s" % (short, "; ".join(problems)))
    print("largest ratio difference: %.4f (tolerance %g%s)" % (worst, a.tol, ", info only" if a.info else ""))
    if bad:
        print("COMPARE FAIL: " + " | ".join(bad))
        return 1
    print("COMPARE OK")
    return 0


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    t = sub.add_parser("table")
    t.add_argument("run")
    t.add_argument("--label", default="run")
    c = sub.add_parser("compare")
    c.add_argument("ref")
    c.add_argument("run")
    c.add_argument("--tol", type=float, default=0.001)
    c.add_argument("--info", action="store_true", help="report differences, do not fail on them")
    c.add_argument("--ref-label", default="sim")
    c.add_argument("--label", default="vmm")
    a = p.parse_args(argv)
    return cmd_table(a) if a.cmd == "table" else cmd_compare(a)


if __name__ == "__main__":
    sys.exit(main())
