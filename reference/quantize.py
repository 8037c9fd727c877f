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
from .errors import check_float_dtype, check_tensor, fail

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
    arg: str,
) -> Quantized:
    v = F.float32_input(values, arg)
    _check_groups(arg, v, GROUP)
    k = v.shape[-1]
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


def _check_groups(arg: str, t: torch.Tensor, group: int) -> None:
    """[..., K] with K a multiple of the scale group (the tensor itself already checked)."""
    if t.dim() == 0 or t.shape[-1] % group:
        fail(arg, f"a tensor [..., K] with K a multiple of {group}", f"shape {list(t.shape)}")


def quantize_activations(x: torch.Tensor) -> Quantized:
    """Host utility: activations [..., H] -> E4M3 codes and per-32 UE8M0 bytes [..., H/32]."""
    return _per32(
        x,
        inv_max=F.INV_E4M3_MAX,
        encode=F.encode_e4m3,
        amax_floor=HOST_AMAX_FLOOR,
        clamp_bytes=True,
        arg="x",
    )


def quantize_weights(w: torch.Tensor) -> Quantized:
    """Host utility: weights [..., N, K] -> packed FP4 [..., N, K/2] and UE8M0 bytes [..., N, K/32].

    Non-finite weights are rejected: E2M1 has no NaN or Inf, so they could only be clipped.
    """
    if not torch.isfinite(F.float32_input(w, "w")).all():
        bad = (~torch.isfinite(w)).nonzero()[0].tolist()
        fail("w", "finite values (E2M1 has no NaN or Inf)", f"a non-finite value at {bad}")
    q = _per32(
        w,
        inv_max=F.INV_E2M1_MAX,
        encode=F.encode_e2m1,
        amax_floor=HOST_AMAX_FLOOR,
        clamp_bytes=True,
        arg="w",
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
        arg="a",
    )


def _expand_scales(scale_bytes: torch.Tensor, codes: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The per-32 scale bytes [..., ceil(K/32)] of codes [..., K] in `dtype`, one per element,
    checked (before anything is decoded)."""
    check_tensor("codes", codes, min_dim=1)
    *lead, k = codes.shape
    check_tensor("scale_bytes", scale_bytes, torch.uint8, (*lead, -(-k // GROUP)), codes.device)
    check_float_dtype("dtype", dtype)
    return F.decode_ue8m0(scale_bytes, dtype).repeat_interleave(GROUP, dim=-1)[..., :k]


def dequantize_e4m3(codes: torch.Tensor, scale_bytes: torch.Tensor, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """E4M3 codes [..., K] with per-32 scales -> values (float64 by default: always exact)."""
    c = F.as_codes(codes, "codes")
    scales = _expand_scales(scale_bytes, c, dtype)
    return F.decode_e4m3(c).to(dtype) * scales


def dequantize_fp4(packed: torch.Tensor, scale_bytes: torch.Tensor, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """Packed FP4 [..., K/2] with per-32 scales -> values [..., K] (float64 by default: exact)."""
    codes = F.unpack_fp4(packed)
    scales = _expand_scales(scale_bytes, codes, dtype)
    return F.decode_e2m1(codes).to(dtype) * scales


def rebase_k128(codes: torch.Tensor, scale_bytes: torch.Tensor) -> Quantized:
    """The fast GEMM mode's activation operand: per-32 scales rebased to one scale per 128.

    A documented operand transform (SPEC §3 D4): per (row, 128-channel block), s_max is the largest
    of the four per-32 scale bytes, and every payload of group g becomes
    e4m3_satfinite(RNE(value · 2^(s_g − s_max))) in fp32 (2^(s_g − s_max) below 2^-149 is 0).
    Exact unless a shifted value falls into E4M3's subnormal range (below 2^-6), where it is
    rounded to the 2^-9 grid. Returns codes [P, K] and scale bytes [P, K/128].

    In torch's own E4M3 casts rather than the codecs' table and bit arithmetic: megamoe.gemm's
    fast-mode entry points (given no x_sf128) and bench.layer run it on the GPU, inside CUDA graphs,
    which cannot capture the codecs' per-call copy of their host table; and the casts are a few ops
    where the codecs take a dozen. Decoding is exact, and the one rounding never reaches the
    overflow on which torch versions differ (SPEC §1), since a factor 2^(s_g − s_max) <= 1 makes no
    value larger. The cast keeps a NaN's sign; SPEC §1 makes every NaN 0x7F, so 0xFF is replaced.
    tests/test_quantize.py compares the result with the codecs' at every code and every shift: the
    whole input domain.
    """
    c = F.as_codes(codes, "codes")
    check_tensor("codes", c, shape=(None, None))
    _check_groups("codes", c, 128)
    p, k = c.shape
    check_tensor("scale_bytes", scale_bytes, torch.uint8, (p, k // GROUP), c.device)
    sf = scale_bytes.reshape(p, k // 128, 4).to(torch.int32)
    smax = sf.amax(dim=-1)
    shift = sf - smax[..., None]
    mult = F.pow2_f32(shift.clamp(min=-149)).masked_fill(shift < -149, 0.0)
    v = F.as_float8(c).to(torch.float32).reshape(p, k // 128, 4, GROUP) * mult[..., None]
    q = v.reshape(p, k).to(torch.float8_e4m3fn).view(torch.uint8)
    return Quantized(q.masked_fill(q == 0xFF, F.E4M3_NAN), smax.to(torch.uint8))


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


# The fast mode keeps a row's accumulator relative to its expert's largest row base B_e and multiplies
# it by 2^(B_r - B_e) after the mainloop (kernel/gemm/gemm_sm90.cuh, kernel/epilogue/prefill_rows.cuh),
# so its partial sums are 2^(B_e - B_r) larger than the row's own: a row far under its expert's base
# overflows where its result does not (found by megamoe.fuzz: an expert with one row at scale byte
# 254 gave inf on every row), and under 2^-149 the factor has no fp32. The fast mode takes weights
# whose rows lie at most FAST_ROW_SPREAD binades under their expert's largest (SPEC §2), the bound
# the exact mode's prefill fold keeps too (megamoe.jit.layout.FOLD_ROW_SPREAD); the partial sums
# then leave the fp32 range only where Σ|a·b| > 2^(128 - 32) (SPEC §4's overflow domain). Checked
# by megamoe.gemm (once per KernelWeights: row_spread) and by MegaMoE's constructor.
FAST_ROW_SPREAD = 32


def row_spreads(sf: torch.Tensor) -> torch.Tensor:
    """int32 [E, R]: B_e - B_r of every weight row, from canonical scale bytes [E, R, K/32] (B_r the
    row's largest byte, B_e its expert's largest B_r)."""
    base = sf.amax(dim=-1).to(torch.int32)
    return base.amax(dim=1, keepdim=True) - base


def weight_row_spread(sf: torch.Tensor) -> int:
    """The largest of row_spreads (0 for no rows): what FAST_ROW_SPREAD bounds."""
    return int(row_spreads(sf).max()) if sf.numel() else 0


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
