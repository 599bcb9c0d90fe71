# SPDX-License-Identifier: Apache-2.0
"""Heap.close() racing with other calls: it refuses new calls with HeapClosedError, waits
for the calls under way, and never destroys the C heap under one (which crashed the
interpreter: a SIGSEGV in 7 of 10 runs of the race below)."""

import os
import random
import subprocess
import sys
import threading

import pytest

import cuma

# Threads allocate and free in a loop while the main thread closes the heap, round after
# round. Run in a child process, so that a crash fails the test instead of ending pytest.
RACE = r"""
import random, sys, threading, time
import cuma

seed, rounds = int(sys.argv[1]), int(sys.argv[2])
rng = random.Random(seed)
errors = []

def worker(h, r):
    live = []
    try:
        while True:
            if live and r.random() < 0.5:
                h.free(live.pop())
            else:
                live.append(h.alloc(r.choice([256, 4096, 1 << 20])))
            if r.random() < 0.05:
                h.stats()
    except Exception as e:
        errors.append(e)

for _ in range(rounds):
    h = cuma.Heap("backend:sim,capacity:1G", use_env=False)
    ts = [threading.Thread(target=worker, args=(h, random.Random(rng.random()))) for _ in range(4)]
    for t in ts:
        t.start()
    time.sleep(rng.random() * 0.01)
    h.close()
    for t in ts:
        t.join()
kinds = sorted(set(type(e).__name__ for e in errors))
print("errors", len(errors), " ".join(kinds))
for e in errors:
    if not isinstance(e, cuma.HeapClosedError):
        print("unexpected", repr(e))
"""


def test_close_while_threads_allocate_never_crashes():
    seed = random.randrange(1 << 30)
    print("seed", seed)
    env = dict(os.environ)
    p = subprocess.run([sys.executable, "-c", RACE, str(seed), "30"], env=env, stdout=subprocess.PIPE,
                       stderr=subprocess.PIPE, universal_newlines=True, timeout=300)
    assert p.returncode == 0, "seed %d: rc %d\n%s\n%s" % (seed, p.returncode, p.stdout, p.stderr[-3000:])
    assert "unexpected" not in p.stdout, "seed %d: %s" % (seed, p.stdout)
    # Every worker thread ends on the closed heap: 4 a round, and only with the clear error.
    assert p.stdout.split()[:3] == ["errors", str(4 * 30), "HeapClosedError"], "seed %d: %s" % (seed, p.stdout)


def test_calls_after_close_raise_heap_closed_error():
    h = cuma.Heap("backend:sim,capacity:64M", use_env=False)
    p = h.alloc(4096)
    h.close()
    for call in (lambda: h.alloc(1), lambda: h.free(p), h.stats, h.trim, h.validate, lambda: h.on_oom(print)):
        with pytest.raises(cuma.HeapClosedError, match="closed"):
            call()
    with pytest.raises(ValueError):  # a ValueError too, as before
        h.alloc(1)
    h.close()  # idempotent


def test_close_waits_for_a_call_inside_c_and_refuses_new_ones():
    """An allocation blocked in an OOM callback is under way: close() from another thread waits
    for it, new calls meanwhile get HeapClosedError, and the heap is destroyed after it returns."""
    h = cuma.Heap("backend:sim,capacity:8M,page_size:2M", use_env=False)
    inside, release = threading.Event(), threading.Event()
    first = h.alloc(6 << 20)

    def shed(size, stream):
        inside.set()
        assert release.wait(60)
        h.free(first)  # a call inside the call under way still works while close() waits
        return "retry"

    h.on_oom(shed)
    result = {}

    def big():
        try:
            result["alloc"] = h.alloc(4 << 20)
        except Exception as e:
            result["alloc"] = e

    t = threading.Thread(target=big)
    t.start()
    assert inside.wait(60)
    closer = threading.Thread(target=h.close)
    closer.start()
    while not h.closed:  # close() has begun: the flag is set before it waits
        closer.join(0.001)
    closer.join(0.2)
    assert closer.is_alive(), "close() returned while an allocation was inside the heap"
    with pytest.raises(cuma.HeapClosedError):
        h.alloc(4096)
    release.set()
    t.join(60)
    closer.join(60)
    assert not closer.is_alive()
    assert isinstance(result["alloc"], int) and result["alloc"]  # the call under way finished normally
    with pytest.raises(cuma.HeapClosedError):
        h.stats()


def test_close_from_inside_an_oom_callback_is_refused():
    h = cuma.Heap("backend:sim,capacity:8M,page_size:2M", use_env=False)
    seen = []

    def close_me(size, stream):
        try:
            h.close()
        except cuma.CumaError as e:
            seen.append(e)
        return "pass"

    h.on_oom(close_me)
    h.alloc(6 << 20)
    with pytest.raises(cuma.OutOfMemoryError):
        h.alloc(4 << 20)
    assert len(seen) == 1 and "inside a call on the same heap" in str(seen[0])
    assert not h.closed
    h.free(h.alloc(4096))  # still usable
    h.close()
    assert h.closed


def test_two_threads_closing_at_once():
    for _ in range(20):
        h = cuma.Heap("backend:sim,capacity:64M", use_env=False)
        h.alloc(4096)
        ts = [threading.Thread(target=h.close) for _ in range(3)]
        for t in ts:
            t.start()
        for t in ts:
            t.join(60)
        assert h.closed


def test_shutdown_default_heaps_then_calls_raise_heap_closed_error(monkeypatch):
    monkeypatch.setenv("CUMA_CONF", "backend:sim,capacity:64M")
    d = cuma.default_heap()
    d.free(d.alloc(4096))
    cuma.shutdown_default_heaps()
    with pytest.raises(cuma.HeapClosedError):
        d.alloc(4096)
    assert cuma.default_heap() is not d  # a fresh heap, usable
    cuma.default_heap().free(cuma.default_heap().alloc(4096))


@pytest.fixture
def ledger_name():
    name = "pytest-close-%d" % os.getpid()
    yield name
    try:
        os.remove(cuma.ledger_path(name))
    except FileNotFoundError:
        pass


def test_close_from_a_pressure_callback_is_refused(ledger_name):
    """A pressure callback runs on the heap's release thread, which cuma_heap_destroy joins:
    closing the heap from there is refused, and the callback's other work goes on."""
    MB = 1 << 20
    conf = "backend:sim,capacity:64M,tcache:off,arenas:1,release_delay_ms:100000,ledger:%s," % ledger_name
    low = cuma.Heap(conf + "priority:-1", use_env=False)
    blocks = [low.alloc(4 * MB) for _ in range(12)]
    seen = []

    def shrink(nbytes):
        try:
            low.close()
        except cuma.CumaError as e:
            seen.append(e)
        while blocks:
            low.free(blocks.pop())

    low.on_pressure(shrink)
    high = cuma.Heap(conf + "priority:10,pressure_timeout_ms:3000", use_env=False)
    p = high.alloc(40 * MB)
    assert len(seen) == 1 and "inside a call on the same heap" in str(seen[0])
    assert not low.closed and not blocks
    high.free(p)
    low.close()
    high.close()
    assert low.closed and high.closed
