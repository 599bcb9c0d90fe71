#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# The builds packagers and other compilers make, kept warning-free: Release with gcc (-O3, where
# gcc's flow-dependent warnings such as -Wformat-truncation appear), RelWithDebInfo with clang,
# and Release with gcc on a machine without cuda.h, all with -DCUMA_WERROR=ON, each in a build
# directory of its own. Exits non-zero if any fails; says which.
# usage: scripts/ci-builds.sh [BUILD_PREFIX]   (default build-ci: build-ci-gcc-release, build-ci-clang,
#                                          build-ci-gcc-no-cuda)
set -uo pipefail
cd "$(dirname "$0")/.."
prefix=${1:-build-ci}
jobs=${JOBS:-$(nproc)}
failed=()

one() { # name cc cxx build_type [cmake option...]
  local name=$1 cc=$2 cxx=$3 type=$4 dir=$prefix-$1
  shift 4
  if ! command -v "$cc" >/dev/null; then
    echo "ci-builds: $name: $cc not installed"
    failed+=("$name")
    return
  fi
  echo "== ci-builds: $name ($cc, $type, -Werror) in $dir"
  mkdir -p "$dir"
  local cxxarg=()
  command -v "$cxx" >/dev/null && cxxarg=(-DCMAKE_CXX_COMPILER="$cxx")
  # CFLAGS: the hardening flags Debian packages build with (fortify, format-security), where known.
  if ! CFLAGS="$(dpkg-buildflags --get CFLAGS 2>/dev/null | sed "s/-O2//")" cmake -S . -B "$dir" -DCMAKE_C_COMPILER="$cc" "${cxxarg[@]}" -DCMAKE_BUILD_TYPE="$type" \
    -DCUMA_WERROR=ON "$@" >"$dir/ci-build.log" 2>&1; then
    tail -30 "$dir/ci-build.log"
    failed+=("$name")
    return
  fi
  if ! cmake --build "$dir" -j"$jobs" ${targets:+--target $targets} >>"$dir/ci-build.log" 2>&1; then
    grep -E -A3 'error|warning' "$dir/ci-build.log" | head -60
    failed+=("$name")
    return
  fi
  echo "   ok (log: $dir/ci-build.log)"
}

one gcc-release gcc g++ Release
one clang clang clang++ RelWithDebInfo
# What a machine without the CUDA toolkit builds (pip, the Dockerfile's build stage): no cuda.h,
# so no CUDA backends, and the code paths that answer for them instead.
# The library and the command only: the tests are the other builds' (and make test's).
targets="cuma_objs cuma_cli" one gcc-no-cuda gcc g++ Release -DCUMA_CUDA_INCLUDE_DIR=/nonexistent
if [ ${#failed[@]} -gt 0 ]; then
  echo "ci-builds: FAILED: ${failed[*]}"
  exit 1
fi
echo "ci-builds: all builds clean"
