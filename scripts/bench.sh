#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# The speed benchmark: cuma's fast path and the bundled trace replays next to glibc malloc,
# mimalloc and jemalloc, printed as one table (bench/README.md says what each row means).
# usage: scripts/bench.sh [BUILD] [cuma-bench options...]    e.g. scripts/bench.sh build --json
# `make bench` runs it after building; options go in BENCH_ARGS (make bench BENCH_ARGS=--quick).
set -euo pipefail
cd "$(dirname "$0")/.."
build=${1:-build}
[ $# -gt 0 ] && shift
bench=$build/bin/cuma-bench
if [ ! -x "$bench" ]; then
    echo "bench: $bench not found: build first (make build)" >&2
    exit 1
fi
exec "$bench" "$@"
