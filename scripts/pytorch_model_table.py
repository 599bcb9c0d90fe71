#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""The tables of PyTorch memory snapshots in README.md and docs/PYTORCH_MODEL.md, made by
replaying each snapshot in DIR with `cuma replay --json --compare pytorch,tlsf FILE`: what
PyTorch recorded, what the model of its allocator (--policy pytorch) reserves, and what cuma
(its default policy, tlsf) reserves, as markdown on stdout.

usage: pytorch_model_table.py [--readme | --model] [--cuma BIN] [DIR]

  --readme  (default) per snapshot: peak requested, PyTorch's recorded peak reserved, the
            model's, cuma's, and cuma / PyTorch; a line under it says where cuma reserves more
            than PyTorch recorded.
  --model   the model against the recording: peak and time-averaged reserved, segments.
  DIR       default ../shared/snapshots beside the checkout. Files *.pickle and *.pickle.gz are
            snapshots; others (torch.profiler *.json.gz traces, README) are listed as left out.
  --cuma    default build/bin/cuma.

Exit status 2 when DIR is missing or holds no snapshot, 1 when a replay fails.
"""
import argparse
import json
import math
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def die(msg, code=2):
    print("pytorch_model_table.py: " + msg, file=sys.stderr)
    sys.exit(code)


def snapshots(d):
    if not os.path.isdir(d):
        die("no snapshot folder at %s: give one (a folder of torch.cuda.memory._dump_snapshot() "
            "pickles) as DIR" % d)
    names = sorted(os.listdir(d))
    snaps = [n for n in names if n.endswith((".pickle", ".pickle.gz"))]
    other = [n for n in names if n not in snaps and not n.lower().startswith("readme")]
    if not snaps:
        die("%s holds no *.pickle or *.pickle.gz snapshot" % d)
    return [os.path.join(d, n) for n in snaps], other


def replay(cuma, path):
    p = subprocess.run([cuma, "replay", "--json", "--compare", "pytorch,tlsf", path],
                       capture_output=True, text=True)
    if p.returncode:
        die("%s: cuma replay exited %d: %s" % (path, p.returncode, p.stderr.strip()), 1)
    lines = {d["policy"]: d for d in map(json.loads, p.stdout.splitlines())}
    return lines["pytorch"], lines["tlsf"]


def name(d):
    n = d["trace"]
    for ext in (".pickle.gz", ".pickle"):
        if n.endswith(ext):
            return n[:-len(ext)]
    return n


def gb(v):
    return "%.3f" % (v / 1e9)


def pct(a, b):
    return "%+.2f%%" % (100.0 * (a / b - 1)) if b else "-"


def readme(rows, other):
    print("| snapshot | peak requested GB | PyTorch recorded peak reserved GB | model of PyTorch "
          "GB | model - recorded | cuma peak reserved GB | cuma / PyTorch |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    over, ratios = [], []
    for model, cuma in rows:
        rec = model["recorded_peak_reserved_bytes"]
        ratio = cuma["peak_reserved_bytes"] / rec if rec else float("nan")
        if rec:
            ratios.append(ratio)
        if rec and cuma["peak_reserved_bytes"] > rec:
            over.append(name(model))
        print("| %s | %s | %s | %s | %s | %s | %.4f |" % (
            name(model), gb(cuma["peak_requested_bytes"]), gb(rec),
            gb(model["peak_reserved_bytes"]), pct(model["peak_reserved_bytes"], rec),
            gb(cuma["peak_reserved_bytes"]), ratio))
    print()
    geo = math.exp(sum(map(math.log, ratios)) / len(ratios)) if ratios else float("nan")
    print("%d snapshots; cuma / PyTorch %.4f to %.4f, geometric mean %.4f. %s" % (
        len(rows), min(ratios), max(ratios), geo,
        "cuma reserves more than PyTorch recorded on: " + ", ".join(over) + "."
        if over else "cuma's peak is at most PyTorch's recorded one on every snapshot."))
    if other:
        print("Left out, not `*.pickle[.gz]` snapshots: " + ", ".join(other) + ".")


def model_table(rows, other):
    print("| snapshot | events | blocks from before | segments from before | model peak reserved "
          "| recorded peak reserved | model - recorded | model time-avg reserved | recorded "
          "time-avg | model - recorded | segments made (model) |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for d, _ in rows:
        m, r = d["peak_reserved_bytes"], d["recorded_peak_reserved_bytes"]
        ta, tr = d["time_avg_reserved_bytes"], d["recorded_time_avg_reserved_bytes"]
        mark = " **outside 3%**" if r and abs(m / r - 1) > 0.03 else ""
        print("| %s | %d | %d | %d | %d | %d | %s%s | %d | %s | %s | %d |" % (
            name(d), d["events"], d["preexisting_blocks"], d["preexisting_segments"], m, r,
            pct(m, r), mark, ta, tr if tr is not None else "-", pct(ta, tr) if tr else "-",
            d["segments_created"]))
    if other:
        print()
        print("Left out, not `*.pickle[.gz]` snapshots: " + ", ".join(other) + ".")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    g = ap.add_mutually_exclusive_group()
    g.add_argument("--readme", action="store_true", help="the README's table (default)")
    g.add_argument("--model", action="store_true", help="the model against the recording")
    ap.add_argument("--cuma", default=os.path.join(ROOT, "build", "bin", "cuma"))
    ap.add_argument("dir", nargs="?", default=os.path.join(ROOT, "..", "shared", "snapshots"))
    a = ap.parse_args()
    if not os.access(a.cuma, os.X_OK):
        die("no cuma at %s: build it (cmake --build build --target cuma_cli) or give --cuma"
            % a.cuma)
    paths, other = snapshots(os.path.normpath(a.dir))
    rows = [replay(a.cuma, p) for p in paths]
    (model_table if a.model else readme)(rows, other)


if __name__ == "__main__":
    main()
