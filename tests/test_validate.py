"""SPEC §7: every kind of bad input raises MegaMoEInputError naming the argument, the expected and
the actual value, before anything runs."""

import dataclasses

import pytest
import torch

from megamoe import reference as ref
from megamoe.reference import MegaMoEInputError

CFG = ref.MoEConfig(
    hidden=256, intermediate=128, num_experts=8, top_k=2, num_ranks=2, max_tokens_per_rank=16, block_m=16
)


@pytest.fixture
def call():
    return ref.make_inputs(CFG, 16, seed=0), ref.random_weights(8, 256, 128, seed=0)


def _expect(call, match, **changes):
    inputs, weights = call
    bad = dataclasses.replace(inputs[1], **changes)
    with pytest.raises(MegaMoEInputError, match=match):
        ref.run_reference(CFG, [inputs[0], bad], weights)


def test_wrong_dtype(call):
    _expect(
        call,
        r"argument 'topk_weights': expected dtype torch.float32, got torch.float64",
        topk_weights=call[0][1].topk_weights.double(),
    )


def test_wrong_shape(call):
    _expect(call, r"argument 'x_sf': expected shape \[16, 8\], got \[16, 4\]", x_sf=call[0][1].x_sf[:, :4].contiguous())


def test_wrong_device(call):
    _expect(call, r"argument 'topk_idx': expected device cpu, got meta", topk_idx=call[0][1].topk_idx.to("meta"))


def test_not_contiguous(call):
    w = call[0][1].topk_weights
    _expect(
        call,
        r"argument 'topk_weights': expected a contiguous tensor",
        topk_weights=torch.empty(w.shape[1], w.shape[0]).T.copy_(w),
    )


def test_too_many_tokens(call):
    inp = ref.make_inputs(dataclasses.replace(CFG, max_tokens_per_rank=17), 17)[1]
    _expect(
        call,
        r"argument 'x': expected at most T_max = 16 tokens \(rank 1\), got 17",
        x=inp.x,
        x_sf=inp.x_sf,
        topk_idx=inp.topk_idx,
        topk_weights=inp.topk_weights,
    )


def test_expert_out_of_range(call):
    idx = call[0][1].topk_idx.clone()
    idx[3, 1] = 8
    _expect(call, r"argument 'topk_idx': expected expert ids in \[-1, 8\), got 8 at \[3, 1\]", topk_idx=idx)


def test_duplicate_expert(call):
    idx = call[0][1].topk_idx.clone()
    idx[5] = torch.tensor([2, 2])
    _expect(
        call,
        r"argument 'topk_idx': expected distinct experts within a token, got expert 2 twice in token 5",
        topk_idx=idx,
    )


def test_nan_scale_byte(call):
    sf = call[0][1].x_sf.clone()
    sf[2, 3] = 255
    _expect(
        call, r"argument 'x_sf': expected UE8M0 scale bytes in \[0, 254\] \(255 is NaN\), got 255 at \[2, 3\]", x_sf=sf
    )


def test_nan_weight_scale_byte(call):
    inputs, weights = call
    weights.w2_sf[1, 2, 3] = 255
    with pytest.raises(MegaMoEInputError, match=r"argument 'w2_sf'.*255 at \[1, 2, 3\]"):
        ref.run_reference(CFG, inputs, weights)


@pytest.mark.parametrize(
    "field,value,match",
    [
        ("hidden", 200, r"argument 'hidden': expected a positive multiple of 128, got 200"),
        ("intermediate", 96, r"argument 'intermediate': expected a positive multiple of 128, got 96"),
        ("num_experts", 7, r"argument 'num_experts': expected a positive multiple of num_ranks = 2, got 7"),
        ("top_k", 9, r"argument 'top_k': expected a value in \[1, 8\], got 9"),
    ],
)
def test_unsupported_shapes(field, value, match):
    with pytest.raises(MegaMoEInputError, match=match):
        dataclasses.replace(CFG, **{field: value})


def test_misaligned_base_address(call):
    x = ref.as_codes(call[0][1].x)
    storage = torch.zeros(x.numel() + 1, dtype=torch.uint8)
    shifted = storage[1:].view(x.shape)  # contiguous, but one byte past an aligned address
    shifted.copy_(x)
    _expect(
        call,
        r"argument 'x': expected a 16-byte aligned base address, got address 0x[0-9a-f]+ \(offset 1 bytes",
        x=ref.as_float8(shifted),
    )
