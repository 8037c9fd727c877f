"""Stage "L2" (D7, D8): the down-projection GEMM and its bf16 epilogue into the combine buffers."""

from __future__ import annotations

import torch

from .dispatch import Pool, check_pool
from .errors import check_int, check_list, check_tensor, check_type, fail
from .gemm import check_weight_operand, grouped_gemm
from .weights import ExpertWeights
from . import formats as F


def l2_gemm(
    l2_acts: torch.Tensor, l2_sf: torch.Tensor, pool: Pool, weights: ExpertWeights, valid: torch.Tensor | None = None
) -> torch.Tensor:
    """D7: acc2 fp32 [P, H]; padding rows are 0."""
    check_pool(pool)
    check_type("weights", weights, ExpertWeights)
    acts = F.as_codes(l2_acts, "l2_acts")
    check_tensor("l2_acts", acts, shape=(pool.num_rows, None))  # the pool's rows; l2_sf: grouped_gemm's
    experts = pool.expert_offsets.numel() - 1  # E_l
    check_weight_operand(("weights.w2", "weights.w2_sf"), weights.w2, weights.w2_sf, acts.shape[1], experts, None)
    valid = pool.valid if valid is None else valid
    return grouped_gemm(l2_acts, l2_sf, pool.expert_offsets, weights.w2, weights.w2_sf, valid=valid)


def empty_combine_buffer(top_k: int, max_tokens: int, hidden: int, device="cpu") -> torch.Tensor:
    """A source rank's combine buffer [K, T_max, H] bf16, poisoned with NaN: slots no expert
    writes (-1 slots, rows >= T) stay NaN, so reading one is visible downstream."""
    check_int("top_k", top_k, 1)
    check_int("max_tokens", max_tokens, 0)
    check_int("hidden", hidden, 1)
    return torch.full((top_k, max_tokens, hidden), float("nan"), dtype=torch.bfloat16, device=device)


def add_l2_bias(acc2: torch.Tensor, *, b2: torch.Tensor, route_weights: torch.Tensor) -> torch.Tensor:
    """SPEC §8 D8's o = acc2 + fp32(w_route · float(b2)), fp32 [P, H]: the product and the sum each
    one fp32 RN operation (two torch ops: no FMA). b2 bf16 [P, H] (`bias_rows`), w_route fp32 [P]."""
    check_tensor("acc2", acc2, torch.float32, (None, None))
    check_tensor("b2", b2, torch.bfloat16, tuple(acc2.shape), acc2.device)
    check_tensor("route_weights", route_weights, torch.float32, (acc2.shape[0],), acc2.device)
    return acc2 + route_weights[:, None] * b2.to(torch.float32)


def l2_epilogue(
    acc2: torch.Tensor,
    meta: torch.Tensor,
    valid: torch.Tensor,
    combine_buffers: list[torch.Tensor],
    *,
    b2: torch.Tensor | None = None,
    route_weights: torch.Tensor | None = None,
) -> None:
    """D8: write bf16(acc2) (RNE) of every valid pool row to combine_s[k][t] of its source rank s.
    With b2 (SPEC §8: each pool row's expert bias, bf16 [P, H], `bias_rows`) the row is first
    o = acc2 + fp32(w_route · float(b2)), the product and the sum each one fp32 RN operation, w_route
    the pool row's routing weight (fp32 [P], D4)."""
    check_tensor("acc2", acc2, torch.float32, (None, None))
    p, h, device = *acc2.shape, acc2.device
    check_tensor("meta", meta, torch.int32, (p, 3), device)
    check_tensor("valid", valid, torch.bool, (p,), device)
    if b2 is not None:
        acc2 = add_l2_bias(acc2, b2=b2, route_weights=route_weights)
    elif route_weights is not None:
        fail("route_weights", "None without b2 (only the bias is scaled by it)", "a tensor")
    check_list("combine_buffers", combine_buffers, None, "combine buffers [K, T_max, H], one per source rank")
    shape = (None, None, h)
    for s, buf in enumerate(combine_buffers):
        check_tensor(f"combine_buffers[{s}]", buf, torch.bfloat16, shape, device)
        shape = tuple(buf.shape)  # every source rank's buffer is [K, T_max, H]
    k, t_max = shape[:2]
    # A valid row names the buffer it is written to: its token and slot must lie inside it (a row
    # whose source rank is none of the buffers' is not written, like a planted fault's padding row).
    written = valid & (meta[:, 0] >= 0) & (meta[:, 0] < len(combine_buffers))
    bad = (written & ((meta[:, 1] < 0) | (meta[:, 1] >= t_max) | (meta[:, 2] < 0) | (meta[:, 2] >= k))).nonzero()
    if bad.numel():
        row = int(bad[0])
        fail("meta", f"tokens in [0, {t_max}) and slots in [0, {k})", f"{meta[row].tolist()} in valid row {row}")
    out = F.bf16_tensor(F.encode_bf16(acc2))
    for s, buf in enumerate(combine_buffers):
        rows = (valid & (meta[:, 0] == s)).nonzero(as_tuple=True)[0]
        if rows.numel():
            buf[meta[rows, 2].long(), meta[rows, 1].long()] = out[rows]
