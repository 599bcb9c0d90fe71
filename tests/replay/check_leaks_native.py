#!/usr/bin/python3
# SPDX-License-Identifier: Apache-2.0
"""Checks trace_stacks:on and `cuma leaks` on a C program that leaks from a known function.

usage: check_leaks_native.py --cuma BIN --program BIN --source leak_native.c --out DIR

leak_native.c keeps 1 MiB each iteration in leaky_cache() (the line marked LEAK) and frees the
3 MiB forward() takes (ACTIVATIONS). Its log must have a .stacks file beside it; `cuma leaks`
must name leaky_cache, with its file and line, first among the live allocations (12 MiB in 12)
and as the only growing call site, and forward() nowhere among the live ones. Standard
library only.
"""
import argparse
import json
import os
import subprocess
import sys

failures = []


def check(what, cond, detail=""):
    print("%-4s %s%s" % ("ok" if cond else "FAIL", what, "" if cond else ": " + str(detail)))
    if not cond:
        failures.append(what)


def marked_line(source, mark):
    with open(source) as f:
        for i, line in enumerate(f, 1):
            if "/* %s */" % mark in line:
                return i
    raise SystemExit("no /* %s */ in %s" % (mark, source))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cuma", required=True)
    ap.add_argument("--program", required=True)
    ap.add_argument("--source", required=True)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    log = os.path.join(a.out, "leak_native.csv")
    for f in (log, log + ".stacks"):
        if os.path.exists(f):
            os.unlink(f)
    env = dict(os.environ)
    env.pop("CUMA_CONF", None)
    p = subprocess.run([a.program, log], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                       universal_newlines=True, timeout=120)
    check("the program ran", p.returncode == 0, p.stderr)
    check("the log has its stacks beside it", os.path.exists(log + ".stacks"))
    leak = marked_line(a.source, "LEAK")
    name = os.path.basename(a.source)
    p = subprocess.run([a.cuma, "leaks", "--json", log], stdout=subprocess.PIPE,
                       stderr=subprocess.PIPE, universal_newlines=True, timeout=120)
    check("cuma leaks --json exits 0", p.returncode == 0, p.stderr)
    try:
        r = json.loads(p.stdout)
    except ValueError as e:
        r = {}
        check("cuma leaks --json prints JSON", False, e)
    check("the log has stacks", r.get("stacks") is True, r.get("stacks"))
    text = subprocess.run([a.cuma, "leaks", log], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          universal_newlines=True, timeout=120).stdout
    print(text)
    lines = [ln for ln in text.splitlines() if "MiB" in ln or "KiB" in ln]
    first = next((ln for ln in lines if "leaky_cache" in ln or "forward" in ln or "(" in ln), "")
    want = "%s:%d leaky_cache" % (name, leak)
    check("leaky_cache, its file and line, first among the live (%s)" % want,
          want in first and "12.0 MiB" in first, first)
    check("forward() holds nothing at the end",
          not any("forward" in ln for ln in text.split("growing")[0].splitlines()[2:]), text)
    grow = text.split("growing", 1)[1] if "growing" in text else ""
    check("leaky_cache is the one growing call site",
          want in grow and "forward" not in grow, grow)
    if failures:
        print("%d failed: %s" % (len(failures), ", ".join(failures)))
        return 1
    print("all passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
