#!/usr/bin/python3
# SPDX-License-Identifier: Apache-2.0
"""Checks `cuma replay --timeline` and `cuma plot` (docs/PLOTS.md).

usage: check_timeline.py replay    --cuma BIN --out DIR [--scale K] TRACE...
       check_timeline.py bad-input --cuma BIN --out DIR

replay: replays the traces with and without --timeline (every printed figure but ns/op must be
the same), then checks each DIR/NAME.timeline.csv against the replay's figures, the trace and
the allocator's documented stats (include/cuma/cuma.h: reserved = mapped + cached, mapped = pages
under live bytes), then plots them and checks the SVG.

What a timeline must show, and why:
  * at most TL_BUCKETS * TL_KEEP = 3840 rows; times non-decreasing, from the trace's first
    event to its latest one (the replay clamps times that step back);
  * reserved == mapped + cached; requested <= mapped; all three whole 2 MiB pages (the default
    page size: page mode);
  * each row's requested bytes is a level the trace really had at that time (from the trace
    itself), and each slice keeps its peak: the rows' maximum in a slice is at least the trace's
    maximum over the slice's events (at most that or the level carried in from before);
  * max reserved == the printed peak_reserved_bytes, max requested == peak_requested_bytes;
  * between two rows of different slices no event happened (the levels there are exact);
  * the time-averaged ratio recomputed from the rows (each row's levels held until the next
    row, as the replay integrates) is within TIME_AVG_TOL of the printed one. Between slices
    the rows are exact; inside a slice (1/640 of the trace) only the first and last state, the
    peaks and the states that end them are kept, and a level that moved between two kept rows
    counts as the earlier row's. The error is the area of those moves: measured -0.0037,
    -0.0047 and -0.0067 on gpt_generate, lstm_phases and resnet_train x16 (about one slice's
    swing, averaged); the tolerance is three times the largest. The requested integral is also
    compared with the exact one from the trace (REQ_AREA_TOL, relative).

The plot: one panel per file, in order; the reserved and cached polylines have 2n - 1 points
(steps), the requested polygon 2n + 1 (closed on the axis), all inside the plot area; the
highest point of the reserved line is at the row of peak reserved (ties within the figure's
0.1 px rounding allowed); the titles carry the ratios
recomputed from the file, the peak one equal to the replay's printed overhead_ratio; ticks are
evenly spaced round numbers (1, 2 or 5 x 10^k); a --compare file is drawn on its panel only.

bad-input: malformed timelines and options give exit status 2 and a message naming the file
(and FILE:LINE for a bad line) and write no figure; odd but valid files (one row, huge values,
CRLF) give a figure. Standard library only.
"""
import argparse
import bisect
import json
import math
import os
import re
import subprocess
import sys
import xml.etree.ElementTree as ET

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from check_goals import requested_levels  # noqa: E402 (the trace's requested bytes per event)

HEADER = "time_s,requested_bytes,reserved_bytes,cached_bytes,mapped_bytes"
BUCKETS, KEEP = 640, 6  # tools/timeline.h
PAGE = 2 << 20
TIME_AVG_TOL = 0.02
REQ_AREA_TOL = 0.02
SVG = "{http://www.w3.org/2000/svg}"

failures = []


def fail(msg):
    failures.append(msg)
    print("FAIL: " + msg)


def run(cmd):
    env = dict(os.environ)
    env.pop("CUMA_CONF", None)  # the user's settings must not change the test
    p = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                       universal_newlines=True, env=env, timeout=540)  # ctest gives 600: ASan beside other work needed over 120
    return p.returncode, p.stdout, p.stderr


def stem(path):
    name = os.path.basename(path)
    for suffix in (".gz", ".csv", ".timeline"):
        if name.endswith(suffix):
            name = name[: -len(suffix)]
    return name


def read_timeline(path):
    """Rows as (time_us, requested, reserved, cached, mapped), all exact integers."""
    with open(path) as f:
        lines = f.read().splitlines()
    if not lines or lines[0] != HEADER:
        raise SystemExit("FAIL: %s: header %r" % (path, lines[:1]))
    rows = []
    for n, line in enumerate(lines[1:], 2):
        m = re.fullmatch(r"(\d+)\.(\d{6}),(\d+),(\d+),(\d+),(\d+)", line)
        if not m:
            raise SystemExit("FAIL: %s:%d: malformed row %r" % (path, n, line))
        g = [int(x) for x in m.groups()]
        rows.append((g[0] * 1000000 + g[1],) + tuple(g[2:]))
    return rows


def areas(rows):
    """Integrals of requested and reserved (byte-microseconds), each row held to the next."""
    req = res = 0
    for k in range(len(rows) - 1):
        dt = rows[k + 1][0] - rows[k][0]
        req += rows[k][1] * dt
        res += rows[k][2] * dt
    return req, res


def bucket(t, t0, span):
    dt = max(t - t0, 0)
    return BUCKETS - 1 if dt >= span else dt * BUCKETS // span


def check_timeline(path, r, trace, scale):
    name = os.path.basename(path)
    rows = read_timeline(path)
    times, levels = requested_levels(trace, scale)
    n = len(rows)
    print("%s: %d rows" % (name, n))
    if not 2 <= n <= BUCKETS * KEEP:
        fail("%s: %d rows, expected 2..%d" % (name, n, BUCKETS * KEEP))
        return
    t = [row[0] for row in rows]
    if any(b < a for a, b in zip(t, t[1:])):
        fail("%s: time goes back" % name)
    if t[0] != times[0] or t[-1] != times[-1]:
        fail("%s: rows span %d..%d us, the trace %d..%d" % (name, t[0], t[-1], times[0], times[-1]))
    for k, (_, req, res, cached, mapped) in enumerate(rows):
        why = None
        if res != mapped + cached:
            why = "reserved != mapped + cached"
        elif req > mapped:
            why = "requested > mapped"
        elif res % PAGE or mapped % PAGE or cached % PAGE:
            why = "not whole 2 MiB pages"
        if why:
            fail("%s: row %d %s: %s" % (name, k + 2, rows[k], why))
            break
    # Requested bytes: each row one of the trace's levels at its time.
    by_time = {}
    for tm, lv in zip(times, levels):
        by_time.setdefault(tm, set()).add(lv)
    for k, row in enumerate(rows):
        i = bisect.bisect_right(times, row[0]) - 1
        if i < 0 or (row[1] != levels[i] and row[1] not in by_time.get(row[0], ())):
            fail("%s: row %d: requested %d is no level of the trace at %d us"
                 % (name, k + 2, row[1], row[0]))
            break
    # Peaks: per slice, the rows' maximum against the trace's events in it.
    t0, span = t[0], t[-1] - t[0]
    ev_max, carried, row_max = {}, {}, {}
    for i, (tm, lv) in enumerate(zip(times, levels)):
        b = bucket(tm, t0, span)
        if b not in ev_max:
            carried[b] = levels[i - 1] if i else 0
        ev_max[b] = max(ev_max.get(b, 0), lv)
    for row in rows:
        b = bucket(row[0], t0, span)
        row_max[b] = max(row_max.get(b, 0), row[1])
    for b in sorted(ev_max):
        if not ev_max[b] <= row_max.get(b, -1) <= max(ev_max[b], carried[b]):
            fail("%s: slice %d: rows' peak requested %s, the trace's %d" %
                 (name, b, row_max.get(b), ev_max[b]))
            break
    # No event between rows of different slices.
    for a, b in zip(rows, rows[1:]):
        if bucket(a[0], t0, span) != bucket(b[0], t0, span):
            i = bisect.bisect_right(times, a[0])
            if i < len(times) and times[i] < b[0]:
                fail("%s: an event at %d us between rows at %d and %d of different slices"
                     % (name, times[i], a[0], b[0]))
                break
    peak_res = max(row[2] for row in rows)
    peak_req = max(row[1] for row in rows)
    if peak_res != r["peak_reserved_bytes"] or peak_req != r["peak_requested_bytes"]:
        fail("%s: peaks %d/%d, the replay printed %d/%d" % (name, peak_res, peak_req,
             r["peak_reserved_bytes"], r["peak_requested_bytes"]))
    a_req, a_res = areas(rows)
    ratio = a_res / a_req
    exact_req = sum(levels[i] * (times[i + 1] - times[i]) for i in range(len(times) - 1))
    req_err = a_req / exact_req - 1
    print("  peak reserved %d = printed; time-avg from the rows %.4f, printed %.4f (%+.4f, "
          "tolerance %.2f); requested area %+.4f%% of the exact one"
          % (peak_res, ratio, r["time_avg_ratio"], ratio - r["time_avg_ratio"], TIME_AVG_TOL,
             100 * req_err))
    if abs(ratio - r["time_avg_ratio"]) > TIME_AVG_TOL:
        fail("%s: time-avg ratio from the rows %.4f, printed %.4f" % (name, ratio,
                                                                       r["time_avg_ratio"]))
    if abs(req_err) > REQ_AREA_TOL:
        fail("%s: requested area off by %.2f%%" % (name, 100 * req_err))
    return rows


def points(el):
    return [tuple(float(v) for v in p.split(",")) for p in el.get("points").split()]


def check_ticks(name, labels, what):
    values = [float(x) for x in labels]
    if len(values) < 2:
        fail("%s: %d %s ticks" % (name, len(values), what))
        return
    steps = [b - a for a, b in zip(values, values[1:])]
    step = steps[0]
    mantissa = step / 10 ** math.floor(math.log10(step))
    if any(abs(s - step) > 1e-9 * max(1, step) for s in steps) or \
            min(abs(mantissa - m) for m in (1, 2, 5, 10)) > 1e-6 or \
            any(abs(v / step - round(v / step)) > 1e-6 for v in values):
        fail("%s: %s ticks %s are not evenly spaced round numbers" % (name, what, labels))


def ratio_text(x):
    return "n/a" if x is None else "%.4f" % x


def check_svg(svg_path, files, replays, compare):
    """compare: {stem: (name, rows)} drawn on the panel of that stem."""
    root = ET.parse(svg_path).getroot()
    if root.tag != SVG + "svg":
        fail("%s: root element %s" % (svg_path, root.tag))
    if root.iter(SVG + "script") and any(True for _ in root.iter(SVG + "script")):
        fail("%s: has a script element" % svg_path)
    panels = [g for g in root.iter(SVG + "g") if g.get("class") == "panel"]
    if len(panels) != len(files):
        fail("%s: %d panels for %d timelines" % (svg_path, len(panels), len(files)))
        return
    for g, path in zip(panels, files):
        name = os.path.basename(path)
        rows = read_timeline(path)
        n = len(rows)
        rect = [e for e in g.iter(SVG + "rect") if e.get("class") == "plot-area"][0]
        x0, y0 = float(rect.get("x")), float(rect.get("y"))
        x1, y1 = x0 + float(rect.get("width")), y0 + float(rect.get("height"))
        shapes = {}
        for e in list(g.iter(SVG + "polyline")) + list(g.iter(SVG + "polygon")):
            shapes.setdefault(e.get("class"), []).append(points(e))
        want = {"reserved": [2 * n - 1], "cached": [2 * n - 1], "requested": [2 * n + 1]}
        if stem(path) in compare:
            want["compare"] = [2 * len(compare[stem(path)][1]) - 1]
        got = {k: [len(p) for p in v] for k, v in shapes.items()}
        if got != want:
            fail("%s: point counts %s, expected %s" % (name, got, want))
        for cls, lines in shapes.items():
            for pts in lines:
                out = [p for p in pts if not (x0 - 0.05 <= p[0] <= x1 + 0.05
                                              and y0 - 0.05 <= p[1] <= y1 + 0.05)]
                if out:
                    fail("%s: %s has %d points outside the plot area, e.g. %s"
                         % (name, cls, len(out), out[0]))
                xs = [p[0] for p in pts[1:-1]] if cls == "requested" else [p[0] for p in pts]
                if any(b < a for a, b in zip(xs, xs[1:])):
                    fail("%s: %s goes back in x" % (name, cls))
        res_pts = shapes.get("reserved", [[]])[0]
        if res_pts:
            top = min(range(len(res_pts)), key=lambda i: (res_pts[i][1], i))
            peak_row = max(range(n), key=lambda k: (rows[k][2], -k))
            # Point 2k is row k's level (its first appearance is at 2k - 1 for k > 0). The
            # figure rounds to 0.1 px, so an earlier level a page below the peak may tie with
            # it: the peak row's point must be at the top, not necessarily the first there.
            if res_pts[2 * peak_row][1] != res_pts[top][1]:
                fail("%s: the reserved line peaks at point %d, the file at row %d"
                     % (name, top, peak_row))
        a_req, a_res = areas(rows)
        peak = max(r[2] for r in rows) / max(r[1] for r in rows)
        title = [e.text for e in g.iter(SVG + "text") if e.get("class") == "panel-title"][0]
        want_title = "peak reserved / requested %s, time-averaged %s" % (
            ratio_text(peak), ratio_text(a_res / a_req if a_req else None))
        if want_title not in title or not title.startswith(stem(path) + ":"):
            fail("%s: title %r lacks %r" % (name, title, want_title))
        printed = replays.get(stem(path))
        if printed and "%.4f" % printed["overhead_ratio"] != ratio_text(peak):
            fail("%s: peak ratio %s in the plot, %.4f printed by the replay"
                 % (name, ratio_text(peak), printed["overhead_ratio"]))
        for cls, what in (("ytick", "y"), ("xtick", "x")):
            labels = [e.text for e in g.iter(SVG + "text") if e.get("class") == cls]
            check_ticks(name, labels, what)
        print("%s: panel ok: %d rows, %s" % (name, n, title))


def mode_replay(args):
    base = [args.cuma, "replay", "--json", "--scale", str(args.scale), "--conf",
            "release_delay_ms:1000"]
    rc0, plain, err0 = run(base + args.traces)
    rc1, with_tl, err1 = run(base + ["--timeline", args.out] + args.traces)
    if rc0 or rc1:
        raise SystemExit("FAIL: replay exited %d / %d: %s%s" % (rc0, rc1, err0, err1))
    strip = lambda out: [re.sub(r'"ns_per_op":[0-9.]+', "", l) for l in out.splitlines()]
    if strip(plain) != strip(with_tl):
        fail("--timeline changed the printed figures:\n%s\n%s" % (plain, with_tl))
    else:
        print("replay figures identical with and without --timeline (ns/op aside)")
    replays = {stem(json.loads(l)["trace"]): json.loads(l) for l in with_tl.splitlines()}
    files = []
    for trace in args.traces:
        path = os.path.join(args.out, stem(trace) + ".timeline.csv")
        if not os.path.isfile(path):
            fail("no %s" % path)
            continue
        check_timeline(path, replays[stem(trace)], trace, args.scale)
        files.append(path)
    if not files:
        return
    # A made-up second allocator for the last trace's panel, in a folder of its own.
    cmp_dir = os.path.join(args.out, "other")
    os.makedirs(cmp_dir, exist_ok=True)
    last = read_timeline(files[-1])
    cmp_rows = [last[0], last[len(last) // 2], last[-1]]
    cmp_path = os.path.join(cmp_dir, os.path.basename(files[-1]))
    with open(cmp_path, "w") as f:
        f.write(HEADER + "\n")
        for row in cmp_rows:
            t, req, res = row[0], row[1], row[2] * 3 // 2
            f.write("%d.%06d,%d,%d,%d,%d\n" % (t // 1000000, t % 1000000, req, res, res - req, req))
    svg = os.path.join(args.out, "replays.svg")
    if os.path.exists(svg):
        os.remove(svg)
    rc, out, err = run([args.cuma, "plot", "-o", svg, "--title", "check <&> title",
                        "--compare", "other=" + cmp_path] + files)
    if rc != 0:
        fail("cuma plot exited %d: %s" % (rc, err))
        return
    check_svg(svg, files, replays, {stem(cmp_path): ("other", cmp_rows)})
    # Without -o the figure goes to stdout, the same bytes.
    rc, out, err = run([args.cuma, "plot", "--title", "check <&> title",
                        "--compare=other=" + cmp_path] + files)
    with open(svg) as f:
        if rc != 0 or out != f.read():
            fail("cuma plot to stdout differs from -o (exit %d)" % rc)


def mode_bad_input(args):
    d = args.out
    os.makedirs(d, exist_ok=True)
    good_row = "0.000000,1048576,2097152,0,2097152"

    def write(name, text, binary=False):
        path = os.path.join(d, name)
        with open(path, "wb" if binary else "w", **({} if binary else {"newline": ""})) as f:
            f.write(text)
        return path

    def expect(what, argv, status, err_has=(), out_file=None, out_has=None):
        if out_file and os.path.exists(out_file):
            os.remove(out_file)
        rc, out, err = run([args.cuma] + argv)
        problems = []
        if rc != status:
            problems.append("exit %d, expected %d" % (rc, status))
        problems += ["stderr lacks %r" % s for s in err_has if s not in err]
        if status and out_file and os.path.exists(out_file):
            problems.append("a figure was written after the error")
        if out_has is not None:
            problems += [] if out_has in out else ["stdout lacks %r" % out_has]
        elif status == 0:
            try:
                root = ET.fromstring(open(out_file).read() if out_file else out)
                for e in root.iter():
                    for p in (e.get("points") or "").split():
                        x, y = (float(v) for v in p.split(","))
                        if not (math.isfinite(x) and math.isfinite(y)):
                            problems.append("non-finite point %s" % p)
            except (ET.ParseError, OSError) as e:
                problems.append("no valid SVG: %s" % e)
        print("%-4s %s: cuma %s" % ("FAIL" if problems else "ok", what, " ".join(argv)))
        if problems:
            fail("%s: %s; stderr %r" % (what, "; ".join(problems), err[-400:]))

    hdr = HEADER + "\n"
    svg = os.path.join(d, "out.svg")
    cases = [
        ("empty file", "empty.csv", "", "empty.csv: empty file"),
        ("header only", "header_only.csv", hdr, "header_only.csv: no samples"),
        ("wrong header", "wrong_header.csv", "time,req\n" + good_row + "\n",
         "wrong_header.csv:1:"),
        ("four fields", "fields.csv", hdr + good_row + "\n1.0,1,2,3\n", "fields.csv:3:"),
        ("non-numeric bytes", "word.csv", hdr + "0.5,many,2097152,0,2097152\n",
         "word.csv:2: requested_bytes"),
        ("NaN time", "nan.csv", hdr + "nan,1,2,0,2\n", "nan.csv:2: time_s"),
        ("infinite time", "inf.csv", hdr + good_row + "\n1e999,1,2,0,2\n", "inf.csv:3: time_s"),
        ("negative time", "negtime.csv", hdr + "-1.5,1,2,0,2\n", "negtime.csv:2: time_s: negative"),
        ("negative bytes", "negbytes.csv", hdr + "1.5,1,-2,0,2\n",
         "negbytes.csv:2: reserved_bytes: negative"),
        ("bytes past 2^64", "huge.csv", hdr + "1.5,1,18446744073709551616,0,2\n",
         "huge.csv:2: reserved_bytes: out of range"),
        ("time goes back", "back.csv", hdr + "2.0,1,2,0,2\n1.0,1,2,0,2\n", "back.csv:3: time_s"),
        ("decimal bytes", "frac.csv", hdr + "1.0,1.5,2,0,2\n", "frac.csv:2: requested_bytes"),
        ("hex time", "hex.csv", hdr + "0x10,1,2,0,2\n", "hex.csv:2: time_s"),
    ]
    for what, fname, text, msg in cases:
        path = write(fname, text)
        expect(what, ["plot", "-o", svg, path], 2, [path.split("/")[-1], msg], svg)
    nul = write("nul.csv", (hdr + "1.0,1,2\x00,0,2\n").encode(), binary=True)
    expect("NUL byte", ["plot", "-o", svg, nul], 2, ["nul.csv:2:"], svg)
    missing = os.path.join(d, "no_such.timeline.csv")
    expect("missing file", ["plot", "-o", svg, missing], 2, ["no_such.timeline.csv"], svg)
    expect("a directory", ["plot", "-o", svg, d], 2, [d], svg)
    good = write("good.timeline.csv", hdr + good_row + "\n1.000000,0,2097152,2097152,0\n")
    # A bad file after a good one still leaves no figure.
    expect("good then bad", ["plot", "-o", svg, good, os.path.join(d, "nan.csv")], 2,
           ["nan.csv:2:"], svg)
    # Usage errors.
    expect("no timeline", ["plot", "-o", svg], 2, ["usage:"], svg)
    expect("unknown option", ["plot", "--frobnicate", good], 2, ["usage:"])
    expect("-o without value", ["plot", good, "-o"], 2, ["-o needs a value"])
    expect("--compare without NAME=", ["plot", "--compare", good, good], 2, ["NAME=TIMELINE"])
    other = write("other.timeline.csv", hdr + good_row + "\n")
    expect("--compare of no panel", ["plot", "-o", svg, "--compare", "x=" + other, good], 2,
           ["other.timeline.csv", "no timeline named other"], svg)
    expect("unwritable output", ["plot", "-o", os.path.join(d, "no_dir", "x.svg"), good], 2,
           ["no_dir/x.svg"])
    # Odd but valid: a figure, finite coordinates.
    expect("one row", ["plot", "-o", svg, write("one.csv", hdr + good_row + "\n")], 0,
           out_file=svg)
    if os.path.exists(svg) and "time-averaged n/a" not in open(svg).read():
        fail("one row: the title should say time-averaged n/a")
    expect("huge values", ["plot", "-o", svg, write(
        "big.csv", hdr + "1000000000000000.000000,18446744073709551615,18446744073709551615,0,"
        "18446744073709551615\n1000000000000000.5,0,18446744073709551615,18446744073709551615,0\n")],
        0, out_file=svg)
    expect("all zero", ["plot", write("zero.csv", hdr + "0,0,0,0,0\n0,0,0,0,0\n")], 0)
    expect("CRLF and a blank line", ["plot", write("crlf.csv", hdr.replace("\n", "\r\n") +
                                                   good_row + "\r\n\r\n2.5,3,4,1,3\r\n")], 0)
    expect("help", ["help", "plot"], 0, out_has="--compare NAME=TIMELINE.csv")
    expect("replay --help", ["replay", "--help"], 0, out_has="--timeline DIR")
    # replay --timeline into something that is not a directory.
    valid = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "valid.csv")
    expect("replay --timeline FILE", ["replay", "--timeline", good, valid], 2,
           ["good.timeline.csv is not a directory"])
    expect("replay --timeline without value", ["replay", valid, "--timeline"], 2,
           ["--timeline needs a value"])
    # Two traces of one name would write one timeline: refused before any replay, naming both.
    twin_dir = os.path.join(d, "twin")
    os.makedirs(twin_dir, exist_ok=True)
    twin = os.path.join(twin_dir, "valid.csv")
    with open(valid) as src, open(twin, "w") as dst:
        dst.write(src.read())
    tl_out = os.path.join(d, "tl_twins")
    expect("replay --timeline of two traces of one name", ["replay", "--timeline", tl_out, valid,
           twin], 2, [valid, twin, "valid.timeline.csv"],
           os.path.join(tl_out, "valid.timeline.csv"))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("mode", choices=["replay", "bad-input"])
    ap.add_argument("--cuma", required=True)
    ap.add_argument("--out", required=True, help="a scratch folder")
    ap.add_argument("--scale", type=int, default=16)
    ap.add_argument("traces", nargs="*")
    args = ap.parse_intermixed_args()
    os.makedirs(args.out, exist_ok=True)
    if args.mode == "replay":
        if not args.traces:
            ap.error("replay needs traces")
        mode_replay(args)
    else:
        mode_bad_input(args)
    if failures:
        print("%d check(s) failed" % len(failures))
        return 1
    print("all checks passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
