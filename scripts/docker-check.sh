#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Checks the Dockerfile. Where a container builder works (docker with a daemon, podman or
# buildah), builds the image and runs `cuma version` in it. Where none does (this project's CI
# machine: a docker client without a daemon, no registry to pull debian:bookworm-slim from),
# says so, and runs scripts/docker_check.py: a lint, and the build stage's commands on the host.
# usage: scripts/docker-check.sh        Exits non-zero on failure.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
tmp=$(mktemp -d "${TMPDIR:-/tmp}/cuma-docker-check.XXXXXX")
trap 'rm -rf "$tmp"' EXIT
builder=
if command -v docker >/dev/null && docker info >/dev/null 2>&1; then builder=docker
elif command -v podman >/dev/null && podman info >/dev/null 2>&1; then builder=podman
elif command -v buildah >/dev/null && buildah info >/dev/null 2>&1; then builder=buildah
fi
if [ -n "$builder" ]; then
  echo "== docker-check: building the image with $builder"
  tag=cuma-check:$$
  if [ "$builder" = buildah ]; then buildah bud -q -t "$tag" . && run=(podman run); else
    "$builder" build -q -t "$tag" . && run=("$builder" run); fi
  "${run[@]}" --rm "$tag" version
  "${run[@]}" --rm --entrypoint id "$tag" -u | grep -qv '^0$'
  "$builder" rmi "$tag" >/dev/null 2>&1 || true
  exit 0
fi
echo "== docker-check: no container builder works here (docker: $(command -v docker >/dev/null && echo 'no daemon' || echo absent); podman, buildah: absent); the image is not built"
/usr/bin/python3 scripts/docker_check.py "$root" "$tmp"
echo "docker-check: ok (lint + build stage on the host; no image built)"
