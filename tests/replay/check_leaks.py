#!/usr/bin/python3
# SPDX-License-Identifier: Apache-2.0
"""Checks `cuma leaks` on synthetic PyTorch memory snapshots with call stacks.

usage: check_leaks.py --cuma BIN --data DIR --out DIR

The snapshots are written here with the standard library's pickle, shaped as
torch.cuda.memory._dump_snapshot() writes them: events with 'frames' (innermost first: C++
frames of the allocator, torch/ Python frames, then the program's), frame dicts shared
through the pickle memo as PyTorch shares them (and, in half the events, fresh copies), and
the dump's segments with blocks alive before recording, their stacks in 'frames' or, as
older PyTorch wrote them, in 'history'. A training loop of ITERS iterations:

  train.py:42 leaky_cache   appends one 1 MiB tensor each iteration and never frees it
  model.py:10 forward       activations, 3 MiB per iteration, freed by the iteration's end
  train.py:50 step          optimizer state, 8 MiB made once in the first iteration
  MmBackward0::apply        a gradient, 2 MiB made once by the backward pass on the autograd
                            engine's thread (a stack with no Python frame at all)

`cuma leaks` must name leaky_cache first among the live allocations, with its exact bytes,
and as the only growing call site; the same loop without the leak must have none. Standard
library only.
"""
import argparse
import gzip
import json
import os
import pickle
import subprocess
import sys

failures = []
MB = 1 << 20
ITERS = 12


def check(what, cond, detail=""):
    print("%-4s %s%s" % ("ok" if cond else "FAIL", what, "" if cond else ": " + detail))
    if not cond:
        failures.append(what)


def run(cuma, *args):
    env = dict(os.environ)
    env.pop("CUMA_CONF", None)
    p = subprocess.run([cuma, "leaks"] + list(args), stdout=subprocess.PIPE,
                       stderr=subprocess.PIPE, env=env, timeout=120)
    return p.returncode, p.stdout.decode("utf-8", "replace"), p.stderr.decode("utf-8", "replace")


def frame(filename, line, name):
    return {"name": name, "filename": filename, "line": line}


# The allocator's own frames, then torch's Python, as a real snapshot has them.
CPP = [frame("??", 0, "torch::unwind::unwind()"),
       frame("CUDACachingAllocator.cpp", 0, "c10::cuda::CUDACachingAllocator::malloc"),
       frame("", 0, "at::detail::empty_cuda"),
       frame("??", 0, "_PyEval_EvalFrameDefault")]
TORCH = [frame("/venv/lib/python3.12/site-packages/torch/nn/modules/module.py", 1790,
               "_call_impl"),
         frame("/usr/lib/python3.12/contextlib.py", 81, "inner")]
MAIN = [frame("train.py", 60, "train_step"), frame("train.py", 99, "<module>")]


def stack(top, shared):
    if top is None:  # the autograd engine's thread: C++ only
        frames = CPP + [frame("??", 0, GRAD), frame("??", 0, "torch::autograd::Engine::thread_main")]
    else:
        frames = CPP + TORCH + [top] + MAIN
    if shared:  # the same dict objects: pickle writes them once and BINGETs them after
        return list(frames)
    return [dict(f) for f in frames]  # fresh copies: the reader interns them by content


LEAK = frame("train.py", 42, "leaky_cache")
ACT = frame("model.py", 10, "forward")
OPT = frame("train.py", 50, "step")
GRAD = "torch::autograd::generated::MmBackward0::apply(std::vector<at::Tensor>&&)"
BASE = 0x7f0000000000


def snapshot(leak=True, gz=True):
    ev, t, addr = [], 1_700_000_000_000_000, BASE

    def alloc(size, top, shared):
        nonlocal t, addr
        t += 100
        addr += 16 * MB
        frames = stack(top, shared)
        ev.append({"action": "alloc", "addr": addr, "size": size, "stream": 0, "time_us": t,
                   "frames": frames})
        return addr, size, frames

    def free(block):
        nonlocal t
        a, size, frames = block
        for act in ("free_requested", "free_completed"):
            t += 10
            ev.append({"action": act, "addr": a, "size": size, "stream": 0, "time_us": t,
                       "frames": frames})

    for i in range(ITERS):
        shared = i % 2 == 0
        acts = [alloc(1 * MB, ACT, shared) for _ in range(3)]
        if i == 0:
            alloc(8 * MB, OPT, shared)
            alloc(2 * MB, None, shared)
        if leak:
            alloc(1 * MB, LEAK, shared)
        for a in reversed(acts):
            free(a)
    # Two weights alive since before recording: one with 'frames', one in the old 'history'.
    weights = frame("model.py", 5, "__init__")
    blocks = [{"address": 0x7e0000000000, "size": 4 * MB, "requested_size": 4 * MB,
               "state": "active_allocated", "frames": stack(weights, True)},
              {"address": 0x7e0000400000, "size": 2 * MB, "requested_size": 2 * MB,
               "state": "active_allocated",
               "history": [{"addr": 0x7e0000400000, "real_size": 2 * MB,
                            "frames": stack(weights, False)}]}]
    segs = [{"device": 0, "address": 0x7e0000000000, "total_size": 6 * MB, "stream": 0,
             "segment_type": "large", "blocks": blocks}]
    data = pickle.dumps({"segments": segs, "device_traces": [ev]}, protocol=4)
    return gzip.compress(data) if gz else data


def write(path, data):
    with open(path, "wb") as f:
        f.write(data)
    return path


def site(entry):
    s = entry.get("site")
    return None if s is None else "%s:%d %s" % (s["file"], s["line"], s["name"])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cuma", required=True)
    ap.add_argument("--data", required=True)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    leaky = write(os.path.join(a.out, "leaky.pickle.gz"), snapshot(leak=True))
    steady = write(os.path.join(a.out, "steady.pickle"), snapshot(leak=False, gz=False))

    rc, out, err = run(a.cuma, leaky)
    table = out.split("call site\n", 1)[-1].split("  growing", 1)[0]
    rows = table.splitlines()
    check("text: exit 0", rc == 0, "exit %d, stderr %r" % (rc, err))
    check("text: leaky_cache is the first call site",
          bool(rows) and rows[0].rstrip().endswith("train.py:42 leaky_cache"), out)
    check("text: leaky_cache holds 12.0 MiB in 12", bool(rows) and
          rows[0].split()[:3] == ["12.0", "MiB", "12"], rows[0] if rows else out)
    check("text: a backward-pass stack is named by its autograd node",
          "2.0 MiB        1  torch::autograd::generated::MmBackward0::apply (backward pass)" in
          out, out)
    grow = out.split("growing call sites", 1)[-1]
    check("text: leaky_cache is growing", "train.py:42 leaky_cache" in grow, out)
    check("text: only leaky_cache is growing", grow.count("more ") == 1, out)

    rc, out, err = run(a.cuma, "--json", leaky)
    check("json: exit 0", rc == 0, "exit %d, stderr %r" % (rc, err))
    j = json.loads(out.splitlines()[0]) if rc == 0 else {}
    live = j.get("live", {})
    by = live.get("by_site", [])
    want = [("train.py:42 leaky_cache", 12 * MB, ITERS), ("train.py:50 step", 8 * MB, 1),
            ("model.py:5 __init__", 6 * MB, 2), ("??:0 " + GRAD, 2 * MB, 1)]
    got = [(site(e), e["bytes"], e["allocs"]) for e in by]
    check("json: live by site, largest first (blocks from before named by frames and history)",
          got == want, repr(got))
    check("json: totals", live.get("bytes") == 28 * MB and live.get("allocs") == ITERS + 4,
          repr(live))
    check("json: stacks recorded", j.get("stacks") is True and j.get("format") ==
          "pytorch_snapshot", repr(j)[:300])
    g = j.get("growing") or []
    check("json: growing is leaky_cache alone", [site(e) for e in g] == [
          "train.py:42 leaky_cache"], repr(g))
    if g:
        lows = g[0]["low_points"]
        check("json: its low points rise", lows == sorted(lows) and lows[-1] > lows[0] and
              g[0]["growth_bytes"] == lows[-1] - lows[0], repr(g[0]))

    rc, out, err = run(a.cuma, "--json", "--all-frames", "--top", "1", leaky)
    j = json.loads(out.splitlines()[0]) if rc == 0 else {}
    by = j.get("live", {}).get("by_site", [])
    st = by[0].get("stacks", []) if by else []
    frames = [(f["file"], f["line"], f["name"]) for f in st[0]["frames"]] if st else []
    want = [(f["filename"], f["line"], f["name"]) for f in stack(LEAK, True)]
    check("--all-frames: one stack, every frame, innermost first (shared and copied frames "
          "interned as one)", len(by) == 1 and len(st) == 1 and frames == want and
          st[0]["allocs"] == ITERS, repr(st)[:400])
    rc, out, err = run(a.cuma, "--all-frames", "--top", "1", leaky)
    check("--all-frames text: the torch frame is shown",
          "#4 /venv/lib/python3.12/site-packages/torch/nn/modules/module.py:1790 _call_impl" in
          out, out)

    rc, out, err = run(a.cuma, "--json", steady)
    j = json.loads(out.splitlines()[0]) if rc == 0 else {}
    check("steady loop (plain pickle): nothing growing", rc == 0 and j.get("growing") == [],
          "exit %d %r %r" % (rc, out[-400:], err))
    got = [(site(e), e["bytes"]) for e in j.get("live", {}).get("by_site", [])]
    check("steady loop: the optimizer state and the weights are live",
          got == [("train.py:50 step", 8 * MB), ("model.py:5 __init__", 6 * MB),
                  ("??:0 " + GRAD, 2 * MB)], repr(got))

    rc, out, err = run(a.cuma, "--windows", "40", "--json", steady)
    j = json.loads(out.splitlines()[0]) if rc == 0 else {}
    check("more windows than events allow: no growth figures", rc == 0 and
          j.get("growing") is None, out[-300:])

    csv = os.path.join(a.data, "gpt_generate.csv.gz")
    rc, out, err = run(a.cuma, csv)
    check("RMM CSV: grouped by size, said so", rc == 0 and
          "no call sites recorded" in out and "size classes" in out, out + err)

    rc, out, err = run(a.cuma, "--help")
    check("leaks --help: the usage, exit 0", rc == 0 and "--windows N" in out and
          "--all-frames" in out, "exit %d %r" % (rc, out + err))
    p = subprocess.run([a.cuma, "help"], stdout=subprocess.PIPE, universal_newlines=True)
    check("cuma help lists leaks", p.returncode == 0 and "\n  leaks " in p.stdout, p.stdout)
    for args, what in ((["--bogus", leaky], "unknown option"), (["--windows", "1", leaky],
                       "--windows 1"), (["--top", "x", leaky], "--top x"), ([], "no trace"),
                       ([os.path.join(a.out, "absent.pickle")], "missing file")):
        rc, out, err = run(a.cuma, *args)
        check("bad input (%s): exit 2 with a message" % what, rc == 2 and "cuma leaks" in err,
              "exit %d %r" % (rc, err))
    esc = snapshot(leak=True, gz=False).replace(b"leaky_cache", b"leaky\x1b[31mc")
    bad_frames = pickle.dumps({"device_traces": [[{"action": "alloc", "addr": 1, "size": 1,
                                                   "frames": 7}]]}, protocol=4)
    rc, out, err = run(a.cuma, write(os.path.join(a.out, "bad_frames.pickle"), bad_frames))
    check("'frames' not a list: exit 2 naming it", rc == 2 and "'frames' is not a list" in err,
          "exit %d %r" % (rc, err))
    path = write(os.path.join(a.out, "escape.pickle"), esc)
    rc, out, err = run(a.cuma, path)
    check("an ESC in a frame's name is printed escaped", rc == 0 and "\x1b" not in out and
          "train.py:42 leaky\\x1b[31mc" in out, repr(out))
    rc, out, err = run(a.cuma, "--json", path)
    check("... and as \\u001b in JSON", rc == 0 and json.loads(out)["growing"][0]["site"]["name"]
          == "leaky\x1b[31mc", repr(out)[:300])

    if failures:
        print("%d failed: %s" % (len(failures), ", ".join(failures)))
        return 1
    print("all passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
