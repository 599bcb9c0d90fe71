# SPDX-License-Identifier: Apache-2.0
"""trace_stacks:on from Python: Heap.alloc records the program's Python frames (file, line,
function) as the allocation's stack in LOG.stacks, without the package's own frames; a heap
without trace_stacks never builds a Python stack."""

import inspect
import os
import sys

import cuma
import cuma.allocator
from cuma import _pystack

SIM = "backend:sim,capacity:64M,page_size:2M"


def _records(path):
    """LOG.stacks as (F frames by id, P stacks by id, ids of S stacks)."""
    frames, stacks, native = {}, {}, set()
    with open(path) as f:
        assert f.readline() == "cuma-stacks 2\n"
        for line in f:
            kind, rest = line[0], line[2:].rstrip("\n")
            if kind == "F":
                fid, lineno, tail = rest.split(" ", 2)
                file, name = tail.split("\t", 1)
                frames[int(fid)] = (file, int(lineno), name)
            elif kind == "P":
                ids = [int(x) for x in rest.split()]
                stacks[ids[0]] = [frames[i] for i in ids[1:]]
            elif kind == "S":
                native.add(int(rest.split()[0]))
    return frames, stacks, native


def _line_of(fn, text):
    lines, start = inspect.getsourcelines(fn)
    return start + next(i for i, ln in enumerate(lines) if text in ln)


def test_alloc_records_python_frames(tmp_path):
    log = str(tmp_path / "t.csv")
    with cuma.Heap(SIM + ",trace:%s,trace_stacks:on" % log, use_env=False) as h:

        def leaky(heap):
            return heap.alloc(4096)  # here

        def caller(heap):
            return leaky(heap)

        p = caller(h)
        h.free(p)
        q = cuma.Heap.alloc(h, 8192)  # through the unbound method too
        h.free(q)
    frames, stacks, native = _records(log + ".stacks")
    assert not native  # no native stack was captured
    first = stacks[1]
    here = os.path.abspath(__file__)
    assert first[0] == (here, _line_of(leaky, "# here"), "test_alloc_records_python_frames.<locals>.leaky")
    assert first[1][2].endswith("caller") and first[2][2] == "test_alloc_records_python_frames"
    package = os.path.dirname(os.path.abspath(cuma.__file__))
    assert not any(os.path.dirname(os.path.abspath(f[0])) == package for f in frames.values())
    assert stacks[2][0][2] == "test_alloc_records_python_frames"


def test_deep_stacks_are_cut_at_32_frames(tmp_path):
    log = str(tmp_path / "deep.csv")
    with cuma.Heap(SIM + ",trace:%s,trace_stacks:on" % log, use_env=False) as h:

        def down(n):
            if n:
                return down(n - 1)
            return h.alloc(4096)

        h.free(down(60))
    _, stacks, _ = _records(log + ".stacks")
    assert len(stacks[1]) == _pystack.MAX_FRAMES
    assert all(f[2].endswith("down") for f in stacks[1])


def test_no_python_stack_without_trace_stacks(tmp_path, monkeypatch):
    def boom(*a):
        raise AssertionError("a Python stack was built for a heap without trace_stacks")

    monkeypatch.setattr(_pystack, "python_stack", boom)
    log = str(tmp_path / "plain.csv")
    for conf in (SIM, SIM + ",trace:%s" % log, SIM + ",trace_stacks:on"):
        with cuma.Heap(conf, use_env=False) as h:
            h.free(h.alloc(4096))
    assert not os.path.exists(log + ".stacks")


def test_tabs_and_newlines_in_names_stay_in_their_field():
    code = compile("def f():\n    return sys._getframe(0)\n", "odd\tdir/x\ny.py", "exec")
    env = {"sys": sys}
    exec(code, env)
    frame = env["f"]()
    offset = frame.f_lasti if _pystack._BY_OFFSET else frame.f_lineno
    assert _pystack._text([frame.f_code], [offset]) == b"odd dir/x y.py\t2\tf"


def test_lines_from_offsets_match_f_lineno():
    def two_lines():
        f = sys._getframe(0)
        return f, f.f_lineno

    f, lineno = two_lines()
    offset = f.f_lasti if _pystack._BY_OFFSET else f.f_lineno
    assert _pystack._line(f.f_code, offset) == lineno


def test_default_heap_through_the_allocator_records_python_frames(tmp_path):
    log = str(tmp_path / "default.csv")
    a = cuma.allocator.CudaMemoryAllocator(SIM + ",trace:%s,trace_stacks:on" % log)

    def grab():
        return a.allocate(4096)  # grab

    p = grab()
    a.free(p)
    cuma.shutdown_default_heaps()
    _, stacks, native = _records(log + ".stacks")
    assert not native
    assert stacks[1][0] == (os.path.abspath(__file__), _line_of(grab, "# grab"),
                            "test_default_heap_through_the_allocator_records_python_frames.<locals>.grab")
