#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# The main job: replays the bundled traces with the default policy and the buddy, side by side.
set -euo pipefail
build=${1:-build}
cuma=$build/bin/cuma
echo "== cuma replay --scale 16 --conf release_delay_ms:1000 (default policy: tlsf good fit)"
# The default policy's replay also writes its timelines, drawn in $build/plots/replays.svg
# (docs/PLOTS.md): no measurable cost next to the replay (about 1.3 s here); the plot 0.01 s.
mkdir -p "$build/plots"
"$cuma" replay --scale 16 --conf release_delay_ms:1000 --timeline "$build/plots" tests/data/*.csv.gz
"$cuma" plot -o "$build/plots/replays.svg" --title "cuma replay x16, default policy, 1 s release delay" \
    "$build/plots"/*.timeline.csv
echo "timelines and $build/plots/replays.svg written (docs/PLOTS.md)"
echo
echo "== the same with --policy buddy (the seed's buddy system)"
"$cuma" replay --scale 16 --conf release_delay_ms:1000 --policy buddy tests/data/*.csv.gz
