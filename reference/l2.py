"""Stage "L2" (D7, D8): the down-projection GEMM and its bf16 epilogue into the combine buffers."""

from __future__ import annotations

import torch

from .dispatch import Pool
from .gemm import grouped_gemm
from .weights import ExpertWeights
from . import formats as F


def l2_gemm(
    l2_acts: torch.Tensor, l2_sf: torch.Tensor, pool: Pool, weights: ExpertWeights, valid: torch.Tensor | None = None
) -> torch.Tensor:
    """D7: acc2 fp32 [P, H]; padding rows are 0."""
    valid = pool.valid if valid is None else valid
    return grouped_gemm(l2_acts, l2_sf, pool.expert_offsets, weights.w2, weights.w2_sf, valid=valid)


def empty_combine_buffer(top_k: int, max_tokens: int, hidden: int, device="cpu") -> torch.Tensor:
    """A source rank's combine buffer [K, T_max, H] bf16, poisoned with NaN: slots no expert
    writes (-1 slots, rows >= T) stay NaN, so reading one is visible downstream."""
    return torch.full((top_k, max_tokens, hidden), float("nan"), dtype=torch.bfloat16, device=device)


def l2_epilogue(
    acc2: torch.Tensor, meta: torch.Tensor, valid: torch.Tensor, combine_buffers: list[torch.Tensor]
) -> None:
    """D8: write bf16(acc2) (RNE) of every valid pool row to combine_s[k][t] of its source rank s."""
    out = F.bf16_tensor(F.encode_bf16(acc2))
    for s, buf in enumerate(combine_buffers):
        rows = (valid & (meta[:, 0] == s)).nonzero(as_tuple=True)[0]
        if rows.numel():
            buf[meta[rows, 2].long(), meta[rows, 1].long()] = out[rows]
