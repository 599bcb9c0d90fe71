#!/usr/bin/env bash
# The main job: replays the bundled traces with the default policy and the buddy, side by side.
set -euo pipefail
build=${1:-build}
cuma=$build/bin/cuma
echo "== cuma replay --scale 16 --conf release_delay_ms:1000 (default policy: tlsf good fit)"
"$cuma" replay --scale 16 --conf release_delay_ms:1000 tests/data/*.csv.gz
echo
echo "== the same with --policy buddy (the seed's buddy system)"
"$cuma" replay --scale 16 --conf release_delay_ms:1000 --policy buddy tests/data/*.csv.gz
