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
# dependencies are all installed (the H200 image) needs no package index.
"$PY" -m pip install -q --no-build-isolation -e ".[test,plots]"
"$PY" -c "import torch, megamoe.reference; print('[setup] megamoe ready: torch', torch.__version__, '| CUDA GPU:', torch.cuda.is_available())"
