#!/usr/bin/env bash
# Prepares .cuda_kit/ on this (Debian, CPU-only) machine for bench/cuda/check.sh, which runs on a
# machine with an NVIDIA GPU but without Bazel or Debian's gRPC, Protobuf and Abseil:
#   .cuda_kit/dbs_ps                  the parameter server (it runs on the CPU there too)
#   .cuda_kit/libdbs_worker_core.a    every dbs_worker object except the two libtorch ones
#   .cuda_kit/lib/                    the shared libraries those need (Debian 12's)
#   .cuda_kit/include/absl/           Abseil's headers, which the libtorch objects include
#   .cuda_kit/python/dbs/             the Python workers' package with its gRPC stubs
# check.sh compiles worker/model.cc and worker/torch_learner.cc there against the GPU machine's
# CUDA libtorch (the torch Python package) and links them with this kit.
#
#   bench/cuda/make_kit.sh            # about 2 minutes on 2 cores; .cuda_kit/ is git-ignored
set -euo pipefail
cd "$(dirname "$0")/../.."
KIT=.cuda_kit
rm -rf "$KIT"
mkdir -p "$KIT/obj" "$KIT/lib" "$KIT/include"
bazel build //server:dbs_ps //proto:dbs_cc_grpc //python:package >/dev/null
cp bazel-bin/server/dbs_ps "$KIT/"
chmod u+w "$KIT/dbs_ps"
mkdir -p "$KIT/python"
cp -r python/dbs "$KIT/python/"
rm -rf "$KIT/python/dbs/__pycache__"
cp -r bazel-bin/python/dbs/_proto "$KIT/python/dbs/"
chmod -R u+w "$KIT/python"

# The worker's sources without libtorch: every .cc of worker/, common/ and common/rpc/ that
# dbs_worker depends on, except the two libtorch ones, and the generated protobuf code.
mapfile -t SOURCES < <(bazel query 'kind("source file", deps(//worker:dbs_worker))' \
  --output=label 2>/dev/null | grep -E '^//(worker|common(/rpc)?):.*\.cc$' |
  grep -v -E ':(model|torch_learner)\.cc$' | sed -e 's|^//||' -e 's|:|/|')
if [ "${#SOURCES[@]}" -lt 10 ]; then
  echo "make_kit: bazel query found only ${#SOURCES[@]} worker sources" >&2
  exit 1
fi
SOURCES+=(bazel-bin/proto/dbs.pb.cc bazel-bin/proto/dbs.grpc.pb.cc)
printf '%s\n' "${SOURCES[@]}" | xargs -P 2 -I{} sh -c \
  'g++ -std=c++17 -O2 -DNDEBUG -fPIC -I. -Ibazel-bin -c "$1" -o "$2/obj/$(echo "$1" | tr / _).o"' \
  _ {} "$KIT"
ar rcs "$KIT/libdbs_worker_core.a" "$KIT"/obj/*.o
rm -rf "$KIT/obj"

# The shared libraries dbs_ps and the worker's gRPC side load, minus the C and C++ runtimes that
# every Linux machine has.
ldd bazel-bin/server/dbs_ps | awk '/=> \//{print $3}' | sort -u |
  grep -v -E '/(libc|libm|libstdc\+\+|libgcc_s|libpthread|libdl|librt|ld-linux[^/]*)\.so' |
  xargs -I{} cp -L {} "$KIT/lib/"
cp -r /usr/include/absl "$KIT/include/"
du -sh "$KIT"
echo "make_kit: ready; on the GPU machine: bench/cuda/check.sh (carry .cuda_kit)"
