#!/usr/bin/env bash
# Set-up for a fresh machine: a virtual environment in .venv with megamoe installed editable.
#
# - A machine that already has torch (the H200 image) reuses it: the venv sees the system
#   site-packages, and nothing is downloaded.
# - A CPU-only machine without torch gets the CPU build torch==2.13.0 (on this workplace's
#   machines it lies on disk; elsewhere point PIP_INDEX_URL / PIP_EXTRA_INDEX_URL at a CPU
#   wheel index), never a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."

python3 -m venv --system-site-packages .venv
PY=.venv/bin/python
if ! "$PY" -c "import torch" 2>/dev/null; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    echo "[setup] GPU found and no torch: installing torch (CUDA build)"
    "$PY" -m pip install -q "torch>=2.9"
  else
    echo "[setup] no GPU and no torch: installing the CPU build torch==2.13.0"
    "$PY" -m pip install -q "torch==2.13.0"
  fi
fi
# setuptools >= 70.1 builds editable wheels by itself (the venv's bundled one may be older).
"$PY" -m pip install -q "setuptools>=70.1" 2>/dev/null || echo "[setup] could not update setuptools (offline?); using the installed one"
# --no-build-isolation: build with the setuptools already present, so an offline machine whose
# dependencies are all installed (the H200 image) needs no package index. The lint tools (extra
# "lint": ruff, clang-format, for ci/lint.sh) come from the index; without one, set-up goes on
# without them and ci/lint.sh says they are missing.
if ! "$PY" -m pip install -q --no-build-isolation -e ".[test,plots,lint]"; then
  echo "[setup] could not install the lint tools (offline?); installing without them"
  "$PY" -m pip install -q --no-build-isolation -e ".[test,plots]"
fi

# The venv sees the system's site-packages (to reuse a GPU image's torch), so pip takes a tool
# the system already has as installed and writes no script for it into .venv/bin: after
# `. .venv/bin/activate` a bare `pytest` would then be the system's, whose Python has no torch.
# So every command the README uses gets the venv's own script: the same version, installed into
# the venv itself (its dependencies stay the ones already visible).
own_script() {  # own_script COMMAND DISTRIBUTION
  [ -x ".venv/bin/$1" ] && return 0
  local version
  version=$("$PY" -c "import importlib.metadata as m, sys; print(m.version(sys.argv[1]))" "$2" 2>/dev/null) || return 0
  echo "[setup] $1 $version is the system's: installing it into the venv"
  if ! "$PY" -m pip install -q --ignore-installed --no-deps "$2==$version"; then
    echo "[setup] could not install $2 into the venv (offline?)"
    return 1
  fi
}
own_script megamoe megamoe
own_script ruff ruff || true
own_script clang-format clang-format || true
if ! own_script pytest pytest; then
  # Offline: a script that runs the venv's Python, which imports the visible pytest.
  printf '#!/bin/sh\nexec "$(dirname "$0")/python" -m pytest "$@"\n' > .venv/bin/pytest
  chmod +x .venv/bin/pytest
  echo "[setup] wrote .venv/bin/pytest (runs the venv's python -m pytest)"
fi
"$PY" -c "import torch, megamoe.reference; print('[setup] megamoe ready: torch', torch.__version__, '| CUDA GPU:', torch.cuda.is_available())"
