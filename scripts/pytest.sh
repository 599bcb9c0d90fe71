#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Runs the Python package's tests against one build of libcuma.
# usage: scripts/pytest.sh BUILD_DIR [pytest arguments...]
# The package is imported from python/ (PYTHONPATH) and loads BUILD_DIR/lib/libcuma.so
# (CUMA_LIBRARY), so the tests check exactly that build. Exits non-zero on any failure, and
# also when no test was collected (pytest's status 5), which would otherwise hide a broken
# test tree behind a green run.
set -u
if [ $# -lt 1 ]; then
  echo "usage: scripts/pytest.sh BUILD_DIR [pytest arguments...]" >&2
  exit 2
fi
build=$1
shift
root=$(cd "$(dirname "$0")/.." && pwd)
case "$build" in /*) ;; *) build="$PWD/$build" ;; esac
lib="$build/lib/libcuma.so"
if [ ! -f "$lib" ]; then
  echo "pytest.sh: $lib not found: build first (cmake --build $build)" >&2
  exit 2
fi
cd "$root"
# CUMA_CONF from the caller's shell would change what the default heaps are; each test sets
# its own. No cache or bytecode is written into the source tree.
env -u CUMA_CONF CUMA_LIBRARY="$lib" PYTHONPATH="$root/python${PYTHONPATH:+:$PYTHONPATH}" \
  PYTHONDONTWRITEBYTECODE=1 /usr/bin/python3 -m pytest -q -p no:cacheprovider python/tests "$@"
rc=$?
if [ "$rc" -eq 5 ]; then
  echo "pytest.sh: no tests were collected: treated as a failure" >&2
  exit 1
fi
exit "$rc"
