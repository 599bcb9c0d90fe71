# SPDX-License-Identifier: Apache-2.0
"""cuma.record: PyTorch's CPU allocations of a small known program, as RMM CSV.

The program allocates storages of known sizes; the trace must hold exactly those blocks, each
free must match an earlier allocate of the same block and size, and the file must be the RMM CSV
that `cuma replay` reads (header, HH:MM:SS:micro times that never go back).
"""
import gzip
import os
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")

import cuma.record as record  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

PROGRAM = """
import sys
import torch
n = int(sys.argv[1])
a = torch.empty(n)                        # 4 n bytes
b = torch.empty(250, dtype=torch.float64) # 2000 bytes
del a
c = torch.empty(3, 4)                     # 48 bytes
keep = torch.empty(7, dtype=torch.int8)   # 7 bytes, freed with the script's globals
del b, c
"""


def _check_pairs(events):
    """Every free matches a live allocate of the same size; returns what is still live."""
    live = {}
    last = 0
    for t, _, action, ptr, size in events:
        assert t >= last
        last = t
        if action == "allocate":
            assert ptr not in live
            live[ptr] = size
        else:
            assert action == "free"
            assert live.pop(ptr) == size
    return live


def test_recorder_sees_each_storage():
    before = torch.empty(100)  # allocated before recording: its free (400 B) is left out
    with record.Recorder() as rec:
        a = torch.empty(1000)
        b = torch.empty(250, dtype=torch.float64)
        del a
        c = torch.empty(3, 4)
        keep = torch.empty(7, dtype=torch.int8)
        del b, c, before
    allocs = [e for e in rec.events if e[2] == "allocate"]
    frees = [e for e in rec.events if e[2] == "free"]
    assert sorted(e[4] for e in allocs) == [7, 48, 2000, 4000]
    assert sorted(e[4] for e in frees) == [48, 2000, 4000]
    assert rec.dropped_frees == 0
    live = _check_pairs(rec.events)
    assert list(live.values()) == [7]
    assert live == {keep.data_ptr(): 7}
    assert rec.events[0][0] == 0
    assert {e[1] for e in rec.events} == {0}


def _read_csv(path):
    with gzip.open(path, "rt", encoding="ascii") as f:
        lines = f.read().splitlines()
    assert lines[0] == "Thread,Time,Action,Pointer,Size,Stream"
    events = []
    for line in lines[1:]:
        thread, time, action, ptr, size, stream = line.split(",")
        h, m, s, us = (int(x) for x in time.split(":"))
        assert len(time.split(":")[3]) == 6
        events.append(((((h * 60 + m) * 60 + s) * 1000000 + us) * 1000, int(thread), action,
                       int(ptr, 16), int(size)))
        assert stream == "0"
    return events


def test_cli_records_a_script_with_its_arguments(tmp_path):
    script = tmp_path / "prog.py"
    script.write_text(PROGRAM)
    out = tmp_path / "trace.csv.gz"
    env = dict(os.environ)
    env["PYTHONPATH"] = os.path.join(ROOT, "python")
    proc = subprocess.run(
        [sys.executable, "-m", "cuma.record", "-o", str(out), str(script), "1500"],
        env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "4 allocations, 4 frees" in proc.stderr
    events = _read_csv(str(out))
    assert sorted(e[4] for e in events if e[2] == "allocate") == [7, 48, 2000, 6000]
    # The script's globals go when it ends, still inside the recording: nothing stays live.
    assert _check_pairs(events) == {}
    assert [e[4] for e in events if e[2] == "free"][-1] == 7


def test_times_are_rmm_fields():
    assert record._rmm_time(0) == "00:00:00:000000"
    assert record._rmm_time(3723000456789) == "01:02:03:000456"
