"""What a non-swapped prefill kernel would reach on this GPU: builds kernel/probes/prefill_rate.cu
with the kernel's own nvcc flags and runs it (one table; needs nvcc and a CUDA GPU).

    python -m bench.prefill_rate

Tokens as the wgmma M dimension (activations the shared-memory A operand, 128 tokens per CTA),
weight rows as N, the FP4 weights decoded to E4M3 into shared memory (the B operand) by the
consumer warps, by three producer warps, or by seven warps (a decode warpgroup of its own), or
predecoded ("before": the E4M3 tile arrives by bulk copy, the prefill path's form), one
FFMA per accumulator with two token scales per thread and K block; the steady state of a long K
loop, one CTA per SM, the stages filled by bulk copies from L2-resident buffers. Rows: tile rows
(128 or 256 weight rows), decoder (or "-": not decoded, a plain FP8 GEMM's traffic), promotion.
MAC/clk/SM is per SM clock (clock64), against the dense FP8 peak of 4096. Results and reading:
bench/NOTES.md v14 (and v15: the prefill path built on the predecoded form)."""

from __future__ import annotations

import sys

from bench.probe import run_probe

if __name__ == "__main__":
    sys.exit(run_probe("prefill_rate", __doc__))
