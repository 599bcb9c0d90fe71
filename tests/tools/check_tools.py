#!/usr/bin/python3
# SPDX-License-Identifier: Apache-2.0
"""Checks `cuma ps`, `cuma top`, `cuma stats` and `cuma exporter` against heaps with known
figures.

usage: check_tools.py --cuma BIN --fixture BIN

ledger_fixture (tests/tools/ledger_fixture.c) makes heaps in a ledger named for this run: three
simulated heaps (process 1), whose release threads publish their allocator figures, and two
slots on a made-up device with every pressure figure set by hand (process 2, one of them named
'fx"q\\z' to exercise escaping), which never publish any. Each prints what it made (the sim
heaps also their own cuma_get_stats); every figure the tools show must equal it. Then the HTTP
server is probed (404, 405, garbage, an oversized request, silent clients), top is checked
across a change of the figures, and the ledger is checked empty once the fixtures are gone (the
second one's slots as a killed process leaves them). A missing ledger must give exit status 1
and its path (ps, top, stats) or cuma_ledger_up 0 (exporter); a PID without a heap exit status 1
naming it. Standard library only. The shared-memory files are removed at the end. The checks
of `cuma stats` are in check_stats.py, what both files use in ledger_checks.py.
"""
import argparse
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time

from check_stats import check_stats, check_stats_doc, stats_json
from ledger_checks import (FIELDS, MB, POD, RAW_DEVICE, RAW_GPU_LABELS, STEP_ALLOCS, Lines, check, device_totals, env,
                           failures, key, ledger_fragmentation, run, shm_path, start_fixture,
                           stop_fixture)


# ---- what the fixtures made -----------------------------------------------------------------

def expected_by_hand(pid_sim, pid_raw):
    """The figures ledger_fixture.c sets, written out independently of what it prints. A sim
    heap's "stats" are some of its allocator figures (page calls and their time depend on the
    placement policy, so they are taken from what the heap itself reports)."""
    a = dict(pid=pid_sim, device="sim", process="ledger_fixture", priority=2, guarantee=8 * MB,
             limit=48 * MB, reserved=12 * MB, cached=4 * MB, requested=8 * MB,
             peak_reserved=12 * MB, want=0, pressure_asks=0, pressure_given_bytes=0,
             pressure_callbacks=0, ledger_denials=0)
    b = dict(pid=pid_sim, device="sim", process="ledger_fixture", priority=-1, guarantee=24 * MB,
             limit=64 * MB, reserved=20 * MB, cached=0, requested=20 * MB,
             peak_reserved=20 * MB, want=0, pressure_asks=0, pressure_given_bytes=0,
             pressure_callbacks=0, ledger_denials=0)
    x = dict(pid=pid_raw, device=RAW_DEVICE, process='fx"q\\z', priority=0, guarantee=16 * MB,
             limit=60 * MB, reserved=40 * MB, cached=8 * MB, requested=30 * MB,
             peak_reserved=40 * MB, want=0, ledger_denials=1, pressure_asks=0,
             pressure_given_bytes=6 * MB, pressure_callbacks=2)
    y = dict(pid=pid_raw, device=RAW_DEVICE, process="raw_y", priority=1, guarantee=0, limit=0,
             reserved=16 * MB, cached=0, requested=16 * MB, peak_reserved=16 * MB,
             want=12 * MB, ledger_denials=0, pressure_asks=1, pressure_given_bytes=0,
             pressure_callbacks=0)
    # C: 3M and 6M live (two pages of 2M under the 3M, three under the 6M, which starts in the
    # 3M's second page), 14M at the most (4M + the 10M spare) before the spare was freed.
    c = dict(pid=pid_sim, device="sim", process="ledger_fixture", priority=0, guarantee=0,
             limit=16 * MB, reserved=10 * MB, cached=0, requested=9 * MB, peak_reserved=14 * MB,
             want=0, pressure_asks=0, pressure_given_bytes=0, pressure_callbacks=0,
             ledger_denials=0)
    common = dict(backend="sim", page_size=2 * MB, arenas=1, managed_bytes=0,
                  managed_fallbacks=0)
    a["stats"] = dict(common, allocated_bytes=8 * MB, mapped_bytes=8 * MB,
                      peak_requested_bytes=12 * MB,
                      active_allocs=2, num_allocs=3, num_frees=1, failed_allocs=0,
                      alloc_retries=0, ooms=0, oom_callbacks=0, trims=0, fragmentation=0.0)
    b["stats"] = dict(common, allocated_bytes=20 * MB, mapped_bytes=20 * MB,
                      peak_requested_bytes=20 * MB,
                      active_allocs=1, num_allocs=1, num_frees=0, failed_allocs=0,
                      alloc_retries=0, ooms=0, oom_callbacks=0, trims=0, fragmentation=0.0)
    c["stats"] = dict(common, allocated_bytes=9 * MB, mapped_bytes=10 * MB,
                      peak_requested_bytes=13 * MB,
                      active_allocs=2, num_allocs=4, num_frees=2, failed_allocs=1,
                      alloc_retries=2, ooms=2, oom_callbacks=2, trims=3, fragmentation=0.1)
    return [a, b, c, x, y]


def check_made(made, by_hand):
    """The fixtures' own reports agree with the figures written out by hand."""
    mk = {key(h): h for h in made}
    for h in by_hand:
        m = mk.get(key(h))
        if not check(m is not None, "fixture made heap %s" % (key(h),), sorted(mk)):
            continue
        bad = {f: (m.get(f), v) for f, v in h.items() if f != "stats" and m.get(f) != v}
        check(not bad, "fixture heap %s has the intended figures" % (key(h),), bad)
        if "stats" not in h:
            check("stats" not in m, "fixture heap %s has no allocator figures" % (key(h),))
            continue
        ms = m.get("stats", {})
        bad = {f: (ms.get(f), v) for f, v in h["stats"].items()
               if (abs(ms.get(f, -1) - v) > 1e-9 if f == "fragmentation" else ms.get(f) != v)}
        check(not bad, "fixture heap %s has the intended allocator figures" % (key(h),), bad)


# ---- ps -------------------------------------------------------------------------------------

def check_ps_json(cuma, name, made):
    rc, out, err = run([cuma, "ps", "--ledger", name, "--json"])
    if not check(rc == 0, "ps --json exits 0", (rc, err)):
        return
    try:
        doc = json.loads(out)
    except ValueError as e:
        check(False, "ps --json is JSON", e)
        return
    check(doc.get("ledger") == shm_path(name), "ps --json names the ledger", doc.get("ledger"))
    check(doc.get("heaps") == len(made), "ps --json counts %d heaps" % len(made), doc.get("heaps"))
    check(doc.get("unlocked") is False and "lock_stuck_ns" not in doc,
          "ps --json: read under the ledger's lock", (doc.get("unlocked"), doc.get("lock_stuck_ns")))
    devices = doc.get("devices", [])
    names = [d["device"] for d in devices]
    want_totals = device_totals(made)
    check(names == sorted(want_totals), "ps --json devices in order", names)
    mk = {key(h): h for h in made}
    seen = 0
    for d in devices:
        t = want_totals.get(d["device"], {})
        for f in ("capacity", "reserved", "cached", "guaranteed", "free"):
            check(d.get(f) == t.get(f), "ps --json device %s %s" % (d["device"], f),
                  (d.get(f), t.get(f)))
        res = [h["reserved"] for h in d["heaps"]]
        check(res == sorted(res, reverse=True), "ps --json %s heaps by reserved" % d["device"], res)
        for h in d["heaps"]:
            h = dict(h, device=d["device"])
            m = mk.get(key(h))
            if not check(m is not None, "ps --json heap %s is one the fixtures made" % (key(h),)):
                continue
            seen += 1
            bad = {f: (h.get(f), m[f]) for f in FIELDS if h.get(f) != m[f]}
            check(not bad, "ps --json heap %s: every figure as made" % (key(h),), bad)
            check(h.get("in_use") == m["reserved"] - m["cached"],
                  "ps --json heap %s in_use" % (key(h),), h.get("in_use"))
    check(seen == len(made), "ps --json shows all %d heaps" % len(made), seen)


SIZE = r"(\d+ B|\d+\.\d+ [KMGTPE]iB|-)"


def mib(x):
    return "0 B" if x == 0 else "%.1f MiB" % (x / MB)


def check_ps_table(cuma, name, made):
    rc, out, err = run([cuma, "ps", "--ledger", name])
    if not check(rc == 0, "ps exits 0", (rc, err)):
        return
    check(out.startswith("ledger %s: %d heaps on 2 devices\n" % (shm_path(name), len(made))),
          "ps names the ledger, heaps and devices", out[:120])
    for dev, t in device_totals(made).items():
        line = ("device %s: capacity %s, reserved %s, cached %s, guaranteed %s, free %s "
                "(%d heaps)" % (dev, mib(t["capacity"]), mib(t["reserved"]), mib(t["cached"]),
                                mib(t["guaranteed"]), mib(t["free"]), t["heaps"]))
        check(line in out, "ps device line for %s" % dev, line)
    row = re.compile(r"^\s*(\d+) (\S+)\s+(-?\d+)" + (r"\s+" + SIZE) * 9 + r"\s+(\d+)$")
    rows = {}
    for line in out.splitlines():
        m = row.match(line)
        if m:
            g = m.groups()
            rows[(int(g[0]), int(g[2]), g[1])] = g
    check(len(rows) == len(made), "ps shows a row per heap", out)
    for h in made:
        g = rows.get((h["pid"], h["priority"], h["process"]))
        if not check(g is not None, "ps row for %s" % (key(h),), out):
            continue
        want = [mib(h["guarantee"]), mib(h["limit"]) if h["limit"] else "-", mib(h["reserved"]),
                mib(h["cached"]), mib(h["reserved"] - h["cached"]), mib(h["requested"]),
                mib(h["peak_reserved"]), mib(h["want"]) if h["want"] else "-",
                mib(h["pressure_given_bytes"]), str(h["ledger_denials"])]
        check(list(g[3:]) == want, "ps row for %s: sizes" % (key(h),), (g[3:], want))


# ---- exporter: the text format --------------------------------------------------------------

NAME_RE = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*$")
SAMPLE_RE = re.compile(r"([a-zA-Z_:][a-zA-Z0-9_:]*)(\{.*\})? (\S+)( -?\d+)?$")


def parse_labels(s):
    """{a="x",b="y\\"z"} -> dict; raises ValueError on anything the format does not allow."""
    labels, i = {}, 1
    while s[i] != "}":
        m = re.compile(r"[a-zA-Z_][a-zA-Z0-9_]*").match(s, i)
        if not m or s[m.end():m.end() + 2] != '="':
            raise ValueError("bad label at %d in %r" % (i, s))
        lname, i, val = m.group(0), m.end() + 2, []
        while s[i] != '"':
            if s[i] == "\\":
                esc = {"\\": "\\", '"': '"', "n": "\n"}.get(s[i + 1])
                if esc is None:
                    raise ValueError("bad escape in %r" % s)
                val.append(esc)
                i += 2
            else:
                if s[i] == "\n":
                    raise ValueError("raw newline")
                val.append(s[i])
                i += 1
        if lname in labels:
            raise ValueError("label %s twice" % lname)
        labels[lname] = "".join(val)
        i += 1
        if s[i] == ",":
            i += 1
    if i != len(s) - 1:
        raise ValueError("text after the labels in %r" % s)
    return labels


def parse_exposition(text, what, types_out=None):
    """Checks the text format 0.0.4's rules; returns {(name, frozenset(labels)): value}, and the
    families' types in types_out (a dict) if given."""
    samples, types, helps, done, current = {}, {}, set(), set(), None
    problems = []
    if not text.endswith("\n"):
        problems.append("no final line feed")
    for n, line in enumerate(text.split("\n")[:-1], 1):
        if line.startswith("#"):
            parts = line.split(" ", 3)
            if len(parts) < 4 or parts[1] not in ("HELP", "TYPE") or not NAME_RE.match(parts[2]):
                problems.append("line %d: a comment that is not HELP/TYPE: %r" % (n, line))
                continue
            fam = parts[2]
            if parts[1] == "TYPE":
                if fam in types or fam in done:
                    problems.append("line %d: TYPE of %s again or after its samples" % (n, fam))
                if parts[3] not in ("counter", "gauge", "histogram", "summary", "untyped"):
                    problems.append("line %d: bad type %r" % (n, parts[3]))
                types[fam] = parts[3]
                if parts[3] == "counter" and not fam.endswith("_total"):
                    problems.append("line %d: counter %s does not end in _total" % (n, fam))
            else:
                if fam in helps:
                    problems.append("line %d: HELP of %s twice" % (n, fam))
                helps.add(fam)
            continue
        m = SAMPLE_RE.match(line)
        if not m:
            problems.append("line %d: not a sample: %r" % (n, line))
            continue
        fam, labels, value = m.group(1), m.group(2), m.group(3)
        try:
            lab = parse_labels(labels) if labels else {}
            v = float(value)
        except (ValueError, IndexError) as e:
            problems.append("line %d: %s" % (n, e))
            continue
        if fam != current:
            if fam in done:
                problems.append("line %d: samples of %s are not together" % (n, fam))
            if current:
                done.add(current)
            current = fam
        if fam not in types:
            problems.append("line %d: %s has no TYPE" % (n, fam))
        k = (fam, frozenset(lab.items()))
        if k in samples:
            problems.append("line %d: series %s twice" % (n, k))
        samples[k] = v
    check(not problems, "%s: valid text format 0.0.4" % what, problems[:5])
    if types_out is not None:
        types_out.update(types)
    return samples


HEAP_METRICS = {
    "cuma_reserved_bytes": "reserved", "cuma_cached_bytes": "cached",
    "cuma_requested_bytes": "requested", "cuma_guarantee_bytes": "guarantee",
    "cuma_limit_bytes": "limit", "cuma_peak_reserved_bytes": "peak_reserved",
    "cuma_pressure_want_bytes": "want", "cuma_ledger_denials_total": "ledger_denials",
    "cuma_pressure_asks_total": "pressure_asks",
    "cuma_pressure_given_bytes_total": "pressure_given_bytes",
    "cuma_pressure_callbacks_total": "pressure_callbacks",
}
# The allocator's families: samples only for the heaps that published figures.
ALLOC_METRICS = {
    "cuma_num_allocs_total": ("counter", "num_allocs"),
    "cuma_num_frees_total": ("counter", "num_frees"),
    "cuma_failed_allocs_total": ("counter", "failed_allocs"),
    "cuma_alloc_retries_total": ("counter", "alloc_retries"),
    "cuma_ooms_total": ("counter", "ooms"),
    "cuma_oom_callbacks_total": ("counter", "oom_callbacks"),
    "cuma_managed_fallbacks_total": ("counter", "managed_fallbacks"),
    "cuma_page_creates_total": ("counter", "page_creates"),
    "cuma_page_releases_total": ("counter", "page_releases"),
    "cuma_compactions_total": ("counter", "compactions"),
    "cuma_compact_moved_bytes_total": ("counter", "compact_moved_bytes"),
    "cuma_compact_freed_pages_total": ("counter", "compact_freed_pages"),
    "cuma_active_allocs": ("gauge", "active_allocs"),
    "cuma_allocated_bytes": ("gauge", "allocated_bytes"),
    "cuma_mapped_bytes": ("gauge", "mapped_bytes"),
    "cuma_managed_bytes": ("gauge", "managed_bytes"),
}
HEAP_LABELS = {"UUID", "backend", "container", "namespace", "pid", "pod", "process", "priority",
               "slot"}
POD_LABELS = {"pod": POD["POD_NAME"], "namespace": POD["POD_NAMESPACE"],
              "container": POD["CONTAINER_NAME"]}
DEVICE_METRICS = {
    "cuma_device_capacity_bytes": "capacity", "cuma_device_reserved_bytes": "reserved",
    "cuma_device_cached_bytes": "cached", "cuma_device_guaranteed_bytes": "guaranteed",
    "cuma_device_free_bytes": "free", "cuma_device_heaps": "heaps",
}


def gpu_labels_ok(lab, base):
    """A GPU the driver's files name has DCGM's gpu and device labels beside UUID; others
    (the simulated device) have UUID alone."""
    extra = RAW_GPU_LABELS if lab.get("UUID") == RAW_DEVICE else {}
    return set(lab) == base | set(extra) and all(lab[k] == v for k, v in extra.items())


def heap_series(get, fam, what):
    """A heap family's samples by (pid, device, priority, process); checks their labels."""
    got = {}
    for lab, v in get.get(fam, []):
        if not gpu_labels_ok(lab, HEAP_LABELS) or any(lab[k] != v for k, v in POD_LABELS.items()):
            check(False, "%s: %s labels (the pod's names too, DCGM's gpu and device)" % (what, fam),
                  lab)
            continue
        got[(int(lab["pid"]), lab["UUID"], int(lab["priority"]), lab["process"])] = (
            v, lab["backend"])
    return got


def heap_id(h):
    return (h["pid"], h["device"], h["priority"], h["process"])


def check_metrics(text, made, what, errors=0, up=1, stale=0, unlocked=0):
    """The figures of the heaps in made, every one. up, stale and unlocked: what
    cuma_ledger_up, cuma_ledger_stale and cuma_ledger_unlocked must say (stale figures are the
    last good read's: the same figures; unlocked ones were read without the ledger's lock and
    have cuma_ledger_lock_stuck_seconds, the others none). errors None: any number of failed
    reads. Returns the samples by family."""
    types = {}
    samples = parse_exposition(text, what, types)
    get = {}
    for (fam, lab), v in samples.items():
        get.setdefault(fam, []).append((dict(lab), v))
    check(get.get("cuma_ledger_up") == [({}, float(up))], "%s: cuma_ledger_up %d" % (what, up),
          get.get("cuma_ledger_up"))
    errs = get.get("cuma_exporter_scrape_errors_total")
    if errors is None:
        check(errs is not None and len(errs) == 1 and errs[0][0] == {},
              "%s: cuma_exporter_scrape_errors_total" % what, errs)
    else:
        check(errs == [({}, float(errors))],
              "%s: cuma_exporter_scrape_errors_total %d" % (what, errors), errs)
    check(get.get("cuma_ledger_stale") == [({}, float(stale))] and
          types.get("cuma_ledger_stale") == "gauge", "%s: cuma_ledger_stale %d" % (what, stale),
          get.get("cuma_ledger_stale"))
    age = get.get("cuma_ledger_snapshot_age_seconds")
    check(types.get("cuma_ledger_snapshot_age_seconds") == "gauge" and age is not None and
          len(age) == 1 and age[0][0] == {} and age[0][1] >= 0 and (stale or age[0][1] < 5),
          "%s: cuma_ledger_snapshot_age_seconds" % what, age)
    check(get.get("cuma_ledger_unlocked") == [({}, float(unlocked))] and
          types.get("cuma_ledger_unlocked") == "gauge",
          "%s: cuma_ledger_unlocked %d" % (what, unlocked), get.get("cuma_ledger_unlocked"))
    stuck = get.get("cuma_ledger_lock_stuck_seconds")
    check(types.get("cuma_ledger_lock_stuck_seconds") == "gauge" and
          (stuck is not None and len(stuck) == 1 and stuck[0][0] == {} and stuck[0][1] >= 0
           if unlocked else stuck is None),
          "%s: cuma_ledger_lock_stuck_seconds %s" % (what, "sampled" if unlocked else "absent"),
          stuck)
    # backend: the heap's own name of its backend; empty for the raw slots, which name none.
    backend = {heap_id(h): h["stats"]["backend"] if "stats" in h else "" for h in made}
    for fam, field in sorted(HEAP_METRICS.items()):
        got = heap_series(get, fam, what)
        want = {heap_id(h): (float(h[field]), backend[heap_id(h)]) for h in made}
        check(got == want, "%s: %s of every heap" % (what, fam), (got, want))
    published = [h for h in made if "stats" in h]
    for fam, (typ, field) in sorted(ALLOC_METRICS.items()):
        check(types.get(fam) == typ, "%s: %s is a %s" % (what, fam, typ), types.get(fam))
        got = heap_series(get, fam, what)
        want = {heap_id(h): (float(h["stats"][field]), h["stats"]["backend"]) for h in published}
        check(got == want, "%s: %s of the heaps that published, none of the others"
              % (what, fam), (got, want))
    got = heap_series(get, "cuma_fragmentation_ratio", what)
    want = {heap_id(h): (ledger_fragmentation(h["stats"]), "sim") for h in published}
    check(types.get("cuma_fragmentation_ratio") == "gauge" and set(got) == set(want) and
          all(abs(got[k][0] - want[k][0]) < 1e-9 and got[k][1] == want[k][1] for k in want),
          "%s: cuma_fragmentation_ratio" % what, (got, want))
    got = heap_series(get, "cuma_stranded_bytes", what)
    want = {heap_id(h): (float(round(h["stats"]["mapped_bytes"] *
                                     ledger_fragmentation(h["stats"]))), "sim")
            for h in published}
    check(types.get("cuma_stranded_bytes") == "gauge" and got == want,
          "%s: cuma_stranded_bytes of the heaps that published" % what, (got, want))
    got = heap_series(get, "cuma_heap_stats_age_seconds", what)
    check(types.get("cuma_heap_stats_age_seconds") == "gauge" and
          set(got) == {heap_id(h) for h in published} and
          all(0 <= v < 5 for v, _ in got.values()), "%s: cuma_heap_stats_age_seconds" % what, got)
    totals = device_totals(made)
    for fam, field in sorted(DEVICE_METRICS.items()):
        check(all(gpu_labels_ok(lab, {"UUID"}) for lab, _ in get.get(fam, [])),
              "%s: %s labels (UUID; DCGM's gpu and device where known)" % (what, fam),
              get.get(fam))
        got = {lab.get("UUID"): v for lab, v in get.get(fam, [])}
        want = {d: float(t[field]) for d, t in totals.items()}
        check(got == want, "%s: %s" % (what, fam), (got, want))
    ages = [v for _, v in get.get("cuma_heap_publish_age_seconds", [])]
    check(len(ages) == len(made) and all(0 <= a < 600 for a in ages),
          "%s: cuma_heap_publish_age_seconds" % what, ages)
    return get


# ---- exporter: HTTP -------------------------------------------------------------------------

def http(port, request, timeout=10.0):
    """Sends raw bytes, returns (status, headers, body) or (None, error)."""
    s = socket.create_connection(("127.0.0.1", port), timeout=timeout)
    try:
        s.sendall(request)
        data = b""
        while True:
            chunk = s.recv(65536)
            if not chunk:
                break
            data += chunk
    except OSError as e:
        return None, str(e), b""
    finally:
        s.close()
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    m = re.match(r"HTTP/1\.[01] (\d{3}) ", lines[0] + " ")
    if not m:
        return None, "no status line in %r" % data[:200], b""
    headers = {}
    for l in lines[1:]:
        k, _, v = l.partition(":")
        headers[k.strip().lower()] = v.strip()
    return int(m.group(1)), headers, body


def start_exporter(cuma, name, extra=()):
    p = subprocess.Popen([cuma, "exporter", "--ledger", name, "--port", "0"] + list(extra),
                         stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env())
    line = Lines(p.stderr).line(10) or ""
    m = re.search(r"serving http://127\.0\.0\.1:(\d+)/metrics", line)
    if not m:
        p.kill()
        raise SystemExit("FAIL exporter did not say where it listens: %r" % line)
    return p, int(m.group(1))


def signal_and_wait(p, sig, timeout):
    """Sends sig and waits for the exit status (killed after timeout seconds: then not 0)."""
    p.send_signal(sig)
    try:
        return p.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        p.kill()
        return p.wait()


def stop_exporter(p, what):
    rc = signal_and_wait(p, signal.SIGTERM, 5)
    check(rc == 0, "%s: exits 0 on SIGTERM" % what, rc)


def scrape(port, what):
    t0 = time.monotonic()
    st, headers, body = http(port, b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
    took = time.monotonic() - t0
    check(st == 200, "%s: GET /metrics is 200" % what, (st, headers))
    if st == 200:
        check(headers.get("content-type") == "text/plain; version=0.0.4; charset=utf-8",
              "%s: content type of the text format 0.0.4" % what, headers.get("content-type"))
        check(int(headers.get("content-length", -1)) == len(body),
              "%s: Content-Length" % what, (headers.get("content-length"), len(body)))
    return body.decode("utf-8"), took


def check_http(cuma, name, made):
    p, port = start_exporter(cuma, name)
    # Clients that never finish asking, open while the others are served.
    silent = socket.create_connection(("127.0.0.1", port))
    t_silent = time.monotonic()
    partial = socket.create_connection(("127.0.0.1", port))
    partial.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n")
    time.sleep(0.2)
    text, took = scrape(port, "http")
    # Held up, it would wait for the server's 10 s timeout on the silent clients.
    check(took < 8.0, "http: a scrape is not held up by silent clients (%.3f s)" % took, took)
    check_metrics(text, made, "http")
    # Every scrape reads the ledger afresh: a second one says the same.
    text, _ = scrape(port, "http, again")
    check_metrics(text, made, "http, again")

    st, headers, body = http(port, b"HEAD /metrics HTTP/1.0\r\n\r\n")
    check(st == 200 and body == b"" and int(headers.get("content-length", 0)) > 1000,
          "http: HEAD /metrics: headers, no body", (st, headers, body[:80]))
    for path in (b"/other", b"/", b"/metricsx", b"/metrics/extra"):
        st, _, _ = http(port, b"GET " + path + b" HTTP/1.1\r\n\r\n")
        check(st == 404, "http: GET %s is 404" % path.decode(), st)
    st, headers, _ = http(port, b"GET /metrics?x=1 HTTP/1.1\r\n\r\n")
    check(st == 200, "http: a query string is ignored", st)
    st, headers, _ = http(port, b"POST /metrics HTTP/1.1\r\nContent-Length: 0\r\n\r\n")
    check(st == 405 and headers.get("allow") == "GET, HEAD", "http: POST is 405 with Allow",
          (st, headers))
    for garbage in (b"\x00\xff\xfe garbage\r\n\r\n", b"NOT A REQUEST\r\n\r\n",
                    b"GET /metrics\r\n\r\n", b"GET  /metrics HTTP/1.1\r\n\r\n",
                    b"GET /metrics HTTP/2.0 x\r\n\r\n", b"\r\n\r\n"):
        st, _, _ = http(port, garbage)
        check(st == 400, "http: garbage %r is 400" % garbage[:24], st)
    # 100 KB that never end a line: refused with 431, which arrives (the server reads and
    # drops the rest before it closes: closed unread, the socket would reset and lose it).
    st, err, _ = http(port, b"GET /" + b"A" * 100000)
    check(st == 431, "http: an oversized request is refused with 431", (st, err))
    # Hang-ups: before asking, and right after asking without reading the answer (the server
    # writes to a closed socket: SIGPIPE must not kill it).
    for i in range(20):
        s = socket.create_connection(("127.0.0.1", port))
        if i % 2:
            s.sendall(b"GET /metrics HTTP/1.1\r\n\r\n")
        s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
        s.close()
    text, took = scrape(port, "http, after the bad clients")
    check(p.poll() is None, "http: the exporter still runs", p.poll())
    # The silent clients are dropped after the server's deadline for a request head (2 s), not
    # kept forever. Never before it (it is the server's own clock); the upper bound is only
    # generous, for a loaded machine.
    for s, what in ((silent, "silent"), (partial, "partial")):
        s.settimeout(20)
        try:
            data = s.recv(4096)
        except OSError as e:
            data = str(e)
        waited = time.monotonic() - t_silent
        check(data in (b"",) or isinstance(data, str) and "reset" in data.lower(),
              "http: the %s client is closed on without an answer" % what, data)
        check(1.9 <= waited <= 20, "http: the %s client is dropped after about 2 s (%.1f s)"
              % (what, waited), waited)
        s.close()
    stop_exporter(p, "http")


def check_exporter_waits(cuma, fixture, name):
    """Started before any heap made the ledger: serves cuma_ledger_up 0, counts the failed
    scrapes, and shows the heaps once a fixture made it."""
    p, port = start_exporter(cuma, name)
    for i in (1, 2):
        text, _ = scrape(port, "no ledger yet, scrape %d" % i)
        s = parse_exposition(text, "no ledger yet, scrape %d" % i)
        check(s.get(("cuma_ledger_up", frozenset())) == 0.0
              and s.get(("cuma_exporter_scrape_errors_total", frozenset())) == float(i),
              "no ledger yet, scrape %d: cuma_ledger_up 0, %d error(s)" % (i, i), s)
    f, made = start_fixture(fixture, name, "raw")
    text, _ = scrape(port, "ledger made")
    check_metrics(text, made, "ledger made", errors=2)
    stop_fixture(f)
    stop_exporter(p, "no ledger yet")


# ---- top ------------------------------------------------------------------------------------

def top_rows(frame):
    """Rows of a frame as the columns' texts: 0 PID, 1 PROCESS, 2 PRIO, 3 GUARANTEE, 4 LIMIT,
    5 RESERVED, 6 DELTA, 7 CACHED, 8 IN USE, 9 REQUESTED, 10 PEAK, 11 WANT, 12 GIVEN/s,
    13 DENIALS/s, 14 ALLOC/s, 15 OOMS, 16 FRAG, 17 STRANDED."""
    row = re.compile(r"^\s*(\d+) (\S+)\s+(-?\d+)" + (r"\s+" + SIZE) * 3 +
                     r"\s+([-+](?:\d+ B|\d+\.\d+ [KMGTPE]iB)|0|-)" + (r"\s+" + SIZE) * 5 +
                     r"\s+(\S+ B/s|\S+ [KMGTPE]iB/s|-)\s+(\d+\.\d|-)" +
                     r"\s+(\d+\.\d|\d+|\d\.\d\de\+\d+|-)\s+(\d+|-)\s+(\d+\.\d%|-)\s+" + SIZE + "$")
    rows = []
    for line in frame.splitlines():
        m = row.match(line)
        if m:
            rows.append(m.groups())
    return rows


def view_size(b):
    """ledger_view.c's view_size."""
    if b < 1024:
        return "%d B" % b
    x, u = b / 1024.0, 0
    while x >= 1024.0 and u < 5:
        x, u = x / 1024.0, u + 1
    return ("%.2f %s" if u >= 2 else "%.1f %s") % (x, ("KiB", "MiB", "GiB", "TiB", "PiB", "EiB")[u])


def top_allocator(h):
    """What top's OOMS, FRAG and STRANDED columns show of heap h: "-" for a heap that never
    published."""
    st = h.get("stats")
    if not st:
        return ("-", "-", "-")
    frag = ledger_fragmentation(st)
    return (str(st["ooms"]), "%.1f%%" % (frag * 100.0),
            view_size(int(st["mapped_bytes"] * frag + 0.5)))  # llround, for these positives


def check_top(cuma, name, made, raw, sim):
    rc, out, err = run([cuma, "top", "--ledger", name, "-n", "2", "-d", "0.1"])
    check(rc == 0, "top -n 2 -d 0.1 exits 0", (rc, err))
    check("\033[" not in out, "top: no ANSI codes when stdout is not a terminal", repr(out[:80]))
    frames = out.split("cuma top - ")[1:]
    check(len(frames) == 2 and "refresh 2 of 2" in frames[1], "top: two frames", out[:300])
    for i, f in enumerate(frames):
        rows = top_rows(f)
        check(len(rows) == len(made), "top frame %d: a row per heap" % (i + 1), f)
        # Sorted by device, then reserved bytes (larger first).
        order = [(r[1], r[2]) for r in rows]
        want = [(h["process"], str(h["priority"])) for h in
                sorted(made, key=lambda h: (h["device"], -h["reserved"]))]
        check(order == want, "top frame %d: by device, then reserved" % (i + 1), (order, want))
        if i == 0:
            check(all(r[6] == "-" and r[12] == "-" and r[13] == "-" and r[14] == "-"
                      for r in rows), "top frame 1: no rates yet", rows)
        else:
            # 0.1 s apart, the two frames may show one publication of the allocator figures
            # (every 100 ms): then its rate is unknown ("-"), else 0.
            check(all(r[6] == "0" and r[12] == "0 B/s" and r[13] == "0.0" for r in rows),
                  "top frame 2: nothing changed", rows)
            mine = {(r[1], r[2]): r[14] for r in rows}
            want = {(h["process"], str(h["priority"])): ("0.0", "-") if h.get("stats") else ("-",)
                    for h in made}
            check(all(mine.get(k, "?") in v for k, v in want.items()),
                  "top frame 2: no allocations per second; '-' for heaps that never published",
                  (mine, want))
        got = {(r[1], r[2]): (r[15], r[16], r[17]) for r in rows}
        want = {(h["process"], str(h["priority"])): top_allocator(h) for h in made}
        check(got == want, "top frame %d: OOMS, FRAG and STRANDED" % (i + 1), (got, want))

    # Across a change: X gives 4M in one callback, is refused once, gives 2M to the device;
    # C allocates and frees STEP_ALLOCS times.
    # 2 s apart, so that a count not divided by the time (200) is not a rate (100).
    p = subprocess.Popen([cuma, "top", "--ledger", name, "-n", "2", "-d", "2"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env())
    lines, first = Lines(p.stdout), []
    while True:  # up to X's row in the first frame
        line = lines.line(10)
        if line is None:
            break
        first.append(line)
        if "fx" in line:
            break
    for f in (raw, sim):
        f.stdin.write(b"step\n")
        f.stdin.flush()
    check(raw.lines.line(10) == "stepped\n", "fixture stepped")
    c_line = sim.lines.line(10) or "{}"
    check(sim.lines.line(10) == "stepped\n", "sim fixture stepped")
    c_now = json.loads(c_line)
    c_then = [h for h in made if key(h) == key(c_now)]
    if check(len(c_then) == 1 and c_now["stats"]["num_allocs"] ==
             c_then[0]["stats"]["num_allocs"] + STEP_ALLOCS,
             "sim fixture: C allocated %d times" % STEP_ALLOCS, c_now):
        made[made.index(c_then[0])] = c_now
    out, err = p.communicate(timeout=30)
    check(p.returncode == 0, "top -n 2 -d 2 exits 0", (p.returncode, err))
    out = "".join(first) + (lines.buf + out).decode("utf-8")
    frames = out.split("cuma top - ")[1:]
    rows = top_rows(frames[-1]) if len(frames) == 2 else []
    x = [r for r in rows if r[1] == 'fx"q\\z']
    if check(len(x) == 1, "top: X in the second frame", frames):
        r = x[0]
        check(r[5] == "38.0 MiB" and r[6] == "-2.0 MiB", "top: X's reserved and delta", r)
        m = re.match(r"(\d+\.\d) MiB/s", r[12])
        rate = float(m.group(1)) if m else -1
        # 4 MiB in the refresh interval: 2 s, more on a busy machine (up to 10 s allowed: what
        # is checked is that the figure is a count divided by the time, not how fast top ran).
        check(0.4 <= rate <= 2.0, "top: X's given/s (%s)" % r[12], r)
        check(0.1 <= float(r[13]) <= 0.5, "top: X's denials/s (%s)" % r[13], r)
    c = [r for r in rows if r[1] == "ledger_fixture" and r[2] == "0"]
    if check(len(c) == 1, "top: C in the second frame", frames):
        # STEP_ALLOCS between two publications about 2 s apart (100 ms either way, and up to
        # 10 s on a busy machine).
        rate = float(c[0][14]) if re.match(r"\d+\.\d$", c[0][14]) else -1
        check(STEP_ALLOCS / 10 <= rate <= STEP_ALLOCS / 1.6, "top: C's alloc/s (%s)" % c[0][14],
              c[0])
    # Ctrl-C in the middle of a long interval ends it at once, with status 0.
    p = subprocess.Popen([cuma, "top", "--ledger", name, "-d", "30"], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, env=env())
    lines = Lines(p.stdout)
    while (lines.line(10) or "\n").strip() != "" and p.poll() is None:
        pass  # the first frame ends with an empty line
    t0 = time.monotonic()
    rc = signal_and_wait(p, signal.SIGINT, 15)
    # "At once": well before the 30 s interval ends (15 s allows for a loaded machine).
    check(rc == 0 and time.monotonic() - t0 < 15, "top: Ctrl-C ends it at once with status 0",
          (rc, time.monotonic() - t0))
    x = [h for h in made if h["process"] == 'fx"q\\z'][0]
    x.update(reserved=38 * MB, pressure_given_bytes=10 * MB, pressure_callbacks=3,
             ledger_denials=2)


# ---- a missing ledger and bad options -------------------------------------------------------

def check_missing(cuma, name):
    path = shm_path(name)
    for args in (["ps"], ["ps", "--json"], ["stats"], ["stats", "--json"], ["stats", "1"]):
        rc, out, err = run([cuma] + args + ["--ledger", name])
        check(rc == 1 and path in err and "no cuma heap has run as this user" in err
              and out == "", "missing ledger: cuma %s exits 1 with the path" % " ".join(args),
              (rc, out, err))
    rc, out, err = run([cuma, "top", "--ledger", name, "-n", "2", "-d", "0.05"])
    check(rc == 1 and out.count(path) == 2, "missing ledger: top shows why and exits 1",
          (rc, out, err))
    rc, out, err = run([cuma, "exporter", "--ledger", name, "--once"])
    s = parse_exposition(out, "missing ledger: exporter --once")
    check(rc == 0 and s.get(("cuma_ledger_up", frozenset())) == 0.0
          and s.get(("cuma_exporter_scrape_errors_total", frozenset())) == 1.0
          and path in err, "missing ledger: exporter --once prints cuma_ledger_up 0",
          (rc, out, err))
    # The user's own ledger: whether it exists depends on the machine; either answer is clear.
    rc, out, err = run([cuma, "ps"])
    mine = "/dev/shm/cuma-%d" % os.geteuid()
    check((rc == 0 and out.startswith("ledger %s:" % mine)) or (rc == 1 and mine in err),
          "cuma ps reads the user's ledger", (rc, out[:200], err))


def check_link(cuma, name):
    """A dangling symbolic link at the ledger's path is reported as one, not as no ledger."""
    path = shm_path(name)
    os.symlink("/nonexistent/cuma-ledger-target", path)
    try:
        for args in (["ps"], ["ps", "--json"]):
            rc, out, err = run([cuma] + args + ["--ledger", name])
            check(rc == 1 and "symbolic link" in err and "does not exist" in err
                  and "/nonexistent/cuma-ledger-target" in err
                  and "no cuma heap has run" not in err,
                  "dangling link: cuma %s says what is there" % " ".join(args), (rc, out, err))
    finally:
        os.remove(path)


def check_options(cuma):
    for args in (["ps", "--ledger", "a/b"], ["ps", "--frob"], ["ps", "--ledger"],
                 ["top", "-d", "0"], ["top", "-d", "x"], ["top", "-n", "0"],
                 ["top", "--json"], ["exporter", "--port", "70000"],
                 ["exporter", "--port", "-1"], ["exporter", "--bind", "not-an-address"],
                 ["exporter", "--ledger", "a b", "--once"], ["stats", "--ledger", "a/b"],
                 ["stats", "--frob"], ["stats", "--ledger"], ["stats", "-d", "1"],
                 # Shorter than the pacing of reads (100 ms) and a read: every scrape stale.
                 ["exporter", "--fresh-wait", "100"]):
        rc, out, err = run([cuma] + args, timeout=10)
        check(rc == 2 and "usage: cuma %s" % args[0] in err,
              "bad options: cuma %s exits 2 with usage" % " ".join(args), (rc, err))
    # A PID that is not a positive number is a usage error, before the ledger is read.
    for pid in ("abc", "12x", "0", "+5", " 7", "99999999999", ""):
        rc, out, err = run([cuma, "stats", "--ledger", "no-such-ledger", "1", pid], timeout=10)
        check(rc == 2 and out == "" and "cuma stats: a PID is a positive integer, not '%s'" % pid
              in err and "usage: cuma stats" in err, "bad PID %r: exit 2 naming it" % pid,
              (rc, err))
    for args in (["-5"], ["--", "-5"]):
        rc, out, err = run([cuma, "stats"] + args, timeout=10)
        check(rc == 2 and "'-5'" in err and "usage: cuma stats" in err,
              "cuma stats %s: exit 2" % " ".join(args), (rc, err))
    for sub in ("ps", "top", "stats", "exporter"):
        rc, out, _ = run([cuma, "help", sub])
        check(rc == 0 and out.startswith("usage: cuma %s" % sub), "cuma help %s" % sub, out)
    rc, out, _ = run([cuma, "stats", "-h"])
    check(rc == 0 and out.startswith("usage: cuma stats"), "cuma stats -h", out)
    rc, out, _ = run([cuma, "help"])
    check(rc == 0 and re.search(r"^  stats +\S", out, re.M) is not None,
          "cuma help lists stats", out)


def check_twins(cuma, fixture, name):
    """Two devices whose names differ only in a control byte, which prints as '?': one device
    for the views, so one series of each device family (Prometheus drops a second sample of a
    series), holding both heaps' memory."""
    f, _ = start_fixture(fixture, name, "twins")
    try:
        rc, out, err = run([cuma, "exporter", "--ledger", name, "--once"])
        check(rc == 0, "twins: exporter --once exits 0", (rc, err))
        s = parse_exposition(out, "twins: exporter --once")
        dev = {dict(k[1]).get("UUID"): v for k, v in s.items() if k[0] == "cuma_device_reserved_bytes"}
        check(dev == {"GPU-cuma-fixture-twin?": 3 * MB},
              "twins: one device, both heaps' 3 MiB reserved", dev)
        rc, out, err = run([cuma, "ps", "--ledger", name, "--json"])
        doc = json.loads(out) if rc == 0 else {}
        check([(d.get("device"), len(d.get("heaps", []))) for d in doc.get("devices", [])] ==
              [("GPU-cuma-fixture-twin?", 2)], "twins: ps --json shows one device of 2 heaps",
              (rc, doc.get("devices"), err))
    finally:
        check(stop_fixture(f) == 0, "twins fixture exits 0")


# ---- main -----------------------------------------------------------------------------------

def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cuma", required=True)
    ap.add_argument("--fixture", required=True)
    a = ap.parse_args()
    name = "tools-test-%d" % os.getpid()
    late, missing, twins = name + "-late", name + "-missing", name + "-twins"
    names = (name, late, missing, twins)
    for n in names:
        if os.path.exists(shm_path(n)):
            os.remove(shm_path(n))
    fixtures = []
    try:
        check_options(a.cuma)
        check_missing(a.cuma, missing)
        check_link(a.cuma, missing)
        sim, made_sim = start_fixture(a.fixture, name, "sim")
        fixtures.append(sim)
        raw, made_raw = start_fixture(a.fixture, name, "raw")
        fixtures.append(raw)
        made = made_sim + made_raw
        check_made(made, expected_by_hand(sim.pid, raw.pid))
        check_ps_json(a.cuma, name, made)
        check_ps_table(a.cuma, name, made)
        check_stats(a.cuma, name, made, sim.pid, raw.pid)
        rc, out, err = run([a.cuma, "exporter", "--ledger", name, "--once"])
        check(rc == 0, "exporter --once exits 0", (rc, err))
        check_metrics(out, made, "exporter --once")
        check_http(a.cuma, name, made)
        check_top(a.cuma, name, made, raw, sim)
        check_ps_json(a.cuma, name, made)  # the stepped figures, exact
        rc, doc, err = stats_json(a.cuma, name)
        if check(rc == 0, "stats --json after the step exits 0", (rc, err)):
            check_stats_doc(doc, name, made, made, "stats --json after the step")
        # Gone: the sim heaps leave the ledger, the raw slots are reaped (their process died).
        check(stop_fixture(sim) == 0, "sim fixture exits 0")
        check(stop_fixture(raw) == 0, "raw fixture exits 0")
        fixtures = []
        rc, out, err = run([a.cuma, "ps", "--ledger", name, "--json"])
        doc = json.loads(out) if rc == 0 else {}
        check(doc.get("heaps") == 0 and doc.get("devices") == [],
              "ps --json: no heaps once the fixtures are gone", (rc, out, err))
        rc, out, err = run([a.cuma, "ps", "--ledger", name])
        check(rc == 0 and "no live heaps" in out, "ps: no live heaps", (rc, out, err))
        rc, out, err = run([a.cuma, "stats", "--ledger", name])
        check(rc == 0 and out == "ledger %s: no live heaps\n" % shm_path(name),
              "stats: no live heaps", (rc, out, err))
        rc, doc, err = stats_json(a.cuma, name)
        check(rc == 0 and doc.get("heaps") == 0 and doc.get("devices") == [],
              "stats --json: no heaps once the fixtures are gone", (rc, doc, err))
        check_exporter_waits(a.cuma, a.fixture, late)
        check_twins(a.cuma, a.fixture, twins)
    finally:
        for f in fixtures:
            f.kill()
            f.wait()
        for n in names:
            if os.path.exists(shm_path(n)):
                os.remove(shm_path(n))
    check(not any(os.path.exists(shm_path(n)) for n in names), "shared-memory files removed")
    if failures:
        print("\n%d check(s) failed: %s" % (len(failures), ", ".join(failures)))
        return 1
    print("\nall checks passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
