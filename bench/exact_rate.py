"""What the exact mode's prefill loop could reach in other shapes on this GPU: builds
kernel/probes/exact_rate.cu with the kernel's own nvcc flags and runs it (one table; needs nvcc and
a CUDA GPU).

    python -m bench.exact_rate

The prefill engine's orientation (tokens as wgmma M, 64 a consumer warpgroup; the predecoded E4M3
weight tile as the shared-memory B operand, brought by bulk copy), each k32 product promoted on
its own with one FFMA per accumulator, in items of 23 K blocks (gpt-oss's K); the steady state,
one CTA per SM, stages from L2-resident buffers. Rows: M (tokens of the CTA tile: 64 per consumer
warpgroup), rows (weight rows of the tile), N (rows of one wgmma), depth (temporaries: groups
issued ahead of the one promoted, plus one), promote (k32; wait-only: each group waited for, an
eighth of its FFMAs; k128: the fast mode's four wgmmas a promotion), busy (producer warps running an
L1-epilogue-like loop beside the consumers, as the fused kernel's two epilogue warps do). MAC/clk/SM
is per SM clock (clock64), against the dense FP8 peak of 4096."""

from __future__ import annotations

import sys

from bench.probe import run_probe

if __name__ == "__main__":
    sys.exit(run_probe("exact_rate", __doc__))
