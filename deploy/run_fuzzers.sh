#!/usr/bin/env bash
# Builds the libFuzzer targets with clang (--config=fuzz, which also checks the thread-safety
# annotations) and runs each for a bounded time from its seed corpus in
# tests/fuzz/corpus/<name>/ (new inputs go to a scratch copy, not the repo).
# Usage: deploy/run_fuzzers.sh [seconds per target, default 60]
set -euo pipefail
cd "$(dirname "$0")/.."
seconds=${1:-60}
targets=(tensor_decoder step_wire plan_codec checkpoint call_sequence)
# With the gRPC adapters of the server and the worker: clang checks every thread-safety
# annotation in this configuration (.bazelrc).
bazel build --config=fuzz $(printf '//tests/fuzz:%s_fuzzer ' "${targets[@]}") \
  //server:ps_server //worker:grpc_ps_client
bin=$(bazel info --config=fuzz bazel-bin 2>/dev/null)
scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT
status=0
for t in "${targets[@]}"; do
  mkdir -p "$scratch/$t"
  cp tests/fuzz/corpus/$t/* "$scratch/$t/"
  seeds=$(ls tests/fuzz/corpus/$t | wc -l)
  echo "fuzz: $t for ${seconds}s from $seeds seeds"
  if ! ASAN_OPTIONS=detect_leaks=0 "$bin/tests/fuzz/${t}_fuzzer" -max_total_time="$seconds" \
      -rss_limit_mb=2048 -max_len=4096 -print_final_stats=1 -artifact_prefix="$scratch/$t-" \
      "$scratch/$t" > "$scratch/$t.log" 2>&1; then
    echo "fuzz: $t FAILED; the input that failed:"; ls "$scratch"/$t-* 2>/dev/null || true
    tail -40 "$scratch/$t.log"
    status=1
  fi
  grep -E "stat::number_of_executed_units|stat::peak_rss_mb" "$scratch/$t.log" | tr '\n' ' '
  echo "corpus now $(ls "$scratch/$t" | wc -l) inputs"
done
exit $status
