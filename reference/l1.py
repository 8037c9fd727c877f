"""Stage "L1" (D5): the gate/up GEMM over the pool, fp32 accumulators in canonical channel order."""

from __future__ import annotations

import torch

from .dispatch import Pool, check_pool
from .errors import check_type
from .gemm import check_weight_operand, grouped_gemm
from .weights import ExpertWeights


def l1_gemm(pool: Pool, weights: ExpertWeights, valid: torch.Tensor | None = None) -> torch.Tensor:
    """D5: acc1 fp32 [P, 2I] (gate channels [0, I), up channels [I, 2I)); padding rows are 0."""
    check_pool(pool)
    check_type("weights", weights, ExpertWeights)
    experts = pool.expert_offsets.numel() - 1  # E_l
    check_weight_operand(("weights.w1", "weights.w1_sf"), weights.w1, weights.w1_sf, pool.x.shape[1], experts, None)
    valid = pool.valid if valid is None else valid
    return grouped_gemm(pool.x, pool.x_sf, pool.expert_offsets, weights.w1, weights.w1_sf, valid=valid)
