"""Regenerate the SiLU tables on a GPU: build kernel/probes/silu_tables.cu with the kernel's own
nvcc flags and run it.

    python -m megamoe.silu_probe OUT_DIR      writes OUT_DIR/silu_fast.bin and silu_precise.bin
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from megamoe.jit.build import probe_command
from megamoe.reference.silu_tables import TABLE_FILES


def generate(out_dir: str | Path, nvcc: str = "nvcc") -> dict[bool, Path]:
    """Compile and run the probe; returns {fast_math: path}."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        exe = Path(tmp) / "silu_tables"
        build = subprocess.run(probe_command("silu_tables", exe, nvcc=nvcc), capture_output=True, text=True)
        if build.returncode:
            raise RuntimeError(f"nvcc failed to build the SiLU probe:\n{build.stderr}")
        paths = {fast: out_dir / name for fast, name in TABLE_FILES.items()}
        run = subprocess.run([str(exe), str(paths[True]), str(paths[False])], capture_output=True, text=True)
        if run.returncode:
            raise RuntimeError(f"the SiLU probe failed:\n{run.stdout}{run.stderr}")
    return paths


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python -m megamoe.silu_probe OUT_DIR", file=sys.stderr)
        return 2
    # The probe is built with nvcc and runs on the GPU: say so in one line instead of a traceback.
    if shutil.which("nvcc") is None:
        print("megamoe.silu_probe: needs nvcc and a CUDA GPU; no nvcc on the PATH", file=sys.stderr)
        return 2
    import torch

    if not torch.cuda.is_available():
        print("megamoe.silu_probe: needs a CUDA GPU; torch sees none on this machine", file=sys.stderr)
        return 2
    for fast, path in generate(argv[0]).items():
        print(f"{'fast' if fast else 'precise'}: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
