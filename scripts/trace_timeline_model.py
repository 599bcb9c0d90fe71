#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""A timeline of PyTorch's caching allocator rules on a trace, for `cuma plot --compare`.

usage: trace_timeline_model.py [--scale K] [--tools DIR] --out DIR TRACE...

Runs the model of PyTorch's native allocator (ptmodel.py, in the steering repository's shared
tools; not part of cuma) on each RMM trace and writes DIR/NAME.timeline.csv in the format of
`cuma replay --timeline` (NAME: the trace's file name without .gz and .csv), sampled by the same
rule (tools/timeline.h: 640 slices of the time span; per slice the first and last state, the
state with the most requested bytes and the one that ends it, the same for reserved bytes).
Then
    cuma plot --compare pytorch=DIR/NAME.timeline.csv build/plots/NAME.timeline.csv
draws the model's reserved bytes over cuma's.

ptmodel.run() is used as it is, not copied: it reads the trace through `open`/`gzip.open`, so
this script hands it a file object whose every next line is asked for right after the model has
applied the previous one, and reads the model's state then from the caller's frame (`reserved`,
`req`, `live`). Columns for the model: requested = its requested bytes, reserved = its segments,
mapped = the bytes of its allocated blocks (after its 512 B rounding and unsplit remainders),
cached = reserved - mapped (free space inside its segments, which it never gives back).

Times are the trace's own, clamped so they never go back, as `cuma replay` does. Standard
library only.
"""
import argparse
import gzip
import os
import sys

BUCKETS = 640  # tools/timeline.h TL_BUCKETS
HEADER = "time_s,requested_bytes,reserved_bytes,cached_bytes,mapped_bytes"
GZIP_OPEN = gzip.open  # model_timeline() swaps gzip.open while the model runs


def parse_time_us(text):
    """HH:MM:SS:micro or HH:MM:SS.micro -> microseconds, as the cuma trace reader reads it."""
    sep = ":" if text.count(":") == 3 else "."
    head, _, frac = text.rpartition(sep)
    h, m, s = head.split(":")
    return ((int(h) * 60 + int(m)) * 60 + int(s)) * 1000000 + int((frac + "00000")[:6])


def open_text(path):
    with open(path, "rb") as f:
        gz = f.read(2) == b"\x1f\x8b"
    return GZIP_OPEN(path, "rt") if gz else open(path, "rt")


def time_span(path):
    """(first time, latest time) of the trace, in microseconds."""
    first = last = None
    with open_text(path) as f:
        next(f)
        for line in f:
            fields = line.split(",")
            if len(fields) < 6:
                continue
            t = parse_time_us(fields[1])
            if first is None:
                first = t
            last = t if last is None or t > last else last
    if first is None:
        raise SystemExit("%s: no events" % path)
    return first, last


class Sampler:
    """The writer of tools/timeline.c, line for line: slices, kept states, their order."""

    def __init__(self, out, t0, span):
        self.out, self.t0, self.span = out, t0, span
        self.bucket = None
        self.keep = []
        self.open_end = [True, True]
        self.seq = 0
        self.rows = 0
        out.write(HEADER + "\n")

    def bucket_of(self, t):
        dt = max(t - self.t0, 0)
        if dt >= self.span:
            return BUCKETS - 1
        return dt * BUCKETS // self.span

    def flush(self):
        seen = set()
        for s in sorted(self.keep, key=lambda s: s[0]):
            if s[0] in seen:
                continue
            seen.add(s[0])
            t = s[1]
            self.out.write("%d.%06d,%d,%d,%d,%d\n" % ((t // 1000000, t % 1000000) + s[2:]))
            self.rows += 1

    def add(self, t, requested, reserved, cached, mapped):
        s = (self.seq, t, requested, reserved, cached, mapped)
        self.seq += 1
        b = self.bucket_of(t)
        if b != self.bucket:
            if self.bucket is not None:
                self.flush()
            self.bucket = b
            self.keep = [s] * 6  # first, last, peak requested, its end, peak reserved, its end
            self.open_end = [True, True]
            return
        self.keep[1] = s
        for c, col in ((0, 2), (1, 3)):
            peak = self.keep[2 + 2 * c]
            if s[col] > peak[col]:
                self.keep[2 + 2 * c] = self.keep[3 + 2 * c] = s
                self.open_end[c] = True
            elif self.open_end[c] and s[col] != peak[col]:
                self.keep[3 + 2 * c] = s
                self.open_end[c] = False

    def close(self):
        if self.bucket is not None:
            self.flush()


class Watched:
    """The trace as the model reads it: before handing out line i + 1, records the model's
    state after line i (the model's frame is the caller of __next__)."""

    def __init__(self, path, sampler):
        self.f = open_text(path)
        self.sampler = sampler
        self.prev = None  # the last line handed out, once past the header
        self.header_done = False
        self.now = 0
        self.blocks = {}  # pointer -> size of its block, for allocations the model holds
        self.leaked = 0  # blocks of pointers allocated again before their free: held forever
        self.allocated = 0

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.f.close()

    def __iter__(self):
        return self

    def record(self, frame):
        _, ts, action, ptr, _, _ = self.prev.rstrip("\n").split(",")
        state = frame.f_locals
        if action == "allocate":
            if ptr in self.blocks:
                self.leaked += self.blocks.pop(ptr)
            block = state["live"][ptr][0]
            self.blocks[ptr] = block.size
            self.allocated += block.size
        elif action == "free" and ptr in self.blocks:
            self.allocated -= self.blocks.pop(ptr)
        self.now = max(self.now, parse_time_us(ts))
        reserved = state["reserved"]
        mapped = self.allocated + self.leaked
        self.sampler.add(self.now, state["req"], reserved, reserved - mapped, mapped)

    def __next__(self):
        if self.prev is not None:
            self.record(sys._getframe(1))
            self.prev = None
        line = next(self.f)  # StopIteration ends the model's loop
        if self.header_done:
            self.prev = line
        self.header_done = True
        return line


def find_tools(given):
    here = os.path.dirname(os.path.abspath(__file__))
    candidates = [given] if given else [os.environ.get("CUMA_MODEL_TOOLS", ""),
                                        os.path.join(here, "..", "..", "shared", "tools"),
                                        os.path.join(here, "..", "shared", "tools")]
    for d in candidates:
        if d and os.path.isfile(os.path.join(d, "ptmodel.py")):
            return d
    raise SystemExit("ptmodel.py not found (looked in %s); give --tools DIR"
                     % ", ".join(c for c in candidates if c))


def model_timeline(ptmodel, trace, scale, out_path):
    t0, end = time_span(trace)
    with open(out_path, "w") as out:
        sampler = Sampler(out, t0, end - t0)
        watched = lambda path, mode="rt", *a, **k: Watched(path, sampler)
        # The model picks gzip.open or open by the file name; both lead to the watched file.
        gzip.open, ptmodel.open = watched, watched
        try:
            figures = ptmodel.run(trace, None, scale)
        finally:
            gzip.open = GZIP_OPEN
            del ptmodel.open
        sampler.close()
    return figures, sampler.rows


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--scale", type=int, default=16, help="multiply every size (default 16)")
    ap.add_argument("--tools", help="the folder with ptmodel.py (default: ../shared/tools)")
    ap.add_argument("--out", required=True, help="folder for the NAME.timeline.csv files")
    ap.add_argument("traces", nargs="+")
    args = ap.parse_args()
    sys.path.insert(0, find_tools(args.tools))
    import ptmodel  # noqa: E402 (found only now)

    os.makedirs(args.out, exist_ok=True)
    for trace in args.traces:
        name = os.path.basename(trace)
        for suffix in (".gz", ".csv"):
            if name.endswith(suffix) and len(name) > len(suffix):
                name = name[: -len(suffix)]
        out_path = os.path.join(args.out, name + ".timeline.csv")
        figures, rows = model_timeline(ptmodel, trace, args.scale, out_path)
        print("%s: %d rows; model of PyTorch's rules: peak reserved / requested %s, "
              "time-averaged %s" % (out_path, rows, figures["ratio"], figures["time_avg_ratio"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
