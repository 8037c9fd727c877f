"""The tensor-core rate each wgmma form reaches on this GPU: builds kernel/probes/wgmma_rate.cu with
the kernel's own nvcc flags and runs it (one table; needs nvcc and a CUDA GPU).

    python -m bench.wgmma_rate

Rows: RS (A from registers: the GEMM core's form, its FP4 weights decoded into registers) or SS
(both operands in shared memory: a plain FP8 GEMM's form), wgmma width N, consumer warpgroups,
each issuing K128 groups of four wgmmas and waiting for each (the wide tile's serial schedule),
and whether each group's products are promoted with one FFMA per accumulator (the fast mode's
promotion). MAC/clk/SM is per SM clock (clock64), against the dense FP8 peak of 4096."""

from __future__ import annotations

import sys

from bench.probe import run_probe

if __name__ == "__main__":
    sys.exit(run_probe("wgmma_rate", __doc__))
