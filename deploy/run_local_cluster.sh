#!/usr/bin/env bash
# README's first command: install dependencies, build both binaries, and train on Fashion-MNIST
# with a local cluster (one dbs_ps, four dbs_workers, one of them slowed 3x). Extra arguments go to
# deploy/local_cluster.py (see --help there), e.g. --policy=fixed or --workers=8.
set -euo pipefail
cd "$(dirname "$0")/.."
bash deploy/install_deps.sh
bazel build //server:dbs_ps //worker:dbs_worker //python:package
exec python3 deploy/local_cluster.py "$@"
