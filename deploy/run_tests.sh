#!/usr/bin/env bash
# README's second command: install dependencies, start a Docker engine for the container tests
# when none runs, and run the whole test suite (bazel test //...).
# Ends with a plain "N passed, N failed" line.
set -uo pipefail
cd "$(dirname "$0")/.."
bash deploy/install_deps.sh || exit 1
# The container tests (tests/compose_test.py) need a Docker engine: start one where none runs.
bash deploy/start_dockerd.sh
log=$(mktemp)
bazel test //... "$@" 2>&1 | tee "$log"
rc=${PIPESTATUS[0]}
passed=$(grep -cE '^//[^ ]+ +(\(cached\) )?PASSED' "$log")
failed=$(grep -cE '^//[^ ]+ +(\(cached\) )?(FAILED|TIMEOUT|NO STATUS|FLAKY)' "$log")
rm -f "$log"
if [ "$rc" -ne 0 ] && [ "$failed" -eq 0 ]; then failed=1; fi
# Tests that passed with checks skipped (a tool or a privilege this machine lacks), and why.
for f in $(grep -lsE "OK \(skipped=|\[  SKIPPED \]" bazel-testlogs/tests/*/test.log \
             bazel-testlogs/tests/*/*/test.log); do
  name=${f#bazel-testlogs/}
  echo "tests: //${name%/test.log} skipped checks: $(grep -hoE "skipped '[^']*'|\[  SKIPPED \] \S+" "$f" |
    sort | uniq -c | sed 's/^ *//' | tr '\n' ';')"
done
echo "tests: ${passed} passed, ${failed} failed"
exit "$rc"
