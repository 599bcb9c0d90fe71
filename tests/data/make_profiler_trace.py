#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Writes profiler_mlp_cpu.pt.trace.json.gz: a torch.profiler Chrome trace with memory events
from a real PyTorch run (tests/data/README.md).

Debian's torch 1.13 is built without kineto, so prof.export_chrome_trace() writes the legacy
trace, which has no memory events (profiler_torch113_cpu.json is one). Its profiler still
records every allocation and free of the run (address, bytes, totals, device, time in ns) in
the result's event tree; this script runs a small MLP training loop under that profiler with
profile_memory on and writes those records, and the operators around them, in the layout
kineto's JSON writer gives them: "[memory]" instant events whose args PyTorch fills ("Device
Type", "Device Id", "Addr", "Bytes", "Total Allocated", "Total Reserved"), times in us with
three decimals, in the order of the event tree (not sorted by time).

usage: make_profiler_trace.py [OUT]   (default: beside this script; needs /usr/bin/python3
with Debian's python3-torch)
"""
import gzip
import json
import os
import sys

import torch
import torch._C._profiler as P
from torch.autograd import ProfilerActivity, ProfilerConfig, ProfilerState


def workload():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(),
                                torch.nn.Linear(256, 10))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for step in range(3):
        x = torch.randn(32 + 16 * step, 64)
        y = torch.randint(0, 10, (32 + 16 * step,))
        loss = torch.nn.functional.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return model


def record():
    cfg = ProfilerConfig(ProfilerState.KINETO, False, True, False, False, False,
                         P._ExperimentalConfig())
    torch.autograd._prepare_profiler(cfg, {ProfilerActivity.CPU})
    torch.autograd._enable_profiler(cfg, {ProfilerActivity.CPU})
    model = workload()
    del model  # its weights and the optimizer state are freed inside the recording
    return torch.autograd._disable_profiler().experimental_event_tree()


def events(tree):
    out, t0 = [], None
    stack = list(reversed(tree))
    while stack:
        e = stack.pop()
        t0 = e.start_time_ns if t0 is None else min(t0, e.start_time_ns)
        out.append(e)
        stack.extend(reversed(e.children))
    trace = []
    for e in out:
        ts = (e.start_time_ns - t0) / 1000
        ef = e.extra_fields
        if isinstance(ef, P._ExtraFields_Allocation):
            dev = ef.device
            trace.append({
                "ph": "i", "cat": "cpu_instant_event", "s": "t", "name": "[memory]",
                "pid": 1, "tid": 1, "ts": float(f"{ts:.3f}"),
                "args": {"Device Type": 1 if dev.type == "cuda" else 0,
                         "Device Id": dev.index if dev.index is not None else -1,
                         "Addr": ef.ptr, "Bytes": ef.alloc_size,
                         "Total Allocated": ef.total_allocated,
                         "Total Reserved": ef.total_reserved}})
        elif isinstance(ef, P._ExtraFields_TorchOp):
            trace.append({"ph": "X", "cat": "cpu_op", "name": e.name, "pid": 1, "tid": 1,
                          "ts": float(f"{ts:.3f}"),
                          "dur": float(f"{(e.end_time_ns - e.start_time_ns) / 1000:.3f}"),
                          "args": {"Sequence number": ef.sequence_number}})
    return trace


def main():
    out = sys.argv[1] if len(sys.argv) > 1 else os.path.join(
        os.path.dirname(os.path.abspath(__file__)), "profiler_mlp_cpu.pt.trace.json.gz")
    doc = {"schemaVersion": 1, "displayTimeUnit": "ms",
           "traceEvents": events(record()), "traceName": os.path.basename(out)}
    with gzip.GzipFile(out, "wb", mtime=0) as f:
        f.write(json.dumps(doc, indent=1).encode())
    n = sum(1 for e in doc["traceEvents"] if e["name"] == "[memory]")
    print(f"{out}: {len(doc['traceEvents'])} events, {n} [memory], torch {torch.__version__}")


if __name__ == "__main__":
    main()
