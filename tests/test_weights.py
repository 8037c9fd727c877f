"""The gate/up interleave of granularity 8 (step 1 of transform_weights, SPEC §2) and its exact inverse."""
import torch
from hypothesis import given, strategies as st

from megamoe import reference as ref


def test_interleave_layout():
    e, i, x = 1, 16, 1
    rows = torch.arange(2 * i).reshape(1, 2 * i, 1)
    got = ref.interleave_gate_up(rows)[0, :, 0].tolist()
    assert got == list(range(0, 8)) + list(range(16, 24)) + list(range(8, 16)) + list(range(24, 32))


@given(e=st.integers(1, 3), blocks=st.integers(1, 4), x=st.integers(1, 5), seed=st.integers(0, 100))
def test_interleave_inverse_is_exact(e, blocks, x, seed):
    rows = torch.randint(0, 256, (e, 16 * blocks, x), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))
    assert torch.equal(ref.deinterleave_gate_up(ref.interleave_gate_up(rows)), rows)


def test_interleave_weights_round_trip():
    w = ref.random_weights(4, 256, 128, seed=3)
    t = ref.interleave_weights(w)
    assert t.w1_sf.dtype == torch.int32 and t.w1_sf.shape == (4, 256, 2)
    back = ref.deinterleave_weights(t)
    for a, b in zip((w.w1, w.w1_sf, w.w2, w.w2_sf), (back.w1, back.w1_sf, back.w2, back.w2_sf)):
        assert torch.equal(a, b)
