"""SPEC §1 formats: exhaustive over every code, against ml_dtypes on random and boundary inputs,
and every known disagreement between ml_dtypes, torch and the hardware pinned as a test."""

import ml_dtypes
import numpy as np
import pytest
import torch

from megamoe import reference as ref

BOUNDARY = [
    0.0,
    -0.0,
    448.0,
    464.0,
    465.0,
    480.0,
    2.0**-9,
    2.0**-10,
    1.5 * 2**-10,
    3 * 2.0**-10,
    0.25,
    0.75,
    1.25,
    1.75,
    2.5,
    3.5,
    5.0,
    7.0,
    1e-30,
    3e-39,
    1e30,
    float("inf"),
    -float("inf"),
]


def _inputs(seed=0, n=200_000):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g) * torch.exp2(torch.randint(-14, 12, (n,), generator=g).float())
    b = torch.tensor(BOUNDARY, dtype=torch.float32)
    grid = ref.decode_e4m3(torch.arange(256, dtype=torch.uint8))
    grid = grid[torch.isfinite(grid)]
    sorted_grid = torch.sort(grid).values
    mids = (sorted_grid[:-1] + sorted_grid[1:]) / 2
    ulp_up, ulp_dn = torch.nextafter(mids, torch.tensor(1e9)), torch.nextafter(mids, torch.tensor(-1e9))
    return torch.cat([x, b, -b, mids, ulp_up, ulp_dn])


def _ml(x: torch.Tensor, dtype) -> torch.Tensor:
    return torch.from_numpy(x.numpy().astype(dtype).view(np.uint8).copy())


# ---------------------------------------------------------------------------------------------- E4M3


def test_e4m3_decode_every_code_matches_ml_dtypes():
    codes = np.arange(256, dtype=np.uint8)
    want = torch.from_numpy(codes.view(ml_dtypes.float8_e4m3fn).astype(np.float32))
    got = ref.decode_e4m3(torch.from_numpy(codes))
    assert torch.equal(torch.isnan(got), torch.isnan(want))
    assert torch.equal(got[~torch.isnan(got)], want[~torch.isnan(want)])
    assert torch.isnan(got[[0x7F, 0xFF]]).all() and got[0x7E] == 448 and got[1] == 2.0**-9


def test_e4m3_encode_round_trips_every_code():
    codes = torch.arange(256, dtype=torch.uint8)
    back = ref.encode_e4m3(ref.decode_e4m3(codes))
    finite = ~torch.isin(codes, torch.tensor([0x7F, 0xFF], dtype=torch.uint8))
    assert torch.equal(back[finite], codes[finite])
    assert (back[~finite] == 0x7F).all()  # every NaN -> 0x7F


def test_e4m3_encode_matches_ml_dtypes_inside_the_range():
    x = _inputs()
    x = x[~torch.isnan(x)].clamp(-448, 448)  # ml_dtypes does not saturate: compare inside the range
    assert torch.equal(ref.encode_e4m3(x), _ml(x, ml_dtypes.float8_e4m3fn))


def test_e4m3_saturates_where_ml_dtypes_gives_nan():
    # Pinned disagreement: ml_dtypes' astype is non-saturating (ml_dtypes#260): NaN above 464.
    x = torch.tensor([464.0, 465.0, 1e6, float("inf"), -465.0])
    assert ref.encode_e4m3(x).tolist() == [0x7E, 0x7E, 0x7E, 0x7E, 0xFE]
    assert _ml(x, ml_dtypes.float8_e4m3fn).tolist() == [0x7E, 0x7F, 0x7F, 0x7F, 0xFF]


def test_e4m3_nan_is_always_0x7f_while_ml_dtypes_keeps_the_sign():
    x = torch.tensor([float("nan"), -float("nan")])
    assert ref.encode_e4m3(x).tolist() == [0x7F, 0x7F]  # cvt.rn.satfinite: NaN -> 0x7F
    assert _ml(x, ml_dtypes.float8_e4m3fn).tolist() == [0x7F, 0xFF]


def test_e4m3_torch_cast_changed_with_213_and_we_do_not_depend_on_it():
    # torch <= 2.11 casts overflow to NaN on the CPU; torch >= 2.13 saturates (pytorch#178817).
    major, minor = (int(p) for p in torch.__version__.split(".")[:2])
    got = torch.tensor([470.0]).to(torch.float8_e4m3fn).view(torch.uint8).item()
    assert got == (0x7E if (major, minor) >= (2, 13) else 0x7F)
    assert ref.encode_e4m3(torch.tensor([470.0])).item() == 0x7E


def test_float64_is_refused_because_the_library_rounds_it_twice():
    x = torch.tensor([1.0625 + 2.0**-40], dtype=torch.float64)  # correctly rounded: 1.125
    assert torch.tensor(x.tolist(), dtype=torch.float64).to(torch.float8_e4m3fn).float().item() == 1.0
    with pytest.raises(TypeError, match="rounded twice"):
        ref.encode_e4m3(x)
    with pytest.raises(TypeError, match="rounded twice"):
        ref.quantize_activations(x.reshape(1, 1).expand(1, 32).contiguous())


# ---------------------------------------------------------------------------------------------- E2M1


def test_e2m1_decode_every_code_matches_ml_dtypes():
    codes = np.arange(16, dtype=np.uint8)
    want = torch.from_numpy(codes.view(ml_dtypes.float4_e2m1fn).astype(np.float32))
    assert torch.equal(ref.decode_e2m1(torch.from_numpy(codes)), want)
    assert ref.decode_e2m1(torch.arange(8, dtype=torch.uint8)).tolist() == [0, 0.5, 1, 1.5, 2, 3, 4, 6]


def test_e2m1_rne_ties_and_saturation():
    x = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 7.0, 1e9, float("inf"), -0.1, -0.0, -5.0])
    got = ref.decode_e2m1(ref.encode_e2m1(x)).tolist()
    assert got == [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 6.0, 6.0, 6.0, -0.0, -0.0, -4.0]
    assert ref.encode_e2m1(torch.tensor([-0.1])).item() == 0x8  # sign kept on zero, like cvt


def test_e2m1_encode_matches_ml_dtypes_on_non_nan_inputs():
    x = _inputs(seed=1) / 64
    x = x[~torch.isnan(x)]
    assert torch.equal(ref.encode_e2m1(x), _ml(x, ml_dtypes.float4_e2m1fn))


def test_e2m1_nan_follows_cvt_not_ml_dtypes():
    # cuda_fp4.hpp: "NaN converts to positive MAXNORM"; ml_dtypes maps NaN to the -0 pattern.
    x = torch.tensor([float("nan")])
    assert ref.encode_e2m1(x).item() == 0x7
    assert _ml(x, ml_dtypes.float4_e2m1fn).item() in (0x0, 0x8)


def test_fp4_nibble_order():
    codes = torch.tensor([[1, 2, 3, 4]], dtype=torch.uint8)
    packed = ref.pack_fp4(codes)
    assert packed.tolist() == [[0x21, 0x43]]  # element 2i low nibble, 2i+1 high nibble
    assert torch.equal(ref.unpack_fp4(packed), codes)
    every = torch.arange(256, dtype=torch.uint8).reshape(1, -1)
    assert torch.equal(ref.pack_fp4(ref.unpack_fp4(every)), every)


# ---------------------------------------------------------------------------------------------- UE8M0


def test_ue8m0_decode_every_code_matches_ml_dtypes():
    codes = np.arange(256, dtype=np.uint8)
    want = torch.from_numpy(codes.view(ml_dtypes.float8_e8m0fnu).astype(np.float64))
    got = ref.decode_ue8m0(torch.from_numpy(codes), torch.float64)
    assert torch.isnan(got[255]) and torch.isnan(want[255])
    assert torch.equal(got[:255], want[:255])
    assert ref.decode_ue8m0(torch.tensor([0], dtype=torch.uint8)).item() == 2.0**-127  # not zero


def test_ue8m0_packing_is_little_endian_groups():
    b = torch.tensor([[1, 2, 3, 4, 250, 251, 252, 254]], dtype=torch.uint8)
    words = ref.pack_ue8m0(b)
    assert words.dtype == torch.int32
    assert (words[0, 0].item() & 0xFFFFFFFF) == 0x04030201
    assert torch.equal(ref.unpack_ue8m0(words), b)


def test_rceil_is_not_the_library_e8m0_rounding():
    v = torch.tensor([1.0, 1.25, 1.5, 3.0, 0.75])
    rceil = 2.0 ** ref.ceil_exponent(v).double()
    assert rceil.tolist() == [1.0, 2.0, 2.0, 4.0, 1.0]
    # torch and ml_dtypes round to nearest (half up): 1.25 -> 1, where RCEIL needs 2.
    assert v.to(torch.float8_e8m0fnu).float().tolist() == [1.0, 1.0, 2.0, 4.0, 1.0]
    assert v.numpy().astype(ml_dtypes.float8_e8m0fnu).astype(np.float32).tolist() == [1.0, 1.0, 2.0, 4.0, 1.0]
    # zero: RCEIL gives byte 0 (2^-127); ml_dtypes gives NaN (0xFF).
    assert ref.ceil_exponent(torch.tensor([0.0])).item() == -127
    assert np.array([0.0], np.float32).astype(ml_dtypes.float8_e8m0fnu).view(np.uint8)[0] == 0xFF


def test_ceil_exponent_brackets_every_positive_normal():
    g = torch.Generator().manual_seed(3)
    v = torch.exp2(torch.rand(100_000, generator=g) * 200 - 100)
    v = torch.cat([v, torch.exp2(torch.arange(-126, 128).float())])
    e = ref.ceil_exponent(v).double()
    assert (torch.exp2(e) >= v.double()).all() and (torch.exp2(e - 1) < v.double()).all()


# ---------------------------------------------------------------------------------------------- BF16


def test_bf16_encode_matches_torch_rne():
    bits = torch.arange(65536, dtype=torch.int32)
    x = ref.decode_bf16(bits)
    x = x[~torch.isnan(x)]
    near = torch.cat([x, torch.nextafter(x, x + 1), torch.nextafter(x, x - 1), _inputs(seed=2)])
    near = near[~torch.isnan(near)]
    assert torch.equal(ref.encode_bf16(near), ref.bf16_bits(near.to(torch.bfloat16)))


def test_bf16_nan_is_canonical():
    x = torch.tensor([float("nan"), -float("nan")])
    assert ref.encode_bf16(x).tolist() == [0x7FFF, 0x7FFF]
    assert torch.equal(ref.bf16_bits(ref.bf16_tensor(torch.tensor([0x8001, 0x7F80]))), torch.tensor([0x8001, 0x7F80]))
