"""Stage "SwiGLU/requant" (D6): the fused L1 epilogue, bit-exact given the dumped acc1.

1. g = bf16(acc_gate), u = bf16(acc_up), RNE.
2. clamp in bf16 against bf16(c): g = min(g, c), u = min(max(u, -c), c); skipped when c is None.
   The min/max propagate NaN (PTX min.NaN / max.NaN), so NaN data stays NaN.
3. s = S(g), the SiLU table entry of g's bf16 bits (fast or precise).
4. a = (s · u) · w_route: two fp32 RN multiplies, no FMA.
5. per 32 intermediate channels: RCEIL scale byte, no floor, no clamp; q = e4m3_satfinite(a·2^-e).
6. l2_acts [P, I] e4m3 (natural channel order), l2_sf [P, I/32], and the L1-completion count
   per pool block (see `l1_done`).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from . import formats as F
from .config import check_activation_clamp
from .errors import INTEGER, check_bool, check_int, check_tensor, fail
from .quantize import requantize_intermediate
from .silu_tables import silu_from_bf16_bits


class L1Output(NamedTuple):
    l2_acts: torch.Tensor  # uint8 E4M3 codes [P, I]
    l2_sf: torch.Tensor  # uint8 UE8M0 [P, I/32]
    activation: torch.Tensor  # fp32 [P, I], the value a before requantization (for reports)


def swiglu(
    acc1: torch.Tensor, route_weights: torch.Tensor, *, activation_clamp: float | None, fast_math: bool
) -> torch.Tensor:
    """Steps 1-4: fp32 [P, 2I] accumulators and fp32 [P] routing weights -> a, fp32 [P, I]."""
    check_swiglu_args(acc1, route_weights, activation_clamp, torch.float32)
    check_bool("fast_math", fast_math)
    i = acc1.shape[1] // 2
    g = F.round_bf16(acc1[:, :i])
    u = F.round_bf16(acc1[:, i:])
    if activation_clamp is not None:
        c = F.round_bf16(torch.tensor([activation_clamp], dtype=torch.float32, device=acc1.device))
        g = torch.minimum(g, c)
        u = torch.minimum(torch.maximum(u, -c), c)
    s = silu_from_bf16_bits(F.encode_bf16(g), fast_math)
    return (s * u) * route_weights.to(torch.float32)[:, None]


def check_swiglu_args(acc1, route_weights, activation_clamp, dtype, group: int = 1) -> None:
    """acc1 [P, 2I] and route_weights [P] of `dtype` (the accumulators' format: fp32 for D6, a
    floating type for the float64 oracle), I a multiple of `group`, and the clamp (SPEC §2)."""
    check_tensor("acc1", acc1, dtype, (None, None))
    if acc1.shape[1] % (2 * group):
        fail(
            "acc1", f"[P, 2I] with I a multiple of {group}" if group > 1 else "[P, 2I] (gate and up)", list(acc1.shape)
        )
    check_tensor("route_weights", route_weights, dtype, (acc1.shape[0],), acc1.device)
    check_activation_clamp(activation_clamp)


def l1_epilogue(
    acc1: torch.Tensor,
    route_weights: torch.Tensor,
    valid: torch.Tensor,
    *,
    activation_clamp: float | None,
    fast_math: bool,
) -> L1Output:
    """D6 for every pool row; padding rows (valid = False) give zero codes and scale bytes."""
    check_swiglu_args(acc1, route_weights, activation_clamp, torch.float32, group=32)  # step 5's groups
    check_tensor("valid", valid, torch.bool, (acc1.shape[0],), acc1.device)
    a = swiglu(acc1, route_weights, activation_clamp=activation_clamp, fast_math=fast_math)
    a = torch.where(valid[:, None], a, torch.zeros_like(a))
    q = requantize_intermediate(a)
    return L1Output(q.codes, q.scales, a)


def l1_done(block_arrivals: torch.Tensor, intermediate: int) -> torch.Tensor:
    """The L1-completion count per pool block after the call's L1 phase.

    Contract: every finished L1 output tile adds its number of 32-channel scale groups to the
    counter of its pool block, so a block is complete at I/32 whatever the kernel's tile width.
    Blocks without valid rows hold no work and stay 0.
    """
    check_tensor("block_arrivals", block_arrivals, INTEGER, (None,))
    check_int("intermediate", intermediate, 32)
    if intermediate % 32:
        fail("intermediate", "a multiple of 32 (scale groups)", intermediate)
    return torch.where(block_arrivals > 0, intermediate // 32, 0).to(torch.int32)
