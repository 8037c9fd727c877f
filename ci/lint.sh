#!/usr/bin/env bash
# Lint and format check of the whole tree, as CI runs it (.ci/run, after ci/setup.sh):
#   ruff check           Python lint (rules: [tool.ruff.lint] in pyproject.toml)
#   ruff format --check  Python formatting (line length 120)
#   clang-format         CUDA / C++ formatting (.clang-format), every tracked *.cu *.cuh *.h *.hpp *.cpp *.cc
# Nothing is skipped. Exit 0 when all is clean, 1 on a finding, 2 when a tool is missing.
#   bash ci/lint.sh --fix    rewrites the files instead (ruff check --fix, ruff format, clang-format -i)
set -uo pipefail
cd "$(dirname "$0")/.."

tool() {  # the venv's pinned tool (ci/setup.sh installs it), else one on the PATH
  if [ -x ".venv/bin/$1" ]; then echo ".venv/bin/$1"
  elif command -v "$1" >/dev/null 2>&1; then command -v "$1"
  else echo "[lint] $1 not found: run bash ci/setup.sh (pip package $1)" >&2; exit 2
  fi
}
RUFF=$(tool ruff) || exit 2
CLANG_FORMAT=$(tool clang-format) || exit 2

# The C++ sources git knows of (tracked, or new and not ignored), so build folders never count.
# *.cu.in is a template with @FIELD@ placeholders, not C++: clang-format would split them.
if git rev-parse --is-inside-work-tree >/dev/null 2>&1; then
  mapfile -t CXX < <(git ls-files --cached --others --exclude-standard -- \
    '*.cu' '*.cuh' '*.h' '*.hpp' '*.cpp' '*.cc' | sort -u)
else
  mapfile -t CXX < <(find . -path ./.venv -prune -o -type f \
    \( -name '*.cu' -o -name '*.cuh' -o -name '*.h' -o -name '*.hpp' -o -name '*.cpp' -o -name '*.cc' \) -print | sort)
fi

status=0
if [ "${1:-}" = "--fix" ]; then
  "$RUFF" check --fix . || status=1
  "$RUFF" format . || status=1
  [ ${#CXX[@]} -eq 0 ] || "$CLANG_FORMAT" -i "${CXX[@]}" || status=1
  exit $status
fi
echo "[lint] ruff check"
"$RUFF" check . || status=1
echo "[lint] ruff format --check"
"$RUFF" format --check . || status=1
echo "[lint] clang-format --dry-run -Werror (${#CXX[@]} files)"
[ ${#CXX[@]} -eq 0 ] || "$CLANG_FORMAT" --dry-run -Werror "${CXX[@]}" || status=1
if [ $status -eq 0 ]; then echo "[lint] clean"; else echo "[lint] FAILED: bash ci/lint.sh --fix rewrites the files" >&2; fi
exit $status
