"""The exact block-scaled GEMM shared by stage L1 (D5) and stage L2 (D7).

out[m, n] = Σ_g 2^(sa[m,g]-127) · 2^(sb[n,g]-127) · Σ_{j<32} a[m, 32g+j] · b[n, 32g+j]

Each 32-wide partial sum is computed on integers (E4M3 values are multiples of 2^-9, E2M1 values
multiples of 1/2, and a 32-term sum stays far below 2^53), so it is exact in float64 in any
order. The per-group terms are then added in float64 in ascending group order — a fixed order,
so the CPU and CUDA references agree bit for bit — and the sum is rounded once to fp32.
"""

from __future__ import annotations

import torch

from . import formats as F
from .errors import INTEGER, check_tensor, fail
from .quantize import dequantize_fp4_fast, rebase_k128

E4M3_UNIT = 2.0**-9  # every E4M3 value is an integer multiple of this
E2M1_UNIT = 0.5  # every E2M1 value is an integer multiple of this


def check_weight_operand(names: tuple[str, str], w, w_sf, k: int, experts: int | None, device) -> None:
    """FP4 weights [(E,) N, K/2] and their scale bytes [(E,) N, K/32] (`experts` None: one matrix),
    named as the caller's signature names them."""
    lead = () if experts is None else (experts,)
    check_tensor(names[0], w, torch.uint8, (*lead, None, k // 2), device)
    check_tensor(names[1], w_sf, torch.uint8, (*lead, w.shape[-2], k // 32), device)


def _check_activations(names: tuple[str, str], a_codes, a_sf) -> torch.Tensor:
    """E4M3 codes [M, K] (K a multiple of 32) and their scale bytes [M, K/32]; returns the codes as uint8."""
    a = F.as_codes(a_codes, names[0])
    check_tensor(names[0], a, shape=(None, None))
    if a.shape[1] % 32:
        fail(names[0], "[M, K] with K a multiple of 32", list(a.shape))
    check_tensor(names[1], a_sf, torch.uint8, (a.shape[0], a.shape[1] // 32), a.device)
    return a


def _operands(a_codes, a_sf, b_packed, b_sf):
    a_codes = _check_activations(("a_codes", "a_sf"), a_codes, a_sf)
    check_weight_operand(("b_packed", "b_sf"), b_packed, b_sf, a_codes.shape[1], None, a_codes.device)
    a_int = F.decode_e4m3(a_codes).to(torch.float64) / E4M3_UNIT
    b_int = F.decode_e2m1(F.unpack_fp4(b_packed)).to(torch.float64) / E2M1_UNIT
    a_scale = F.decode_ue8m0(a_sf, torch.float64) * E4M3_UNIT
    b_scale = F.decode_ue8m0(b_sf, torch.float64) * E2M1_UNIT
    return a_int, b_int, a_scale, b_scale


def block_scaled_gemm_f64(
    a_codes: torch.Tensor, a_sf: torch.Tensor, b_packed: torch.Tensor, b_sf: torch.Tensor, *, absolute: bool = False
) -> torch.Tensor:
    """float64 [M, N] sum of FP8 [M, K] (per-32 scales [M, K/32]) times FP4 [N, K/2] (scales [N, K/32]).

    With absolute=True, returns Σ |a_k·b_k| instead: the scale of the GEMM_BOUND tolerance.
    """
    a_int, b_int, a_scale, b_scale = _operands(a_codes, a_sf, b_packed, b_sf)
    if absolute:
        a_int, b_int = a_int.abs(), b_int.abs()
    m, k = a_int.shape
    out = torch.zeros(m, b_int.shape[0], dtype=torch.float64, device=a_int.device)
    for g in range(k // 32):
        cols = slice(32 * g, 32 * g + 32)
        partial = a_int[:, cols] @ b_int[:, cols].T  # exact: integers below 2^53
        out += partial * (a_scale[:, g, None] * b_scale[None, :, g])
    return out


def block_scaled_gemm(a_codes, a_sf, b_packed, b_sf) -> torch.Tensor:
    """The reference accumulator: the float64 sum rounded once to fp32."""
    return block_scaled_gemm_f64(a_codes, a_sf, b_packed, b_sf).to(torch.float32)


def fast_gemm_f64(
    a_codes: torch.Tensor, a_sf: torch.Tensor, b_packed: torch.Tensor, b_sf: torch.Tensor, *, absolute: bool = False
) -> torch.Tensor:
    """float64 [M, N]: the fast mode's (promotion k128) GEMM on its own operands, what its tensor
    cores multiply (SPEC §3 D5): the activations rebased per 128 channels (`rebase_k128`), the
    weights through the scaled tables (`dequantize_fp4_fast`). Every product is exact in float64 and
    the K-sum rounds at 2^-53 of Σ|a·b|, far under any τ (not for GEMM_EXACT's bitwise checks).
    With absolute=True, Σ |a_k·b_k|."""
    a_codes = _check_activations(("a_codes", "a_sf"), a_codes, a_sf)
    if a_codes.shape[1] % 128:  # rebased per 128 channels
        fail("a_codes", "[M, K] with K a multiple of 128", list(a_codes.shape))
    check_weight_operand(("b_packed", "b_sf"), b_packed, b_sf, a_codes.shape[1], None, a_codes.device)
    q = rebase_k128(a_codes, a_sf)
    a = F.decode_e4m3(q.codes).to(torch.float64) * F.decode_ue8m0(q.scales, torch.float64).repeat_interleave(128, -1)
    b = dequantize_fp4_fast(b_packed, b_sf)
    if absolute:
        a, b = a.abs(), b.abs()
    return a @ b.T


def grouped_gemm(
    rows_codes: torch.Tensor,
    rows_sf: torch.Tensor,
    expert_offsets: torch.Tensor,
    w: torch.Tensor,
    w_sf: torch.Tensor,
    *,
    valid: torch.Tensor,
    fn=block_scaled_gemm,
) -> torch.Tensor:
    """Apply `fn` expert by expert over an expert-major pool; padding rows give 0."""
    rows_codes = _check_activations(("rows_codes", "rows_sf"), rows_codes, rows_sf)
    p, k, device = *rows_codes.shape, rows_codes.device
    check_tensor("w", w, shape=(None, None, None))
    check_weight_operand(("w", "w_sf"), w, w_sf, k, w.shape[0], device)
    check_tensor("expert_offsets", expert_offsets, INTEGER, (w.shape[0] + 1,), device)
    check_tensor("valid", valid, torch.bool, (p,), device)
    bounds = expert_offsets.tolist()
    if bounds[0] < 0 or bounds[-1] > p or any(a > b for a, b in zip(bounds, bounds[1:])):
        fail("expert_offsets", f"ascending pool rows in [0, {p}]", bounds)
    n = w.shape[1]
    dtype = torch.float64 if fn is not block_scaled_gemm else torch.float32
    out = torch.zeros(p, n, dtype=dtype, device=rows_codes.device)
    for e in range(w.shape[0]):
        rows = torch.arange(bounds[e], bounds[e + 1], device=rows_codes.device)
        rows = rows[valid[rows]]
        if rows.numel():
            out[rows] = fn(rows_codes[rows], rows_sf[rows], w[e], w_sf[e]).to(dtype)
    return out
