"""The GEMM mainloop's hooks for the fused kernel, exercised through the standalone launch:

* arrival gate (GemmParams::arrival / arrival_block): full counters give the bits of an ungated
  launch; counters raised late by a second stream, over pool rows written just before them (the
  payload, its scales or the routing weights), make the GEMM wait, at every token tile of both
  promotions (tests/gpu/gemm_hooks_worker.py, in subprocesses: a wrong design could trap);
* timeout record: a counter that never fills traps with a record naming it (subprocess, ~10 s);
* outputs through a pointer offset (a peer's buffer in the fused kernel): L1 out / out_sf and the L2
  combine buffer as views into larger buffers, same bits, nothing outside written;
* expert sizes 0, 1, BLOCK_M - 1, BLOCK_M, BLOCK_M + 1 and many (BLOCK_M = pool alignment 64 and
  128) in both promotions, and the exact-promotion L1 at its largest tile.

Run: pytest -s tests/gpu/test_gemm_fused_hooks.py"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch


from megamoe import gemm as G
from megamoe.jit import build as jb
from megamoe.jit import contract

from . import gemm_hooks_worker as W
from .gemm_helpers import (
    COUNTS,
    Pool,
    check_l1_epilogue,
    check_l2_epilogue,
    combine_rows,
    first_diff,
    log_result,
    pool_arrivals,
    pool_l1,
    pool_l2,
    setup_l1,
    worst_bound_ratio,
)


TAU = G.TAU
REPO = Path(__file__).resolve().parents[2]
WORKER_TIMEOUT_S = 900  # one worker: CUDA start-up (EAGER loads every kernel), a group's variants or a trap
SENTINEL_U8 = 0xA5
SENTINEL_BF16 = 0x7FA5  # a NaN payload the kernel never produces (bf16 NaN from the cvt is 0x7FFF)


def _l1(pool, kw, promotion="k32", **kw2):
    return pool_l1(pool, kw, promotion=promotion, **kw2)


def _l2(pool, kw, dst, comb, promotion="k32", **kw2):
    return pool_l2(pool, dst, kw, comb, promotion=promotion, **kw2)


def _l1_outputs(pool, inter, fill=SENTINEL_U8):
    return (
        torch.full((pool.P, inter), fill, dtype=torch.uint8, device="cuda"),
        torch.full((pool.P, inter // 32), fill, dtype=torch.uint8, device="cuda"),
    )


def _bf16_sentinel(*shape):
    return torch.full(shape, SENTINEL_BF16, dtype=torch.int16, device="cuda").view(torch.bfloat16)


# ------------------------------------------------------------------------------------------------
# 1a. arrival gate, counters already full: the standalone launch's bits
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("promotion", ["k32", "k128"])
@pytest.mark.parametrize("block,over", [(64, False), (32, True)])
def test_full_counters_same_bits_l1(promotion, block, over):
    """Counters exactly at each pool block's valid rows (block = the pool alignment) or, with
    block 32, over-full (every counter at `block`): out, out_sf bit-equal to the ungated launch."""
    H, inter = 1024, 1024
    pool, _, kw = setup_l1(H, inter, COUNTS, seed=41)
    arrival = pool_arrivals(pool, block)
    if over:
        arrival.fill_(block)
    ref_out, ref_sf = _l1_outputs(pool, inter)
    out, out_sf = _l1_outputs(pool, inter)
    _l1(pool, kw, promotion, out=ref_out.view(torch.float8_e4m3fn), out_sf=ref_sf)
    res = _l1(
        pool, kw, promotion, out=out.view(torch.float8_e4m3fn), out_sf=out_sf, arrival=arrival, arrival_block=block
    )
    torch.cuda.synchronize()
    assert res.l2_acts.data_ptr() == out.data_ptr()
    assert torch.equal(out, ref_out), f"l2_acts: {first_diff(out, ref_out)}"
    assert torch.equal(out_sf, ref_sf), f"l2_sf: {first_diff(out_sf, ref_sf)}"
    assert torch.equal(arrival, pool_arrivals(pool, block) if not over else torch.full_like(arrival, block)), (
        "the GEMM wrote its arrival counters"
    )


@pytest.mark.parametrize("promotion", ["k32", "k128"])
@pytest.mark.parametrize("max_tile", [None, 8])
def test_full_counters_same_bits_l2(promotion, max_tile):
    H, inter = 1024, 512
    gen = torch.Generator().manual_seed(42)
    _, _, kw = setup_l1(H, inter, [1] * len(COUNTS), seed=43)
    pool = Pool(COUNTS, inter, gen=gen)
    ref, dst = combine_rows(pool, H, K=2, gen=gen)
    ref = _bf16_sentinel(*ref.shape)
    comb = _bf16_sentinel(*ref.shape)
    _l2(pool, kw, dst, ref, promotion, max_tile=max_tile)
    _l2(pool, kw, dst, comb, promotion, max_tile=max_tile, arrival=pool_arrivals(pool, 64), arrival_block=64)
    torch.cuda.synchronize()
    assert torch.equal(comb.view(torch.int16), ref.view(torch.int16)), first_diff(
        comb.view(torch.int16), ref.view(torch.int16)
    )


def test_arrival_arguments_checked():
    H, inter = 1024, 512
    pool, _, kw = setup_l1(H, inter, COUNTS, seed=44)
    good = pool_arrivals(pool, 64)
    cases = [
        (dict(arrival_block=64), ValueError, "without arrival counters"),
        (dict(arrival=good), ValueError, "'arrival_block': expected a positive int"),
        (dict(arrival=good, arrival_block=-64), ValueError, "'arrival_block': expected a positive int"),
        (dict(arrival=good, arrival_block=64.0), ValueError, "'arrival_block': expected a positive int"),
        (dict(arrival=good, arrival_block=32), ValueError, r"'arrival': expected shape \(%d,\)" % (pool.P // 32)),
        (dict(arrival=good.long(), arrival_block=64), TypeError, "'arrival': expected dtype torch.int32"),
        (dict(arrival=good.cpu(), arrival_block=64), ValueError, "'arrival': expected device"),
        (
            dict(arrival=torch.zeros(2 * good.numel(), dtype=torch.int32, device="cuda")[::2], arrival_block=64),
            ValueError,
            "'arrival': expected a contiguous tensor",
        ),
    ]
    for kwargs, exc, msg in cases:
        # SPEC §7's error type, still a TypeError / ValueError for callers that catch those.
        with pytest.raises(exc, match=msg) as info:
            _l1(pool, kw, max_tile=64, **kwargs)
        assert isinstance(info.value, G.MegaMoEInputError)
    comb, dst = combine_rows(Pool(COUNTS, inter, gen=torch.Generator().manual_seed(1)), H)
    with pytest.raises(ValueError, match="'arrival_block': expected a positive int"):
        G.l2_gemm(
            pool.x[:, :inter].contiguous(),
            pool.sf[:, : inter // 32].contiguous(),
            pool.offsets,
            pool.expert_rows,
            dst,
            kw,
            comb,
            max_tile=64,
            arrival=good,
            arrival_block=0,
        )


# ------------------------------------------------------------------------------------------------
# 1b. arrival gate with counters raised late by another stream; 2. the timeout record
# (subprocess: tests/gpu/gemm_hooks_worker.py)
# ------------------------------------------------------------------------------------------------


def _prebuild(variants) -> None:
    """Compiles the worker's specialisations here, several at a time, before it starts: it would
    otherwise compile them one by one on a cold cache, inside its own timeout."""
    specs = {W.spec_of(W.VARIANTS[v]) if isinstance(v, str) else v for v in variants}
    with ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1)) as pool:
        list(pool.map(jb.build, specs))


def _run_worker(*args, module_loading="EAGER", check=True):
    """Runs the worker; returns (its HOOKS_RESULT lines, its output for an assertion message), and
    asserts that it exited 0 unless check is False. module_loading: CUDA_MODULE_LOADING of the
    worker's environment. EAGER by default: every kernel is loaded when the worker starts CUDA, so
    none is loaded while the gated GEMM spins (a second guard beside the worker's own warm-up,
    gemm_hooks_worker.load_filler_kernels, which says why both)."""
    env = dict(os.environ, CUDA_MODULE_LOADING=module_loading)
    proc = subprocess.run(
        [sys.executable, "-m", "tests.gpu.gemm_hooks_worker", *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=WORKER_TIMEOUT_S,
    )
    results = [json.loads(line[len(W.PREFIX) :]) for line in proc.stdout.splitlines() if line.startswith(W.PREFIX)]
    where = (
        f"worker {' '.join(args)} (CUDA_MODULE_LOADING={module_loading}) exited {proc.returncode}\n"
        f"--- stdout\n{proc.stdout[-4000:]}\n--- stderr\n{proc.stderr[-4000:]}"
    )
    assert proc.returncode == 0 or not check, where
    return results, where


def _gate_problem(r):
    """What is wrong with one variant's result of `gemm_hooks_worker gated` (None: nothing)."""
    if "error" in r:
        return (
            f"{r['error']}; trap record: {r.get('timeout_message')} (a record naming an arrival counter "
            f"means the filler stream never ran next to the gated GEMM: a filler kernel loaded while the "
            f"GEMM spun, or no SM left to it; no record means a trap or fault other than the kernel's "
            f"spin timeouts, or a record the trap cut short)"
        )
    if not r["equal"]:
        return (
            f"output differs from the ungated launch ({r['diff']}): the kernel read {r['late']} rows "
            f"before their arrival counters were raised"
        )
    if r["last_block_rows_held"] != r["last_block_rows"]:
        return (
            f"{r['last_block_rows'] - r['last_block_rows_held']} of the {r['last_block_rows']} valid rows "
            f"of pool block {r['last_block']} were written while its counter was short (its rows were "
            f"already real, so only the gate could hold them)"
        )
    if r["rows_done_before_last_count"] == 0:
        return (
            f"none of the other {r['other_rows']} valid rows was written before the last counter was "
            f"raised: the GEMM did not run while the filler did, so the gate was not exercised"
        )
    return None


# Results of `gemm_hooks_worker gated` in this pytest process, by variant. One worker per group of
# variants (layer and promotion) runs those of the group that this session selected: a group pays
# one CUDA start-up, and a trap, which ends its worker's context, costs the rest of its group only.
# A worker that fails as a whole is recorded for each of its variants, so it runs once per group.
_GATED: dict[str, tuple[dict, str]] = {}


def _gated_result(variant, selected):
    if variant not in _GATED:
        group = W.VARIANTS[variant].group
        names = [n for n, v in W.VARIANTS.items() if v.group == group and n not in _GATED and n in selected]
        _prebuild(names)
        results, where = _run_worker("gated", *names, check=False)
        for r in results:
            _GATED[r["variant"]] = (r, where)
        for n in names:
            _GATED.setdefault(n, ({"variant": n, "error": "no result from the worker"}, where))
    return _GATED[variant]


def _selected_variants(request) -> set[str]:
    """The variants of test_arrival_gate_waits_for_late_rows this session runs (-k, node ids)."""
    return {
        item.callspec.params["variant"]
        for item in request.session.items
        if getattr(item, "originalname", None) == "test_arrival_gate_waits_for_late_rows" and hasattr(item, "callspec")
    } | {request.node.callspec.params["variant"]}


@pytest.mark.slow
@pytest.mark.xdist_group("arrival_gate")
@pytest.mark.parametrize("variant", list(W.VARIANTS))
def test_arrival_gate_waits_for_late_rows(variant, request):
    """One input of the pool rows (the payload x, the activation scales x_sf, or w_route) is
    poisoned, and a second stream writes the real rows and then raises the counters, block by block,
    while the GEMM runs, at every token tile of both promotions: the output must be the ungated
    launch's, the last block's output rows must still be untouched just before its counter is
    raised, and other rows must be done by then (the two streams overlapped). (x_sf: the producer's
    scale warp waits at the gate too; w_route: read with coherent loads.)"""
    r, where = _gated_result(variant, _selected_variants(request))
    log_result(test="arrival_gate", **{k: v for k, v in r.items() if k != "diff"})
    if "skipped" in r:
        pytest.skip(r["skipped"])
    p = _gate_problem(r)
    assert p is None, f"{variant}: {p}\n{where}"


@pytest.mark.slow
@pytest.mark.xdist_group("arrival_gate")
def test_filler_warm_up_alone_keeps_lazy_module_loading_from_deadlocking_the_gate():
    """The worker's first guard on its own: under lazy module loading (the default that deadlocked
    with the gated GEMM), loading the filler's kernels before the gated launch is enough. One
    variant per layer (the filler's kernels do not depend on the tile)."""
    variants = ["l1-k32-t32-x", "l2-k128-t128-x_sf"]
    _prebuild(variants)
    results, where = _run_worker("gated", *variants, module_loading="LAZY")
    assert [r["variant"] for r in results] == variants, where
    for r in results:
        log_result(test="arrival_gate_lazy", **{k: v for k, v in r.items() if k != "diff"})
        if "skipped" not in r:
            assert r.get("module_loading", "LAZY") == "LAZY", f"the worker ran with {r['module_loading']}\n{where}"
            p = _gate_problem(r)
            assert p is None, f"{r['variant']}: {p}\n{where}"


@pytest.mark.slow
def test_a_counter_that_never_fills_traps_with_a_record_naming_it():
    """A counter that stays short (pool block 3: 40 of 64 rows) makes the kernel trap after its spin
    timeout; the record, read back by megamoe.gemm.timeout_message(), names that wait, the pool
    block, the expected and the observed count."""
    block, observed = 3, 40
    _prebuild([G.spec_for(1, promotion="k32", n_rows=2 * W.INTER, max_tile=64)])
    results, where = _run_worker("timeout", "--block", str(block), "--observed", str(observed))
    assert len(results) == 1, where
    r = results[0]
    log_result(test="arrival_timeout", elapsed_s=r["elapsed_s"], message=r["timeout_message"], record=r["record"])
    assert r["error"] is not None, f"the launch completed although pool block {block} never filled\n{where}"
    assert r["timeout_message"] is not None, f"trapped ({r['error']}) without a timeout record\n{where}"
    state, what, sm_block, index, expected, seen, thread = r["record"][:7]
    # Word 0: 1 = complete; 2 = claimed and its fields fenced, the completion flag cut short: another
    # waiter that lost the claim trapped at once and ended the kernel (every H200 record so far).
    assert state in (1, 2), f"record state {state}: {r['record']}\n{where}"
    arrival = next(code for code, name in contract.WAITS.items() if name == "arrival counter of pool block")
    assert what == arrival, f"record names wait {what} ({contract.WAITS.get(what)}), expected {arrival}: {r['record']}"
    assert (index, expected, seen) == (block, r["need"], observed), (
        f"record names pool block {index}, expected {expected}, observed {seen}; "
        f"the launch left block {block} at {observed} of {r['need']}: {r['record']}"
    )
    # The waiters at the gate are threads of a CTA's producer warpgroup (warpgroup 0: the TMA thread
    # and the scale warp's lane 0), in a grid of one CTA per SM: either may report.
    assert 0 <= sm_block < r["sms"] and 0 <= thread < 128, f"SM block {sm_block} thread {thread}: {r['record']}"
    want = f"SM block {sm_block} thread {thread}: waited for arrival counter of pool block {block}: "
    want += f"expected {r['need']}, observed {observed}"
    assert r["timeout_message"].startswith(want), f"record: {r['timeout_message']!r}, expected {want!r}"


# ------------------------------------------------------------------------------------------------
# 3. outputs through a pointer offset
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("promotion", ["k32", "k128"])
def test_l1_outputs_into_offset_views(promotion):
    """out at a 16-byte aligned offset (two rows and 16 bytes) into a larger buffer, out_sf at an
    odd byte offset: the view holds the normal launch's bits, the rest of both buffers is untouched."""
    H, inter = 1024, 1024
    pool, _, kw = setup_l1(H, inter, COUNTS, seed=51)
    P, n_sf = pool.P, inter // 32
    ref_out, ref_sf = _l1_outputs(pool, inter)
    _l1(pool, kw, promotion, out=ref_out.view(torch.float8_e4m3fn), out_sf=ref_sf)
    off, off_sf = 2 * inter + 16, 7
    big = torch.full((off + P * inter + 3 * inter,), SENTINEL_U8, dtype=torch.uint8, device="cuda")
    big_sf = torch.full((off_sf + P * n_sf + 33,), SENTINEL_U8, dtype=torch.uint8, device="cuda")
    out = big[off : off + P * inter].view(P, inter)
    out_sf = big_sf[off_sf : off_sf + P * n_sf].view(P, n_sf)
    res = _l1(pool, kw, promotion, out=out.view(torch.float8_e4m3fn), out_sf=out_sf)
    torch.cuda.synchronize()
    assert res.l2_acts.data_ptr() == big.data_ptr() + off and res.l2_sf.data_ptr() == big_sf.data_ptr() + off_sf
    assert torch.equal(out, ref_out), f"l2_acts: {first_diff(out, ref_out)}"
    assert torch.equal(out_sf, ref_sf), f"l2_sf: {first_diff(out_sf, ref_sf)}"
    for name, outside in (
        ("before out", big[:off]),
        ("after out", big[off + P * inter :]),
        ("before out_sf", big_sf[:off_sf]),
        ("after out_sf", big_sf[off_sf + P * n_sf :]),
    ):
        assert (outside == SENTINEL_U8).all(), f"written {name}"


@pytest.mark.parametrize("promotion", ["k32", "k128"])
def test_l2_combine_into_offset_view(promotion):
    """combine [2, T, H] at 3 rows + 8 elements (16 bytes) into a larger bf16 buffer, half its rows
    mapped: same bits as into its own buffer, unmapped rows and everything outside untouched."""
    H, inter = 1024, 512
    gen = torch.Generator().manual_seed(52)
    _, _, kw = setup_l1(H, inter, [1] * len(COUNTS), seed=53)
    pool = Pool(COUNTS, inter, gen=gen)
    ref, dst = combine_rows(pool, H, K=2, gen=gen)
    ref = _bf16_sentinel(*ref.shape)
    _l2(pool, kw, dst, ref, promotion)
    n = ref.numel()
    off = 3 * H + 8
    big = _bf16_sentinel(off + n + 5 * H)
    comb = big[off : off + n].view(ref.shape)
    res = _l2(pool, kw, dst, comb, promotion)
    torch.cuda.synchronize()
    assert res.combine.data_ptr() == big.data_ptr() + 2 * off
    got, want = comb.view(torch.int16), ref.view(torch.int16)
    assert torch.equal(got, want), first_diff(got, want)
    unmapped = torch.ones(n // H, dtype=torch.bool, device="cuda")
    unmapped[dst[pool.valid].long()] = False
    assert unmapped.any() and (got.view(-1, H)[unmapped] == SENTINEL_BF16).all(), "unmapped combine rows written"
    bi = big.view(torch.int16)
    assert (bi[:off] == SENTINEL_BF16).all() and (bi[off + n :] == SENTINEL_BF16).all(), "written outside the view"


def test_misaligned_destinations_rejected():
    H, inter = 1024, 512
    pool, _, kw = setup_l1(H, inter, COUNTS, seed=54)
    P = pool.P
    big = torch.zeros(P * inter + 16, dtype=torch.uint8, device="cuda")
    with pytest.raises(ValueError, match="'out': expected a 16-byte aligned address"):
        _l1(pool, kw, max_tile=64, out=big[8 : 8 + P * inter].view(P, inter).view(torch.float8_e4m3fn))
    with pytest.raises(TypeError, match="'out': expected dtype torch.float8_e4m3fn or torch.uint8"):
        _l1(pool, kw, max_tile=64, out=torch.zeros(P, inter, dtype=torch.int8, device="cuda"))
    pool2 = Pool(COUNTS, inter, gen=torch.Generator().manual_seed(2))
    comb, dst = combine_rows(pool2, H)
    flat = torch.zeros(comb.numel() + 8, dtype=torch.bfloat16, device="cuda")
    with pytest.raises(ValueError, match="'combine': expected a 16-byte aligned address"):
        _l2(pool2, kw, dst, flat[4 : 4 + comb.numel()].view(comb.shape), max_tile=64)


# ------------------------------------------------------------------------------------------------
# 4. expert sizes around BLOCK_M, many tokens, both modes; exact-promotion L1 at max_tile = 128
# ------------------------------------------------------------------------------------------------

MANY = 1100


def _sizes(block_m):
    return [0, 1, block_m - 1, block_m, block_m + 1, 0, MANY]


@pytest.mark.parametrize("promotion", ["k32", "k128"])
@pytest.mark.parametrize("block_m", [64, 128])
@pytest.mark.parametrize("max_tile", [None, 8])
def test_l1_expert_sizes(promotion, block_m, max_tile):
    H, inter = 1024, 1024
    counts = _sizes(block_m)
    pool, (w1, s1, _, _), kw = setup_l1(H, inter, counts, seed=60 + block_m, align=block_m)
    out, out_sf = _l1_outputs(pool, inter, 0x55)
    res = _l1(pool, kw, promotion, max_tile=max_tile, debug=True, out=out.view(torch.float8_e4m3fn), out_sf=out_sf)
    torch.cuda.synchronize()
    worst = worst_bound_ratio(res.acc1, pool, w1, s1)
    pad = ~pool.valid
    assert torch.isnan(res.acc1[pad]).all(), "acc1 written on padding rows"
    assert (out[pad] == 0x55).all() and (out_sf[pad] == 0x55).all(), "outputs written on padding rows"
    check_l1_epilogue(pool, res, inter, True, None, f"{promotion} BLOCK_M {block_m} bn {max_tile}")
    log_result(
        test="l1_expert_sizes",
        promotion=promotion,
        block_m=block_m,
        max_tile=max_tile,
        max_ratio=worst,
        tau=TAU[promotion],
    )
    assert worst <= TAU[promotion], f"GEMM_BOUND: max ratio {worst} > tau {TAU[promotion]}"


@pytest.mark.parametrize("promotion", ["k32", "k128"])
@pytest.mark.parametrize("block_m", [64, 128])
@pytest.mark.parametrize("max_tile", [None, 8])
def test_l2_expert_sizes(promotion, block_m, max_tile):
    H, inter = 1024, 1024
    counts = _sizes(block_m)
    gen = torch.Generator().manual_seed(70 + block_m)
    _, (_, _, w2, s2), kw = setup_l1(H, inter, [1] * len(counts), seed=71)
    pool = Pool(counts, inter, gen=gen, align=block_m)
    comb, dst = combine_rows(pool, H, K=2, gen=gen)
    comb = _bf16_sentinel(*comb.shape)
    res = _l2(pool, kw, dst, comb, promotion, max_tile=max_tile, debug=True)
    torch.cuda.synchronize()
    worst = worst_bound_ratio(res.acc2, pool, w2, s2)
    assert torch.isnan(res.acc2[~pool.valid]).all(), "acc2 written on padding rows"
    check_l2_epilogue(pool, res.acc2, comb, dst, f"{promotion} BLOCK_M {block_m} bn {max_tile}")
    unmapped = torch.ones(comb.numel() // H, dtype=torch.bool, device="cuda")
    unmapped[dst[pool.valid].long()] = False
    assert (comb.view(torch.int16).view(-1, H)[unmapped] == SENTINEL_BF16).all(), "unmapped combine rows written"
    log_result(
        test="l2_expert_sizes",
        promotion=promotion,
        block_m=block_m,
        max_tile=max_tile,
        max_ratio=worst,
        tau=TAU[promotion],
    )
    assert worst <= TAU[promotion], f"GEMM_BOUND: max ratio {worst} > tau {TAU[promotion]}"


@pytest.mark.parametrize("fast_math,clamp", [(True, None), (False, 1.0)])
def test_exact_l1_largest_tile_production_build_equals_debug(fast_math, clamp):
    """The exact-promotion L1 at its largest tile (64): GEMM_BOUND, D6 bit-exact,
    padding untouched, and the production build's bits equal the debug build's."""
    H, inter = 1024, 1024
    counts = [0, 1, 63, 65, 127, 128, 129, 300]
    pool, (w1, s1, _, _), kw = setup_l1(H, inter, counts, seed=80)
    out, out_sf = _l1_outputs(pool, inter, 0x55)
    res = _l1(
        pool,
        kw,
        "k32",
        max_tile=64,
        debug=True,
        fast_math=fast_math,
        activation_clamp=clamp,
        out=out.view(torch.float8_e4m3fn),
        out_sf=out_sf,
    )
    prod_out, prod_sf = _l1_outputs(pool, inter, 0x55)
    _l1(
        pool,
        kw,
        "k32",
        max_tile=64,
        fast_math=fast_math,
        activation_clamp=clamp,
        out=prod_out.view(torch.float8_e4m3fn),
        out_sf=prod_sf,
    )
    torch.cuda.synchronize()
    worst = worst_bound_ratio(res.acc1, pool, w1, s1)
    pad = ~pool.valid
    assert torch.isnan(res.acc1[pad]).all(), "acc1 written on padding rows"
    assert (out[pad] == 0x55).all() and (out_sf[pad] == 0x55).all(), "outputs written on padding rows"
    check_l1_epilogue(pool, res, inter, fast_math, clamp, f"exact bn128 fast_math {fast_math} clamp {clamp}")
    assert torch.equal(prod_out, out), f"production vs debug l2_acts: {first_diff(prod_out, out)}"
    assert torch.equal(prod_sf, out_sf), f"production vs debug l2_sf: {first_diff(prod_sf, out_sf)}"
    log_result(test="exact_l1_bn128", fast_math=fast_math, clamp=clamp, max_ratio=worst, tau=G.TAU["k32"])
    assert worst <= G.TAU["k32"], f"GEMM_BOUND: max ratio {worst} > tau {G.TAU['k32']}"
