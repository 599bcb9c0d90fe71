# SPDX-License-Identifier: Apache-2.0
"""Record the CPU allocations of a PyTorch program as an RMM CSV trace for `cuma replay`.

    /usr/bin/python3 -m cuma.record -o TRACE.csv.gz script.py [args...]

or, from Python::

    with cuma.record.Recorder("TRACE.csv.gz"):
        train()

Every block that PyTorch's CPU allocator (c10's DefaultCPUAllocator: tensor storages and the
buffers ops take from it) hands out or takes back while recording is one ``allocate`` or
``free`` row, with its address, its byte count and the time on a monotonic clock. The rows are
RAPIDS RMM's event-log format (Thread,Time,Action,Pointer,Size,Stream; gzip when the name ends
in .gz), the format of tests/data/*.csv.gz.

How: PyTorch's profiler with memory profiling on. c10's CPU allocator reports each allocation
and each free to the profiler itself (address, signed byte count, a steady-clock time in ns),
so the rows are what the allocator saw, including blocks that never become a Python tensor
(op scratch, autograd buffers), and nothing is inferred. The alternatives were weaker on
torch 1.13: a TorchDispatchMode sees only op outputs, and storage finalizers fire when Python
lets go, not when the allocator does; an LD_PRELOAD of posix_memalign/free would also catch
other libraries' blocks (oneDNN, OpenMP) and needs a native build. The profiler records every
op too, which slows the program (gaps between events grow by the cost of recording an op, a
few microseconds) and keeps every event in memory until the end: record runs of minutes, not
hours.

Blocks allocated before recording began and freed during it are left out (c10 does not report
the free of a block it did not see allocated; the recorder would drop one too), so are blocks of
0 bytes; blocks still live at the end stay allocated in the trace.
Threads are numbered 0, 1, ... in the order they first allocate. PyTorch is imported only when
recording starts.
"""

import argparse
import gzip
import os
import runpy
import sys

__all__ = ["Recorder", "write_rmm_csv", "main"]


def _allocation_nodes(roots):
    """The [memory] nodes of the profiler's event tree, walked without recursion."""
    stack = list(roots)
    while stack:
        node = stack.pop()
        fields = node.extra_fields
        if type(fields).__name__ == "_ExtraFields_Allocation":
            yield node, fields
        stack.extend(node.children)


class Recorder:
    """A context manager that records PyTorch's CPU allocations while it is entered.

    After exit, ``events`` holds (time_ns, thread, action, pointer, size) tuples in time order,
    time_ns counted from the first event, and ``dropped_frees`` the frees of blocks allocated
    before recording. With ``path`` given, exit also writes them there as RMM CSV.
    """

    def __init__(self, path=None):
        self.path = path
        self.events = []
        self.dropped_frees = 0
        self._on = False

    def __enter__(self):
        from torch.autograd import (
            ProfilerActivity,
            ProfilerConfig,
            ProfilerState,
            _enable_profiler,
            _prepare_profiler,
        )
        from torch._C._profiler import _ExperimentalConfig

        # Memory only matters here: no shapes, stacks, flops or modules, which would add to
        # the cost of every op and so stretch the gaps between allocations.
        config = ProfilerConfig(ProfilerState.KINETO, False, True, False, False, False,
                                _ExperimentalConfig())
        activities = {ProfilerActivity.CPU}
        _prepare_profiler(config, activities)
        _enable_profiler(config, activities)
        self._on = True
        return self

    def __exit__(self, *exc):
        if not self._on:
            return False
        from torch.autograd import _disable_profiler

        self._on = False
        result = _disable_profiler()
        self._collect(result.experimental_event_tree())
        if self.path is not None:
            write_rmm_csv(self.path, self.events)
        return False

    def _collect(self, roots):
        raw = []
        for seq, (node, fields) in enumerate(_allocation_nodes(roots)):
            if fields.alloc_size == 0 or fields.device.type != "cpu":
                continue
            raw.append((node.start_time_ns, seq, node.start_tid, fields.ptr, fields.alloc_size))
        # The walk is depth first, so time orders the events; the walk index only breaks ties.
        raw.sort()
        threads = {}
        live = {}
        events = []
        t0 = raw[0][0] if raw else 0
        for t, _, tid, ptr, size in raw:
            thread = threads.setdefault(tid, len(threads))
            if size > 0:
                live[ptr] = size
                events.append((t - t0, thread, "allocate", ptr, size))
            else:
                known = live.pop(ptr, None)
                if known is None:
                    self.dropped_frees += 1
                    continue
                events.append((t - t0, thread, "free", ptr, known))
        self.events = events


def _rmm_time(ns):
    """Nanoseconds -> RMM's HH:MM:SS:microseconds."""
    us = ns // 1000
    s, us = divmod(us, 1000000)
    m, s = divmod(s, 60)
    h, m = divmod(m, 60)
    return "%02d:%02d:%02d:%06d" % (h, m, s, us)


def write_rmm_csv(path, events):
    """Writes (time_ns, thread, action, pointer, size) tuples as an RMM CSV (gzip on .gz)."""
    if path.endswith(".gz"):
        # mtime=0 keeps a gzip trace byte-identical across runs that record the same events.
        f = gzip.GzipFile(path, "wb", mtime=0)
    else:
        f = open(path, "wb")
    with f:
        f.write(b"Thread,Time,Action,Pointer,Size,Stream\n")
        rows = []
        for t, thread, action, ptr, size in events:
            rows.append("%d,%s,%s,0x%x,%d,0\n" % (thread, _rmm_time(t), action, ptr, size))
            if len(rows) >= 4096:
                f.write("".join(rows).encode("ascii"))
                rows = []
        f.write("".join(rows).encode("ascii"))


def main(argv=None):
    parser = argparse.ArgumentParser(
        prog="python -m cuma.record",
        description="Run a Python script and record PyTorch's CPU allocations as RMM CSV.")
    parser.add_argument("-o", "--output", required=True,
                        help="trace to write (gzip when it ends in .gz)")
    parser.add_argument("script", help="the Python script to run")
    parser.add_argument("args", nargs=argparse.REMAINDER, help="the script's arguments")
    opts = parser.parse_args(argv)
    script = os.path.abspath(opts.script)
    sys.argv = [script] + opts.args
    sys.path.insert(0, os.path.dirname(script))
    rec = Recorder(opts.output)
    with rec:
        runpy.run_path(script, run_name="__main__")
    allocs = sum(1 for e in rec.events if e[2] == "allocate")
    print("cuma.record: %d allocations, %d frees, %d frees of earlier blocks left out -> %s"
          % (allocs, len(rec.events) - allocs, rec.dropped_frees, opts.output), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
