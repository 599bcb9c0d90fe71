# SPDX-License-Identifier: Apache-2.0
# cuma's image: the `cuma` command (ps, top, stats, exporter, replay, ...), libcuma.so,
# libcuma_preload.so, libcuma_torch.so, the headers and the Python package, on Debian 12.
#   docker build -t cuma .
#   docker run --rm cuma version
#   docker run --rm --ipc=host --pid=host --user UID cuma exporter --bind 0.0.0.0
# The exporter reads the ledger of its own user (/dev/shm/cuma-UID): run it as the jobs' UID,
# with their /dev/shm and PID namespace (deploy/README.md for Kubernetes).
# The build stage runs scripts/image-build.sh, which scripts/docker-check.sh also runs on the
# host where no container builder works.

ARG DEBIAN_IMAGE=debian:bookworm-slim

FROM ${DEBIAN_IMAGE} AS build
# hadolint ignore=DL3008
RUN apt-get update \
 && apt-get install -y --no-install-recommends cmake make gcc g++ libc6-dev zlib1g-dev python3 \
 && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY CMakeLists.txt ./
COPY cmake cmake
COPY include include
COPY src src
COPY tools tools
COPY bench bench
COPY python/cuma python/cuma
COPY scripts/image-build.sh scripts/image-build.sh
# cuda.h is not in Debian's main archive. Without it the CUDA backends and the LD_PRELOAD shim
# are left out (the exporter and the tools need neither). To build them in, put the CUDA
# headers in the build context first: mkdir -p cuda && cp -r /usr/local/cuda/include cuda/
# (the pattern matches nothing otherwise; CMakeLists.txt keeps the COPY from being empty).
COPY CMakeLists.txt cuda/includ[e] /src/cuda-include/
RUN scripts/image-build.sh /src /stage /usr/local /src/cuda-include

FROM ${DEBIAN_IMAGE}
# hadolint ignore=DL3008
RUN apt-get update \
 && apt-get install -y --no-install-recommends zlib1g python3 libstdc++6 \
 && rm -rf /var/lib/apt/lists/* \
 && groupadd --system --gid 10001 cuma \
 && useradd --system --uid 10001 --gid cuma --no-create-home --shell /usr/sbin/nologin cuma
COPY --from=build /stage/usr/local /usr/local
COPY LICENSE NOTICE /usr/local/share/doc/cuma/
RUN ldconfig && cuma version
USER 10001:10001
EXPOSE 9840
ENTRYPOINT ["cuma"]
CMD ["exporter", "--bind", "0.0.0.0"]
