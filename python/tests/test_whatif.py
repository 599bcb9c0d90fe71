# SPDX-License-Identifier: Apache-2.0
"""cuma.torch.whatif(): a PyTorch snapshot from tests/data (a path, or a dict as
torch.cuda.memory._snapshot() gives it) replayed through `cuma replay`, on the CPU. PyTorch's
figures are checked against the snapshot's own segments, read here with pickle."""

import gzip
import os
import pickle

import pytest

import cuma.torch as ctorch

DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "tests", "data")
CACHED = os.path.join(DATA, "snapshot_cached_segments.pickle.gz")
TOY = os.path.join(DATA, "snapshot_toy_attention.pickle.gz")


def _load(path):
    with gzip.open(path, "rb") as f:
        return pickle.load(f)


def _recorded_peak(snap, device=0):
    """PyTorch's peak reserved bytes: the dump's segments, walked back over the segment events."""
    level = sum(s["total_size"] for s in snap["segments"] if s.get("device", 0) == device)
    peak = level
    for e in reversed(snap["device_traces"][device]):
        if e["action"] in ("segment_alloc", "segment_map"):
            level -= e["size"]
        elif e["action"] in ("segment_free", "segment_unmap"):
            level += e["size"]
        peak = max(peak, level)
    return peak


@pytest.mark.parametrize("path", [CACHED, TOY])
def test_path_pytorch_against_cuma(path):
    r = ctorch.whatif(path)
    snap = _load(path)
    assert r["pytorch_peak_reserved_bytes"] == _recorded_peak(snap)
    assert r["pytorch_time_avg_reserved_bytes"] > 0
    # The model of PyTorch's allocator, started from the cache before recording, meets it.
    assert abs(r["model_peak_reserved_bytes"] / r["pytorch_peak_reserved_bytes"] - 1) <= 0.03
    assert r["peak_requested_bytes"] <= r["cuma_peak_reserved_bytes"]
    assert r["cuma_peak_reserved_bytes"] <= r["pytorch_peak_reserved_bytes"]
    assert r["peak_ratio"] == r["cuma_peak_reserved_bytes"] / r["pytorch_peak_reserved_bytes"]
    assert r["time_avg_ratio"] == (r["cuma_time_avg_reserved_bytes"] /
                                   r["pytorch_time_avg_reserved_bytes"])
    assert r["failed_allocs"] == 0 and r["synthetic_times"] is False and r["device"] == 0
    assert [d["policy"] for d in r["replays"]] == ["pytorch", "tlsf"]


def test_dict_is_the_same_as_the_file():
    by_path = ctorch.whatif(CACHED)
    by_dict = ctorch.whatif(_load(CACHED))
    drop = lambda r: {k: v for k, v in r.items() if k != "replays"}  # noqa: E731 (paths differ)
    assert drop(by_dict) == drop(by_path)


def test_conf_and_pytorch_conf_reach_the_replays():
    r = ctorch.whatif(CACHED, "policy:buddy", pytorch_conf="expandable_segments:True")
    assert [d["policy"] for d in r["replays"]] == ["pytorch_expandable", "buddy"]
    with pytest.raises(RuntimeError, match="nonsense"):
        ctorch.whatif(CACHED, "nonsense:1")


def test_no_snapshot_without_cuda_or_a_bad_command(tmp_path):
    try:
        import torch

        cuda = torch.cuda.is_available()
    except ImportError:
        cuda = False
    if not cuda:  # this process has no PyTorch CUDA snapshot to take
        with pytest.raises(RuntimeError, match="CUDA is not available|PyTorch is not installed"):
            ctorch.whatif()
    with pytest.raises(RuntimeError, match="no executable"):
        ctorch.whatif(CACHED, cuma_bin=str(tmp_path / "nope"))
    with pytest.raises(RuntimeError, match="exited 2"):
        ctorch.whatif(str(tmp_path / "missing.pickle"))
