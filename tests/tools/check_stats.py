# SPDX-License-Identifier: Apache-2.0
"""The checks of `cuma stats` (text, JSON, PIDs, errors) against what ledger_fixture made;
check_tools.py runs them with the others."""
import json
import os
import re
import subprocess

from ledger_checks import FIELDS, STAT_FIELDS, check, device_totals, key, run, shm_path


def size(b):
    """view_size's text: "512 B", "12.0 MiB", "1.50 GiB"."""
    if b < 1024:
        return "%d B" % b
    x, u, units = b / 1024.0, 0, ["KiB", "MiB", "GiB", "TiB", "PiB", "EiB"]
    while x >= 1024.0 and u + 1 < len(units):
        x, u = x / 1024.0, u + 1
    return ("%.2f %s" if u >= 2 else "%.1f %s") % (x, units[u])


def duration(ns):
    if ns < 1000:
        return "%d ns" % ns
    if ns < 1000000:
        return "%.1f us" % (ns / 1e3)
    if ns < 1000000000:
        return "%.1f ms" % (ns / 1e6)
    return "%.2f s" % (ns / 1e9)


def stats_json(cuma, name, pids=()):
    rc, out, err = run([cuma, "stats", "--ledger", name, "--json"] + [str(p) for p in pids])
    try:
        return rc, json.loads(out), err
    except ValueError as e:
        return rc, {"not json": str(e), "out": out}, err


def check_stats_doc(doc, name, made, shown, what):
    """A `cuma stats --json` document: ps's shape with the heaps `shown`, devices' totals over
    all the `made` ones, and each heap's allocator figures equal to what the heap itself
    reported (null for the raw slots, which never publish)."""
    check(doc.get("ledger") == shm_path(name), "%s names the ledger" % what, doc.get("ledger"))
    check(doc.get("uid") == os.geteuid(), "%s names the uid" % what, doc.get("uid"))
    check(doc.get("heaps") == len(shown), "%s counts %d heaps" % (what, len(shown)),
          doc.get("heaps"))
    devices = doc.get("devices", [])
    totals = device_totals(made)
    check([d["device"] for d in devices] == sorted({h["device"] for h in shown}),
          "%s: the devices of the heaps shown, in order" % what, [d["device"] for d in devices])
    mk = {key(h): h for h in shown}
    seen = set()
    for d in devices:
        t = totals.get(d["device"], {})
        for f in ("capacity", "reserved", "cached", "guaranteed", "free"):
            check(d.get(f) == t.get(f), "%s: device %s %s (all its heaps)" % (what, d["device"], f),
                  (d.get(f), t.get(f)))
        for h in d["heaps"]:
            h = dict(h, device=d["device"])
            k = key(h)
            m = mk.get(k)
            if not check(m is not None and k not in seen, "%s: heap %s shown once, as made"
                         % (what, k)):
                continue
            seen.add(k)
            bad = {f: (h.get(f), m[f]) for f in FIELDS if h.get(f) != m[f]}
            check(not bad, "%s: heap %s: the ledger's figures" % (what, k), bad)
            ms = m.get("stats")
            if ms is None:
                nulls = ["backend", "fragmentation", "stats_age_ns"] + STAT_FIELDS
                bad = {f: h.get(f, "absent") for f in nulls if h.get(f, "absent") is not None}
                check(not bad, "%s: heap %s never published: its figures are null" % (what, k),
                      bad)
                continue
            bad = {f: (h.get(f), ms[f]) for f in ["backend"] + STAT_FIELDS if h.get(f) != ms[f]}
            check(not bad, "%s: heap %s: allocator figures equal its own stats" % (what, k), bad)
            frag = h.get("fragmentation")
            check(isinstance(frag, float) and abs(frag - ms["fragmentation"]) <= 5e-7 + 1e-12,
                  "%s: heap %s: fragmentation %s (its own %r)" % (what, k, frag,
                                                                 ms["fragmentation"]), frag)
            age = h.get("stats_age_ns")
            # Published every 100 ms: a few seconds allow for a loaded machine.
            check(isinstance(age, int) and 0 <= age < 5e9, "%s: heap %s: stats_age_ns" % (what, k),
                  age)
    check(len(seen) == len(shown), "%s shows all %d heaps" % (what, len(shown)), len(seen))


# The allocator figures `cuma stats` shows, those of the list in include/cuma/cuma.h that the
# ledger carries, in the list's order, with their kind and unit. Written out here, so that the
# text is checked against the list rather than against the tool's own expansion of it.
SHOWN_FIGURES = [
    ("peak_requested_bytes", "gauge", "bytes"), ("allocated_bytes", "gauge", "bytes"),
    ("mapped_bytes", "gauge", "bytes"), ("managed_bytes", "gauge", "bytes"),
    ("page_size", "gauge", "bytes"), ("active_allocs", "gauge", "count"),
    ("num_allocs", "counter", "count"), ("num_frees", "counter", "count"),
    ("failed_allocs", "counter", "count"), ("alloc_retries", "counter", "count"),
    ("ooms", "counter", "count"), ("oom_callbacks", "counter", "count"),
    ("managed_fallbacks", "counter", "count"), ("page_creates", "counter", "count"),
    ("page_releases", "counter", "count"), ("maps", "counter", "count"),
    ("unmaps", "counter", "count"), ("page_call_ns", "counter", "ns"),
    ("trims", "counter", "count"), ("fragmentation", "gauge", "ratio"),
    ("arenas", "gauge", "count"), ("compactions", "counter", "count"),
    ("compact_moved_bytes", "counter", "bytes"), ("compact_freed_pages", "counter", "count")]


def figure_text(st, name, unit):
    if unit == "bytes":
        return size(st[name])
    if unit == "ns":
        return duration(st[name])
    if unit == "ratio":  # the ledger keeps parts per million
        return "%.1f%%" % (int(st[name] * 1e6 + 0.5) / 1e6 * 100.0)
    return "%d" % st[name]


def figure_lines(st, kind, label):
    """The figures of one kind as "name value", after the label, wrapped at 100 columns under
    the label's column."""
    lines, cur = [], "  %-14s" % label
    for i, (name, k, unit) in enumerate(f for f in SHOWN_FIGURES if f[1] == kind):
        item = "%s %s" % (name, figure_text(st, name, unit))
        if i and len(cur) + 2 + len(item) > 100:
            lines.append(cur + ",")
            cur = " " * 16 + item
        else:
            cur += (", " if i else "") + item
    return lines + [cur]


def stats_block(m):
    """The lines `cuma stats` prints for heap m (as the fixture made it), after the header and
    without the age line (the ages change)."""
    st = m.get("stats")
    lines = ["  %-14s%s" % ("backend", st["backend"] if st else "-"),
             "  %-14s%s" % ("settings", "priority %d, guarantee %s, limit %s" % (
                 m["priority"], size(m["guarantee"]), size(m["limit"]) if m["limit"] else "-")),
             "  %-14s%s" % ("memory", "reserved %s, cached %s, in use %s, requested %s" % (
                 size(m["reserved"]), size(m["cached"]), size(m["reserved"] - m["cached"]),
                 size(m["requested"]))),
             "  %-14sreserved %s" % ("peaks", size(m["peak_reserved"]))]
    if st:
        lines += figure_lines(st, "gauge", "gauges") + figure_lines(st, "counter", "counters")
    else:
        lines.append("  %-14snever published (no release thread: release_thread:off or "
                     "sim_clock:manual)" % "allocator")
    lines.append("  %-14swant %s, denials %d, asks %d, given %s, callbacks %d" % (
        "ledger", size(m["want"]) if m["want"] else "-", m["ledger_denials"], m["pressure_asks"],
        size(m["pressure_given_bytes"]), m["pressure_callbacks"]))
    return lines


AGE = r"(\d+ ns|\d+\.\d (?:us|ms)|\d+\.\d\d s)"


def check_stats_text(cuma, name, made):
    rc, out, err = run([cuma, "stats", "--ledger", name])
    if not check(rc == 0 and err == "", "stats exits 0, nothing on stderr", (rc, err)):
        return
    check(out.startswith("ledger %s: %d heaps on 2 devices\n\n" % (shm_path(name), len(made))),
          "stats names the ledger, heaps and devices", out[:120])
    blocks = out.split("\n\n")[1:]
    check(len(blocks) == len(made), "stats: a block per heap", out)
    for m in made:
        head = "pid %d %s, device %s, slot " % (m["pid"], m["process"], m["device"])
        want = stats_block(m)
        found = [b for b in blocks if b.startswith(head) and want[1] in b.split("\n")]
        if not check(len(found) == 1, "stats: one block for %s" % (key(m),), (head, want[1])):
            continue
        lines = found[0].rstrip("\n").split("\n")
        check(re.match(r"pid \d+ .*, slot \d+$", lines[0]) is not None,
              "stats: %s: the header" % (key(m),), lines[0])
        check(lines[1:-1] == want, "stats: %s: every figure" % (key(m),), (lines[1:-1], want))
        age = (r"  age           allocator figures %s, cached/requested %s$" % (AGE, AGE)
               if m.get("stats") else r"  age           cached/requested %s$" % AGE)
        check(re.match(age, lines[-1]) is not None, "stats: %s: the age line" % (key(m),),
              lines[-1])


def dead_pid():
    """A pid that is not running: a child's, once it has been waited for."""
    p = subprocess.Popen(["true"])
    p.wait()
    return p.pid


def check_stats(cuma, name, made, pid_sim, pid_raw):
    rc, doc, err = stats_json(cuma, name)
    if check(rc == 0 and err == "", "stats --json exits 0", (rc, err)):
        check_stats_doc(doc, name, made, made, "stats --json")
    check_stats_text(cuma, name, made)
    # Only the named processes' heaps; each named once even if given twice.
    for pids in ([pid_sim], [pid_raw], [pid_raw, pid_sim, pid_raw]):
        shown = [h for h in made if h["pid"] in pids]
        rc, doc, err = stats_json(cuma, name, pids)
        what = "stats --json %s" % " ".join(map(str, pids))
        if check(rc == 0 and err == "", "%s exits 0" % what, (rc, err)):
            check_stats_doc(doc, name, made, shown, what)
    rc, out, err = run([cuma, "stats", "--ledger", name, str(pid_raw)])
    check(rc == 0 and out.startswith("ledger %s: 2 of its %d heaps\n" % (shm_path(name),
                                                                       len(made)))
          and out.count("\npid %d " % pid_raw) == 2 and "\npid %d " % pid_sim not in out,
          "stats PID: that process's blocks only", (rc, out[:300], err))
    # PIDs without a heap: exit 1, each named; the heaps of the others are still shown.
    gone, alive = dead_pid(), os.getpid()
    rc, out, err = run([cuma, "stats", "--ledger", name, str(gone)])
    check(rc == 1 and out == "" and err == "cuma stats: pid %d is not running\n" % gone,
          "stats: a pid not running exits 1 naming it", (rc, out, err))
    rc, out, err = run([cuma, "stats", "--ledger", name, str(alive)])
    check(rc == 1 and out == "" and err == "cuma stats: pid %d has no heap in ledger %s\n"
          % (alive, shm_path(name)), "stats: a pid without a heap exits 1 naming it",
          (rc, out, err))
    rc, doc, err = stats_json(cuma, name, [gone, pid_sim])
    check(rc == 1 and err == "cuma stats: pid %d is not running\n" % gone and
          doc.get("heaps") == len([h for h in made if h["pid"] == pid_sim]),
          "stats: with a pid not running, the other pid's heaps and exit 1", (rc, doc, err))
