#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""`cuma replay --policy pytorch` and `--compare` on the bundled snapshots: the model's peak
reserved within 3% of what PyTorch recorded (also where recording started with a full cache),
one JSON line per compared policy, and bad model options refused with exit 2 before anything
is replayed. A free on another stream than the allocation's (record_stream) waits for the
simulated device's lag (sim_lag_ms, from --conf or CUMA_CONF) before the block is reused.

usage: check_torch_cli.py --cuma CUMA --data DIR
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile

SNAPSHOTS = ("snapshot_small_lm_5steps.pickle.gz", "snapshot_toy_attention.pickle.gz",
             "snapshot_cached_segments.pickle.gz")


def run(cuma, *args, env=None):
    e = dict(os.environ)
    e.pop("CUMA_CONF", None)
    e.update(env or {})
    p = subprocess.run([cuma, "replay", *args], capture_output=True, text=True, timeout=300,
                       env=e)
    return p.returncode, p.stdout, p.stderr


# A 20 MiB block allocated on stream 1 and last used on stream 2 (record_stream), then a second
# one on stream 1 1 ms later: on a device 5 ms behind, PyTorch's events on stream 2 are not
# complete yet, so the second takes a new segment; freed on stream 1 it reuses the first.
RECORDED_CSV = """Thread,Time,Action,Pointer,Size,Stream
0,00:00:00:000000,allocate,0x1000,20971520,1
0,00:00:00:001000,free,0x1000,20971520,%d
0,00:00:00:002000,allocate,0x2000,20971520,1
"""


def check_record_stream(cuma):
    with tempfile.TemporaryDirectory() as tmp:
        for free_stream, conf, env, segments in ((2, "sim_lag_ms:5", None, 2),
                                                 (2, "", {"CUMA_CONF": "sim_lag_ms:5"}, 2),
                                                 (2, "sim_lag_ms:0", None, 1),
                                                 (1, "sim_lag_ms:5", None, 1)):
            path = os.path.join(tmp, "rs.csv")
            with open(path, "w") as f:
                f.write(RECORDED_CSV % free_stream)
            args = ["--policy", "pytorch", "--json"] + (["--conf", conf] if conf else []) + [path]
            rc, out, err = run(cuma, *args, env=env)
            d = json.loads(out) if rc == 0 else {}
            print("record_stream: free on %d, %s %s: %d segments" % (free_stream, conf, env,
                                                                     d.get("segments_created", -1)))
            if d.get("segments_created") != segments or \
                    d.get("deferred_frees") != (segments - 1):
                fail("record_stream, free on %d, %r %r: %s %s" % (free_stream, conf, env, out, err))


def fail(msg):
    print("FAIL: " + msg)
    sys.exit(1)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cuma", required=True)
    ap.add_argument("--data", required=True)
    a = ap.parse_args()
    for name in SNAPSHOTS:
        path = os.path.join(a.data, name)
        rc, out, err = run(a.cuma, "--policy", "pytorch", "--json", path)
        if rc != 0:
            fail("%s: exit %d: %s" % (name, rc, err))
        d = json.loads(out)
        model, rec = d["peak_reserved_bytes"], d["recorded_peak_reserved_bytes"]
        print("%s: model %d recorded %d (%+.2f%%)" % (name, model, rec, 100.0 * (model / rec - 1)))
        if d["policy"] != "pytorch" or abs(model / rec - 1) > 0.03 or d["failed_allocs"]:
            fail("%s: %s" % (name, out))
        rc, out, err = run(a.cuma, "--compare", "pytorch,tlsf,buddy", "--json", path)
        lines = [json.loads(l) for l in out.splitlines()]
        if rc != 0 or [l["policy"] for l in lines] != ["pytorch", "tlsf", "buddy"]:
            fail("%s: --compare: exit %d, %s %s" % (name, rc, out, err))
        if lines[0]["peak_reserved_bytes"] != model:
            fail("%s: --compare's pytorch line differs from --policy pytorch" % name)
    # Recording started with PyTorch's cache full: the model starts from those segments (their
    # free room is cache) and makes only the segment PyTorch made during the trace.
    rc, out, err = run(a.cuma, "--policy", "pytorch", "--json", os.path.join(a.data, SNAPSHOTS[2]))
    d = json.loads(out) if rc == 0 else {}
    if (d.get("preexisting_segments"), d.get("segments_seeded"), d.get("blocks_placed"),
            d.get("segments_created")) != (3, 3, 3, 1):
        fail("segments from before recording: %s %s" % (out, err))
    # Expandable segments: the same traces with the policy named, and the same figures through
    # --pytorch-conf expandable_segments:True.
    for name in SNAPSHOTS:
        path = os.path.join(a.data, name)
        rc, out, err = run(a.cuma, "--compare", "pytorch,pytorch_expandable", "--json", path)
        lines = [json.loads(l) for l in out.splitlines()]
        if rc != 0 or [l["policy"] for l in lines] != ["pytorch", "pytorch_expandable"]:
            fail("%s: pytorch_expandable: exit %d, %s %s" % (name, rc, out, err))
        fixed, exp = lines[0]["peak_reserved_bytes"], lines[1]["peak_reserved_bytes"]
        print("%s: expandable %d, fixed %d" % (name, exp, fixed))
        if exp < lines[1]["peak_requested_bytes"] or lines[1]["failed_allocs"]:
            fail("%s: pytorch_expandable: %s" % (name, lines[1]))
        rc, out2, err = run(a.cuma, "--policy", "pytorch", "--pytorch-conf",
                            "expandable_segments:True", "--json", path)
        if rc != 0 or json.loads(out2)["peak_reserved_bytes"] != exp:
            fail("%s: expandable_segments:True differs from pytorch_expandable" % name)
    # A small capacity: the model frees its cache, then fails what still does not fit.
    rc, out, err = run(a.cuma, "--policy", "pytorch", "--capacity", "1G", "--json",
                       os.path.join(a.data, SNAPSHOTS[1]))
    d = json.loads(out)
    if rc != 0 or d["failed_allocs"] == 0 or d["peak_reserved_bytes"] > 1 << 30:
        fail("--capacity 1G: exit %d, %s" % (rc, out))
    check_record_stream(a.cuma)
    path = os.path.join(a.data, SNAPSHOTS[1])
    bad = [
        (["--policy", "pytorch", "--pytorch-conf", "max_split_size_mb:5"], "max_split_size_mb"),
        (["--policy", "pytorch", "--pytorch-conf", "nonsense:1"], "nonsense"),
        (["--policy", "pytorch", "--pytorch-conf", "expandable_segments:yes"], "expandable"),
        (["--policy", "pytorch_expandable", "--timeline", "/tmp"], "--timeline"),
        (["--policy", "pytorch", "--capacity", "12Q"], "--capacity"),
        (["--compare", "pytorch,bogus"], "bogus"),
        (["--compare", "pytorch,,tlsf"], "--compare"),
        (["--policy", "pytorch", "--scale", "2"], "--scale"),
    ]
    for args, word in bad:
        rc, out, err = run(a.cuma, *args, path)
        if rc != 2 or out or word not in err:
            fail("%s: wanted exit 2, no output and %r in the message; got %d %r %r"
                 % (args, word, rc, out, err))
    print("check_torch_cli: ok")


if __name__ == "__main__":
    main()
