"""Whether the tensor core's k32 sums keep their bits when the weights' values are scaled by 2^-6,
as the exact mode's E4M3 words decode them (bench/NOTES.md v65): builds kernel/probes/exact_scale.cu
with the kernel's own nvcc flags and runs it (one table; needs nvcc and a CUDA GPU).

    python -m bench.exact_scale

Each row is a kind of activation operand; each comparison is one m64n8k32 sum of the E4M3 words'
bytes, times 2^6, against the table decode's bytes of the same FP4 codes, bit for bit. Exit status 1
when any differs other than in a NaN's payload or a zero's sign."""

from __future__ import annotations

import sys

from bench.probe import run_probe

if __name__ == "__main__":
    sys.exit(run_probe("exact_scale", __doc__))
