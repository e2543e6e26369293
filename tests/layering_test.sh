#!/usr/bin/env bash
# Each argument is a `bazel query somepath(...)` result (tests/BUILD, genquery): a dependency path
# the design forbids. The test fails, printing the path, when any of them is not empty.
status=0
for f in "$@"; do
  if [[ -s $f ]]; then
    echo "layering_test: a forbidden dependency path ($(basename "$f")):" >&2
    sed 's/^/  /' "$f" >&2
    status=1
  else
    echo "layering_test: $(basename "$f"): no path"
  fi
done
exit $status
