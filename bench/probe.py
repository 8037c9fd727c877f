"""Builds one of kernel/probes/<name>.cu with the kernel's own nvcc flags and runs it: the shared
main of the probe benchmarks (python -m bench.wgmma_rate, bench.prefill_rate, bench.decode_rate,
bench.exact_rate) and of bench.step_columns and bench.exact_scale, bit-for-bit checks. Each probe prints one table; this needs a CUDA GPU and nvcc, both checked before
anything is compiled (a probe takes minutes to build, and without a GPU its table cannot come)."""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

from megamoe.jit.build import find_nvcc, probe_command

# Every kernel/probes/<name>.cu that `python -m bench.<name>` builds and runs with run_probe.
PROBES = ("wgmma_rate", "prefill_rate", "decode_rate", "exact_rate", "step_columns", "exact_scale")


def run_probe(name: str, doc: str | None = None, argv: list[str] | None = None) -> int:
    """The command `python -m bench.<name>` (doc: its --help text): 0 after its table, 2 without a
    GPU or nvcc (one line saying which), 1 when nvcc or the probe fails."""
    parser = argparse.ArgumentParser(
        prog=f"python -m bench.{name}", description=doc, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print(f"bench.{name}: needs a CUDA GPU, and torch sees none on this machine", file=sys.stderr)
        return 2
    nvcc = find_nvcc()
    if nvcc is None:
        print(f"bench.{name}: needs nvcc on the PATH (or $CUDA_HOME/bin)", file=sys.stderr)
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
