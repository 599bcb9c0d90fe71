# SPDX-License-Identifier: Apache-2.0
"""The GPU check's PyTorch scripts, run where they can run without a GPU: torch_trace.py (the
allocation trace of torch_compare.py's training loop on the meta device) and torch_compare.py's
CPU dry run. Tiny models, a few steps: they test the scripts, not the figures."""

import csv
import gzip
import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("torch")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPTS = os.path.join(ROOT, "scripts", "gpu")
TINY = ["--steps", "3", "--d-model", "64", "--layers", "1", "--heads", "2", "--vocab", "128",
        "--tokens", "256", "--max-len", "64"]


def cuma_cli():
    """build/bin/cuma next to the libcuma.so the tests load (scripts/pytest.sh sets it)."""
    lib = os.environ.get("CUMA_LIBRARY")
    if not lib:
        pytest.skip("CUMA_LIBRARY is not set (run through scripts/pytest.sh)")
    cli = os.path.join(os.path.dirname(os.path.dirname(lib)), "bin", "cuma")
    if not os.path.exists(cli):
        pytest.skip("no %s" % cli)
    return cli


def run(args, timeout=240):
    return subprocess.run([sys.executable] + args, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          universal_newlines=True, timeout=timeout, cwd=ROOT)


@pytest.mark.parametrize("name", ["lm.csv", "lm.csv.gz"])
def test_torch_trace_writes_a_matched_trace_that_replays(tmp_path, name):
    out = str(tmp_path / name)
    p = run([os.path.join(SCRIPTS, "torch_trace.py"), "--out", out, "--step-ms", "10"] + TINY)
    assert p.returncode == 0, p.stderr
    opener = gzip.open if name.endswith(".gz") else open
    with opener(out, "rt", newline="") as f:
        rows = list(csv.reader(f))
    assert rows[0] == ["Thread", "Time", "Action", "Pointer", "Size", "Stream"]
    live, peak, cur, last_t = {}, 0, 0, -1
    for thread, t, action, ptr, size, stream in rows[1:]:
        h, m, s, us = (int(x) for x in t.split(":"))
        t_us = ((h * 60 + m) * 60 + s) * 1000000 + us
        assert t_us >= last_t  # in time order
        last_t = t_us
        size = int(size)
        if action == "allocate":
            assert ptr not in live and size > 0
            live[ptr] = size
            cur += size
            peak = max(peak, cur)
        else:
            assert action == "free" and live.pop(ptr) == size  # frees match their allocation
            cur -= size
    assert peak > 0 and len(rows) > 100
    # The events span the steps: 3 steps of 10 ms plus the set-up slot.
    assert 20000 <= last_t <= 40000
    r = subprocess.run([cuma_cli(), "replay", "--json", out], stdout=subprocess.PIPE,
                       stderr=subprocess.PIPE, universal_newlines=True, timeout=120)
    assert r.returncode == 0, r.stderr
    d = json.loads(r.stdout)
    assert d["failed_allocs"] == 0 and d["unmatched_frees"] == 0
    assert d["peak_requested_bytes"] == peak


def test_torch_compare_dry_run_with_an_alternative_cuma_run(tmp_path):
    p = run([os.path.join(SCRIPTS, "torch_compare.py"), "--device", "cpu", "--warmup", "1",
             "--cuma-alt-conf", "remap_threshold:0.25", "--trace-out", str(tmp_path / "t.csv.gz"),
             "--trace-steps", "2", "--snapshot-out", str(tmp_path / "s.pickle.gz"),
             "--snapshot-steps", "2"] + TINY)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "TORCH RESULT: DRY RUN" in p.stdout
    assert "cuma_alt (remap_threshold:0.25, reported only)" in p.stdout
    for mode in ("native", "expandable", "cuma", "snapshot", "cuma_alt", "cuma_trace"):
        assert "== %s run" % mode in p.stdout
    assert p.stdout.index("== expandable run") < p.stdout.index("== cuma run")  # judged: first
    assert "[cuma_trace] step 2/2" in p.stderr + p.stdout  # --trace-steps sets its length
    assert "[snapshot] step 2/2" in p.stderr + p.stdout
    # On the CPU there is no memory history to dump: said, and no file.
    assert "memory snapshot of the native run: none (no CUDA here" in p.stdout
    assert not os.path.exists(str(tmp_path / "s.pickle.gz"))
    # The table: one row per judged allocator, with both step-time columns.
    rows = [ln for ln in p.stdout.splitlines() if ln.startswith("| ")]
    assert rows[0] == "| allocator | peak reserved | peak allocated | median step time | p99 step time |"
    assert [r.split(" | ")[0] for r in rows[1:]] == [
        "| PyTorch native (defaults)", "| PyTorch native, `expandable_segments:True`",
        "| cuma (`cuma.torch.enable()`)"]
    assert all(r.count(" ms |") == 2 for r in rows[1:])
    assert "PASS  peak reserved cuma/expandable_segments" in p.stdout or \
        "FAIL  peak reserved cuma/expandable_segments" in p.stdout


def test_torch_compare_percentile_is_nearest_rank():
    sys.path.insert(0, SCRIPTS)
    try:
        import torch_compare
    finally:
        sys.path.pop(0)
    xs = list(range(1, 281))  # 280 steps: the p99 is the third slowest
    assert torch_compare.percentile(xs, 0.99) == 278
    assert torch_compare.percentile([5.0], 0.99) == 5.0
    assert torch_compare.percentile([3, 1, 2], 0.5) == 2


def test_torch_compare_total_timeout_runs_the_judged_runs_first(tmp_path):
    """With too little total time for the reported-only runs, native and cuma still run (first,
    each keeping time for the other) and the others are left out, saying so."""
    p = run([os.path.join(SCRIPTS, "torch_compare.py"), "--device", "cpu", "--warmup", "1",
             "--total-timeout", "29.9", "--cuma-alt-conf", "remap_threshold:0.25",
             "--trace-out", str(tmp_path / "t.csv.gz"), "--trace-steps", "2"] + TINY)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "TORCH RESULT: DRY RUN" in p.stdout
    assert p.stdout.index("== native run") < p.stdout.index("== cuma run")
    assert p.stdout.index("== expandable run") < p.stdout.index("== cuma run")
    for mode in ("cuma_alt", "cuma_trace"):
        assert "the %s run is left out" % mode in p.stdout
        assert "== %s run" % mode not in p.stdout


def test_memory_guard_check_dry_run():
    """The GPU check's guard step on the CPU: both modes guard blocks, and the losses of the
    guarded runs equal the plain run's."""
    p = run([os.path.join(SCRIPTS, "memory_guard_check.py"), "--device", "cpu", "--steps", "3",
             "--warmup", "1", "--batch", "2", "--length", "16", "--d-model", "32", "--layers", "3",
             "--heads", "2"])
    assert p.returncode == 0, p.stdout + p.stderr
    assert "GUARD RESULT: PASS (dry run)" in p.stdout
    for mode in ("offload", "recompute"):
        lines = [ln for ln in p.stdout.splitlines() if ln.startswith(mode + ",")]
        assert len(lines) == 2 and all("loss same" in ln for ln in lines), p.stdout
        assert all("0 of 3 blocks guarded" not in ln for ln in lines), p.stdout


def test_compact_check_dry_run():
    """The GPU check's compaction step on the CPU (a simulated heap with host backing): the
    scattered model's tensors move, values and losses stay, fragmentation falls under 0.05."""
    p = run([os.path.join(SCRIPTS, "compact_check.py"), "--device", "cpu", "--width", "2048",
             "--small", "2", "--steps", "2", "--batch", "4"])
    assert p.returncode == 0, p.stdout + p.stderr
    assert "COMPACT RESULT: PASS (dry run)" in p.stdout
    assert "losses same" in p.stdout
    line = [ln for ln in p.stdout.splitlines() if ln.startswith("tensors:")][0]
    before, after = (float(v) for v in line.split("fragmentation ")[1].split(" (")[0].split(" -> "))
    assert before > 0.30 and after < 0.05, line


def test_pool_check_dry_run():
    """The GPU check's pool step on the CPU (a simulated heap with host backing): raw blocks
    distinct, in one carve, their bytes each their own; a model's buffers in a pool train as
    the plain run does and do not move in a compaction."""
    p = run([os.path.join(SCRIPTS, "pool_check.py"), "--device", "cpu", "--count", "64",
             "--width", "32", "--layers", "2", "--steps", "3", "--batch", "8"])
    assert p.returncode == 0, p.stdout + p.stderr
    assert "POOL RESULT: PASS (dry run)" in p.stdout
    assert "data checked" in p.stdout and "losses same" in p.stdout
    assert "6 buffers in a pool" in p.stdout and "buffers stayed" in p.stdout, p.stdout


def test_torch_multistream_dry_run(tmp_path):
    """The GPU check's multi-stream step on the CPU (no streams there): both runs go through the
    schedule and their checksums agree; no snapshot without CUDA, said so."""
    p = run([os.path.join(SCRIPTS, "torch_multistream.py"), "--device", "cpu", "--layers", "4",
             "--width", "64", "--tokens", "32", "--steps", "2",
             "--snapshot-out", str(tmp_path / "m.pickle.gz")])
    assert p.returncode == 0, p.stdout + p.stderr
    assert "== native run" in p.stdout and "== cuma run" in p.stdout
    assert "memory snapshot of the native run: none (no CUDA here)" in p.stdout
    assert "MULTISTREAM RESULT: PASS" in p.stdout and "dry run on the CPU" in p.stdout


def test_torch_multistream_tolerance_tells_different_values_apart():
    """The comparison is not vacuous: checksums 2 % apart fail it, 0.5 % apart pass."""
    sys.path.insert(0, SCRIPTS)
    try:
        import torch_multistream
    finally:
        sys.path.pop(0)
    assert torch_multistream.agree(1000.0, 1005.0, 1e-2)
    assert not torch_multistream.agree(1000.0, 1020.0, 1e-2)
    assert torch_multistream.agree(0.001, 0.002, 1e-2)  # near zero: absolute
