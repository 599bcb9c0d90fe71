#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# The GPU check: cuma on a machine with a real NVIDIA GPU, in one command of under 9 minutes.
# The steps run in this order: 1, 2, 5, 5b, 3b, 4, 7-11, then 6 and 3a (which need no GPU).
#
#   1. Machine   nvidia-smi (device 0's compute mode first), driver, uname -m, nproc, the python3
#                every Python step runs (and its torch); asks the driver whether device 0 works
#   2. Build     cmake into build-gpu (scripts/deps.sh build first if cmake, cc or zlib.h is
#                missing; without apt network that is reported), for the python3 on PATH and the
#                nvcc's cuda.h; under --require-gpu a build without the CUDA backends FAILs
#   3. Tests     ctest on the fake driver (-E 'replay_'; last); `cuma replay --scale 16` of the bundled
#                traces on backend:sim, on backend:vmm over the fake driver, and over the real
#                driver on backend:vmm (overhead_ratio and time_avg_ratio must equal the sim's
#                within 0.001 on the fake driver, 0.015 on the real one, whose events complete
#                late: LAG_TOL) and backend:segment (must serve every allocation)
#   4. CUDA      scripts/gpu/churn.cu (nvcc, libcuma.a): kernels write and verify patterns in
#                cuma blocks on two streams while blocks churn (vmm; vmm with a 5 ms release
#                delay; segment), then micro-benchmarks of the driver's VMM calls and of cuma
#   5. PyTorch   runs first, right after the build (the one measurement only a GPU gives):
#                scripts/gpu/torch_compare.py: one variable-length transformer training loop
#                under the native allocator, under native with expandable_segments:True and
#                under cuma, as one table (peak reserved and allocated, median and p99 step
#                time; goals: step time within 3%, peak reserved at least 15% lower than
#                native's and at most expandable_segments'; PyTorch must report the pluggable
#                allocator in the cuma run; device memory the allocators did not count is
#                compared; cuma's driver calls per step), then, with the time left, 60 native
#                steps recording PyTorch's memory history (native_snapshot.pickle.gz), cuma with
#                remap_threshold:0.25 (reported: the fewest page moves, for some memory), then
#                120 steps under cuma logging the allocation trace (torch_trace.csv.gz); SKIP
#                without PyTorch+CUDA
#  5b. Streams   scripts/gpu/torch_multistream.py: layers' weights prefetched on a side stream,
#                used and freed on the main one, activations offloaded on a third: the values
#                under cuma must equal native's; the native run's memory snapshot
#                (multistream_snapshot.pickle.gz)
#   6. Bench     cuma-bench --only replay --no-peers on the host CPUs (1 and 2 threads): the
#                2-thread scaling a quiet many-core machine can show
#   7. Preload   scripts/gpu/preload_check.cu (the plain CUDA runtime, built with churn.cu) under
#                LD_PRELOAD=libcuma_preload.so with CUMA_CONF=limit:8G: cudaMemGetInfo says 8G,
#                cudaMalloc is refused beyond it, kernels write and verify cudaMalloc,
#                cudaMallocAsync and cudaMallocPitch memory
#   8. Ledger    scripts/gpu/ledger_pair.py --conf backend:vmm: two processes on device 0
#                through the cross-process ledger; a low-priority one holds 60% of the device
#                idle, a high-priority one takes 60% (must get it from the other's cache), then
#                the same with the memory in use (freed by the holder's pressure callback);
#                last, with what is left of the budget
#   9. Guard     scripts/gpu/memory_guard_check.py: cuma.adaptive.MemoryGuard on 8 transformer
#                layers, offload and recompute at watermarks 0 and 512 MiB with room for half
#                the activations: peak reserved and step time against the plain run, losses
#                equal; SKIP without PyTorch+CUDA; with what is left of the budget
#  10. Compact   scripts/gpu/compact_check.py: an MLP and its Adam state scattered one small
#                tensor per page under cuma, then cuma.torch.compact(model, optimizer=opt):
#                values bit for bit, fragmentation under 0.05, losses of 3 more steps equal to
#                an uncompacted run; SKIP without PyTorch+CUDA; with what is left of the budget
#  11. Pool      scripts/gpu/pool_check.py: heap.pool blocks on the device (distinct, one carve,
#                each block's bytes its own, refused past the last) and a BatchNorm model's
#                buffers in a pool (cuma.torch.pool_buffers): losses and running statistics
#                equal to the plain run, not moved by compaction; SKIP without PyTorch+CUDA
#
# Every step runs, each under its own timeout and within one overall budget (--budget, 480 s,
# the build included); a step the budget leaves no time for is SKIP (saying so), and under
# --require-gpu a GPU step skipped for time FAILs; a summary table of PASS/FAIL/SKIP ends the
# output. Exit status 1 if any step FAILed, else 0.
# Without a GPU the GPU steps SKIP, saying why, and the script exits 0; --require-gpu turns
# those SKIPs into FAILs.
#
# Output: build-gpu/ (the build, build-gpu/gpu/churn) and build-gpu/gpu-check/ (logs). When $OUT
# is set, 7 files go there: gpu-check.log (as it is written) and summary.txt (after every step),
# so a run cut off still brings back what it did; torch_trace.csv.gz (the allocation trace of the
# training loop under cuma, for `cuma replay` anywhere), native_snapshot.pickle.gz and
# multistream_snapshot.pickle.gz (PyTorch memory snapshots) when their steps end; results.json
# and logs.tar.gz (every log, torch.log and torch.json among them) at the end.
#
# On the device tool: `echo /.debs/ >>.git/info/exclude; mkdir -p .debs; (cd .debs && apt-get
# download zlib1g-dev)` here once, then run `CUMA_GPU_DEBS=.debs scripts/gpu-check.sh
# --require-gpu` with .debs carried, timeout_s 600.
#
# Environment: GPU_CHECK_BUDGET (seconds, as --budget), CUMA_GPU_DEBS (a folder of .deb files,
# e.g. zlib1g-dev, unpacked into build-gpu/sysroot when apt cannot install them), NVCC.
#
# --only STEPS runs those steps alone (comma-separated: ctest, replays, churn, bench, torch,
# multistream, ledger, preload, guard, compact, pool, probe; the
# machine and build steps always run), e.g. `--only torch` to run the PyTorch comparison again
# within the same device session.
#
# usage: scripts/gpu-check.sh [--require-gpu] [--budget SECONDS] [--no-torch] [--only STEPS]
#                             [--help]
set -uo pipefail

usage() { sed -n '2,/^set -uo/p' "$0" | sed -e '$d' -e 's/^# \{0,1\}//'; }

REQUIRE_GPU=0
NO_TORCH=0
ONLY=""
BUDGET=${GPU_CHECK_BUDGET:-480}
while [ $# -gt 0 ]; do
  case "$1" in
    --require-gpu) REQUIRE_GPU=1 ;;
    --no-torch) NO_TORCH=1 ;;
    --budget) BUDGET=${2:-}; shift ;;
    --budget=*) BUDGET=${1#--budget=} ;;
    --only) ONLY=${2:-}; shift ;;
    --only=*) ONLY=${1#--only=} ;;
    -h|--help) usage; exit 0 ;;
    *) echo "gpu-check: unknown option '$1'" >&2; usage >&2; exit 2 ;;
  esac
  shift
done
case "$BUDGET" in ''|*[!0-9]*) echo "gpu-check: --budget wants seconds, not '$BUDGET'" >&2; exit 2 ;; esac
for s in ${ONLY//,/ }; do
  case "$s" in ctest|replays|churn|bench|torch|multistream|ledger|preload|guard|compact|pool|probe) ;;
    *) echo "gpu-check: --only: unknown step '$s' (ctest, replays, churn, bench, torch, multistream, ledger, preload, guard, compact, pool, probe)" >&2; exit 2 ;;
  esac
done
# wanted STEP: whether --only leaves the step in.
wanted() { [ -z "$ONLY" ] || [[ ",$ONLY," == *",$1,"* ]]; }

cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit 2
BUILD=build-gpu
WORK=$BUILD/gpu-check
JOBS=$(nproc 2>/dev/null || echo 4)
mkdir -p "$WORK" || exit 2
rm -f "$WORK"/*.log "$WORK"/*.jsonl "$WORK"/*.json "$WORK"/*.txt "$WORK"/*.tsv "$WORK"/*.err "$WORK"/*.csv.gz
LOG=$WORK/gpu-check.log
T0=$SECONDS
# $OUT (the device tool's folder of files brought back) gets the log as it is written and the
# summary after every step: a run cut off at the tool's limit still brings back what it did.
if [ -n "${OUT:-}" ]; then
  mkdir -p "$OUT" || exit 2
  rm -f "$OUT/gpu-check.log" "$OUT/summary.txt"
fi
export PYTHONDONTWRITEBYTECODE=1 # nothing written outside build-gpu/ (python/cuma/__pycache__)

# ---- results --------------------------------------------------------------------------------

R_NAME=() R_STATUS=() R_NOTE=() R_SECS=()
STEP_T0=$SECONDS

step_start() { STEP_T0=$SECONDS; }

# record NAME STATUS NOTE [gpu]: one row of the summary. A SKIP of a GPU step is a FAIL under
# --require-gpu.
record() {
  local name=$1 st=$2 note=$3
  if [ "$st" = SKIP ] && [ "${4:-}" = gpu ] && [ "$REQUIRE_GPU" = 1 ]; then
    st=FAIL
    note="$note (--require-gpu)"
  fi
  R_NAME+=("$name") R_STATUS+=("$st") R_NOTE+=("$note") R_SECS+=("$((SECONDS - STEP_T0))")
  printf '>> %-36s %-4s  %s\n' "$name" "$st" "$note"
  [ -n "${OUT:-}" ] && summary_rows "(partial: the run goes on; $((SECONDS - T0)) s so far)" >"$OUT/summary.txt"
  return 0
}

# summary_rows TRAILER: the table of the steps recorded so far, then TRAILER.
summary_rows() {
  local i
  printf '%-36s %-4s %5s  %s\n' "step" "" "s" "result"
  for i in "${!R_NAME[@]}"; do
    printf '%-36s %-4s %5s  %s\n' "${R_NAME[$i]}" "${R_STATUS[$i]}" "${R_SECS[$i]}" "${R_NOTE[$i]}"
  done
  echo
  echo "$1"
}

# out_copy FILE...: files of $WORK into $OUT as soon as a step has made them.
out_copy() {
  local f
  [ -n "${OUT:-}" ] || return 0
  for f in "$@"; do [ -f "$WORK/$f" ] && cp "$WORK/$f" "$OUT/"; done
  return 0
}

section() { printf '\n==================== %s ====================\n' "$*"; }

# tmo WANTED: the timeout for the next command, within what is left of the budget; fails when
# less than 5 s would be left.
tmo() {
  local want=$1 left
  left=$((BUDGET - (SECONDS - T0) - 3))
  [ "$left" -lt "$want" ] && want=$left
  [ "$want" -ge 5 ] || return 1
  echo "$want"
}

# run SECONDS LOGFILE CMD...: runs CMD under timeout, its output on the console and appended to
# LOGFILE; returns CMD's status (124: timed out).
run() {
  local t=$1 log=$2
  shift 2
  echo "\$ $*" >>"$log"
  timeout -k 5 "$t" "$@" 2>&1 | tee -a "$log"
  return "${PIPESTATUS[0]}"
}

# quiet SECONDS LOGFILE CMD...: like run, output only into LOGFILE.
quiet() {
  local t=$1 log=$2
  shift 2
  echo "\$ $*" >>"$log"
  timeout -k 5 "$t" "$@" >>"$log" 2>&1
}

why_rc() { # a few words for an exit status
  case "$1" in
    124|137) echo "timed out after ${2}s" ;;
    125) echo "not run: the time budget (${BUDGET}s) is spent" ;;
    *) echo "exit $1" ;;
  esac
}

NO_TIME="the time budget (${BUDGET}s) is spent"

# ---- 1. machine -----------------------------------------------------------------------------

HAVE_GPU=0
COMPUTE_MODE=""
GPU_LINE=""
NO_GPU_WHY=""

step_machine() {
  section "1. Machine"
  step_start
  if command -v nvidia-smi >/dev/null 2>&1; then
    timeout 20 nvidia-smi -L || echo "nvidia-smi -L failed"
    # The compute mode first: under Exclusive_Process the ledger step's second process on
    # device 0 cannot make a context, and its failure says nothing about cuma.
    COMPUTE_MODE=$(timeout 20 nvidia-smi -i 0 --query-gpu=compute_mode --format=csv,noheader 2>/dev/null | head -1)
    echo "compute mode (device 0): ${COMPUTE_MODE:-unknown}"
    timeout 20 nvidia-smi --query-gpu=name,driver_version,memory.total,memory.used,pstate,clocks.sm,clocks.max.sm \
      --format=csv || true
  else
    echo "nvidia-smi: not found"
  fi
  echo "uname -m: $(uname -m)   kernel: $(uname -r)   nproc: $JOBS"
  [ -r /etc/os-release ] && echo "os: $(sed -n 's/^PRETTY_NAME=//p' /etc/os-release | tr -d '"')"
  free -g 2>/dev/null | sed -n '1,2p'
  echo "cmake: $(cmake --version 2>/dev/null | head -1 || echo none)"
  echo "cc: $(cc --version 2>/dev/null | head -1 || echo none)"
  NVCC=${NVCC:-$(command -v nvcc || true)}
  [ -z "$NVCC" ] && [ -x /usr/local/cuda/bin/nvcc ] && NVCC=/usr/local/cuda/bin/nvcc
  echo "nvcc: ${NVCC:-none} $( [ -n "$NVCC" ] && "$NVCC" --version 2>/dev/null | grep -o 'release [0-9.]*' )"
  echo "python3 (every Python step runs it): $(command -v python3 || echo none) $(python3 --version 2>&1)$(
    python3 -c 'import torch; print(", torch", torch.__version__, "cuda", torch.version.cuda)' 2>/dev/null)"
  echo "budget: ${BUDGET}s; require GPU: $([ "$REQUIRE_GPU" = 1 ] && echo yes || echo no)"
  # Whether the GPU steps can run: the driver itself is asked (libcuma loads libcuda.so.1 too).
  local probe
  if command -v python3 >/dev/null 2>&1; then
    probe=$(env -u CUMA_CUDA_LIBRARY timeout 60 python3 scripts/gpu/cuda_probe.py 2>&1)
    local rc=$?
    echo "driver probe: $probe"
    if [ $rc -eq 0 ]; then HAVE_GPU=1 GPU_LINE=${probe#GPU: }; else NO_GPU_WHY=${probe#NO GPU: }; fi
  elif timeout 20 nvidia-smi -L >/dev/null 2>&1; then
    HAVE_GPU=1 GPU_LINE="nvidia-smi lists a GPU (no python3 to ask the driver)"
  else
    NO_GPU_WHY="no python3 to ask the driver and nvidia-smi lists nothing"
  fi
  [ -z "$NO_GPU_WHY" ] && [ "$HAVE_GPU" = 0 ] && NO_GPU_WHY="unknown"
  if [ "$HAVE_GPU" = 1 ]; then
    record "gpu present" PASS "$GPU_LINE"
  else
    record "gpu present" SKIP "no GPU: $NO_GPU_WHY" gpu
  fi
}

# ---- 2. build -------------------------------------------------------------------------------

BUILD_OK=0
ZLIB_ARGS=()
ZLIB_LIB="" # the library's full path when zlib came from $CUMA_GPU_DEBS

CC_BIN=$(command -v cc || command -v gcc || true)

have_zlib_h() { printf '#include <zlib.h>\n' | "$CC_BIN" -E -x c - >/dev/null 2>&1; }

# zlib from .deb files in $CUMA_GPU_DEBS when apt cannot install zlib1g-dev: the headers from
# the package, the library the system already has (libz.so.1 is on every system).
zlib_from_debs() {
  local dir=${CUMA_GPU_DEBS:-} deb libz d
  [ -n "$dir" ] && [ -d "$dir" ] || return 1
  command -v dpkg-deb >/dev/null 2>&1 || return 1
  for deb in "$dir"/*.deb; do
    [ -e "$deb" ] || continue
    dpkg-deb -x "$deb" "$BUILD/sysroot" || return 1
  done
  [ -f "$BUILD/sysroot/usr/include/zlib.h" ] || return 1
  libz=$(ldconfig -p 2>/dev/null | awk '/libz\.so\.1 .*x86-64|libz\.so\.1 .*AArch64/ {print $NF; exit}')
  if [ -z "$libz" ]; then
    for d in /lib/*/libz.so.1 /usr/lib/*/libz.so.1; do [ -e "$d" ] && { libz=$d; break; }; done
  fi
  [ -n "$libz" ] || return 1
  ZLIB_ARGS=(-DZLIB_INCLUDE_DIR="$(cd "$BUILD/sysroot/usr/include" && pwd)" -DZLIB_LIBRARY="$libz")
  ZLIB_LIB=$libz
  echo "zlib: headers from $dir, library $libz"
}

step_build() {
  section "2. Build ($BUILD, RelWithDebInfo, -j$JOBS)"
  step_start
  local blog=$WORK/build.log t missing=()
  command -v cmake >/dev/null 2>&1 || missing+=(cmake)
  [ -n "$CC_BIN" ] || missing+=(cc)
  [ -n "$CC_BIN" ] && ! have_zlib_h && missing+=(zlib.h)
  if [ ${#missing[@]} -gt 0 ]; then
    echo "missing: ${missing[*]}: scripts/deps.sh build (apt-get)"
    if t=$(tmo 75) && quiet "$t" "$blog" scripts/deps.sh build; then
      echo "deps: installed"
    else
      echo "deps: scripts/deps.sh build failed (no apt network here?); its output:"
      tail -5 "$blog"
    fi
    CC_BIN=$(command -v cc || command -v gcc || true)
    if [ -n "$CC_BIN" ] && ! have_zlib_h; then
      zlib_from_debs || echo "zlib.h: still missing (set CUMA_GPU_DEBS to a folder holding zlib1g-dev's .deb)"
    fi
  fi
  if ! command -v cmake >/dev/null 2>&1; then
    record build FAIL "cmake is missing and could not be installed (apt network?)"
    return
  fi
  local gen=()
  if [ ! -f "$BUILD/CMakeCache.txt" ] && ! command -v make >/dev/null 2>&1 && command -v ninja >/dev/null 2>&1; then
    gen=(-G Ninja)
  fi
  # The python3 every Python step runs (the one holding PyTorch), so the build's PyTorch shim is
  # made for it; cuda.h from the toolkit of the nvcc found, where /usr/local/cuda has none.
  local pyargs=() cudaargs=() inc
  command -v python3 >/dev/null 2>&1 && pyargs=(-DCUMA_PYTHON="$(command -v python3)")
  if [ ! -f /usr/local/cuda/include/cuda.h ] && [ -n "${NVCC:-}" ]; then
    inc="$(dirname "$(dirname "$NVCC")")/include"
    [ -f "$inc/cuda.h" ] && cudaargs=(-DCUMA_CUDA_INCLUDE_DIR="$inc")
  fi
  gen+=("${pyargs[@]}" "${cudaargs[@]}")
  echo "\$ cmake -S . -B $BUILD -DCMAKE_BUILD_TYPE=RelWithDebInfo ${gen[*]} ${ZLIB_ARGS[*]}"
  echo "\$ cmake --build $BUILD -j$JOBS   (compiler output in $blog)"
  local rc=0
  if ! t=$(tmo 90); then record build SKIP "$NO_TIME"; return; fi
  quiet "$t" "$blog" cmake -S . -B "$BUILD" -DCMAKE_BUILD_TYPE=RelWithDebInfo "${gen[@]}" "${ZLIB_ARGS[@]}" || rc=$?
  if [ $rc -eq 0 ]; then
    if ! t=$(tmo 240); then record build SKIP "$NO_TIME"; return; fi
    quiet "$t" "$blog" cmake --build "$BUILD" -j"$JOBS" || rc=$?
  fi
  # libcuma_torch_c10 is compiled against this machine's PyTorch headers: if that is what
  # failed, the rest is built without it (cuma.torch then builds it when it loads, or raises a
  # RuntimeError for cuma's out-of-memory), not every step lost to it.
  if [ $rc -ne 0 ] && [ $rc -ne 124 ] && grep -q 'cuma_torch_c10\|raise_c10' "$blog"; then
    echo "build: libcuma_torch_c10 failed against this PyTorch; again without it (-DCUMA_TORCH_C10=OFF)"
    rc=0
    if t=$(tmo 120); then
      quiet "$t" "$blog" cmake -S . -B "$BUILD" -DCUMA_TORCH_C10=OFF &&
        quiet "$t" "$blog" cmake --build "$BUILD" -j"$JOBS" || rc=$?
    else
      rc=125
    fi
  fi
  if [ $rc -eq 0 ] && [ -x "$BUILD/bin/cuma" ] && [ -f "$BUILD/lib/libcuma.a" ] && [ -f "$BUILD/lib/libcuma.so" ]; then
    tail -2 "$blog"
    if grep -q 'CUDA backends are not built' "$blog"; then
      echo "WARNING: cuda.h not found: no CUDA backends"
      if [ "$REQUIRE_GPU" = 1 ]; then
        record build FAIL "cuda.h not found: the CUDA backends are not built (--require-gpu)"
        return
      fi
    fi
    BUILD_OK=1
    record build PASS "$BUILD/bin/cuma, $BUILD/lib/libcuma.{a,so}"
  else
    tail -40 "$blog"
    record build FAIL "cmake $(why_rc $rc "$t") (see build.log)"
  fi
}

# ---- 4a. churn.cu, built in the background while the tests run ------------------------------

CHURN=$BUILD/gpu/churn
PRELOAD_CHECK=$BUILD/gpu/preload_check
DRIVER_PROBE=$BUILD/gpu/driver_probe
CHURN_PID=""

# shellcheck disable=SC2317  # run through `declare -f`, which shellcheck cannot follow
build_churn() { # runs in the background; all output into churn-build.log
  local stubs="" d arch
  for d in "$(dirname "$(dirname "$NVCC")")"/lib64/stubs "$(dirname "$(dirname "$NVCC")")"/targets/*/lib/stubs \
           /usr/local/cuda/lib64/stubs; do
    [ -f "$d/libcuda.so" ] && { stubs=$d; break; }
  done
  mkdir -p "$BUILD/gpu"
  # Linked against the toolkit's stub libcuda.so: at run time the loader takes the driver's
  # libcuda.so.1 (the stub is never on the run-time path).
  local link=("$BUILD/lib/libcuma.a")
  [ -n "$stubs" ] && link+=(-L"$stubs")
  link+=(-lcuda)
  if [ -n "$ZLIB_LIB" ]; then link+=(-Xlinker "$ZLIB_LIB"); else link+=(-lz); fi
  link+=(-lpthread -ldl -lm)
  local archs=()
  [ "$HAVE_GPU" = 1 ] && archs+=("-arch=native")
  archs+=("-gencode=arch=compute_90,code=[sm_90,compute_90]")
  local out rc
  for arch in "${archs[@]}"; do
    echo "\$ $NVCC -O2 -std=c++17 $arch -Xcompiler -Wall,-Wextra -I include scripts/gpu/churn.cu ${link[*]} -o $CHURN"
    out=$("$NVCC" -O2 -std=c++17 "$arch" -Xcompiler -Wall,-Wextra -I include scripts/gpu/churn.cu "${link[@]}" \
          -o "$CHURN" 2>&1)
    rc=$?
    [ -n "$out" ] && echo "$out"
    # -arch=native that finds no GPU only warns and builds for a default architecture.
    if [ "$rc" -eq 0 ] && ! grep -q 'Cannot find valid GPU' <<<"$out"; then
      echo "built with $arch"
      # The LD_PRELOAD step's program: the plain CUDA runtime, nothing of cuma linked in.
      echo "\$ $NVCC -O2 -std=c++17 $arch scripts/gpu/preload_check.cu -o $PRELOAD_CHECK"
      "$NVCC" -O2 -std=c++17 "$arch" -Xcompiler -Wall,-Wextra scripts/gpu/preload_check.cu \
        -o "$PRELOAD_CHECK" || echo "preload_check.cu: nvcc failed"
      # The driver questions' program: the runtime and the driver API, nothing of cuma.
      echo "\$ $NVCC -O2 -std=c++17 $arch scripts/gpu/driver_probe.cu -lcuda -o $DRIVER_PROBE"
      "$NVCC" -O2 -std=c++17 "$arch" -Xcompiler -Wall,-Wextra scripts/gpu/driver_probe.cu \
        ${stubs:+-L"$stubs"} -lcuda -o "$DRIVER_PROBE" || echo "driver_probe.cu: nvcc failed"
      return 0
    fi
    echo "nvcc with $arch: $([ "$rc" -eq 0 ] && echo "found no GPU to build for" || echo "failed (exit $rc)")"
  done
  rm -f "$CHURN"
  return 1
}

start_churn_build() {
  CHURN_PID=""
  rm -f "$CHURN" "$PRELOAD_CHECK" "$DRIVER_PROBE"
  [ "$BUILD_OK" = 1 ] && [ -n "${NVCC:-}" ] || return
  local t
  t=$(tmo 180) || return
  export NVCC HAVE_GPU ZLIB_LIB BUILD CHURN PRELOAD_CHECK DRIVER_PROBE
  timeout -k 5 "$t" bash -c "$(declare -f build_churn); build_churn" >"$WORK/churn-build.log" 2>&1 &
  CHURN_PID=$!
}

# ---- 3. tests and replays -------------------------------------------------------------------

step_ctest() {
  section "3a. Test suite on the fake driver: ctest --test-dir $BUILD -j $JOBS -E 'replay_'"
  step_start
  if [ "$BUILD_OK" != 1 ]; then record "ctest (fake driver)" SKIP "needs the build (failed or left out)"; return; fi
  local t rc=0
  if ! t=$(tmo 150); then record "ctest (fake driver)" SKIP "$NO_TIME"; return; fi
  run "$t" "$WORK/ctest.log" env -u CUMA_CONF -u CUMA_CUDA_LIBRARY \
    ctest --test-dir "$BUILD" -j "$JOBS" -E 'replay_' --output-on-failure || rc=$?
  local line
  line=$(grep -E 'tests passed|tests failed' "$WORK/ctest.log" | tail -1)
  if [ $rc -eq 0 ]; then record "ctest (fake driver)" PASS "$line"
  else record "ctest (fake driver)" FAIL "${line:-$(why_rc $rc "$t")}"; fi
}

TRACES=(tests/data/*.csv.gz)

# replay LABEL SECONDS CONF [ENV=VALUE...]: `cuma replay --json --scale 16` of every bundled
# trace into $WORK/replay-LABEL.jsonl; prints its table; returns cuma's status.
replay() {
  local label=$1 want=$2 conf=$3 t rc=0
  shift 3
  local out=$WORK/replay-$label.jsonl
  : >"$out"
  t=$(tmo "$want") || { echo "$NO_TIME"; return 125; }
  echo "\$ ${*:+$* }$BUILD/bin/cuma replay --json --scale 16 --conf $conf ${TRACES[*]}"
  local t1=$SECONDS
  timeout -k 5 "$t" env -u CUMA_CONF -u CUMA_CUDA_LIBRARY "$@" \
    "$BUILD/bin/cuma" replay --json --scale 16 --conf "$conf" "${TRACES[@]}" >"$out" 2>"$out.err" || rc=$?
  cat "$out.err"
  python3 scripts/gpu/replay_compare.py table "$out" --label "$label"
  echo "($label: exit $rc, $((SECONDS - t1)) s)"
  [ $rc -eq 124 ] || [ $rc -eq 137 ] && echo "$label: timed out after ${t}s"
  return $rc
}

# The real driver's events complete some microseconds after they are recorded, which the
# replay's clock does not see: memory freed on a stream is then reusable a poll later than in the
# sim, as with the fake's FAKECUDA_EVENT_LAG, whose replays (tests/cuda/check_replay_backends.py)
# stay within 1% of the sim's ratios. So the real driver's ratios may differ by 0.015 (1% of a
# ratio up to 1.5); the fake driver's, whose events complete at once, by 0.001.
LAG_TOL=0.015

# compare_to_sim NAME LABEL [--info] [gpu] [TOL]: the run against the sim's, one summary row.
compare_to_sim() {
  local name=$1 label=$2 info=${3:-} gpu=${4:-} tol=${5:-0.001} ref=sim args=()
  if [ "$info" = --info ]; then ref=simseg args=(--info); fi
  local out rc worst
  out=$(python3 scripts/gpu/replay_compare.py compare "$WORK/replay-$ref.jsonl" "$WORK/replay-$label.jsonl" \
        --tol "$tol" --ref-label "$ref" --label "$label" "${args[@]}" 2>&1)
  rc=$?
  echo "$out"
  worst=$(echo "$out" | grep -o 'largest ratio difference: [0-9.]*' | awk '{print $4}')
  if [ $rc -ne 0 ]; then
    record "$name" FAIL "$(echo "$out" | grep 'COMPARE FAIL' | cut -c15-200)" "$gpu"
  elif [ "$info" = --info ]; then
    record "$name" PASS "served every allocation; ratios differ from sim_segments:on by up to ${worst:-?} (info)" "$gpu"
  else
    record "$name" PASS "same ratios as sim within $tol (largest difference ${worst:-?})" "$gpu"
  fi
}

step_replays() {
  section "3b. Replays: cuma replay --scale 16 --conf <backend>,release_delay_ms:1000 tests/data/*.csv.gz"
  step_start
  if [ "$BUILD_OK" != 1 ]; then
    record "replay sim" SKIP "needs the build (failed or left out)"
    record "replay vmm (fake driver) = sim" SKIP "needs the build (failed or left out)"
    record "replay vmm (real driver) = sim" SKIP "needs the build (failed or left out)" gpu
    record "replay segment (real driver)" SKIP "needs the build (failed or left out)" gpu
    return
  fi
  if ! command -v python3 >/dev/null 2>&1; then
    record "replay sim" FAIL "python3 is needed to read the JSON"
    return
  fi
  local rc
  echo "-- backend:sim (the reference)"
  replay sim 60 backend:sim,release_delay_ms:1000; rc=$?
  if [ $rc -eq 0 ]; then record "replay sim" PASS "$(wc -l <"$WORK/replay-sim.jsonl") traces"
  elif [ $rc -eq 125 ]; then record "replay sim" SKIP "$NO_TIME"
  else record "replay sim" FAIL "cuma replay $(why_rc $rc 60)"; fi

  step_start
  echo
  echo "-- backend:vmm over the fake driver (tests/fakecuda, 80 GiB like the sim)"
  local fake=$BUILD/tests/fakecuda/libcuda.so.1
  if [ ! -f "$fake" ]; then
    record "replay vmm (fake driver) = sim" SKIP "no fake driver built (cuda.h missing?)"
  else
    replay fakevmm 90 backend:vmm,release_delay_ms:1000 CUMA_CUDA_LIBRARY="$PWD/$fake" FAKECUDA_CAPACITY=80G; rc=$?
    if [ $rc -eq 125 ]; then record "replay vmm (fake driver) = sim" SKIP "$NO_TIME"
    elif [ $rc -ne 0 ]; then record "replay vmm (fake driver) = sim" FAIL "cuma replay exit $rc"
    else compare_to_sim "replay vmm (fake driver) = sim" fakevmm; fi
  fi

  step_start
  echo
  echo "-- backend:vmm on the real driver (CUMA_CUDA_LIBRARY unset: libcuda.so.1)"
  if [ "$HAVE_GPU" != 1 ]; then
    echo "SKIP: no GPU: $NO_GPU_WHY"
    record "replay vmm (real driver) = sim" SKIP "no GPU" gpu
  else
    replay vmm 120 backend:vmm,release_delay_ms:1000; rc=$?
    if [ $rc -eq 125 ]; then record "replay vmm (real driver) = sim" SKIP "$NO_TIME" gpu
    elif [ $rc -ne 0 ]; then record "replay vmm (real driver) = sim" FAIL "cuma replay $(why_rc $rc 120)"
    else compare_to_sim "replay vmm (real driver) = sim" vmm "" gpu "$LAG_TOL"; fi
  fi

  step_start
  echo
  echo "-- backend:segment on the real driver, against the sim's segment mode (sim_segments:on)"
  if [ "$HAVE_GPU" != 1 ]; then
    echo "SKIP: no GPU: $NO_GPU_WHY"
    record "replay segment (real driver)" SKIP "no GPU" gpu
  else
    replay simseg 60 backend:sim,sim_segments:on,release_delay_ms:1000 >/dev/null
    replay segment 90 backend:segment,release_delay_ms:1000; rc=$?
    if [ $rc -eq 125 ]; then record "replay segment (real driver)" SKIP "$NO_TIME" gpu
    elif [ $rc -ne 0 ]; then record "replay segment (real driver)" FAIL "cuma replay $(why_rc $rc 90)"
    else compare_to_sim "replay segment (real driver)" segment --info gpu; fi
  fi
  # One file for $OUT: every run's JSON lines, each tagged with its run.
  local f lab
  : >"$WORK/replay.jsonl"
  for f in "$WORK"/replay-*.jsonl; do
    lab=${f##*/replay-}
    lab=${lab%.jsonl}
    sed "s/^{/{\"run\":\"$lab\",/" "$f" >>"$WORK/replay.jsonl"
  done
}

# ---- 4. churn and bench ---------------------------------------------------------------------

CHURN_BUILT=0

step_churn_build() {
  section "4a. Build scripts/gpu/churn.cu (nvcc, $BUILD/lib/libcuma.a, -lcuda)"
  step_start
  if [ "$BUILD_OK" != 1 ]; then record "churn.cu builds" SKIP "needs the build (failed or left out)"; return; fi
  if [ -z "${NVCC:-}" ]; then record "churn.cu builds" SKIP "no nvcc (CUDA toolkit) here" gpu; return; fi
  if [ -z "$CHURN_PID" ]; then record "churn.cu builds" SKIP "$NO_TIME" gpu; return; fi
  local rc=0
  wait "$CHURN_PID" || rc=$?
  cat "$WORK/churn-build.log"
  cat "$WORK/churn-build.log" >>"$WORK/churn.log"
  if [ $rc -eq 0 ] && [ -x "$CHURN" ]; then
    CHURN_BUILT=1
    record "churn.cu builds" PASS "$(grep -o 'built with .*' "$WORK/churn-build.log" | tail -1)"
  else
    record "churn.cu builds" FAIL "nvcc $(why_rc $rc 180) (see churn.log)"
  fi
}

# churn_run NAME SECONDS ARGS...: one run of the churn program, one summary row.
churn_run() {
  local name=$1 want=$2 t rc=0
  shift 2
  step_start
  echo
  echo "-- $name"
  if [ "$HAVE_GPU" != 1 ]; then echo "SKIP: no GPU: $NO_GPU_WHY"; record "$name" SKIP "no GPU" gpu; return; fi
  if [ "$CHURN_BUILT" != 1 ]; then record "$name" SKIP "churn.cu did not build" gpu; return; fi
  if ! t=$(tmo "$want"); then record "$name" SKIP "$NO_TIME" gpu; return; fi
  local n0 res
  n0=$(wc -l <"$WORK/churn.log")
  run "$t" "$WORK/churn.log" env -u CUMA_CONF -u CUMA_CUDA_LIBRARY "$CHURN" "$@" || rc=$?
  # This run's verdict line, else its last line (a crash, a missing library).
  res=$(tail -n +"$((n0 + 2))" "$WORK/churn.log" | grep 'CHURN RESULT' | tail -1)
  res=${res#CHURN RESULT: }
  [ -n "$res" ] || res=$(tail -n +"$((n0 + 2))" "$WORK/churn.log" | grep -v '^ *$' | tail -1 | cut -c1-160)
  if [ $rc -eq 0 ]; then record "$name" PASS "$res"
  else record "$name" FAIL "$(why_rc $rc "$t")${res:+: $res}"; fi
}

step_churn() {
  section "4b. churn on the real driver: patterns written and verified on two streams"
  churn_run "churn vmm" 90 --conf backend:vmm --iters 3000 --seed 1
  churn_run "churn vmm, release_delay_ms:5" 60 --conf backend:vmm,release_delay_ms:5 --iters 1500 --seed 2
  churn_run "churn segment" 60 --conf backend:segment --iters 1500 --seed 3
  section "4c. Micro-benchmarks: driver VMM calls and cuma alloc+free"
  churn_run "bench (driver calls, cuma pairs)" 60 --bench-only --conf backend:vmm
}

# ---- 5. pytorch -----------------------------------------------------------------------------

step_torch() {
  section "5. PyTorch: native allocator against cuma (scripts/gpu/torch_compare.py)"
  step_start
  local name="torch: cuma vs native" t rc=0
  if [ "$NO_TORCH" = 1 ]; then record "$name" SKIP "--no-torch" gpu; return; fi
  local why
  why=$(timeout 90 python3 -c "import torch; assert torch.cuda.is_available(), 'torch %s: torch.cuda.is_available() is False' % torch.__version__" 2>&1)
  rc=$?
  why=$(echo "$why" | grep -v '^ ' | tail -1)
  if [ "$HAVE_GPU" != 1 ]; then
    echo "SKIP: no GPU: $NO_GPU_WHY"
    echo "(PyTorch here: ${why:-exit $rc})"
    record "$name" SKIP "no GPU (PyTorch here: ${why:-exit $rc})" gpu
    return
  fi
  if [ $rc -ne 0 ]; then
    echo "SKIP: PyTorch with CUDA is not usable here: ${why:-exit $rc}"
    record "$name" SKIP "no PyTorch with CUDA: ${why:-exit $rc}" gpu
    return
  fi
  if [ "$BUILD_OK" != 1 ]; then record "$name" SKIP "needs the build (failed or left out)" gpu; return; fi
  if ! t=$(tmo 200); then record "$name" SKIP "$NO_TIME" gpu; return; fi
  rc=0
  # The native, expandable_segments and cuma runs (judged) come first and share what is left of
  # t, each up to 100 s; the reported-only runs (the native run's memory snapshot, remap_threshold,
  # the trace) get the rest, or are left out. An allocation cuma fails for good leaves
  # torch_oom-PID.json (what held the memory: logs.tar.gz).
  run "$t" "$WORK/torch.log" env -u CUMA_CONF -u CUMA_CUDA_LIBRARY PYTHONPATH="$PWD/python" \
    CUMA_LIBRARY="$PWD/$BUILD/lib/libcuma.so" PYTHONUNBUFFERED=1 \
    python3 scripts/gpu/torch_compare.py --json-out "$WORK/torch.json" --child-timeout 100 \
    --total-timeout "$((t - 10))" --cuma-conf "oom_dump:$WORK/torch_oom-%p.json" \
    --snapshot-out "$WORK/native_snapshot.pickle.gz" \
    --cuma-alt-conf remap_threshold:0.25 --trace-out "$WORK/torch_trace.csv.gz" || rc=$?
  out_copy torch_trace.csv.gz native_snapshot.pickle.gz
  local res
  res=$(grep 'TORCH RESULT' "$WORK/torch.log" | tail -1)
  res=${res#TORCH RESULT: }
  case $rc in
    0) record "$name" PASS "$res" gpu ;;
    3) record "$name" SKIP "$res" gpu ;;
    *) record "$name" FAIL "$(why_rc $rc "$t")${res:+: $res}" gpu ;;
  esac
}

# ---- 6. host scaling ------------------------------------------------------------------------

# The replays of cuma-bench on this machine's CPUs: a quiet many-core machine measures the
# 2-thread scaling that a shared 2-CPU machine cannot (issue: 2T/1T >= 1.6). No GPU needed.
step_bench() {
  section "6. Host replays and scaling: $BUILD/bin/cuma-bench --only replay --runs 5 --no-peers"
  step_start
  local name="bench replays (CPU)"
  if [ "$BUILD_OK" != 1 ] || [ ! -x "$BUILD/bin/cuma-bench" ]; then
    record "$name" SKIP "needs the build (failed or left out)"
    return
  fi
  if ! t=$(tmo 60); then record "$name" SKIP "$NO_TIME"; return; fi
  local rc=0
  run "$t" "$WORK/bench.log" "$BUILD/bin/cuma-bench" --only replay --runs 5 --no-peers || rc=$?
  if [ $rc -ne 0 ]; then record "$name" FAIL "cuma-bench $(why_rc $rc "$t")"; return; fi
  local sc
  sc=$(awk -F'|' '$2 ~ /scaling/ && $3 ~ / x1 / && $4 ~ /cuma/ { gsub(/^ +| +$/, "", $3); gsub(/ /, "", $13); printf "%s%s %s", sep, $3, $13; sep = ", " }' "$WORK/bench.log")
  record "$name" PASS "cuma 2T/1T: ${sc:-?}"
}

# ---- 7. any CUDA program under LD_PRELOAD -------------------------------------------------

step_preload() {
  section "7. LD_PRELOAD: a plain CUDA runtime program under libcuma_preload.so (scripts/gpu/preload_check.cu)"
  step_start
  local name="preload: cudaMalloc under the shim"
  if [ "$HAVE_GPU" != 1 ]; then record "$name" SKIP "no GPU: $NO_GPU_WHY" gpu; return; fi
  # Built in the background with churn.cu (step 4a waited for it unless --only left it out).
  [ -n "$CHURN_PID" ] && { wait "$CHURN_PID" 2>/dev/null; cat "$WORK/churn-build.log" >>"$WORK/preload.log"; }
  if [ ! -x "$PRELOAD_CHECK" ]; then record "$name" SKIP "preload_check.cu did not build (churn.log)" gpu; return; fi
  if [ ! -f "$BUILD/lib/libcuma_preload.so" ]; then record "$name" FAIL "no $BUILD/lib/libcuma_preload.so"; return; fi
  if ! t=$(tmo 60); then record "$name" SKIP "$NO_TIME" gpu; return; fi
  local rc=0 res
  echo "-- without the shim (the driver's figures)"
  run "$((t / 2))" "$WORK/preload.log" env -u CUMA_CONF -u LD_PRELOAD "$PRELOAD_CHECK" || true
  echo "-- under the shim with CUMA_CONF=limit:8G"
  run "$((t / 2))" "$WORK/preload.log" env CUMA_CONF=limit:8G LD_PRELOAD="$PWD/$BUILD/lib/libcuma_preload.so" \
    "$PRELOAD_CHECK" 8589934592 || rc=$?
  res=$(grep 'PRELOAD RESULT' "$WORK/preload.log" | tail -1)
  res=${res#PRELOAD RESULT: }
  if [ $rc -eq 0 ]; then record "$name" PASS "$res" gpu; else record "$name" FAIL "$(why_rc $rc "$t")${res:+: $res}" gpu; fi
}

# ---- 8. two processes through the ledger ---------------------------------------------------

step_ledger() {
  section "8. Ledger: two processes on device 0 (scripts/gpu/ledger_pair.py --conf backend:vmm)"
  step_start
  local name="ledger: two processes, one GPU"
  if [ "$HAVE_GPU" != 1 ]; then record "$name" SKIP "no GPU: $NO_GPU_WHY" gpu; return; fi
  if [ "$BUILD_OK" != 1 ]; then record "$name" SKIP "needs the build (failed or left out)" gpu; return; fi
  case "$COMPUTE_MODE" in
    Exclusive_Process|Prohibited)
      record "$name" SKIP "device 0's compute mode is $COMPUTE_MODE: a second process cannot use it" gpu
      return ;;
  esac
  if ! t=$(tmo 90); then record "$name" SKIP "$NO_TIME" gpu; return; fi
  local rc=0
  run "$t" "$WORK/ledger.log" env -u CUMA_CONF -u CUMA_CUDA_LIBRARY PYTHONPATH="$PWD/python" \
    CUMA_LIBRARY="$PWD/$BUILD/lib/libcuma.so" PYTHONUNBUFFERED=1 \
    python3 scripts/gpu/ledger_pair.py --conf backend:vmm || rc=$?
  local res
  res=$(grep 'LEDGER RESULT' "$WORK/ledger.log" | tail -1)
  res=${res#LEDGER RESULT: }
  if [ $rc -eq 0 ]; then record "$name" PASS "$res" gpu; else record "$name" FAIL "$(why_rc $rc "$t")${res:+: $res}" gpu; fi
}

# ---- summary --------------------------------------------------------------------------------

summary() {
  section "Summary"
  local i npass=0 nfail=0 nskip=0 gskip=0
  for i in "${!R_NAME[@]}"; do # counted here, not in the pipeline below (a subshell)
    case ${R_STATUS[$i]} in
      PASS) npass=$((npass + 1)) ;;
      FAIL) nfail=$((nfail + 1)) ;;
      SKIP) nskip=$((nskip + 1)) ;;
    esac
    case ${R_NOTE[$i]} in "no GPU"*) gskip=$((gskip + 1)) ;; esac
  done
  {
    summary_rows "$npass PASS, $nfail FAIL, $nskip SKIP in $((SECONDS - T0)) s (budget ${BUDGET} s)"
    if [ "$HAVE_GPU" = 1 ]; then
      echo "GPU: $GPU_LINE"
    else
      echo "NO GPU here ($NO_GPU_WHY): the $gskip steps that need one were skipped;"
      echo "the steps that need none ran (the table above)"
      if [ "$REQUIRE_GPU" = 1 ]; then echo "--require-gpu: those skips count as failures."
      else echo "Run with --require-gpu to make that a failure."; fi
    fi
    if [ "$nfail" -gt 0 ]; then echo "RESULT: FAIL"; else echo "RESULT: PASS"; fi
  } | tee "$WORK/summary.txt"
  if command -v python3 >/dev/null 2>&1; then
    for i in "${!R_NAME[@]}"; do
      printf '%s\t%s\t%s\t%s\n' "${R_NAME[$i]}" "${R_STATUS[$i]}" "${R_SECS[$i]}" "${R_NOTE[$i]}"
    done >"$WORK/rows.tsv"
    python3 - "$WORK" "$HAVE_GPU" "$GPU_LINE$NO_GPU_WHY" "$((SECONDS - T0))" "$nfail" <<'EOF'
import json, os, sys
work, have_gpu, gpu, secs, nfail = sys.argv[1:6]
rows = []
with open(os.path.join(work, "rows.tsv"), encoding="utf-8", errors="replace") as f:
    for line in f:
        name, status, s, note = (line.rstrip("\n").split("\t") + [""] * 4)[:4]
        rows.append({"step": name, "status": status, "seconds": int(s or 0), "note": note})
res = {"result": "FAIL" if int(nfail) else "PASS", "gpu": bool(int(have_gpu)), "gpu_info": gpu,
       "seconds": int(secs), "steps": rows}


def tagged(path, tag):
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.startswith(tag):
                    return json.loads(line[len(tag):])
    except (OSError, ValueError):
        return None
    return None


bench = tagged(os.path.join(work, "churn.log"), "BENCH_JSON ")
if bench:
    res["bench_median_ns"] = bench
try:
    with open(os.path.join(work, "torch.json"), encoding="utf-8") as f:
        res["torch"] = json.load(f)
except (OSError, ValueError):
    pass
with open(os.path.join(work, "results.json"), "w", encoding="utf-8") as f:
    json.dump(res, f, indent=1)
EOF
  fi
  [ "$nfail" -eq 0 ]
}

# py_step SECTION NAME LOG SCRIPT TAG [BUDGET [ARG...]]: a Python step over the package and the
# build's libcuma that prints "TAG RESULT: PASS|FAIL|SKIP ..." and exits 0, 1 or 3 (SKIP).
py_step() {
  local section=$1 name=$2 log=$3 script=$4 tag=$5 budget=${6:-60}
  local args=("${@:7}")
  section "$section"
  step_start
  if [ "$NO_TORCH" = 1 ]; then record "$name" SKIP "--no-torch" gpu; return; fi
  if [ "$HAVE_GPU" != 1 ]; then record "$name" SKIP "no GPU: $NO_GPU_WHY" gpu; return; fi
  if [ "$BUILD_OK" != 1 ]; then record "$name" SKIP "needs the build (failed or left out)" gpu; return; fi
  if ! t=$(tmo "$budget"); then record "$name" SKIP "$NO_TIME" gpu; return; fi
  local rc=0
  run "$t" "$WORK/$log" env -u CUMA_CONF -u CUMA_CUDA_LIBRARY PYTHONPATH="$PWD/python" \
    CUMA_LIBRARY="$PWD/$BUILD/lib/libcuma.so" PYTHONUNBUFFERED=1 \
    python3 "$script" "${args[@]}" || rc=$?
  local res
  res=$(grep "$tag RESULT" "$WORK/$log" | tail -1)
  res=${res#"$tag RESULT: "}
  case $rc in
    0) record "$name" PASS "$res" gpu ;;
    3) record "$name" SKIP "$res" gpu ;;
    *) record "$name" FAIL "$(why_rc $rc "$t")${res:+: $res}" gpu ;;
  esac
}

step_multistream() {
  py_step "5b. Multi-stream: weights prefetched on a side stream, activations offloaded on a third (scripts/gpu/torch_multistream.py)" \
    "multistream: frees on other streams" multistream.log scripts/gpu/torch_multistream.py MULTISTREAM 90 \
    --snapshot-out "$WORK/multistream_snapshot.pickle.gz" --child-timeout 40
  out_copy multistream_snapshot.pickle.gz
}

step_guard() {
  py_step "9. Guard: MemoryGuard on a transformer (scripts/gpu/memory_guard_check.py)" \
    "guard: activations kept off the device" guard.log scripts/gpu/memory_guard_check.py GUARD
}

step_compact() {
  py_step "10. Compact: cuma.torch.compact on a scattered model (scripts/gpu/compact_check.py)" \
    "compact: model tensors to dense pages" compact.log scripts/gpu/compact_check.py COMPACT
}

step_pool() {
  py_step "11. Pool: raw blocks and a model's buffers in a fixed-size pool (scripts/gpu/pool_check.py)" \
    "pool: blocks and buffers on the device" pool.log scripts/gpu/pool_check.py POOL
}

# ---- 4d. what the design assumes of the driver ----------------------------------------------

step_probe() {
  section "4d. Driver probe: a dead thread's per-thread stream, VMM calls beside a busy stream (scripts/gpu/driver_probe.cu)"
  step_start
  local name="probe: legacy stream and VMM calls" t rc=0 res
  if [ "$HAVE_GPU" != 1 ]; then record "$name" SKIP "no GPU: $NO_GPU_WHY" gpu; return; fi
  # Built in the background with churn.cu.
  [ -n "$CHURN_PID" ] && { wait "$CHURN_PID" 2>/dev/null; cat "$WORK/churn-build.log" >>"$WORK/probe.log"; }
  if [ ! -x "$DRIVER_PROBE" ]; then record "$name" SKIP "driver_probe.cu did not build (churn.log)" gpu; return; fi
  if ! t=$(tmo 30); then record "$name" SKIP "$NO_TIME" gpu; return; fi
  run "$t" "$WORK/probe.log" env -u CUMA_CONF -u LD_PRELOAD "$DRIVER_PROBE" || rc=$?
  res=$(grep 'PROBE RESULT' "$WORK/probe.log" | tail -1)
  res=${res#PROBE RESULT: }
  if [ $rc -eq 0 ]; then record "$name" PASS "$res" gpu; else record "$name" FAIL "$(why_rc $rc "$t")${res:+: $res}" gpu; fi
}

main() {
  echo "cuma GPU check: $(git log -1 --format='%h %s' 2>/dev/null | cut -c1-100) ($(date -u '+%Y-%m-%d %H:%M:%S UTC'))"
  [ -n "$(git status --porcelain --untracked-files=no 2>/dev/null)" ] && echo "(the working tree has uncommitted changes)"
  step_machine
  step_build
  # The PyTorch table first: the figures no other machine can give (before nvcc starts in the
  # background, which would take CPU from the timed runs), then the multi-stream snapshot.
  wanted torch && step_torch
  wanted multistream && step_multistream
  { wanted churn || wanted preload || wanted probe; } && start_churn_build
  # Then what needs the real driver; the steps that need no GPU (the fake driver's ctest, the
  # host bench: CI and any machine run them) last, with what time is left.
  wanted replays && step_replays
  wanted churn && step_churn_build
  wanted churn && step_churn
  wanted probe && step_probe
  wanted preload && step_preload
  wanted ledger && step_ledger
  wanted guard && step_guard
  wanted compact && step_compact
  wanted pool && step_pool
  wanted bench && step_bench
  wanted ctest && step_ctest
  summary
}

if [ -n "${OUT:-}" ]; then
  main 2>&1 | tee "$LOG" "$OUT/gpu-check.log"
else
  main 2>&1 | tee "$LOG"
fi
rc=${PIPESTATUS[0]}
if [ -n "${OUT:-}" ]; then
  out_copy summary.txt results.json torch_trace.csv.gz native_snapshot.pickle.gz multistream_snapshot.pickle.gz
  # Every log in one file (torch.log and torch.json too): the device tool brings back at most 8.
  (cd "$WORK" && tar -czf "$OUT/logs.tar.gz" -- *.log *.jsonl *.json *.txt 2>/dev/null)
  echo "gpu-check: results in $OUT"
fi
exit "$rc"
