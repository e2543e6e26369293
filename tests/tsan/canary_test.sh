#!/usr/bin/env bash
# Checks that the ThreadSanitizer build catches a race and sees Abseil's locks (tests/tsan).
# Only meaningful under --config=tsan, so it is tagged manual and deploy/run_sanitizers.sh
# names it; run elsewhere, the canary says it was not built with TSan and this test fails.
set -uo pipefail
canary="$TEST_SRCDIR/$TEST_WORKSPACE/tests/tsan/canary"
export TSAN_OPTIONS="halt_on_error=1:exitcode=66"
fail=0
expect() {  # expect <mode> <exit code> <pattern that must (or, with !, must not) appear>
  local mode=$1 want=$2 pattern=$3 out code
  out=$("$canary" "$mode" 2>&1); code=$?
  if [[ $code -ne $want ]]; then
    echo "FAIL: canary $mode exited $code, wanted $want"; echo "$out" | head -40; fail=1; return
  fi
  if [[ $pattern == !* ]]; then
    if grep -q -- "${pattern:1}" <<<"$out"; then
      echo "FAIL: canary $mode printed '${pattern:1}'"; echo "$out" | head -60; fail=1; return
    fi
  elif ! grep -q -- "$pattern" <<<"$out"; then
    echo "FAIL: canary $mode did not print '$pattern'"; echo "$out" | head -40; fail=1; return
  fi
  echo "ok: canary $mode (exit $code)"
}
expect race 66 "WARNING: ThreadSanitizer: data race"
expect other_mutex 66 "WARNING: ThreadSanitizer: data race"
expect mutex 0 "!ThreadSanitizer"
exit $fail
