"""Builds one of kernel/probes/<name>.cu with the kernel's own nvcc flags and runs it: the shared
main of the probe benchmarks (python -m bench.wgmma_rate, python -m bench.prefill_rate). Each probe
prints one table; this needs nvcc and a CUDA GPU."""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from megamoe.jit.build import probe_command


def run_probe(name: str) -> int:
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        print(f"bench.{name}: needs nvcc on the PATH", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory() as tmp:
        exe = Path(tmp) / name
        build = subprocess.run(probe_command(name, exe, nvcc=nvcc), capture_output=True, text=True)
        if build.returncode:
            print(f"bench.{name}: nvcc failed:\n{build.stderr}", file=sys.stderr)
            return 1
        run = subprocess.run([str(exe)], capture_output=True, text=True)
        print(run.stdout, end="")
        if run.returncode:
            print(run.stderr, file=sys.stderr, end="")
        return run.returncode
