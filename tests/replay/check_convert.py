#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""`cuma convert -o OUT.pickle TRACE`: a trace written as a PyTorch memory snapshot.

For the snapshots in tests/data, one whose block from before recording has frames no event has
(written first, numbered last), and a small RMM CSV log (an address above 2^32, a stream with
the top bit set, a free of a block never allocated, an allocation failure):
- Python's own pickle module loads the file, and it holds plain data only (dict, list, str,
  int), with the fields a snapshot has: segments with blocks, device_traces of events with
  action/addr/size/stream/time_us/frames, frames of filename/line/name;
- its events are the trace's, one for one (a free as free_requested + free_completed; a block
  live at the end in a segment of its own after that segment's segment_alloc);
- the project's reader reads it back as the same trace: `cuma leaks --json --all-frames` (call
  sites, bytes, every stack) and `cuma replay --json`'s figures are the original's, with
  `--policy pytorch` too (the segments from before recording, their free room, are kept);
- where PyTorch is installed, torch.cuda._memory_viz.stats accepts its segments.
Its --help, its row in `cuma help`. Bad options, and an address a snapshot cannot hold (over 2^63-1): exit 2 and no file.
usage: check_convert.py --cuma CUMA --data tests/data --out DIR
"""

import argparse
import json
import os
import pickle
import re
import subprocess
import sys

failures = []
REPLAY_KEYS = ("events", "allocs", "frees", "unmatched_frees", "trace_alloc_failures",
               "peak_requested_bytes", "peak_reserved_bytes", "end_reserved_bytes",
               "time_avg_ratio", "overhead_ratio")
PYTORCH_KEYS = ("preexisting_segments", "preexisting_segment_bytes", "segments_seeded",
                "blocks_placed", "segments_created")


def check(cond, what):
    print(("ok   " if cond else "FAIL ") + what)
    if not cond:
        failures.append(what)


def run(cmd):
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300)


def plain(x):
    if isinstance(x, dict):
        return all(isinstance(k, str) and plain(v) for k, v in x.items())
    if isinstance(x, list):
        return all(plain(v) for v in x)
    return type(x) in (str, int)


def json_line(cmd):
    r = run(cmd)
    if r.returncode:
        return None
    d = json.loads(r.stdout.splitlines()[0])
    d.pop("trace", None)
    d.pop("path", None)
    return d


def check_one(cuma, trace, out, name, same=True):
    pk = os.path.join(out, name + ".pickle")
    r = run([cuma, "convert", "-o", pk, trace])
    check(r.returncode == 0, "%s: cuma convert exits 0 (%s)" % (name, r.stderr.strip()))
    if r.returncode:
        return None
    with open(pk, "rb") as f:
        d = pickle.load(f)
    check(isinstance(d, dict) and set(d) == {"segments", "device_traces"} and plain(d),
          "%s: pickle.load gives plain data with segments and device_traces" % name)
    evs = [e for dev in d["device_traces"] for e in dev]
    check(all(set(e) == {"action", "addr", "size", "stream", "time_us", "frames"} for e in evs),
          "%s: every event has action, addr, size, stream, time_us, frames" % name)
    frames = [f for e in evs for f in e["frames"]]
    frames += [f for s in d["segments"] for b in s["blocks"] for f in b["frames"]]
    check(all(set(f) == {"filename", "line", "name"} for f in frames),
          "%s: every frame has filename, line, name (%d frames)" % (name, len(frames)))
    check(all(s["total_size"] == sum(b["size"] for b in s["blocks"]) and
              all(b["state"] in ("active_allocated", "inactive") for b in s["blocks"])
              for s in d["segments"]),
          "%s: segments are their blocks, active or free" % name)
    nfree_req = sum(e["action"] == "free_requested" for e in evs)
    check(nfree_req == sum(e["action"] == "free_completed" for e in evs),
          "%s: each free is requested and completed" % name)
    for cmd in ("leaks", "replay", "pytorch") if same else ():
        extra = ["--top", "100000", "--all-frames"] if cmd == "leaks" else []
        if cmd == "pytorch":  # the model, which starts from the segments from before recording
            cmd, extra = "replay", ["--policy", "pytorch"]
        a = json_line([cuma, cmd, "--json", *extra, trace])
        b = json_line([cuma, cmd, "--json", *extra, pk])
        if cmd == "replay" and a and b:
            keys = REPLAY_KEYS + (PYTORCH_KEYS if extra else ())
            a = {k: a.get(k) for k in keys}
            b = {k: b.get(k) for k in keys}
        if cmd == "leaks" and a and b:
            a.pop("format"), b.pop("format")
        check(a is not None and a == b, "%s: cuma %s reads it back as the original" %
              (name, " ".join([cmd] + extra[:2])))
        if a != b:
            print("  original: %s\n  converted: %s" % (str(a)[:600], str(b)[:600]))
    try:
        import torch.cuda._memory_viz as mv  # noqa: E402 (optional: PyTorch's own reader)
    except Exception:
        print("note: no torch.cuda._memory_viz here; PyTorch's check left out")
    else:
        st = mv.stats(d["segments"])
        check(st["total_size"].value == sum(s["total_size"] for s in d["segments"]),
              "%s: torch.cuda._memory_viz.stats reads the segments" % name)
    return d


def late_frames_snapshot(path):
    """A snapshot whose block from before recording has frames no event has, after 200
    allocations with frames of their own: the reader numbers the block's frames last, and the
    writer puts that block first (in "segments"), so its memo ids must follow the writing order,
    not the reader's numbering, for a pickle reader to accept them."""
    base = 0x7F0000000000
    fr = lambda k: [{"filename": "f%d.py" % k, "line": k, "name": "g%d" % k}]  # noqa: E731
    trace = [{"action": a, "addr": base + (1 + k) * 4096, "size": 4096, "stream": 0,
              "time_us": 10 * k + (a != "alloc"), "frames": fr(k)}
             for k in range(200) for a in ("alloc", "free_requested", "free_completed")]
    blocks = [{"address": base, "size": 4096, "requested_size": 4096, "state": "active_allocated",
               "frames": fr(999)},
              {"address": base + 4096, "size": 2 * 1024 * 1024 - 4096, "requested_size": 0,
               "state": "inactive", "frames": []}]
    segs = [{"device": 0, "address": base, "total_size": 2 * 1024 * 1024, "stream": 0,
             "segment_type": "small", "blocks": blocks}]
    with open(path, "wb") as f:
        pickle.dump({"segments": segs, "device_traces": [trace]}, f, protocol=4)
    return path


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cuma", required=True)
    ap.add_argument("--data", required=True)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    for snap in ("snapshot_toy_attention.pickle.gz", "snapshot_small_lm_5steps.pickle.gz",
                 "snapshot_cached_segments.pickle.gz"):
        d = check_one(a.cuma, os.path.join(a.data, snap), a.out, snap.split(".")[0])
        if d and snap.startswith("snapshot_toy"):
            evs = d["device_traces"][0]
            check(len([e for e in evs if e["action"] == "alloc"]) == 36 and
                  any(f["filename"].endswith("trace_peak_memory.py") for e in evs for f in e["frames"]),
                  "toy attention: its 36 allocations with the program's frames")
    check_one(a.cuma, late_frames_snapshot(os.path.join(a.out, "late_frames_in.pickle")), a.out,
              "late_frames")
    csv = os.path.join(a.out, "small.csv")
    with open(csv, "w") as f:
        f.write("Thread,Time,Action,Pointer,Size,Stream\n"
                "0,00:00:00:000100,allocate,0x7fff800000000000,4096,0x7f00aa\n"
                "0,00:00:00:000200,allocate,0x1000,512,0xffffffffffff00aa\n"
                "0,00:00:00:000300,free,0x9999,64,0\n"
                "0,00:00:00:000400,allocate failure,0x0,1073741824,0\n"
                "0,00:00:00:000500,free,0x1000,512,0\n")
    # A free of a block the log never allocated is, in a snapshot, a block alive before
    # recording: read back, it is allocated at time 0 (so one more event and allocation).
    d = check_one(a.cuma, csv, a.out, "small_csv", same=False)
    orig = json_line([a.cuma, "replay", "--json", csv])
    back = json_line([a.cuma, "replay", "--json", os.path.join(a.out, "small_csv.pickle")])
    check(orig and back and (back["events"], back["allocs"], back["frees"], back["unmatched_frees"],
                             back["peak_requested_bytes"], back["trace_alloc_failures"]) ==
          (orig["events"] + 1, orig["allocs"] + 1, orig["frees"] + 1, 0,
           orig["peak_requested_bytes"] + 64, orig["trace_alloc_failures"]),
          "small CSV read back: the same, but its unmatched free is a block from before")
    if d:
        evs = d["device_traces"][0]
        check([(e["action"], e["addr"], e["size"], e["time_us"]) for e in evs] ==
              [("segment_alloc", 0x7fff800000000000, 4096, 100),
               ("alloc", 0x7fff800000000000, 4096, 100), ("alloc", 0x1000, 512, 200),
               ("free_requested", 0x9999, 64, 300), ("free_completed", 0x9999, 64, 300),
               ("oom", 0, 1073741824, 400), ("free_requested", 0x1000, 512, 500),
               ("free_completed", 0x1000, 512, 500)],
              "small CSV: its events one for one, the segment of the block live at the end made "
              "during recording: %s" % [(e["action"], e["addr"]) for e in evs])
        check(evs[1]["stream"] == 0x7f00aa and evs[2]["stream"] == 0xffffffffffff00aa - 2**64 and
              [(s["address"], s["total_size"]) for s in d["segments"]] == [(0x7fff800000000000, 4096)],
              "small CSV: the streams (the top bit set: negative, as PyTorch's cudaStream_t ints), and "
              "the block live at the end as a segment")
    bad = os.path.join(a.out, "bad.pickle")
    wide = os.path.join(a.out, "wide.csv")
    with open(wide, "w") as f:
        f.write("Thread,Time,Action,Pointer,Size,Stream\n0,00:00:00:000100,allocate,0xffff800000000000,64,0\n")
    for args, what in (([csv], "-o OUT.pickle is needed"),
                       (["-o", bad, csv, csv], "one trace at a time"),
                       (["-o", bad, os.path.join(a.out, "missing.csv")], "missing.csv"),
                       (["-o", os.path.join(a.out, "no", "such", "dir.pickle"), csv], "cannot write"),
                       (["-o", bad, "--device", "x", csv], "--device wants"),
                       (["-o", bad, wide], "over 2^63-1")):
        r = run([a.cuma, "convert", *args])
        check(r.returncode == 2 and what in r.stderr and not os.path.exists(bad),
              "cuma convert %s: exit 2, says %r (%d: %s)" % (" ".join(args[:2]), what, r.returncode,
                                                             r.stderr.strip().splitlines()[:1]))
    r = run([a.cuma, "convert", "--help"])
    check(r.returncode == 0 and r.stdout.startswith("usage: cuma convert"), "cuma convert --help")
    r = run([a.cuma, "help"])
    check(r.returncode == 0 and re.search(r"^  convert +write a trace as a PyTorch", r.stdout, re.M),
          "cuma help lists convert")
    print("%d failures" % len(failures))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
