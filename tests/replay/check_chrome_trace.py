#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""`cuma replay` on torch.profiler Chrome traces (ctest replay_chrome_trace).

Writes a trace in kineto's layout (the [memory] instant events PyTorch's profiler adds with
profile_memory=True, among operator events) plain and gzip'd, replays it with --json and
--compare pytorch,tlsf, and checks the source fields both replays print against what the file
holds; --device picks a device and refuses an absent one; the memory events torch 1.13
recorded here (tests/data/profiler_mlp_cpu.pt.trace.json.gz) replay to PyTorch's own peak of
"Total Allocated", cuma leaks names their format, and cuma convert writes them as a snapshot
of device 0 that replays the same; and the Chrome trace Debian's torch 1.13 wrote here
(tests/data/profiler_torch113_cpu.json: no kineto, so no memory events) is refused naming the
missing profile_memory events, not read as a malformed CSV.

usage: check_chrome_trace.py --cuma BIN --data DIR --out DIR
"""
import argparse
import gzip
import json
import os
import subprocess
import sys

MIB = 1 << 20


def mem(ts, addr, nbytes, reserved, dev=0, dtype=1):
    return {"ph": "i", "cat": "cpu_instant_event", "s": "t", "name": "[memory]", "pid": 9,
            "tid": 9, "ts": ts,
            "args": {"Device Type": dtype, "Device Id": dev, "Addr": addr, "Bytes": nbytes,
                     "Total Allocated": 0, "Total Reserved": reserved}}


def make_trace():
    """A training-like loop on device 0: weights alive before profiling (freed at the end),
    activations allocated and freed each step, written out of time order; one event on
    device 1 and CPU ones that the default device choice leaves out."""
    ev = [{"ph": "X", "cat": "cpu_op", "name": "aten::mm", "pid": 9, "tid": 9, "ts": 1.0,
           "dur": 5.5, "args": {"Input Dims": [[64, 64], [64, 64]]}}]
    base, t, reserved = 0x7F0000000000, 10.0, 40 * MIB
    for step in range(20):
        for k in range(4):
            t += 1.125
            ev.append(mem(round(t, 3), base + k * 4 * MIB, 3 * MIB, reserved))
        for k in range(4):
            t += 0.5
            ev.append(mem(round(t, 3), base + k * 4 * MIB, -3 * MIB, reserved))
    ev.append(mem(t + 1, base + 64 * MIB, -8 * MIB, reserved))  # a weight from before
    ev.append(mem(t + 2, 0x1000, 64, 0, dev=-1, dtype=0))
    ev.append(mem(t + 3, base, 512, 2 * MIB, dev=1))
    ev.reverse()  # the reader sorts by time
    return {"schemaVersion": 1, "traceEvents": ev, "traceName": "loop"}


def run(args, *cmd):
    return subprocess.run([args.cuma, *cmd], capture_output=True, text=True, timeout=120)


def check_recorded(args):
    """The trace torch 1.13 recorded here (make_profiler_trace.py): CPU events only, so those
    are replayed, said on stderr; the peak requested is the peak of PyTorch's own "Total
    Allocated" over its value before the first event."""
    path = os.path.join(args.data, "profiler_mlp_cpu.pt.trace.json.gz")
    with gzip.open(path, "rt") as f:
        mem_ev = [e for e in json.load(f)["traceEvents"] if e.get("name") == "[memory]"]
    mem_ev.sort(key=lambda e: e["ts"])
    first = mem_ev[0]["args"]
    base = first["Total Allocated"] - first["Bytes"]
    want = {"format": "torch_profiler", "device": -1, "events": len(mem_ev),
            "preexisting_blocks": 0, "unmatched_frees": 0, "recorded_peak_reserved_bytes": None,
            "peak_requested_bytes": max(e["args"]["Total Allocated"] for e in mem_ev) - base}
    bad = 0
    r = run(args, "replay", "--json", "--compare", "pytorch,tlsf", path)
    lines = [json.loads(x) for x in r.stdout.splitlines() if x.startswith("{")]
    if r.returncode != 0 or len(lines) != 2 or "no CUDA memory events" not in r.stderr:
        print(f"FAIL {path}: exit {r.returncode}, {len(lines)} lines: {r.stderr}")
        return 1
    for j in lines:
        got = {k: j.get(k) for k in want}
        if got != want:
            print(f"FAIL {path} {j.get('policy')}: {got} != {want}")
            bad += 1
    r = run(args, "leaks", "--json", path)
    j = json.loads(r.stdout) if r.returncode == 0 else {}
    if (j.get("format"), j.get("device"), j.get("events"), j.get("stacks")) != \
            ("pytorch_profiler", -1, len(mem_ev), False):
        print(f"FAIL cuma leaks {path}: exit {r.returncode}: {r.stdout[:200]} {r.stderr}")
        bad += 1
    pk = os.path.join(args.out, "profiler_mlp_cpu.pickle")
    r = run(args, "convert", "-o", pk, path)
    c = run(args, "replay", "--json", pk) if r.returncode == 0 else r
    j = json.loads(c.stdout) if c.returncode == 0 else {}
    if "writing the CPU ones as device 0" not in r.stderr or (
            j.get("format"), j.get("device"), j.get("events"), j.get("peak_requested_bytes")) != (
            "torch_snapshot", 0, len(mem_ev), want["peak_requested_bytes"]):
        print(f"FAIL cuma convert {path}: exit {r.returncode}: {r.stderr} {c.stdout[:300]}")
        bad += 1
    r = run(args, "replay", "--device", "0", path)
    if r.returncode != 2 or f"no CUDA memory events ({len(mem_ev)} CPU ones)" not in r.stderr:
        print(f"FAIL {path} --device 0: exit {r.returncode}: {r.stderr}")
        bad += 1
    return bad


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cuma", required=True)
    ap.add_argument("--data", required=True)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    plain = os.path.join(args.out, "loop.json")
    packed = os.path.join(args.out, "loop.pt.trace.json.gz")
    text = json.dumps(make_trace(), indent=1)
    with open(plain, "w") as f:
        f.write(text)
    with gzip.open(packed, "wt") as f:
        f.write(text)
    bad = 0
    for path in (plain, packed):
        r = run(args, "replay", "--json", "--compare", "pytorch,tlsf", path)
        lines = [json.loads(x) for x in r.stdout.splitlines() if x.startswith("{")]
        if r.returncode != 0 or len(lines) != 2:
            print(f"FAIL {path}: exit {r.returncode}, {len(lines)} lines: {r.stderr}")
            bad += 1
            continue
        for j in lines:
            want = {"format": "torch_profiler", "device": 0, "events": 162,
                    "preexisting_blocks": 1, "unmatched_frees": 0,
                    "recorded_peak_reserved_bytes": 40 * MIB,
                    "recorded_time_avg_reserved_bytes": 40 * MIB, "peak_requested_bytes":
                    20 * MIB}
            got = {k: j.get(k) for k in want}
            if got != want:
                print(f"FAIL {path} {j.get('policy')}: {got} != {want}")
                bad += 1
        if [j["policy"] for j in lines] != ["pytorch", "tlsf"]:
            print(f"FAIL {path}: policies {[j['policy'] for j in lines]}")
            bad += 1
    r = run(args, "replay", "--json", "--device", "1", plain)
    j = json.loads(r.stdout) if r.returncode == 0 else {}
    if j.get("device") != 1 or j.get("events") != 1:
        print(f"FAIL --device 1: exit {r.returncode} {j} {r.stderr}")
        bad += 1
    r = run(args, "replay", "--device", "2", plain)
    if r.returncode != 2 or "no device 2: the trace has CUDA memory events of device(s) 0 1" \
            not in r.stderr:
        print(f"FAIL --device 2: exit {r.returncode}: {r.stderr}")
        bad += 1
    bad += check_recorded(args)
    legacy = os.path.join(args.data, "profiler_torch113_cpu.json")
    r = run(args, "replay", legacy)
    if r.returncode != 2 or "a Chrome trace with no [memory] events" not in r.stderr \
            or "profile_memory=True" not in r.stderr:
        print(f"FAIL {legacy}: exit {r.returncode}: {r.stderr}")
        bad += 1
    print(f"chrome trace replays: {bad} checks failed" if bad else "chrome trace replays: ok")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
