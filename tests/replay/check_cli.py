#!/usr/bin/python3
# SPDX-License-Identifier: Apache-2.0
"""Checks how the `cuma` command treats bad input, and its plain subcommands.

usage: check_cli.py bad-input --cuma BIN --data DIR   (replay on malformed traces and settings)
       check_cli.py commands  --cuma BIN              (help, version, config, unknown names)

Every bad input must give exit status 2 and a message that says where the problem is: the
FILE:LINE of a malformed trace line, the key of a bad setting. Standard library only.
"""
import argparse
import os
import subprocess
import sys

failures = []


def run(cuma, *args):
    env = dict(os.environ)
    env.pop("CUMA_CONF", None)  # the user's settings must not change the test
    p = subprocess.run([cuma] + list(args), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                       universal_newlines=True, env=env, timeout=120)
    return p.returncode, p.stdout, p.stderr


def expect(what, args, got, status, out_has=(), err_has=()):
    rc, out, err = got
    problems = []
    if rc != status:
        problems.append("exit status %d, expected %d" % (rc, status))
    problems += ["stdout lacks %r" % s for s in out_has if s not in out]
    problems += ["stderr lacks %r" % s for s in err_has if s not in err]
    print("%-4s %s: cuma %s" % ("FAIL" if problems else "ok", what, " ".join(args)))
    if problems:
        failures.append(what)
        for p in problems:
            print("     " + p)
        print("     stdout: %r\n     stderr: %r" % (out[-600:], err[-600:]))


def check(cuma, what, args, status, out_has=(), err_has=()):
    expect(what, args, run(cuma, *args), status, out_has, err_has)


def bad_input(cuma, data):
    bad_time = os.path.join(data, "bad_time.csv")
    valid = os.path.join(data, "valid.csv")
    check(cuma, "malformed trace", ["replay", bad_time], 2,
          err_has=["cuma replay: ", bad_time + ":3:", "time"])
    check(cuma, "malformed trace, json", ["replay", "--json", os.path.join(data, "bad_pointer.csv")],
          2, err_has=["bad_pointer.csv:4:", "pointer"])
    check(cuma, "wrong field count", ["replay", os.path.join(data, "wrong_fields.csv")], 2,
          err_has=["wrong_fields.csv:2:"])
    check(cuma, "missing trace", ["replay", os.path.join(data, "no_such_trace.csv")], 2,
          err_has=["no_such_trace.csv", "No such file"])
    check(cuma, "empty trace", ["replay", os.path.join(data, "empty.csv")], 2,
          err_has=["empty.csv"])
    check(cuma, "unknown key", ["replay", "--conf", "no_such_key:1", valid], 2,
          err_has=["no_such_key"])
    check(cuma, "bad value", ["replay", "--conf", "release_delay_ms:soon", valid], 2,
          err_has=["release_delay_ms"])
    check(cuma, "bad policy", ["replay", "--policy", "nosuchpolicy", valid], 2,
          err_has=["policy"])
    check(cuma, "zero scale", ["replay", "--scale", "0", valid], 2, err_has=["usage:"])
    check(cuma, "bad scale", ["replay", "--scale", "x2", valid], 2, err_has=["usage:"])
    check(cuma, "unknown option", ["replay", "--frobnicate", valid], 2, err_has=["usage:"])
    check(cuma, "option without value", ["replay", valid, "--conf"], 2,
          err_has=["--conf needs a value", "usage:"])
    check(cuma, "no trace", ["replay", "--json"], 2, err_has=["usage:"])
    # A good trace after a bad one is still replayed, and the exit status is still 2.
    check(cuma, "bad then good", ["replay", "--json", bad_time, valid], 2,
          out_has=['"trace":"valid.csv"'], err_has=["bad_time.csv:3:"])
    check(cuma, "option after the trace", ["replay", valid, "--json"], 0,
          out_has=['"trace":"valid.csv"'])
    # --max-events: the reader's limit, named with the line where it stopped (valid.csv has 9).
    check(cuma, "max events", ["replay", "--max-events", "4", valid], 2,
          err_has=["valid.csv:", "more than 4 events", "--max-events"])
    check(cuma, "max events enough", ["replay", "--json", "--max-events", "9", valid], 0,
          out_has=['"events":9'])
    check(cuma, "bad max events", ["replay", "--max-events", "0", valid], 2,
          err_has=["--max-events wants an integer", "usage:"])
    # Control bytes in an argument or a setting are echoed escaped, never raw.
    esc = "\x1b]0;owned\x07\x1b[2J"
    for what, args in (("escaped option", ["replay", "--frobnicate" + esc, valid]),
                       ("escaped setting", ["replay", "--conf", "policy:" + esc, valid]),
                       ("escaped trace name", ["replay", os.path.join(data, esc + ".csv")])):
        got = run(cuma, *args)
        expect(what, args, got, 2, err_has=["\\x1b]0;owned\\x07\\x1b[2J"])
        if "\x1b" in got[2] or "\x07" in got[2]:
            failures.append(what)
            print("     a raw control byte on stderr: %r" % got[2][-300:])
    # And the good one alone works, with the skipped events accounted for.
    check(cuma, "valid trace", ["replay", "--json", valid], 0,
          out_has=['"events":9', '"unmatched_frees":1', '"trace_alloc_failures":1',
                   '"failed_allocs":0'])


def commands(cuma):
    check(cuma, "help", ["help"], 0, out_has=["replay", "config", "version", "--scale"])
    check(cuma, "--help", ["--help"], 0, out_has=["replay", "config"])
    check(cuma, "help replay", ["help", "replay"], 0, out_has=["--policy", "--json"])
    check(cuma, "replay --help", ["replay", "--help"], 0, out_has=["--conf"])
    check(cuma, "version", ["version"], 0, out_has=["cuma 0."])
    check(cuma, "config table", ["config"], 0, out_has=["release_delay_ms", "policy"])
    check(cuma, "config --check good", ["config", "--check", "policy:buddy,release_delay_ms:10"],
          0)
    check(cuma, "config --check unknown key", ["config", "--check", "no_such_key:1"], 2,
          err_has=["no_such_key"])
    check(cuma, "config --check bad value", ["config", "--check", "capacity:lots"], 2,
          err_has=["capacity"])
    check(cuma, "config bad option", ["config", "--frobnicate"], 2, err_has=["usage:"])
    check(cuma, "no subcommand", [], 2, err_has=["usage:"])
    check(cuma, "unknown subcommand", ["frobnicate"], 2, err_has=["frobnicate", "usage:"])


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("mode", choices=["bad-input", "commands"])
    ap.add_argument("--cuma", required=True)
    ap.add_argument("--data", help="tests/replay/data")
    args = ap.parse_args()
    if args.mode == "bad-input":
        if not args.data:
            ap.error("bad-input needs --data")
        bad_input(args.cuma, args.data)
    else:
        commands(args.cuma)
    if failures:
        print("%d check(s) failed: %s" % (len(failures), ", ".join(failures)))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
