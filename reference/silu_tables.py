"""The 65 536-entry SiLU tables of SPEC §3 D6 step 3.

Entry i is what the kernel's device function `megamoe::silu<fast>` (kernel/epilogue/silu.cuh)
returns for the bf16 bit pattern i. They were generated on an H200 by kernel/probes/silu_tables.cu
(`python -m megamoe.silu_probe` regenerates them) and ship as package data, which is what makes
the CPU reference bit-exact although ex2.approx, rcp.approx and expf are not reproducible on a CPU.
"""

from __future__ import annotations

from functools import lru_cache
from importlib import resources

import torch

from .errors import check_bool

TABLE_FILES = {True: "silu_fast.bin", False: "silu_precise.bin"}
TABLE_SIZE = 65536


@lru_cache(maxsize=None)
def _load(fast_math: bool) -> torch.Tensor:
    data = resources.files("megamoe.reference").joinpath("tables", TABLE_FILES[fast_math]).read_bytes()
    if len(data) != TABLE_SIZE * 4:
        raise RuntimeError(f"SiLU table {TABLE_FILES[fast_math]} has {len(data)} bytes, expected {TABLE_SIZE * 4}")
    return torch.frombuffer(bytearray(data), dtype=torch.int32).view(torch.float32).clone()


def silu_table(fast_math: bool, device="cpu") -> torch.Tensor:
    """fp32 [65536]: silu of every bf16 bit pattern, as the kernel computes it."""
    check_bool("fast_math", fast_math)
    return _load(fast_math).to(device)


def silu_from_bf16_bits(bits: torch.Tensor, fast_math: bool) -> torch.Tensor:
    """fp32 silu of bf16 values given by their bit patterns."""
    return silu_table(fast_math, bits.device)[bits.to(torch.int64) & 0xFFFF]
