#!/usr/bin/env bash
# The test suite under AddressSanitizer + UndefinedBehaviorSanitizer (all of it), then under
# ThreadSanitizer (the domain and adapter tests: the ones with threads of our own, no libtorch).
set -uo pipefail
cd "$(dirname "$0")/.."
status=0
bazel test --config=asan //... || status=1
bazel test --config=tsan \
  //tests:hardening_test //tests:training_job_test //tests:scheduler_test \
  //tests:step_aggregator_test //tests:liveness_monitor_test //tests:parameter_service_test \
  //tests:ps_server_test //tests:training_loop_test //tests:files_test || status=1
exit $status
