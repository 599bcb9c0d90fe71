#!/bin/sh
# SPDX-License-Identifier: Apache-2.0
# bench_smoke: runs cuma-bench --quick on one trace and checks that it prints every row, as
# JSON and as the table. Timings are not checked (a benchmark is not a timed test).
# usage: bench/smoke.sh BENCH TRACE.csv.gz
set -u
bench=$1
trace=$2
name=$(basename "$trace" .csv.gz)
out=$(mktemp)
trap 'rm -f "$out" "$out.table"' EXIT
fail=0

if ! "$bench" --quick --json "$trace" >"$out"; then
    echo "bench_smoke: cuma-bench --quick --json failed"
    exit 1
fi
has() { # section case allocator threads
    if ! grep -qF "{\"section\":\"$1\",\"case\":\"$2\",\"allocator\":\"$3\",\"threads\":$4," "$out"; then
        echo "bench_smoke: missing row: $1 / $2 / $3 / $4 threads"
        fail=1
    fi
}
grep -q '^{"section":"machine","nproc":' "$out" || { echo "bench_smoke: no machine line"; fail=1; }
has cost "clock_gettime(MONOTONIC)" - 1
has cost "mutex lock+unlock" - 1
has cost "mutex lock+unlock" - 2
for size in "64 B" "4 KiB" "64 KiB" "1 MiB" "64 MiB"; do
    for alloc in cuma glibc mimalloc jemalloc; do
        has fast "$size" "$alloc" 1
        has fast "$size" "$alloc" 2
    done
done
has fast "4 KiB" "cuma (real clock)" 1
has fast "4 KiB" "cuma (real clock)" 2
for alloc in cuma glibc mimalloc jemalloc; do
    has replay "$name x1" "$alloc" 1
    has latency "$name x1" "$alloc" 1
    has scaling "$name x1" "$alloc" 2
done
has replay "$name x16" cuma 1
has latency "$name x16" cuma 1
has scaling "$name x16" cuma 2
for rc in "delay 20 ms: a thread's timed wait" "delay 20 ms: idle heap (all freed)" \
    "delay 20 ms: 32 of 96 pages freed, frag 0" "delay 20 ms: 32 of 96 pages freed, frag 0.05" \
    "delay 20 ms: idle heap, thread caches on" "trim 64 MiB" "trim 1 GiB" \
    "trim 64 MiB, sim_call_us:20" "max_cached 8 MiB, 32 pages freed" \
    "max_cached 8 MiB, 32 pages freed, tcache on" "ledger pressure: 512 MiB, 768 of 1024 MiB idle"; do
    alloc=cuma
    case "$rc" in *"timed wait") alloc=cond_timedwait ;; esac
    has release "$rc" "$alloc" 1
done
has pacing "$name x16, sim_call_us:20" "cuma (paced)" 1
has pacing "$name x16, sim_call_us:20" "cuma (unpaced)" 1
# cuma's own rows carry figures, not notes of failure (release rows always carry a note: the
# reference their figures are read against).
if grep '"allocator":"cuma' "$out" | grep -v '"section":"release"' | grep -v '"note":""' |
    grep -v 'sim_clock:real' | grep -v '"section":"pacing".*maps a pass'; then
    echo "bench_smoke: a cuma row has a note (failed calls?)"
    fail=1
fi
# Every release row has its figures, and none says that a round failed, that memory never went
# back or went back before its delay, or that the allocation did not go through the ledger.
if grep '^{"section":"release"' "$out" |
    grep -E '"p50_ns":null|failed|never given|stayed|before the delay|did not ask|no ledger'; then
    echo "bench_smoke: a release row has no figures or a note of failure"
    fail=1
fi
rows=$(grep -c '^{"section":"[a-z]*","case"' "$out")

if ! "$bench" --quick "$trace" >"$out.table"; then
    echo "bench_smoke: cuma-bench --quick failed"
    exit 1
fi
table=$(grep -cE '^\| (cost|fast|replay|latency|scaling|release|pacing) ' "$out.table")
if [ "$table" -ne "$rows" ]; then
    echo "bench_smoke: the table has $table rows, the JSON $rows"
    fail=1
fi
grep -q '^machine: nproc=' "$out.table" || { echo "bench_smoke: no machine line in the table"; fail=1; }
[ "$fail" -eq 0 ] && echo "bench_smoke: $rows rows, table and JSON"
exit "$fail"
