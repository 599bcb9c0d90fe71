#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""cuma.adaptive.MemoryGuard on a transformer training loop: peak reserved memory and step time
at a few watermarks, each mode (offload, recompute), under cuma.

One process, cuma.torch.enable() first. A stack of nn.TransformerEncoderLayer blocks (each one
guarded) trains on random tokens of one shape. First a plain run (no guard) measures the peak;
then, for each mode and watermark (the peaks counted after --warmup steps, in which the guard
measures the blocks), the guard's free memory is a budget (``--budget-share`` of
the plain run's activations: free = the plain peak's non-activation part + share * activations
+ watermark), so the guard must keep (1 - share) of the activations off the device; the run
reports peak reserved, median step time, guarded blocks and offloaded or recomputed blocks, and
checks that the loss equals the plain run's (the same data and seed: bit for bit with offload,
the same RNG stream with recompute).

Prints one line per run and ``GUARD RESULT: PASS|FAIL ...`` (exit 0 or 1). PASS: every guarded
run's loss equals the plain one's, and with a share below 1 the guarded runs' peak reserved is
below the plain run's. ``--device cpu`` is a dry run (no memory figures; the losses still
compared) for the tests.

    PYTHONPATH=python CUMA_LIBRARY=build-gpu/lib/libcuma.so python3 scripts/gpu/memory_guard_check.py
"""

import argparse
import statistics
import sys
import time


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--length", type=int, default=512)
    p.add_argument("--d-model", type=int, default=1024)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--budget-share", type=float, default=0.5,
                   help="share of the plain run's activations the guard may keep on the device")
    p.add_argument("--watermarks-mib", default="0,512",
                   help="comma-separated watermarks (MiB) to run at")
    p.add_argument("--cuma-conf", default=None)
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    return p.parse_args(argv)


def main(argv=None):
    a = parse_args(argv)
    import torch

    on_gpu = a.device == "cuda"
    if on_gpu and not torch.cuda.is_available():
        print("GUARD RESULT: SKIP torch.cuda.is_available() is False")
        return 3
    import cuma
    from cuma.adaptive import MemoryGuard

    if on_gpu:
        cuma.torch.enable(a.cuma_conf)
    nn = torch.nn
    dev = torch.device(a.device)

    def make():
        torch.manual_seed(0)
        blocks = [nn.TransformerEncoderLayer(a.d_model, a.heads, 4 * a.d_model, dropout=0.1,
                                             batch_first=True, norm_first=True) for _ in range(a.layers)]
        return nn.Sequential(*blocks).to(dev)

    def stats():
        if not on_gpu:
            return 0, 0
        s = cuma.torch.memory_stats()
        return s["reserved_bytes.all.peak"], s["allocated_bytes.all.peak"]

    def loop(model, guard=None, budget=None):
        torch.manual_seed(1)
        opt = torch.optim.SGD(model.parameters(), lr=1e-3)
        x = torch.randn(a.batch, a.length, a.d_model, device=dev)
        times, losses = [], []
        for i in range(a.steps):
            if on_gpu and i == a.warmup:
                # The peaks from here: the guard measures the blocks in its first steps.
                torch.cuda.synchronize()
                cuma.torch.empty_cache()
                cuma.heap.default_heap().reset_peaks()
            t0 = time.perf_counter()
            if guard:
                guard.update()
            opt.zero_grad(set_to_none=True)
            loss = model(x).float().pow(2).mean()
            loss.backward()
            opt.step()
            if on_gpu:
                torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
            losses.append(float(loss))
        timed = times[a.warmup:] or times
        peak_reserved, peak_allocated = stats()
        return {"median_ms": statistics.median(timed) * 1e3, "losses": losses,
                "peak_reserved": peak_reserved, "peak_allocated": peak_allocated}

    plain_model = make()
    base = loop(plain_model)
    # The activations the plain run kept: measured by a guard that never guards.
    probe = MemoryGuard(list(plain_model), watermark=0, free_memory=lambda: 1 << 62)
    loop(plain_model, probe)
    acts = sum(b["saved_bytes"] or 0 for b in probe.stats()["blocks"])
    probe.close()
    print("plain: peak reserved %.1f MiB, allocated %.1f MiB, activations %.1f MiB, %.1f ms/step" % (
        base["peak_reserved"] / 2**20, base["peak_allocated"] / 2**20, acts / 2**20, base["median_ms"]))
    ok = True
    notes = []
    for mode in ("offload", "recompute"):
        for wm in (int(w) << 20 for w in a.watermarks_mib.split(",")):
            model = make()
            # Free memory between steps as if the device had room for budget_share of the
            # activations beyond the watermark: the guard must keep the rest off.
            guard = MemoryGuard(list(model), watermark=wm, mode=mode,
                                free_memory=lambda wm=wm: wm + int(a.budget_share * acts))
            r = loop(model, guard)
            st = guard.stats()
            guard.close()
            same = r["losses"] == base["losses"]
            lower = not on_gpu or a.budget_share >= 1 or r["peak_reserved"] < base["peak_reserved"]
            print("%s, watermark %d MiB: peak reserved %.1f MiB (%.2fx plain), %.1f ms/step (%.2fx), "
                  "%d of %d blocks guarded, offloaded %.1f MiB, recomputed %d blocks, loss %s" % (
                      mode, wm >> 20, r["peak_reserved"] / 2**20,
                      r["peak_reserved"] / max(1, base["peak_reserved"]), r["median_ms"],
                      r["median_ms"] / base["median_ms"], st["guarded_blocks"], a.layers,
                      st["offloaded_bytes"] / 2**20, st["recomputed_blocks"],
                      "same" if same else "DIFFERENT"))
            if not same:
                ok = False
                notes.append("%s@%dMiB: loss differs" % (mode, wm >> 20))
            if not lower:
                ok = False
                notes.append("%s@%dMiB: peak not lower" % (mode, wm >> 20))
    print("GUARD RESULT: %s%s%s" % ("PASS" if ok else "FAIL", " (dry run)" if not on_gpu else "",
                                     ": " + "; ".join(notes) if notes else ""))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
