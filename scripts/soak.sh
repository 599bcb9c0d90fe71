#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# The soak run (`make soak`): the randomized tests again and again, with new seeds, for
# SOAK_MINUTES (default 10) in a build with AddressSanitizer + UBSan (build-asan): the stress test
# in each of its configurations, the fork tests, the cross-process ledger stress, the release
# thread's timing cases. Stops at the first failure and prints the command and the seed that
# replays it; otherwise prints how many runs of each passed.
#
# usage: scripts/soak.sh [BUILD_DIR]   (default build-asan, configured and built here)
set -uo pipefail
build=${1:-build-asan}
minutes=${SOAK_MINUTES:-10}
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
if [ "$build" = build-asan ]; then
  # As `make test-asan` configures it (the two share the folder): warnings are errors.
  cmake -S . -B build-asan -DCMAKE_BUILD_TYPE=Debug -DCUMA_SANITIZE=address -DCUMA_WERROR=ON \
    >/dev/null || exit 1
fi
cmake --build "$build" -j"$(nproc)" --target test_stress test_fork test_fork_cases \
  test_ledger_stress test_release_thread test_tcache test_arena >/dev/null || exit 1
export UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1
t=$build/tests
# name | command (CUMA_TEST_SEED is set per run)
cases=(
  "stress|$t/test_stress"
  "stress_buddy|$t/test_stress policy:buddy"
  "stress_segments|$t/test_stress sim_segments:on"
  "stress_arenas|$t/test_stress arenas:3 spread"
  "stress_lag|$t/test_stress arenas:3,sim_lag_ms:2 spread"
  "tcache|$t/test_tcache"
  "arena|$t/test_arena"
  "fork|$t/test_fork"
  "fork_cases|$t/test_fork_cases"
  "ledger_stress|$t/coord/test_ledger_stress"
  "release_thread|$t/test_release_thread"
)
declare -A passed
end=$(( $(date +%s) + minutes * 60 ))
round=0
while [ "$(date +%s)" -lt "$end" ]; do
  round=$((round + 1))
  for c in "${cases[@]}"; do
    name=${c%%|*}
    cmd=${c#*|}
    seed=$(od -An -N8 -tu8 /dev/urandom | tr -d ' ')
    log=$(mktemp)
    # test_fork takes its seed as an argument; the others read CUMA_TEST_SEED.
    [ "$name" = fork ] && cmd="$cmd $((seed % 4294967296))"
    if ! CUMA_TEST_SEED=$seed CUMA_STRESS_OPS=${CUMA_STRESS_OPS:-400000} timeout 600 $cmd >"$log" 2>&1; then
      tail -30 "$log"
      echo "soak: FAIL in round $round: CUMA_TEST_SEED=$seed $cmd"
      rm -f "$log"
      exit 1
    fi
    rm -f "$log"
    passed[$name]=$(( ${passed[$name]:-0} + 1 ))
    [ "$(date +%s)" -lt "$end" ] || break
  done
done
for c in "${cases[@]}"; do
  name=${c%%|*}
  printf 'soak: %-16s %d runs passed\n' "$name" "${passed[$name]:-0}"
done
echo "soak: $round rounds in $minutes min, no failure"
