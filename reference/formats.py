"""Bit-exact encoders and decoders of the number formats in SPEC §1.

Everything here works on torch tensors on any device and never relies on a library cast whose
behaviour changed between releases (torch's fp8 overflow, ml_dtypes' NaN sign, the E8M0 casts):
each rule is written out on the fp32 bit pattern.

Codes are returned as uint8 tensors; `as_float8` views E4M3 codes as torch.float8_e4m3fn.
"""

from __future__ import annotations

import torch

from .errors import FLOATING, INTEGER, check_float_dtype, check_tensor, fail

E4M3_MAX = 448.0
E2M1_MAX = 6.0
E4M3_NAN = 0x7F  # what cvt.rn.satfinite.e4m3x2.f32 gives for any NaN
E2M1_NAN = 0x7  # cvt.rn.satfinite.e2m1x2.f32: "NaN converts to positive MAXNORM" (+6)
BF16_NAN = 0x7FFF  # canonical NaN of cvt.rn.bf16.f32

# fp32(1/max_elem), the multiplier of the RCEIL scale rule (rounded once, to fp32).
INV_E4M3_MAX = torch.tensor(1.0 / E4M3_MAX, dtype=torch.float32)
INV_E2M1_MAX = torch.tensor(1.0 / E2M1_MAX, dtype=torch.float32)


def float32_input(x: torch.Tensor, arg: str) -> torch.Tensor:
    """Argument `arg` of an encoder or quantizer, a floating-point tensor, as fp32. float64 is
    refused: through fp32 to fp8 it would be rounded twice (SPEC §1), so the caller rounds first."""
    check_tensor(arg, x, FLOATING)
    if x.dtype == torch.float64:
        fail(arg, "float32, bfloat16 or float16 (float64 would be rounded twice: round to float32 first)", x.dtype)
    return x.to(torch.float32)


def f32_bits(x: torch.Tensor) -> torch.Tensor:
    """The int32 bit pattern of a float32 tensor."""
    return x.to(torch.float32).contiguous().view(torch.int32)


def pow2_f32(exponent: torch.Tensor) -> torch.Tensor:
    """2**exponent as float32, exactly (exponent is an integer tensor in [-149, 127])."""
    e = exponent.to(torch.int64)
    as_f64 = ((e + 1023) << 52).view(torch.float64)  # an exact double power of two
    return as_f64.to(torch.float32)  # exact: every 2^k with k >= -149 is representable


def ceil_exponent(v: torch.Tensor) -> torch.Tensor:
    """The RCEIL exponent of SPEC §1 on fp32 bits: biased_exp - 127 + (mantissa != 0).

    For a positive normal v this is ceil(log2 v); 0 gives -127; +Inf gives 128.
    """
    bits = f32_bits(float32_input(v, "v"))
    biased = (bits >> 23) & 0xFF
    mantissa = bits & 0x7FFFFF
    return (biased - 127 + (mantissa != 0).to(torch.int32)).to(torch.int32)


# ---------------------------------------------------------------------------------------------
# Minifloats (E4M3, E2M1): RNE with saturation, on the fp32 bits.
# ---------------------------------------------------------------------------------------------


def _encode_magnitude(x: torch.Tensor, *, mbits: int, bias: int, max_val: float) -> torch.Tensor:
    """The unsigned code of RNE(|x|) saturated to max_val, for a minifloat with `mbits` mantissa
    bits and exponent bias `bias` (NaN lanes give garbage; callers replace them)."""
    # Saturating: every |x| above max_val (Inf too) becomes max_val. Clamping first is equivalent
    # to rounding first because the midpoint just above max_val rounds down to it (tie to even).
    mag = x.abs().clamp(max=max_val)
    emin = 1 - bias
    exp = torch.clamp(((f32_bits(mag) >> 23) & 0xFF) - 127, min=emin)  # fp32 subnormals -> emin
    ulp = pow2_f32(exp - mbits)
    q = torch.round(mag / ulp)  # exact division by a power of two; torch.round is half-to-even
    # code = (exp + bias - 1) * 2^mbits + q covers subnormals, normals and the carry into the next
    # binade in one formula (q is an integer in [0, 2^(mbits+1)]).
    return (exp + bias - 1) * (1 << mbits) + torch.nan_to_num(q).to(torch.int32)


def _encode_signed(
    x: torch.Tensor, *, mbits: int, bias: int, max_val: float, sign_bit: int, nan_code: int
) -> torch.Tensor:
    x = float32_input(x, "x")
    sign = (f32_bits(x) >> 31) & 1  # -0 keeps its sign, as cvt does
    code = _encode_magnitude(x, mbits=mbits, bias=bias, max_val=max_val) | (sign << sign_bit)
    code = torch.where(torch.isnan(x), torch.full_like(code, nan_code), code)
    return code.to(torch.uint8)


def encode_e4m3(x: torch.Tensor) -> torch.Tensor:
    """fp32 -> E4M3 codes: RNE, saturating to ±448, every NaN -> 0x7F (cvt.rn.satfinite)."""
    return _encode_signed(x, mbits=3, bias=7, max_val=E4M3_MAX, sign_bit=7, nan_code=E4M3_NAN)


def encode_e2m1(x: torch.Tensor) -> torch.Tensor:
    """fp32 -> E2M1 codes (one per uint8, low nibble): RNE, saturating to ±6, NaN -> 0x7."""
    return _encode_signed(x, mbits=1, bias=1, max_val=E2M1_MAX, sign_bit=3, nan_code=E2M1_NAN)


def _minifloat_table(ebits: int, mbits: int, bias: int, nan_codes: tuple[int, ...]) -> torch.Tensor:
    values = []
    for code in range(1 << (1 + ebits + mbits)):
        sign = -1.0 if code >> (ebits + mbits) else 1.0
        e = (code >> mbits) & ((1 << ebits) - 1)
        m = code & ((1 << mbits) - 1)
        if e == 0:
            v = m * 2.0 ** (1 - bias - mbits)
        else:
            v = (1 + m / (1 << mbits)) * 2.0 ** (e - bias)
        values.append(float("nan") if code in nan_codes else sign * v)
    return torch.tensor(values, dtype=torch.float32)


E4M3_VALUES = _minifloat_table(4, 3, 7, nan_codes=(0x7F, 0xFF))
E2M1_VALUES = _minifloat_table(2, 1, 1, nan_codes=())


def decode_e4m3(codes: torch.Tensor) -> torch.Tensor:
    """E4M3 codes (uint8 or float8_e4m3fn) -> fp32 values (0x7F/0xFF -> NaN)."""
    c = as_codes(codes, "codes")
    return E4M3_VALUES.to(c.device)[c.to(torch.int64)]


def decode_e2m1(codes: torch.Tensor) -> torch.Tensor:
    """E2M1 codes (uint8, one per element, values 0..15) -> fp32 values."""
    check_tensor("codes", codes, INTEGER)
    return E2M1_VALUES.to(codes.device)[(codes.to(torch.int64) & 0xF)]


def as_codes(x: torch.Tensor, arg: str = "x") -> torch.Tensor:
    """A uint8 view of E4M3 data given as uint8 codes or torch.float8_e4m3fn (`arg`: the caller's
    name for it, for the error)."""
    check_tensor(arg, x, (torch.uint8, torch.float8_e4m3fn))
    return x.view(torch.uint8) if x.dtype == torch.float8_e4m3fn else x


def as_float8(codes: torch.Tensor) -> torch.Tensor:
    """View uint8 E4M3 codes as torch.float8_e4m3fn (no conversion)."""
    return as_codes(codes, "codes").view(torch.float8_e4m3fn)


# ---------------------------------------------------------------------------------------------
# FP4 nibble packing
# ---------------------------------------------------------------------------------------------


def pack_fp4(codes: torch.Tensor) -> torch.Tensor:
    """[..., K] E2M1 codes -> [..., K/2] bytes: element 2i in the low nibble, 2i+1 in the high."""
    check_tensor("codes", codes, INTEGER, min_dim=1)
    if codes.shape[-1] % 2:
        fail("codes", "an even last dimension (two codes a byte)", list(codes.shape))
    c = codes.to(torch.uint8) & 0xF
    return c[..., 0::2] | (c[..., 1::2] << 4)


def unpack_fp4(packed: torch.Tensor) -> torch.Tensor:
    """[..., K/2] bytes -> [..., K] E2M1 codes (inverse of pack_fp4)."""
    check_tensor("packed", packed, torch.uint8, min_dim=1)
    p = packed
    out = torch.stack([p & 0xF, p >> 4], dim=-1)
    return out.reshape(*p.shape[:-1], p.shape[-1] * 2)


# ---------------------------------------------------------------------------------------------
# UE8M0
# ---------------------------------------------------------------------------------------------

UE8M0_VALUES = torch.tensor([2.0 ** (b - 127) for b in range(255)] + [float("nan")], dtype=torch.float64)


def decode_ue8m0(scale_bytes: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """UE8M0 bytes -> 2^(b-127) (byte 0 = 2^-127, an fp32 subnormal; 255 = NaN)."""
    check_tensor("scale_bytes", scale_bytes, torch.uint8)
    check_float_dtype("dtype", dtype)
    return UE8M0_VALUES.to(scale_bytes.device)[scale_bytes.to(torch.int64)].to(dtype)


def pack_ue8m0(scale_bytes: torch.Tensor) -> torch.Tensor:
    """[..., G] bytes -> [..., G/4] int32, byte j (little-endian) of word i = group 4i+j."""
    check_tensor("scale_bytes", scale_bytes, INTEGER, min_dim=1)
    g = scale_bytes.shape[-1]
    if g % 4:
        fail("scale_bytes", "a last dimension (scale groups) that is a multiple of 4", list(scale_bytes.shape))
    b = scale_bytes.to(torch.int64).reshape(*scale_bytes.shape[:-1], g // 4, 4)
    word = b[..., 0] | (b[..., 1] << 8) | (b[..., 2] << 16) | (b[..., 3] << 24)
    return torch.where(word >= 1 << 31, word - (1 << 32), word).to(torch.int32)


def unpack_ue8m0(words: torch.Tensor) -> torch.Tensor:
    """[..., G/4] int32 -> [..., G] bytes (inverse of pack_ue8m0)."""
    check_tensor("words", words, INTEGER, min_dim=1)
    w = words.to(torch.int64) & 0xFFFFFFFF
    b = torch.stack([(w >> (8 * j)) & 0xFF for j in range(4)], dim=-1)
    return b.reshape(*words.shape[:-1], words.shape[-1] * 4).to(torch.uint8)


# ---------------------------------------------------------------------------------------------
# BF16
# ---------------------------------------------------------------------------------------------


def encode_bf16(x: torch.Tensor) -> torch.Tensor:
    """fp32 -> bf16 bit patterns (int32 in [0, 65535]): RNE; NaN -> 0x7FFF (cvt.rn.bf16.f32)."""
    bits = f32_bits(float32_input(x, "x")).to(torch.int64) & 0xFFFFFFFF
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    return torch.where(torch.isnan(x), torch.full_like(rounded, BF16_NAN), rounded).to(torch.int32)


def decode_bf16(bits: torch.Tensor) -> torch.Tensor:
    """bf16 bit patterns (any integer dtype, low 16 bits) -> fp32, exactly."""
    check_tensor("bits", bits, INTEGER)
    return ((bits.to(torch.int32) & 0xFFFF) << 16).view(torch.float32)


def round_bf16(x: torch.Tensor) -> torch.Tensor:
    """fp32 -> fp32 holding the RNE bf16 value (NaN canonicalised)."""
    return decode_bf16(encode_bf16(x))


def bf16_tensor(bits: torch.Tensor) -> torch.Tensor:
    """bf16 bit patterns (any integer dtype, low 16 bits) -> a torch.bfloat16 tensor with exactly those bits."""
    check_tensor("bits", bits, INTEGER)
    b = bits.to(torch.int32) & 0xFFFF
    return torch.where(b >= 0x8000, b - 0x10000, b).to(torch.int16).view(torch.bfloat16)


def bf16_bits(x: torch.Tensor) -> torch.Tensor:
    """The bit patterns (int32) of a torch.bfloat16 tensor."""
    check_tensor("x", x, torch.bfloat16)
    return x.contiguous().view(torch.int16).to(torch.int32) & 0xFFFF
