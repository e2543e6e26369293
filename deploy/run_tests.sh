#!/usr/bin/env bash
# README's second command: install dependencies and run the whole test suite (bazel test //...).
# Ends with a plain "N passed, N failed" line.
set -uo pipefail
cd "$(dirname "$0")/.."
bash deploy/install_deps.sh || exit 1
log=$(mktemp)
bazel test //... "$@" 2>&1 | tee "$log"
rc=${PIPESTATUS[0]}
passed=$(grep -cE '^//[^ ]+ +(\(cached\) )?PASSED' "$log")
failed=$(grep -cE '^//[^ ]+ +(\(cached\) )?(FAILED|TIMEOUT|NO STATUS|FLAKY)' "$log")
rm -f "$log"
if [ "$rc" -ne 0 ] && [ "$failed" -eq 0 ]; then failed=1; fi
echo "tests: ${passed} passed, ${failed} failed"
exit "$rc"
