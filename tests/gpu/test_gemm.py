"""SM90 grouped GEMM on the GPU: D5/D7 GEMM_BOUND (random data) and GEMM_EXACT (grid-snapped),
D6 bit-exact given the dumped acc1 (both SiLU modes, with and without clamp), D8 bit-exact given
acc2, padding rows never written, debug and production builds agree.

Run: pytest -s tests/gpu/test_gemm.py  (prints the measured max ratio to the GEMM_BOUND)."""

from __future__ import annotations

import pytest
import torch


from megamoe import gemm as G
from megamoe.jit import layout as L

from .gemm_helpers import (
    COUNTS,
    Pool,
    bound_ratio,
    check_l2_epilogue,
    combine_rows,
    first_diff,
    log_result,
    pool_l1,
    pool_l2,
    random_weights,
    reference_acc,
    worst_bound_ratio,
)

from .gemm_helpers import check_l1_epilogue as _check_l1_epilogue
from .gemm_helpers import setup_l1 as _setup_l1


# H or I = 384: an odd number of K blocks (the exact mode takes K % 256 == 128; a loop of whole
# pairs of K blocks would run half a pair past the end).
@pytest.mark.parametrize(
    "H,inter,max_tile", [(1024, 1024, 8), (1024, 1024, 64), (2048, 1024, 32), (384, 384, 8), (384, 384, 64)]
)
def test_l1_bound_and_epilogue(H, inter, max_tile):
    pool, (w1, s1, _, _), kw = _setup_l1(H, inter, COUNTS, seed=max_tile + H)
    ref = reference_acc(pool, pool.x, pool.sf, w1, s1)
    worst = 0.0
    for fast in (True, False):
        for clamp in (None, 1.0):
            out = torch.full((pool.P, inter), 0x55, dtype=torch.uint8, device="cuda").view(torch.float8_e4m3fn)
            out_sf = torch.full((pool.P, inter // 32), 0x55, dtype=torch.uint8, device="cuda")
            res = pool_l1(
                pool,
                kw,
                fast_math=fast,
                activation_clamp=clamp,
                max_tile=max_tile,
                debug=True,
                out=out,
                out_sf=out_sf,
            )
            torch.cuda.synchronize()
            for e, (exact, bound) in ref.items():
                worst = max(worst, bound_ratio(res.acc1[pool.rows(e)], exact, bound))
            # padding rows: never written (dump stays NaN, outputs keep the poison)
            pad = ~pool.valid
            assert torch.isnan(res.acc1[pad]).all(), "acc1 written on padding rows"
            assert (res.l2_acts.view(torch.uint8)[pad] == 0x55).all(), "l2_acts written on padding rows"
            assert (res.l2_sf[pad] == 0x55).all(), "l2_sf written on padding rows"
            _check_l1_epilogue(pool, res, inter, fast, clamp, f"H{H} I{inter} tile{max_tile} fast{fast} clamp{clamp}")
    log_result(test="l1_bound", H=H, I=inter, max_tile=max_tile, promotion="k32", max_ratio=worst, tau=G.TAU["k32"])
    assert worst <= G.TAU["k32"], f"GEMM_BOUND: max ratio {worst} > tau {G.TAU['k32']}"


def test_l1_production_build_matches_debug():
    H, inter = 1024, 1024
    pool, _, kw = _setup_l1(H, inter, COUNTS, seed=7)
    a = pool_l1(pool, kw, max_tile=64, debug=True)
    b = pool_l1(pool, kw, max_tile=64, debug=False)
    c = pool_l1(pool, kw, debug=False)  # auto tile
    torch.cuda.synchronize()
    v = pool.valid
    for other in (b, c):
        assert torch.equal(a.l2_acts.view(torch.uint8)[v], other.l2_acts.view(torch.uint8)[v])
        assert torch.equal(a.l2_sf[v], other.l2_sf[v])


@pytest.mark.parametrize("H,inter", [(1024, 1024), (2048, 4096)])
def test_gemm_exact_grid(H, inter):
    """GEMM_EXACT: small integers, small scale spread -> every partial sum exact: acc == exact bitwise."""
    counts = [3, 0, 65, 130]
    pool, (w1, s1, w2, s2), kw = _setup_l1(H, inter, counts, seed=11, grid=True)
    res = pool_l1(pool, kw, debug=True)
    gen = torch.Generator().manual_seed(12)
    pool2 = Pool(counts, inter, gen=gen, grid=True)
    comb = torch.zeros(sum(counts), H, dtype=torch.bfloat16, device="cuda")
    dst = torch.full((pool2.P,), -1, dtype=torch.int32, device="cuda")
    dst[pool2.valid] = torch.arange(sum(counts), dtype=torch.int32, device="cuda")
    res2 = G.l2_gemm(pool2.x, pool2.sf, pool2.offsets, pool2.expert_rows, dst, kw, comb, debug=True)
    torch.cuda.synchronize()
    for e, (exact, _) in reference_acc(pool, pool.x, pool.sf, w1, s1).items():
        got = res.acc1[pool.rows(e)]
        assert torch.equal(got, exact.to(torch.float32)), f"L1 GEMM_EXACT expert {e}: {first_diff(got, exact.float())}"
        assert torch.equal(exact.to(torch.float32).to(torch.float64), exact), "test inputs not exact in fp32"
    for e, (exact, _) in reference_acc(pool2, pool2.x, pool2.sf, w2, s2).items():
        got = res2.acc2[pool2.rows(e)]
        assert torch.equal(got, exact.to(torch.float32)), f"L2 GEMM_EXACT expert {e}: {first_diff(got, exact.float())}"
    log_result(test="gemm_exact", H=H, I=inter, ok=True)


@pytest.mark.parametrize(
    "H,inter,max_tile",
    [(1024, 1024, 8), (1024, 1024, 64), (1024, 1024, 32), (2048, 1024, 16), (384, 384, 8), (384, 384, 64)],
)
def test_l2_bound_and_epilogue(H, inter, max_tile):
    gen = torch.Generator().manual_seed(100 + max_tile)
    pool = Pool(COUNTS, inter, gen=gen)
    E = len(COUNTS)
    w1, s1 = random_weights(E, 2 * inter, H, gen=gen)
    w2, s2 = random_weights(E, H, inter, gen=gen)
    kw = L.transform_weights(w1, s1, w2, s2)
    T, K = sum(COUNTS), 2
    comb, dst = combine_rows(pool, H, K, gen=gen)  # a random choice of T of the K * T rows
    res = pool_l2(pool, dst, kw, comb, max_tile=max_tile, debug=True)
    torch.cuda.synchronize()
    worst = worst_bound_ratio(res.acc2, pool, w2, s2)
    check_l2_epilogue(pool, res.acc2, comb, dst, "k32")
    assert torch.isnan(res.acc2[~pool.valid]).all(), "acc2 written on padding rows"
    flat = comb.view(K * T, H)
    untouched = torch.ones(K * T, dtype=torch.bool, device="cuda")
    untouched[dst[pool.valid].long()] = False
    assert torch.isnan(flat[untouched].float()).all(), "combine rows written that no pool row maps to"
    log_result(test="l2_bound", H=H, I=inter, max_tile=max_tile, promotion="k32", max_ratio=worst, tau=G.TAU["k32"])
    assert worst <= G.TAU["k32"], f"GEMM_BOUND: max ratio {worst} > tau {G.TAU['k32']}"


@pytest.mark.parametrize("H,inter", [(7168, 2048), (4096, 2048)])
def test_chain_large_shapes(H, inter):
    """L1 -> L2 on the production shapes, L2 fed with the kernel's own l2_acts (SPEC D7)."""
    counts = [1, 0, 65, 17]
    pool, (w1, s1, w2, s2), kw = _setup_l1(H, inter, counts, seed=5)
    l1 = pool_l1(pool, kw, debug=True)
    T = sum(counts)
    comb = torch.zeros(1, T, H, dtype=torch.bfloat16, device="cuda")
    dst = torch.full((pool.P,), -1, dtype=torch.int32, device="cuda")
    dst[pool.valid] = torch.arange(T, dtype=torch.int32, device="cuda")
    acts = l1.l2_acts.view(torch.uint8).clone()
    acts[~pool.valid] = 0
    sfs = l1.l2_sf.clone()
    sfs[~pool.valid] = 127
    l2 = G.l2_gemm(acts, sfs, pool.offsets, pool.expert_rows, dst, kw, comb, debug=True)
    torch.cuda.synchronize()
    w1r, w2r = 0.0, 0.0
    for e, (exact, bound) in reference_acc(pool, pool.x, pool.sf, w1, s1).items():
        w1r = max(w1r, bound_ratio(l1.acc1[pool.rows(e)], exact, bound))
    _check_l1_epilogue(pool, l1, inter, True, None, f"chain H{H}")
    for e, (exact, bound) in reference_acc(pool, acts, sfs, w2, s2).items():
        w2r = max(w2r, bound_ratio(l2.acc2[pool.rows(e)], exact, bound))
    log_result(test="chain", H=H, I=inter, l1_ratio=w1r, l2_ratio=w2r, tau=G.TAU["k32"])
    assert w1r <= G.TAU["k32"] and w2r <= G.TAU["k32"]


def _wide_spread_l1_ratio(promotion: str) -> float:
    """L1 on scale bytes spread over 60 binades: the largest |acc - exact| / sum|ab|."""
    H, inter = 1024, 1024
    gen = torch.Generator().manual_seed(3)
    pool = Pool([40, 129], H, gen=gen, sf_lo=97, sf_hi=157)
    w1, s1 = random_weights(2, 2 * inter, H, gen=gen, sf_lo=90, sf_hi=150)
    w2, s2 = random_weights(2, H, inter, gen=gen)
    kw = L.transform_weights(w1, s1, w2, s2)
    res = pool_l1(pool, kw, promotion=promotion, debug=True)
    torch.cuda.synchronize()
    return worst_bound_ratio(res.acc1, pool, w1, s1)


def test_wide_scale_spread():
    """Adversarial scales (bytes spread over 60 binades) for the tau calibration."""
    worst = _wide_spread_l1_ratio("k32")
    log_result(test="wide_spread", max_ratio=worst, tau=G.TAU["k32"])
    assert worst <= G.TAU["k32"]


# ------------------------------------------------------------------------------------------------
# fast promotion (K128 promotion, weight scales in the LUT, activations rebased per K128)
# ------------------------------------------------------------------------------------------------


# Expert sizes whose token blocks take every width of the four-warpgroup kernels' one mainloop at
# max_tile 64 (items of 1-8, 9-16, 17-32 and 33-64 rows: 100 = 64 + 36, 130 = 64 + 64 + 2).
WIDTH_COUNTS = [3, 12, 16, 17, 32, 0, 33, 64, 100, 130]
# A skewed routing with more items than the H200's 132 CTAs (42 token blocks: 336 L1 items, 168
# L2), so that the four-warpgroup kernel's CTAs each take several items of unequal width.
SKEW_COUNTS = [700, 3, 9, 17, 33, 0, 64, 200, 5, 1, 70, 150, 2, 2, 2, 2, 40, 600]
FAST_CASES = [(8, COUNTS), (64, COUNTS), (64, WIDTH_COUNTS), (64, SKEW_COUNTS), (128, COUNTS), (256, COUNTS)]


def _fast_case_id(case):
    tile, counts = case
    return f"tile{tile}" + {id(WIDTH_COUNTS): "-widths", id(SKEW_COUNTS): "-skew"}.get(id(counts), "")


@pytest.mark.parametrize("max_tile,counts", FAST_CASES, ids=[_fast_case_id(c) for c in FAST_CASES])
def test_fast_l1_bound_and_epilogue(max_tile, counts):
    H, inter = 2048, 1024
    if max_tile == 64:  # the case is there for the four-warpgroup kernel's widths
        assert G.spec_for(1, promotion="k128", n_rows=2 * inter, max_tile=64).wgs == 4
    pool, (w1, s1, _, _), kw = _setup_l1(H, inter, counts, seed=200 + max_tile + len(counts))
    ref = reference_acc(pool, pool.x, pool.sf, w1, s1)  # against the ORIGINAL per-32 operands
    res = pool_l1(
        pool,
        kw,
        promotion="k128",
        max_tile=max_tile,
        debug=True,
        activation_clamp=1.0,
    )
    torch.cuda.synchronize()
    worst = max(bound_ratio(res.acc1[pool.rows(e)], ex, b) for e, (ex, b) in ref.items())
    _check_l1_epilogue(pool, res, inter, True, 1.0, f"fast tile{max_tile}")
    log_result(
        test="fast_l1_bound", H=H, I=inter, max_tile=max_tile, promotion="k128", max_ratio=worst, tau=G.TAU["k128"]
    )
    assert worst <= G.TAU["k128"]


@pytest.mark.parametrize("max_tile,counts", FAST_CASES, ids=[_fast_case_id(c) for c in FAST_CASES])
def test_fast_l2_bound_and_epilogue(max_tile, counts):
    H, inter = 1024, 2048
    if max_tile == 64:
        assert G.spec_for(2, promotion="k128", n_rows=H, max_tile=64).wgs == 4
    gen = torch.Generator().manual_seed(300 + max_tile + len(counts))
    pool = Pool(counts, inter, gen=gen)
    E = len(counts)
    w1, s1 = random_weights(E, 2 * inter, H, gen=gen)
    w2, s2 = random_weights(E, H, inter, gen=gen)
    kw = L.transform_weights(w1, s1, w2, s2)
    comb, dst = combine_rows(pool, H)  # valid pool rows to combine rows in order
    res = pool_l2(pool, dst, kw, comb, promotion="k128", max_tile=max_tile, debug=True)
    torch.cuda.synchronize()
    worst = worst_bound_ratio(res.acc2, pool, w2, s2)
    check_l2_epilogue(pool, res.acc2, comb, dst, "k128")
    log_result(
        test="fast_l2_bound", H=H, I=inter, max_tile=max_tile, promotion="k128", max_ratio=worst, tau=G.TAU["k128"]
    )
    assert worst <= G.TAU["k128"]


def test_fast_gemm_exact_grid():
    """GEMM_EXACT in the fast promotion: integers, equal scales (sums stay inside the tensor core's
    ~13-bit accumulator over a K128 block) -> acc == exact bitwise."""
    H, inter = 1024, 1024
    counts = [5, 70]
    gen = torch.Generator().manual_seed(21)
    pool = Pool(counts, H, gen=gen, grid=True, grid_sf=(127, 127))
    w1, s1 = random_weights(2, 2 * inter, H, gen=gen, grid=True, grid_sf=(125, 127))
    w2, s2 = random_weights(2, H, inter, gen=gen, grid=True, grid_sf=(127, 127))
    kw = L.transform_weights(w1, s1, w2, s2)
    res = pool_l1(pool, kw, promotion="k128", debug=True)
    torch.cuda.synchronize()
    for e, (exact, _) in reference_acc(pool, pool.x, pool.sf, w1, s1).items():
        got = res.acc1[pool.rows(e)]
        assert torch.equal(got, exact.to(torch.float32)), (
            f"fast GEMM_EXACT expert {e}: {first_diff(got, exact.float())}"
        )
    log_result(test="fast_gemm_exact", ok=True)


def test_rebase_k128_exact_when_representable():
    gen = torch.Generator().manual_seed(4)
    x = torch.randint(0x38, 0x60, (4, 256), generator=gen, dtype=torch.int32).to(torch.uint8).cuda()
    sf = torch.randint(125, 128, (4, 8), generator=gen, dtype=torch.int32).to(torch.uint8).cuda()
    xq, s128 = G.rebase_k128(x, sf)
    from .gemm_helpers import dequant_fp8

    a = dequant_fp8(x, sf)
    b = xq.view(torch.float8_e4m3fn).double() * torch.pow(2.0, s128.double() - 127).repeat_interleave(128, -1)
    assert torch.equal(a, b)
