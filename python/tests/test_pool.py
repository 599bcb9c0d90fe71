# SPDX-License-Identifier: Apache-2.0
"""Heap.pool on the simulated device: blocks, reuse, stats, errors, close and threads."""

import threading

import pytest

import cuma

MB = 1 << 20


def test_alloc_free_and_stats(sim_heap):
    h = sim_heap
    allocs0 = h.stats()["num_allocs"]
    with h.pool(100, 8) as pool:
        assert isinstance(pool, cuma.Pool)
        assert (pool.block_size, pool.count, pool.in_use) == (256, 8, 0)
        blocks = [pool.alloc() for _ in range(8)]
        assert all(isinstance(b, int) and b % 256 == 0 for b in blocks)
        assert blocks == [blocks[0] + 256 * i for i in range(8)]
        s = h.stats()
        assert (s["pools"], s["pool_bytes"], s["pool_blocks"], s["pool_blocks_in_use"]) == (1, 2048, 8, 8)
        assert s["num_allocs"] == allocs0 + 1  # the carve; the blocks are not heap allocations
        with pytest.raises(cuma.OutOfMemoryError, match="all 8 blocks"):
            pool.alloc()
        pool.free(blocks[5])
        assert pool.alloc() == blocks[5]  # the last freed comes back first
        for b in blocks:
            pool.free(b)
        pool.free(None)
        pool.free(0)
        assert pool.in_use == 0 and h.stats()["pool_blocks_in_use"] == 0
        pool.validate()
        assert "8 blocks of 256 bytes, 0 in use" in repr(pool)
    assert pool.closed and repr(pool) == "<cuma.Pool closed>"
    s = h.stats()
    assert (s["pools"], s["pool_bytes"], s["pool_blocks"], s["active_allocs"]) == (0, 0, 0, 0)
    h.validate()


def test_bad_arguments(sim_heap):
    h = sim_heap
    with pytest.raises(cuma.InvalidArgumentError, match="size is 0"):
        h.pool(0, 4)
    with pytest.raises(cuma.InvalidArgumentError, match="count is 0"):
        h.pool(64, 0)
    with pytest.raises(cuma.InvalidArgumentError, match="overflow"):
        h.pool(1 << 62, 8)
    with pytest.raises(ValueError):
        h.pool(1 << 64, 1)
    with pytest.raises(TypeError):
        h.pool("64", 1)
    with pytest.raises(cuma.OutOfMemoryError, match="cuma_pool_create"):
        h.pool(MB, 128)  # more than the 64 MiB device
    assert h.stats()["pools"] == 0


def test_misuse_is_refused_and_changes_nothing(sim_heap):
    h = sim_heap
    p, q = h.pool(1000, 4), h.pool(1000, 4)
    a, b = p.alloc(), p.alloc()
    qa = q.alloc()
    plain = h.alloc(4096)
    for bad, why in ((qa, "is not in pool"), (plain, "is not in pool"), (b + 8, "not at its start")):
        with pytest.raises(cuma.BadPointerError, match=why):
            p.free(bad)
    p.free(b)
    with pytest.raises(cuma.BadPointerError, match="already free"):
        p.free(b)
    assert p.in_use == 1
    with pytest.raises(cuma.InvalidArgumentError, match="1 of the pool's 4 blocks are still allocated"):
        p.close()
    assert not p.closed
    assert p.alloc() == b  # still usable
    p.free(b)
    p.free(a)
    p.close()
    p.close()  # idempotent
    with pytest.raises(cuma.HeapClosedError):
        p.alloc()
    with pytest.raises(cuma.HeapClosedError):
        p.free(a)
    q.free(qa)
    q.close()
    h.free(plain)
    h.validate()


def test_with_block_keeps_the_exception_when_blocks_are_out(sim_heap):
    with pytest.raises(KeyError):
        with sim_heap.pool(64, 2) as pool:
            pool.alloc()
            raise KeyError("the caller's")
    assert not pool.closed and sim_heap.stats()["pools"] == 1  # kept until the heap closes


def test_heap_close_frees_its_pools():
    h = cuma.Heap("backend:sim,capacity:64M", use_env=False)
    pool = h.pool(512, 16)
    pool.alloc()
    h.close()
    assert pool.closed
    with pytest.raises(cuma.HeapClosedError):
        pool.alloc()
    pool.close()  # nothing left to do


def test_threads_share_a_pool(sim_heap):
    pool = sim_heap.pool(256, 32)
    owners = {}
    lock = threading.Lock()
    errors = []

    def work(tid):
        try:
            held = []
            for i in range(2000):
                if len(held) < 6 and (i % 3 != 2 or not held):
                    try:
                        b = pool.alloc()
                    except cuma.OutOfMemoryError:
                        continue
                    with lock:
                        assert b not in owners, "block %#x handed out twice" % b
                        owners[b] = tid
                    held.append(b)
                else:
                    b = held.pop(0)
                    with lock:
                        assert owners.pop(b) == tid
                    pool.free(b)
            for b in held:
                with lock:
                    owners.pop(b)
                pool.free(b)
        except BaseException as e:  # reported by the main thread
            errors.append(e)

    threads = [threading.Thread(target=work, args=(t,)) for t in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert pool.in_use == 0 and sim_heap.stats()["pool_blocks_in_use"] == 0
    pool.validate()
    pool.close()
