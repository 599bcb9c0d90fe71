# SPDX-License-Identifier: Apache-2.0
"""Heap.compact, Heap.set_mover and compact_if_needed on the simulated device with host
backing (the bytes the movers copy are real): data intact at the new places, fragmentation
under the threshold, refusals, exceptions in movers, the out-of-memory rung."""

import ctypes
import random
import warnings

import pytest

import cuma

KB = 1 << 10
MB = 1 << 20
CONF = "backend:sim,host_backing:on,tcache:off,capacity:512M,page_size:2M,sim_clock:manual"


def _pattern(i, n):
    return bytes((i * 37 + k * 11 + 1) & 0xFF for k in range(n))


class Owner:
    """The program's side: its blocks (address -> index) and a mover that memmoves."""

    def __init__(self, heap, sizes):
        self.heap = heap
        self.sizes = sizes
        self.ptrs = []
        self.calls = 0

    def fill(self):
        for i, (p, n) in enumerate(zip(self.ptrs, self.sizes)):
            ctypes.memmove(p, _pattern(i, n), n)

    def intact(self):
        return all(ctypes.string_at(p, n) == _pattern(i, n) for i, (p, n) in enumerate(zip(self.ptrs, self.sizes)))

    def move(self, old, new, size):
        self.calls += 1
        i = self.ptrs.index(old) if old in self.ptrs else None
        if i is None:
            return False
        assert size == self.sizes[i]
        ctypes.memmove(new, old, size)
        self.ptrs[i] = new
        return True


def _fragment(h, seed, nsmall=24, ndense=16):
    """ndense live 4 MiB blocks, then nsmall small live blocks among freed large ones."""
    print("seed", seed)
    rng = random.Random(seed)
    dense = [h.alloc(4 * MB) for _ in range(ndense)]
    o = Owner(h, [rng.randrange(4 * KB, 48 * KB) for _ in range(nsmall)])
    big = []
    for n in o.sizes:
        o.ptrs.append(h.alloc(n))
        big.append(h.alloc(2 * MB + rng.randrange(2 * MB)))
    for b in big:
        h.free(b)
    h.trim()
    o.fill()
    return o, dense


@pytest.fixture
def seed():
    return random.randrange(1 << 30)


def test_compact_moves_data_and_frees_pages(seed):
    with cuma.Heap(CONF, use_env=False) as h:
        o, _ = _fragment(h, seed)
        s0 = h.stats()
        assert s0["fragmentation"] > 0.30
        r = h.compact(o.move)
        s1 = h.stats()
        assert r["blocks_moved"] == len(o.sizes) and r["blocks_refused"] == 0
        assert r["bytes_moved"] == sum(o.sizes)
        assert r["pages_emptied"] > 0 and r["pages_released"] > 0
        assert o.intact()
        assert s1["fragmentation"] < 0.05 < s0["fragmentation"]
        assert s1["mapped_bytes"] < s0["mapped_bytes"]
        assert (s1["compactions"], s1["compact_moved_bytes"], s1["compact_freed_pages"]) == (
            1, r["bytes_moved"], r["pages_emptied"])
        h.validate()
        for p in o.ptrs:
            h.free(p)  # the new places are ordinary allocations
        h.validate()


def test_refusing_mover_keeps_blocks(seed):
    with cuma.Heap(CONF, use_env=False) as h:
        o, _ = _fragment(h, seed)
        before = list(o.ptrs)
        s0 = h.stats()
        r = h.compact(lambda old, new, size: False)
        assert (r["blocks_moved"], r["blocks_refused"], r["pages_emptied"]) == (0, len(before), 0)
        assert o.ptrs == before and o.intact()
        assert h.stats()["mapped_bytes"] == s0["mapped_bytes"]
        h.validate()


def test_exception_in_mover_keeps_that_block(seed):
    with cuma.Heap(CONF, use_env=False) as h:
        o, _ = _fragment(h, seed)
        first = []

        def move(old, new, size):
            if not first:
                first.append(old)
                raise ValueError("no room in my table")
            return o.move(old, new, size)

        with pytest.warns(RuntimeWarning, match="no room in my table"):
            r = h.compact(move)
        assert r["blocks_refused"] == 1 and r["blocks_moved"] == len(o.sizes) - 1
        assert first[0] in o.ptrs and o.intact()
        h.validate()


def test_keyboard_interrupt_in_mover_stops_and_is_raised(seed):
    with cuma.Heap(CONF, use_env=False) as h:
        o, _ = _fragment(h, seed)
        before = list(o.ptrs)

        def move(old, new, size):
            raise KeyboardInterrupt

        with pytest.raises(KeyboardInterrupt):
            h.compact(move)
        assert o.ptrs == before and o.intact()
        assert h.stats()["compactions"] == 1
        h.validate()


def test_set_mover_and_compact_if_needed(seed):
    with cuma.Heap(CONF, use_env=False) as h:
        o, _ = _fragment(h, seed)
        assert h.compact_if_needed()["blocks_moved"] == 0  # no mover yet
        assert h.stats()["compactions"] == 0
        h.set_mover(o.move)
        r = h.compact_if_needed()
        assert r["blocks_moved"] == len(o.sizes) and o.intact()
        assert h.stats()["fragmentation"] < 0.05
        assert h.compact_if_needed()["blocks_moved"] == 0  # under the threshold now
        assert h.stats()["compactions"] == 1
        h.set_mover(None)
        with pytest.raises(TypeError):
            h.set_mover(42)
        h.validate()


def test_oom_rung_makes_a_failing_allocation_succeed(seed):
    rng = random.Random(seed)
    print("seed", seed)
    conf = "backend:sim,host_backing:on,tcache:off,capacity:48M,page_size:2M,sim_clock:manual"
    with cuma.Heap(conf, use_env=False) as h:
        o = Owner(h, [rng.randrange(4 * KB, 60 * KB) // 512 * 512 for _ in range(24)])
        big = []
        for n in o.sizes:  # one small block at the start of each page, the rest freed
            o.ptrs.append(h.alloc(n))
            big.append(h.alloc(2 * MB - n))
        for b in big:
            h.free(b)
        o.fill()
        with pytest.raises(cuma.OutOfMemoryError):
            h.alloc(8 * MB)
        h.set_mover(o.move)
        x = h.alloc(8 * MB)
        assert x and o.intact()
        assert h.stats()["compactions"] == 1
        h.validate()


def test_compact_unsupported_in_segment_mode():
    with cuma.Heap("backend:sim,sim_segments:on,capacity:64M", use_env=False) as h:
        with pytest.raises(cuma.UnsupportedError, match="segment mode"):
            h.compact(lambda old, new, size: True)
        with pytest.raises(cuma.UnsupportedError):
            h.set_mover(lambda old, new, size: True)
