#!/usr/bin/env bash
# Installs what building and testing cuma needs on a Debian machine, where it is missing.
# usage: scripts/deps.sh [build|test|bench]   (test and bench include build)
set -euo pipefail
what=${1:-build}
pkgs=(cmake make gcc g++ pkg-config zlib1g-dev python3)
case "$what" in
  test) pkgs+=(clang python3-pytest python3-numpy python3-torch valgrind
    python3-setuptools python3-wheel python3-venv python3-pip) ;;
  bench) pkgs+=(libmimalloc-dev libjemalloc-dev valgrind) ;;
esac
[ "$what" = test ] && pkgs+=(libmimalloc-dev libjemalloc-dev)
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
