"""The 65 536-entry activation tables: SiLU (SPEC §3 D6 step 3) and gpt-oss's glu factor (§8 D6
step 3), each in a fast and a precise form.

Entry i is what the kernel's device function (kernel/epilogue/silu.cuh: `megamoe::silu<fast>`,
`megamoe::glu_oai<fast>` at alpha = GPT_OSS_ALPHA) returns for the bf16 bit pattern i. They are
generated on an H200 by kernel/probes/silu_tables.cu (`python -m megamoe.silu_probe` regenerates
them) and ship as package data, which is what makes the CPU reference bit-exact although
ex2.approx, rcp.approx and expf are not reproducible on a CPU.
"""

from __future__ import annotations

from functools import lru_cache
from importlib import resources

import torch

from .errors import check_bool

TABLE_FILES = {True: "silu_fast.bin", False: "silu_precise.bin"}
GLU_TABLE_FILES = {True: "glu_oai_fast.bin", False: "glu_oai_precise.bin"}
TABLE_SIZE = 65536


@lru_cache(maxsize=None)
def _load(name: str) -> torch.Tensor:
    path = resources.files("megamoe.reference").joinpath("tables", name)
    if not path.is_file():  # an OSError: a command-line tool prints it as its one line
        raise FileNotFoundError(
            f"the activation table {name} is not in this installation (reference/tables/): it is made on a "
            "GPU from the kernel's device function, `python -m megamoe.silu_probe reference/tables`"
        )
    data = path.read_bytes()
    if len(data) != TABLE_SIZE * 4:
        raise RuntimeError(f"activation table {name} has {len(data)} bytes, expected {TABLE_SIZE * 4}")
    return torch.frombuffer(bytearray(data), dtype=torch.int32).view(torch.float32).clone()


def silu_table(fast_math: bool, device="cpu") -> torch.Tensor:
    """fp32 [65536]: silu of every bf16 bit pattern, as the kernel computes it."""
    check_bool("fast_math", fast_math)
    return _load(TABLE_FILES[fast_math]).to(device)


def glu_table(fast_math: bool, device="cpu") -> torch.Tensor:
    """fp32 [65536]: gpt-oss's glu factor g * sigmoid(alpha g) of every bf16 bit pattern g, as the
    kernel computes it (SPEC §8 D6 step 3, alpha = GPT_OSS_ALPHA)."""
    check_bool("fast_math", fast_math)
    return _load(GLU_TABLE_FILES[fast_math]).to(device)


def silu_from_bf16_bits(bits: torch.Tensor, fast_math: bool) -> torch.Tensor:
    """fp32 silu of bf16 values given by their bit patterns."""
    return silu_table(fast_math, bits.device)[bits.to(torch.int64) & 0xFFFF]


def glu_from_bf16_bits(bits: torch.Tensor, fast_math: bool) -> torch.Tensor:
    """fp32 glu factor of bf16 values given by their bit patterns."""
    return glu_table(fast_math, bits.device)[bits.to(torch.int64) & 0xFFFF]
