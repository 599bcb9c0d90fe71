#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# The build stage of the Dockerfile: configures and builds cuma (Release, no tests) and installs
# it under STAGE/PREFIX (DESTDIR), from where the image's last stage copies PREFIX.
# scripts/docker-check.sh runs it on the host too, so the host check and the image build run the
# same commands.
# usage: scripts/image-build.sh SRC STAGE PREFIX [CUDA_INCLUDE_DIR]
set -euo pipefail
src=$1 stage=$2 prefix=$3 cuda=${4:-/usr/local/cuda/include}
build=${IMAGE_BUILD_DIR:-$src/build-image}
cmake -S "$src" -B "$build" -DCMAKE_BUILD_TYPE=Release -DCUMA_BUILD_TESTS=OFF \
  -DCMAKE_INSTALL_PREFIX="$prefix" -DCUMA_CUDA_INCLUDE_DIR="$cuda" >/dev/null
cmake --build "$build" -j"${JOBS:-$(nproc)}"
DESTDIR=$stage cmake --install "$build" >/dev/null
echo "image-build: installed under $stage$prefix"
