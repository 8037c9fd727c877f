"""How fast k SMs decode a layer's FP4 weights to the prefill kernel's E4M3 tiles while the other
SMs leave HBM to them: builds kernel/probes/decode_rate.cu with the kernel's own nvcc flags and runs
it (one table; needs nvcc and a CUDA GPU).

    python -m bench.decode_rate

Rows: the predecode pass as launched today, then a persistent form on k SMs with D groups in flight
per warp (GB/s: packed bytes, LUT offsets and the E4M3 bytes written), then "to smem", the persistent
form on every SM without writing the tiles out (GB/s: the bytes read; a decode-rate bound for decoder
warps that feed shared-memory wgmma operands). Reading: bench/NOTES.md v17, v41."""

from __future__ import annotations

import sys

from bench.probe import run_probe

if __name__ == "__main__":
    sys.exit(run_probe("decode_rate", __doc__))
