#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""scripts/pytorch_model_table.py, the command behind the README's snapshot table: on a folder
of snapshots (tests/data) one row per snapshot with the figures `cuma replay --compare
pytorch,tlsf --json` gives, the other files named as left out, and the cuma / PyTorch line; the
model's table too; a missing or snapshot-less folder is exit 2 with the folder named.

usage: check_snapshot_table.py --cuma CUMA --data DIR --out DIR
"""
import argparse
import json
import os
import subprocess
import sys

SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "scripts",
                      "pytorch_model_table.py")
failures = []


def check(cond, what):
    print(("ok   " if cond else "FAIL ") + what)
    if not cond:
        failures.append(what)


def table(*args):
    return subprocess.run([sys.executable, SCRIPT, *args], capture_output=True, text=True,
                          timeout=300)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cuma", required=True)
    ap.add_argument("--data", required=True)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    snaps = sorted(n for n in os.listdir(a.data) if n.endswith(".pickle.gz"))
    r = table("--readme", "--cuma", a.cuma, a.data)
    rows = [l for l in r.stdout.splitlines() if l.startswith("| snapshot_")]
    check(r.returncode == 0 and len(rows) == len(snaps) >= 3,
          "--readme: one row per snapshot (%d): %s" % (len(snaps), r.stderr))
    for n, row in zip(snaps, rows):
        p = subprocess.run([a.cuma, "replay", "--json", "--compare", "pytorch,tlsf",
                            os.path.join(a.data, n)], capture_output=True, text=True)
        m, c = [json.loads(l) for l in p.stdout.splitlines()]
        rec = m["recorded_peak_reserved_bytes"]
        cells = [x.strip() for x in row.strip("|").split("|")]
        want = [n[:-len(".pickle.gz")], "%.3f" % (c["peak_requested_bytes"] / 1e9),
                "%.3f" % (rec / 1e9), "%.3f" % (m["peak_reserved_bytes"] / 1e9),
                "%+.2f%%" % (100.0 * (m["peak_reserved_bytes"] / rec - 1)),
                "%.3f" % (c["peak_reserved_bytes"] / 1e9), "%.4f" % (c["peak_reserved_bytes"] / rec)]
        check(cells == want, "%s: the replay's figures %s (row %s)" % (n, want, cells))
    check("gpt_generate.csv.gz" in r.stdout and "Left out" in r.stdout and
          "cuma's peak is at most PyTorch's recorded one on every snapshot" in r.stdout,
          "--readme: the CSV traces left out by name, the cuma / PyTorch line")
    r = table("--model", "--cuma", a.cuma, a.data)
    check(r.returncode == 0 and
          sum(l.startswith("| snapshot_") for l in r.stdout.splitlines()) == len(snaps),
          "--model: one row per snapshot")
    missing = os.path.join(a.out, "no_such_folder")
    r = table("--cuma", a.cuma, missing)
    check(r.returncode == 2 and "no snapshot folder at " + missing in r.stderr and not r.stdout,
          "a missing folder: exit 2, named (%r)" % r.stderr)
    os.makedirs(os.path.join(a.out, "empty"), exist_ok=True)
    r = table("--cuma", a.cuma, os.path.join(a.out, "empty"))
    check(r.returncode == 2 and "holds no *.pickle" in r.stderr, "a folder without snapshots: exit 2")
    print("%d failures" % len(failures))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
