"""Per-32 block quantizers and dequantizers (SPEC §1, "Scale rule" and the quantizer table).

Three quantizers share one rule (RCEIL on the fp32 bits of amax · fp32(1/max_elem)) and differ
only in the amax floor and the exponent clamp:

| quantizer                      | amax floor | scale byte clamp | all-zero group          |
|--------------------------------|------------|------------------|-------------------------|
| quantize_activations (host)    | 1e-4       | [1, 254]         | byte of 1e-4/448        |
| quantize_weights (host)        | 1e-4       | [1, 254]         | byte of 1e-4/6          |
| requantize_intermediate (D6.5) | none       | none             | byte 0, payload 0       |

amax ignores NaN (the fmaxf of the kernel's reduction), so a NaN element stays a NaN code and
does not poison its group's scale.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import torch

from . import formats as F

GROUP = 32
HOST_AMAX_FLOOR = 1e-4


class Quantized(NamedTuple):
    codes: torch.Tensor  # uint8 element codes, same shape as the input
    scales: torch.Tensor  # uint8 UE8M0 bytes, [..., K/32]


def _per32(
    values: torch.Tensor,
    *,
    inv_max: torch.Tensor,
    encode: Callable,
    amax_floor: float | None,
    clamp_bytes: bool,
    what: str,
) -> Quantized:
    if values.dtype == torch.float64:
        raise TypeError(f"{what}: float64 input would be rounded twice; round to float32 first")
    v = values.to(torch.float32)
    k = v.shape[-1]
    if k % GROUP:
        raise ValueError(f"{what}: the last dimension must be a multiple of {GROUP}, got {k}")
    groups = v.reshape(*v.shape[:-1], k // GROUP, GROUP)
    mag = groups.abs()
    amax = torch.where(torch.isnan(mag), torch.zeros_like(mag), mag).amax(dim=-1)
    if amax_floor is not None:
        amax = torch.clamp(amax, min=torch.tensor(amax_floor, dtype=torch.float32).item())
    exp = F.ceil_exponent(amax * inv_max.to(amax.device))
    if clamp_bytes:
        exp = exp.clamp(min=1 - 127, max=254 - 127)
    scale_bytes = (exp + 127).to(torch.uint8)
    scaled = groups * F.pow2_f32(-exp).unsqueeze(-1)  # fp32 RN multiply, as the kernel does
    codes = encode(scaled).reshape(v.shape)
    return Quantized(codes, scale_bytes)


def quantize_activations(x: torch.Tensor) -> Quantized:
    """Host utility: activations [..., H] -> E4M3 codes and per-32 UE8M0 bytes [..., H/32]."""
    return _per32(
        x,
        inv_max=F.INV_E4M3_MAX,
        encode=F.encode_e4m3,
        amax_floor=HOST_AMAX_FLOOR,
        clamp_bytes=True,
        what="quantize_activations",
    )


def quantize_weights(w: torch.Tensor) -> Quantized:
    """Host utility: weights [..., N, K] -> packed FP4 [..., N, K/2] and UE8M0 bytes [..., N, K/32].

    Non-finite weights are rejected: E2M1 has no NaN or Inf, so they could only be clipped.
    """
    if not torch.isfinite(w).all():
        bad = (~torch.isfinite(w)).nonzero()[0].tolist()
        raise ValueError(f"quantize_weights: argument 'w' must be finite; first non-finite value at {bad}")
    q = _per32(
        w,
        inv_max=F.INV_E2M1_MAX,
        encode=F.encode_e2m1,
        amax_floor=HOST_AMAX_FLOOR,
        clamp_bytes=True,
        what="quantize_weights",
    )
    return Quantized(F.pack_fp4(q.codes), q.scales)


def requantize_intermediate(a: torch.Tensor) -> Quantized:
    """D6 step 5: fp32 [P, I] -> E4M3 codes and UE8M0 bytes; no amax floor, no byte clamp."""
    return _per32(
        a,
        inv_max=F.INV_E4M3_MAX,
        encode=F.encode_e4m3,
        amax_floor=None,
        clamp_bytes=False,
        what="requantize_intermediate",
    )


def _expand_scales(scale_bytes: torch.Tensor, k: int, dtype: torch.dtype) -> torch.Tensor:
    return F.decode_ue8m0(scale_bytes, dtype).repeat_interleave(GROUP, dim=-1)[..., :k]


def dequantize_e4m3(codes: torch.Tensor, scale_bytes: torch.Tensor, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """E4M3 codes [..., K] with per-32 scales -> values (float64 by default: always exact)."""
    c = F.as_codes(codes)
    return F.decode_e4m3(c).to(dtype) * _expand_scales(scale_bytes, c.shape[-1], dtype)


def dequantize_fp4(packed: torch.Tensor, scale_bytes: torch.Tensor, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """Packed FP4 [..., K/2] with per-32 scales -> values [..., K] (float64 by default: exact)."""
    codes = F.unpack_fp4(packed)
    return F.decode_e2m1(codes).to(dtype) * _expand_scales(scale_bytes, codes.shape[-1], dtype)


def rebase_k128(codes: torch.Tensor, scale_bytes: torch.Tensor) -> Quantized:
    """The fast GEMM mode's activation operand: per-32 scales rebased to one scale per 128.

    A documented operand transform (SPEC §3 D4): per (row, 128-channel block), s_max is the largest
    of the four per-32 scale bytes, and every payload of group g becomes
    e4m3_satfinite(RNE(value · 2^(s_g − s_max))) in fp32 (2^(s_g − s_max) below 2^-149 is 0).
    Exact unless a shifted value falls into E4M3's subnormal range (below 2^-6), where it is
    rounded to the 2^-9 grid. Returns codes [P, K] and scale bytes [P, K/128].
    """
    c = F.as_codes(codes)
    p, k = c.shape
    if k % 128:
        raise ValueError(f"rebase_k128: K must be a multiple of 128, got {k}")
    sf = scale_bytes.reshape(p, k // 128, 4).to(torch.int32)
    smax = sf.amax(dim=-1)
    shift = sf - smax[..., None]
    mult = torch.where(
        shift < -149, torch.zeros((), dtype=torch.float32, device=c.device), F.pow2_f32(shift.clamp(min=-149))
    )
    v = F.decode_e4m3(c).reshape(p, k // 128, 4, GROUP) * mult[..., None]
    return Quantized(F.encode_e4m3(v.reshape(p, k)), smax.to(torch.uint8))


# The fast GEMM mode's weight operand (megamoe.gemm promotion="k128"). Each weight row r has a base
# B_r = the largest of its per-32 scale bytes (over all of K). Group g of the row is decoded through
# the scaled lookup table d = B_r - s_g: its E2M1 magnitudes m become the E4M3 value
# RNE(m * 2^(FAST_LUT_HEADROOM - d)) (subnormals included), and the row's accumulator is scaled by
# 2^(B_r - 127 - FAST_LUT_HEADROOM) once. The headroom uses the binades of E4M3 above 6 (6 * 2^6 =
# 384 <= 448), so every group within 14 binades of its row's largest is decoded exactly; 15-18
# binades under it, the values are rounded onto E4M3's subnormal grid (2^-9); from 19 they are 0.
FAST_LUT_HEADROOM = 6
FAST_LUT_ENTRIES = 20  # d = 0 .. 19; larger offsets use entry 19 (all magnitudes round to 0)
FAST_EXACT_BINADES = 14  # d <= 14 decodes exactly


def scaled_fp4_lut(device="cpu") -> torch.Tensor:
    """[FAST_LUT_ENTRIES, 8] uint8: entry d holds the E4M3 codes of the E2M1 magnitudes
    {0, 0.5, 1, 1.5, 2, 3, 4, 6} x 2^(FAST_LUT_HEADROOM - d), RNE (fp32 multiply, then encode),
    computed on `device`."""
    mags = F.decode_e2m1(torch.arange(8, dtype=torch.uint8, device=device))
    d = torch.arange(FAST_LUT_ENTRIES, dtype=torch.int32, device=device)
    return F.encode_e4m3(mags[None, :] * F.pow2_f32(FAST_LUT_HEADROOM - d)[:, None])


class FastWeightScales(NamedTuple):
    offsets: torch.Tensor  # uint8 [..., N, K/32]: min(B_r - s_g, FAST_LUT_ENTRIES - 1)
    row_base: torch.Tensor  # uint8 [..., N]: B_r


def fast_weight_scales(scale_bytes: torch.Tensor) -> FastWeightScales:
    """The fast mode's view of per-32 weight scale bytes [..., N, K/32]: row bases and LUT offsets."""
    sf = scale_bytes.to(torch.int32)
    base = sf.amax(dim=-1)
    off = (base[..., None] - sf).clamp(max=FAST_LUT_ENTRIES - 1)
    return FastWeightScales(off.to(torch.uint8), base.to(torch.uint8))


def fast_rounded_rows(scale_bytes: torch.Tensor) -> int:
    """How many weight rows [..., N, K/32] have a group more than FAST_EXACT_BINADES under the row's
    largest: the rows whose fast-mode operand is not the exact dequantized weight."""
    sf = scale_bytes.to(torch.int32)
    return int(((sf.amax(dim=-1, keepdim=True) - sf) > FAST_EXACT_BINADES).any(dim=-1).sum())


def dequantize_fp4_fast(packed: torch.Tensor, scale_bytes: torch.Tensor) -> torch.Tensor:
    """The fast mode's weight operand as float64 values [..., N, K]: what the kernel multiplies,
    by the rule above (equal to dequantize_fp4 wherever fast_rounded_rows finds nothing)."""
    codes = F.unpack_fp4(packed).to(torch.int64)
    fs = fast_weight_scales(scale_bytes)
    lut = F.decode_e4m3(scaled_fp4_lut(codes.device)).to(torch.float64)  # [entries, 8]
    off = fs.offsets.to(torch.int64).repeat_interleave(GROUP, dim=-1)[..., : codes.shape[-1]]
    mag = lut[off, codes & 7]
    sign = torch.where((codes & 8) != 0, -1.0, 1.0).to(torch.float64)
    row = torch.pow(torch.tensor(2.0, dtype=torch.float64), fs.row_base.to(torch.float64) - 127 - FAST_LUT_HEADROOM)
    return sign * mag * row[..., None]
