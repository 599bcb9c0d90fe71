#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""`cuma replay`'s progress line: on stderr when it is a terminal (a pty here), rewritten in
place and cleared at the end; nothing of it on stdout (the --json lines parse), nothing when
stderr is a pipe, nothing with CUMA_PROGRESS=off. The first line comes after 65536 events
whatever the time, so the check does not depend on the machine's speed.

    check_progress.py CUMA TRACE   (TRACE: a bundled trace of more than 65536 events)
"""
import json
import os
import pty
import select
import subprocess
import sys


def run(cuma, trace, tty, env_extra=None):
    env = dict(os.environ)
    env.pop("CUMA_PROGRESS", None)
    env.update(env_extra or {})
    cmd = [cuma, "replay", "--json", trace]
    if not tty:
        p = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, timeout=300)
        return p.returncode, p.stdout, p.stderr
    master, slave = pty.openpty()
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=slave, env=env)
    os.close(slave)
    out = p.stdout.read()
    rc = p.wait(timeout=300)
    err = b""
    while select.select([master], [], [], 0.2)[0]:
        try:
            d = os.read(master, 65536)
        except OSError:  # the pty's other side is gone: all of it was read
            break
        if not d:
            break
        err += d
    os.close(master)
    return rc, out, err


def main():
    cuma, trace = sys.argv[1], sys.argv[2]
    name = os.path.basename(trace)
    failures = []

    def check(ok, what, got):
        print("%s %s" % ("ok  " if ok else "FAIL", what))
        if not ok:
            print("     got: %r" % (got,))
            failures.append(what)

    rc, out, err = run(cuma, trace, True)
    check(rc == 0, "on a terminal: exit 0", rc)
    text = err.decode("utf-8", "replace")
    check(("\r\x1b[K%s: 65536 of " % name) in text, "the first line after 65536 events", text[:200])
    check(text.endswith("\r\x1b[K"), "the line is cleared at the end", text[-40:])
    check(b"\x1b" not in out and json.loads(out.decode().splitlines()[0])["trace"] == name,
          "stdout: the JSON only", out[:200])
    rc, out, err = run(cuma, trace, False)
    check(rc == 0 and err == b"", "stderr piped: no progress", err[:200])
    rc, out, err = run(cuma, trace, True, {"CUMA_PROGRESS": "off"})
    check(rc == 0 and b"events" not in err, "CUMA_PROGRESS=off: none on a terminal", err[:200])
    if failures:
        print("%d failed: %s" % (len(failures), ", ".join(failures)))
        return 1
    print("all passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
