"""The whole reference pipeline: default shape, metamorphic properties, shapes at tile boundaries."""

import dataclasses
import time

import torch
from hypothesis import given, strategies as st

from megamoe import reference as ref
from megamoe.reference import points as P

SMALL = ref.MoEConfig(
    hidden=256, intermediate=128, num_experts=8, top_k=2, num_ranks=2, max_tokens_per_rank=40, block_m=16
)


def _run(cfg, inputs, weights):
    return ref.run_reference(cfg, inputs, weights)


def _bits(y: torch.Tensor) -> torch.Tensor:
    return ref.bf16_bits(y)


def test_default_shape_runs_in_seconds():
    cfg = ref.DEFAULT_CONFIG
    inputs = ref.make_inputs(cfg, seed=0)
    weights = ref.random_weights(cfg.num_experts, cfg.hidden, cfg.intermediate, seed=0)
    t0 = time.perf_counter()
    res = _run(cfg, inputs, weights)
    elapsed = time.perf_counter() - t0
    print(f"default shape {cfg}: reference {elapsed:.2f} s")
    assert elapsed < 60  # about 0.3 s here; the bound only catches a pathological slowdown
    assert all(torch.isfinite(y.float()).all() and y.float().abs().sum() > 0 for y in res.y)
    # every tensor of the dump-point table, nothing else (tests/test_points.py checks dtypes and shapes)
    assert set(res.dumps[0]) == set(P.NAMES)


def test_nan_weight_of_a_masked_slot_changes_nothing():
    inputs = ref.make_inputs(SMALL, seed=1, masked_ratio=0.3)
    weights = ref.random_weights(8, 256, 128, seed=1)
    before = _run(SMALL, inputs, weights)
    for inp in inputs:
        inp.topk_weights[inp.topk_idx < 0] = float("nan")
    after = _run(SMALL, inputs, weights)
    for a, b in zip(before.y, after.y):
        assert torch.equal(_bits(a), _bits(b))


def test_permuting_tokens_permutes_y():
    cfg = dataclasses.replace(SMALL, num_ranks=1, num_experts=4)
    inp = ref.make_inputs(cfg, seed=2)[0]
    weights = ref.random_weights(4, 256, 128, seed=2)
    perm = torch.randperm(inp.num_tokens, generator=torch.Generator().manual_seed(0))
    permuted = ref.RankInputs(
        inp.x[perm].contiguous(),
        inp.x_sf[perm].contiguous(),
        inp.topk_idx[perm].contiguous(),
        inp.topk_weights[perm].contiguous(),
    )
    y = _run(cfg, [inp], weights).y[0]
    y_perm = _run(cfg, [permuted], weights).y[0]
    assert torch.equal(_bits(y[perm]), _bits(y_perm))


def test_expert_parallel_invariance():
    """The same global batch split over R = 1, 2, 4, 8 ranks gives the same y bits."""
    base = ref.MoEConfig(
        hidden=256, intermediate=128, num_experts=16, top_k=4, num_ranks=1, max_tokens_per_rank=64, block_m=16
    )
    global_batch = ref.make_inputs(base, 64, seed=3, distribution="skewed", masked_ratio=0.1)[0]
    weights = ref.random_weights(16, 256, 128, seed=3)
    want = _bits(_run(base, [global_batch], weights).y[0])
    for r in (2, 4, 8):
        cfg = dataclasses.replace(base, num_ranks=r)
        parts = ref.split_global_batch(global_batch, r)
        ys = _run(cfg, parts, weights).y
        assert torch.equal(torch.cat([_bits(y) for y in ys]), want), f"R={r}"


def test_nan_in_x_reaches_only_its_own_token():
    cfg = dataclasses.replace(SMALL, num_ranks=1, num_experts=4)
    inp = ref.make_inputs(cfg, seed=4)[0]
    weights = ref.random_weights(4, 256, 128, seed=4)
    clean = _run(cfg, [inp], weights).y[0]
    x = ref.as_codes(inp.x).clone()
    x[7, 100] = 0x7F
    poisoned = _run(cfg, [dataclasses.replace(inp, x=ref.as_float8(x))], weights).y[0]
    assert torch.isnan(poisoned[7].float()).all()
    others = torch.arange(inp.num_tokens) != 7
    assert torch.equal(_bits(poisoned[others]), _bits(clean[others]))


def test_tokens_without_experts_give_positive_zero():
    cfg = dataclasses.replace(SMALL, num_ranks=1, num_experts=4)
    inp = ref.make_inputs(cfg, seed=5)[0]
    inp.topk_idx[:5] = -1
    y = _run(cfg, [inp], ref.random_weights(4, 256, 128, seed=5)).y[0]
    assert (_bits(y[:5]) == 0).all()


def test_cleanup_accumulates_receive_statistics():
    inputs = ref.make_inputs(SMALL, seed=6)
    weights = ref.random_weights(8, 256, 128, seed=6)
    first = _run(SMALL, inputs, weights)
    stats = [d[P.D10_RECV_STATS] for d in first.dumps]
    second = ref.run_reference(SMALL, inputs, weights, recv_stats=stats)
    for d1, d2 in zip(first.dumps, second.dumps):
        assert torch.equal(d2[P.D10_RECV_STATS], 2 * d1[P.D2_RECV_TOTALS].long())


@given(
    tokens=st.lists(st.sampled_from([0, 1, 15, 16, 17, 31, 32, 33]), min_size=2, max_size=2),
    distribution=st.sampled_from(ref.DISTRIBUTIONS),
    masked_ratio=st.sampled_from([0.0, 0.25, 1.0]),
    clamp=st.sampled_from([None, 0.5, 7.0]),
    fast_math=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_shapes_routings_and_masks(tokens, distribution, masked_ratio, clamp, fast_math, seed):
    cfg = dataclasses.replace(SMALL, activation_clamp=clamp, fast_math=fast_math)
    inputs = ref.make_inputs(cfg, tokens, seed=seed, distribution=distribution, masked_ratio=masked_ratio)
    res = _run(cfg, inputs, ref.random_weights(8, 256, 128, seed=seed % 7))
    for rank, (inp, y, dump) in enumerate(zip(inputs, res.y, res.dumps)):
        assert y.shape == (inp.num_tokens, 256)
        assert torch.isfinite(y.float()).all()
        empty = (inp.topk_idx < 0).all(dim=1)
        assert (_bits(y[empty]) == 0).all()
        assert int(dump[P.D4_BLOCK_ARRIVALS].sum()) == int(dump[P.D2_RECV_TOTALS].sum())
        if clamp is not None:
            a = ref.dequantize_e4m3(dump[P.D6_L2_ACTS], dump[P.D6_L2_SF])
            assert (a.abs() <= clamp * clamp * 1.2 + 1e-6).all()  # |silu(g)·u·w| <= c·c·|w|, |w| <= 1
