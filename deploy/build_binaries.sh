#!/usr/bin/env bash
# Builds dbs_ps, dbs_worker and dbs_health_probe exactly as CI does and copies them to
# OUT/bin (default out/image), with a custom libtorch's libraries in OUT/lib when LIBTORCH_DIR
# is set (a CUDA build), and the Python workers' package with its generated stubs to
# OUT/python/dbs. Used by .ci/run and by the container image (deploy/docker/Dockerfile).
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-out/image}
TARGETS=(//server:dbs_ps //server:dbs_health_probe //worker:dbs_worker //python:stubs)
bazel build "${TARGETS[@]}"
mkdir -p "$out/bin" "$out/lib"
cp -f bazel-bin/server/dbs_ps bazel-bin/server/dbs_health_probe bazel-bin/worker/dbs_worker \
  "$out/bin/"
rm -rf "$out/python" && mkdir -p "$out/python/dbs/_proto"
cp -f python/dbs/*.py "$out/python/dbs/"
cp -f bazel-bin/python/dbs/_proto/*.py "$out/python/dbs/_proto/"
if [ -n "${LIBTORCH_DIR:-}" ]; then
  cp -a "$LIBTORCH_DIR"/lib/*.so* "$out/lib/"
fi
echo "build_binaries: $(ls "$out/bin" | tr '\n' ' ')in $out/bin"
