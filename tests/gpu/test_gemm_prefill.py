"""The prefill path (predecode pass + kernel/gemm/gemm_sm90_prefill.cuh), both promotions, on the
GPU: D5/D7 inside GEMM_BOUND tau, D6 / D8 bit-exact given its own dumped accumulators, GEMM_EXACT
on grid-snapped data, padding rows never written, the production build equal to the debug build,
and the entry points' choice of path. (The SPEC edges through it: tests/gpu/test_gemm_edges.py.)

Run: pytest -s tests/gpu/test_gemm_prefill.py"""

from __future__ import annotations

import copy

import pytest
import torch

from megamoe import gemm as G
from megamoe import runtime
from megamoe.jit import build as jb
from megamoe.jit import contract
from megamoe.jit import layout as L
from megamoe.reference import MegaMoEInputError

from .gemm_helpers import (
    COUNTS,
    Pool,
    bound_ratio,
    check_l1_epilogue,
    check_l2_epilogue,
    combine_rows,
    first_diff,
    log_result,
    pool_l1,
    pool_l2,
    prefill_weights,
    random_weights,
    reference_acc,
    setup_l1,
    worst_bound_ratio,
)

# Experts of 0 and 1 rows, one token block just under / at / over 128, several blocks with a
# partial last one.
PREFILL_COUNTS = [0, 1, 127, 128, 129, 300, 64, 5]
# 49 token blocks: 392 items at 2048 weight rows, about three per CTA on the H200's 132, so the
# epilogue warps' staging buffer changes hands between items (both barrier parities, a second
# write into it) in every CTA.
MANY_ITEMS = [1500, 1300, 129, 5, 700, 2000, 0, 1]
# The exact mode's prefill path folds the weight scales of the blocks the tests' weights give (all);
# "k32/unfolded" runs the same weights on its two-scale promotion (gemm_helpers.prefill_weights).
PROMOTIONS = ["k32", "k32/unfolded", "k128"]


@pytest.mark.parametrize("promotion", PROMOTIONS)
@pytest.mark.parametrize(
    "H,inter,counts",
    [(1024, 1024, COUNTS), (2048, 1024, PREFILL_COUNTS), (512, 2048, [600, 3]), (512, 1024, MANY_ITEMS)],
)
def test_prefill_l1_bound_and_epilogue(H, inter, counts, promotion):
    pool, (w1, s1, _, _), kw = setup_l1(H, inter, counts, seed=H + inter + len(counts))
    promotion, kw = prefill_weights(promotion, kw)
    ref = reference_acc(pool, pool.x, pool.sf, w1, s1)
    for fast, clamp in ((True, 1.0), (False, None)):
        out = torch.full((pool.P, inter), 0x55, dtype=torch.uint8, device="cuda").view(torch.float8_e4m3fn)
        out_sf = torch.full((pool.P, inter // 32), 0x55, dtype=torch.uint8, device="cuda")
        res = pool_l1(
            pool,
            kw,
            promotion=promotion,
            prefill=True,
            fast_math=fast,
            activation_clamp=clamp,
            debug=True,
            out=out,
            out_sf=out_sf,
        )
        torch.cuda.synchronize()
        worst = max(bound_ratio(res.acc1[pool.rows(e)], ex, b) for e, (ex, b) in ref.items())
        check_l1_epilogue(pool, res, inter, fast, clamp, f"prefill {promotion}")
        pad = ~pool.valid
        assert (out.view(torch.uint8)[pad] == 0x55).all(), "prefill L1 wrote a padding row"
        assert (out_sf[pad] == 0x55).all(), "prefill L1 wrote a padding row's scales"
        log_result(
            test="prefill_l1_bound", promotion=promotion, H=H, I=inter, fast=fast, max_ratio=worst, tau=G.TAU[promotion]
        )
        assert worst <= G.TAU[promotion]


@pytest.mark.parametrize("promotion", PROMOTIONS)
@pytest.mark.parametrize("H,inter,counts", [(1024, 2048, COUNTS), (2048, 512, PREFILL_COUNTS), (2048, 512, MANY_ITEMS)])
def test_prefill_l2_bound_and_epilogue(H, inter, counts, promotion):
    gen = torch.Generator().manual_seed(400 + H + len(counts))
    pool = Pool(counts, inter, gen=gen)
    E = len(counts)
    w1, s1 = random_weights(E, 2 * inter, H, gen=gen)
    w2, s2 = random_weights(E, H, inter, gen=gen)
    promotion, kw = prefill_weights(promotion, L.transform_weights(w1, s1, w2, s2))
    comb, dst = combine_rows(pool, H, K=2, gen=gen)  # random rows of a [2, T, H] buffer, the rest NaN
    res = pool_l2(pool, dst, kw, comb, promotion=promotion, prefill=True, debug=True)
    torch.cuda.synchronize()
    worst = worst_bound_ratio(res.acc2, pool, w2, s2)
    check_l2_epilogue(pool, res.acc2, comb, dst, f"prefill {promotion}")
    written = torch.zeros(comb.shape[0] * comb.shape[1], dtype=torch.bool, device="cuda")
    written[dst[pool.valid].long()] = True
    assert comb.view(-1, H)[~written].isnan().all(), "prefill L2 wrote a combine row no pool row maps to"
    log_result(test="prefill_l2_bound", promotion=promotion, H=H, I=inter, max_ratio=worst, tau=G.TAU[promotion])
    assert worst <= G.TAU[promotion]


@pytest.mark.parametrize("promotion", PROMOTIONS)
def test_prefill_gemm_exact_grid(promotion):
    """GEMM_EXACT: integers, equal scales -> acc == exact bitwise."""
    H, inter = 1024, 1024
    counts = [5, 200, 0, 130]
    gen = torch.Generator().manual_seed(22)
    pool = Pool(counts, H, gen=gen, grid=True, grid_sf=(127, 127))
    w1, s1 = random_weights(4, 2 * inter, H, gen=gen, grid=True, grid_sf=(125, 127))
    w2, s2 = random_weights(4, H, inter, gen=gen, grid=True, grid_sf=(127, 127))
    promotion, kw = prefill_weights(promotion, L.transform_weights(w1, s1, w2, s2))
    res = pool_l1(pool, kw, promotion=promotion, prefill=True, debug=True)
    torch.cuda.synchronize()
    for e, (exact, _) in reference_acc(pool, pool.x, pool.sf, w1, s1).items():
        got = res.acc1[pool.rows(e)]
        assert torch.equal(got, exact.to(torch.float32)), (
            f"prefill {promotion} GEMM_EXACT expert {e}: {first_diff(got, exact.float())}"
        )
    log_result(test="prefill_gemm_exact", promotion=promotion, ok=True)


@pytest.mark.parametrize("promotion", PROMOTIONS)
def test_prefill_production_build_matches_debug(promotion):
    H, inter = 1024, 512
    pool, _, kw = setup_l1(H, inter, PREFILL_COUNTS, seed=9)
    promotion, kw = prefill_weights(promotion, kw)
    outs = []
    for debug in (True, False):
        res = pool_l1(
            pool,
            kw,
            promotion=promotion,
            prefill=True,
            debug=debug,
        )
        torch.cuda.synchronize()
        outs.append((res.l2_acts.view(torch.uint8)[pool.valid].clone(), res.l2_sf[pool.valid].clone()))
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])


def _scratch(layer: int, promotion: str, tiles: int) -> torch.Tensor:
    """The prefill path's scratch buffer of `layer` with `tiles` weight tiles, [tiles, tile bytes]."""
    size = contract.PREFILL_TILE_BYTES[promotion]
    (buf,) = [b for (_, _, lay, n), b in runtime._SCRATCH.items() if lay == layer and n == tiles * size]
    return buf.view(tiles, size)


@pytest.mark.parametrize("layer", [1, 2])
def test_exact_mode_folded_blocks_give_the_two_scale_promotions_bits(layer):
    """The exact mode's prefill path folds a 128-row block's weight scales into its predecoded bytes
    where every row spans at most 11 binades (layout.fold_blocks) and promotes each k32 product with
    one FMA (gemm_sm90_prefill.cuh): the same bits as the two-scale promotion. Weights whose rows
    span up to 11 binades (the most that folds) but one row of 22 (its block does not fold), 10 % of
    the activations E4M3 subnormals, several items per CTA: the flags as computed, then half of them
    cleared (folded and two-scale items alternate in a CTA's ring), against no block folded: D5 / D7
    and the layer's output bitwise equal. The folded tiles are the fast mode's predecoded bytes."""
    if layer == 1:
        H, inter, K, R = 512, 1024, 512, 2048
    else:
        H, inter, K, R = 2048, 512, 512, 2048
    E = len(MANY_ITEMS)
    gen = torch.Generator().manual_seed(77 + layer)
    pool = Pool(MANY_ITEMS, K, gen=gen, sf_lo=100, sf_hi=140)
    sub = (torch.rand(pool.x.shape, generator=gen) < 0.1).cuda() & pool.valid[:, None]
    codes = torch.randint(1, 8, pool.x.shape, generator=gen, dtype=torch.int32).to(torch.uint8).cuda()
    pool.x[sub] = codes[sub] | (pool.x[sub] & 0x80)  # subnormal payloads, the signs kept
    w1, s1 = random_weights(E, 2 * inter, H, gen=gen, sf_lo=111, sf_hi=122)
    w2, s2 = random_weights(E, H, inter, gen=gen, sf_lo=111, sf_hi=122)
    (s1 if layer == 1 else s2)[1, 700, 3] = 100
    kw = L.transform_weights(w1, s1, w2, s2)
    name = "w1_fold" if layer == 1 else "w2_fold"
    fold = getattr(kw, name)
    assert int((fold == 0).sum()) == 1 and int(fold.sum()) == fold.numel() - 1, fold.tolist()
    half = copy.copy(kw)
    setattr(half, name, fold * (torch.rand(fold.shape, generator=gen) < 0.5).to(fold.device, torch.uint8))
    none = copy.copy(kw)
    setattr(none, name, torch.zeros_like(fold))
    rows = contract.PREFILL_ROWS["k32"]  # a block; the fast mode's tile is two blocks' bytes, in order
    comb, dst = combine_rows(pool, H, K=2, gen=torch.Generator().manual_seed(5))

    def run(weights, promotion="k32"):
        if layer == 1:
            res = pool_l1(pool, weights, promotion=promotion, prefill=True, debug=True)
            torch.cuda.synchronize()
            return res.acc1[pool.valid].clone(), res.l2_acts.view(torch.uint8)[pool.valid].clone()
        res = pool_l2(pool, dst, weights, comb, promotion=promotion, prefill=True, debug=True)
        torch.cuda.synchronize()
        return res.acc2[pool.valid].clone(), comb.view(torch.uint8).clone()

    want = run(none)
    assert torch.isfinite(want[0]).all() and want[0].abs().max() > 0
    for weights, tag in ((kw, "flags as computed"), (half, "half the flags")):
        got = run(weights)
        a, b = got[0].view(torch.int32), want[0].view(torch.int32)
        assert torch.equal(a, b), f"{tag}: folded vs two-scale promotion: {first_diff(a, b)}"
        assert torch.equal(got[1], want[1]), f"{tag}: the layer's output differs"
    # The last run's tiles (half the flags) against the fast mode's predecode pass of the same weights.
    exact_tiles = _scratch(layer, "k32", E * (K // 128) * (R // rows)).view(E, K // 128, R // rows, -1)
    exact_tiles = exact_tiles[..., : rows * 128].clone()
    run(kw, "k128")
    fast = _scratch(layer, "k128", E * (K // 128) * (R // contract.PREFILL_ROWS["k128"]))
    fast_tiles = fast.view(E, K // 128, R // rows, rows * 128)
    flags = getattr(half, name).bool()[:, None, :].expand(E, K // 128, R // rows)
    assert torch.equal(exact_tiles[flags], fast_tiles[flags]), "a folded tile is not the fast mode's bytes"
    assert not torch.equal(exact_tiles[~flags], fast_tiles[~flags])
    log_result(test="exact_fold_bits", layer=layer, folded_blocks=int(fold.sum()), blocks=fold.numel())


def test_the_entry_points_refuse_a_forced_prefill_path_they_cannot_take():
    """(The choice itself is tested on the CPU: tests/test_gemm_host.py.)"""
    pool, _, kw = setup_l1(512, 512, [3, 2], seed=1)
    with pytest.raises(MegaMoEInputError, match="prefill"):
        pool_l1(
            pool,
            kw,
            promotion="k128",
            prefill=True,
            max_tile=64,
        )
    assert jb.PrefillSpec(layer=1, promotion="k128").rows_per_cta == G.PREFILL_ROWS["k128"] == 256
    assert jb.PrefillSpec(layer=1, promotion="k32").rows_per_cta == G.PREFILL_ROWS["k32"] == 128
    with pytest.raises(MegaMoEInputError, match="prefill"):
        pool_l1(pool, kw, promotion="k32", prefill=True, wgs=2)


@pytest.mark.parametrize("promotion", ["k32", "k128"])
def test_prefill_cached_replays_and_the_automatic_choice_agree_with_a_fresh_launch(promotion):
    """The production call as the benchmark makes it (out / out_sf given, k128 with x_sf128, no
    debug): the first call builds and caches the predecode + GEMM pair, the next ones replay it;
    with max_tokens past the crossover the entry point picks the prefill path by itself. All equal
    to prefill=True."""
    H, inter = 512, 512
    counts = [520, 530]
    pool, _, kw = setup_l1(H, inter, counts, seed=31)
    x, x128 = G.rebase_k128(pool.x, pool.sf) if promotion == "k128" else (pool.x, None)
    assert G.use_prefill(1, max(counts), pool.P / len(counts), promotion, 2 * inter)

    out = torch.empty(pool.P, inter, dtype=torch.float8_e4m3fn, device="cuda")
    out_sf = torch.empty(pool.P, inter // 32, dtype=torch.uint8, device="cuda")

    def call(**kw_):
        G.l1_gemm(
            x,
            x128 if promotion == "k128" else pool.sf,
            pool.offsets,
            pool.expert_rows,
            pool.w_route,
            kw,
            promotion=promotion,
            out=out,
            out_sf=out_sf,
            x_sf128=x128,
            **kw_,
        )
        torch.cuda.synchronize()
        return out.view(torch.uint8)[pool.valid].clone(), out_sf[pool.valid].clone()

    want = call(prefill=True)
    out.view(torch.uint8).fill_(0x55)
    out_sf.fill_(0x55)
    for _ in range(3):  # first call, then cached replays into the same buffers
        got = call(max_tokens=max(counts))
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_two_weight_sets_share_a_stream_and_its_scratch_in_order():
    """Two layers' calls in a row on one stream, each predecoding into the scratch buffer of its
    shape, interleaved with a second set of the same shape: each result equals its own call alone."""
    H, inter = 512, 512
    pool, _, kw_a = setup_l1(H, inter, [300, 5], seed=41)
    _, _, kw_b = setup_l1(H, inter, [300, 5], seed=42)
    args = (pool.x, pool.sf, pool.offsets, pool.expert_rows, pool.w_route)
    alone = []
    for kw in (kw_a, kw_b):
        res = G.l1_gemm(*args, kw, promotion="k128", prefill=True)
        torch.cuda.synchronize()
        alone.append(res.l2_acts.view(torch.uint8)[pool.valid].clone())
    outs = [G.l1_gemm(*args, kw, promotion="k128", prefill=True) for kw in (kw_a, kw_b, kw_a)]
    torch.cuda.synchronize()
    for res, want in zip(outs, (alone[0], alone[1], alone[0])):
        assert torch.equal(res.l2_acts.view(torch.uint8)[pool.valid], want)
    G.release_prefill_buffers()
    res = G.l1_gemm(*args, kw_b, promotion="k128", prefill=True)
    torch.cuda.synchronize()
    assert torch.equal(res.l2_acts.view(torch.uint8)[pool.valid], alone[1])
