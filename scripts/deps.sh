#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Installs what building and testing cuma needs on a Debian machine, where it is missing.
# usage: scripts/deps.sh [build|test|bench|deploy]   (each includes build)
set -euo pipefail
what=${1:-build}
pkgs=(cmake make gcc g++ pkg-config zlib1g-dev python3)
case "$what" in
  test) pkgs+=(clang python3-pytest python3-numpy python3-torch libtorch-dev valgrind
    python3-setuptools python3-wheel python3-venv python3-pip chromium) ;;
  bench) pkgs+=(libmimalloc-dev libjemalloc-dev valgrind) ;;
esac
[ "$what" = test ] && pkgs+=(libmimalloc-dev libjemalloc-dev)
# deploy: the Kubernetes kit's checks (scripts/deploy-check.sh, tests/deploy). kubectl, node and
# npm are taken as they are where the commands exist (a machine may have them from elsewhere);
# only where one is missing is Debian's package asked for.
if [ "$what" = deploy ]; then
  pkgs+=(prometheus python3-yaml)
  command -v kubectl >/dev/null || pkgs+=(kubernetes-client)
  command -v node >/dev/null || pkgs+=(nodejs)
  command -v npm >/dev/null || pkgs+=(npm)
fi
missing=()
for p in "${pkgs[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
[ ${#missing[@]} -eq 0 ] && exit 0
echo "deps: installing ${missing[*]}"
SUDO=""
[ "$(id -u)" -eq 0 ] || SUDO="sudo"
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq
$SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
