#!/bin/bash
# dbs_ps with tcmalloc's release rate at 0 (KeepFreedMemoryMapped, session 24) against the
# binary before it, interleaved, without gloo: server page faults, peak RSS and step time.
# OLD_PS: a dbs_ps built at 72d375d (git worktree add /tmp/old 72d375d && cd /tmp/old &&
# bazel build //server:dbs_ps). Writes old1 new1 old2 new2 (10M) and 25old1 25new1 (25M, 1M).
set -e
cd "$(dirname "$0")/../../.."
: "${OLD_PS:?set OLD_PS to a dbs_ps built at 72d375d}"
out=bench/results/faults_s24
run() {  # NAME PS_BIN SIZES
  /usr/bin/python3 bench/dataplane.py --sizes="$3" --variants=fp32,bf16 --rounds=2 --no_gloo \
    --ps_bin="$2" --out_dir="$out/$1"
}
for i in 1 2; do
  run "old$i" "$OLD_PS" 10000000
  run "new$i" bazel-bin/server/dbs_ps 10000000
done
run 25old1 "$OLD_PS" 25000000,1000000
run 25new1 bazel-bin/server/dbs_ps 25000000,1000000
