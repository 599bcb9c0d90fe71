#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# libcuma's thread-local block must stay small. Some of its thread-locals are initial-exec (the
# fast path reads them without a call), so a dlopen of libcuma (ctypes in Python, beside
# PyTorch's libraries, which take their share) must place the whole block in the small static
# TLS reserve glibc keeps for such libraries (about 1.6 KiB for all of them); past it the load
# fails with "cannot allocate memory in static TLS block". At 1,568 bytes every Python test
# failed that way.
#   check_tls.sh LIBCUMA.so [LIMIT_BYTES]   (default limit 1280)
set -u
lib=$1
limit=${2:-1280}
line=$(readelf -lW "$lib" | awk '$1 == "TLS" {print $6}')
if [ -z "$line" ]; then
  echo "check_tls: $lib has no TLS segment (readelf -lW found none)"
  exit 0
fi
size=$((line))
if [ "$size" -gt "$limit" ]; then
  echo "check_tls: $lib's thread-local block is $size bytes, over $limit: move large" \
    "thread-local buffers to memory allocated per thread (see src/util/lockrank.c)" >&2
  exit 1
fi
echo "check_tls: $lib's thread-local block is $size bytes (limit $limit)"
