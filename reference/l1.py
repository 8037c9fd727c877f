"""Stage "L1" (D5): the gate/up GEMM over the pool, fp32 accumulators in canonical channel order."""

from __future__ import annotations

import torch

from .dispatch import Pool
from .gemm import grouped_gemm
from .weights import ExpertWeights


def l1_gemm(pool: Pool, weights: ExpertWeights, valid: torch.Tensor | None = None) -> torch.Tensor:
    """D5: acc1 fp32 [P, 2I] (gate channels [0, I), up channels [I, 2I)); padding rows are 0."""
    valid = pool.valid if valid is None else valid
    return grouped_gemm(pool.x, pool.x_sf, pool.expert_offsets, weights.w1, weights.w1_sf, valid=valid)
