#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""PyTorch's native CUDA allocator against cuma, on one variable-length training loop.

The parent runs the same loop three times, each in a fresh process (an allocator can only be
chosen before the first CUDA tensor): with PyTorch's native caching allocator at its defaults,
with PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True (the strongest peer), and after
cuma.torch.enable(). The loop trains a small causal nn.TransformerEncoder language model
under bf16 autocast with AdamW; every step draws a sequence length (and a batch size that
keeps the tokens per step roughly fixed) from a fixed seed, so both runs see the same shapes
and data. Each child prints one RESULT_JSON line: peak reserved and allocated bytes (native:
torch.cuda.max_memory_reserved / max_memory_allocated; cuma: memory_stats()'s
reserved_bytes.all.peak / allocated_bytes.all.peak), the largest device memory in use seen
after a step (cudaMemGetInfo, the same yardstick for both), the median and p99 step times, the
loss; under cuma, the driver calls of its physical layer per step and their time.

The parent prints one table (allocator, peak reserved, peak allocated, median and p99 step
time), the figures side by side with the ratios, and judges (defaults):
  step time:      cuma's median step time <= 1.03 x native's
  peak reserved:  cuma's peak reserved <= 0.85 x native's (at least 15% lower), and at most
                  expandable_segments' (when that run ran: --no-expandable leaves it out)
  sanity:         the runs finished, cuma's loss is finite and within 2% of native's
Exit status: 0 PASS, 1 FAIL, 3 SKIP (no PyTorch with CUDA), 2 usage error.

    PYTHONPATH=python CUMA_LIBRARY=build-gpu/lib/libcuma.so python3 scripts/gpu/torch_compare.py

Options: --steps, --warmup, --tokens, --min-len/--max-len, --d-model, --layers, --heads,
--vocab, --seed, --cuma-conf (CUMA_CONF for the cuma run; default: none, i.e. backend:auto),
--json-out FILE, --child-timeout SECONDS, --total-timeout SECONDS (the judged runs first, each
keeping time for the others; the reported-only runs get what is left), --only native|cuma,
--no-expandable (no expandable_segments run), --cuma-alt-conf CONF (a
further cuma run with these settings, reported only: remap_threshold:0.25, the fewest page
moves cuma makes (about 19% more peak memory on torch_trace.py's trace of this loop, a tenth of
the maps), tells whether page calls are what a slower step time pays for), --trace-out FILE
(a last cuma run of --trace-steps steps, 120 by default, with the `trace` setting: the training
loop's allocation trace on this machine, for `cuma replay` anywhere; reported only),
--snapshot-out FILE (a native run of --snapshot-steps steps, 60 by default, under
torch.cuda.memory._record_memory_history(): its _dump_snapshot(), gzip'd, for the replay tests;
reported only).
"""

import argparse
import json
import math
import os
import random
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))


def add_loop_args(p):
    """The model and the step plan: shared with torch_trace.py, which records this loop."""
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--tokens", type=int, default=16384, help="tokens per step (batch = tokens // length)")
    p.add_argument("--min-len", type=int, default=32)
    p.add_argument("--max-len", type=int, default=1024)
    p.add_argument("--d-model", type=int, default=1024)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--seed", type=int, default=0)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_loop_args(p)
    p.add_argument("--warmup", type=int, default=20, help="steps left out of the step-time median")
    p.add_argument("--cuma-conf", default=None, help="settings for cuma.torch.enable() (CUMA_CONF)")
    p.add_argument("--cuma-alt-conf", default=None,
                   help="a further cuma run with these settings (reported, not judged)")
    p.add_argument("--trace-out", default=None,
                   help="a last cuma run that logs its allocations to this file (RMM CSV, .gz)")
    p.add_argument("--trace-steps", type=int, default=120, help="steps of the --trace-out run")
    p.add_argument("--snapshot-out", default=None,
                   help="a native run recording PyTorch's memory history; its snapshot, gzip'd, here")
    p.add_argument("--snapshot-steps", type=int, default=60, help="steps of the --snapshot-out run")
    p.add_argument("--time-ratio-max", type=float, default=1.03)
    p.add_argument("--reserved-ratio-max", type=float, default=0.85)
    p.add_argument("--loss-rel-tol", type=float, default=0.02)
    p.add_argument("--json-out", default=None)
    p.add_argument("--child-timeout", type=float, default=150.0, help="the most one run may take")
    p.add_argument("--total-timeout", type=float, default=None,
                   help="the most all runs may take together: the native and cuma runs come first and "
                        "each keeps time for the other; the runs reported only get what is left, or are "
                        "left out")
    p.add_argument("--only", choices=("native", "cuma"), default=None, help="run one child in this process's stead")
    p.add_argument("--no-expandable", dest="expandable", action="store_false",
                   help="leave out the native run with expandable_segments:True (judged when it runs)")
    p.add_argument("--child", choices=("native", "cuma", "cuma_alt", "cuma_trace", "expandable", "snapshot"),
                   default=None, help=argparse.SUPPRESS)
    # A dry run of the loop and the report on the CPU (tests of this script; figures meaningless,
    # cuma is not enabled there because it needs CUDA).
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help=argparse.SUPPRESS)
    return p.parse_args(argv)


# ---- the child: one training run --------------------------------------------------------------


def plan(a):
    """(batch, length) for every step, the same in every process."""
    rng = random.Random(a.seed)
    out = []
    for _ in range(a.steps):
        n = rng.randint(a.min_len, a.max_len)
        out.append((max(1, a.tokens // n), n))
    return out


def child(a):
    import contextlib
    import inspect

    import torch

    on_gpu = a.device == "cuda"
    if on_gpu and not torch.cuda.is_available():
        raise SystemExit("torch.cuda.is_available() is False")
    backend = "pytorch native"
    if a.child in ("cuma", "cuma_alt", "cuma_trace"):
        import cuma

        if on_gpu:
            cuma.torch.enable(a.cuma_conf)  # before the first CUDA tensor
        else:  # the dry run's default heap is the simulated device, asked for (no driver here)
            conf = os.environ.get("CUMA_CONF")
            os.environ["CUMA_CONF"] = "backend:sim" + ("," + conf if conf else "")
        backend = "cuma (%s)" % cuma.torch.memory_stats().get("cuma.backend")
    elif a.child == "expandable":
        backend = "pytorch native, expandable_segments:True"
    elif a.child == "snapshot":
        backend = "pytorch native, memory history recorded"
    import torch.nn as nn
    import torch.nn.functional as F

    dev = torch.device(a.device)
    torch.manual_seed(a.seed)
    if on_gpu:
        torch.cuda.manual_seed(a.seed)
    causal_kw = "is_causal" in inspect.signature(nn.TransformerEncoder.forward).parameters
    if "device" in inspect.signature(nn.Transformer.generate_square_subsequent_mask).parameters:
        def causal_mask(n, device):
            return nn.Transformer.generate_square_subsequent_mask(n, device=device)
    else:  # PyTorch 1.x builds it on the CPU
        def causal_mask(n, device):
            return nn.Transformer.generate_square_subsequent_mask(n).to(device)

    class LM(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(a.vocab, a.d_model)
            layer = nn.TransformerEncoderLayer(a.d_model, a.heads, 4 * a.d_model, dropout=0.1,
                                               batch_first=True, norm_first=True)
            self.enc = nn.TransformerEncoder(layer, a.layers, enable_nested_tensor=False)
            self.head = nn.Linear(a.d_model, a.vocab)

        def forward(self, x):
            n = x.shape[1]
            mask = causal_mask(n, x.device)
            h = self.emb(x)
            # PyTorch 2.x takes the hint and runs flash attention without the mask tensor.
            h = self.enc(h, mask=mask, is_causal=True) if causal_kw else self.enc(h, mask=mask)
            return self.head(h)

    # What the device holds before the model: the context and libraries. Device use beyond
    # it that the allocator does not count went around the allocator (the report compares).
    used_at_start = 0
    allocator_backend = None
    if on_gpu:
        torch.cuda.init()
        free, total = torch.cuda.mem_get_info()
        used_at_start = total - free
        get_backend = getattr(torch.cuda, "get_allocator_backend", None)
        allocator_backend = get_backend() if get_backend else None
    if a.child == "snapshot" and on_gpu:
        start_history(torch)
    model = LM().to(dev)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4)
    gen = torch.Generator(device=dev)
    gen.manual_seed(a.seed + 1)
    sync = torch.cuda.synchronize if on_gpu else (lambda: None)
    autocast = (lambda: torch.autocast("cuda", dtype=torch.bfloat16)) if on_gpu else contextlib.nullcontext
    steps = plan(a)
    times, losses = [], []
    peak_used = 0
    t_start = time.perf_counter()
    for i, (b, n) in enumerate(steps):
        sync()
        t0 = time.perf_counter()
        x = torch.randint(0, a.vocab, (b, n + 1), device=dev, generator=gen)
        with autocast():
            logits = model(x[:, :-1])
        loss = F.cross_entropy(logits.float().reshape(-1, a.vocab), x[:, 1:].reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        lv = loss.detach()
        sync()
        times.append(time.perf_counter() - t0)
        losses.append(float(lv))
        if on_gpu:
            free, total = torch.cuda.mem_get_info()
            peak_used = max(peak_used, total - free)
        if i % 50 == 0 or i == len(steps) - 1:
            print("  [%s] step %d/%d: batch %d x %d, %.1f ms, loss %.4f" % (
                a.child, i + 1, len(steps), b, n, times[-1] * 1e3, losses[-1]), file=sys.stderr, flush=True)
    wall = time.perf_counter() - t_start
    if a.child in ("cuma", "cuma_alt", "cuma_trace"):
        import cuma

        s = cuma.torch.memory_stats()
        peak_reserved = s["reserved_bytes.all.peak"]
        peak_allocated = s["allocated_bytes.all.peak"]
        peak_requested = s.get("requested_bytes.all.peak")
        extra = {k: s.get("cuma." + k) for k in ("page_creates", "page_releases", "maps", "unmaps", "map_runs",
                                                   "unmap_runs",
                                                   "early_remaps", "remap_waits", "events_recorded",
                                                   "event_queries", "page_call_ns", "remap_keep",
                                                   "failed_allocs", "fragmentation",
                                                   "policy", "page_alias")}
        extra["num_alloc_retries"] = s.get("num_alloc_retries")  # PyTorch's name, as below
        # Driver calls per training step: what the step time pays for cuma's memory.
        for k in ("page_creates", "page_releases", "maps", "unmaps", "map_runs", "unmap_runs", "remap_waits",
                  "event_queries", "page_call_ns"):
            if isinstance(extra.get(k), (int, float)):
                extra[k + "_per_step"] = round(extra[k] / max(1, a.steps), 1)
    elif on_gpu:
        if a.child == "snapshot":
            extra_snapshot = write_snapshot(torch, a.snapshot_out)
        peak_reserved = torch.cuda.max_memory_reserved()
        peak_allocated = torch.cuda.max_memory_allocated()
        ms = torch.cuda.memory_stats()
        peak_requested = ms.get("requested_bytes.all.peak")
        extra = {k: ms.get(k) for k in ("num_alloc_retries", "num_device_alloc", "num_device_free", "num_ooms")}
        if a.child == "snapshot":
            extra["snapshot"] = extra_snapshot
    else:  # a dry run on the CPU: no device memory to speak of
        peak_reserved = peak_allocated = peak_requested = 0
        extra = {}
        if a.child == "snapshot":
            extra["snapshot"] = {"skipped": "no CUDA here: the dry run records no memory history"}
    timed = times[a.warmup:] if len(times) > a.warmup else times
    return {
        "mode": a.child,
        "backend": backend,
        "torch": torch.__version__,
        "device": torch.cuda.get_device_name(0) if on_gpu else "cpu (dry run)",
        "steps": len(times),
        "median_step_ms": statistics.median(timed) * 1e3,
        "p99_step_ms": percentile(timed, 0.99) * 1e3,
        "mean_step_ms": statistics.fmean(timed) * 1e3,
        "wall_s": wall,
        "peak_reserved": peak_reserved,
        "peak_allocated": peak_allocated,
        "peak_requested": peak_requested,
        "peak_device_used_sampled": peak_used,
        "device_used_at_start": used_at_start,
        "allocator_backend": allocator_backend,
        "loss_last20": statistics.fmean(losses[-20:]),
        "loss_first": losses[0],
        "extra": extra,
    }


def percentile(xs, q):
    """The nearest-rank q-quantile of xs (the p99 of 280 steps is the third slowest)."""
    ys = sorted(xs)
    return ys[min(len(ys) - 1, max(0, math.ceil(q * len(ys)) - 1))]


# The snapshot run's memory history: Python stacks only (C++ frames are symbolised at the dump,
# which can take minutes), and a bound on the entries so the file stays well under the 16 MiB a
# file the device tool brings back.
SNAPSHOT_MAX_ENTRIES = 200000


def start_history(torch):
    rec = torch.cuda.memory._record_memory_history
    try:
        rec(enabled="all", context="all", stacks="python", max_entries=SNAPSHOT_MAX_ENTRIES)
    except TypeError:  # PyTorch before 2.1 takes a flag and its own keywords
        rec(True, trace_alloc_max_entries=SNAPSHOT_MAX_ENTRIES)


def write_snapshot(torch, out):
    """torch.cuda.memory._dump_snapshot() of the run so far, gzip'd into out; what was written."""
    import gzip
    import shutil

    raw = out + ".pickle.tmp"
    t0 = time.perf_counter()
    torch.cuda.memory._dump_snapshot(raw)
    try:
        torch.cuda.memory._record_memory_history(enabled=None)
    except TypeError:
        torch.cuda.memory._record_memory_history(False)
    with open(raw, "rb") as src, gzip.open(out, "wb", compresslevel=6) as dst:
        shutil.copyfileobj(src, dst)
    raw_bytes = os.path.getsize(raw)
    os.unlink(raw)
    return {"path": out, "bytes": os.path.getsize(out), "raw_bytes": raw_bytes,
            "dump_s": round(time.perf_counter() - t0, 2)}


# ---- the parent: the runs, side by side -------------------------------------------------------


def child_argv(a, mode):
    argv = [sys.executable, os.path.abspath(__file__), "--child", mode]
    for k in ("steps", "warmup", "tokens", "min_len", "max_len", "d_model", "layers", "heads", "vocab", "seed",
              "device"):
        argv += ["--" + k.replace("_", "-"), str(getattr(a, k))]
    conf = a.cuma_alt_conf if mode == "cuma_alt" else a.cuma_conf
    if mode == "snapshot":
        argv += ["--snapshot-out", os.path.abspath(a.snapshot_out)]
        argv[argv.index("--steps") + 1] = str(a.snapshot_steps)
        conf = None
    if mode == "cuma_trace":
        conf = ((conf + ",") if conf else "") + "trace:" + os.path.abspath(a.trace_out)
        argv[argv.index("--steps") + 1] = str(a.trace_steps)
    if conf is not None:
        argv += ["--cuma-conf", conf]
    return argv


def child_env(env, cuma):
    """A child's environment (changed in place): PyTorch's allocator at its defaults, whatever
    this machine's environment says (newer PyTorch reads PYTORCH_ALLOC_CONF first, older
    PYTORCH_CUDA_ALLOC_CONF); for a cuma child the package and the build's libcuma, else no
    CUMA_CONF. Shared with torch_multistream.py."""
    env["PYTHONUNBUFFERED"] = "1"
    for k in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF", "PYTORCH_NO_CUDA_MEMORY_CACHING"):
        env.pop(k, None)
    if cuma:
        py = os.path.join(REPO, "python")
        env["PYTHONPATH"] = py + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
        env.setdefault("CUMA_LIBRARY", os.path.join(REPO, "build-gpu", "lib", "libcuma.so"))
        env.pop("CUMA_CUDA_LIBRARY", None)
    else:
        env.pop("CUMA_CONF", None)
    return env


def run_child(a, mode, timeout):
    env = dict(os.environ)
    child_env(env, mode.startswith("cuma"))
    if mode == "expandable":
        env["PYTORCH_CUDA_ALLOC_CONF"] = env["PYTORCH_ALLOC_CONF"] = "expandable_segments:True"
    print("== %s run (%s)" % (mode, "CUMA_LIBRARY=" + env["CUMA_LIBRARY"] if mode.startswith("cuma") else "no cuma"),
          flush=True)
    t0 = time.time()
    try:
        p = subprocess.run(child_argv(a, mode), env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                           text=True, timeout=timeout)
    except subprocess.TimeoutExpired as e:
        err = e.stderr if isinstance(e.stderr, str) else (e.stderr or b"").decode(errors="replace")
        sys.stdout.write(err[-3000:])
        return None, "the %s run timed out after %.0f s" % (mode, timeout)
    sys.stdout.write(p.stderr[-6000:])
    res = None
    for line in p.stdout.splitlines():
        if line.startswith("RESULT_JSON "):
            res = json.loads(line[len("RESULT_JSON "):])
    if res is None:
        return None, "the %s run failed (exit %d after %.0f s)" % (mode, p.returncode, time.time() - t0)
    if p.returncode != 0:
        # The loop finished and its figures are whole: a crash on the way out (a library's
        # teardown) is reported beside them, not in their stead.
        res["exit_warning"] = "exit %d after printing its result" % p.returncode
        print("  WARNING: the %s run %s" % (mode, res["exit_warning"]), flush=True)
    print("  %s: peak reserved %s, peak allocated %s, median step %.2f ms (%s, %.0f s)" % (
        mode, gib(res["peak_reserved"]), gib(res["peak_allocated"]), res["median_step_ms"], res["backend"],
        time.time() - t0), flush=True)
    return res, None


def gib(n):
    return "%.2f GiB" % (n / 2**30) if isinstance(n, (int, float)) else "-"


def report(a, runs, errors):
    nat, cum = runs.get("native"), runs.get("cuma")
    print()
    print("== side by side (%d steps, %d tokens/step, lengths %d..%d, d_model %d, %d layers; median "
          "step time over steps %d..%d)" % (a.steps, a.tokens, a.min_len, a.max_len, a.d_model, a.layers,
                                           a.warmup + 1, a.steps))
    cols = [m for m in ("native", "expandable", "cuma", "cuma_alt") if m in runs]
    rows = [
        ("backend", lambda r: r["backend"]),
        ("peak reserved", lambda r: gib(r["peak_reserved"])),
        ("peak allocated", lambda r: gib(r["peak_allocated"])),
        ("peak requested", lambda r: gib(r["peak_requested"])),
        ("device used, max after a step", lambda r: gib(r["peak_device_used_sampled"])),
        ("reserved / allocated at peak", lambda r: "%.3f" % (r["peak_reserved"] / max(1, r["peak_allocated"]))),
        ("median step time", lambda r: "%.2f ms" % r["median_step_ms"]),
        ("p99 step time", lambda r: "%.2f ms" % r["p99_step_ms"]),
        ("mean step time", lambda r: "%.2f ms" % r["mean_step_ms"]),
        ("loss, mean of last 20 steps", lambda r: "%.4f" % r["loss_last20"]),
        ("run wall time", lambda r: "%.1f s" % r["wall_s"]),
    ]
    w = 34
    print("  %-*s" % (w, "") + "".join("%-28s" % c for c in cols))
    for name, f in rows:
        print("  %-*s" % (w, name) + "".join("%-28s" % str(f(runs[c]))[:27] for c in cols))
    for c in cols:
        print("  %s extra: %s" % (c, json.dumps(runs[c]["extra"])))
    print_table(runs)
    if cum:
        print_driver_calls(cum)
    sn = runs.get("snapshot")
    if sn:
        info = sn["extra"].get("snapshot") or {}
        if info.get("path"):
            print("  memory snapshot of the native run: %s, %d steps, %.1f MiB gzip'd (%.1f MiB raw, dumped in "
                  "%.1f s)" % (info["path"], sn["steps"], info["bytes"] / 2**20, info["raw_bytes"] / 2**20,
                               info["dump_s"]))
        else:
            print("  memory snapshot of the native run: none (%s)" % info.get("skipped", "not written"))
    tr = runs.get("cuma_trace")
    if tr and a.trace_out:
        size = os.path.getsize(a.trace_out) if os.path.exists(a.trace_out) else 0
        print("  allocation trace: %s, %d steps, %.1f MiB (replay: build/bin/cuma replay --json %s)" % (
            a.trace_out, tr["steps"], size / 2**20, os.path.basename(a.trace_out)))

    verdict = {"pass": False, "errors": errors}
    exp = runs.get("expandable")
    if nat is None or cum is None or (a.expandable and exp is None):
        print("TORCH RESULT: FAIL (%s)" % "; ".join(errors or ["a run is missing"]))
        return verdict
    t_ratio = cum["median_step_ms"] / nat["median_step_ms"]
    r_ratio = cum["peak_reserved"] / max(1, nat["peak_reserved"])
    u_ratio = cum["peak_device_used_sampled"] / max(1, nat["peak_device_used_sampled"])
    loss_rel = abs(cum["loss_last20"] - nat["loss_last20"]) / max(1e-9, abs(nat["loss_last20"]))
    # Device memory the allocator did not count: the context and libraries (the same in both
    # runs) plus anything allocated around the allocator. If cuma's run has much more of it,
    # some of PyTorch's allocations did not go through cuma, and its peak reserved flatters it.
    # (Device use is sampled after steps, the peak reserved is exact: a heap that gives memory
    # back between steps shows less "outside" than it has; the figure is reported only.)
    def outside(r):
        return r["peak_device_used_sampled"] - r["device_used_at_start"] - r["peak_reserved"]
    bypass = outside(cum) - outside(nat)
    swapped = cum.get("allocator_backend")
    checks = [
        ("PyTorch's allocator in the cuma run is the pluggable one (get_allocator_backend: %s)" % swapped,
         swapped in (None, "pluggable")),
        ("step time cuma/native = %.4f (goal <= %.2f)" % (t_ratio, a.time_ratio_max), t_ratio <= a.time_ratio_max),
        ("peak reserved cuma/native = %.4f, %.1f%% lower (goal <= %.2f)" % (
            r_ratio, 100 * (1 - r_ratio), a.reserved_ratio_max), r_ratio <= a.reserved_ratio_max),
    ]
    if exp:
        e_ratio = cum["peak_reserved"] / max(1, exp["peak_reserved"])
        checks.append(("peak reserved cuma/expandable_segments = %.4f (goal <= 1)" % e_ratio, e_ratio <= 1.0))
    judged = ("native", "expandable", "cuma") if exp else ("native", "cuma")
    checks += [
        ("the judged runs exited cleanly after their results (%s)" % "; ".join(
            "%s: %s" % (m, runs[m].get("exit_warning") or "exit 0") for m in judged),
         not any(runs[m].get("exit_warning") for m in judged)),
        ("loss agrees: cuma %.4f, native %.4f, rel diff %.4f (tolerance %.2f)" % (
            cum["loss_last20"], nat["loss_last20"], loss_rel, a.loss_rel_tol),
         math.isfinite(cum["loss_last20"]) and loss_rel <= a.loss_rel_tol),
    ]
    print("  device used (sampled) cuma/native = %.4f (reported only)" % u_ratio)
    print("  device memory outside the allocator's count, beyond the start: native %s, cuma %s%s" % (
        gib(outside(nat)), gib(outside(cum)),
        "  WARNING: %s more under cuma: allocations may have gone around it" % gib(bypass)
        if bypass > 2**29 else ""))
    alt = runs.get("cuma_alt")
    if alt:
        print("  cuma_alt (%s, reported only): step time x%.4f, peak reserved x%.4f of native" % (
            a.cuma_alt_conf, alt["median_step_ms"] / nat["median_step_ms"],
            alt["peak_reserved"] / max(1, nat["peak_reserved"])))
    for text, ok in checks:
        print("  %s  %s" % ("PASS" if ok else "FAIL", text))
    ok = all(c[1] for c in checks)
    if a.device == "cpu":
        print("TORCH RESULT: DRY RUN (CPU; the checks above mean nothing)")
        verdict.update({"pass": True, "dry_run": True})
        return verdict
    if exp:
        verdict["reserved_ratio_vs_expandable"] = cum["peak_reserved"] / max(1, exp["peak_reserved"])
    verdict.update({"pass": ok, "time_ratio": t_ratio, "reserved_ratio": r_ratio, "device_used_ratio": u_ratio,
                    "outside_allocator_bytes": {"native": outside(nat), "cuma": outside(cum)},
                    "loss_rel_diff": loss_rel, "checks": [{"check": t, "pass": o} for t, o in checks]})
    print("TORCH RESULT: %s (step time x%.3f, peak reserved x%.3f)" % ("PASS" if ok else "FAIL", t_ratio, r_ratio))
    return verdict


TABLE_NAMES = (("native", "PyTorch native (defaults)"),
               ("expandable", "PyTorch native, `expandable_segments:True`"),
               ("cuma", "cuma (`cuma.torch.enable()`)"))


def print_table(runs):
    """The README's table: one row per judged allocator that ran."""
    print()
    print("| allocator | peak reserved | peak allocated | median step time | p99 step time |")
    print("|---|---|---|---|---|")
    for mode, name in TABLE_NAMES:
        r = runs.get(mode)
        if r:
            print("| %s | %s | %s | %.2f ms | %.2f ms |" % (name, gib(r["peak_reserved"]), gib(r["peak_allocated"]),
                                                       r["median_step_ms"], r["p99_step_ms"]))
    print()


def print_driver_calls(r):
    """cuma's physical-layer driver calls per training step, from its counters: cuMemCreate per
    page created, cuMemRelease per page released, cuMemMap per page mapped, cuMemSetAccess per run
    of pages mapped and cuMemUnmap per run unmapped (one call a page where the driver takes no
    runs: the vmm backend's probe), and the time spent in them."""
    e = r["extra"]
    per = {k: e.get(k + "_per_step") for k in ("page_creates", "page_releases", "maps", "map_runs", "unmap_runs",
                                               "page_call_ns")}
    if per["maps"] is None:
        print("  cuma driver calls per step: not in the stats (%s)" % r["backend"])
        return
    print("  cuma driver calls per step (%d steps): cuMemCreate %s, cuMemRelease %s, cuMemMap %s, "
          "cuMemSetAccess %s, cuMemUnmap %s; %.3f ms a step in them" % (
              r["steps"], per["page_creates"], per["page_releases"], per["maps"], per["map_runs"],
              per["unmap_runs"], (per["page_call_ns"] or 0) / 1e6))


def main(argv=None):
    a = parse_args(argv)
    if a.child:
        res = child(a)
        print("RESULT_JSON " + json.dumps(res), flush=True)
        return 0
    try:
        import torch
    except Exception as e:  # noqa: BLE001 - any import failure means no PyTorch here
        print("TORCH RESULT: SKIP (PyTorch cannot be imported: %s)" % e)
        return 3
    if a.device == "cpu":
        print("DRY RUN on the CPU: the loop and the report only; the figures mean nothing")
    elif not torch.cuda.is_available():
        print("TORCH RESULT: SKIP (torch %s: torch.cuda.is_available() is False; torch.version.cuda = %s)" % (
            torch.__version__, torch.version.cuda))
        return 3
    # The parent asks nothing else of the device: it must hold no memory beside the children.
    print("torch %s (CUDA %s), %s" % (torch.__version__, torch.version.cuda, sys.executable))
    # The judged runs first, then those reported only, with what time is left.
    required = [a.only] if a.only else (["native"] + (["expandable"] if a.expandable else []) + ["cuma"])
    optional = [] if a.only else ((["snapshot"] if a.snapshot_out else []) +
                                  (["cuma_alt"] if a.cuma_alt_conf else []) +
                                  (["cuma_trace"] if a.trace_out else []))
    t_end = time.time() + a.total_timeout if a.total_timeout else None
    runs, errors = {}, []
    for i, m in enumerate(required + optional):
        timeout = a.child_timeout
        if t_end is not None:
            left = t_end - time.time()
            if i < len(required):  # keep an equal share for each judged run still to come
                timeout = min(timeout, left / (len(required) - i))
            elif left < 30:
                print("  the %s run is left out: %.0f s of the total time are left" % (m, left))
                continue
            else:
                timeout = min(timeout, left - 5)
        res, err = run_child(a, m, timeout)
        if err:
            print("  " + err)
            errors.append(err)
        else:
            runs[m] = res
    if a.only:
        print(json.dumps(runs.get(a.only), indent=1))
        return 0 if runs else 1
    verdict = report(a, runs, errors)
    if a.json_out:
        with open(a.json_out, "w", encoding="utf-8") as f:
            json.dump({"runs": runs, "verdict": verdict, "args": vars(a)}, f, indent=1)
    return 0 if verdict["pass"] else 1


if __name__ == "__main__":
    sys.exit(main())
