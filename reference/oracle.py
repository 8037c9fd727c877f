"""The float64 oracle: the same layer on the dequantized inputs with no intermediate rounding
(no bf16 of the accumulators, exact SiLU, no FP8 requantization, fp64 sums), and calc_diff.

It is laid out on the reference pool so that every stage can be compared row for row.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .combine import check_combine_args
from .config import MoEConfig
from .dispatch import build_pool
from .errors import FLOATING, check_tensor
from .gemm import block_scaled_gemm_f64, grouped_gemm
from .inputs import RankInputs
from .quantize import dequantize_fp4
from .swiglu import bias_rows, check_swiglu_args
from .validate import check_call
from .weights import ExpertWeights


@dataclass
class OracleRank:
    acc1: torch.Tensor  # fp64 [P, 2I]
    activation: torch.Tensor  # fp64 [P, I]
    acc2: torch.Tensor  # fp64 [P, H]
    y: torch.Tensor  # fp64 [T, H]
    valid: torch.Tensor  # bool [P]


def run_oracle(cfg: MoEConfig, inputs: list[RankInputs], weights: ExpertWeights) -> list[OracleRank]:
    """The float64 oracle of one call, every rank's stages on the reference pool."""
    check_call(cfg, inputs, weights)
    e_l = cfg.local_experts
    device = inputs[0].x.device
    ys = [torch.zeros(inp.num_tokens, cfg.hidden, dtype=torch.float64, device=device) for inp in inputs]
    ranks = []
    for rank in range(cfg.num_ranks):
        local = weights.slice(rank * e_l, (rank + 1) * e_l)
        pool = build_pool(inputs, rank, cfg)
        acc1 = grouped_gemm(
            pool.x, pool.x_sf, pool.expert_offsets, local.w1, local.w1_sf, valid=pool.valid, fn=block_scaled_gemm_f64
        )
        b1 = None if local.b1 is None else bias_rows(local.b1, pool.expert_offsets, pool.num_rows)
        act = swiglu_f64(acc1, pool.weights, pool.valid, cfg.activation_clamp, cfg=cfg, b1=b1)
        acc2 = torch.zeros(pool.num_rows, cfg.hidden, dtype=torch.float64, device=device)
        w2 = dequantize_fp4(local.w2, local.w2_sf)
        for le in range(e_l):
            rows = pool.expert_rows(le)
            acc2[rows] = act[rows] @ w2[le].T
        meta = pool.meta.long()
        valid = pool.valid
        out = acc2  # what each row adds to its token's y: with b2 (SPEC §8 D8) w · b2 more
        if local.b2 is not None:
            b2 = bias_rows(local.b2, pool.expert_offsets, pool.num_rows).to(torch.float64)
            out = acc2 + pool.weights.to(torch.float64)[:, None] * b2
        for s in range(cfg.num_ranks):
            sel = valid & (meta[:, 0] == s)
            ys[s].index_add_(0, meta[sel, 1], out[sel])
        ranks.append(OracleRank(acc1, act, acc2, None, valid))
    for rank, y in zip(ranks, ys):
        rank.y = y
    return ranks


def swiglu_f64(
    acc1: torch.Tensor,
    route_weights: torch.Tensor,
    valid: torch.Tensor,
    activation_clamp: float | None,
    *,
    cfg: MoEConfig | None = None,
    b1: torch.Tensor | None = None,
) -> torch.Tensor:
    """silu(g) · u · w in float64 with exact sigmoid and no rounding of g or u; padding rows 0.
    A "swiglu_oai" layer `cfg` (SPEC §8): g · sigmoid(alpha g) · (u + 1) · w, g and u with their
    biases b1 (each pool row's, [P, 2I]) and clamped to the layer's limit."""
    check_swiglu_args(acc1, route_weights, activation_clamp, FLOATING)
    check_tensor("valid", valid, torch.bool, (acc1.shape[0],), acc1.device)
    acc1 = acc1.to(torch.float64)
    i = acc1.shape[1] // 2
    g, u = acc1[:, :i], acc1[:, i:]
    w = route_weights.to(torch.float64)[:, None]
    oai = cfg is not None and cfg.activation == "swiglu_oai"
    if oai and b1 is not None:
        check_tensor("b1", b1, torch.bfloat16, tuple(acc1.shape), acc1.device)
        bias = b1.to(torch.float64)
        g, u = g + bias[:, :i], u + bias[:, i:]
    bound = cfg.limit if oai else activation_clamp
    if bound is not None:
        g, u = g.clamp(max=float(bound)), u.clamp(-float(bound), float(bound))
    if oai:
        act = g * torch.sigmoid(cfg.alpha * g) * (u + 1.0) * w
    else:
        act = g * torch.sigmoid(g) * u * w
    return torch.where(valid[:, None], act, torch.zeros_like(act))


def combine_f64(combine_buffer: torch.Tensor, topk_idx: torch.Tensor) -> torch.Tensor:
    """The exact sum of a token's valid combine slots, float64 [T, H]."""
    check_combine_args(combine_buffer, topk_idx)
    t = topk_idx.shape[0]
    vals = combine_buffer[:, :t].to(torch.float64)
    mask = (topk_idx.T >= 0)[:, :, None]
    return torch.where(mask, vals, torch.zeros_like(vals)).sum(dim=0)


def calc_diff(x: torch.Tensor, y: torch.Tensor) -> float:
    """1 - 2Σxy / Σ(x² + y²) in float64 (0 when both are all zero); DeepGEMM's similarity."""
    check_tensor("x", x)
    check_tensor("y", y, shape=tuple(x.shape), device=x.device)  # no broadcast: one value per element
    x, y = x.to(torch.float64), y.to(torch.float64)
    denom = (x * x + y * y).sum()
    if denom == 0:
        return 0.0
    return float(1 - 2 * (x * y).sum() / denom)
