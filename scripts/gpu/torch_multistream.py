#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""A layer-offloading pipeline on several streams, under PyTorch's native allocator and under cuma.

The workload is what inference servers and offloading trainers do and what every shared snapshot
lacks: the weights of each layer live in pinned host memory and are copied to the device on a
side stream (allocated there) while the main stream computes the layer before; the main stream
waits for the copy, uses the weights and drops them (record_stream: a free on another stream than
the allocation's); every other layer's activation is copied back to the host on a third stream
and dropped there once the copy is queued. A block freed while another stream still uses it and
reused at once would corrupt the numbers, so the two runs' checksums must agree.

Each run is a fresh process (the allocator is chosen before the first CUDA tensor). The native
run records PyTorch's memory history (torch.cuda.memory._record_memory_history) and, with
--snapshot-out FILE, writes its _dump_snapshot() gzip'd there: a real multi-stream trace for
`cuma replay`. The cuma run (cuma.torch.enable()) checks the values. Prints one
"MULTISTREAM RESULT: PASS|FAIL|SKIP ..." line; exit status 0 PASS, 1 FAIL, 3 SKIP (no PyTorch
with CUDA), 2 usage error.

    PYTHONPATH=python CUMA_LIBRARY=build-gpu/lib/libcuma.so python3 scripts/gpu/torch_multistream.py \\
        --snapshot-out build-gpu/gpu-check/multistream_snapshot.pickle.gz

--device cpu runs the same schedule on the CPU without streams (a test of the script).
"""

import argparse
import contextlib
import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
SNAPSHOT_MAX_ENTRIES = 100000


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--width", type=int, default=4096, help="each layer is width x width (bf16 on the GPU)")
    p.add_argument("--tokens", type=int, default=2048, help="rows of the activation")
    p.add_argument("--steps", type=int, default=12, help="passes through all layers")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--rel-tol", type=float, default=1e-2, help="checksums of the two runs may differ by this")
    p.add_argument("--snapshot-out", default=None, help="the native run's memory snapshot, gzip'd, here")
    p.add_argument("--cuma-conf", default=None, help="settings for cuma.torch.enable() (CUMA_CONF)")
    p.add_argument("--child-timeout", type=float, default=120.0)
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--child", choices=("native", "cuma"), default=None, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def child(a):
    import torch

    on_gpu = a.device == "cuda"
    if on_gpu and not torch.cuda.is_available():
        raise SystemExit("torch.cuda.is_available() is False")
    if a.child == "cuma" and on_gpu:
        import cuma

        cuma.torch.enable(a.cuma_conf)  # before the first CUDA tensor
    torch.manual_seed(a.seed)
    dev = torch.device(a.device)
    dtype = torch.bfloat16 if on_gpu else torch.float32
    if on_gpu and a.child == "native" and a.snapshot_out:
        try:
            torch.cuda.memory._record_memory_history(enabled="all", context="all", stacks="python",
                                                     max_entries=SNAPSHOT_MAX_ENTRIES)
        except TypeError:  # PyTorch before 2.1
            torch.cuda.memory._record_memory_history(True, trace_alloc_max_entries=SNAPSHOT_MAX_ENTRIES)
    # Host weights, scaled so the activations stay of order one through the layers.
    scale = 1.0 / (a.width ** 0.5)
    host = [(torch.randn(a.width, a.width) * scale).to(dtype) for _ in range(a.layers)]
    if on_gpu:
        host = [w.pin_memory() for w in host]
    x0 = torch.randn(a.tokens, a.width).to(dtype)
    if on_gpu:
        main, copy, offload = torch.cuda.current_stream(), torch.cuda.Stream(), torch.cuda.Stream()

        def on(s):
            return torch.cuda.stream(s)
    else:
        main = copy = offload = None

        def on(s):
            return contextlib.nullcontext()

    offloaded = [torch.empty(a.tokens, a.width, dtype=dtype, pin_memory=on_gpu) for _ in range(a.layers // 2)]

    def prefetch(i):
        with on(copy):  # allocated on the copy stream
            w = host[i].to(dev, non_blocking=True)
            ev = torch.cuda.Event() if on_gpu else None
            if ev is not None:
                ev.record(copy)
        return w, ev

    sums = []
    t0 = time.perf_counter()
    for step in range(a.steps):
        x = x0.to(dev, non_blocking=True)
        nxt = prefetch(0)
        for i in range(a.layers):
            w, ev = nxt
            if i + 1 < a.layers:
                nxt = prefetch(i + 1)  # the next layer's copy overlaps this layer's compute
            if ev is not None:
                main.wait_event(ev)
            y = torch.relu(x @ w) + x  # a temporary and a result, on the main stream
            if on_gpu:
                w.record_stream(main)  # allocated on copy, last used on main
            del w
            if i % 2 == 1:
                with on(offload):  # copied back to the host on a third stream, freed there
                    if on_gpu:
                        offload.wait_stream(main)
                    offloaded[i // 2].copy_(y, non_blocking=True)
                    if on_gpu:
                        y.record_stream(offload)
            x = y
        sums.append(float(x.float().sum()))
        del x, y
    if on_gpu:
        torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    host_sum = sum(float(t.float().sum()) for t in offloaded)
    out = {"mode": a.child, "torch": torch.__version__, "steps": a.steps, "wall_s": wall,
           "checksum": sums[-1], "checksums": sums, "offloaded_checksum": host_sum}
    if on_gpu:
        out["device"] = torch.cuda.get_device_name(0)
        if a.child == "native":
            out["peak_reserved"] = torch.cuda.max_memory_reserved()
            out["peak_allocated"] = torch.cuda.max_memory_allocated()
            if a.snapshot_out:
                out["snapshot"] = dump_snapshot(torch, a.snapshot_out)
        else:
            import cuma

            s = cuma.torch.memory_stats()
            out["peak_reserved"] = s["reserved_bytes.all.peak"]
            out["peak_allocated"] = s["allocated_bytes.all.peak"]
            out["failed_allocs"] = s.get("cuma.failed_allocs")
    return out


def dump_snapshot(torch, out):
    import gzip
    import shutil

    raw = out + ".pickle.tmp"
    torch.cuda.memory._dump_snapshot(raw)
    with open(raw, "rb") as src, gzip.open(out, "wb", compresslevel=6) as dst:
        shutil.copyfileobj(src, dst)
    raw_bytes = os.path.getsize(raw)
    os.unlink(raw)
    return {"path": out, "bytes": os.path.getsize(out), "raw_bytes": raw_bytes}


def run_child(a, mode):
    sys.path.insert(0, HERE)
    try:
        from torch_compare import child_env  # noqa: PLC0415  (the GPU check's scripts folder)
    finally:
        sys.path.pop(0)
    env = child_env(dict(os.environ), mode == "cuma")
    argv = [sys.executable, os.path.abspath(__file__), "--child", mode]
    for k in ("layers", "width", "tokens", "steps", "seed", "device"):
        argv += ["--" + k, str(getattr(a, k))]
    if mode == "native" and a.snapshot_out:
        argv += ["--snapshot-out", os.path.abspath(a.snapshot_out)]
    if mode == "cuma" and a.cuma_conf is not None:
        argv += ["--cuma-conf", a.cuma_conf]
    print("== %s run" % mode, flush=True)
    try:
        p = subprocess.run(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, universal_newlines=True,
                           timeout=a.child_timeout)
    except subprocess.TimeoutExpired:
        return None, "the %s run timed out after %.0f s" % (mode, a.child_timeout)
    sys.stdout.write(p.stderr[-4000:])
    for line in p.stdout.splitlines():
        if line.startswith("RESULT_JSON "):
            res = json.loads(line[len("RESULT_JSON "):])
            if p.returncode != 0:
                res["exit_warning"] = "exit %d after printing its result" % p.returncode
            return res, None
    return None, "the %s run failed (exit %d)" % (mode, p.returncode)


def agree(x, y, tol):
    return abs(x - y) <= tol * max(1.0, abs(x), abs(y))


def main(argv=None):
    a = parse_args(argv)
    if a.child:
        print("RESULT_JSON " + json.dumps(child(a)), flush=True)
        return 0
    try:
        import torch
    except Exception as e:  # noqa: BLE001 - any import failure means no PyTorch here
        print("MULTISTREAM RESULT: SKIP (PyTorch cannot be imported: %s)" % e)
        return 3
    if a.device == "cuda" and not torch.cuda.is_available():
        print("MULTISTREAM RESULT: SKIP (torch %s: torch.cuda.is_available() is False)" % torch.__version__)
        return 3
    runs, errors = {}, []
    for mode in ("native", "cuma"):
        res, err = run_child(a, mode)
        if err:
            errors.append(err)
            print("  " + err)
        else:
            runs[mode] = res
            print("  %s: %.2f s, checksum %.6g%s" % (mode, res["wall_s"], res["checksum"],
                                                   ", peak reserved %.2f GiB" % (res["peak_reserved"] / 2**30)
                                                   if "peak_reserved" in res else ""))
    nat, cum = runs.get("native"), runs.get("cuma")
    if nat is None or cum is None:
        print("MULTISTREAM RESULT: FAIL (%s)" % "; ".join(errors))
        return 1
    snap = nat.get("snapshot")
    if snap:
        print("  memory snapshot of the native run: %s, %.2f MiB gzip'd (%.2f MiB raw)" % (
            snap["path"], snap["bytes"] / 2**20, snap["raw_bytes"] / 2**20))
    elif a.snapshot_out:
        print("  memory snapshot of the native run: none (%s)" % (
            "no CUDA here" if a.device == "cpu" else "not written"))
    bad = [i for i, (x, y) in enumerate(zip(nat["checksums"], cum["checksums"])) if not agree(x, y, a.rel_tol)]
    host_ok = agree(nat["offloaded_checksum"], cum["offloaded_checksum"], a.rel_tol)
    warn = [r["exit_warning"] for r in (nat, cum) if r.get("exit_warning")]
    what = "%d steps x %d layers of %dx%d, weights prefetched on a side stream, activations offloaded on a third" % (
        a.steps, a.layers, a.width, a.width)
    if bad or not host_ok or warn or cum.get("failed_allocs"):
        print("MULTISTREAM RESULT: FAIL (%s: checksums differ at steps %s%s%s%s)" % (
            what, bad[:5], "" if host_ok else ", offloaded activations differ",
            "; " + "; ".join(warn) if warn else "",
            "; cuma failed %s allocations" % cum["failed_allocs"] if cum.get("failed_allocs") else ""))
        return 1
    ratio = ""
    if cum.get("peak_reserved") and nat.get("peak_reserved"):
        ratio = ", peak reserved cuma/native %.3f" % (cum["peak_reserved"] / nat["peak_reserved"])
    print("MULTISTREAM RESULT: PASS (%s: the values agree under both allocators%s%s)" % (
        what, ratio, "; dry run on the CPU" if a.device == "cpu" else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
