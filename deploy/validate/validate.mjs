// SPDX-License-Identifier: Apache-2.0
// Validates rendered manifests (kubectl kustomize output, multi-document YAML) offline:
// 1. each object against the Kubernetes API schema of its apiVersion/kind (kubernetes-models,
//    generated from the Kubernetes OpenAPI spec; ServiceMonitor from the Prometheus Operator's
//    CRD): types, required fields, enums, formats. Unknown fields are not caught: the
//    generated schemas allow extra properties, as the API's OpenAPI spec does.
// 2. the Pod Security Standard "baseline" for pod templates in a namespace that enforces it
//    (the rules that concern a manifest: host namespaces, hostPath volumes, privileged
//    containers, added capabilities beyond the baseline's list, host ports, unsafe sysctls,
//    /proc mount, seccomp Unconfined).
// usage: node validate.mjs FILE.yaml...     Exits 1 on any failure.
import fs from "node:fs";
import yaml from "js-yaml";

const baselineCaps = new Set(["AUDIT_WRITE", "CHOWN", "DAC_OVERRIDE", "FOWNER", "FSETID", "KILL", "MKNOD",
  "NET_BIND_SERVICE", "SETFCAP", "SETGID", "SETPCAP", "SETUID", "SYS_CHROOT"]);
const safeSysctls = new Set(["kernel.shm_rmid_forced", "net.ipv4.ip_local_port_range", "net.ipv4.ip_unprivileged_port_start",
  "net.ipv4.tcp_syncookies", "net.ipv4.ping_group_range", "net.ipv4.ip_local_reserved_ports", "net.ipv4.tcp_keepalive_time",
  "net.ipv4.tcp_fin_timeout", "net.ipv4.tcp_keepalive_intvl", "net.ipv4.tcp_keepalive_probes"]);

async function modelFor(apiVersion, kind) {
  const [group, version] = apiVersion.includes("/") ? apiVersion.split("/") : [null, apiVersion];
  const mod = group === "monitoring.coreos.com"
    ? `@kubernetes-models/prometheus-operator/${group}/${version}/${kind}`
    : group ? `kubernetes-models/${group}/${version}/${kind}` : `kubernetes-models/${version}/${kind}`;
  try {
    return (await import(mod))[kind];
  } catch (e) {
    return null;
  }
}

function podSpecOf(obj) {
  if (obj.kind === "Pod") return obj.spec;
  const t = obj.spec && (obj.spec.template || (obj.spec.jobTemplate && obj.spec.jobTemplate.spec.template));
  return t && t.spec;
}

function baselineViolations(spec) {
  const v = [];
  for (const f of ["hostPID", "hostIPC", "hostNetwork"]) if (spec[f]) v.push(`${f}: true`);
  for (const vol of spec.volumes || []) if (vol.hostPath) v.push(`volume ${vol.name}: hostPath`);
  for (const s of (spec.securityContext && spec.securityContext.sysctls) || [])
    if (!safeSysctls.has(s.name)) v.push(`sysctl ${s.name}`);
  const seccomp = (sc) => sc && sc.seccompProfile && sc.seccompProfile.type === "Unconfined";
  if (seccomp(spec.securityContext)) v.push("seccompProfile Unconfined");
  for (const c of [...(spec.initContainers || []), ...(spec.containers || []), ...(spec.ephemeralContainers || [])]) {
    const sc = c.securityContext || {};
    if (sc.privileged) v.push(`container ${c.name}: privileged`);
    for (const cap of (sc.capabilities && sc.capabilities.add) || [])
      if (!baselineCaps.has(cap)) v.push(`container ${c.name}: adds capability ${cap}`);
    for (const p of c.ports || []) if (p.hostPort) v.push(`container ${c.name}: hostPort ${p.hostPort}`);
    if (sc.procMount && sc.procMount !== "Default") v.push(`container ${c.name}: procMount ${sc.procMount}`);
    if (seccomp(sc)) v.push(`container ${c.name}: seccompProfile Unconfined`);
  }
  return v;
}

// A pod running `cuma exporter` beside the job (no host PID namespace) needs the job's ledger
// and pids: a shared process namespace and one memory-backed emptyDir at /dev/shm in every
// container.
function exporterProblems(spec) {
  const cs = spec.containers || [];
  if (spec.hostPID || !cs.some((c) => (c.args || [])[0] === "exporter")) return [];
  const v = [];
  if (!spec.shareProcessNamespace) v.push("shareProcessNamespace is not true");
  const vols = Object.fromEntries((spec.volumes || []).map((x) => [x.name, x]));
  for (const c of cs) {
    const m = (c.volumeMounts || []).find((x) => x.mountPath === "/dev/shm");
    const vol = m && vols[m.name];
    if (!vol || !vol.emptyDir || vol.emptyDir.medium !== "Memory")
      v.push(`container ${c.name} has no memory-backed emptyDir at /dev/shm`);
  }
  return v;
}

// cuma's series carry the pod a heap's process names in its environment (POD_NAME): that is the
// process's own word, and with honorLabels it would replace the scrape's pod, so that any job
// writing a ledger could feed another pod's autoscaler. A ServiceMonitor of cuma's exporter
// keeps the scrape's labels.
function monitorProblems(d) {
  if (d.kind !== "ServiceMonitor") return [];
  return ((d.spec && d.spec.endpoints) || [])
    .filter((e) => e.honorLabels)
    .map((e) => `endpoint ${e.port || e.targetPort || "?"} sets honorLabels: the heaps' own pod labels would win over the scrape's`);
}

let failed = 0;
for (const file of process.argv.slice(2)) {
  const docs = yaml.loadAll(fs.readFileSync(file, "utf8")).filter(Boolean);
  const enforce = {};
  for (const d of docs)
    if (d.kind === "Namespace") enforce[d.metadata.name] = (d.metadata.labels || {})["pod-security.kubernetes.io/enforce"];
  for (const d of docs) {
    const what = `${file}: ${d.kind} ${d.metadata && d.metadata.namespace ? d.metadata.namespace + "/" : ""}${d.metadata && d.metadata.name}`;
    const Model = await modelFor(d.apiVersion || "", d.kind || "");
    if (!Model) {
      console.log(`  FAIL ${what}: no schema for ${d.apiVersion} ${d.kind}`);
      failed++;
      continue;
    }
    try {
      new Model(d).validate();
    } catch (e) {
      console.log(`  FAIL ${what}: ${e.message}`);
      failed++;
      continue;
    }
    const monitorWhy = monitorProblems(d);
    if (monitorWhy.length) {
      console.log(`  FAIL ${what}: ${monitorWhy.join(", ")}`);
      failed++;
      continue;
    }
    const spec = podSpecOf(d);
    const exporterWhy = spec ? exporterProblems(spec) : [];
    if (exporterWhy.length) {
      console.log(`  FAIL ${what}: the cuma exporter cannot see the job's ledger: ${exporterWhy.join(", ")}`);
      failed++;
      continue;
    }
    const level = d.metadata && enforce[d.metadata.namespace];
    if (spec && level === "baseline") {
      const v = baselineViolations(spec);
      if (v.length) {
        console.log(`  FAIL ${what}: not allowed under the baseline Pod Security Standard: ${v.join(", ")}`);
        failed++;
        continue;
      }
      console.log(`  ok   ${what} (schema, baseline Pod Security)`);
    } else {
      console.log(`  ok   ${what} (schema)`);
    }
  }
}
process.exit(failed ? 1 : 0);
