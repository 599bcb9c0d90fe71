#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# The Kubernetes kit (deploy/), offline: renders each kustomization with `kubectl kustomize`,
# validates the objects against the Kubernetes API schemas and the sidecar's pod against the
# baseline Pod Security Standard (deploy/validate/validate.mjs, Node.js with kubernetes-models
# from the npm registry, installed by `npm ci` from its lock file), then checks that the
# validator rejects broken copies (a sidecar with hostPID, one without shareProcessNamespace,
# a port that is not a number, a ServiceMonitor that honours the heaps' own pod labels), so a
# green run is not a validator that accepts anything.
# Nothing talks to a cluster. usage: scripts/deploy-check.sh     Exits non-zero on failure.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
for tool in kubectl node npm; do
  command -v "$tool" >/dev/null || { echo "deploy-check: $tool not installed (scripts/deps.sh deploy)" >&2; exit 1; }
done
tmp=$(mktemp -d "${TMPDIR:-/tmp}/cuma-deploy-check.XXXXXX")
trap 'rm -rf "$tmp"' EXIT
if [ ! -d deploy/validate/node_modules ]; then
  echo "== deploy-check: npm ci (deploy/validate)"
  (cd deploy/validate && npm ci --no-audit --no-fund --silent)
fi
# Where a machine has no kubectl, deps.sh installs Debian 12's (kubernetes-client 1.20), whose
# kustomize (v2) refuses the newer `labels:` field and a generator's own `options:` with
# 'unknown field': the kit keeps its labels in the resources and its generator options at the
# top, which every kustomize since v2 renders alike. Checked here too, whichever kubectl this is.
if grep -nE '^labels:|^ +options:' deploy/*/kustomization.yaml; then
  echo "deploy-check: FAILED: a kustomization uses a field Debian's kubectl (kustomize v2) refuses" >&2
  exit 1
fi
echo "== deploy-check: kubectl kustomize ($(kubectl version --client 2>/dev/null | grep -i kustomize || echo 'kustomize version unknown'))"
for kit in daemonset sidecar adapter; do
  kubectl kustomize "deploy/$kit" >"$tmp/$kit.yaml" || { echo "deploy-check: FAILED: kubectl kustomize deploy/$kit" >&2; exit 1; }
  echo "  deploy/$kit: $(grep -c '^kind:' "$tmp/$kit.yaml") objects"
done
echo "== deploy-check: schemas and Pod Security"
node deploy/validate/validate.mjs "$tmp/daemonset.yaml" "$tmp/sidecar.yaml" "$tmp/adapter.yaml" ||
  { echo "deploy-check: FAILED: validation" >&2; exit 1; }

echo "== deploy-check: the validator rejects broken copies"
bad=0
expect_fail() { # name sed-expression [kit, default sidecar]
  sed "$2" "$tmp/${3:-sidecar}.yaml" >"$tmp/bad-$1.yaml"
  cmp -s "$tmp/${3:-sidecar}.yaml" "$tmp/bad-$1.yaml" && { echo "  FAIL $1: the edit changed nothing"; bad=1; return; }
  if node deploy/validate/validate.mjs "$tmp/bad-$1.yaml" >"$tmp/bad-$1.out"; then
    echo "  FAIL $1: accepted"; bad=1
  else
    echo "  ok   $1: $(grep -m1 FAIL "$tmp/bad-$1.out" | sed "s|.*$1.yaml: ||")"
  fi
}
expect_fail host-pid 's/shareProcessNamespace: true/hostPID: true/'
expect_fail no-shared-pids 's/shareProcessNamespace: true/shareProcessNamespace: false/'
expect_fail port-not-a-number 's/containerPort: 9840/containerPort: metrics/'
expect_fail honor-labels 's/honorLabels: false/honorLabels: true/'
expect_fail honor-labels-node 's/honorLabels: false/honorLabels: true/' daemonset
[ "$bad" = 0 ] || { echo "deploy-check: FAILED: the validator accepted a broken manifest" >&2; exit 1; }
echo "deploy-check: ok"
