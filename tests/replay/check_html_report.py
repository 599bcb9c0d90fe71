#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""`cuma plot --html`: the report page, loaded in a real browser (Debian's chromium, headless).

- The page is one file that references nothing outside itself: no src=/href= attribute, no
  url(, @import, fetch(, XMLHttpRequest, <link>, <img>, and "http" only as the SVG namespace
  name (an identifier, never fetched).
- Its series are the rows `cuma replay --timeline` writes for the same trace.
- Loaded with #hover=T (the page's link/test hook) and --dump-dom: it drew the three series,
  the live blocks it lists at the end of the recording carry the call sites and bytes that
  `cuma leaks --json` reports (the same rule, callsite.c), the hovered largest block's whole
  stack is shown, the page map is drawn, and nothing reached window.onerror or console.error
  (a copy of the page with a thrown error shows that the catcher works).
- A small RMM CSV trace (no stacks) gives a page too, its blocks "(no stack recorded)".
- --screenshot at 1200x800 writes that PNG.
- Bad options and a missing trace: exit 2, a message saying what, no file.

chromium missing is a failure: scripts/deps.sh test installs it.
usage: check_html_report.py --cuma CUMA --data tests/data --out DIR
"""

import argparse
import html
import json
import os
import re
import shutil
import struct
import subprocess
import sys
import tempfile

TRACE = "snapshot_toy_attention.pickle.gz"  # 97 events with call stacks (tests/data/README.md)
SVG_NS = "http://www.w3.org/2000/svg"
failures = []


def check(cond, what):
    print(("ok   " if cond else "FAIL ") + what)
    if not cond:
        failures.append(what)


def run(cmd, **kw):
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300, **kw)


def page_data(text):
    m = re.search(r"const CUMA = (\{.*?\});\n", text, re.S)
    return json.loads(m.group(1)) if m else None


def chromium(browser, profile, url, *extra):
    cmd = [browser, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
           "--user-data-dir=" + profile, "--virtual-time-budget=5000", *extra, url]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120)


def element(dom, ident):
    m = re.search(r'id="%s"[^>]*>(.*?)</(?:div|pre)>' % ident, dom, re.S)
    return html.unescape(re.sub(r"<[^>]+>", "\t", m.group(1))) if m else None


def self_contained(text):
    check(not re.search(r"\b(src|href)\s*=", text, re.I), "no src= or href= attribute")
    for bad in ("url(", "@import", "fetch(", "XMLHttpRequest", "<link", "<img", "<iframe",
                "import(", "sourceMappingURL"):
        check(bad.lower() not in text.lower(), "nothing like %r in the page" % bad)
    urls = set(re.findall(r"(?:https?:)?//[A-Za-z0-9.-]+\.[a-z]{2,}[^\s\"'<>)]*", text))
    check(urls <= {SVG_NS}, "no URL but the SVG namespace name (%s)" % sorted(urls))


def timeline_rows(cuma, trace, out):
    d = os.path.join(out, "timeline")
    r = run([cuma, "replay", "--json", "--timeline", d, trace])
    check(r.returncode == 0, "cuma replay --timeline runs (%s)" % r.stderr.strip())
    files = [f for f in os.listdir(d) if f.endswith(".timeline.csv")] if os.path.isdir(d) else []
    if len(files) != 1:
        return []
    lines = open(os.path.join(d, files[0])).read().split("\n")[1:]
    return [l.split(",") for l in lines if l]


def site_label(site):
    if site is None:
        return None
    if site["file"].endswith(".py"):
        return "%s:%d %s" % (site["file"], site["line"], site["name"])
    return site["name"].split("(")[0] + " (backward pass)"


def live_rows(dom):
    rows = []
    for tr in re.findall(r'<tr data-block="(\d+)"[^>]*>(.*?)</tr>', dom, re.S):
        cells = [html.unescape(c) for c in re.findall(r"<td>(.*?)</td>", tr[1], re.S)]
        rows.append((int(tr[0]), cells))
    return rows


def check_snapshot(cuma, browser, data, out, profile):
    trace = os.path.join(data, TRACE)
    report = os.path.join(out, "report.html")
    r = run([cuma, "plot", "--html", "-o", report, trace])
    check(r.returncode == 0, "cuma plot --html -o report.html %s exits 0 (%s)" % (TRACE, r.stderr.strip()))
    if r.returncode:
        return
    text = open(report, encoding="utf-8").read()
    self_contained(text)
    D = page_data(text)
    check(D is not None, "the page carries its data")
    if D is None:
        return
    S, B = D["series"], D["blocks"]
    rows = timeline_rows(cuma, trace, out)
    got = [["%.6f" % t, str(a), str(b), str(c)] for t, a, b, c in zip(S["t"], S["req"], S["res"], S["cached"])]
    check(len(rows) > 2 and got == [r[:4] for r in rows],
          "the series are cuma replay --timeline's %d rows (page: %d)" % (len(rows), len(got)))

    # The end of the recording: the page's live set against cuma leaks.
    leaks = run([cuma, "leaks", "--json", "--top", "1000", trace])
    L = json.loads(leaks.stdout.splitlines()[0])["live"]
    t_end = S["t"][-1]
    dom = chromium(browser, profile, "file://%s#hover=%r" % (report, t_end), "--dump-dom").stdout
    check(element(dom, "status") == "drawn", "the page says it drew")
    for cls in ("requested", "reserved", "cached"):
        m = re.search(r'<path class="series %s" d="([^"]*)"' % cls, dom)
        check(m is not None and m.group(1).count("L") >= len(S["t"]) - 1,
              "the %s series is a path of its steps" % cls)
    check(element(dom, "errors") == "", "no error reached window.onerror or console.error (%r)"
          % element(dom, "errors"))
    listed = live_rows(dom)
    check(len(listed) == L["allocs"], "%d live blocks listed at the end (cuma leaks: %d)"
          % (len(listed), L["allocs"]))
    sizes = [B["size"][i] for i, _ in listed]
    check(sizes == sorted(sizes, reverse=True), "largest first")
    by_site = {}
    check(all(cells[1] == "0x%x" % B["addr"][i] for i, cells in listed), "with their addresses")
    for i, cells in listed:
        by_site[cells[2]] = by_site.get(cells[2], 0) + B["size"][i]
    want = {site_label(g.get("site")): g["bytes"] for g in L["by_site"]}
    check(None not in want and by_site == want,
          "bytes by call site (%d sites) are cuma leaks'" % len(want))
    if by_site != want:
        print("  page: %s\n  leaks: %s" % (by_site, want))

    # A moment in the middle: the largest live block's whole stack.
    big = max(range(len(B["a"])), key=lambda i: (B["size"][i] if B["stack"][i] else -1))
    t_mid = (B["a"][big] + (B["f"][big] if B["f"][big] >= 0 else B["a"][big] + 1)) / 2e6
    dom = chromium(browser, profile, "file://%s#hover=%r" % (report, t_mid), "--dump-dom").stdout
    listed = live_rows(dom)
    check(listed and listed[0][0] == big, "at %.6f s the largest block (%d B) comes first"
          % (t_mid, B["size"][big]))
    stack = element(dom, "stack") or ""
    frames = D["stacks"][B["stack"][big]]
    check(len(frames) > 3 and all(("#%d %s:%d %s" % (k, *D["frames"][f])) in stack
                                  for k, f in enumerate(frames)),
          "its %d-frame stack is shown" % len(frames))
    site = D["frames"][D["site"][B["stack"][big]]]
    check(("call site: %s:%d %s" % tuple(site)) in stack, "with its call site %s:%d" % tuple(site[:2]))
    head = re.search(r'id="maphead" data-full="(\d+)" data-partial="(\d+)" data-idle="(\d+)"', dom)
    check(head is not None and int(head.group(1)) * 2 * 2**20 <= sum(
        B["size"][i] for i, _ in listed), "the page map counts pages under the live bytes")

    shot = os.path.join(out, "report.png")
    if os.path.exists(shot):
        os.remove(shot)
    chromium(browser, profile, "file://%s#hover=%r" % (report, t_mid), "--window-size=1200,800",
             "--screenshot=" + shot)
    ok = os.path.exists(shot) and open(shot, "rb").read(8) == b"\x89PNG\r\n\x1a\n"
    w, h = struct.unpack(">II", open(shot, "rb").read(24)[16:24]) if ok else (0, 0)
    check(ok and (w, h) == (1200, 800) and os.path.getsize(shot) > 20000,
          "a 1200x800 screenshot (%dx%d, %s)" % (w, h, shot))

    # The error catcher itself: a copy of the page that throws shows it.
    broken = os.path.join(out, "broken.html")
    open(broken, "w", encoding="utf-8").write(text.replace("</body>", "<script>undefinedThing();</script></body>"))
    dom = chromium(browser, profile, "file://" + broken, "--dump-dom").stdout
    check("undefinedThing" in (element(dom, "errors") or ""), "a thrown error shows in the errors element")


def check_csv(cuma, browser, out, profile):
    csv = os.path.join(out, "small.csv")
    with open(csv, "w") as f:
        f.write("Thread,Time,Action,Pointer,Size,Stream\n")
        f.write("0,00:00:00:000100,allocate,0x10000000,3145728,0\n")
        f.write("0,00:00:00:000200,allocate,0x10300000,4096,0\n")
        f.write("0,00:00:00:000300,allocate,0x10400000,1048576,0\n")
        f.write("0,00:00:00:000400,free,0x10300000,4096,0\n")
        f.write("0,00:00:00:000500,free,0x10000000,3145728,0\n")
    report = os.path.join(out, "small.html")
    r = run([cuma, "plot", "--html", "-o", report, csv])
    check(r.returncode == 0, "cuma plot --html on an RMM CSV exits 0 (%s)" % r.stderr.strip())
    if r.returncode:
        return
    dom = chromium(browser, profile, "file://%s#hover=0.00045" % report, "--dump-dom").stdout
    listed = live_rows(dom)
    check([c for _, c in listed] == [["3.0 MiB", "0x10000000", "(no stack recorded)"],
                                     ["1.0 MiB", "0x10400000", "(no stack recorded)"]],
          "the CSV trace's live blocks at 450 us: %s" % [c for _, c in listed])
    check(element(dom, "errors") == "", "no errors on the CSV page")


def check_bad_input(cuma, data, out):
    trace = os.path.join(data, TRACE)
    target = os.path.join(out, "bad.html")
    for args, what in ((["--html", "-o", target, trace, trace], "--html draws one trace"),
                       (["--html", "-o", target, "--compare", "x=y.csv", trace], "without --compare"),
                       (["--device", "0", trace], "--device goes with --html"),
                       (["--html", "--device", "x", "-o", target, trace], "--device wants a device number"),
                       (["--html", "-o", target, os.path.join(out, "missing.pickle")], "missing.pickle"),
                       (["--html", "-o", target], "no trace given")):
        r = run([cuma, "plot", *args])
        check(r.returncode == 2 and what in r.stderr and not os.path.exists(target),
              "cuma plot %s: exit 2, says %r, no file (%d: %s)"
              % (" ".join(args[1:3]), what, r.returncode, r.stderr.strip().splitlines()[:1]))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cuma", required=True)
    ap.add_argument("--data", required=True)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    if not browser:
        print("FAIL: no chromium to load the page in (Debian package chromium; scripts/deps.sh test)")
        return 1
    os.makedirs(a.out, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="cuma-chromium-") as profile:
        check_snapshot(a.cuma, browser, a.data, a.out, profile)
        check_csv(a.cuma, browser, a.out, profile)
    check_bad_input(a.cuma, a.data, a.out)
    print("%d failures" % len(failures))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
