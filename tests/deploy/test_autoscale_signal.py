# SPDX-License-Identifier: Apache-2.0
"""End-to-end check of the autoscaling signal of deploy/ (the HPA of deploy/sidecar on the
prometheus-adapter rules of deploy/adapter/config.yaml), with everything but Kubernetes real:

- two "pods": each a job holding a simulated heap in a named ledger (a pod's own /dev/shm),
  and `cuma exporter` on that ledger, on a free loopback port;
  pod infer-0: 400 MiB live, limit 512 MiB, guarantee 256 MiB, an allocation over its limit every 0.1 s
  (each counts in cuma_alloc_retries_total); pod infer-1: 300 MiB live, no guarantee, limit
  512 MiB, no retries;
- a third pod, infer-2, whose job says in its environment that it is infer-1 (POD_NAME, as
  any process that writes a ledger may): its figures must not reach infer-1's;
- Debian's prometheus on loopback scraping all three every second, each target given the
  namespace/pod labels the Prometheus Operator's ServiceMonitor gives the sidecar's series, and
  the ServiceMonitor's honorLabels (deploy/sidecar/servicemonitor.yaml) as honor_labels;
- the adapter's metricsQuery of each rule, with <<.LabelMatchers>> and <<.GroupBy>> filled in
  as prometheus-adapter does for a pods request, evaluated through Prometheus's HTTP API:
  the memory ratio must equal (reserved - cached) / (guarantee, or limit) from the ledger itself
  (`cuma stats --json`), the retry rate be positive for infer-0 and zero for infer-1;
- the HPA's replica formula (ceil(replicas * average / target), no change within the 10 %
  tolerance, the largest over the metrics, clamped to min/maxReplicas of hpa.yaml) applied to
  those values gives the count expected: 3, from the memory ratio. The retry rate is checked
  against the counter's samples; over the pods' first seconds rate() over [2m] reads low (it
  divides by the window), a Prometheus property that deploy/README.md mentions.
  The controller and the adapter themselves are not run: this checks the queries and the
  figures they see, not Kubernetes.

A heap's series carry the pod its process names in its environment; with honorLabels false they
become exported_pod, and the scrape's pod label (the pod the exporter runs in) is the one the
rules key on.

Every process started here is stopped at the end, the ledgers removed; bounded by TIMEOUT_S.
usage: python3 tests/deploy/test_autoscale_signal.py BUILD_DIR    (exit 0 = pass; 77 = skipped:
no prometheus binary)
"""

import json
import math
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.parse
import urllib.request

import yaml

TIMEOUT_S = 90
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MiB = 1 << 20

JOB = r"""
import sys, time, cuma
conf, live_mib, retry = sys.argv[1], int(sys.argv[2]), sys.argv[3] == "1"
h = cuma.Heap(conf, use_env=False)
blocks = [h.alloc(100 << 20) for _ in range(live_mib // 100)]
print("ready", flush=True)
while True:
    if retry:
        try:
            h.alloc(1 << 30)  # over the limit: fails, after the out-of-memory ladder
        except cuma.CumaError:
            pass
    time.sleep(0.1)
"""


def free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


class Test:
    def __init__(self, build):
        self.build = os.path.abspath(build)
        self.cuma = os.path.join(self.build, "bin", "cuma")
        self.procs = []
        self.ledgers = []
        self.tmp = tempfile.mkdtemp(prefix="cuma-autoscale-")
        self.deadline = time.monotonic() + TIMEOUT_S
        self.env = dict(os.environ, CUMA_LIBRARY=os.path.join(self.build, "lib", "libcuma.so"),
                        PYTHONPATH=os.path.join(ROOT, "python"))
        self.env.pop("CUMA_CONF", None)

    def left(self):
        r = self.deadline - time.monotonic()
        if r <= 0:
            raise AssertionError("timed out after %d s" % TIMEOUT_S)
        return r

    def start(self, args, **kw):
        kw.setdefault("env", self.env)
        p = subprocess.Popen(args, **kw)
        self.procs.append(p)
        return p

    def stop(self):
        for p in reversed(self.procs):
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in reversed(self.procs):
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        for name in self.ledgers:
            path = "/dev/shm/cuma-%d-%s" % (os.getuid(), name)
            if os.path.exists(path):
                os.unlink(path)
        shutil.rmtree(self.tmp, ignore_errors=True)

    def pod(self, name, conf, live_mib, retry, says=None):
        ledger = "autoscale-%d-%s" % (os.getpid(), name)
        self.ledgers.append(ledger)
        conf = "backend:sim,capacity:1G,ledger:%s,pressure_timeout_ms:0,%s" % (ledger, conf)
        env = dict(self.env, **(says or {}))
        job = self.start([sys.executable, "-c", JOB, conf, str(live_mib), "1" if retry else "0"],
                         stdout=subprocess.PIPE, universal_newlines=True, env=env)
        line = job.stdout.readline()
        assert line.strip() == "ready", "job %s did not start: %r" % (name, line)
        port = free_port()
        self.start([self.cuma, "exporter", "--ledger", ledger, "--bind", "127.0.0.1", "--port", str(port)],
                   stderr=subprocess.DEVNULL)
        return {"name": name, "ledger": ledger, "port": port}

    def query(self, prom, expr, at=None, raw=False):
        args = {"query": expr}
        if at is not None:
            args["time"] = "%.3f" % at
        url = "http://127.0.0.1:%d/api/v1/query?%s" % (prom, urllib.parse.urlencode(args))
        with urllib.request.urlopen(url, timeout=min(10, self.left())) as r:
            body = json.load(r)
        assert body["status"] == "success", body
        if raw:
            return body["data"]["result"]
        return {s["metric"].get("pod", ""): float(s["value"][1]) for s in body["data"]["result"]}

    def run(self):
        prom_bin = shutil.which("prometheus")
        if not prom_bin:
            print("SKIP: no prometheus binary (Debian package prometheus; scripts/deps.sh deploy)")
            return 77
        rules = yaml.safe_load(open(os.path.join(ROOT, "deploy/adapter/config.yaml")))["rules"]
        hpa = yaml.safe_load(open(os.path.join(ROOT, "deploy/sidecar/hpa.yaml")))
        namespace = yaml.safe_load(open(os.path.join(ROOT, "deploy/sidecar/kustomization.yaml")))["namespace"]
        monitor = yaml.safe_load(open(os.path.join(ROOT, "deploy/sidecar/servicemonitor.yaml")))
        honor = bool(monitor["spec"]["endpoints"][0].get("honorLabels", False))

        pods = [
            self.pod("infer-0", "limit:512M,guarantee:256M", 400, True),
            self.pod("infer-1", "limit:512M", 300, False),
        ]
        # Another job (here of another pod) that names infer-1 as its pod.
        spoof = self.pod("infer-2", "limit:512M", 500, False,
                         says={"POD_NAME": "infer-1", "POD_NAMESPACE": namespace})
        prom = free_port()
        cfg = {
            "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
            "scrape_configs": [{
                "job_name": "cuma",
                "honor_labels": honor,
                "static_configs": [{"targets": ["127.0.0.1:%d" % p["port"]],
                                    "labels": {"namespace": namespace, "pod": p["name"]}}
                                   for p in pods + [spoof]],
            }],
        }
        cfg_path = os.path.join(self.tmp, "prometheus.yml")
        with open(cfg_path, "w") as f:
            yaml.safe_dump(cfg, f)
        self.start([prom_bin, "--config.file=" + cfg_path, "--storage.tsdb.path=" + os.path.join(self.tmp, "data"),
                    "--web.listen-address=127.0.0.1:%d" % prom, "--log.level=warn"],
                   stdout=subprocess.DEVNULL, stderr=open(os.path.join(self.tmp, "prometheus.log"), "w"))

        # Filled in as prometheus-adapter does for GET .../namespaces/NS/pods/*/METRIC.
        names = [p["name"] for p in pods]
        matchers = 'namespace="%s",pod=~"%s"' % (namespace, "|".join(names))
        queries = {}
        for r in rules:
            q = r["metricsQuery"].replace("<<.LabelMatchers>>", matchers).replace("<<.GroupBy>>", "pod")
            queries[r["name"]["as"]] = q

        # Wait until both targets are scraped and the retry counter has samples enough for rate().
        while True:
            try:
                up = self.query(prom, 'up{job="cuma"}')
                n = self.query(prom, 'count_over_time(cuma_alloc_retries_total{pod="infer-0"}[2m])')
                if len(up) == 3 and all(v == 1 for v in up.values()) and n.get("infer-0", 0) >= 4:
                    break
            except OSError:
                pass
            if self.left() < 30:
                log = open(os.path.join(self.tmp, "prometheus.log")).read()[-2000:]
                raise AssertionError("prometheus did not scrape the exporters in time; its log:\n" + log)
            time.sleep(0.5)

        at = time.time()  # one evaluation time for every query below
        values = {m: self.query(prom, q, at) for m, q in queries.items()}
        print("adapter queries (namespace %s):" % namespace)
        for m, q in queries.items():
            print("  %s = %s\n    %s" % (m, values[m], " ".join(q.split())))

        # The memory ratio from the ledger itself, for each pod.
        for p in pods:
            st = json.loads(subprocess.check_output([self.cuma, "stats", "--ledger", p["ledger"], "--json"], env=self.env))
            heap = st["devices"][0]["heaps"][0]
            den = heap["guarantee"] if heap["guarantee"] > 0 else heap["limit"]
            want = (heap["reserved"] - heap["cached"]) / den
            got = values["cuma_memory_in_use_ratio"][p["name"]]
            print("  %s: ledger says (%d - %d) / %d = %.6f, Prometheus %.6f" % (
                p["name"], heap["reserved"], heap["cached"], den, want, got))
            assert abs(got - want) < 1e-9, "%s: memory ratio %s, the ledger says %s" % (p["name"], got, want)
        assert abs(values["cuma_memory_in_use_ratio"]["infer-0"] - 400 / 256) < 1e-9
        # infer-2's word is kept, apart: its series are infer-2's, with exported_pod infer-1.
        said = self.query(prom, 'cuma_reserved_bytes{exported_pod="infer-1"}', at, raw=True)
        print("  infer-2, which says it is infer-1: %s" % [r["metric"].get("pod") for r in said])
        assert [r["metric"].get("pod") for r in said] == ["infer-2"], said
        assert abs(values["cuma_memory_in_use_ratio"]["infer-1"] - 300 / 512) < 1e-9
        # The retry rate: rate() over [2m] of the counter's samples in that window. The pods are
        # seconds old, so the window is mostly empty and rate() (which divides by the window)
        # reads low: increase(samples) / 120 s at least, little more at most. The samples
        # themselves must show infer-0's ~10 retries a second (5 at least, for a loaded machine).
        retries = values["cuma_alloc_retries_per_second"]
        assert retries["infer-1"] == 0, retries
        raw = self.query(prom, 'cuma_alloc_retries_total{pod="infer-0"}[2m]', at, raw=True)[0]["values"]
        (t0, c0), (t1, c1) = (raw[0][0], float(raw[0][1])), (raw[-1][0], float(raw[-1][1]))
        print("  infer-0 retries: %d samples, %g -> %g in %.1f s; rate over [2m] %.4f/s" % (
            len(raw), c0, c1, t1 - t0, retries["infer-0"]))
        assert (c1 - c0) / (t1 - t0) >= 5, raw
        # Prometheus extrapolates at most 1.1 average sample intervals past each end.
        span = t1 - t0
        most = (c1 - c0) * (span + 2 * 1.1 * span / (len(raw) - 1)) / span / 120
        assert (c1 - c0) / 120 - 1e-9 <= retries["infer-0"] <= most + 1e-9, (retries, raw)

        # The HPA's replica formula (the controller is not run).
        spec = hpa["spec"]
        current = len(pods)
        desired = {}
        for m in spec["metrics"]:
            name = m["pods"]["metric"]["name"]
            target = parse_quantity(m["pods"]["target"]["averageValue"])
            avg = sum(values[name].values()) / len(values[name])
            ratio = avg / target
            desired[name] = current if abs(ratio - 1) <= 0.1 else math.ceil(current * ratio)
            print("  HPA %s: average %.4f / target %s -> %d replicas" % (name, avg, target, desired[name]))
        final = min(spec["maxReplicas"], max(spec.get("minReplicas", 1), max(desired.values())))
        print("  HPA: %d replicas now -> %d" % (current, final))
        # (400/256 + 300/512) / 2 = 1.0742; / 0.8 = 1.343 -> ceil(2 * 1.343) = 3.
        assert desired["cuma_memory_in_use_ratio"] == 3, desired
        # Retries: at most ~10/s over the pods' few seconds, / 120 s / 2 pods, far below the
        # target of 0.5: the memory ratio decides (a sustained 10/s would read 5/s per 2 minutes
        # and scale to maxReplicas).
        assert desired["cuma_alloc_retries_per_second"] <= 3, desired
        assert final == 3, final
        print("PASS")
        return 0


def parse_quantity(q):
    q = str(q)
    return float(q[:-1]) / 1000 if q.endswith("m") else float(q)


def main():
    if len(sys.argv) != 2:
        print(__doc__.strip().splitlines()[-2])
        return 2
    t = Test(sys.argv[1])
    try:
        return t.run()
    finally:
        t.stop()


if __name__ == "__main__":
    sys.exit(main())
