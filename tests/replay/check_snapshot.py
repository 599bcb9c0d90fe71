#!/usr/bin/python3
# SPDX-License-Identifier: Apache-2.0
"""Checks `cuma replay` on PyTorch memory snapshots (torch.cuda.memory._dump_snapshot() files).

usage: check_snapshot.py --cuma BIN --data DIR --out DIR

Tiny snapshots are made here with the standard library's pickle (the same plain dicts and
lists PyTorch writes) for the edge cases: several protocols, gzip or not, a name that says
CSV, no time_us, blocks and segments alive before recording, two devices, streams,
free_requested without free_completed, stream_order:on for a snapshot, a refused GLOBAL opcode, a truncated file. The two real snapshots in DIR
(tests/data) are checked against the figures their README gives. Standard library only.
"""
import argparse
import datetime
import gzip
import json
import os
import pickle
import subprocess
import sys

failures = []
MB = 1 << 20


def run(cuma, *args):
    env = dict(os.environ)
    env.pop("CUMA_CONF", None)
    p = subprocess.run([cuma, "replay"] + list(args), stdout=subprocess.PIPE,
                       stderr=subprocess.PIPE, universal_newlines=True, env=env, timeout=300)
    return p.returncode, p.stdout, p.stderr


def check(what, cond, detail=""):
    print("%-4s %s%s" % ("ok" if cond else "FAIL", what, "" if cond else ": " + detail))
    if not cond:
        failures.append(what)


def replay_json(cuma, path, *extra):
    rc, out, err = run(cuma, "--json", *extra, path)
    if rc != 0:
        check("replay %s %s" % (os.path.basename(path), " ".join(extra)), False,
              "exit %d, stderr %r" % (rc, err[-600:]))
        return None, err
    return json.loads(out.splitlines()[0]), err


def ev(action, addr, size, t=None, stream=0):
    e = {"action": action, "addr": addr, "size": size, "stream": stream,
         "frames": [{"name": "f", "filename": "x.py", "line": 1}]}
    if t is not None:
        e["time_us"] = t
    return e


def write(path, snap, protocol=4, gz=False):
    data = pickle.dumps(snap, protocol=protocol)
    if gz:
        data = gzip.compress(data)
    with open(path, "wb") as f:
        f.write(data)
    return path


def segment(addr, total, blocks, device=0, stream=0):
    return {"device": device, "address": addr, "total_size": total, "stream": stream,
            "segment_type": "large", "blocks": blocks}


def basic_snapshot(times=True):
    """One 20 MiB segment reserved before recording (alive at the dump), one 2 MiB segment
    made and freed in the trace; two blocks allocated and freed, one freed only by request."""
    T = (lambda x: 1_700_000_000_000_000 + x) if times else (lambda x: None)
    base, small = 0x7f0000000000, 0x7f0100000000
    trace = [
        ev("alloc", base, 1 * MB, T(0)),
        ev("segment_alloc", small, 2 * MB, T(100)),
        ev("alloc", small, 2 * MB, T(100)),
        ev("free_requested", base, 1 * MB, T(200)),
        ev("free_completed", base, 1 * MB, T(250)),
        ev("free_requested", small, 2 * MB, T(300)),
        ev("segment_free", small, 2 * MB, T(400)),
        ev("alloc", base + MB, 3 * MB, T(500)),
        ev("free_requested", base + MB, 3 * MB, T(1000)),
    ]
    segs = [segment(base, 20 * MB, [{"address": base, "size": 20 * MB, "requested_size": 0,
                                      "state": "inactive", "frames": []}])]
    return {"segments": segs, "device_traces": [trace],
            "allocator_settings": {"expandable_segments": False, "ratio": 0.5}}


def check_basic(cuma, out):
    snap = basic_snapshot()
    # Reserved: 20 MiB before, 22 MiB from t=100 to t=400, 20 MiB after; span 0..1000.
    want_avg = (20 * MB * 1000 + 2 * MB * 300) // 1000
    for proto in (2, 3, 4, 5):
        for gz in (False, True):
            name = "basic_p%d%s.csv" % (proto, ".gz" if gz else "")  # content, not name, tells
            d, err = replay_json(cuma, write(os.path.join(out, name), snap, proto, gz))
            if not d:
                continue
            what = "basic snapshot, protocol %d%s" % (proto, ", gzip" if gz else "")
            check(what + ": format, events, links",
                  d["format"] == "torch_snapshot" and d["events"] == 6 and d["allocs"] == 3 and
                  d["frees"] == 3 and d["unmatched_frees"] == 0 and d["preexisting_blocks"] == 0,
                  json.dumps(d))
            check(what + ": recorded peak and time-averaged reserved",
                  d["recorded_peak_reserved_bytes"] == 22 * MB and
                  d["recorded_time_avg_reserved_bytes"] == want_avg and
                  d["synthetic_times"] is False and "warning" not in err, json.dumps(d))
            check(what + ": replay's peak requested (3 MiB)",
                  d["peak_requested_bytes"] == 3 * MB, json.dumps(d))
    rc, text, err = run(cuma, os.path.join(out, "basic_p4.csv"))
    check("text output names the recorded peak",
          rc == 0 and "recorded by PyTorch: peak reserved 22.0 MiB" in text and
          "time-avg reserved 20.6 MiB" in text, text + err)


def check_no_times(cuma, out):
    d, err = replay_json(cuma, write(os.path.join(out, "notimes.pickle"), basic_snapshot(False)))
    if d:
        check("no time_us: synthetic times, warned, no recorded time average",
              d["synthetic_times"] is True and d["recorded_time_avg_reserved_bytes"] is None and
              "no time_us" in err and d["recorded_peak_reserved_bytes"] == 22 * MB and
              d["events"] == 6, json.dumps(d) + err)


def check_preexisting(cuma, out):
    a, b, c = 0x10000000, 0x10200000, 0x10400000
    trace = [
        ev("free_requested", a, 4096, 10),  # allocated before recording, freed here
        ev("free_completed", a, 4096, 20),
        ev("alloc", c, 8192, 30),
        ev("free_completed", c, 8192, 40),
    ]
    blocks = [{"address": b, "size": 512 * 1024, "state": "active_allocated"},
              {"address": c, "size": 8192, "state": "inactive"},
              {"address": a, "size": 4096, "state": "inactive"}]
    snap = {"segments": [segment(a, 2 * MB, blocks)], "device_traces": [trace]}
    d, _ = replay_json(cuma, write(os.path.join(out, "pre.pickle"), snap))
    if d:
        check("blocks alive before recording are allocated at time 0",
              d["preexisting_blocks"] == 2 and d["events"] == 5 and d["unmatched_frees"] == 0 and
              d["frees"] == 2 and d["peak_requested_bytes"] == 512 * 1024 + 8192 and
              d["recorded_peak_reserved_bytes"] == 2 * MB, json.dumps(d))


def check_segments_from_before(cuma, out):
    """Only dump segments that no segment event names, not expandable, not overlapping an
    earlier one, are cache from before recording; the model starts with them."""
    a, b, c, d, e = (0x7f0000000000 + k * 0x10000000 for k in range(5))
    trace = [ev("segment_alloc", b, 20 * MB, 10), ev("alloc", b, 4 * MB, 10),
             ev("segment_map", c, 20 * MB, 20), ev("alloc", a, 4 * MB, 30)]
    free = [{"address": a, "size": 20 * MB, "state": "inactive"}]
    segs = [segment(a, 20 * MB, free), segment(b, 20 * MB, free), segment(c, 20 * MB, free),
            dict(segment(d, 20 * MB, free), is_expandable=True),
            segment(a + 2 * MB, 20 * MB, free)]  # overlaps a (a malformed file)
    snap = {"segments": segs, "device_traces": [trace]}
    d_, _ = replay_json(cuma, write(os.path.join(out, "segs.pickle"), snap), "--policy", "pytorch")
    if d_:
        check("segments from before: the one no event names, not expandable, not overlapping",
              d_["preexisting_segments"] == 1 and d_["preexisting_segment_bytes"] == 20 * MB and
              d_["segments_seeded"] == 1 and d_["segments_created"] == 0 and
              d_["peak_reserved_bytes"] == 20 * MB, json.dumps(d_))  # both 4 MiB fit in a


def check_devices(cuma, out):
    t0 = [ev("alloc", 0x1000, 1 * MB, 1), ev("free_completed", 0x1000, 1 * MB, 2)]
    t1 = [ev("segment_alloc", 0x9000000, 4 * MB, 1)] + \
         [ev("alloc", 0x9000000 + i * MB, MB, 2 + i, stream=7 if i % 2 else 0) for i in range(3)]
    segs = [segment(0x5000000, 2 * MB, [], device=0),
            segment(0x9000000, 4 * MB, [], device=1)]
    path = write(os.path.join(out, "twodev.pickle.gz"), {"segments": segs,
                                                         "device_traces": [t0, t1]}, gz=True)
    d, _ = replay_json(cuma, path)
    if d:
        check("two devices: the one with more events by default",
              d["device"] == 1 and d["allocs"] == 3 and d["recorded_peak_reserved_bytes"] == 4 * MB,
              json.dumps(d))
    d, _ = replay_json(cuma, path, "--device", "0")
    if d:
        check("two devices: --device 0",
              d["device"] == 0 and d["allocs"] == 1 and d["frees"] == 1 and
              d["recorded_peak_reserved_bytes"] == 2 * MB, json.dumps(d))
    rc, _, err = run(cuma, "--device", "2", path)
    check("--device of a device the snapshot lacks: exit 2, named",
          rc == 2 and "no device 2" in err and "0 to 1" in err, err)
    rc, _, err = run(cuma, "--device", "x", path)
    check("--device x: exit 2", rc == 2 and "--device" in err, err)


def check_free_requested_only(cuma, out):
    # Block 1: only free_requested. Block 2: requested then completed later: freed at completion.
    trace = [ev("alloc", 0x1000, MB, 0), ev("alloc", 0x200000, 2 * MB, 1),
             ev("free_requested", 0x1000, MB, 2), ev("free_requested", 0x200000, 2 * MB, 3),
             ev("alloc", 0x400000, 4 * MB, 4), ev("free_completed", 0x200000, 2 * MB, 5)]
    d, _ = replay_json(cuma, write(os.path.join(out, "freereq.pickle"),
                                   {"segments": [], "device_traces": [trace]}))
    if d:
        # At t=4: 4 MiB + the 2 MiB block not yet completed = 6 MiB.
        check("free_requested frees only without a later free_completed",
              d["events"] == 5 and d["frees"] == 2 and d["peak_requested_bytes"] == 6 * MB,
              json.dumps(d))


def check_stream_order(cuma, out):
    """A snapshot is replayed with stream_order:on (PyTorch's contract is stream-ordered): on a
    device 5 ms behind, stream 7's 64 MiB 1 ms after stream 5 freed 64 MiB take those pages
    (stream 7 waits for stream 5 on the device); with stream_order:off, or as an RMM log (any
    cuma heap's contract), they wait and new pages are made."""
    T = lambda x: 1_700_000_000_000_000 + x
    a = 0x7f0000000000
    trace = [ev("alloc", a, 64 * MB, T(0), stream=5),
             ev("free_requested", a, 64 * MB, T(1000), stream=5),
             ev("free_completed", a, 64 * MB, T(1000), stream=5),
             ev("alloc", a + 64 * MB, 64 * MB, T(2000), stream=7),
             ev("free_requested", a + 64 * MB, 64 * MB, T(3000), stream=7),
             ev("free_completed", a + 64 * MB, 64 * MB, T(3000), stream=7)]
    path = write(os.path.join(out, "two_streams.pickle"), {"segments": [], "device_traces": [trace]})
    csv = os.path.join(out, "two_streams.csv")
    with open(csv, "w") as f:
        f.write("Thread,Time,Action,Pointer,Size,Stream\n"
                "0,00:00:00:000000,allocate,0x1000,67108864,5\n"
                "0,00:00:00:001000,free,0x1000,67108864,5\n"
                "0,00:00:00:002000,allocate,0x5000000,67108864,7\n"
                "0,00:00:00:003000,free,0x5000000,67108864,7\n")
    for what, p, conf, peak in (("snapshot", path, "sim_lag_ms:5", 64),
                                ("snapshot, stream_order:off", path,
                                 "sim_lag_ms:5,stream_order:off", 128),
                                ("RMM log", csv, "sim_lag_ms:5", 128)):
        d, err = replay_json(cuma, p, "--conf", conf)
        check("stream order, %s: peak reserved %d MiB" % (what, peak),
              d is not None and d["peak_reserved_bytes"] == peak * MB and
              d["peak_requested_bytes"] == 64 * MB, json.dumps(d))


def check_refused(cuma, out):
    snap = basic_snapshot()
    snap["allocator_settings"]["when"] = datetime.date(2024, 1, 2)
    for proto, op in ((2, "GLOBAL"), (4, "STACK_GLOBAL")):
        path = write(os.path.join(out, "global_p%d.pickle" % proto), snap, proto)
        rc, text, err = run(cuma, path)
        check("a pickle that names a class (protocol %d) is refused, naming %s" % (proto, op),
              rc == 2 and ("pickle: %s (0x" % op) in err and "at offset" in err and
              "refused" in err and not text, err)
    # By hand: what an attacker would write to run a command.
    path = os.path.join(out, "os_system.pickle")
    with open(path, "wb") as f:
        f.write(b"\x80\x02cos\nsystem\nq\x00X\x04\x00\x00\x00trueq\x01\x85q\x02Rq\x03.")
    rc, _, err = run(cuma, path)
    check("GLOBAL os.system at offset 2 is refused", rc == 2 and
          "pickle: GLOBAL (0x63) at offset 2" in err, err)


def check_truncated(cuma, out):
    data = pickle.dumps(basic_snapshot(), protocol=4)
    for cut in (len(data) - 1, len(data) // 2, 3):
        path = os.path.join(out, "cut%d.pickle" % cut)
        with open(path, "wb") as f:
            f.write(data[:cut])
        rc, _, err = run(cuma, path)
        check("truncated at %d of %d bytes: exit 2, said" % (cut, len(data)),
              rc == 2 and "truncated" in err and path in err, err)
    path = os.path.join(out, "cut.pickle.gz")
    with open(path, "wb") as f:
        f.write(gzip.compress(data)[:-20])
    rc, _, err = run(cuma, path)
    check("truncated gzip: exit 2", rc == 2 and path in err, err)
    path = write(os.path.join(out, "notsnap.pickle"), [1, 2, 3])
    rc, _, err = run(cuma, path)
    check("a pickle that is no snapshot: exit 2", rc == 2 and "not a memory snapshot" in err, err)


def check_real(cuma, data):
    # tests/data/README.md: peak requested and PyTorch's peak reserved, GB = 1e9 bytes.
    for name, req, res in (("snapshot_small_lm_5steps.pickle.gz", 0.76, 0.94),
                           ("snapshot_toy_attention.pickle.gz", 3.25, 3.78)):
        d, _ = replay_json(cuma, os.path.join(data, name))
        if not d:
            continue
        check("%s: recorded peak reserved %.2f GB as its README says" % (name, res),
              abs(d["recorded_peak_reserved_bytes"] / 1e9 - res) < 0.005 and
              d["recorded_time_avg_reserved_bytes"] is not None, json.dumps(d))
        check("%s: peak requested %.2f GB, every free matched, nothing failed" % (name, req),
              abs(d["peak_requested_bytes"] / 1e9 - req) < 0.005 and d["unmatched_frees"] == 0 and
              d["failed_allocs"] == 0, json.dumps(d))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cuma", required=True)
    ap.add_argument("--data", required=True)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    check_basic(a.cuma, a.out)
    check_no_times(a.cuma, a.out)
    check_preexisting(a.cuma, a.out)
    check_segments_from_before(a.cuma, a.out)
    check_devices(a.cuma, a.out)
    check_free_requested_only(a.cuma, a.out)
    check_stream_order(a.cuma, a.out)
    check_refused(a.cuma, a.out)
    check_truncated(a.cuma, a.out)
    check_real(a.cuma, a.data)
    if failures:
        print("%d failed: %s" % (len(failures), ", ".join(failures)))
        return 1
    print("all passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
