#!/usr/bin/env bash
# Every C++ file follows .clang-format (Google style, 100 columns), and no source file of the
# product (server/, worker/, common/) is over 600 lines. Fix the format with:
#   clang-format -i $(git ls-files '*.cc' '*.h')
set -euo pipefail
if ! command -v clang-format >/dev/null; then
  echo "format_test: clang-format is missing; deploy/install_deps.sh installs it" >&2
  exit 1
fi
files=$(find -L common server worker bench tests -name '*.cc' -o -name '*.h' | sort)
count=$(echo "$files" | wc -l)
if [ "$count" -lt 40 ]; then
  echo "format_test: found only $count C++ files; the data dependencies are wrong" >&2
  exit 1
fi
# shellcheck disable=SC2086
clang-format --style=file --dry-run --Werror $files
# shellcheck disable=SC2086
long=$(wc -l $(echo "$files" | grep -E '^(common|server|worker)/') | awk '$2 != "total" && $1 > 600')
if [ -n "$long" ]; then
  echo "format_test: over 600 lines (split them by what they do):" >&2
  echo "$long" >&2
  exit 1
fi
echo "format_test: $count files formatted, none of the product's over 600 lines"
