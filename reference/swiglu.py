"""Stage "SwiGLU/requant" (D6): the fused L1 epilogue, bit-exact given the dumped acc1.

1. g = bf16(acc_gate), u = bf16(acc_up), RNE.
2. clamp in bf16 against bf16(c): g = min(g, c), u = min(max(u, -c), c); skipped when c is None.
   The min/max propagate NaN (PTX min.NaN / max.NaN), so NaN data stays NaN.
3. s = S(g), the SiLU table entry of g's bf16 bits (fast or precise).
4. a = (s · u) · w_route: two fp32 RN multiplies, no FMA.
5. per 32 intermediate channels: RCEIL scale byte, no floor, no clamp; q = e4m3_satfinite(a·2^-e).
6. l2_acts [P, I] e4m3 (natural channel order), l2_sf [P, I/32], and the L1-completion count
   per pool block (see `l1_done`).

activation="swiglu_oai" (gpt-oss, SPEC §8) replaces steps 1-4:
1. g = bf16(acc_gate + float(b1_gate)), u = bf16(acc_up + float(b1_up)): one fp32 RN add, then
   RNE; without b1 the add is skipped (an accumulator of -0.0 keeps its sign).
2. clamp in bf16 against L = bf16(fp32(limit)): g = min(g, L), u = min(max(u, -L), L).
3. s = G(g), the glu table entry of g's bf16 bits (g * sigmoid(alpha g), fast or precise).
4. a = ((u + 1) · s) · w_route: one fp32 RN add, then two RN multiplies, no FMA.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from . import formats as F
from .config import GPT_OSS_ALPHA, GPT_OSS_LIMIT, check_activation, check_activation_clamp
from .errors import INTEGER, check_bool, check_int, check_tensor, fail
from .quantize import requantize_intermediate
from .silu_tables import glu_from_bf16_bits, silu_from_bf16_bits


class L1Output(NamedTuple):
    l2_acts: torch.Tensor  # uint8 E4M3 codes [P, I]
    l2_sf: torch.Tensor  # uint8 UE8M0 [P, I/32]
    activation: torch.Tensor  # fp32 [P, I], the value a before requantization (for reports)


def swiglu(
    acc1: torch.Tensor,
    route_weights: torch.Tensor,
    *,
    activation_clamp: float | None,
    fast_math: bool,
    activation: str = "swiglu",
    limit: float = GPT_OSS_LIMIT,
    b1: torch.Tensor | None = None,
) -> torch.Tensor:
    """Steps 1-4: fp32 [P, 2I] accumulators and fp32 [P] routing weights -> a, fp32 [P, I].
    "swiglu_oai" reads `limit` and each pool row's bias `b1` (bf16 [P, 2I], `bias_rows`, or None)."""
    check_swiglu_args(acc1, route_weights, activation_clamp, torch.float32)
    check_bool("fast_math", fast_math)
    check_activation_args(acc1, activation, limit, activation_clamp, b1)
    i = acc1.shape[1] // 2
    w = route_weights.to(torch.float32)[:, None]
    gate, up = acc1[:, :i], acc1[:, i:]
    if b1 is not None:  # "swiglu_oai" only (check_activation_args)
        bias = b1.to(torch.float32)  # bf16 -> fp32 is exact
        gate, up = gate + bias[:, :i], up + bias[:, i:]
    g, u = F.round_bf16(gate), F.round_bf16(up)
    oai = activation == "swiglu_oai"
    bound = limit if oai else activation_clamp  # §8's limit or §3's clamp, never both
    if bound is not None:
        c = F.round_bf16(torch.tensor([bound], dtype=torch.float32, device=acc1.device))
        g = torch.minimum(g, c)
        u = torch.minimum(torch.maximum(u, -c), c)
    bits = F.encode_bf16(g)
    if oai:
        return ((u + 1.0) * glu_from_bf16_bits(bits, fast_math)) * w
    return (silu_from_bf16_bits(bits, fast_math) * u) * w


def check_activation_args(acc1, activation, limit, activation_clamp, b1) -> None:
    """The activation's own arguments (SPEC §8) beside acc1 [P, 2I]: the config's rule for the
    activation, its limit and the clamp (the tables' one alpha), and biases only with "swiglu_oai"
    (a project choice: the one published model with biases is gpt-oss), one bf16 row per pool row."""
    check_activation(activation, GPT_OSS_ALPHA, limit, activation_clamp)
    if b1 is None:
        return
    if activation == "swiglu":
        fail("b1", "None with activation 'swiglu' (biases are the gpt-oss variant's, 'swiglu_oai')", "a tensor")
    check_tensor("b1", b1, torch.bfloat16, tuple(acc1.shape), acc1.device)


def bias_rows(bias: torch.Tensor, expert_offsets: torch.Tensor, num_rows: int) -> torch.Tensor:
    """Each pool row's expert bias: bias [E_l, N] (bf16) -> [P, N], the rows of local expert e
    (expert_offsets[e] up to expert_offsets[e + 1]) holding bias[e]. A row past every expert's
    (P's padding at its end) gets zeros."""
    check_tensor("bias", bias, torch.bfloat16, (None, None))
    check_tensor("expert_offsets", expert_offsets, INTEGER, (bias.shape[0] + 1,), bias.device)
    check_int("num_rows", num_rows, 0)
    rows = torch.arange(num_rows, device=bias.device)
    expert = torch.searchsorted(expert_offsets.to(torch.int64).contiguous(), rows, right=True) - 1
    inside = (expert >= 0) & (expert < bias.shape[0])
    out = bias[expert.clamp(0, max(bias.shape[0] - 1, 0))]
    return torch.where(inside[:, None], out, torch.zeros_like(out))


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
    activation: str = "swiglu",
    limit: float = GPT_OSS_LIMIT,
    b1: torch.Tensor | None = None,
) -> L1Output:
    """D6 for every pool row; padding rows (valid = False) give zero codes and scale bytes."""
    check_swiglu_args(acc1, route_weights, activation_clamp, torch.float32, group=32)  # step 5's groups
    check_tensor("valid", valid, torch.bool, (acc1.shape[0],), acc1.device)
    a = swiglu(
        acc1,
        route_weights,
        activation_clamp=activation_clamp,
        fast_math=fast_math,
        activation=activation,
        limit=limit,
        b1=b1,
    )
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
