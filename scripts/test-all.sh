#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# `make test`: runs every test phase, each as `make test-PHASE`, even when an earlier one
# failed, then prints one summary (phase, passed/failed, duration) and exits non-zero if any
# phase failed. A phase whose build fails has failed. Each phase's own output (ctest's and
# pytest's closing lines) comes first, as it runs.
#
#   scripts/test-all.sh PHASE...        (the Makefile passes TEST_PHASES)
#
# A new phase is a `test-NAME` target in the Makefile and NAME added to TEST_PHASES there.
set -u
if [ $# -eq 0 ]; then
  echo "usage: scripts/test-all.sh PHASE... (each runs as make test-PHASE)" >&2
  exit 2
fi
make_cmd=${MAKE:-make}
names=() results=() times=()
failed=0
for phase in "$@"; do
  echo "==== test phase: $phase (make test-$phase)"
  start=$(date +%s)
  if "$make_cmd" --no-print-directory "test-$phase"; then
    result=passed
  else
    result=failed
    failed=$((failed + 1))
  fi
  secs=$(($(date +%s) - start))
  names+=("$phase") results+=("$result") times+=("$secs")
  echo "==== test phase: $phase $result ($secs s)"
done

total=0
echo
echo "==== make test summary"
printf '%-12s %-7s %9s\n' phase result duration
for i in "${!names[@]}"; do
  printf '%-12s %-7s %7d s\n' "${names[$i]}" "${results[$i]}" "${times[$i]}"
  total=$((total + times[i]))
done
printf '%-12s %-7s %7d s\n' all "$([ "$failed" -eq 0 ] && echo passed || echo failed)" "$total"
if [ "$failed" -ne 0 ]; then
  echo "make test: $failed of ${#names[@]} phases failed"
else
  echo "make test: all ${#names[@]} phases passed"
fi
# The plain closing line that test runners and CI read: it counts phases, not tests.
echo "phases: $((${#names[@]} - failed)) passed, $failed failed"
[ "$failed" -eq 0 ]
