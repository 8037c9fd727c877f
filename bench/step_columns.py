"""Whether the narrow engine could take a K block's four k32 products from one accumulating group of
four wgmmas over step-major token columns (bench/NOTES.md v50): builds kernel/probes/step_columns.cu
with the kernel's own nvcc flags and runs it (one table; needs nvcc and a CUDA GPU).

    python -m bench.step_columns

B's 8 columns are (k32 step s, token j) of two tokens, each holding its token's activations in its
own step's K range and zeros in the other three (K-major tiles without swizzle). Each row is a kind
of operand; each comparison is one product of the accumulating group against today's form (four
wgmmas, each overwriting an accumulator with one step's products over the 128-byte swizzled token
tile), bit for bit. Exit status 1 when any differs other than in a NaN's payload or a zero's sign."""

from __future__ import annotations

import sys

from bench.probe import run_probe

if __name__ == "__main__":
    sys.exit(run_probe("step_columns", __doc__))
