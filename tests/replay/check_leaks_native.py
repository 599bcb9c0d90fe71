#!/usr/bin/python3
# SPDX-License-Identifier: Apache-2.0
"""Checks trace_stacks:on and `cuma leaks` on a program that leaks from a known function.

usage: check_leaks_native.py --cuma BIN --program BIN --source leak_native.c --out DIR
       check_leaks_native.py --cuma BIN --python PY --lib LIBCUMA --pythonpath DIR
                             --program leak_python.py --source leak_python.py --out DIR

leak_native.c (a C program) and leak_python.py (a Python one, through cuma.Heap) keep 1 MiB
each iteration in leaky_cache() (the line marked LEAK) and free the 3 MiB forward() takes
(ACTIVATIONS). The log must have a .stacks file beside it; `cuma leaks` must name leaky_cache,
with its file and line, first among the live allocations (12 MiB in 12) and as the only
growing call site, and forward() nowhere among the live ones. Standard library only.
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
            if "/* %s */" % mark in line or line.rstrip().endswith("# " + mark):
                return i
    raise SystemExit("no /* %s */ in %s" % (mark, source))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cuma", required=True)
    ap.add_argument("--program", required=True)
    ap.add_argument("--source", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--python", help="run --program with this interpreter")
    ap.add_argument("--lib", help="with --python: the libcuma.so the package loads")
    ap.add_argument("--pythonpath", help="with --python: where the cuma package is")
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    log = os.path.join(a.out, os.path.splitext(os.path.basename(a.source))[0] + ".csv")
    for f in (log, log + ".stacks"):
        if os.path.exists(f):
            os.unlink(f)
    env = dict(os.environ)
    env.pop("CUMA_CONF", None)
    cmd = [a.program, log]
    if a.python:
        cmd.insert(0, a.python)
        env["CUMA_LIBRARY"] = a.lib
        env["PYTHONPATH"] = a.pythonpath
        env["PYTHONDONTWRITEBYTECODE"] = "1"
    p = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
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
    # The first group under the live table's header ("bytes  allocs  call site").
    rows = text.split("call site\n", 1)[1].splitlines() if "call site\n" in text else []
    first = rows[0] if rows else ""
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
