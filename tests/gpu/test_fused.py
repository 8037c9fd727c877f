"""The fused MegaMoE layer (megamoe.MegaMoE, kernel/fused/) on one rank, every dump point through the
conformance suite: D1-D4 (the kernel's own dispatch and pool), D5/D7 (GEMM_BOUND with the exact
mode's tau), D6/D8/D9/D10 bit-exact from the kernel's own dumped inputs, on several routings and
modes; y bitwise against the CPU reference end to end on grid-snapped inputs; repeats, a call after
another routing, the release build against the debug build, and bad input refused before a launch.

Run: pytest -s tests/gpu/test_fused.py"""

from __future__ import annotations

import pytest
import torch

from megamoe import reference as ref
from megamoe.conformance.suite import check
from megamoe.jit import build as jb
from megamoe.moe import MegaMoE

DEFAULT = dict(hidden=1024, intermediate=512, num_experts=16, top_k=4, num_ranks=1, max_tokens_per_rank=128)


def _cfg(**kw) -> ref.MoEConfig:
    return ref.MoEConfig(**{**DEFAULT, "block_m": 64, **kw})


_LAYERS: dict = {}


# Every test that runs the GEMMs runs every engine of the fused kernel layer its promotion has
# (megamoe.moe; the narrow one is the exact mode's): the layer's own choice at these sizes is the
# swap-AB engine. The narrow engine runs these sizes' pool blocks of more than 8 rows in parts.
ENGINES = list(jb.FUSED_ENGINES_OF["k32"])
MODES = jb.FUSED_MODES


def _layer(
    cfg: ref.MoEConfig, seed: int = 3, promotion: str = "k32", engine: str = "auto"
) -> tuple[MegaMoE, ref.ExpertWeights]:
    """One layer per (shape, seed, mode, engine): making it compiles nothing new and allocates the
    workspace once."""
    key = (cfg.hidden, cfg.intermediate, cfg.num_experts, cfg.top_k, cfg.max_tokens_per_rank, seed, promotion, engine)
    if key not in _LAYERS:
        w = ref.random_weights(cfg.num_experts, cfg.hidden, cfg.intermediate, seed=seed, device="cuda")
        _LAYERS[key] = (MegaMoE(cfg, w, promotion=promotion, engine=engine), w)
    layer, w = _LAYERS[key]
    layer.cfg = cfg  # clamp / SiLU mode of this test (shape fields are the same)
    return layer, w


def _inputs(cfg, tokens, distribution="uniform", masked_ratio=0.0, seed=11):
    return ref.make_inputs(cfg, tokens, seed=seed, distribution=distribution, masked_ratio=masked_ratio, device="cuda")[
        0
    ]


def _call(cfg, inp, promotion="k32", engine="auto", **kw):
    layer, _ = _layer(cfg, promotion=promotion, engine=engine)
    return layer(inp.x, inp.x_sf, inp.topk_idx, inp.topk_weights, **kw)


CASES = [
    ("uniform", 128, 0.0, dict()),
    ("skewed", 100, 0.1, dict(activation_clamp=1.5)),
    ("one_hot", 128, 0.0, dict(fast_math=False)),
    ("empty_experts", 77, 0.25, dict(activation_clamp=0.75, fast_math=False)),
    ("uniform", 1, 0.0, dict()),
    ("uniform", 0, 0.0, dict()),
    ("uniform", 128, 1.0, dict()),  # every slot masked: no expert gets a token
]


@pytest.mark.parametrize("promotion,engine", MODES)
@pytest.mark.parametrize("distribution,tokens,masked,mode", CASES, ids=[f"{c[0]}-T{c[1]}-m{c[2]}" for c in CASES])
def test_every_dump_point_of_the_fused_kernel_conforms(distribution, tokens, masked, mode, promotion, engine):
    cfg = _cfg(**{k: v for k, v in mode.items()})
    inp = _inputs(cfg, tokens, distribution, masked)
    y, dumps = _call(cfg, inp, promotion, engine, debug=True)
    assert dumps[0].meta["build_id"].split("_")[3] == engine
    report = check(dumps, end_to_end=tokens > 0 and masked < 1.0)
    print(report.text())
    assert report.ok, report.text()
    assert torch.equal(y.view(torch.int16).cpu(), dumps[0]["D9.y"].view(torch.int16))


@pytest.mark.parametrize("promotion,engine", MODES)
def test_the_dsv3_slice_conforms(promotion, engine):
    cfg = ref.MoEConfig(
        hidden=7168, intermediate=2048, num_experts=32, top_k=8, num_ranks=1, max_tokens_per_rank=16, block_m=64
    )
    inp = _inputs(cfg, 16)
    y, dumps = _call(cfg, inp, promotion, engine, debug=True)
    report = check(dumps)
    assert report.ok, report.text()


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize(
    "hidden,intermediate", [(2880, 2880), (160, 192), (384, 96)], ids=["2880", "160-192", "384-96"]
)
def test_sizes_in_multiples_of_32_conform_in_the_exact_mode_padded_inside_the_layouts(hidden, intermediate, engine):
    # SPEC §8: H and I in multiples of 32; x stays [T, H], its scales [T, H / 32]. The layouts'
    # rows (padded to 128) in the prefill engine's 256-row blocks: 2880: L1 5760 (22.5 blocks), L2
    # 2944 (11.5); 160-192: L1 384 (1.5), L2 160 real of 256; 384-96: L1 96 channels of 128, L2
    # 384 (1.5).
    cfg = _cfg(hidden=hidden, intermediate=intermediate, num_experts=8, top_k=4, activation_clamp=1.5)
    inp = _inputs(cfg, 100, "skewed", 0.1)
    assert inp.x_sf.shape == (100, hidden // 32)
    y, dumps = _call(cfg, inp, "k32", engine, debug=True)
    assert dumps[0].meta["build_id"].split("_")[3] == engine
    report = check(dumps)
    assert report.ok, report.text()
    assert torch.equal(y.view(torch.int16).cpu(), dumps[0]["D9.y"].view(torch.int16))
    y_release = _call(cfg, inp, "k32", engine)
    assert torch.equal(y_release.view(torch.int16), y.view(torch.int16))


@pytest.mark.parametrize("engine", jb.FUSED_ENGINES_OF["k128"])
def test_the_fast_modes_rebased_operands_are_the_references_rebase_k128_bit_for_bit(engine):
    # The transform is part of the contract (SPEC D4): the pool's rows for L1 and the intermediate
    # for L2, each rebased per 128 channels, must be megamoe.reference.rebase_k128 of the canonical
    # dumped operands, byte for byte, on every valid row (each engine writes the intermediate's).
    cfg = _cfg(activation_clamp=1.5)
    inp = _inputs(cfg, 128, "skewed", 0.1)
    layer, _ = _layer(cfg, promotion="k128", engine=engine)
    _, dumps = layer(inp.x, inp.x_sf, inp.topk_idx, inp.topk_weights, debug=True)
    torch.cuda.synchronize()
    d = dumps[0]
    valid = ref.valid_rows(d.tensors)
    p = valid.numel()
    assert valid.sum() > 0
    for (x, sf), (got_x, got_sf) in (
        ((d["D4.pool_x"], d["D4.pool_x_sf"]), ("pool_x128", "pool_sf128")),
        ((d["D6.l2_acts"], d["D6.l2_sf"]), ("l2_x128", "l2_sf128")),
    ):
        want = ref.rebase_k128(x[valid], sf[valid])
        assert torch.equal(layer.ws[got_x][:p][valid].cpu(), want.codes), got_x
        assert torch.equal(layer.ws[got_sf][:p][valid].cpu(), want.scales), got_sf


@pytest.mark.parametrize("engine", ENGINES)
def test_y_equals_the_cpu_reference_bit_for_bit_on_grid_snapped_inputs(engine):
    cfg = _cfg(hidden=256, intermediate=128, num_experts=4, top_k=2, max_tokens_per_rank=64)
    g = torch.Generator().manual_seed(5)
    inp = ref.make_inputs(cfg, 60, seed=5)[0]
    vals = torch.randint(-2, 3, inp.x.shape, generator=g).float() * (torch.rand(inp.x.shape, generator=g) < 0.3)
    inp.x.view(torch.uint8).copy_(ref.encode_e4m3(vals))
    inp.x_sf.fill_(127)
    w1 = torch.randint(-2, 3, (4, 256, 256), generator=g).float() * (torch.rand(4, 256, 256, generator=g) < 0.3)
    # L2's operand is the requantised intermediate: arbitrary E4M3 codes, whose k32 sums a truncating
    # accumulator would round. One non-zero weight per (row, 32-group) keeps every k32 product exact,
    # and the four promoted products of a row stay within fp32's 24 bits.
    w2 = torch.zeros(4, 256, 128)
    pick = torch.randint(0, 32, (4, 256, 4), generator=g) + 32 * torch.arange(4)
    w2.scatter_(
        2,
        pick,
        torch.randint(1, 3, (4, 256, 4), generator=g).float() * (1 - 2 * (torch.rand(4, 256, 4, generator=g) < 0.5)),
    )
    weights = ref.ExpertWeights(
        ref.pack_fp4(ref.encode_e2m1(w1)),
        torch.full((4, 256, 8), 127, dtype=torch.uint8),
        ref.pack_fp4(ref.encode_e2m1(w2)),
        torch.full((4, 256, 4), 127, dtype=torch.uint8),
    )
    layer = MegaMoE(cfg, weights.to("cuda"), engine=engine)
    cuda_inp = inp.to("cuda")
    y, dumps = layer(cuda_inp.x, cuda_inp.x_sf, cuda_inp.topk_idx, cuda_inp.topk_weights, debug=True)
    for d in dumps:
        d.meta["grid_snapped"] = True
    report = check(dumps)
    assert report.ok, report.text()
    assert {r.check for r in report.results if r.point in ("D5", "D7")} == {"GEMM_EXACT"}
    want = ref.run_reference(cfg, [inp], weights).y[0]
    assert torch.equal(y.cpu().view(torch.int16), want.view(torch.int16))


@pytest.mark.parametrize("engine", ENGINES)
def test_twenty_repeats_and_the_release_build_give_the_same_bits(engine):
    cfg = _cfg()
    inp = _inputs(cfg, 128, "skewed", 0.1)
    y_dbg, _ = _call(cfg, inp, engine=engine, debug=True)
    ys = [_call(cfg, inp, engine=engine) for _ in range(20)]
    torch.cuda.synchronize()
    for y in ys:
        assert torch.equal(y.view(torch.int16), y_dbg.view(torch.int16))


def test_a_call_after_another_routing_and_engine_equals_a_call_on_a_fresh_layer():
    cfg = _cfg()
    a, b = _inputs(cfg, 128, "one_hot", seed=1), _inputs(cfg, 90, "uniform", 0.2, seed=2)
    layer, w = _layer(cfg)
    layer.engine = "prefill"  # one workspace, calls on every engine in turn
    layer(a.x, a.x_sf, a.topk_idx, a.topk_weights)
    layer.engine = "swapab"
    layer(b.x, b.x_sf, b.topk_idx, b.topk_weights)
    layer.engine = "narrow"
    layer(a.x, a.x_sf, a.topk_idx, a.topk_weights)
    layer.engine = "prefill"
    layer(a.x, a.x_sf, a.topk_idx, a.topk_weights)
    layer.engine = "auto"
    y_after = layer(b.x, b.x_sf, b.topk_idx, b.topk_weights)
    fresh = MegaMoE(cfg, w)
    y_fresh = fresh(b.x, b.x_sf, b.topk_idx, b.topk_weights)
    assert torch.equal(y_after.view(torch.int16), y_fresh.view(torch.int16))


def test_receive_statistics_accumulate_unless_a_call_says_not_to():
    cfg = _cfg()
    inp = _inputs(cfg, 64, "skewed")
    layer = MegaMoE(cfg, _layer(cfg)[1])
    layer(inp.x, inp.x_sf, inp.topk_idx, inp.topk_weights, record_stats=False)
    assert int(layer.recv_stats.sum()) == 0
    layer(inp.x, inp.x_sf, inp.topk_idx, inp.topk_weights)
    _, dumps = layer(inp.x, inp.x_sf, inp.topk_idx, inp.topk_weights, record_stats=False, debug=True)
    assert check(dumps).ok  # D10 expects the statistics unchanged when the call says so
    layer(inp.x, inp.x_sf, inp.topk_idx, inp.topk_weights)
    want = 2 * ref.send_counts(inp.topk_idx.cpu(), cfg.num_experts).long()
    assert torch.equal(layer.recv_stats.cpu(), want)


@pytest.mark.parametrize("engine", ENGINES)
def test_the_fused_layer_can_be_captured_in_a_cuda_graph(engine):
    cfg = _cfg()
    inp = _inputs(cfg, 128)
    layer, _ = _layer(cfg, engine=engine)
    want = layer(inp.x, inp.x_sf, inp.topk_idx, inp.topk_weights)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        layer(inp.x, inp.x_sf, inp.topk_idx, inp.topk_weights)  # warm-up on the capture stream
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = layer(inp.x, inp.x_sf, inp.topk_idx, inp.topk_weights)
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(y.view(torch.int16), want.view(torch.int16))


@pytest.mark.parametrize("engine", ENGINES)
def test_a_prepared_call_gives_the_calls_bits_eagerly_and_from_a_graph_and_refuses_another_stream(engine):
    """MegaMoE.prepare on a call's tensors: called three times (new input values in the same
    tensors), then from a CUDA graph captured on its stream, it writes what the layer's call writes;
    under another stream it is an input error and launches nothing."""
    cfg = _cfg()
    layer, _ = _layer(cfg, engine=engine)
    a, b = _inputs(cfg, 96, seed=5), _inputs(cfg, 96, seed=6)
    want = {k: layer(i.x, i.x_sf, i.topk_idx, i.topk_weights).clone() for k, i in (("a", a), ("b", b))}
    x, x_sf, idx, w = (t.clone() for t in (a.x, a.x_sf, a.topk_idx, a.topk_weights))
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        call = layer.prepare(x, x_sf, idx, w)
        for k, i in (("a", a), ("b", b), ("a", a)):
            for dst, src in zip((x, x_sf, idx, w), (i.x, i.x_sf, i.topk_idx, i.topk_weights)):
                dst.copy_(src)
            y = call()
            assert y is call.result
            torch.cuda.synchronize()
            assert torch.equal(y.view(torch.int16), want[k].view(torch.int16)), f"prepared call, input {k}"
    y.fill_(float("nan"))
    torch.cuda.synchronize()
    with pytest.raises(ref.MegaMoEInputError, match="runs on the stream it was prepared on"):
        call()  # the current stream is not s
    torch.cuda.synchronize()
    assert y.isnan().all(), "a prepared call refused under another stream launched"
    g = torch.cuda.CUDAGraph()
    with torch.cuda.stream(s), torch.cuda.graph(g, stream=s):
        call()
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(y.view(torch.int16), want["a"].view(torch.int16)), "prepared call, graph replay"


def test_bad_input_is_refused_before_any_launch():
    cfg = _cfg()
    inp = _inputs(cfg, 16)
    layer, _ = _layer(cfg)
    before = layer.ws.buffer.clone()
    bad = inp.topk_idx.clone()
    bad[3, 1] = bad[3, 0]
    with pytest.raises(ref.MegaMoEInputError, match="topk_idx"):
        layer(inp.x, inp.x_sf, bad, inp.topk_weights)
    with pytest.raises(ref.MegaMoEInputError, match="x_sf"):
        layer(inp.x, inp.x_sf.clone().fill_(255), inp.topk_idx, inp.topk_weights)
    with pytest.raises(ref.MegaMoEInputError, match="x"):
        big = _inputs(_cfg(max_tokens_per_rank=200), 200)
        layer(big.x, big.x_sf, big.topk_idx, big.topk_weights)
    torch.cuda.synchronize()
    assert torch.equal(layer.ws.buffer, before)


def test_the_fast_mode_refuses_weights_with_a_row_far_under_its_experts_largest():
    """SPEC §2 (reference.quantize.FAST_ROW_SPREAD): refused at construction, naming the tensor;
    the exact mode takes the same weights."""
    cfg = _cfg()
    w = ref.random_weights(cfg.num_experts, cfg.hidden, cfg.intermediate, seed=0, device="cuda")
    w.w1_sf[2, 5] = 254
    with pytest.raises(ref.MegaMoEInputError, match="weights.w1_sf"):
        MegaMoE(cfg, w, promotion="k128")
    MegaMoE(cfg, w, promotion="k32")


_HANG = """
import torch
from megamoe.jit import contract as C
# bench.hangs' layer: T K above C.LOCAL_DISPATCH_ENTRIES, as a one-rank call of fewer entries has no dispatch counter
from bench.hangs import layer_and_inputs
layer, inp = layer_and_inputs(1, 0, "auto")
layer.ws["signals"][0, C.SIGNAL_POSTED] = -(10**6)  # this call's dispatch counter can never fill
try:
    layer(inp.x, inp.x_sf, inp.topk_idx, inp.topk_weights)
    torch.cuda.synchronize()
    print("NO ERROR")
except Exception as exc:
    print("ERROR", type(exc).__name__)
print("RECORD", layer.timeout_message())
"""


def test_a_wait_that_never_completes_traps_with_a_record_naming_rank_wait_and_counts():
    # In a subprocess: the trap ends the CUDA context (about 10 s of spinning first).
    import subprocess
    import sys

    run = subprocess.run([sys.executable, "-c", _HANG], capture_output=True, text=True, timeout=600)
    out = run.stdout + run.stderr
    assert "NO ERROR" not in out, out
    record = next((line for line in out.splitlines() if line.startswith("RECORD ")), "")
    assert "rank 0" in record and "dispatch counter" in record, out
    assert "observed -" in record and "expected" in record, out
