#!/usr/bin/env bash
# The test suite under the sanitizers, as CI runs it:
#   1. the whole suite under AddressSanitizer + UndefinedBehaviorSanitizer (--config=asan), but
#      for the tests that run the same binaries through other tools rather than new code paths:
#      the benchmark harness's small run (bench_small_test: four more minutes of the binaries
#      cluster_test drives, and dataplane_client, which only benchmarks use), the container
#      test (compose_test: its image builds the binaries its own way), the deployment files'
#      checks, the exported models read back in Python, the data formats' jobs and the
#      Prometheus and Chromium checks (deploy_test, torchscript_test, data_formats_test,
#      observability_test: their readers and exports are under ASan in dataset_test and
#      exactness_test, their jobs in cluster_test; faulty_worker_test: its screen and quarantine
#      are under ASan in step_aggregator_test and hardening_test; python_worker_test: the Python
#      workers' calls are the C++ worker's calls, under ASan in cluster_test); and with
#      simulation_test's property tests on their first 60 random clusters instead of 300 (the
#      same code paths at a fifth of the time), and burst_test's on 10 instead of 50; cluster_test
#      skips its cases that judge the share policy's decisions (policy_outcome); only the tests
#      and what they need are built;
#   2. the domain and adapter tests (every C++ test that does not need libtorch) under
#      ThreadSanitizer (--config=tsan), with tests/tsan's canary first: it proves the build
#      reports a real race and sees Debian's uninstrumented Abseil locks (docs/security.md).
#      simulation_test and burst_test are left out: they run on one thread and take minutes
#      under TSan.
set -uo pipefail
cd "$(dirname "$0")/.."
status=0
bazel test --config=asan --build_tests_only --test_env=SIMULATION_TEST_CLUSTERS=60 \
  --test_env=BURST_TEST_CLUSTERS=10 -- //... \
  -//tests:bench_small_test -//tests:compose_test -//tests:deploy_test -//tests:torchscript_test \
  -//tests:data_formats_test -//tests:observability_test -//tests:faulty_worker_test \
  -//tests:python_worker_test || status=1
tsan_tests=$(bazel query 'kind(cc_test, //tests:*) except rdeps(//tests:*, @system//:torch)
                          except //tests:simulation_test except //tests:burst_test' 2>/dev/null)
if [[ -z $tsan_tests ]]; then
  echo "run_sanitizers: bazel query found no tests for ThreadSanitizer" >&2
  exit 1
fi
bazel test --config=tsan //tests/tsan:canary_test $tsan_tests || status=1
exit $status
