# SPDX-License-Identifier: Apache-2.0
"""cuma.torch.whatif(): a PyTorch memory snapshot replayed through `cuma replay`, to tell what
PyTorch reserved against what cuma would have reserved for the same allocations.

The replay lives in the native `cuma` command (tools/replay.c), not in libcuma, so this runs it
as a subprocess on the snapshot (written to a temporary file when given as a dict): once with
the model of PyTorch's allocator (`--policy pytorch`), once with cuma's settings (`--conf`).
"""

import json
import os
import pickle
import shutil
import subprocess
import tempfile


def _find_cli(cuma_bin):
    """The `cuma` command: cuma_bin, $CUMA_BIN, the package's bin/cuma (pip install), bin/cuma
    beside the loaded libcuma's folder (a build tree: build/lib and build/bin), then PATH."""
    for given, what in ((cuma_bin, "cuma_bin"), (os.environ.get("CUMA_BIN"), "$CUMA_BIN")):
        if given:
            if not os.access(given, os.X_OK):
                raise RuntimeError("cuma.torch.whatif(): %s %s is no executable `cuma` command"
                                   % (what, given))
            return given
    pkg = os.path.dirname(os.path.abspath(__file__))
    tried = [os.path.join(pkg, "bin", "cuma")]
    try:
        from . import _lib

        tried.append(os.path.join(os.path.dirname(os.path.dirname(_lib.path())), "bin", "cuma"))
    except Exception:  # no libcuma loadable: the other places still count
        pass
    for p in tried:
        if os.access(p, os.X_OK):
            return p
    found = shutil.which("cuma")
    if found:
        return found
    raise RuntimeError(
        "cuma.torch.whatif(): the `cuma` command was not found (tried %s and PATH); build it "
        "(cmake --build build --target cuma_cli) and pass cuma_bin= or set CUMA_BIN"
        % ", ".join(tried)
    )


def _current_snapshot():
    """torch.cuda.memory._snapshot() of this process."""
    try:
        import torch
    except ImportError as e:
        raise RuntimeError("cuma.torch.whatif(): no snapshot given and PyTorch is not installed "
                           "(%s)" % e) from e
    if not torch.cuda.is_available():
        raise RuntimeError("cuma.torch.whatif(): no snapshot given and CUDA is not available; "
                           "pass a snapshot dict or the path of a _dump_snapshot() pickle")
    from . import torch as cuma_torch

    if cuma_torch.is_enabled():
        raise RuntimeError("cuma.torch.whatif(): cuma is PyTorch's allocator in this process, so "
                           "there is no PyTorch caching-allocator snapshot to replay")
    return torch.cuda.memory._snapshot()


def _replay(cli, path, args, timeout):
    cmd = [cli, "replay", "--json"] + args + [path]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    if p.returncode != 0:
        raise RuntimeError("cuma.torch.whatif(): %s exited %d: %s"
                           % (" ".join(cmd), p.returncode, p.stderr.strip()))
    return json.loads(p.stdout.splitlines()[0])


def _ratio(a, b):
    return a / b if a is not None and b else None


def whatif(snapshot_or_path=None, conf=None, *, device=None, pytorch_conf=None, cuma_bin=None,
           timeout=600):
    """What PyTorch reserved for a snapshot's allocations against what cuma would reserve.

    snapshot_or_path: a dict as torch.cuda.memory._snapshot() returns it, the path of a
    torch.cuda.memory._dump_snapshot() pickle (plain or .gz), or None for this process's own
    snapshot (needs CUDA; call torch.cuda.memory._record_memory_history() early so it holds the
    allocations over time, not only the state now). conf: cuma settings for its replay (CUMA_CONF
    syntax, e.g. "release_delay_ms:2000"; default: cuma's defaults). device: the snapshot's device
    (default: the one with the most events). pytorch_conf: PYTORCH_CUDA_ALLOC_CONF for the model
    of PyTorch's allocator. cuma_bin: the `cuma` command (default: found as _find_cli says).

    Returns a dict of bytes (None where the snapshot has no such figure):
    pytorch_peak_reserved_bytes / pytorch_time_avg_reserved_bytes (what PyTorch recorded),
    model_peak_reserved_bytes / model_time_avg_reserved_bytes (the model of PyTorch's allocator,
    for a snapshot that does not record PyTorch's own figures), cuma_peak_reserved_bytes /
    cuma_time_avg_reserved_bytes, peak_requested_bytes, peak_ratio and time_avg_ratio (cuma /
    PyTorch recorded), failed_allocs (cuma's), synthetic_times (no time_us in the snapshot: the
    time averages mean nothing), and "replays": the two JSON lines of `cuma replay --json`.
    """
    if snapshot_or_path is None:
        snapshot_or_path = _current_snapshot()
    cli = _find_cli(cuma_bin)
    tmp = None
    try:
        if isinstance(snapshot_or_path, dict):
            fd, tmp = tempfile.mkstemp(prefix="cuma-whatif-", suffix=".pickle")
            with os.fdopen(fd, "wb") as f:
                pickle.dump(snapshot_or_path, f, protocol=4)
            path = tmp
        else:
            path = os.fspath(snapshot_or_path)
        common = ["--device", str(int(device))] if device is not None else []
        model = _replay(cli, path, common + ["--policy", "pytorch"] +
                        (["--pytorch-conf", pytorch_conf] if pytorch_conf else []), timeout)
        ours = _replay(cli, path, common + (["--conf", conf] if conf else []), timeout)
    finally:
        if tmp:
            os.unlink(tmp)
    rec_peak = model.get("recorded_peak_reserved_bytes")
    rec_avg = model.get("recorded_time_avg_reserved_bytes")
    return {
        "pytorch_peak_reserved_bytes": rec_peak,
        "pytorch_time_avg_reserved_bytes": rec_avg,
        "model_peak_reserved_bytes": model["peak_reserved_bytes"],
        "model_time_avg_reserved_bytes": model["time_avg_reserved_bytes"],
        "cuma_peak_reserved_bytes": ours["peak_reserved_bytes"],
        "cuma_time_avg_reserved_bytes": ours["time_avg_reserved_bytes"],
        "peak_requested_bytes": ours["peak_requested_bytes"],
        "peak_ratio": _ratio(ours["peak_reserved_bytes"], rec_peak),
        "time_avg_ratio": _ratio(ours["time_avg_reserved_bytes"], rec_avg),
        "failed_allocs": ours["failed_allocs"],
        "synthetic_times": ours["synthetic_times"],
        "device": ours.get("device"),
        "replays": [model, ours],
    }
