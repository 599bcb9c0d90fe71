#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# The folders of src/ are layers whose dependencies run one way (docs/DESIGN.md "Layers"): a
# file may include headers of its own folder and of the folders below it, never above. Only
# src/backend/ and src/shim/ may include a CUDA, NVTX or PyTorch header.
#
#   tests/unit/check_layers.sh SRC_DIR     check a tree; prints every offending include
#   tests/unit/check_layers.sh --self-test check that an upward include, a CUDA header in the
#                                          heap, an unknown folder and a missing bare header
#                                          in a planted tree are each reported
set -u
LAYERS="util trace settings backend place phys heap coord shim"
CUDA_OK="backend shim"

rank() { # prints the rank of layer $1, nothing for an unknown folder
  local i=0 l
  for l in $LAYERS; do
    [ "$l" = "$1" ] && { echo $i; return; }
    i=$((i + 1))
  done
}

check_tree() {
  local src=$1 bad=0 f rel top r line inc dep dr
  while IFS= read -r f; do
    rel=${f#"$src"/}
    top=${rel%%/*}
    r=$(rank "$top")
    if [ -z "$r" ]; then
      echo "$rel: folder '$top' is not a layer (known: $LAYERS)"
      bad=$((bad + 1))
      continue
    fi
    while IFS= read -r line; do
      inc=${line#*:}
      inc=$(printf '%s' "$inc" | sed -E 's/^[[:space:]]*#[[:space:]]*include[[:space:]]*//')
      case $inc in
      '<cuda'* | '<nvtx3/'* | '<torch/'* | '<c10/'* | '<ATen/'* | '"nvtx3/'*)
        case " $CUDA_OK " in
        *" $top "*) ;;
        *)
          echo "$rel:${line%%:*}: $inc: only $CUDA_OK may include CUDA, NVTX or PyTorch headers"
          bad=$((bad + 1))
          ;;
        esac
        ;;
      '"cuma/'*) ;; # the public headers sit below every layer
      '"'*/*'"')
        dep=${inc#\"}
        dep=${dep%%/*}
        dr=$(rank "$dep")
        if [ -z "$dr" ]; then
          echo "$rel:${line%%:*}: $inc: '$dep' is not a layer"
          bad=$((bad + 1))
        elif [ "$dr" -gt "$r" ]; then
          echo "$rel:${line%%:*}: $inc: $top may not include $dep (a layer above it)"
          bad=$((bad + 1))
        fi
        ;;
      '"'*'"')
        dep=${inc#\"}
        dep=${dep%\"}
        if [ ! -e "$(dirname "$f")/$dep" ]; then
          echo "$rel:${line%%:*}: $inc: no such header beside it (name the folder)"
          bad=$((bad + 1))
        fi
        ;;
      esac
    done < <(grep -nE '^[[:space:]]*#[[:space:]]*include' "$f")
  done < <(find "$src" -type f \( -name '*.c' -o -name '*.h' -o -name '*.cpp' \) | sort)
  if [ "$bad" -ne 0 ]; then
    echo "check_layers: $bad include(s) against the layers of $src"
    return 1
  fi
  echo "check_layers: every include of $src runs down the layers ($LAYERS)"
}

self_test() {
  local t fails=0 out
  t=$(mktemp -d)
  trap 'rm -rf "$t"' RETURN
  mkdir -p "$t/util" "$t/heap" "$t/core"
  printf '#include "heap/heap.h"\n' >"$t/util/up.c"
  printf '#include <cuda.h>\n#include "util/ok.h"\n' >"$t/heap/cuda.c"
  printf '#include "missing.h"\n' >"$t/heap/bare.c"
  : >"$t/util/ok.h"
  : >"$t/core/old.c"
  out=$(check_tree "$t")
  for want in "util may not include heap" "only backend shim may include" \
    "folder 'core' is not a layer" "missing.h\": no such header"; do
    if ! printf '%s\n' "$out" | grep -qF "$want"; then
      echo "self-test: not reported: $want"
      fails=$((fails + 1))
    fi
  done
  rm -rf "$t/core" "$t/util/up.c" "$t/heap/cuda.c" "$t/heap/bare.c"
  printf '#include "util/ok.h"\n#include "cuma/cuma.h"\n' >"$t/heap/fine.c"
  if ! check_tree "$t" >/dev/null; then
    echo "self-test: a clean tree was refused"
    fails=$((fails + 1))
  fi
  [ "$fails" -eq 0 ] && echo "check_layers self-test: passed"
  [ "$fails" -eq 0 ]
}

case ${1:-} in
--self-test) self_test ;;
'') echo "usage: $0 SRC_DIR | --self-test" >&2; exit 2 ;;
*) check_tree "$1" ;;
esac
