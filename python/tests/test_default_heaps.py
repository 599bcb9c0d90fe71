# SPDX-License-Identifier: Apache-2.0
"""The process-wide default heaps and the PyTorch entry points of libcuma
(src/shim/default_heap.c, src/shim/torch_alloc.c), called through ctypes, plus the Python
layers over them: cuma.default_heap, cuma.on_oom, cuma.torch.memory_stats,
cuma.CudaMemoryAllocator."""

import ctypes
import os
import threading
import time

import pytest

import cuma
import cuma.torch as ctorch
from conftest import cuda_driver_present

MB = 1 << 20
def test_no_backend_named_gives_no_sim_unasked(monkeypatch):
    monkeypatch.setenv("CUMA_CONF", "capacity:1G")
    if cuda_driver_present():
        assert not cuma.default_heap(0).stats()["backend"].startswith("sim")
        return
    # No CUDA driver (or a libcuma without CUDA backends): an error that says what to set,
    # never simulated memory a program would take for the GPU's
    with pytest.raises(cuma.NoDeviceError, match="backend_fallback:sim"):
        cuma.default_heap(0)
    monkeypatch.setenv("CUMA_CONF", "capacity:1G,backend_fallback:sim")  # asked for
    s = cuma.default_heap(0).stats()
    assert s["backend"] == "sim" and s["backend_fallback"] is True
    assert s["config"]["backend"] == "sim"
    assert s["device_total_bytes"] == 1 << 30  # CUMA_CONF's other keys still apply


def test_named_backend_gets_exactly_that(monkeypatch):
    monkeypatch.setenv("CUMA_CONF", "backend:sim,capacity:1G")
    assert cuma.default_heap(0).stats()["backend"] == "sim"
    cuma.shutdown_default_heaps()
    monkeypatch.setenv("CUMA_CONF", "backend:auto")  # explicit: no fallback
    if cuda_driver_present():
        assert not cuma.default_heap(0).stats()["backend"].startswith("sim")
    else:
        with pytest.raises(cuma.NoDeviceError):
            cuma.default_heap(0)


def test_default_heap_is_per_device_and_shared(monkeypatch, lib):
    monkeypatch.setenv("CUMA_CONF", "backend:sim,capacity:256M")
    h0, h1 = cuma.default_heap(0), cuma.default_heap(1)
    assert h0 is cuma.default_heap(0) and h0.handle != h1.handle
    assert lib.cuma_torch_created_heap(0) == h0.handle
    assert lib.cuma_torch_created_heap(2) is None
    assert h1.stats()["config"]["device"] == 1
    h0.close()  # a default heap cannot be closed through a wrapper
    assert not h0.closed and cuma.default_heap(0) is h0


def test_other_device_falls_back_only_without_driver(monkeypatch, lib):
    monkeypatch.setenv("CUMA_CONF", "capacity:256M,backend_fallback:sim")
    if cuda_driver_present():
        # A missing ordinal on a machine with a driver is an error, never simulated memory.
        with pytest.raises(cuma.NoDeviceError):
            cuma.default_heap(63)
    else:
        assert cuma.default_heap(3).stats()["backend_fallback"] is True
    assert lib.cuma_torch_created_heap(0) is None  # no heap made for another's sake


def test_config_error_is_not_remembered(monkeypatch):
    monkeypatch.setenv("CUMA_CONF", "backend:sim,capacity:nope")
    with pytest.raises(cuma.ConfigError, match="capacity"):
        cuma.default_heap(0)
    monkeypatch.setenv("CUMA_CONF", "backend:sim,capacity:64M")
    assert cuma.default_heap(0).stats()["config"]["capacity"] == 64 * MB


def test_torch_malloc_free_entry_points(monkeypatch, lib):
    monkeypatch.setenv("CUMA_CONF", "backend:sim,capacity:64M")
    p = lib.cuma_torch_malloc(3000, 0, None)
    assert p
    q = lib.cuma_torch_malloc(5000, 0, ctypes.c_void_p(42))
    s = cuma.default_heap(0).stats()
    assert s["requested_bytes"] == 8000 and s["active_allocs"] == 2
    lib.cuma_torch_free(p, 3000, 0, None)
    lib.cuma_torch_free(q, 5000, 0, ctypes.c_void_p(42))
    lib.cuma_torch_free(None, 0, 0, None)
    assert cuma.default_heap(0).stats()["active_allocs"] == 0
    cuma.default_heap(0).validate()


def test_torch_entry_points_log_a_trace(monkeypatch, lib, tmp_path):
    """The `trace` setting of the default heap logs what PyTorch asks for (the GPU check records
    its training loop so), in a file `cuma replay` reads; complete once the heap is gone."""
    path = tmp_path / "torch.csv"
    monkeypatch.setenv("CUMA_CONF", "backend:sim,capacity:64M,trace:%s" % path)
    p = lib.cuma_torch_malloc(3000, 0, None)
    q = lib.cuma_torch_malloc(5000, 0, ctypes.c_void_p(42))
    lib.cuma_torch_free(p, 3000, 0, None)
    assert cuma.torch.memory_stats()["cuma.config.tcache"] is False  # every call in the log
    lib.cuma_torch_free(q, 5000, 0, ctypes.c_void_p(42))
    cuma.shutdown_default_heaps()
    lines = path.read_text().splitlines()
    assert lines[0] == "Thread,Time,Action,Pointer,Size,Stream"
    rows = [line.split(",") for line in lines[1:]]
    # Frees go to the heap with no stream, the allocation's own (PyTorch 2.5-2.9 could pass
    # another allocation's stream to the free hook), which the log names.
    assert [(r[2], int(r[3], 16), int(r[4]), r[5]) for r in rows] == [
        ("allocate", p, 3000, "0"), ("allocate", q, 5000, "0x2a"),
        ("free", p, 3000, "0"), ("free", q, 5000, "0x2a")]


def test_torch_malloc_zero_negative_and_failures(monkeypatch, lib):
    monkeypatch.setenv("CUMA_CONF", "backend:sim,capacity:64M")
    assert lib.cuma_torch_malloc(0, 0, None) is None
    assert cuma._lib.last_error() == ""
    assert lib.cuma_torch_malloc(-5, 0, None) is None
    assert "negative size -5" in cuma._lib.last_error()
    assert lib.cuma_torch_malloc(16, 64, None) is None
    assert "device 64" in cuma._lib.last_error()
    assert lib.cuma_torch_malloc(100 * MB, 0, None) is None
    assert "out of memory" in cuma._lib.last_error()


def test_free_with_the_wrong_device_still_frees(monkeypatch, lib, capfd):
    monkeypatch.setenv("CUMA_CONF", "backend:sim,capacity:64M")
    p = lib.cuma_torch_malloc(4096, 0, None)
    lib.cuma_torch_free(p, 4096, 1, None)
    assert cuma.default_heap(0).stats()["active_allocs"] == 0
    assert capfd.readouterr().err == ""
    lib.cuma_torch_free(p, 4096, 0, None)  # now a double free: reported, not fatal
    err = capfd.readouterr().err
    assert err.startswith("cuma: free:") and "not a live allocation" in err


def test_record_stream_hook_finds_the_owner(monkeypatch, lib, capfd):
    monkeypatch.setenv("CUMA_CONF", "backend:sim,capacity:64M")
    cuma.default_heap(0)
    p = lib.cuma_torch_malloc(MB, 1, ctypes.c_void_p(1))  # on device 1's heap
    h1 = cuma.default_heap(1)
    h1.sim_hold_stream(2)
    lib.cuma_torch_record_stream(p, ctypes.c_void_p(2))
    lib.cuma_torch_free(p, MB, 1, ctypes.c_void_p(1))
    assert h1.stats()["requested_bytes"] == MB  # waits for stream 2
    h1.sim_release_stream(2)
    h1.poll()
    assert h1.stats()["requested_bytes"] == 0
    assert capfd.readouterr().err == ""
    # Memory cuma did not allocate (from_blob, DLPack, IPC): skipped without a word, as
    # PyTorch's own allocator skips it; it used to print an error at every call.
    lib.cuma_torch_record_stream(ctypes.c_void_p(0x1000), ctypes.c_void_p(2))
    assert capfd.readouterr().err == ""


def test_reset_and_memory_fraction_hooks(monkeypatch, lib, capfd):
    monkeypatch.setenv("CUMA_CONF", "backend:sim,capacity:64M")
    for d in (0, 1):
        lib.cuma_torch_free(lib.cuma_torch_malloc(4 * MB, d, None), 0, d, None)
        assert cuma.default_heap(d).stats()["reserved_bytes"] == 4 * MB  # kept for reuse
    lib.cuma_torch_reset()
    for d in (0, 1):
        assert cuma.default_heap(d).stats()["reserved_bytes"] == 0
    lib.cuma_torch_memory_fraction(0.25, 1)
    assert cuma.default_heap(1).stats()["limit_bytes"] == 16 * MB
    assert capfd.readouterr().err == ""
    lib.cuma_torch_memory_fraction(2.0, 1)
    assert "cuma: memory_fraction:" in capfd.readouterr().err


def test_init_hook_reports_bad_settings(monkeypatch, lib, capfd):
    monkeypatch.setenv("CUMA_CONF", "backend:sim,colour:blue")
    lib.cuma_torch_init(1)
    err = capfd.readouterr().err
    assert "cuma: init: CUMA_CONF" in err and "colour" in err
    monkeypatch.setenv("CUMA_CONF", "backend:sim")
    lib.cuma_torch_init(2)
    assert capfd.readouterr().err == ""
    assert lib.cuma_torch_created_heap(0) is None  # init creates nothing


def test_stats_json_reports_the_length_needed(monkeypatch, lib):
    monkeypatch.setenv("CUMA_CONF", "backend:sim,capacity:64M")
    small = ctypes.create_string_buffer(16)
    n = lib.cuma_torch_stats_json(0, small, 16)
    assert n > 16
    big = ctypes.create_string_buffer(n + 1)
    assert lib.cuma_torch_stats_json(0, big, n + 1) == n
    assert big.value.startswith(b'{"version"') and len(big.value) == n
    monkeypatch.setenv("CUMA_CONF", "backend:sim,capacity:bad")
    cuma.shutdown_default_heaps()
    assert lib.cuma_torch_stats_json(0, big, n + 1) == -5  # -CUMA_ERR_CONFIG


def test_first_use_from_many_threads_creates_one_heap(monkeypatch, lib):
    monkeypatch.setenv("CUMA_CONF", "backend:sim,capacity:256M")
    n = 16
    barrier = threading.Barrier(n)
    ptrs = [None] * n

    def work(i):
        barrier.wait()
        got = [lib.cuma_torch_malloc(4096 + i, 0, None) for _ in range(50)]
        ptrs[i] = got

    threads = [threading.Thread(target=work, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    h = cuma.default_heap(0)
    flat = [p for got in ptrs for p in got]
    assert all(flat) and len(set(flat)) == n * 50
    for p in flat:
        assert h.block_size(p) >= 4096  # every one from the same heap
    assert h.stats()["active_allocs"] == n * 50
    for p in flat:
        lib.cuma_torch_free(p, 0, 0, None)
    h.validate()


def test_memory_stats_uses_pytorch_key_names(monkeypatch, lib):
    monkeypatch.setenv("CUMA_CONF", "backend:sim,capacity:1G")
    p = lib.cuma_torch_malloc(3000, 0, None)
    q = lib.cuma_torch_malloc(3 * MB, 0, None)
    s = ctorch.memory_stats(0)
    assert s["requested_bytes.all.current"] == 3000 + 3 * MB
    assert s["allocated_bytes.all.current"] >= s["requested_bytes.all.current"]
    assert s["active_bytes.all.current"] == s["allocated_bytes.all.current"]
    assert s["reserved_bytes.all.current"] == 4 * MB  # two 2 MiB pages under live bytes
    assert s["allocation.all.current"] == 2 and s["active.all.current"] == 2
    assert s["num_device_alloc"] == 2 and s["num_device_free"] == 0
    assert s["num_alloc_retries"] == 0 and s["num_ooms"] == 0
    lib.cuma_torch_free(q, 0, 0, None)
    lib.cuma_torch_free(p, 0, 0, None)
    ctorch.empty_cache()
    s = ctorch.memory_stats(0)
    assert s["reserved_bytes.all.current"] == 0 and s["reserved_bytes.all.peak"] == 4 * MB
    assert s["allocated_bytes.all.current"] == 0 and s["allocated_bytes.all.peak"] >= 3000 + 3 * MB
    assert s["requested_bytes.all.peak"] == 3000 + 3 * MB
    assert s["num_device_free"] == 2 and s["allocation.all.freed"] == 2
    assert s["cuma.backend"] == "sim" and s["cuma.config.capacity"] == 1 << 30
    assert s["cuma.page_creates"] == 2 and "cuma.fragmentation" in s
    text = ctorch.memory_summary(0)
    assert "Reserved memory" in text and "backend: sim" in text and "4.00 MiB" in text
    # Nothing live: nothing stranded, however much is cached.
    assert s["cuma.stranded_bytes"] == 0 and s["cuma.fragmentation"] == 0
    assert "Stranded (in-use pages, not live)" in text and "0 B (0.00% of in use)" in text


def test_memory_stats_counts_ooms_and_retries(monkeypatch):
    monkeypatch.setenv("CUMA_CONF", "backend:sim,capacity:64M")
    alloc = cuma.CudaMemoryAllocator()
    p = alloc.allocate(60 * MB)
    calls = []
    cuma.on_oom(lambda size, stream: calls.append(size))  # passes: the failure follows
    with pytest.raises(cuma.OutOfMemoryError):
        alloc.allocate(60 * MB)
    s = ctorch.memory_stats()
    assert calls == [60 * MB]
    assert s["num_ooms"] == 1 and s["num_alloc_retries"] >= 1
    assert s["num_alloc_retries"] == s["cuma.alloc_retries"] and s["cuma.failed_allocs"] == 1
    assert s["cuma.oom_callbacks"] == 1
    alloc.free(p)


def test_module_level_on_oom(monkeypatch):
    monkeypatch.setenv("CUMA_CONF", "backend:sim,capacity:64M")
    alloc = cuma.CudaMemoryAllocator()
    held = [alloc.allocate(48 * MB)]
    seen = []

    def shed(size, stream):
        seen.append(size)
        if held:
            alloc.free(held.pop())
            return "retry"
        return False

    ids = cuma.on_oom(shed, device=[0, 1])
    assert len(ids) == 2
    p = alloc.allocate(32 * MB)
    assert seen == [32 * MB]
    alloc.free(p)
    cuma.remove_oom(ids[0], device=0)
    assert ctorch.memory_stats(0)["num_ooms"] == 1


def test_cuda_memory_allocator_conf(monkeypatch, lib):
    a = cuma.CudaMemoryAllocator("backend:sim,capacity:128M")
    assert a.allocate(0) == 0
    p = a.allocate(MB, device=0, stream=3)
    assert a.stats(0)["config"]["capacity"] == 128 * MB
    a.free(p, device=0, stream=3)
    a.free(0)
    b = cuma.CudaMemoryAllocator("backend:sim,capacity:256M")
    with pytest.raises(RuntimeError, match="already exist"):
        b.allocate(MB)
    with pytest.raises(cuma.ConfigError, match="wrong"):
        cuma.CudaMemoryAllocator("backend:sim,wrong:1").allocate(1)
    with pytest.raises(ValueError, match="device must be in 0..63"):
        a.allocate(16, device=99)
    with pytest.raises(cuma.BadPointerError):
        a.free(p)


def test_allocators_with_other_settings_in_two_threads(monkeypatch):
    """Two threads' first allocations with different settings: one makes the default heap, the
    other gets the RuntimeError (the check and the heap's creation are one step). The window
    between them is widened by slowing the check down."""
    import cuma.heap as H

    created = H._created_default_heaps

    def slow_created():
        out = created()
        time.sleep(0.2)
        return out

    monkeypatch.setattr(H, "_created_default_heaps", slow_created)
    confs = ("backend:sim,capacity:128M", "backend:sim,capacity:256M")
    results = {}

    def use(conf):
        a = cuma.CudaMemoryAllocator(conf)
        try:
            a.free(a.allocate(MB))
            results[conf] = a.stats()["config"]["capacity"]
        except RuntimeError as e:
            results[conf] = e

    threads = [threading.Thread(target=use, args=(c,)) for c in confs]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    refused = [c for c in confs if isinstance(results[c], RuntimeError)]
    assert len(refused) == 1, results
    assert "already exist" in str(results[refused[0]])
    (ok,) = [c for c in confs if c not in refused]
    assert results[ok] == int(ok.rsplit(":", 1)[1][:-1]) * MB  # it got its own settings


def test_package_exports_what_it_documents():
    for name in ("on_pressure", "remove_pressure", "ledger", "ledger_path", "on_oom", "remove_oom", "default_heap"):
        assert name in cuma.__all__
    assert all(hasattr(cuma, name) for name in cuma.__all__)
    ns = {}
    exec("from cuma import *", ns)
    assert callable(ns["ledger"]) and callable(ns["on_pressure"])
    with pytest.raises(TypeError, match="name must be a str or None, not int"):
        cuma.ledger_path(5)
    assert cuma.ledger_path("x").endswith("-x") and cuma.ledger_path() != cuma.ledger_path("x")


def test_memory_settings_act_on_the_default_heaps_only(monkeypatch):
    """set_memory_limit / set_memory_growth wrote CUMA_CONF, so a later, unrelated
    Heap("...,limit:100M") in the process (and every child) got the default heaps' limit too
    and failed at "limit of 50 pages reached" (issue 13)."""
    import os
    import subprocess
    import sys

    from cuma import adaptive

    monkeypatch.setenv("CUMA_CONF", "backend:sim,capacity:1G")
    adaptive.set_memory_limit(64 << 20)
    adaptive.set_memory_growth(False)
    assert os.environ["CUMA_CONF"] == "backend:sim,capacity:1G"
    child = subprocess.run([sys.executable, "-c", "import os; print(os.environ.get('CUMA_CONF'))"],
                           stdout=subprocess.PIPE, universal_newlines=True, check=True)
    assert child.stdout.strip() == "backend:sim,capacity:1G"
    with cuma.Heap("backend:sim,capacity:1G,limit:100M") as h:  # CUMA_CONF, then its own
        c = h.stats()
        assert c["limit_bytes"] == 100 * MB and c["config"]["growth"] is True
        p = h.alloc(90 * MB)  # over the default heaps' 64M
        h.free(p)
    d = cuma.default_heap(0).stats()
    assert d["limit_bytes"] == 64 * MB and d["reserved_bytes"] == 64 * MB  # preallocated
    assert d["device_total_bytes"] == 1 << 30  # CUMA_CONF's other keys still apply
    with pytest.raises(cuma.LimitExceededError):
        cuma.default_heap(0).alloc(100 * MB)
    cuma.shutdown_default_heaps()  # recreated with the same settings
    assert cuma.default_heap(1).stats()["limit_bytes"] == 64 * MB
    assert os.environ["CUMA_CONF"] == "backend:sim,capacity:1G"


def test_allocator_conf_leaves_cuma_conf_alone(monkeypatch):
    import os

    monkeypatch.setenv("CUMA_CONF", "backend:sim,capacity:1G,limit:16M")
    a = cuma.CudaMemoryAllocator("backend:sim,capacity:128M")  # replaces CUMA_CONF, as before
    a.free(a.allocate(MB))
    assert a.stats()["config"]["capacity"] == 128 * MB and a.stats()["config"]["limit"] is None
    assert os.environ["CUMA_CONF"] == "backend:sim,capacity:1G,limit:16M"
    with cuma.Heap() as h:
        assert h.stats()["limit_bytes"] == 16 * MB


def _config_error(call):
    with pytest.raises(cuma.ConfigError) as e:
        call()
    return str(e.value)


@pytest.mark.parametrize("bad", ["bogus", "limit:lots", "no_such_key:1", "growth:maybe"])
def test_settings_refused_alike_by_every_reader(monkeypatch, bad):
    """libcuma's config.c is the one reader of the settings grammar: a bad item is refused with
    the same message when the string is checked, when a heap is made from it, and when the
    package reads or rewrites the default heaps' settings (set_memory_limit, set_memory_growth),
    which split the string themselves before: 'bogus' became the key 'bogus' with an empty value
    and was refused as an unknown key, and 'limit:lots' was replaced by the new limit unseen."""
    from cuma import adaptive

    checked = _config_error(lambda: cuma.check_config(bad))
    assert checked.startswith("config: ")
    assert _config_error(lambda: cuma.Heap(bad, use_env=False)) == checked
    monkeypatch.setenv("CUMA_CONF", "backend:sim,capacity:256M," + bad)
    want = "CUMA_CONF: " + checked[len("config: "):]
    assert _config_error(lambda: cuma.Heap()) == want
    assert _config_error(lambda: adaptive.set_memory_limit(64 << 20)) == want
    assert _config_error(lambda: adaptive.set_memory_growth(False)) == want
    assert _config_error(lambda: adaptive.set_memory_growth(True)) == want
    assert cuma.heap._default_conf() == os.environ["CUMA_CONF"]  # nothing was given


def test_memory_settings_read_the_settings_as_a_heap_does(monkeypatch):
    """The default heaps' growth and limit are read by libcuma, with the grammar's spacing,
    spellings and last-one-wins, and a rewritten key wins over the one it replaces."""
    from cuma import adaptive

    monkeypatch.setenv("CUMA_CONF", "backend:sim,capacity:256M, growth : NO ,preallocate:16M, limit : 16M ")
    adaptive.set_memory_limit(32 << 20)  # growth is off: the preallocation follows
    conf = cuma.heap._default_conf()
    assert cuma.heap._conf_value(conf, "preallocate") == 32 << 20
    assert cuma.heap._conf_value(conf, "limit") == 32 << 20
    assert cuma.heap._conf_value(conf, "growth") is False
    adaptive.set_memory_growth(True)
    conf = cuma.heap._default_conf()
    assert "preallocate" not in conf and cuma.heap._conf_value(conf, "growth") is True
    monkeypatch.setenv("CUMA_CONF", "backend:sim,limit:16M,limit:UNLIMITED")
    with cuma.heap._conf_lock:
        cuma.heap._set_default_settings(None)
    with pytest.raises(ValueError, match="set_memory_limit"):
        adaptive.set_memory_growth(False)  # the last limit is none
