# SPDX-License-Identifier: Apache-2.0
"""Heap.snapshot() and cuma.torch.memory_snapshot() (cuma_snapshot_json): what holds a heap's
memory, block by block, on the simulated device."""

import ctypes
import json

import pytest

import cuma
import cuma.torch as ctorch

MB = 1 << 20
EXACT = "backend:sim,capacity:512M,page_size:2M,tcache:off,sim_clock:manual"
S1, S2 = 0x1000, 0x2000


def _bucket(size):
    le = 1
    while le < size:
        le <<= 1
    return le


def _check_totals(h, snap=None):
    snap = snap or h.snapshot()
    s = h.stats()
    live, deferred = snap["live"], snap["deferred"]
    assert live["requested"] + deferred["requested"] == s["requested_bytes"]
    assert live["bytes"] + deferred["bytes"] == s["allocated_bytes"]
    assert live["count"] + deferred["count"] == s["active_allocs"]
    for key in ("cached_bytes", "mapped_bytes", "reserved_bytes"):
        assert snap["free"][key] == s[key], key
    assert snap["managed"]["bytes"] == s["managed_bytes"]
    assert snap["arenas"] == s["arenas"] and snap["page_size"] == s["page_size"]
    return snap


def test_every_figure_on_two_streams():
    with cuma.Heap(EXACT, use_env=False) as h:
        blocks = {}
        for i in range(40):
            req = 3 * MB + 100 if i < 3 else i * i * 6000 + 1
            stream = (S1, S2, 0)[i % 3]
            p = h.alloc(req, stream)
            blocks[p] = (h.block_size(p), req, stream)
        snap = _check_totals(h)
        live = snap["live"]
        assert live["count"] == 40
        assert live["bytes"] == sum(b[0] for b in blocks.values())
        assert live["requested"] == sum(b[1] for b in blocks.values())
        want = {}
        for size, _, _ in blocks.values():
            c, n = want.get(_bucket(size), (0, 0))
            want[_bucket(size)] = (c + 1, n + size)
        assert [(b["le"], b["count"], b["bytes"]) for b in live["by_size"]] == sorted(
            (le, c, n) for le, (c, n) in want.items()
        )
        order = sorted(blocks, key=lambda p: (-blocks[p][0], p))[:32]
        largest = live["largest"]
        assert [int(b["addr"], 16) for b in largest] == order
        for b in largest:
            size, req, stream = blocks[int(b["addr"], 16)]
            assert (b["size"], b["requested"], b["arena"]) == (size, req, 0)
            assert b["stream"] == (("0x%x" % stream) if stream else 0)
        assert "request_failed_last" not in snap  # the heap keeps no such figure

        # A freed block waiting on another stream's work is deferred, not live.
        big = order[0]
        h.record_stream(big, 0x3000)
        h.sim_hold_stream(0x3000)
        h.free(big)
        snap = _check_totals(h)
        assert snap["live"]["count"] == 39
        assert snap["deferred"] == {"count": 1, "bytes": blocks[big][0], "requested": blocks[big][1]}
        assert big not in [int(b["addr"], 16) for b in snap["live"]["largest"]]
        h.sim_release_stream(0x3000)
        h.poll()
        assert _check_totals(h)["deferred"]["count"] == 0
        for p in blocks:
            if p != big:
                h.free(p)
        snap = _check_totals(h)
        assert snap["live"] == {"count": 0, "bytes": 0, "requested": 0, "by_size": [], "largest": []}


def test_thread_cached_blocks_are_not_live():
    with cuma.Heap("backend:sim,capacity:256M,page_size:2M,sim_clock:manual", use_env=False) as h:
        a = h.alloc(100000)
        b = h.alloc(300000)
        size = h.block_size(b)
        h.free(b)  # into this thread's cache
        snap = _check_totals(h)
        assert snap["live"]["count"] == 1 and snap["live"]["requested"] == 100000
        assert snap["thread_cached"] == {"count": 1, "bytes": size}
        assert [int(x["addr"], 16) for x in snap["live"]["largest"]] == [a]
        h.free(a)


def test_managed_fallback_counts_apart():
    with cuma.Heap("backend:sim,capacity:64M,managed_fallback:on,tcache:off", use_env=False) as h:
        p = h.alloc(MB)
        m = h.alloc(300 * MB)  # more than the virtual range: managed memory
        snap = _check_totals(h)
        assert snap["managed"] == {"count": 1, "bytes": 300 * MB}
        assert snap["live"]["count"] == 1
        h.free(m)
        h.free(p)


def test_raw_json_and_buffer_protocol(lib):
    with cuma.Heap(EXACT, use_env=False) as h:
        h.alloc(5 * MB, S1)
        needed = ctypes.c_size_t(0)
        small = ctypes.create_string_buffer(8)
        assert lib.cuma_snapshot_json(h.handle, small, 8, ctypes.byref(needed)) != 0
        assert "too small" in cuma._lib.last_error()
        buf = ctypes.create_string_buffer(needed.value + 1)
        assert lib.cuma_snapshot_json(h.handle, buf, needed.value + 1, None) == 0
        text = buf.value.decode()
        assert len(text) == needed.value
        assert json.loads(text) == h.snapshot()
        assert lib.cuma_snapshot_json(None, buf, len(buf), None) != 0
        assert "heap is NULL" in cuma._lib.last_error()
    with pytest.raises(ValueError, match="closed"):
        h.snapshot()


def test_torch_memory_snapshot_on_default_heap(monkeypatch):
    monkeypatch.setenv("CUMA_CONF", "backend:sim,capacity:256M,tcache:off")
    assert "memory_snapshot" in ctorch.__all__
    heap = cuma.default_heap(0)
    p = heap.alloc(7 * MB, S2)
    snap = ctorch.memory_snapshot()
    assert snap["live"]["count"] == 1
    top = snap["live"]["largest"][0]
    assert int(top["addr"], 16) == p and top["stream"] == "0x%x" % S2
    assert snap == heap.snapshot()
    assert ctorch.memory_snapshot(1)["live"]["count"] == 0  # device 1's heap, made on demand
    with pytest.raises(ValueError):
        ctorch.memory_snapshot(-1)
    heap.free(p)


def test_oom_dump_file_is_json_with_what_held_the_memory(tmp_path):
    """oom_dump: the file a failed allocation leaves parses as JSON and holds the request, the
    error the caller got, the stats and the snapshot of that moment."""
    pattern = str(tmp_path / "oom-%p-%d.json")
    with cuma.Heap("backend:sim,capacity:16M,page_size:2M,tcache:off,sim_clock:manual,device:1,"
                   "oom_dump:" + pattern, use_env=False) as h:
        held = h.alloc(12 * MB)
        with pytest.raises(cuma.OutOfMemoryError) as ei:
            h.alloc(8 * MB)
        dumps = list(tmp_path.glob("oom-*-1.json"))
        assert len(dumps) == 1
        d = json.loads(dumps[0].read_text())
        assert d["request_bytes"] == 8 * MB and d["device"] == 1
        assert d["error"] == str(ei.value)
        assert d["stats"]["failed_allocs"] == 1 and d["stats"]["reserved_bytes"] == 12 * MB
        assert d["snapshot"]["live"]["count"] == 1
        assert d["snapshot"]["live"]["largest"][0]["addr"] == hex(held)
        h.free(held)
