#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""docs/PYTORCH_MODEL.md's table from `cuma replay --policy pytorch --json` lines on stdin:
the model's peak and time-averaged reserved bytes against what PyTorch recorded."""
import json, sys
print("| file | events | blocks from before | model peak reserved | recorded peak reserved | model - recorded | model time-avg reserved | recorded time-avg | model - recorded | segments (model) |")
print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
for l in sys.stdin:
    d = json.loads(l); m = d["peak_reserved_bytes"]; r = d["recorded_peak_reserved_bytes"]
    off = 100.0 * (m / r - 1)
    mark = " **outside 3%**" if abs(off) > 3 else ""
    ta, tr = d["time_avg_reserved_bytes"], d["recorded_time_avg_reserved_bytes"]
    toff = "%+.2f%%" % (100.0 * (ta / tr - 1)) if tr else "-"
    print("| %s | %d | %d | %d | %d | %+.2f%%%s | %d | %s | %s | %d |" % (
        d["trace"].replace(".pickle.gz", ""), d["events"], d["preexisting_blocks"], m, r, off,
        mark, ta, tr if tr is not None else "-", toff, d["segments_created"]))
