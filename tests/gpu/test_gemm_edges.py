"""The SPEC §1 edges through the SM90 GEMMs, with hard assertions: scale bytes 0 and 254 with
non-zero payloads, scale products under 2^-126, all-zero groups, NaN payloads in valid rows (with
and without a clamp), and weight scales spread over more than 17 binades inside one K128 block,
where the fast mode (promotion k128) must follow its documented operand rule exactly
(megamoe.reference.quantize.dequantize_fp4_fast and rebase_k128). Also: a cached launch replayed
from a CUDA graph gives the eager bits, so do prepared calls (prepare_l1_gemm / prepare_l2_gemm), and
the swap-AB kernels' dynamic item order runs every item once per launch.

Run: pytest -s tests/gpu/test_gemm_edges.py"""

from __future__ import annotations

import copy

import pytest
import torch

from megamoe import gemm as G
from megamoe import runtime
from megamoe import reference as ref
from megamoe.jit import layout as L

from .gemm_helpers import (
    Pool,
    bound_ratio,
    check_l1_epilogue,
    check_l2_epilogue,
    combine_rows,
    log_result,
    pool_l1,
    pool_l2,
    prefill_weights,
    random_weights,
    reference_acc,
    setup_l1,
    worst_bound_ratio,
)


# (promotion, max_tile, wgs): the 4-warpgroup 8-token kernel, the 2-warpgroup kernel whose items run
# at 8 tokens, the 4-warpgroup 64-token kernel (one serial mainloop, items 8 .. 64 wide) and the
# 2-warpgroup one it replaces where the weight rows do not fill 256-row CTAs, and the largest tiles;
# (None, None): the prefill path of that promotion (predecode pass + gemm_sm90_prefill.cuh; the exact
# mode's with its weight scales folded where the blocks allow, which the tests' weights all do, and
# "k32/unfolded": its two-scale promotion).
KERNELS = [
    ("k32", 8, 4),
    ("k32", 64, 2),
    ("k32", None, None),
    ("k32/unfolded", None, None),
    ("k128", None, None),
    ("k128", 8, 4),
    ("k128", 8, 2),
    ("k128", 64, 4),
    ("k128", 64, 2),
    ("k128", 128, 2),
    ("k128", 256, 2),
]


def _kernel(promotion, max_tile, wgs, debug):
    """The launch arguments of one of KERNELS (max_tile None: the promotion's prefill path)."""
    return dict(promotion=promotion, max_tile=max_tile, wgs=wgs, prefill=max_tile is None, debug=debug)


def _launch_l1(pool, kw, promotion, max_tile, wgs, debug=True, **kwargs):
    """An L1 launch (by default the debug build) of one of KERNELS, synchronised."""
    res = pool_l1(pool, kw, **_kernel(promotion, max_tile, wgs, debug), **kwargs)
    torch.cuda.synchronize()
    return res


def _launch_l2(pool, dst, kw, comb, promotion, max_tile, wgs, debug=False):
    """An L2 launch (by default the release build) of one of KERNELS, synchronised."""
    res = pool_l2(pool, dst, kw, comb, **_kernel(promotion, max_tile, wgs, debug))
    torch.cuda.synchronize()
    return res


def _experts_with_scale_ranges(ranges, H, inter, counts, seed):
    """A pool and L1 weights where expert e's token scale bytes lie in ranges[e][0] and its weight
    scale bytes in ranges[e][1] (inclusive)."""
    gen = torch.Generator().manual_seed(seed)
    pool = Pool(counts, H, gen=gen)
    ws, ss = [], []
    for e, ((xlo, xhi), (wlo, whi)) in enumerate(ranges):
        r = pool.rows(e)
        pool.sf[r] = (
            torch.randint(xlo, xhi + 1, pool.sf[r].shape, generator=gen, dtype=torch.int32).to(torch.uint8).cuda()
        )
        w, s = random_weights(1, 2 * inter, H, gen=gen, sf_lo=wlo, sf_hi=whi)
        ws.append(w)
        ss.append(s)
    w1, s1 = torch.cat(ws), torch.cat(ss)
    w2, s2 = random_weights(len(counts), H, inter, gen=gen)
    return pool, w1, s1, L.transform_weights(w1, s1, w2, s2)


@pytest.mark.parametrize("promotion,max_tile,wgs", KERNELS)
def test_scale_bytes_0_and_254_and_underflowing_scale_products_reach_the_kernel(promotion, max_tile, wgs):
    """Expert 0: token bytes 253-254 (2^126, 2^127) against weight bytes 1-10; expert 1: token bytes
    0-5 (byte 0 is 2^-127) against weight bytes 245-254; expert 2: bytes 55-65 on both sides, whose
    scale product (about 2^-134) is under fp32's normal range while every result is normal. Every
    accumulator is finite and within tau of the fp64 sum; D6 is bit-exact from it."""
    H, inter = 1024, 512
    ranges = [((253, 254), (1, 10)), ((0, 5), (245, 254)), ((55, 65), (55, 65))]
    pool, w1, s1, kw = _experts_with_scale_ranges(ranges, H, inter, [9, 7, 20], seed=1)
    name = promotion
    promotion, kw = prefill_weights(promotion, kw)
    res = _launch_l1(pool, kw, promotion, max_tile, wgs)
    worst = 0.0
    for e, (exact, bound) in reference_acc(pool, pool.x, pool.sf, w1, s1).items():
        got = res.acc1[pool.rows(e)]
        assert torch.isfinite(got).all(), f"expert {e}: non-finite accumulators"
        assert (exact.abs() > 2.0**-126).float().mean() > 0.9, "test data: results should be normal numbers"
        worst = max(worst, bound_ratio(got, exact, bound))
    check_l1_epilogue(pool, res, inter, True, None, f"extreme scales {name} tile {max_tile}")
    log_result(
        test="extreme_scale_bytes",
        promotion=name,
        max_tile=max_tile,
        wgs=wgs,
        max_ratio=worst,
        tau=G.TAU[promotion],
    )
    assert worst <= G.TAU[promotion], f"GEMM_BOUND: max ratio {worst} > tau {G.TAU[promotion]}"


@pytest.mark.parametrize("promotion,max_tile,wgs", KERNELS)
@pytest.mark.parametrize("clamp", [None, 2.0])
def test_nan_payloads_and_all_zero_groups_in_valid_rows(promotion, max_tile, wgs, clamp):
    """A NaN code (0x7F) in a valid row makes every accumulator of that row NaN and nothing else;
    all-zero 32-groups (payload 0) of tokens and weights are exact zeros. D6 follows SPEC §3 D6's
    NaN rule (clamp propagates NaN, amax ignores it) bit for bit, from the dumped accumulators."""
    H, inter = 1024, 512
    gen = torch.Generator().manual_seed(5)
    counts = [5, 40]
    pool = Pool(counts, H, gen=gen)
    w1, s1 = random_weights(2, 2 * inter, H, gen=gen)
    w2, s2 = random_weights(2, H, inter, gen=gen)
    w1[:, 3, 0:16] = 0  # row 3, group 0 of every expert: all-zero weights
    w1[:, 10, 48:64] = 0  # row 10, group 3
    nan_rows = [pool.offs[0] + 2, pool.offs[1] + 17]
    for p in nan_rows:
        pool.x[p, 100] = 0x7F
    zero_rows = [pool.offs[1] + 3]
    for p in zero_rows:
        pool.x[p, 32:64] = 0  # token group 1 all zero
    name = promotion
    promotion, kw = prefill_weights(promotion, L.transform_weights(w1, s1, w2, s2))
    res = _launch_l1(pool, kw, promotion, max_tile, wgs, activation_clamp=clamp)
    nan_mask = torch.zeros(pool.P, dtype=torch.bool, device="cuda")
    nan_mask[nan_rows] = True
    assert torch.isnan(res.acc1[nan_rows]).all(), "a NaN payload must reach every accumulator of its row"
    for e, (exact, bound) in reference_acc(pool, pool.x, pool.sf, w1, s1).items():
        rows = pool.rows(e)
        keep = ~nan_mask[rows]
        assert not torch.isnan(res.acc1[rows][keep]).any(), "NaN leaked into another row"
        assert bound_ratio(res.acc1[rows][keep], exact[keep], bound[keep]) <= G.TAU[promotion]
    check_l1_epilogue(pool, res, inter, True, clamp, f"NaN rows {name} tile {max_tile} clamp {clamp}")


def _fast_rule_reference(pool: Pool, w, w_sf):
    """Per expert: the fp64 sum of the fast mode's own operands (rebase_k128 of the tokens, the
    scaled-table weights: reference.fast_gemm_f64) and its bound."""
    out = {}
    for e, n in enumerate(pool.counts):
        if n == 0:
            continue
        r = pool.rows(e)
        args = (pool.x[r], pool.sf[r], w[e], w_sf[e])
        out[e] = (ref.fast_gemm_f64(*args), ref.fast_gemm_f64(*args, absolute=True))
    return out


def _wide_spreads(counts, seed):
    """A pool and L1 weights (H 1024, I 512) whose scales spread over 17 binades in every K128 block:
    weight groups 124, 107, 107, 107 and token groups 110, 127, 127, 127."""
    H, inter = 1024, 512
    gen = torch.Generator().manual_seed(seed)
    pool = Pool(counts, H, gen=gen)
    pool.sf[pool.valid] = torch.tensor([110, 127, 127, 127], dtype=torch.uint8, device="cuda").repeat(H // 128)
    w1, s1 = random_weights(len(counts), 2 * inter, H, gen=gen)
    s1[:] = torch.tensor([124, 107, 107, 107], dtype=torch.uint8).repeat(H // 128).to(s1.device)
    w2, s2 = random_weights(len(counts), H, inter, gen=gen)
    return pool, w1, s1, L.transform_weights(w1, s1, w2, s2)


@pytest.mark.parametrize("max_tile,wgs", [(8, 4), (64, 4), (128, 2), (256, 2), (None, None)])
def test_fast_mode_follows_its_operand_rule_on_wide_scale_spreads(max_tile, wgs):
    """In every K128 block, weight group 0 has scale byte 124 and groups 1-3 have 107 (17 binades
    under it: the scaled tables round them onto E4M3's subnormal grid), and token group 0 has 110
    while groups 1-3 have 127 (rebase_k128 shifts group 0 by 2^-17), so every group carries a
    comparable share of each sum. The fast mode's accumulators are within tau of the fp64 sum of its
    own documented operands, and far from that of the original ones (so the rule is what is tested)."""
    pool, w1, s1, kw = _wide_spreads([30, 70], seed=9)
    assert ref.quantize.fast_rounded_rows(s1) == s1.shape[0] * s1.shape[1], (
        "test data: every row exceeds the exact window"
    )
    res = _launch_l1(pool, kw, "k128", max_tile, wgs)
    rule = max(bound_ratio(res.acc1[pool.rows(e)], ex, b) for e, (ex, b) in _fast_rule_reference(pool, w1, s1).items())
    original = worst_bound_ratio(res.acc1, pool, w1, s1)
    log_result(
        test="fast_rule_wide_spread", max_tile=max_tile, rule_ratio=rule, original_ratio=original, tau=G.TAU["k128"]
    )
    assert rule <= G.TAU["k128"], f"fast mode off its own operand rule: ratio {rule}"
    assert original > 16 * G.TAU["k128"], "the data should show the rule (the original operands differ)"


@pytest.mark.parametrize("max_tile,wgs", [(8, 4), (64, 2), (None, None)])
def test_exact_mode_stays_inside_tau_on_wide_scale_spreads(max_tile, wgs):
    """The fast-mode test's data (weight groups 17 binades apart inside every K128 block, token groups
    17 apart): the exact mode promotes every k32 product with both of its scales, so it stays within
    its tau of the fp64 sum of the original operands."""
    pool, w1, s1, kw = _wide_spreads([30, 140], seed=10)
    res = _launch_l1(pool, kw, "k32", max_tile, wgs)
    worst = worst_bound_ratio(res.acc1, pool, w1, s1)
    log_result(test="exact_wide_spread", max_tile=max_tile, max_ratio=worst, tau=G.TAU["k32"])
    assert worst <= G.TAU["k32"], f"exact mode off its tau on wide spreads: ratio {worst}"
    check_l1_epilogue(pool, res, 512, True, None, f"exact wide spread tile {max_tile}")


def test_cached_launch_replays_from_a_cuda_graph_with_the_eager_bits():
    """After a first call (compile, tensor maps, packed parameters), L1 and L2 launches are captured in
    a CUDA graph; replaying it writes the eager outputs bit for bit. Prints the host time per call."""
    import time

    H, inter = 1024, 512
    gen = torch.Generator().manual_seed(13)
    counts = [3, 60, 130]
    pool = Pool(counts, H, gen=gen)
    w1, s1 = random_weights(3, 2 * inter, H, gen=gen)
    w2, s2 = random_weights(3, H, inter, gen=gen)
    kw = L.transform_weights(w1, s1, w2, s2)
    x128, sf128 = G.rebase_k128(pool.x, pool.sf)
    out = torch.empty(pool.P, inter, dtype=torch.uint8, device="cuda")
    out_sf = torch.empty(pool.P, inter // 32, dtype=torch.uint8, device="cuda")
    comb, dst = combine_rows(pool, H)

    def call():
        G.l1_gemm(
            x128,
            pool.sf,
            pool.offsets,
            pool.expert_rows,
            pool.w_route,
            kw,
            promotion="k128",
            x_sf128=sf128,
            out=out,
            out_sf=out_sf,
            max_tokens=130,
        )
        G.l2_gemm(out, out_sf, pool.offsets, pool.expert_rows, dst, kw, comb, promotion="k32", max_tokens=130)

    call()
    torch.cuda.synchronize()
    want = (out.clone(), out_sf.clone(), comb.clone())
    n = 200
    t0 = time.perf_counter()
    for _ in range(n):
        call()
    host_us = (time.perf_counter() - t0) / (2 * n) * 1e6
    torch.cuda.synchronize()
    out.fill_(0x55)
    comb.fill_(float("nan"))
    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s), torch.cuda.graph(g, stream=s):
        call()
    torch.cuda.current_stream().wait_stream(s)
    g.replay()
    torch.cuda.synchronize()
    log_result(test="graph_replay", host_us_per_launch=host_us)
    v = pool.valid  # padding rows are never written: they keep the poison
    assert torch.equal(out[v], want[0][v]) and torch.equal(out_sf[v], want[1][v])
    assert torch.equal(comb.view(torch.int16), want[2].view(torch.int16))


@pytest.mark.parametrize("prefill", [False, True], ids=["swap-AB", "prefill"])
def test_a_prepared_call_writes_the_entry_points_bits_again_from_a_graph_and_past_a_buffer_release(prefill):
    """prepare_l1_gemm / prepare_l2_gemm on the tensors of an l1_gemm / l2_gemm call: called three
    times, then from a CUDA graph captured on their stream, they write the entry points' bits; the
    prefill path's prepared calls keep their scratch buffer through release_prefill_buffers(). Under
    another stream a prepared call is an input error and launches nothing. Prints the host time of
    a prepared call and of a repeated entry point call."""
    import time

    from megamoe.reference import MegaMoEInputError

    H, inter = 1024, 512
    pool, _, kw = setup_l1(H, inter, [3, 60, 130], seed=21)
    out = torch.empty(pool.P, inter, dtype=torch.uint8, device="cuda")
    out_sf = torch.empty(pool.P, inter // 32, dtype=torch.uint8, device="cuda")
    comb, dst = combine_rows(pool, H)
    l1_args = (pool.x, pool.sf, pool.offsets, pool.expert_rows, pool.w_route, kw)
    l2_args = (out, out_sf, pool.offsets, pool.expert_rows, dst, kw, comb)
    opts = dict(promotion="k32", prefill=prefill, max_tokens=130)
    G.l1_gemm(*l1_args, **opts, out=out, out_sf=out_sf)
    G.l2_gemm(*l2_args, **opts)
    torch.cuda.synchronize()
    want = (out.clone(), out_sf.clone(), comb.clone())
    v = pool.valid  # padding rows are never written

    def poison():
        out.fill_(0x55)
        out_sf.fill_(0x55)
        comb.fill_(float("nan"))
        torch.cuda.synchronize()

    def check(tag):
        torch.cuda.synchronize()
        assert torch.equal(out[v], want[0][v]) and torch.equal(out_sf[v], want[1][v]), f"{tag}: L1 bits"
        assert torch.equal(comb.view(torch.int16), want[2].view(torch.int16)), f"{tag}: L2 bits"

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        l1 = G.prepare_l1_gemm(*l1_args, **opts, out=out, out_sf=out_sf)
        l2 = G.prepare_l2_gemm(*l2_args, **opts)
    G.release_prefill_buffers()  # the prepared calls keep theirs
    poison()
    with torch.cuda.stream(s):
        for _ in range(3):
            assert l1() is l1.result and l1.result.l2_acts is out
            l2()
    check("prepared, eager")
    poison()
    with pytest.raises(MegaMoEInputError, match="runs on the stream it was prepared on"):
        l1()  # the current stream is not s
    torch.cuda.synchronize()
    assert (out[v] == 0x55).all(), "a prepared call refused under another stream launched"
    g = torch.cuda.CUDAGraph()
    with torch.cuda.stream(s), torch.cuda.graph(g, stream=s):
        l1()
        l2()
    g.replay()
    check("prepared, graph replay")

    n = 200
    with torch.cuda.stream(s):
        t0 = time.perf_counter()
        for _ in range(n):
            l1()
        prepared_us = (time.perf_counter() - t0) / n * 1e6
        t0 = time.perf_counter()
        for _ in range(n):
            G.l1_gemm(*l1_args, **opts, out=out, out_sf=out_sf)
        entry_us = (time.perf_counter() - t0) / n * 1e6
    torch.cuda.synchronize()
    log_result(test="prepared_call", prefill=prefill, prepared_us=prepared_us, entry_point_us=entry_us)


# The swap-AB kernels' dynamic item order (kernel/gemm/scheduler.cuh claim_item): the exact mode's
# and the fast mode's kernels with four and two consumer warpgroups, on pools of (experts, H, I): 40
# experts of 1-70 tokens (L1: up to ~1600 items, many per CTA), 2 experts of 1 and 8 tokens (fewer
# items than CTAs), and in the exact mode items of 1 and 2 K blocks (K = 128 / 256: the TMA thread
# claims at its item's first stage; k128 needs K % 512 == 0).
# (promotion, max_tile, wgs); max_tile None: the promotion's prefill kernel (its predecode pass first).
DYNAMIC_KERNELS = [
    ("k32", 8, 4),
    ("k32", 64, 2),
    ("k128", 8, 4),
    ("k128", 64, 4),
    ("k128", 256, 2),
    ("k32", None, None),
    ("k128", None, None),
]
DYNAMIC_POOLS = [(40, 512, 1024), (2, 512, 512), (40, 256, 128)]


def _item_counters() -> list[torch.Tensor]:
    """This device's chunks of item counter pairs (megamoe.runtime.item_counter)."""
    return runtime._ITEM_COUNTERS[torch.cuda.current_device()]


def _counters_zero() -> bool:
    return not any(c.any() for c in _item_counters())


@pytest.mark.parametrize("promotion,max_tile,wgs", DYNAMIC_KERNELS)
@pytest.mark.parametrize("E,H,inter", DYNAMIC_POOLS)
def test_every_item_runs_in_each_launch_of_the_dynamic_order_which_leaves_its_counters_zero(
    promotion, max_tile, wgs, E, H, inter
):
    """Both layers: the debug launch is inside tau with D6 / D8 bit-exact from its dumps; then three
    production launches each write every valid row (the outputs are poisoned before each) with the
    debug launch's bits, and leave every item counter zero. (An item run twice would write the same
    bits: not seen here.) Negative control (the first pool): with the claim counters left at 5 by a
    broken reset, a launch skips items and the poison check sees it."""
    if promotion == "k128" and (H % 512 or inter % 512):
        pytest.skip("the fast mode needs K % 512 == 0")
    counts = [(7 * e) % 70 + 1 for e in range(E)]
    pool, (w1, s1, w2, s2), kw = setup_l1(H, inter, counts, seed=40 + E)
    fast = promotion == "k128"
    tau = G.TAU[promotion]
    res = _launch_l1(pool, kw, promotion, max_tile, wgs)
    worst = worst_bound_ratio(res.acc1, pool, w1, s1)
    assert worst <= tau, f"L1 off its tau: ratio {worst}"
    check_l1_epilogue(pool, res, inter, fast, None, f"dynamic order {promotion} tile {max_tile}")
    v = pool.valid
    out = torch.empty(pool.P, inter, dtype=torch.uint8, device="cuda")
    out_sf = torch.empty(pool.P, inter // 32, dtype=torch.uint8, device="cuda")

    def l1():
        out.fill_(0x7F)  # a NaN code: every valid row must be rewritten
        out_sf.fill_(0xFF)
        _launch_l1(pool, kw, promotion, max_tile, wgs, debug=False, out=out, out_sf=out_sf)

    want_q, want_sf = res.l2_acts.view(torch.uint8)[v], res.l2_sf[v]
    for i in range(3):
        l1()
        assert torch.equal(out[v], want_q) and torch.equal(out_sf[v], want_sf), f"L1 launch {i}: rows lost"
        assert _counters_zero(), f"L1 launch {i} left its item counters non-zero"
    if (E, H, inter) == DYNAMIC_POOLS[0]:
        for c in _item_counters():
            c[0::2] = 5  # every launch's claim counter, as a broken reset would leave it
        l1()
        skipped = (out[v] != want_q).any(1).sum().item()
        for c in _item_counters():
            c.zero_()
        assert skipped > 0, "negative control: items skipped by a non-zero claim counter went unnoticed"

    # L2 on the L1 output (K = inter; the fast mode rebases it per K128 before the launch).
    l2_pool = copy.copy(pool)  # the L1 output as the L2 activations
    l2_pool.x, l2_pool.sf = res.l2_acts.view(torch.uint8), res.l2_sf
    comb, dst = combine_rows(pool, H)

    def l2(debug=False):
        return _launch_l2(l2_pool, dst, kw, comb, promotion, max_tile, wgs, debug=debug)

    r2 = l2(debug=True)
    worst2 = worst_bound_ratio(r2.acc2, l2_pool, w2, s2)
    assert worst2 <= tau, f"L2 off its tau: ratio {worst2}"
    check_l2_epilogue(pool, r2.acc2, comb, dst, f"dynamic order {promotion} tile {max_tile}")
    want_c = comb.clone()
    for i in range(3):
        comb.fill_(float("nan"))
        l2()
        assert torch.equal(comb.view(torch.int16), want_c.view(torch.int16)), f"L2 launch {i}: rows lost"
        assert _counters_zero(), f"L2 launch {i} left its item counters non-zero"
    log_result(test="dynamic_order", promotion=promotion, max_tile=max_tile, E=E, l1_ratio=worst, l2_ratio=worst2)


@pytest.mark.parametrize("promotion,max_tile,wgs", DYNAMIC_KERNELS)
def test_a_launch_without_items_writes_nothing_and_leaves_its_item_counters_zero(promotion, max_tile, wgs):
    """Every expert empty: every CTA retires without a claim (its first item is past the end)."""
    pool, _, kw = setup_l1(512, 512, [0, 0, 0], seed=7)
    out = torch.full((pool.P, 512), 0x7F, dtype=torch.uint8, device="cuda")
    out_sf = torch.full((pool.P, 16), 0xFF, dtype=torch.uint8, device="cuda")
    for _ in range(2):
        _launch_l1(pool, kw, promotion, max_tile, wgs, debug=False, out=out, out_sf=out_sf)
        assert (out == 0x7F).all() and (out_sf == 0xFF).all(), "a launch without items wrote rows"
        assert _counters_zero(), "a launch without items left its item counters non-zero"


def test_weights_on_another_device_than_the_activations_are_an_input_error_naming_kw():
    """CPU weights with CUDA activations: a MegaMoEInputError naming `kw` before any launch (the kernel
    would dereference host addresses and fault, ending the context)."""
    from megamoe.reference import MegaMoEInputError

    pool, (w1, s1, w2, s2), _ = setup_l1(512, 512, [3, 9], seed=3)
    kw_cpu = L.transform_weights(w1.cpu(), s1.cpu(), w2.cpu(), s2.cpu())
    with pytest.raises(MegaMoEInputError, match="'kw'.*weights on cuda"):
        pool_l1(pool, kw_cpu)
    comb, dst = combine_rows(pool, 512)
    x2 = torch.zeros(pool.P, 512, dtype=torch.uint8, device="cuda")
    sf2 = torch.full((pool.P, 16), 127, dtype=torch.uint8, device="cuda")
    with pytest.raises(MegaMoEInputError, match="'kw'.*weights on cuda"):
        G.l2_gemm(x2, sf2, pool.offsets, pool.expert_rows, dst, kw_cpu, comb)
    torch.cuda.synchronize()  # nothing was launched: the context is intact
