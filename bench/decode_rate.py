"""How fast k SMs decode a layer's FP4 weights to the prefill kernel's E4M3 tiles while the other
SMs leave HBM to them: builds kernel/probes/decode_rate.cu with the kernel's own nvcc flags and runs
it (one table; needs nvcc and a CUDA GPU).

    python -m bench.decode_rate

Rows: the predecode pass as launched today, then a persistent form on k SMs with D groups in flight
per warp. GB/s counts packed bytes, LUT offsets and the E4M3 bytes written. Reading: bench/NOTES.md
v17."""

from __future__ import annotations

import sys

from bench.probe import run_probe

if __name__ == "__main__":
    sys.exit(run_probe("decode_rate", __doc__))
