# SPDX-License-Identifier: Apache-2.0
"""What the checks of the `cuma` command's ledger views share (check_tools.py, check_stats.py):
the check function and its list of failures, running commands, the fixture's processes, and the
figures a heap has in every view. Standard library only."""
import atexit
import json
import os
import select
import shutil
import subprocess
import tempfile
import time

MB = 1024 * 1024
STEP_ALLOCS = 200  # ledger_fixture.c's
RAW_DEVICE = "GPU-cuma-fixture-0001"
failures = []

# The NVIDIA driver's /proc/driver/nvidia/gpus as the exporter reads it (CUMA_NVIDIA_PROC): the
# fixture's raw device is minor 3 at the second bus location, so DCGM would call it gpu="1",
# device="nvidia3"; the other GPU has no heap, and a file without a UUID is left out.
RAW_GPU_LABELS = {"gpu": "1", "device": "nvidia3"}
NVIDIA_PROC = tempfile.mkdtemp(prefix="cuma-nvidia-proc-")
atexit.register(shutil.rmtree, NVIDIA_PROC, True)
for bus, uuid, minor in (("0000:41:00.0", RAW_DEVICE, 3), ("0000:18:00.0", "GPU-other-0000", 0),
                         ("0000:c1:00.0", None, 7)):
    os.makedirs(os.path.join(NVIDIA_PROC, bus))
    with open(os.path.join(NVIDIA_PROC, bus, "information"), "w") as f:
        f.write("Model: \t\t NVIDIA H200\nIRQ:   \t\t 123\n")
        if uuid:
            f.write("GPU UUID: \t %s\n" % uuid)
        f.write("Bus Type: \t PCIe\nBus Location: \t %s\nDevice Minor: \t %d\n" % (bus, minor))


def check(cond, what, detail=""):
    print("%-4s %s%s" % ("ok" if cond else "FAIL", what, "" if cond else ": " + str(detail)))
    if not cond:
        failures.append(what)
    return cond


# What every process the checks start is told of its pod (the downward API's variables, which
# the machine running the tests may set to its own values): each heap's series carry them.
POD = {"POD_NAME": "trainer-7f9c4", "POD_NAMESPACE": "ml-jobs", "CONTAINER_NAME": "train"}


def env():
    e = dict(os.environ)
    e.pop("CUMA_CONF", None)  # the user's settings must not change the test
    e.update(POD)
    e["CUMA_NVIDIA_PROC"] = NVIDIA_PROC
    return e


def run(args, timeout=60):
    p = subprocess.run(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                       universal_newlines=True, env=env(), timeout=timeout)
    return p.returncode, p.stdout, p.stderr


def shm_path(name):
    return "/dev/shm/cuma-%d-%s" % (os.geteuid(), name)


# ---- the fixtures ---------------------------------------------------------------------------

class Lines:
    """Lines from a pipe with a timeout. Reads the descriptor itself: a buffered file object
    may hold lines that select() cannot see."""

    def __init__(self, f):
        self.fd, self.buf = f.fileno(), b""

    def line(self, timeout):
        """The next line (text), or None at EOF or after timeout seconds."""
        deadline = time.monotonic() + timeout
        while b"\n" not in self.buf:
            r, _, _ = select.select([self.fd], [], [], max(deadline - time.monotonic(), 0))
            if not r:
                return None
            chunk = os.read(self.fd, 65536)
            if not chunk:
                return None
            self.buf += chunk
        line, _, self.buf = self.buf.partition(b"\n")
        return line.decode("utf-8") + "\n"


def start_fixture(binary, name, mode):
    p = subprocess.Popen([binary, name, mode], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                         env=env())
    p.lines = Lines(p.stdout)
    heaps = []
    while True:
        line = p.lines.line(30)
        if line is None:
            p.kill()
            raise SystemExit("FAIL ledger_fixture %s %s: no 'ready' (exit %s)" %
                             (name, mode, p.poll()))
        if line.strip() == "ready":
            return p, heaps
        heaps.append(json.loads(line))


def stop_fixture(p):
    p.stdin.close()
    try:
        return p.wait(timeout=30)
    except subprocess.TimeoutExpired:
        p.kill()
        p.wait()
        return None


FIELDS = ["pid", "process", "priority", "guarantee", "limit", "reserved", "cached", "requested",
          "peak_reserved", "want", "ledger_denials", "pressure_asks", "pressure_given_bytes",
          "pressure_callbacks"]
# The allocator figures of `cuma stats --json` (and of the fixture's "stats"), as integers.
STAT_FIELDS = ["page_size", "allocated_bytes", "peak_requested_bytes", "mapped_bytes",
               "managed_bytes", "active_allocs", "num_allocs", "num_frees", "failed_allocs",
               "alloc_retries", "ooms", "oom_callbacks", "managed_fallbacks", "page_creates",
               "page_releases", "maps", "unmaps", "trims", "page_call_ns", "arenas", "compactions",
               "compact_moved_bytes", "compact_freed_pages"]


def ledger_fragmentation(stats):
    """A heap's fragmentation as the ledger keeps it: in parts per million."""
    return int(stats["fragmentation"] * 1e6 + 0.5) / 1e6


def key(h):
    return (h["pid"], h["device"], h["priority"])


def device_totals(heaps):
    out = {}
    for h in heaps:
        d = out.setdefault(h["device"], dict(capacity=64 * MB, reserved=0, cached=0,
                                             guaranteed=0, claimed=0, heaps=0))
        d["reserved"] += h["reserved"]
        d["cached"] += min(h["cached"], h["reserved"])
        d["guaranteed"] += h["guarantee"]
        d["claimed"] += max(h["reserved"], h["guarantee"])
        d["heaps"] += 1
    for d in out.values():
        d["free"] = max(d["capacity"] - d["claimed"], 0)
    return out
