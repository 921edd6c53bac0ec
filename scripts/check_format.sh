#!/usr/bin/env bash
# Fails when clang-format (.clang-format at the root) would change any C++ file of the project;
# prints the files and how to fix them. Run by scripts/test.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
CF=$(command -v clang-format-14 || command -v clang-format)
mapfile -t files < <(git ls-files '*.cc' '*.h' | grep -v '^src/commands/command_table.inc$')
bad=()
for f in "${files[@]}"; do
  if ! "$CF" --dry-run --Werror "$f" >/dev/null 2>&1; then bad+=("$f"); fi
done
if [ ${#bad[@]} -gt 0 ]; then
  echo "not formatted (fix with: $CF -i FILE):"
  printf '  %s\n' "${bad[@]}"
  exit 1
fi
echo "format: ${#files[@]} files clean"
