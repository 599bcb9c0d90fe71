#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Instructions per operation of cuma's fast path and of a trace replay, counted by callgrind:
# repeatable where wall-clock timings are not (a shared or noisy machine).
#
# usage: bench/profile.sh [BUILD] [TRACE]     (make profile)
#   BUILD  build folder holding bin/cuma-bench (default: build)
#   TRACE  trace to replay (default: tests/data/resnet_train.csv.gz)
#   CUMA_PROFILE_PAIRS    alloc+free pairs of the fast path (default 100000)
#   CUMA_PROFILE_REPLAYS  replays of the trace (default 2)
#   CUMA_PROFILE_CONF     added to cuma's settings (e.g. policy:buddy)
#   CUMA_PROFILE_SCALED   trace replayed with its sizes x16, as make bench's x16 rows do
#                         (default: tests/data/lstm_phases.csv.gz). At x1 few blocks fall in
#                         64 KiB-2 MiB, where placement packs blocks under a page, so a cost
#                         there shows only in this row.
#
# Each case runs twice under valgrind --tool=callgrind with the same start-up and warm-up:
# once with N operations and once with 0. The difference of the two instruction totals (Ir)
# divided by N is the cost of one operation, with start-up, trace parsing and warm-up removed.
# Then the functions that take the fast path's instructions, per pair.
set -euo pipefail
cd "$(dirname "$0")/.."
build=${1:-build}
trace=${2:-tests/data/resnet_train.csv.gz}
bench=$build/bin/cuma-bench
pairs=${CUMA_PROFILE_PAIRS:-100000}
replays=${CUMA_PROFILE_REPLAYS:-2}
conf=()
[ -n "${CUMA_PROFILE_CONF:-}" ] && conf=(--conf "$CUMA_PROFILE_CONF")

if ! command -v valgrind >/dev/null; then
    echo "profile: valgrind is not installed (scripts/deps.sh bench installs it)" >&2
    exit 1
fi
[ -x "$bench" ] || { echo "profile: $bench not found: build first (make build)" >&2; exit 1; }
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

# run NAME ARGS...: runs the bench under callgrind; prints "OPS IR".
run() {
    local name=$1
    shift
    if ! valgrind --tool=callgrind --callgrind-out-file="$tmp/$name.out" \
        "$bench" "${conf[@]}" "$@" >"$tmp/$name.txt" 2>"$tmp/$name.err"; then
        echo "profile: $bench $* failed under valgrind:" >&2
        cat "$tmp/$name.err" >&2
        exit 1
    fi
    local ops ir
    ops=$(awk '$1 == "ops" { print $2 }' "$tmp/$name.txt")
    ir=$(awk '/^(summary|totals):/ { print $2; exit }' "$tmp/$name.out")
    echo "$ops $ir"
}

# row CASE UNIT N_RUN ZERO_RUN: one line of the table.
row() {
    read -r ops ir <<<"$3"
    read -r _ ir0 <<<"$4"
    awk -v c="$1" -v u="$2" -v n="$ops" -v ir="$ir" -v ir0="$ir0" 'BEGIN {
        printf "| %-34s | %-13s | %8d | %13d | %13d | %7.1f |\n", c, u, n, ir, ir0, (ir - ir0) / n }'
}

echo "callgrind: instructions (Ir) per operation; start-up and warm-up removed by a 0-op run"
[ ${#conf[@]} -gt 0 ] && echo "cuma settings added: ${conf[1]}"
echo
echo "| case                               | op            |        N |      Ir total | Ir with 0 ops |   Ir/op |"
echo "|:-----------------------------------|:--------------|---------:|--------------:|--------------:|--------:|"
fast=$(run fast --profile-fast 4096 "$pairs")
fast0=$(run fast0 --profile-fast 4096 0)
row "fast path, 4 KiB, 1 thread" "alloc+free" "$fast" "$fast0"
name=$(basename "$trace" .csv.gz)
rep=$(run replay --profile-replay "$trace" "$replays")
rep0=$(run replay0 --profile-replay "$trace" 0)
row "replay $name x1, 1 thread" "alloc or free" "$rep" "$rep0"
scaled=${CUMA_PROFILE_SCALED:-tests/data/lstm_phases.csv.gz}
sname=$(basename "$scaled" .csv.gz)
srep=$(run sreplay --profile-replay "$scaled" "$replays" --profile-scale 16)
srep0=$(run sreplay0 --profile-replay "$scaled" 0 --profile-scale 16)
row "replay $sname x16, 1 thread" "alloc or free" "$srep" "$srep0"

echo
echo "Where the fast path's instructions go (self Ir per alloc+free pair, the 0-op run taken off):"
echo
# fns FILE: "IR<TAB>function" for every function of a callgrind output.
fns() {
    callgrind_annotate --inclusive=no --auto=no --threshold=100 "$1" 2>/dev/null |
        awk '/^-+$/ { dashes++; next }
             dashes >= 3 && /^ *$/ && seen { exit }
             dashes >= 3 && $1 ~ /^[0-9,]+$/ && !/PROGRAM TOTALS/ {
                 ir = $1; gsub(",", "", ir)
                 fn = $0; sub(/^ *[0-9,]+ *(\([^)]*\))? */, "", fn); sub(/ \[.*\]$/, "", fn)
                 printf "%s\t%s\n", ir, fn; seen = 1 }'
}
if command -v callgrind_annotate >/dev/null; then
    fns "$tmp/fast0.out" >"$tmp/f0.tsv"
    fns "$tmp/fast.out" >"$tmp/f.tsv"
    awk -F '\t' -v n="$pairs" 'NR == FNR { zero[$2] = $1; next }
        { d = ($1 - zero[$2]) / n; if (d >= 0.5) printf "%10.1f  %s\n", d, $2 }' \
        "$tmp/f0.tsv" "$tmp/f.tsv" | sort -rn | head -16
else
    echo "  (callgrind_annotate not found)"
fi
