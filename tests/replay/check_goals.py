#!/usr/bin/python3
# SPDX-License-Identifier: Apache-2.0
"""Checks `cuma replay` on one trace against the memory goals, measured from an ideal cache.

usage: check_goals.py --cuma BIN [--policy NAME] [--scale K] [--delay-ms MS]
                      [--expect-ideal RATIO:CREATES] [--ideal-only] TRACE

Without --policy, the replay (default policy) must meet the goals:
  failed_allocs == 0
  overhead_ratio <= 1.02                      (peak reserved / peak requested)
  time_avg_ratio <= ideal time_avg_ratio + 0.03
  page_creates   <= 1.25 * ideal page_creates
With --policy NAME (the buddy, say) the replay is only required not to fail an allocation; its
figures are printed next to the ideal ones for comparison.

With --lag-ms N the simulated device runs N ms behind the host (sim_lag_ms), as a GPU does
while the host queues work ahead: memory freed in the last N ms cannot move to another address
yet. Then the replay must still fail nothing, and
  overhead_ratio <= 1.10                      (pages still pending are skipped, not waited for)
  event_queries  <= 0.25 * allocations        (the device is asked about a lagging stream once
                                               per operation, not once per idle page)
--lag-overhead and --lag-queries set other bounds (a multi-stream trace, whose memory freed on
one stream waits for that stream before another may use it). --vs-pytorch also replays the
trace on the model of PyTorch's allocator at the same lag (--policy pytorch) and requires
  peak_reserved_bytes <= the model's

The ideal cache is the yardstick: a cache that keeps memory exactly DELAY after its use and
reuses it perfectly. At the time of event i it holds

    ideal_i = max { requested_j : event j <= i, t_j >= t_i - DELAY }

where requested_j is the sum of the live sizes right after event j (sizes x SCALE). Like the
replay, values after event i hold until event i + 1, so both ratios integrate the same step
functions over the same intervals:

    time_avg_ratio = sum ideal_i * (t_{i+1} - t_i) / sum requested_i * (t_{i+1} - t_i)

Its pages are ceil(ideal_i / 2 MiB); page_creates is the sum of every rise of that count (a
fall gives pages back, a later rise has to create them again).

Standard library only: runs under the system /usr/bin/python3.
"""
import argparse
import gzip
import json
import os
import subprocess
import sys
from collections import deque

PAGE = 2 << 20
GOAL_OVERHEAD = 1.02
GOAL_TIME_AVG_SLACK = 0.03
GOAL_CREATES_FACTOR = 1.25
GOAL_LAG_OVERHEAD = 1.10
GOAL_LAG_QUERIES_PER_ALLOC = 0.25


def open_trace(path):
    """A text stream over a plain or gzip-compressed trace (told apart by the magic bytes)."""
    with open(path, "rb") as f:
        magic = f.read(2)
    if magic == b"\x1f\x8b":
        return gzip.open(path, "rt", encoding="ascii", newline="")
    return open(path, "rt", encoding="ascii", newline="")


def parse_time_us(text):
    """HH:MM:SS:micro or HH:MM:SS.micro -> microseconds (the fraction read as a fraction)."""
    sep = ":" if text.count(":") == 3 else "."
    head, _, frac = text.rpartition(sep)
    h, m, s = head.split(":")
    if not frac.isdigit():
        raise ValueError("bad time " + text)
    return ((int(h) * 60 + int(m)) * 60 + int(s)) * 1000000 + int((frac + "00000")[:6])


def requested_levels(path, scale):
    """Times (clamped so they never go back) and requested bytes after every event."""
    times, levels = [], []
    live = {}
    requested = 0
    now = 0
    with open_trace(path) as f:
        header = f.readline().strip()
        if header != "Thread,Time,Action,Pointer,Size,Stream":
            raise ValueError("%s: missing header" % path)
        for line in f:
            line = line.strip()
            if not line:
                continue
            _, time, action, ptr, size, _ = line.split(",")
            now = max(now, parse_time_us(time))
            if action == "allocate":
                if ptr in live:  # a lost free: the old block stays live, as the reader has it
                    live[(ptr, len(times))] = live.pop(ptr)
                live[ptr] = int(size) * scale
                requested += live[ptr]
            elif action == "free":
                requested -= live.pop(ptr, 0)  # a free of an unknown pointer changes nothing
            times.append(now)
            levels.append(requested)
    return times, levels


def ideal_cache(times, levels, delay_us):
    """(time_avg_ratio, page_creates, peak_pages, paged_ratio) of the ideal window cache.

    time_avg_ratio integrates the ideal in bytes: it reproduces the project's reference figures
    and is the stricter yardstick. paged_ratio integrates whole pages instead (shown only)."""
    # Candidates for the window maximum, oldest first, with falling levels: a level older and
    # not above a newer one can never be the maximum again, so it is dropped at once.
    window = deque()
    ideal_area = requested_area = paged_area = 0
    pages = creates = peak_pages = 0
    n = len(times)
    for i in range(n):
        t, level = times[i], levels[i]
        while window and window[-1][1] <= level:
            window.pop()
        window.append((t, level))
        while window[0][0] < t - delay_us:
            window.popleft()
        ideal = window[0][1]
        new_pages = -(-ideal // PAGE)
        if new_pages > pages:
            creates += new_pages - pages
        pages = new_pages
        peak_pages = max(peak_pages, pages)
        if i + 1 < n:
            dt = times[i + 1] - t
            ideal_area += ideal * dt
            paged_area += pages * PAGE * dt
            requested_area += level * dt
    if not requested_area:
        return 0.0, creates, peak_pages, 0.0
    return ideal_area / requested_area, creates, peak_pages, paged_area / requested_area


def run_replay(cuma, trace, scale, delay_ms, policy, lag_ms=0, conf=""):
    cmd = [cuma, "replay", "--json", "--scale", str(scale), "--conf",
           "release_delay_ms:%d,sim_lag_ms:%d" % (delay_ms, lag_ms) + ("," + conf if conf else "")]
    if policy:
        cmd += ["--policy", policy]
    cmd.append(trace)
    env = dict(os.environ)
    env.pop("CUMA_CONF", None)  # the user's settings must not change the test
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          universal_newlines=True, env=env, timeout=900)
    if proc.returncode != 0:
        sys.stderr.write(proc.stderr)
        raise SystemExit("FAIL: %s exited with %d" % (" ".join(cmd), proc.returncode))
    lines = [l for l in proc.stdout.splitlines() if l.strip()]
    if len(lines) != 1:
        raise SystemExit("FAIL: expected one JSON line, got:\n" + proc.stdout)
    return json.loads(lines[0])


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cuma", help="the cuma executable")
    ap.add_argument("--policy", help="replay with this policy; only failures are checked")
    ap.add_argument("--scale", type=int, default=16)
    ap.add_argument("--delay-ms", type=int, default=1000)
    ap.add_argument("--expect-ideal", metavar="RATIO:CREATES",
                    help="fail unless the ideal cache gives these figures (a self-check)")
    ap.add_argument("--ideal-only", action="store_true", help="print the ideal figures only")
    ap.add_argument("--lag-ms", type=int, default=0,
                    help="the simulated device runs this far behind: the lag checks instead")
    ap.add_argument("--lag-overhead", type=float, default=GOAL_LAG_OVERHEAD,
                    help="with --lag-ms: the bound on overhead_ratio (default %(default)s)")
    ap.add_argument("--lag-queries", type=float, default=GOAL_LAG_QUERIES_PER_ALLOC,
                    help="with --lag-ms: the bound on event_queries per allocation "
                    "(default %(default)s)")
    ap.add_argument("--vs-pytorch", action="store_true",
                    help="with --lag-ms: peak reserved at most the PyTorch model's at that lag")
    ap.add_argument("--conf", default="", help="more settings for the replay (KEY:VALUE,...)")
    ap.add_argument("trace")
    args = ap.parse_args()

    times, levels = requested_levels(args.trace, args.scale)
    ideal_ratio, ideal_creates, ideal_peak, paged_ratio = ideal_cache(times, levels,
                                                                      args.delay_ms * 1000)
    name = os.path.basename(args.trace)
    print("%s: ideal cache at %d ms, x%d: time_avg_ratio %.4f (%.4f in whole pages), "
          "page_creates %d, peak pages %d" % (name, args.delay_ms, args.scale, ideal_ratio,
                                              paged_ratio, ideal_creates, ideal_peak))
    failures = []
    if args.expect_ideal:
        want_ratio, want_creates = args.expect_ideal.split(":")
        if abs(ideal_ratio - float(want_ratio)) > 0.00005 or ideal_creates != int(want_creates):
            failures.append("ideal cache gives %.4f:%d, expected %s"
                            % (ideal_ratio, ideal_creates, args.expect_ideal))
    if args.ideal_only:
        print(json.dumps({"trace": name, "time_avg_ratio": round(ideal_ratio, 4),
                          "page_creates": ideal_creates, "peak_pages": ideal_peak}))
        return 1 if failures else 0
    if not args.cuma:
        ap.error("--cuma is required unless --ideal-only")

    r = run_replay(args.cuma, args.trace, args.scale, args.delay_ms, args.policy, args.lag_ms,
                   args.conf)
    checks = [("failed_allocs", r["failed_allocs"], "== 0", r["failed_allocs"] == 0)]
    if args.lag_ms:
        limit_queries = args.lag_queries * r["allocs"]
        checks += [
            ("overhead_ratio", r["overhead_ratio"], "<= %.2f (device %d ms behind)"
             % (args.lag_overhead, args.lag_ms), r["overhead_ratio"] <= args.lag_overhead),
            ("event_queries", r["event_queries"], "<= %.0f (%.2f x %d allocations)"
             % (limit_queries, args.lag_queries, r["allocs"]),
             r["event_queries"] <= limit_queries),
        ]
        if args.vs_pytorch:
            m = run_replay(args.cuma, args.trace, 1, args.delay_ms, "pytorch", args.lag_ms)
            checks.append(("peak_reserved", r["peak_reserved_bytes"],
                           "<= %d (PyTorch model, %.4f)" % (m["peak_reserved_bytes"],
                                                            m["overhead_ratio"]),
                           r["peak_reserved_bytes"] <= m["peak_reserved_bytes"]))
    elif not args.policy:
        limit_ratio = ideal_ratio + GOAL_TIME_AVG_SLACK
        limit_creates = GOAL_CREATES_FACTOR * ideal_creates
        checks += [
            ("overhead_ratio", r["overhead_ratio"], "<= %.2f" % GOAL_OVERHEAD,
             r["overhead_ratio"] <= GOAL_OVERHEAD),
            ("time_avg_ratio", r["time_avg_ratio"], "<= %.4f (ideal + %.2f)"
             % (limit_ratio, GOAL_TIME_AVG_SLACK), r["time_avg_ratio"] <= limit_ratio),
            ("page_creates", r["page_creates"], "<= %.0f (%.2f x ideal %d)"
             % (limit_creates, GOAL_CREATES_FACTOR, ideal_creates),
             r["page_creates"] <= limit_creates),
        ]
    print("%s: policy %s, %d events, peak requested %.1f MiB, peak reserved %.1f MiB, "
          "end reserved %.1f MiB, %d page releases, %d maps, %d unmaps, %.1f ns/op"
          % (name, r["policy"], r["events"], r["peak_requested_bytes"] / 2**20,
             r["peak_reserved_bytes"] / 2**20, r["end_reserved_bytes"] / 2**20,
             r["page_releases"], r["maps"], r["unmaps"], r["ns_per_op"]))
    if args.policy or args.lag_ms:
        print("  (not held to the goals) overhead_ratio %.4f, time_avg_ratio %.4f vs ideal %.4f,"
              " page_creates %d vs ideal %d" % (r["overhead_ratio"], r["time_avg_ratio"],
                                                 ideal_ratio, r["page_creates"], ideal_creates))
    for key, value, rule, ok in checks:
        print("  %-15s %-10s %-30s %s" % (key, value, rule, "ok" if ok else "FAIL"))
        if not ok:
            failures.append("%s = %s, goal %s" % (key, value, rule))
    for f in failures:
        print("FAIL: %s: %s" % (name, f))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
