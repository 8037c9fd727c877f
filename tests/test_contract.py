"""The host <-> kernel contract has one definition (megamoe/jit/contract.py): the committed C++
header is exactly what it generates, and the packer puts every field at the offset the header's
static_asserts pin. CPU only."""

import struct

import pytest

from megamoe.jit import contract


def test_committed_contract_header_is_what_the_python_definition_generates():
    assert contract.header_path().read_text() == contract.header(), (
        "kernel/gemm/contract.cuh is stale: run python -m megamoe.jit.contract"
    )


def test_packed_parameters_put_each_field_at_its_offset():
    values = {f.name: (bytes([i]) * 128 if f.kind == "tmap" else 1000 + i) for i, f in enumerate(contract.PARAMS)}
    values["clamp_value"] = 1.5
    b = contract.pack_params(**values)
    assert len(b) == contract.PARAMS_BYTES
    for i, f in enumerate(contract.PARAMS):
        o = contract.OFFSETS[f.name]
        if f.kind == "tmap":
            assert b[o : o + 128] == bytes([i]) * 128
        elif f.kind == "ptr":
            assert struct.unpack_from("<Q", b, o)[0] == 1000 + i
        elif f.kind == "i32":
            assert struct.unpack_from("<i", b, o)[0] == 1000 + i
    assert struct.unpack_from("<f", b, contract.OFFSETS["clamp_value"])[0] == 1.5


def test_packing_refuses_a_missing_or_unknown_field():
    values = {f.name: (bytes(128) if f.kind == "tmap" else 0) for f in contract.PARAMS}
    with pytest.raises(KeyError, match="missing"):
        contract.pack_params(**{k: v for k, v in values.items() if k != "err"})
    with pytest.raises(KeyError, match="unknown"):
        contract.pack_params(**values, bogus=1)


def test_the_scaled_tables_are_exact_within_fourteen_binades_and_zero_from_nineteen():
    from megamoe.reference import formats as F
    from megamoe.reference import quantize as Q

    lut = F.decode_e4m3(Q.scaled_fp4_lut()).double()
    mags = F.decode_e2m1(__import__("torch").arange(8, dtype=__import__("torch").uint8)).double()
    for d in range(Q.FAST_LUT_ENTRIES):
        want = mags * 2.0 ** (Q.FAST_LUT_HEADROOM - d)
        if d <= Q.FAST_EXACT_BINADES:
            assert (lut[d] == want).all(), d
        else:
            assert not (lut[d] == want).all(), d
    assert (lut[Q.FAST_LUT_ENTRIES - 1] == 0).all() and (lut[Q.FAST_LUT_ENTRIES - 2] != 0).any()
