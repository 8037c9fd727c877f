"""Regenerate the activation tables on a GPU: build kernel/probes/silu_tables.cu with the kernel's
own nvcc flags and run it.

    python -m megamoe.silu_probe OUT_DIR      writes OUT_DIR/silu_fast.bin, silu_precise.bin,
                                              glu_oai_fast.bin and glu_oai_precise.bin
"""

from __future__ import annotations

import shutil
import struct
import subprocess
import sys
import tempfile
from pathlib import Path

from megamoe.jit.build import probe_command
from megamoe.reference.config import GPT_OSS_ALPHA
from megamoe.reference.silu_tables import GLU_TABLE_FILES, TABLE_FILES


def alpha_bits(alpha: float = GPT_OSS_ALPHA) -> str:
    """fp32(alpha)'s bits in hex, as the probe takes them (SPEC §8: alpha rounded to fp32, RNE)."""
    return f"{struct.unpack('<I', struct.pack('<f', alpha))[0]:08x}"


def generate(out_dir: str | Path, nvcc: str = "nvcc") -> dict[str, dict[bool, Path]]:
    """Compile and run the probe; returns {"silu" | "glu_oai": {fast_math: path}}."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {
        "silu": {fast: out_dir / name for fast, name in TABLE_FILES.items()},
        "glu_oai": {fast: out_dir / name for fast, name in GLU_TABLE_FILES.items()},
    }
    with tempfile.TemporaryDirectory() as tmp:
        exe = Path(tmp) / "silu_tables"
        build = subprocess.run(probe_command("silu_tables", exe, nvcc=nvcc), capture_output=True, text=True)
        if build.returncode:
            raise RuntimeError(f"nvcc failed to build the activation tables' probe:\n{build.stderr}")
        args = [
            paths["silu"][True],
            paths["silu"][False],
            alpha_bits(),
            paths["glu_oai"][True],
            paths["glu_oai"][False],
        ]
        run = subprocess.run([str(exe), *map(str, args)], capture_output=True, text=True)
        if run.returncode:
            raise RuntimeError(f"the activation tables' probe failed:\n{run.stdout}{run.stderr}")
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
    for kind, tables in generate(argv[0]).items():
        for fast, path in tables.items():
            print(f"{kind} {'fast' if fast else 'precise'}: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
