"""The gate/up interleave of granularity 8 (SPEC §2; step 1 of megamoe.jit.layout.transform_weights) and its
exact inverse; random_weights' expert-by-expert draw."""

import torch
from hypothesis import given, strategies as st

from megamoe import reference as ref


def test_interleave_layout():
    i = 16
    rows = torch.arange(2 * i).reshape(1, 2 * i, 1)
    got = ref.interleave_gate_up(rows)[0, :, 0].tolist()
    assert got == list(range(0, 8)) + list(range(16, 24)) + list(range(8, 16)) + list(range(24, 32))


@given(e=st.integers(1, 3), blocks=st.integers(1, 4), x=st.integers(1, 5), seed=st.integers(0, 100))
def test_interleave_inverse_is_exact(e, blocks, x, seed):
    rows = torch.randint(0, 256, (e, 16 * blocks, x), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))
    assert torch.equal(ref.deinterleave_gate_up(ref.interleave_gate_up(rows)), rows)


def test_random_weights_drawn_one_expert_at_a_time_are_the_whole_draw_quantized():
    # random_weights draws and quantizes expert by expert (on the device asked for); the numbers
    # must be those of one draw of the whole tensors, quantized at once (SPEC §1's host utility).
    from megamoe.reference.quantize import quantize_weights

    e, h, i = 3, 256, 128
    g = torch.Generator().manual_seed(7)
    w1 = quantize_weights(torch.randn(e, 2 * i, h, generator=g) / h**0.5)
    w2 = quantize_weights(torch.randn(e, h, i, generator=g) / i**0.5)
    got = ref.random_weights(e, h, i, seed=7)
    for want, have in zip((w1.codes, w1.scales, w2.codes, w2.scales), (got.w1, got.w1_sf, got.w2, got.w2_sf)):
        assert torch.equal(want, have)
