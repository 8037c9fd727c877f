"""The gate/up interleave of granularity 8 (SPEC §2; step 1 of megamoe.jit.layout.transform_weights) and its
exact inverse."""

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
