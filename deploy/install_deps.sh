#!/usr/bin/env bash
# Installs what dbs needs on Debian 12 (bookworm). Idempotent: when every package is already
# installed it changes nothing and does not touch the network.
#
#   deploy/install_deps.sh           everything: build, run, test and benchmark (a developer, CI)
#   deploy/install_deps.sh --build   only what building the binaries needs (the image's builder)
set -euo pipefail

# Building dbs_ps, dbs_worker and dbs_health_probe.
BUILD_PACKAGES=(
  bazel-bootstrap bazel-rules-java g++ python3
  libgrpc++-dev protobuf-compiler-grpc libprotobuf-dev protobuf-compiler
  libabsl-dev libgoogle-glog-dev zlib1g-dev nlohmann-json3-dev
  libgoogle-perftools-dev libtorch-dev
  prometheus-cpp-dev libcpp-httplib-dev libssl-dev libbrotli-dev
)
# Running the default job, the tests, the sanitizers, the fuzzers and the benchmarks.
TEST_PACKAGES=(
  libgtest-dev libgmock-dev dataset-fashion-mnist
  python3-torch python3-numpy python3-matplotlib python3-yaml clang-format openssl
  python3-grpcio python3-protobuf python3-venv python3-setuptools python3-wheel
  clang libclang-rt-14-dev
  prometheus chromium docker-compose docker.io debootstrap
)

mode=all
case "${1:-}" in
  "") ;;
  --build) mode=build ;;
  *) echo "usage: $0 [--build]" >&2; exit 2 ;;
esac

PACKAGES=("${BUILD_PACKAGES[@]}")
if [ "$mode" = all ]; then
  PACKAGES+=("${TEST_PACKAGES[@]}")
  # kubectl (the Kubernetes manifests' test): any kubectl on the PATH will do; otherwise
  # Debian's kubernetes-client provides one.
  if ! command -v kubectl >/dev/null 2>&1; then PACKAGES+=(kubernetes-client); fi
  # Node.js and npm (the manifests' schema check uses the npm package kubernetes-models): any
  # on the PATH will do; otherwise Debian's.
  if ! command -v npm >/dev/null 2>&1; then PACKAGES+=(nodejs npm); fi
fi

missing=()
for p in "${PACKAGES[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
    missing+=("$p")
  fi
done
SUDO=""
if [ "$(id -u)" -ne 0 ]; then SUDO="sudo"; fi
if [ ${#missing[@]} -eq 0 ]; then
  echo "install_deps: all ${#PACKAGES[@]} packages present"
else
  echo "install_deps: installing ${missing[*]}"
  $SUDO apt-get update
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y --no-install-recommends "${missing[@]}"
fi
[ "$mode" = build ] && exit 0

# The Kubernetes API schemas that tests/deploy_test.py validates the manifests against (the npm
# package kubernetes-models, from the npm registry), outside the repository.
VALIDATOR=/usr/local/lib/dbs-k8s-validator
if [ ! -d "$VALIDATOR/node_modules/kubernetes-models" ]; then
  echo "install_deps: installing kubernetes-models into $VALIDATOR"
  $SUDO mkdir -p "$VALIDATOR"
  $SUDO npm install --prefix "$VALIDATOR" --no-audit --no-fund kubernetes-models@4.5.1
fi
