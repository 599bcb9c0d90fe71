#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Writes snapshot_cached_segments.pickle.gz: a PyTorch memory snapshot (the plain-data pickle
torch.cuda.memory._dump_snapshot() writes) whose recording started with PyTorch's cache already
full of segments, as real ones often do (tests/data/README.md).

Before recording: segment A (60 MiB, large pool) holds a 20 MiB block and 40 MiB of free
cache, B (2 MiB, small pool) a 512 KiB block, C (20 MiB) an 8 MiB block, E (20 MiB) nothing.
During it: E is given back (segment_free), C's block freed, 30 MiB taken from A's free room,
a new segment D (50 MiB) made for 50 MiB, 1 KiB from B, the 30 MiB freed, 15 MiB from C.
The events follow PyTorch's caching allocator's rules (best fit, split, 2 MiB small segments),
so what it reserved (recorded: 132 MiB at the peak, 102 MiB at the start) is what a faithful
model replays when it starts from A, B and C; one that starts empty reserves 122 MiB.

usage: make_snapshot_cached.py [OUT]   (default: beside this script)
"""
import gzip
import os
import pickle
import sys

MB = 1 << 20
A, B, C, D, E = (0x7F0000000000 + k * 0x10000000 for k in range(5))
T0 = 1_700_000_000_000_000


def ev(action, addr, size, t):
    return {"action": action, "addr": addr, "size": size, "stream": 0, "time_us": T0 + t,
            "frames": [{"filename": "train.py", "line": 10 + t // 10, "name": "step"}]}


def block(addr, size, state, requested=None):
    return {"address": addr, "size": size, "state": state,
            "requested_size": size if requested is None else requested, "frames": []}


def segment(addr, total, blocks, kind="large"):
    active = sum(b["size"] for b in blocks if b["state"] == "active_allocated")
    return {"device": 0, "address": addr, "total_size": total, "stream": 0,
            "segment_type": kind, "allocated_size": active, "active_size": active,
            "requested_size": active, "is_expandable": False, "segment_pool_id": (0, 0),
            "frames": [], "blocks": blocks}


def snapshot():
    trace = [
        ev("segment_free", E, 20 * MB, 10),  # an empty_cache() of the free segment E
        ev("free_requested", C, 8 * MB, 10),  # a block from before recording
        ev("free_completed", C, 8 * MB, 10),
        ev("alloc", A + 20 * MB, 30 * MB, 20),  # best fit: A's 40 MiB free block, split
        ev("segment_alloc", D, 50 * MB, 30),  # no free block of 50 MiB: a new segment
        ev("alloc", D, 50 * MB, 30),
        ev("alloc", B + 512 * 1024, 1000, 40),  # small pool: B's free room
        ev("free_requested", A + 20 * MB, 30 * MB, 50),
        ev("free_completed", A + 20 * MB, 30 * MB, 50),
        ev("alloc", C, 15 * MB, 60),  # best fit: C, now one free 20 MiB block
    ]
    segs = [
        segment(A, 60 * MB, [block(A, 20 * MB, "active_allocated"),
                             block(A + 20 * MB, 40 * MB, "inactive", 0)]),
        segment(B, 2 * MB, [block(B, 512 * 1024, "active_allocated"),
                            block(B + 512 * 1024, 1024, "active_allocated", 1000),
                            block(B + 513 * 1024, 2 * MB - 513 * 1024, "inactive", 0)], "small"),
        segment(C, 20 * MB, [block(C, 15 * MB, "active_allocated"),
                             block(C + 15 * MB, 5 * MB, "inactive", 0)]),
        segment(D, 50 * MB, [block(D, 50 * MB, "active_allocated")]),
    ]
    settings = {"PYTORCH_CUDA_ALLOC_CONF": "", "max_split_size": -1,
                "garbage_collection_threshold": 0.0, "expandable_segments": False}
    return {"segments": segs, "device_traces": [trace], "allocator_settings": settings}


def main():
    out = sys.argv[1] if len(sys.argv) > 1 else os.path.join(
        os.path.dirname(os.path.abspath(__file__)), "snapshot_cached_segments.pickle.gz")
    data = pickle.dumps(snapshot(), protocol=4)
    with open(out, "wb") as f:
        f.write(gzip.compress(data, mtime=0))


if __name__ == "__main__":
    main()
