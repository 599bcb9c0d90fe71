#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Two jobs on one device through cuma's cross-process ledger, for the GPU check.

A low-priority process ("holder") fills a share of the device and frees it, so that its heap
holds the memory idle in its cache; then a high-priority process ("taker") asks for the same
share. Together they need more than the device: the taker's heap is refused by the ledger, asks
the holder, and gets the memory once the holder's release thread gave its cache back. A second
round does the same with the holder's memory in use: its pressure callback frees it.

Prints each process's figures and one line ``LEDGER RESULT: ...``; exit status 0 when the taker
got its memory both times, by asking (the first time from the holder's cache, without a
pressure callback; the second through one), 1 otherwise, 2 on bad arguments. On the simulated device (the
default here, for tests) the processes share a simulated device of --capacity through a
ledger named for the run; on a GPU pass --conf backend:vmm.

usage: ledger_pair.py [--conf CONF] [--share 0.6] [--timeout-ms 5000]
"""

import argparse
import json
import os
import subprocess
import sys
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "python"))

GIB = 1 << 30
BLOCK = 256 << 20  # the share is allocated in blocks of 256 MiB


def heap(args, priority):
    import cuma

    conf = "%s,ledger:%s,priority:%d,pressure_timeout_ms:%d,release_delay_ms:100000" % (
        args.conf, args.ledger, priority, args.timeout_ms)
    return cuma.Heap(conf, use_env=False)


def blocks_for(h, share):
    total = h.stats()["device_total_bytes"] or h.stats()["limit_bytes"]
    # Rounded up: two shares must not fit side by side.
    return max(1, -(-int(total * share) // BLOCK)), total


def role_holder(args):
    """Fills the share, frees it (idle cache), reports; on "use" fills it again and keeps it in
    use, with a pressure callback that frees it; exits on "quit"."""
    h = heap(args, -1)
    n, total = blocks_for(h, args.share)
    held = []
    lock = threading.Lock()
    asked = []

    def on_pressure(nbytes):
        asked.append(nbytes)
        with lock:
            while held:
                h.free(held.pop())

    h.on_pressure(on_pressure)
    t0 = time.time()
    held = [h.alloc(BLOCK) for _ in range(n)]
    fill_s = time.time() - t0
    with lock:
        while held:
            h.free(held.pop())
    say({"role": "holder", "event": "idle", "blocks": n, "total": total, "fill_s": round(fill_s, 3),
         "stats": pick(h.stats())})
    for line in sys.stdin:
        cmd = line.strip()
        if cmd == "use":
            got = []
            for _ in range(n):
                try:
                    got.append(h.alloc(BLOCK))
                except Exception:
                    break  # the taker holds part of the device now
            with lock:
                held.extend(got)
            say({"role": "holder", "event": "in_use", "blocks": len(got), "stats": pick(h.stats())})
        elif cmd == "report":
            say({"role": "holder", "event": "report", "asked": asked, "stats": pick(h.stats())})
        elif cmd == "quit":
            break
    h.close()


def role_taker(args):
    """Takes the share (timed), reports, frees it, and exits."""
    h = heap(args, 1)
    n, total = blocks_for(h, args.share)
    got, err = [], None
    t0 = time.time()
    try:
        for _ in range(n):
            got.append(h.alloc(BLOCK))
    except Exception as e:  # reported, not raised: the parent judges
        err = str(e)
    took = time.time() - t0
    say({"role": "taker", "blocks": len(got), "wanted": n, "seconds": round(took, 3),
         "error": err, "stats": pick(h.stats())})
    for p in got:
        h.free(p)
    h.close()


KEYS = ("reserved_bytes", "cached_bytes", "page_creates", "page_releases", "ledger_denials",
        "pressure_asks", "pressure_given_bytes", "pressure_callbacks", "backend", "device")


def pick(s):
    return {k: s.get(k) for k in KEYS}


def say(obj):
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


def spawn(args, role):
    cmd = [sys.executable, os.path.abspath(__file__), "--role", role, "--conf", args.conf,
           "--ledger", args.ledger, "--share", str(args.share), "--timeout-ms", str(args.timeout_ms)]
    return subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            universal_newlines=True, bufsize=1)


def read_json(p, what):
    line = p.stdout.readline()
    if not line:
        raise RuntimeError("the %s process ended without reporting (exit %s)" % (what, p.wait()))
    return json.loads(line)


def take(args, holder):
    taker = spawn(args, "taker")
    r = read_json(taker, "taker")
    taker.wait(60)
    holder.stdin.write("report\n")
    holder.stdin.flush()
    h = read_json(holder, "holder")
    return r, h


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--conf", default="backend:sim,capacity:1G",
                    help="settings of both heaps (default: a simulated device of 1 GiB)")
    ap.add_argument("--share", type=float, default=0.6,
                    help="share of the device each process wants (more than 0.5: they must share)")
    ap.add_argument("--timeout-ms", type=int, default=5000, help="pressure_timeout_ms of the heaps")
    ap.add_argument("--ledger", default="pair-%d" % os.getpid(), help=argparse.SUPPRESS)
    ap.add_argument("--role", choices=("holder", "taker"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if not 0.5 < args.share < 1:
        ap.error("--share must be between 0.5 and 1")
    if args.role == "holder":
        return role_holder(args)
    if args.role == "taker":
        return role_taker(args)

    import cuma

    holder = spawn(args, "holder")
    ok = True
    try:
        idle = read_json(holder, "holder")
        print("holder: %d blocks of 256 MiB filled in %.2f s, now idle in its cache: %s" % (
            idle["blocks"], idle["fill_s"], idle["stats"]))
        # What `cuma stats` shows from outside: the holder's figures, published by its release
        # thread every 100 ms, as its own stats have them.
        # A publication may fall between the allocations and the frees: wait (5 s at most) for
        # one taken after both.
        def view_matches(e):
            return (e.get("backend") == idle["stats"]["backend"].split(" ")[0]
                    and e.get("num_allocs") == idle["blocks"]
                    and e.get("num_frees") == idle["blocks"]
                    and e.get("page_creates") == idle["stats"]["page_creates"])

        e, deadline = {}, time.time() + 5
        while time.time() < deadline:
            seen = [x for x in cuma.ledger(args.ledger) if x["priority"] == -1]
            e = seen[0] if seen else {}
            if view_matches(e):
                break
            time.sleep(0.02)
        view_ok = view_matches(e)
        ok = ok and view_ok
        print("ledger view of the holder (cuma stats): %s backend %s, %s allocations, %s frees, "
              "%s pages created" % ("OK" if view_ok else "WRONG", e.get("backend"),
                                    e.get("num_allocs"), e.get("num_frees"), e.get("page_creates")))
        rounds = []
        for name in ("idle cache", "in use"):
            if name == "in use":
                holder.stdin.write("use\n")
                holder.stdin.flush()
                u = read_json(holder, "holder")
                print("holder: %d blocks in use again" % u["blocks"])
            r, h = take(args, holder)
            good = r["blocks"] == r["wanted"] and not r["error"] and r["stats"]["pressure_asks"] >= 1
            # Idle memory is given without asking the holder to shrink; memory in use is freed
            # by its pressure callback.
            calls = h["stats"]["pressure_callbacks"]
            good = good and h["stats"]["pressure_given_bytes"] > 0
            good = good and (calls == 0 if name == "idle cache" else calls >= 1)
            ok = ok and good
            rounds.append("%s: %s in %.2f s" % (name, "taken" if good else "NOT taken", r["seconds"]))
            print("round '%s': taker got %d of %d blocks in %.3f s%s" % (
                name, r["blocks"], r["wanted"], r["seconds"], (": " + r["error"]) if r["error"] else ""))
            print("  taker:  %s" % r["stats"])
            print("  holder: %s (pressure callbacks asked for %s)" % (h["stats"], h["asked"]))
        holder.stdin.write("quit\n")
        holder.stdin.flush()
        holder.wait(60)
    finally:
        if holder.poll() is None:
            holder.kill()
        try:
            os.remove(cuma.ledger_path(args.ledger))
        except (FileNotFoundError, cuma.CumaError):
            pass
    print("LEDGER RESULT: %s" % "; ".join(rounds))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main() or 0)
