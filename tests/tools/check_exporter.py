#!/usr/bin/python3
# SPDX-License-Identifier: Apache-2.0
"""Checks that `cuma exporter` keeps answering scrapes when clients misbehave and when the
ledger cannot be read.

usage: check_exporter.py --cuma BIN --fixture BIN [--probe-limit S]
                         [--only slow|stuck|reader|pipelined|paced|held]

1. Slow clients: 200 clients on loopback hold connections to the exporter, half of them idle,
   half sending a request head a byte every 0.25 s that never ends; each reconnects 0.1 s after
   the server drops it. Meanwhile probe scrapes must each be answered, with every figure of the
   fixture's heaps (ledger_fixture raw). Then the same with --connections 64: the slots run out
   and each probe gets in by pushing out the client that has been sending its head the longest.
2. A stuck ledger: a fixture process (ledger_fixture hold) takes the ledger's lock and stops
   itself (SIGSTOP) holding it. The first read then waits 2 s for the lock before it reads
   without it: the scrapes meanwhile are answered from the last good read, marked stale
   (cuma_ledger_up 0, cuma_ledger_stale 1, every figure as before). Then, one after another
   and several at once, they are fresh and say they were read without the lock
   (cuma_ledger_up 1, cuma_ledger_unlocked 1, cuma_ledger_lock_stuck_seconds >= 2 and
   growing); a request for another path meanwhile is answered too. `cuma ps` (text and
   --json), `cuma stats` and `cuma top` print a warning line ("unlocked": true). Once the holder
   is killed the figures are fresh and read under the lock again, without its slot.
3. A slow reader: an answer larger than the sockets' buffers, taken slowly, arrives whole, and
   a probe meanwhile is answered.
4. A client that sends a second request while its answer is being written (or more bytes of
   any kind) still gets all of the answer: the server reads what else comes and drops it, so
   that closing does not reset the connection and throw away what the kernel still holds.
5. A client that scrapes back to back does not make the exporter read the ledger (and take its
   lock, which the heaps' admissions wait for) more than once in 100 ms: after 30 scrapes one
   after another, cuma_exporter_reads_total is at most the time they took over 100 ms, plus 2.
6. Clients that ask and never read, each after the previous one's read, hold a read's figures
   each: the server keeps what they hold within its budget (8 MiB for answers of this size) by
   cutting off the oldest, while the newest one still gets its whole answer.

Why a probe must be answered within 5 s (--probe-limit), and why that is no speed test: the
server it replaces had 32 connection slots and closed a connection only after 10 s. The 200
clients connect before the first probe, so there they hold all 32 slots and no probe can be
accepted, let alone answered, until 10 s after they connected: it fails whatever the machine's
speed (a slower machine only delays the probe further). The new server answers in
milliseconds; 5 s is a bound a loaded machine meets with a wide margin, and half the old one's
floor. The probes' latencies are printed (median, max), not judged beyond that bound.

Every process and thread this starts is stopped at the end; the shared-memory files it made
are removed. Standard library only.
"""
import argparse
import contextlib
import json
import os
import re
import selectors
import socket
import statistics
import sys
import threading
import time

from check_tools import check_metrics, parse_exposition, start_exporter, stop_exporter
from ledger_checks import check, failures, run, shm_path, start_fixture, stop_fixture

N_SLOW = 200
# Fewer slots than slow clients: every probe must take one from them. A new connection is not
# pushed out in its first 250 ms (EVICT_GRACE_MS), so a slot changes hands at most SMALL_SLOTS
# times in 250 ms and a probe may wait behind the reconnecting clients in the backlog for
# (N_SLOW - SMALL_SLOTS) / SMALL_SLOTS * 0.25 s (about 0.5 s), well within the bound.
SMALL_SLOTS = 64
# The slow-client and slow-reader checks are about the server, and want fresh figures: a scrape
# there waits for its read of the ledger up to just under the probe limit instead of the
# default 500 ms, which a read of 128 heaps can exceed on a loaded machine (seen under
# AddressSanitizer beside a CPU hog: cuma_ledger_up 0, then stale figures). The stuck-ledger
# check keeps the default: it wants the stale answer.
def fresh_wait(limit):
    return ["--fresh-wait", str(int(limit * 1000 * 0.8))]
TRICKLE_HEAD = b"GET /metrics HTTP/1.1\r\nHost: x\r\nX-Slow: "
REQUEST = b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n"


class SlowClients(threading.Thread):
    """n clients that hold connections open: even ones idle, odd ones sending TRICKLE_HEAD and
    then 'a' a byte every 0.25 s, never ending the head. A client the server drops (EOF,
    reset, refused) reconnects 0.1 s later. One thread, non-blocking sockets."""

    def __init__(self, port, n):
        threading.Thread.__init__(self, daemon=True)
        self.port, self.n = port, n
        self.halt = threading.Event()
        self.all_started = threading.Event()
        self.connects = self.drops = 0

    def open_one(self, i):
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        s.setblocking(False)
        s.connect_ex(("127.0.0.1", self.port))  # in progress; a failure shows as readable
        self.sel.register(s, selectors.EVENT_READ, i)
        self.socks[i], self.sent[i] = s, 0
        self.connects += 1

    def run(self):
        self.sel, self.socks, self.sent, reopen = selectors.DefaultSelector(), {}, {}, {}
        try:
            for i in range(self.n):
                self.open_one(i)
            self.all_started.set()
            next_trickle = time.monotonic()
            while not self.halt.is_set():
                now = time.monotonic()
                for i, t in list(reopen.items()):
                    if now >= t:
                        del reopen[i]
                        self.open_one(i)
                if now >= next_trickle:
                    next_trickle = now + 0.25
                    for i, s in self.socks.items():
                        if i % 2 == 0:
                            continue
                        k = self.sent[i]
                        byte = TRICKLE_HEAD[k:k + 1] or b"a"
                        try:
                            self.sent[i] += s.send(byte)
                        except OSError:
                            pass  # not connected yet, or gone: the selector says which
                for key, _ in self.sel.select(timeout=0.05):
                    s, i = key.fileobj, key.data
                    try:
                        if s.recv(4096):
                            continue  # an answer (never to these): its EOF follows
                    except BlockingIOError:
                        continue
                    except OSError:
                        pass
                    self.sel.unregister(s)
                    s.close()
                    del self.socks[i]
                    self.drops += 1
                    reopen[i] = now + 0.1
        finally:
            for s in self.socks.values():
                s.close()
            self.sel.close()
            self.all_started.set()

    def stop(self):
        self.halt.set()
        self.join(30)
        check(not self.is_alive(), "slow clients: their thread stopped")


def probe(port, limit, request=REQUEST):
    """One request (a scrape) that must be answered within limit seconds: (status, body,
    seconds), status None (and the error as body) when it was not."""
    t0 = time.monotonic()
    deadline = t0 + limit
    try:
        s = socket.create_connection(("127.0.0.1", port), timeout=limit)
    except OSError as e:
        return None, "connect: %s" % e, time.monotonic() - t0
    data = b""
    try:
        s.sendall(request)
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise socket.timeout("no full answer within %.1f s" % limit)
            s.settimeout(left)
            chunk = s.recv(65536)
            if not chunk:
                break
            data += chunk
    except OSError as e:
        return None, "%s (after %d bytes)" % (e, len(data)), time.monotonic() - t0
    finally:
        s.close()
    took = time.monotonic() - t0
    head, _, body = data.partition(b"\r\n\r\n")
    m = re.match(rb"HTTP/1\.1 (\d{3}) ", head)
    if not m:
        return None, "no status line in %r" % data[:100], took
    length = re.search(rb"\r\nContent-Length: (\d+)", head)
    if not length or int(length.group(1)) != len(body):
        return None, "Content-Length %r for %d bytes" % (length, len(body)), took
    return int(m.group(1)), body.decode("utf-8"), took


def report(what, times):
    if times:
        print("     %s: %d probes, median %.3f s, max %.3f s" %
              (what, len(times), statistics.median(times), max(times)))


def probes(port, made, what, limit, count=6, gap=0.5):
    """count probes gap seconds apart (they span the 2 s after which the server drops the
    trickling clients, so some come while those reconnect); each must be answered in full."""
    times = []
    for i in range(count):
        st, body, took = probe(port, limit)
        w = "%s, probe %d" % (what, i + 1)
        if check(st == 200, "%s: answered within %.0f s (%.3f s)" % (w, limit, took),
                 (st, body[:200] if st is None else "")):
            times.append(took)
            check_metrics(body, made, w)
        time.sleep(gap)
    report(what, times)
    return times


def check_slow_clients(cuma, fixture, name, limit):
    f, made = start_fixture(fixture, name, "raw")
    try:
        for conns in (None, SMALL_SLOTS):
            what = "%d slow clients%s" % (N_SLOW, ", --connections %d" % conns if conns else "")
            p, port = start_exporter(cuma, name, (["--connections", str(conns)] if conns else []) +
                                     fresh_wait(limit))
            slow = SlowClients(port, N_SLOW)
            slow.start()
            try:
                slow.all_started.wait(30)
                time.sleep(0.5)  # the clients are connected (or queued) before the first probe
                probes(port, made, what, limit)
                check(slow.drops > 0, "%s: the server dropped some (%d of %d connects)" %
                      (what, slow.drops, slow.connects), slow.drops)
            finally:
                slow.stop()
                stop_exporter(p, what)
    finally:
        stop_fixture(f)


def scrape_one(port, made, what, limit, **want):
    """A scrape that must be answered within limit seconds, with every figure of made and the
    head families as want says (check_metrics); its samples by family (None if unanswered)."""
    st, body, took = probe(port, limit)
    if not check(st == 200, "%s: answered within %.0f s (%.3f s)" % (what, limit, took),
                 body[:200] if st is None else ""):
        return None, took
    return check_metrics(body, made, what, **want), took


def sample(get, fam):
    vals = [v for _, v in (get or {}).get(fam, [])]
    return vals[0] if len(vals) == 1 else None


# The ledger's wait for a lock that does not change hands (LEDGER_STALL_MS), after which it
# reads without the lock.
STALL_S = 2.0


def check_stuck_views(cuma, name, made):
    """cuma ps, ps --json, stats and top while the lock's holder is stopped: each its own
    process, whose first read waits STALL_S and then reads without the lock, which each says in
    a warning line ("unlocked" in the JSON), with every heap as made."""
    warning = "warning: read without the ledger's lock, which a process holds and does not run"
    rc, out, err = run([cuma, "ps", "--ledger", name])
    check(rc == 0 and out.startswith(warning) and
          ("ledger %s: %d heaps" % (shm_path(name), len(made))) in out,
          "stuck ledger: cuma ps warns that it read without the lock, and shows the heaps",
          (rc, out[:400], err))
    rc, out, err = run([cuma, "ps", "--ledger", name, "--json"])
    try:
        doc = json.loads(out) if rc == 0 else {}
    except ValueError as e:
        doc = {"error": str(e)}
    check(rc == 0 and doc.get("unlocked") is True and doc.get("heaps") == len(made) and
          doc.get("lock_stuck_ns", 0) >= STALL_S * 1e9,
          "stuck ledger: cuma ps --json says \"unlocked\": true, lock_stuck_ns >= %.0f s" %
          STALL_S, (rc, {k: doc.get(k) for k in ("unlocked", "lock_stuck_ns", "heaps")}, err))
    rc, out, err = run([cuma, "stats", "--ledger", name])
    check(rc == 0 and out.startswith(warning), "stuck ledger: cuma stats warns too",
          (rc, out[:400], err))
    # Two refreshes: the second one's read does not wait (the stuck lock is remembered), and is
    # as unlocked as the first.
    rc, out, err = run([cuma, "top", "--ledger", name, "-n", "2", "-d", "0.1"])
    frames = out.split("cuma top - ")[1:]
    check(rc == 0 and len(frames) == 2 and all(warning in f for f in frames),
          "stuck ledger: each cuma top refresh warns", (rc, out[:400], err))


def check_stuck_ledger(cuma, fixture, name, limit):
    """A holder stopped with the ledger's lock. The first read after it stopped waits STALL_S
    for the lock, so the scrapes meanwhile are answered from the read before, stale (up 0,
    stale 1, read under the lock: unlocked 0, no read failed); then the ledger reads without the
    lock, at once from then on: fresh figures (the holder's slot too: it lives), up 1,
    unlocked 1, the lock's stuck time at least STALL_S and growing. Once the holder is killed:
    fresh, under the lock again, its slot gone."""
    sim, made_sim = start_fixture(fixture, name, "sim")
    holder, made_hold = None, []
    p = None
    try:
        holder, made_hold = start_fixture(fixture, name, "hold")
        made = made_sim + made_hold
        p, port = start_exporter(cuma, name)
        get, _ = scrape_one(port, made, "stuck ledger, before", limit)
        holder.stdin.write(b"hold\n")
        holder.stdin.flush()
        check(holder.lines.line(30) == "held\n", "stuck ledger: the fixture holds the lock")
        _, status = os.waitpid(holder.pid, os.WUNTRACED)
        check(os.WIFSTOPPED(status), "stuck ledger: the holder is stopped", status)

        # While the first read waits: stale. Each scrape waits 0.5 s at most, the read STALL_S:
        # the first scrape is stale whatever the machine's speed, and a fresh one comes within
        # 5 * STALL_S of scrapes (a bound, not a timing). A scrape whose read is still due when
        # the first one ends is served that one, stale and unlocked: after the others.
        t0 = time.monotonic()
        stale, first_fresh, n = [], None, 0
        while first_fresh is None and time.monotonic() - t0 < 5 * STALL_S:
            n += 1
            st, body, took = probe(port, limit)
            w = "stuck ledger, scrape %d" % n
            if not check(st == 200, "%s: answered within %.0f s (%.3f s)" % (w, limit, took),
                         body[:200] if st is None else ""):
                break
            parsed = parse_exposition(body, w)
            if parsed.get(("cuma_ledger_up", frozenset())) == 1.0:
                first_fresh = (w, body)
                break
            u = 1 if parsed.get(("cuma_ledger_unlocked", frozenset())) == 1.0 else 0
            get = check_metrics(body, made, w + " (the first read waits: stale)", up=0,
                                stale=1, unlocked=u)
            stale.append((u, sample(get, "cuma_ledger_snapshot_age_seconds")))
        check(len(stale) >= 1 and stale[0][0] == 0 and
              [u for u, _ in stale] == sorted(u for u, _ in stale),
              "stuck ledger: the first scrape(s) stale, from the read under the lock, while the "
              "read waits (%d)" % len(stale), stale)
        # Those figures are of the read before the lock was taken: they age.
        ages = [a for u, a in stale if u == 0]
        check(all(a is not None for a in ages) and all(a < b for a, b in zip(ages, ages[1:])),
              "stuck ledger: the stale figures' age grows", ages)
        stuck = []
        if check(first_fresh is not None, "stuck ledger: a fresh scrape within %.0f s" %
                 (5 * STALL_S), n):
            get = check_metrics(first_fresh[1], made, first_fresh[0] + " (unlocked)",
                                unlocked=1)
            stuck.append(sample(get, "cuma_ledger_lock_stuck_seconds"))
        # The next reads do not wait: fresh and unlocked, one after another and several at once.
        times = []
        for i in range(3):
            time.sleep(0.05)
            get, took = scrape_one(port, made, "stuck ledger, unlocked scrape %d" % (i + 1),
                                   limit, unlocked=1)
            if get:
                times.append(took)
                stuck.append(sample(get, "cuma_ledger_lock_stuck_seconds"))
        check(len(stuck) == 4 and all(s is not None for s in stuck) and stuck[0] >= STALL_S and
              all(a < b for a, b in zip(stuck, stuck[1:])),
              "stuck ledger: the lock's stuck time is at least %.0f s and grows" % STALL_S, stuck)

        # Several at once, and a request that needs no read: all answered. The threads only
        # ask; the answers are checked here, in order.
        results = {}

        def one(k):
            results[k] = probe(port, limit, b"GET /other HTTP/1.1\r\n\r\n" if k == "other"
                               else REQUEST)

        threads = [threading.Thread(target=one, args=(k,)) for k in list(range(6)) + ["other"]]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        check(not any(t.is_alive() for t in threads), "stuck ledger: the scrapes' threads ended")
        st, body, took = results.get("other", (None, "no answer", 0))
        check(st == 404, "stuck ledger: GET /other meanwhile is 404 (%.3f s)" % took, body[:200])
        for k in range(6):
            st, body, took = results.get(k, (None, "no answer", 0))
            w = "stuck ledger, together %d" % (k + 1)
            if check(st == 200, "%s: answered within %.0f s (%.3f s)" % (w, limit, took),
                     body[:200] if st is None else ""):
                times.append(took)
                check_metrics(body, made, w, unlocked=1)
        report("stuck ledger, unlocked", times)

        check_stuck_views(cuma, name, made)

        holder.kill()
        holder.wait()
        holder = None
        # Fresh, under the lock (its holder is gone), and the dead holder's slot reclaimed; no
        # read ever failed.
        scrape_one(port, made_sim, "stuck ledger, holder killed", limit)
        stop_exporter(p, "stuck ledger")
        p = None
    finally:
        for f in (holder, p):
            if f is not None:
                f.kill()
                f.wait()
        stop_fixture(sim)


class Served:
    """An exporter on a fixture's heaps (served's): its port, the figures the fixture made, and
    stop(), which ends it with SIGTERM and wants status 0."""

    def __init__(self, p, port, made):
        self.p, self.port, self.made = p, port, made

    def stop(self, what):
        stop_exporter(self.p, what)
        self.p = None


@contextlib.contextmanager
def served(cuma, fixture, name, mode, limit):
    """ledger_fixture's `mode` heaps in ledger `name` and an exporter on them whose scrapes wait
    for fresh figures (fresh_wait); an exporter the check did not stop is killed at the end."""
    f, made = start_fixture(fixture, name, mode)
    srv = None
    try:
        p, port = start_exporter(cuma, name, fresh_wait(limit))
        srv = Served(p, port, made)
        yield srv
    finally:
        if srv is not None and srv.p is not None:
            srv.p.kill()
            srv.p.wait()
        stop_fixture(f)


def small_client(port, limit):
    """A client with a 4 KiB receive buffer that has sent a scrape's request."""
    c = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    c.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    c.settimeout(limit)
    c.connect(("127.0.0.1", port))
    c.sendall(REQUEST)
    return c


def take_slowly(s, what, made):
    """Takes a scrape's answer from s 1 KiB at a time, then checks that all of it came (its
    Content-Length) and holds the fixture's figures."""
    data = b""
    try:
        while True:
            chunk = s.recv(1024)
            if not chunk:
                break
            data += chunk
            time.sleep(0.0005)
    except OSError as e:
        check(False, "%s: takes its answer" % what, "%s after %d bytes" % (e, len(data)))
    s.close()
    head, _, body = data.partition(b"\r\n\r\n")
    length = re.search(rb"\r\nContent-Length: (\d+)", head)
    if check(head.startswith(b"HTTP/1.1 200 ") and length is not None and
             int(length.group(1)) == len(body),
             "%s: all of the answer" % what, (head[:200], len(body))):
        check_metrics(body.decode("utf-8"), made, what)


def check_slow_reader(cuma, fixture, name, limit):
    """An answer larger than the sockets' buffers (ledger_fixture many), to a client with a
    small receive buffer that first takes none of it and then takes it slowly: the server
    writes it in parts as the client reads, answers a probe meanwhile, and the client gets all
    of it. (The server before this one wrote in parts too: this guards the new write path.)"""
    with served(cuma, fixture, name, "many", limit) as srv:
        slow = small_client(srv.port, limit)
        time.sleep(0.5)  # the server has written what the buffers take, and waits
        st, body, took = probe(srv.port, limit)
        if check(st == 200, "slow reader: a probe meanwhile is answered (%.3f s)" % took,
                 body[:200] if st is None else ""):
            check(len(body) > 65536, "slow reader: the answer is larger than 64 KiB", len(body))
            check_metrics(body, srv.made, "slow reader, the probe")
        take_slowly(slow, "slow reader", srv.made)
        srv.stop("slow reader")


def check_pipelined(cuma, fixture, name, limit):
    """A client with a small receive buffer asks, asks again 0.3 s later (a pipelined request,
    which the server does not answer) and only then takes the answer, slowly. The server had
    closed the socket with the second request unread, so the kernel sent a reset and dropped the
    last part of the answer it still held; now the whole answer arrives."""
    with served(cuma, fixture, name, "many", limit) as srv:
        c = small_client(srv.port, limit)
        time.sleep(0.3)
        c.sendall(REQUEST)
        time.sleep(0.5)
        take_slowly(c, "pipelined", srv.made)
        srv.stop("pipelined")


# exporter.h's EXP_READ_INTERVAL_MS, in seconds.
READ_INTERVAL_S = 0.1


def check_paced(cuma, fixture, name, limit):
    """30 scrapes one after another, each answered fresh; the reads they cost are at most one
    per READ_INTERVAL_S of the time they took, and two more (the first, and one begun as the
    clock is read). Unpaced, every scrape was a read of its own: 30 in a fraction of a second.
    A slower machine only allows more reads, never fewer: no speed is asserted."""
    with served(cuma, fixture, name, "raw", limit) as srv:
        t0 = time.monotonic()
        body = ""
        for i in range(30):
            st, body, _ = probe(srv.port, limit)
            if not check(st == 200, "paced: scrape %d is answered" % (i + 1),
                         body[:200] if st is None else ""):
                return
        took = time.monotonic() - t0
        s = parse_exposition(body, "paced: the last scrape")
        reads = s.get(("cuma_exporter_reads_total", frozenset()))
        up = s.get(("cuma_ledger_up", frozenset()))
        print("  30 scrapes in %.3f s: %s reads" % (took, reads))
        check(up == 1.0, "paced: the last scrape is fresh", up)
        check(reads is not None and reads <= took / READ_INTERVAL_S + 2,
              "paced: at most a read per 100 ms (%s reads in %.3f s)" % (reads, took), reads)
        srv.stop("paced")


# exporter_server.c's PINNED_MAX: the figures answers being written may hold, when four of the
# largest answer fit in it.
PINNED_MAX = 8 << 20


def read_answer(s, limit):
    """Everything s gets until the server closes it: (Content-Length or None, body bytes)."""
    s.settimeout(limit)
    data = b""
    try:
        while True:
            chunk = s.recv(65536)
            if not chunk:
                break
            data += chunk
    except OSError:
        pass  # a reset: what came before it is what arrived
    head, _, body = data.partition(b"\r\n\r\n")
    length = re.search(rb"\r\nContent-Length: (\d+)", head)
    return (int(length.group(1)) if length else None), body


def check_held(cuma, fixture, name, limit):
    """Clients that each ask for the figures and take none of them, each one after the read the
    previous client's answer came from (a probe between them waits for a later read), so that
    every one holds another read's figures. Before the budget they were all held until each
    write timed out (10 s): 28 MB for 100 such clients of this fixture's answer, in an exporter
    that Kubernetes runs with 64 MiB. Now the oldest are cut off once they hold more than
    PINNED_MAX, and the newest still gets all of its answer."""
    holders = []
    try:
        with served(cuma, fixture, name, "many", limit) as srv:
            st, body, _ = probe(srv.port, limit)
            if not check(st == 200, "held: a first probe is answered", body[:200] if st is None else ""):
                return
            n = PINNED_MAX // len(body) + 8  # more than the budget holds
            for i in range(n):
                holders.append(small_client(srv.port, limit))
                st, body, _ = probe(srv.port, limit)  # answered after its read: it is being written to
                if not check(st == 200, "held: the probe after client %d is answered" % (i + 1),
                             body[:200] if st is None else ""):
                    return
            print("  %d clients hold an answer of %d bytes each, from %d reads" % (n, len(body), n))
            length, got = read_answer(holders[0], limit)
            check(length is not None and len(got) < length,
                  "held: the oldest client's answer was cut off (%s of %s bytes)" % (len(got), length))
            length, got = read_answer(holders[-1], limit)
            check(length is not None and len(got) == length,
                  "held: the newest client's answer arrived whole (%s of %s bytes)" % (len(got), length))
            srv.stop("held")
    finally:
        for h in holders:
            h.close()


# The checks in the order they run, by the name --only takes.
CHECKS = [("slow", check_slow_clients), ("stuck", check_stuck_ledger), ("reader", check_slow_reader),
          ("pipelined", check_pipelined), ("paced", check_paced), ("held", check_held)]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cuma", required=True)
    ap.add_argument("--fixture", required=True)
    ap.add_argument("--probe-limit", type=float, default=5.0,
                    help="seconds a probe may take (see above; more, to measure an old build)")
    ap.add_argument("--only", choices=[k for k, _ in CHECKS], help="run one of the checks")
    a = ap.parse_args()
    base = "exporter-test-%d" % os.getpid()
    names = {k: "%s-%s" % (base, k) for k, _ in CHECKS}  # each check's own ledger
    for n in names.values():
        if os.path.exists(shm_path(n)):
            os.remove(shm_path(n))
    try:
        for k, run_check in CHECKS:
            if a.only in (None, k):
                run_check(a.cuma, a.fixture, names[k], a.probe_limit)
    finally:
        for n in names.values():
            if os.path.exists(shm_path(n)):
                os.remove(shm_path(n))
    if failures:
        print("\n%d check(s) failed: %s" % (len(failures), ", ".join(failures)))
        return 1
    print("\nall checks passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
