# SPDX-License-Identifier: Apache-2.0
"""Jobs sharing a device through the cross-process ledger, from Python: the pressure callback
of a low-priority heap frees memory a high-priority heap needs; cuma.ledger() lists both; bad
arguments raise. Simulated heaps in a ledger named for this test, removed afterwards."""

import os
import subprocess
import sys
import threading

import pytest

import cuma

MB = 1 << 20


@pytest.fixture
def ledger_name():
    name = "pytest-%d" % os.getpid()
    yield name
    try:
        os.remove(cuma.ledger_path(name))
    except FileNotFoundError:
        pass


def _heap(name, extra):
    return cuma.Heap(
        "backend:sim,capacity:64M,tcache:off,arenas:1,release_delay_ms:100000,ledger:%s,%s" % (name, extra),
        use_env=False,
    )


def test_pressure_callback_frees_for_higher_priority(ledger_name):
    low = _heap(ledger_name, "priority:-1,guarantee:8M")
    blocks = [low.alloc(4 * MB) for _ in range(12)]  # 48M in use
    asked = []
    freed = threading.Event()

    def shrink(nbytes):
        asked.append(nbytes)
        while blocks and nbytes > 0:
            low.free(blocks.pop())
            nbytes -= 4 * MB
        freed.set()

    cb = low.on_pressure(shrink)
    high = _heap(ledger_name, "priority:10,pressure_timeout_ms:3000")
    p = high.alloc(40 * MB)  # 16M free: 24M must come from the low-priority heap
    assert freed.is_set() and len(asked) == 1
    assert 24 * MB <= asked[0] <= 40 * MB  # its use beyond the guarantee, at most
    s_low, s_high = low.stats(), high.stats()
    assert s_low["pressure_callbacks"] == 1 and s_high["pressure_asks"] == 1
    assert s_low["reserved_bytes"] + s_high["reserved_bytes"] <= 64 * MB
    assert s_high["ledger"]["priority"] == 10
    entries = {e["pid"]: e for e in cuma.ledger(ledger_name)}
    assert list(entries) == [os.getpid()]  # both heaps are this process's
    heaps = sorted(cuma.ledger(ledger_name), key=lambda e: e["priority"])
    assert [e["priority"] for e in heaps] == [-1, 10]
    assert heaps[0]["guarantee"] == 8 * MB and heaps[0]["device"] == "sim"
    assert heaps[1]["reserved"] == s_high["reserved_bytes"]
    assert heaps[0]["pressure_callbacks"] == 1
    low.remove_pressure(cb)
    with pytest.raises(cuma.InvalidArgumentError, match="no callback with id"):
        low.remove_pressure(cb)
    high.free(p)
    low.validate()
    high.validate()
    for b in blocks:
        low.free(b)
    high.close()
    low.close()
    assert cuma.ledger(ledger_name) == []


def test_ledger_names_the_pod(ledger_name, monkeypatch):
    # The downward API's variables, read when the heap joins: the exporter's pod labels.
    monkeypatch.setenv("POD_NAME", "trainer-7f9c4")
    monkeypatch.setenv("POD_NAMESPACE", "ml-jobs")
    monkeypatch.setenv("CONTAINER_NAME", "x" * 100)  # cut to fit, never overflowing
    with _heap(ledger_name, ""):
        (e,) = cuma.ledger(ledger_name)
        assert e["pod"] == "trainer-7f9c4" and e["pod_namespace"] == "ml-jobs"
        assert e["container"] == "x" * 63
    monkeypatch.delenv("POD_NAME")
    monkeypatch.delenv("POD_NAMESPACE")
    monkeypatch.delenv("CONTAINER_NAME")
    with _heap(ledger_name, ""):
        (e,) = cuma.ledger(ledger_name)
        assert e["pod"] == "" and e["pod_namespace"] == "" and e["container"] == ""


def test_ledger_errors(ledger_name):
    with pytest.raises(cuma.CumaIOError, match="no heap has joined it"):
        cuma.ledger("pytest-nobody-made-this-%d" % os.getpid())
    with pytest.raises(cuma.ConfigError, match="ledger"):
        cuma.Heap("backend:sim,ledger:a/b", use_env=False)
    with pytest.raises(TypeError):
        cuma.ledger(3)
    with _heap(ledger_name, "") as h:
        with pytest.raises(TypeError):
            h.on_pressure(None)
    with _heap(ledger_name, "guarantee:60M"):
        with pytest.raises(cuma.LimitExceededError, match="guarantee"):
            _heap(ledger_name, "guarantee:8M")


def test_dynamic_batcher_yields_to_a_higher_priority_job(ledger_name):
    """A training loop in a low-priority heap halves its batch when a high-priority heap on the
    same device needs memory; the memory its batches held goes back and the other job gets it."""
    from cuma import adaptive

    low = _heap(ledger_name, "priority:-1,release_delay_ms:100000")
    released = []

    def release():
        low.trim(0)
        released.append(1)

    source = [list(range(8)) for _ in range(100)]  # batches of 8 samples
    batcher = adaptive.DynamicBatcher(source, batch_size=8, grow_after=10**6, release=release)
    asked = threading.Event()

    def on_pressure(nbytes):
        batcher.yield_memory()
        asked.set()

    low.on_pressure(on_pressure)
    high = _heap(ledger_name, "priority:10,pressure_timeout_ms:3000")
    sizes = []
    p = None
    it = iter(batcher)
    for step in range(12):
        piece = next(it)
        sizes.append(len(piece))
        # A step holds 4 MiB a sample while it runs (8 samples: 32M of the device's 64M).
        blocks = [low.alloc(4 * MB) for _ in piece]
        if step == 3:
            # Meanwhile another job needs 40M: 32M are free; the low job's loop is asked.
            done = threading.Event()
            out = []

            def grab():
                out.append(high.alloc(40 * MB))
                done.set()

            t = threading.Thread(target=grab)
            t.start()
            # The step is still running when the request comes (else its memory would just be
            # idle cache by then, given back without asking anyone to shrink).
            assert asked.wait(5)
        for b in blocks:
            low.free(b)
        if step == 3:
            t.join(5)
            p = out[0] if out else None
    assert p is not None, "the high-priority job did not get its memory"
    assert batcher.num_yields == 1 and released
    assert sizes[:4] == [8, 8, 8, 8] and sizes[4:] == [4] * 8
    assert high.stats()["pressure_asks"] == 1
    high.free(p)
    high.close()
    low.close()


def test_ledger_pair_script_on_the_simulated_device():
    """scripts/gpu/ledger_pair.py (the GPU check's two jobs on one device) on a simulated device
    shared through a ledger: the taker gets the holder's idle cache without a pressure callback,
    then memory in use that the holder's callback frees."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    p = subprocess.run([sys.executable, os.path.join(root, "scripts", "gpu", "ledger_pair.py"),
                        "--conf", "backend:sim,capacity:1G"], stdout=subprocess.PIPE,
                       stderr=subprocess.PIPE, universal_newlines=True, timeout=120)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "LEDGER RESULT: idle cache: taken in" in p.stdout and "in use: taken in" in p.stdout


def test_default_heap_in_a_ledger_shows_in_torch_summary(ledger_name, monkeypatch):
    monkeypatch.setenv("CUMA_CONF", "backend:sim,capacity:64M,ledger:%s,priority:7" % ledger_name)
    s = cuma.torch.memory_stats()
    assert s["cuma.ledger"]["priority"] == 7 and s["cuma.pressure_asks"] == 0
    assert "Ledger denials / asks of others" in cuma.torch.memory_summary()
    assert [e["priority"] for e in cuma.ledger(ledger_name)] == [7]
    cuma.shutdown_default_heaps()
    assert cuma.ledger(ledger_name) == []


def test_ledger_shows_the_heaps_allocator_figures(ledger_name):
    """What `cuma stats` reads from outside: the figures the release thread publishes equal the
    heap's own stats once the program stops changing them (a field out of place in the ctypes
    mirror, or one published from the wrong counter, shows as a mismatch)."""
    import time

    with _heap(ledger_name, "page_size:1M") as h:
        first = cuma.ledger(ledger_name)[0]
        assert first["backend"] == "sim"
        blocks = [h.alloc((i + 1) * 300 * 1024) for i in range(9)]
        for b in blocks[::2]:
            h.free(b)
        h.trim()
        h.compact(lambda old, new, size: False)  # compactions 1 (nothing moves)
        with pytest.raises(cuma.OutOfMemoryError):
            h.alloc(200 * MB)  # past the 64M device: no OOM callbacks yet, an OOM all the same
        h.on_oom(lambda size, stream: False)
        h.on_oom(lambda size, stream: False)
        with pytest.raises(cuma.OutOfMemoryError):
            h.alloc(63 * MB)  # fits the device, not next to the 6M in use: both callbacks run
        s = h.stats()
        deadline = time.monotonic() + 30  # a bound on a hang (it publishes every few ms)
        while True:
            e = cuma.ledger(ledger_name)[0]
            if e["num_allocs"] == s["num_allocs"] and e["failed_allocs"] == s["failed_allocs"]:
                break
            assert time.monotonic() < deadline, "figures not published within 30 s: %r" % e
            time.sleep(0.02)
        assert e["stats_age_ns"] is not None and e["stats_age_ns"] < 5 * 10**9
        # The ledger's figures of the list, under the names of Heap.stats(); fragmentation,
        # which the ledger keeps in parts per million, below.
        names = [f["name"] for f in cuma._lib.stat_fields() if f["ledger"]]
        names.remove("fragmentation")
        assert len(names) == 23 and "page_call_ns" in names
        names.remove("page_call_ns")  # the sim's page calls time the host: not equal twice
        got = {k: e[k] for k in names}
        want = {k: s[k] for k in names}
        assert got == want
        assert e["num_allocs"] == 9 and e["num_frees"] == 5 and e["active_allocs"] == 4
        assert e["failed_allocs"] == 2 and e["ooms"] == 2 and e["oom_callbacks"] == 2
        assert e["trims"] >= 1
        assert e["page_size"] == MB and e["page_creates"] > 0
        assert e["fragmentation"] == pytest.approx(s["fragmentation"], abs=1e-6)
        for b in blocks[1::2]:
            h.free(b)


def test_keyboard_interrupt_in_a_pressure_callback_reaches_the_main_thread(ledger_name):
    """A pressure callback runs on the release thread, where no Python caller can receive a
    KeyboardInterrupt: it is raised again in the main thread, not turned into a warning."""
    import time
    import warnings

    low = _heap(ledger_name, "priority:-1")
    blocks = [low.alloc(4 * MB) for _ in range(12)]
    called = threading.Event()

    def interrupted(nbytes):
        called.set()
        raise KeyboardInterrupt()

    low.on_pressure(interrupted)
    high = _heap(ledger_name, "priority:10,pressure_timeout_ms:500")
    got = []
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a warning instead of the interrupt fails the test
        with pytest.raises(KeyboardInterrupt):
            try:
                got.append(high.alloc(40 * MB))
            except cuma.OutOfMemoryError:
                pass  # nothing was freed: the interrupt comes all the same
            assert called.wait(5)
            for _ in range(5000):
                time.sleep(0.001)
    for p in got:
        high.free(p)
    for b in blocks:
        low.free(b)
    high.close()
    low.close()
