# SPDX-License-Identifier: Apache-2.0
"""cuma.Heap on the simulated device: allocation, stats, trim, validate, errors, OOM
callbacks, argument checks."""

import gc
import threading
import time
import warnings
import weakref

import pytest

import cuma

MB = 1 << 20
SIM = "backend:sim,capacity:64M,page_size:2M"


def test_alloc_free_stats_trim_validate(sim_heap):
    h = sim_heap
    a = h.alloc(1000)
    b = h.alloc(3 * MB, stream=0)
    assert isinstance(a, int) and a % 256 == 0 and b % 256 == 0 and a != b
    assert h.block_size(a) >= 1000
    s = h.stats()
    assert s["backend"] == "sim"
    assert s["requested_bytes"] == 1000 + 3 * MB
    assert s["active_allocs"] == 2 and s["num_allocs"] == 2
    assert s["reserved_bytes"] >= s["requested_bytes"]
    assert s["config"]["capacity"] == 64 * MB
    h.validate()
    h.free(b)
    h.free(a)
    s = h.stats()
    assert s["requested_bytes"] == 0 and s["active_allocs"] == 0 and s["num_frees"] == 2
    assert s["reserved_bytes"] > 0  # kept for reuse (page cache or the thread's cache)
    h.trim(0)
    s = h.stats()
    assert s["reserved_bytes"] == 0 and s["page_releases"] == s["page_creates"]
    assert s["peak_requested_bytes"] == 1000 + 3 * MB
    h.reset_peaks()
    assert h.stats()["peak_requested_bytes"] == 0
    h.poll()
    h.validate()


def test_trim_keeps_bytes(sim_heap):
    h = sim_heap
    ptrs = [h.alloc(2 * MB) for _ in range(4)]
    for p in ptrs:
        h.free(p)
    assert h.stats()["reserved_bytes"] == 8 * MB
    h.trim(4 * MB)
    assert h.stats()["cached_bytes"] == 4 * MB
    h.validate()


def test_free_none_and_zero_are_noops(sim_heap):
    sim_heap.free(None)
    sim_heap.free(0)
    assert sim_heap.stats()["num_frees"] == 0


def test_double_free_raises_bad_pointer(sim_heap):
    p = sim_heap.alloc(4096)
    sim_heap.free(p)
    with pytest.raises(cuma.BadPointerError) as ei:
        sim_heap.free(p)
    assert "freed twice" in str(ei.value) and hex(p)[2:] in str(ei.value)
    assert isinstance(ei.value, cuma.CumaError) and isinstance(ei.value, ValueError)
    assert ei.value.status == 4
    with pytest.raises(cuma.BadPointerError, match="not allocated by this heap"):
        sim_heap.free(0x1234)
    sim_heap.validate()


def test_oom_raises_out_of_memory_with_message(sim_heap):
    keep = sim_heap.alloc(60 * MB)
    with pytest.raises(cuma.OutOfMemoryError) as ei:
        sim_heap.alloc(10 * MB)
    e = ei.value
    assert isinstance(e, MemoryError) and isinstance(e, cuma.CumaError)
    msg = str(e)
    assert "out of memory" in msg and str(10 * MB) in msg
    assert sim_heap.stats()["failed_allocs"] == 1
    sim_heap.free(keep)
    sim_heap.validate()


def test_limit_raises_limit_exceeded(sim_heap):
    sim_heap.set_limit(8 * MB)
    assert sim_heap.stats()["limit_bytes"] == 8 * MB
    with pytest.raises(cuma.OutOfMemoryError) as ei:
        sim_heap.alloc(16 * MB)
    assert isinstance(ei.value, cuma.LimitExceededError) and ei.value.status == 3
    assert "limit" in str(ei.value)
    sim_heap.set_limit(None)
    p = sim_heap.alloc(16 * MB)
    sim_heap.free(p)
    sim_heap.set_memory_fraction(0.5)
    assert sim_heap.stats()["limit_bytes"] == 32 * MB


def test_oom_callbacks_run_in_order_and_retry(sim_heap):
    h = sim_heap
    big = h.alloc(48 * MB)
    calls = []

    def first(size, stream):
        calls.append(("first", size))
        return None  # pass

    def second(size, stream):
        calls.append(("second", size))
        h.free(big)  # a callback may free memory on the same heap
        return "retry"

    h.on_oom(first)
    h.on_oom(second)
    p = h.alloc(32 * MB)
    assert calls == [("first", 32 * MB), ("second", 32 * MB)]
    s = h.stats()
    assert s["ooms"] == 1 and s["oom_callbacks"] == 2 and s["active_allocs"] == 1
    h.free(p)
    h.validate()


def test_oom_callback_true_means_retry_and_remove(sim_heap):
    h = sim_heap
    held = [h.alloc(48 * MB)]

    def cb(size, stream):
        if held:
            h.free(held.pop())
        return True

    cid = h.on_oom(cb)
    h.free(h.alloc(32 * MB))
    h.remove_oom(cid)
    keep = h.alloc(48 * MB)
    with pytest.raises(cuma.OutOfMemoryError):
        h.alloc(32 * MB)  # no callback left
    h.free(keep)
    with pytest.raises(cuma.InvalidArgumentError, match="no callback with id"):
        h.remove_oom(cid)


def test_oom_callback_exception_is_the_cause(sim_heap):
    h = sim_heap
    keep = h.alloc(60 * MB)

    def broken(size, stream):
        raise KeyError("boom")

    h.on_oom(broken)
    with pytest.raises(cuma.OutOfMemoryError) as ei:
        h.alloc(10 * MB)
    assert isinstance(ei.value.__cause__, KeyError)
    h.free(keep)


def test_record_stream_defers_reuse_until_the_stream_is_done(sim_heap):
    h = sim_heap
    p = h.alloc(MB, stream=1)
    h.record_stream(p, 2)
    h.sim_hold_stream(2)
    h.free(p, stream=1)
    assert h.stats()["requested_bytes"] == MB  # stream 2 may still use it
    h.sim_release_stream(2)
    h.poll()
    assert h.stats()["requested_bytes"] == 0
    h.validate()


def test_retired_streams_free_their_slots(sim_heap):
    h = sim_heap
    # 1000 streams one after another: past the table's 256 slots only if retired ones go.
    for i in range(1000):
        p = h.alloc(4096, stream=0x1000 + i)
        h.free(p, stream=0x1000 + i)
        h.retire_stream(0x1000 + i)
    h.retire_stream(0x99999)  # never seen: nothing to do
    with pytest.raises(ValueError, match="never destroyed"):
        h.retire_stream(None)
    h.validate()


class FakeTorchStream:
    cuda_stream = 7


def test_stream_objects_are_accepted(sim_heap):
    p = sim_heap.alloc(4096, stream=FakeTorchStream())
    sim_heap.free(p, stream=FakeTorchStream())


def test_threads_allocate_concurrently(sim_heap):
    errors = []

    def work(seed):
        try:
            ptrs = []
            for i in range(300):
                ptrs.append(sim_heap.alloc(512 + (seed * 131 + i * 977) % 70000, stream=seed % 3))
                if i % 3 == 2:
                    sim_heap.free(ptrs.pop(0))
            for p in ptrs:
                sim_heap.free(p)
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    s = sim_heap.stats()
    assert s["active_allocs"] == 0 and s["num_allocs"] == 8 * 300
    sim_heap.validate()


@pytest.mark.parametrize(
    "call, exc, words",
    [
        (lambda h: h.alloc(-1), ValueError, "size must be >= 0"),
        (lambda h: h.alloc(0), ValueError, "size must be > 0"),
        (lambda h: h.alloc(1.5), TypeError, "size must be an int, not float"),
        (lambda h: h.alloc("10"), TypeError, "size must be an int, not str"),
        (lambda h: h.alloc(True), TypeError, "size must be an int, not bool"),
        (lambda h: h.alloc(1 << 70), ValueError, "does not fit in 64 bits"),
        (lambda h: h.alloc(10, stream="s"), TypeError, "stream must be an int handle"),
        (lambda h: h.alloc(10, stream=-1), ValueError, "not a valid pointer"),
        (lambda h: h.free("p"), TypeError, "ptr must be an int"),
        (lambda h: h.free(-5), ValueError, "ptr must be >= 0"),
        (lambda h: h.trim(-1), ValueError, "keep_bytes must be >= 0"),
        (lambda h: h.set_limit(-1), ValueError, "nbytes must be >= 0"),
        (lambda h: h.set_memory_fraction(1.5), ValueError, "fraction must be in (0, 1]"),
        (lambda h: h.set_memory_fraction("half"), TypeError, "fraction must be a number"),
        (lambda h: h.on_oom(5), TypeError, "callback must be callable"),
        (lambda h: h.record_stream(0, 1), ValueError, "must be a live allocation"),
    ],
)
def test_bad_arguments_raise_python_errors(sim_heap, call, exc, words):
    with pytest.raises(exc) as ei:
        call(sim_heap)
    assert words in str(ei.value)
    assert not isinstance(ei.value, cuma.CumaError)  # caught before C


def test_numpy_ints_are_accepted(sim_heap):
    np = pytest.importorskip("numpy")
    p = sim_heap.alloc(np.int64(4096))
    sim_heap.free(np.uint64(p))


def test_closed_heap_and_context_manager():
    with cuma.Heap(SIM, use_env=False) as h:
        h.free(h.alloc(100))
    assert h.closed
    with pytest.raises(ValueError, match="closed"):
        h.alloc(100)
    h.close()  # idempotent
    assert "closed" in repr(h)


def test_config_errors_name_the_key():
    with pytest.raises(cuma.ConfigError) as ei:
        cuma.Heap("backend:sim,bogus_key:1")
    assert "bogus_key" in str(ei.value) and isinstance(ei.value, ValueError)
    with pytest.raises(cuma.ConfigError, match="'capacity'"):
        cuma.Heap("backend:sim,capacity:lots")
    with pytest.raises(cuma.ConfigError, match="backend"):
        cuma.check_config("backend:tpu")
    cuma.check_config("backend:sim,limit:2G")
    with pytest.raises(TypeError, match="conf must be a str"):
        cuma.Heap(conf=5)
    with pytest.raises(ValueError, match="device must be in 0..63"):
        cuma.Heap("backend:sim", device=64)


def test_heap_reads_cuma_conf_unless_told_not_to(monkeypatch):
    monkeypatch.setenv("CUMA_CONF", "capacity:32M")
    with cuma.Heap("backend:sim") as h:
        assert h.stats()["config"]["capacity"] == 32 * MB
    with cuma.Heap("backend:sim", use_env=False) as h:
        assert h.stats()["config"]["capacity"] != 32 * MB


def test_config_keys_table():
    keys = {k.name: k for k in cuma.config_keys()}
    assert {"backend", "capacity", "limit", "growth", "preallocate"} <= set(keys)
    assert "auto" in keys["backend"].choices and keys["backend"].default == "auto"
    assert keys["capacity"].meaning
    assert "KEY" in cuma.config_table().splitlines()[0]


def test_sim_clock_controls():
    with cuma.Heap(SIM + ",sim_clock:manual,release_delay_ms:10", use_env=False) as h:
        h.sim_set_time(1000)
        assert h.sim_time() == 1000
        h.free(h.alloc(MB))
        assert h.stats()["reserved_bytes"] == 2 * MB
        # Idle memory goes back once the clock passes the release delay (plus any time it
        # sits in a thread cache first); poll() runs the policy at the simulated time.
        t = 1000
        while h.stats()["reserved_bytes"] and t < 10**9:
            due = h.next_release()
            t = max(t + 1000000, due if due is not None else 0)
            h.sim_set_time(t)
            h.poll()
        assert h.stats()["reserved_bytes"] == 0 and t < 10**9
        assert h.next_release() is None


# --- OOM callbacks: nesting, Ctrl-C, answers, removal ---


@pytest.mark.parametrize("nested_first", [False, True])
def test_nested_alloc_in_a_callback_keeps_the_outer_callback_errors(sim_heap, nested_first):
    h = sim_heap
    keep = h.alloc(60 * MB)

    def broken(size, stream):
        raise KeyError("first callback failed")

    def allocates(size, stream):
        h.free(h.alloc(MB))  # a nested allocation on the same heap (it succeeds)
        return None

    for cb in ((allocates, broken) if nested_first else (broken, allocates)):
        h.on_oom(cb)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the KeyError is the cause, not a warning
        with pytest.raises(cuma.OutOfMemoryError) as ei:
            h.alloc(10 * MB)
    assert isinstance(ei.value.__cause__, KeyError)
    h.free(keep)


@pytest.mark.parametrize("fatal", [KeyboardInterrupt, SystemExit])
def test_keyboard_interrupt_in_an_oom_callback_reaches_the_caller(sim_heap, fatal):
    h = sim_heap
    keep = h.alloc(60 * MB)
    later = []

    def interrupted(size, stream):
        raise fatal()

    h.on_oom(interrupted)
    h.on_oom(lambda size, stream: later.append(size))
    with pytest.raises(fatal):
        h.alloc(10 * MB)
    assert later == []  # nothing more ran once it was raised
    assert h.stats()["active_allocs"] == 1

    # Raised after a callback freed enough: the memory served anyway goes back.
    h2 = cuma.Heap(SIM, use_env=False)
    held = [h2.alloc(60 * MB)]

    def frees_then_interrupted(size, stream):
        h2.free(held.pop())
        raise fatal()

    h2.on_oom(frees_then_interrupted)
    with pytest.raises(fatal):
        h2.alloc(10 * MB)
    assert h2.stats()["active_allocs"] == 0
    h2.close()
    h.free(keep)


@pytest.mark.parametrize("sigint", ["python's handler", "ignored"])
def test_keyboard_interrupt_in_a_callback_without_a_python_caller(monkeypatch, lib, sigint):
    """An OOM callback run for an allocation that did not come through Heap.alloc (here
    PyTorch's entry point, called directly): the KeyboardInterrupt is raised again in the
    main thread. Also where the process ignores SIGINT (a job that a shell without job
    control started in the background): interrupt_main() does nothing there, and the
    callback's KeyboardInterrupt was lost (seen in a make test run started so)."""
    import signal

    monkeypatch.setenv("CUMA_CONF", "backend:sim,capacity:64M,page_size:2M")
    keep = cuma.default_heap(0).alloc(60 * MB)
    cuma.on_oom(lambda size, stream: (_ for _ in ()).throw(KeyboardInterrupt()))
    before = signal.signal(signal.SIGINT, signal.SIG_IGN if sigint == "ignored" else signal.default_int_handler)
    try:
        with pytest.raises(KeyboardInterrupt):
            assert lib.cuma_torch_malloc(10 * MB, 0, None) is None
            for _ in range(1000):  # the main thread's next bytecodes see the interrupt
                time.sleep(0.001)
    finally:
        signal.signal(signal.SIGINT, before)
    cuma.default_heap(0).free(keep)


# Run in a child: pytest swaps sys.unraisablehook around every test, which would hide the
# wrapper being tested. Ctrl-C (interrupt_main, from a thread) arrives while the main thread
# waits in C for another thread's run of the OOM callbacks; the main thread then runs them
# itself, and Python raises the interrupt at the trampoline's first line, outside its try.
CTRL_C_WHILE_WAITING = r"""
import _thread, json, os, signal, sys, threading, time, types
# The Ctrl-C below comes through the SIGINT handler: installed whatever the test was started
# with (a shell without job control leaves SIGINT ignored for background jobs).
signal.signal(signal.SIGINT, signal.default_int_handler)
import cuma
import cuma.heap
from cuma import _lib

MB = 1 << 20
SIM = "backend:sim,capacity:64M,page_size:2M"
user_reports = []
sys.unraisablehook = lambda args: user_reports.append(args.exc_type.__name__)  # the user's own


def ctrl_c_while_waiting(heap, allocate):
    keep = heap.alloc(60 * MB)
    started = threading.Event()

    def slow(size, stream):
        if threading.current_thread() is not threading.main_thread():
            started.set()
            time.sleep(0.3)  # the main thread waits in C for this run by now
            _thread.interrupt_main()
            time.sleep(0.1)

    cid = heap.on_oom(slow)

    def worker():
        try:
            heap.alloc(10 * MB)
        except cuma.OutOfMemoryError:
            pass

    t = threading.Thread(target=worker)
    t.start()
    try:
        started.wait()
        allocate()
        for _ in range(500):  # a KeyboardInterrupt raised again in the main thread lands here
            time.sleep(0.001)
        got = "lost"
    except cuma.OutOfMemoryError:
        got = "lost"
    except KeyboardInterrupt:
        got = "raised"
    t.join()
    heap.remove_oom(cid)
    heap.free(keep)
    return got


out = {}
h = cuma.Heap(SIM, use_env=False)
out["alloc"] = ctrl_c_while_waiting(h, lambda: h.alloc(10 * MB))
# Python >= 3.13 reports a ctypes callback's exception with no object: only the traceback.
wrapper = sys.unraisablehook
sys.unraisablehook = lambda a: wrapper(types.SimpleNamespace(
    exc_type=a.exc_type, exc_value=a.exc_value, exc_traceback=a.exc_traceback, err_msg=a.err_msg, object=None))
out["alloc, no object"] = ctrl_c_while_waiting(h, lambda: h.alloc(10 * MB))
sys.unraisablehook = wrapper
os.environ["CUMA_CONF"] = SIM  # PyTorch's entry point: no Heap.alloc to raise it from
out["torch entry point"] = ctrl_c_while_waiting(
    cuma.default_heap(0), lambda: _lib.lib().cuma_torch_malloc(10 * MB, 0, None))
for _ in range(3):  # more callbacks, more heaps: still one wrapper over the user's hook
    cuma.Heap(SIM, use_env=False).on_pressure(lambda n: None)
ours = getattr(cuma._callbacks, "_unraisablehook", None)
out["wrapped once"] = ours is not None and sys.unraisablehook is ours and cuma._callbacks._previous_unraisablehook not in (
    None, ours)


class Broken:
    def __del__(self):
        raise ValueError("not cuma's")


Broken()
out["user hook"] = user_reports
print(json.dumps(out))
"""


def test_ctrl_c_before_a_callbacks_try_is_not_lost():
    import json
    import os
    import subprocess
    import sys

    env = dict(os.environ)
    env.pop("CUMA_CONF", None)
    env["PYTHONPATH"] = os.path.dirname(os.path.dirname(os.path.abspath(cuma.__file__)))
    p = subprocess.run([sys.executable, "-c", CTRL_C_WHILE_WAITING], env=env, stdout=subprocess.PIPE,
                       stderr=subprocess.PIPE, universal_newlines=True, timeout=120)
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout.strip().splitlines()[-1])
    assert "Exception ignored" not in p.stderr, p.stderr
    assert out == {
        "alloc": "raised",
        "alloc, no object": "raised",
        "torch entry point": "raised",
        "wrapped once": True,
        "user hook": ["ValueError"],  # everything else still reaches the user's hook
    }, (out, p.stderr)


ANSWERS = {  # an OOM callback's answer -> whether it asks for a retry
    "np.True_": (lambda np, torch: np.True_, True),
    "np.int64(1)": (lambda np, torch: np.int64(1), True),
    "np.array(True)": (lambda np, torch: np.array(True), True),
    "torch.tensor(True)": (lambda np, torch: torch.tensor(True), True),
    "torch.tensor(1)": (lambda np, torch: torch.tensor(1), True),
    "np.False_": (lambda np, torch: np.False_, False),
    "np.int64(0)": (lambda np, torch: np.int64(0), False),
    "np.float64(1.0)": (lambda np, torch: np.float64(1.0), False),  # not an integer
    "torch.ones(2)": (lambda np, torch: torch.ones(2), False),  # not one value
}


@pytest.mark.parametrize("answer", list(ANSWERS))
def test_numpy_and_torch_answers_count_like_python_ones(sim_heap, answer):
    np = pytest.importorskip("numpy")
    torch = pytest.importorskip("torch") if answer.startswith("torch") else None
    make, retry = ANSWERS[answer]
    value = make(np, torch)
    h = sim_heap
    held = [h.alloc(60 * MB)]

    def cb(size, stream):
        if held:
            h.free(held.pop())
        return value

    h.on_oom(cb)
    if retry:  # the freed memory serves the allocation
        h.free(h.alloc(10 * MB))
    else:  # pass: nothing else frees, so it fails even though memory is free now
        with pytest.raises(cuma.OutOfMemoryError):
            h.alloc(10 * MB)


def test_removed_callbacks_release_what_they_hold(sim_heap):
    class Big:
        pass

    refs, calls = [], []
    for _ in range(5):
        big = Big()
        refs.append(weakref.ref(big))
        cid = sim_heap.on_oom(lambda size, stream, big=big: calls.append(big))
        sim_heap.remove_oom(cid)
        pid = sim_heap.on_pressure(lambda nbytes, big=big: calls.append(big))
        sim_heap.remove_pressure(pid)
        del big
    gc.collect()
    assert all(r() is None for r in refs)
    keep = sim_heap.alloc(60 * MB)
    with pytest.raises(cuma.OutOfMemoryError):
        sim_heap.alloc(10 * MB)
    assert calls == []
    sim_heap.free(keep)


def test_removed_default_heap_callbacks_release_what_they_hold(monkeypatch):
    monkeypatch.setenv("CUMA_CONF", "backend:sim,capacity:64M")

    class Big:
        pass

    big = Big()
    ref = weakref.ref(big)
    cuma.remove_oom(cuma.on_oom(lambda size, stream, big=big: None))
    cuma.remove_pressure(cuma.on_pressure(lambda nbytes, big=big: None))
    del big
    gc.collect()
    assert ref() is None


@pytest.mark.parametrize(
    "call, words",
    [
        (lambda h, cid: h.trim(1 << 64), "keep_bytes 18446744073709551616 does not fit in 64 bits"),
        (lambda h, cid: h.sim_set_time((1 << 64) + 5000), "ns 18446744073709556616 does not fit in 64 bits"),
        (lambda h, cid: h.set_limit(1 << 64), "nbytes 18446744073709551616 does not fit in 64 bits"),
        (lambda h, cid: h.remove_oom((1 << 32) + cid), "is not an id from on_oom"),  # would wrap to cid
        (lambda h, cid: h.remove_pressure(1 << 31), "is not an id from on_oom"),
    ],
    ids=["trim", "sim_set_time", "set_limit", "remove_oom", "remove_pressure"],
)
def test_values_past_the_c_types_are_refused(call, words):
    with cuma.Heap(SIM + ",sim_clock:manual", use_env=False) as h:
        cid = h.on_oom(lambda size, stream: None)
        h.sim_set_time(1000)
        with pytest.raises(ValueError) as ei:
            call(h, cid)
        assert words in str(ei.value) and not isinstance(ei.value, cuma.CumaError)
        assert h.sim_time() == 1000 and cid in h._callbacks  # nothing wrapped around and applied
