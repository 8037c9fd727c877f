"""What bench/layer.py computes without a GPU: its arguments, the roofline arithmetic, and the torch
building blocks of its unfused and torch columns against the reference (dispatch against
build_pool, the combine), plus both pipelines end to end with their device-only
kernels replaced by reference computations."""

import subprocess
import sys

import pytest
import torch

from bench import layer as L
from megamoe import reference as ref
from megamoe.jit import contract
from megamoe.reference import formats as F

# One rank, masked and skewed slots, experts that receive nothing (E = 8, K = 3, T = 40).
CFG = ref.MoEConfig(hidden=256, intermediate=128, num_experts=8, top_k=3, num_ranks=1, max_tokens_per_rank=40)


def _inputs(seed=0, masked_ratio=0.2, distribution="skewed"):
    return ref.make_inputs(CFG, 40, seed=seed, distribution=distribution, masked_ratio=masked_ratio)[0]


# ---------------------------------------------------------------------------------------------
# Arguments
# ---------------------------------------------------------------------------------------------
def test_the_default_run_is_both_shapes_at_six_token_counts():
    args = L.parse_args([])
    assert args.shapes == ["dsv3", "v4flash"]
    assert args.tokens == [1, 8, 64, 512, 4096, 8192]
    assert args.out is None and not args.quick


def test_quick_is_dsv3_at_8_and_512_tokens():
    args = L.parse_args(["--quick"])
    assert args.shapes == ["dsv3"] and args.tokens == [8, 512] and args.quick


def test_explicit_shapes_tokens_and_out_are_taken_as_given_even_with_quick():
    args = L.parse_args(["--quick", "--shapes", "v4flash", "--tokens", "1,4096", "--out", "r.json"])
    assert args.shapes == ["v4flash"] and args.tokens == [1, 4096] and args.out == "r.json"


@pytest.mark.parametrize("bad", [["--shapes", "dsv4"], ["--tokens", "8,x"], ["--tokens", "0"], ["--tokens", "-8"]])
def test_unknown_shapes_and_bad_token_counts_are_usage_errors(bad, capsys):
    with pytest.raises(SystemExit) as exc:
        L.parse_args(bad)
    assert exc.value.code == 2
    assert bad[0] in capsys.readouterr().err  # the message names the argument


def test_the_shapes_are_bench_gemms_slices_with_top_8_and_gpt_oss_by_name():
    from bench import gemm

    assert set(L.TOP_K) == set(gemm.SHAPES) and set(L.TOP_K.values()) == {8}
    assert L.SHAPES is gemm.SHAPES and L.E == 32
    assert L.LAYER_SHAPES["gpt-oss"] == (2880, 2880) and L.LAYER_TOP_K["gpt-oss"] == 4
    assert L.parse_args([]).shapes == ["dsv3", "v4flash"]  # the default run is what it was
    assert L.parse_args(["--shapes", "gpt-oss"]).shapes == ["gpt-oss"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without a GPU")
def test_without_a_gpu_the_benchmark_says_it_needs_one():
    proc = subprocess.run([sys.executable, "-m", "bench.layer", "--quick"], capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0
    assert "needs a CUDA GPU" in proc.stderr and "Traceback" not in proc.stderr, proc.stderr


# ---------------------------------------------------------------------------------------------
# The roofline
# ---------------------------------------------------------------------------------------------
def test_the_floor_counts_active_experts_weights_and_the_layers_own_traffic():
    # H 256, I 128: per expert L1 2I x H = 65536 and L2 H x I = 32768 FP4 elements, so
    # 98304 / 2 + 98304 / 32 = 49152 + 3072 = 52224 bytes; 3 active experts: 156672.
    # T 4, K 2: x 4 * 256 = 1024, its scales 32, topk_idx + topk_weights 4 * 2 * 12 = 96,
    # y 4 * 256 * 2 = 2048: 3200. FLOPs: 2 * 8 slots * 98304 = 1572864.
    f = L.layer_floor(hidden=256, intermediate=128, tokens=4, top_k=2, active_experts=3, slots=8)
    assert f.hbm_bytes == 156672 + 3200 == 159872
    assert f.flops == 1572864
    assert f.us == pytest.approx(159872 / 4.8e12 * 1e6)  # memory-bound at this size


def test_the_floor_is_compute_bound_when_many_slots_share_few_experts():
    # One expert takes all 4096 tokens (top-1), H = I = 4096: 27 MB of weights, 412 GFLOP.
    f = L.layer_floor(hidden=4096, intermediate=4096, tokens=4096, top_k=1, active_experts=1, slots=4096)
    flops = 2 * 4096 * (4096 * 8192 + 4096 * 4096)
    assert f.flops == flops
    assert f.us == pytest.approx(flops / 1979e12 * 1e6)
    assert f.hbm_bytes / 4.8e12 < flops / 1979e12


def test_the_floor_is_taken_at_the_limits_of_the_card_it_runs_on():
    from bench.gemm import H100, H200, card

    assert card("NVIDIA H200") is H200
    assert card("NVIDIA H100 80GB HBM3") is H100
    # Memory-bound: the H100's 3.35 TB/s makes the floor 4.8 / 3.35 of the H200's.
    kw = dict(hidden=256, intermediate=128, tokens=4, top_k=2, active_experts=3, slots=8)
    assert L.layer_floor(**kw, lim=H100).us == pytest.approx(L.layer_floor(**kw).us * 4.8 / 3.35)
    # Compute-bound: the two cards' FP8 peaks are the same.
    kw = dict(hidden=4096, intermediate=4096, tokens=4096, top_k=1, active_experts=1, slots=4096)
    assert L.layer_floor(**kw, lim=H100).us == pytest.approx(L.layer_floor(**kw).us)


def test_a_card_without_known_limits_gets_the_h200s_and_says_so(capsys):
    from bench.gemm import H200, card

    assert card("NVIDIA A100-SXM4-80GB") is H200
    assert "no limits known for 'NVIDIA A100-SXM4-80GB'" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------
# Dispatch
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("seed,masked_ratio", [(0, 0.0), (1, 0.2), (2, 0.5)])
def test_the_torch_dispatch_builds_the_reference_pool(seed, masked_ratio):
    inp = _inputs(seed, masked_ratio)
    want = ref.build_pool([inp], 0, CFG)
    got = L.PoolDispatch(CFG, "cpu")(inp.x, inp.x_sf, inp.topk_idx, inp.topk_weights)
    p = want.num_rows
    assert got.x.shape[0] == contract.pool_rows(40, 3, 8, 1, 64) >= p  # the fused layer's P
    assert torch.equal(got.expert_offsets, want.expert_offsets)
    assert torch.equal(got.expert_rows, ref.send_counts(inp.topk_idx, CFG.num_experts))
    valid = want.valid
    meta = want.meta[valid].long()
    # Every valid reference row holds the same slot (by its metadata) and the same bytes ...
    assert torch.equal(got.dst_rows[:p][valid].long(), meta[:, 2] * CFG.max_tokens_per_rank + meta[:, 1])
    assert torch.equal(got.x[:p][valid], want.x[valid])
    assert torch.equal(got.x_sf[:p][valid], want.x_sf[valid])
    assert torch.equal(got.weights[:p][valid].view(torch.int32), want.weights[valid].view(torch.int32))
    # ... and no other row is sent anywhere by L2.
    assert (got.dst_rows[:p][~valid] == -1).all() and (got.dst_rows[p:] == -1).all()


def test_a_second_dispatch_forgets_the_first_routing():
    d = L.PoolDispatch(CFG, "cpu")
    first, second = _inputs(3), _inputs(4, masked_ratio=0.5)
    d(first.x, first.x_sf, first.topk_idx, first.topk_weights)
    got = d(second.x, second.x_sf, second.topk_idx, second.topk_weights)
    want = ref.build_pool([second], 0, CFG)
    assert torch.equal(got.expert_offsets, want.expert_offsets)
    assert int((got.dst_rows >= 0).sum()) == int((second.topk_idx >= 0).sum())


def test_slot_rows_without_padding_are_the_grouped_gemm_layout():
    idx = torch.tensor([[2, 0], [0, -1], [2, 1]])
    rows, counts, offsets = L.slot_rows(idx, 4, 1, sentinel=6)
    # expert 0: slots 1, 2; expert 1: slot 5; expert 2: slots 0, 4; expert 3: none; slot 3 masked
    assert counts.tolist() == [2, 1, 2, 0]
    assert offsets.tolist() == [0, 2, 3, 5, 5]
    assert rows.tolist() == [3, 0, 1, 6, 4, 2]


# ---------------------------------------------------------------------------------------------
# Combine
# ---------------------------------------------------------------------------------------------
def test_the_torch_combine_is_the_references_ordered_sum():
    idx = _inputs(6).topk_idx
    buf = torch.randn(CFG.top_k, 40, CFG.hidden).to(torch.bfloat16)
    buf[(idx < 0).T] = float("nan")  # masked slots are never written: their rows must not count
    got = L.combine_slots(buf, idx)
    assert torch.equal(got.view(torch.int16), ref.combine(buf, idx).view(torch.int16))


def test_per32_dequantisation_is_the_references():
    inp = _inputs(7)
    want = ref.dequantize_e4m3(inp.x, inp.x_sf, torch.float32)
    assert torch.equal(L.dequantize_per32(inp.x, inp.x_sf), want)


# ---------------------------------------------------------------------------------------------
# The pipelines end to end, device-only kernels replaced
# ---------------------------------------------------------------------------------------------
def _fake_gemms(monkeypatch, weights):
    """megamoe.gemm's l1_gemm / l2_gemm by the reference stages, on the canonical weights (the
    benchmark hands the entry points whatever `kw` it was given). The k128 operand's per-128 scale
    bytes are spread back to per 32: the same values."""
    from megamoe import gemm as G

    def operand(x, x_sf, x_sf128):
        return (x, x_sf) if x_sf128 is None else (x, x_sf128.repeat_interleave(4, dim=1))

    def l1(x, x_sf, offsets, counts, w_route, kw, *, fast_math, activation_clamp, out, out_sf, x_sf128, **_):
        x, x_sf = operand(x, x_sf, x_sf128)
        valid = ref.region_valid(offsets, counts, x.shape[0])
        acc1 = ref.grouped_gemm(F.as_codes(x), x_sf, offsets, weights.w1, weights.w1_sf, valid=valid)
        res = ref.l1_epilogue(acc1, w_route, valid, activation_clamp=activation_clamp, fast_math=fast_math)
        out.view(torch.uint8)[valid] = res.l2_acts[valid]
        out_sf[valid] = res.l2_sf[valid]

    def l2(x, x_sf, offsets, counts, dst_rows, kw, combine, *, x_sf128, **_):
        x, x_sf = operand(x, x_sf, x_sf128)
        valid = ref.region_valid(offsets, counts, x.shape[0])
        acc2 = ref.grouped_gemm(F.as_codes(x), x_sf, offsets, weights.w2, weights.w2_sf, valid=valid)
        combine.view(-1, combine.shape[-1])[dst_rows[valid].long()] = acc2[valid].to(torch.bfloat16)

    monkeypatch.setattr(G, "l1_gemm", l1)
    monkeypatch.setattr(G, "l2_gemm", l2)


@pytest.mark.parametrize("masked_ratio", [0.0, 0.3])
def test_the_unfused_pipeline_with_reference_gemms_gives_the_reference_y(monkeypatch, masked_ratio):
    weights = ref.random_weights(CFG.num_experts, CFG.hidden, CFG.intermediate, seed=1)
    inp = _inputs(8, masked_ratio)
    want = ref.run_reference(CFG, [inp], weights).y[0]
    _fake_gemms(monkeypatch, weights)
    layer = L.UnfusedLayer(CFG, weights, "k32", "cpu")
    for _ in range(2):  # the second call runs on buffers the first one left
        y = layer(inp.x, inp.x_sf, inp.topk_idx, inp.topk_weights)
        assert torch.equal(y.view(torch.int16), want.view(torch.int16))
    y128 = L.UnfusedLayer(CFG, weights, "k128", "cpu")(inp.x, inp.x_sf, inp.topk_idx, inp.topk_weights)
    assert ref.calc_diff(y128, want) < 1e-5


def test_the_torch_fp8_pipeline_computes_the_reference_layer(monkeypatch):
    def scaled_grouped_mm(a, b, scale_a, scale_b, *, offs, out_dtype):
        # torch._scaled_grouped_mm (2-D x 3-D, row-wise scales) has no CPU kernel: the same product.
        out = torch.zeros(a.shape[0], b.shape[2], dtype=torch.float32)
        start = 0
        for e, end in enumerate(offs.tolist()):
            lhs = a[start:end].float() * scale_a[start:end, None]
            out[start:end] = lhs @ (b[e].float() * scale_b[e][None, :])
            start = end
        return out.to(out_dtype)

    monkeypatch.setattr(torch, "_scaled_grouped_mm", scaled_grouped_mm, raising=False)
    weights = ref.random_weights(CFG.num_experts, CFG.hidden, CFG.intermediate, seed=2)
    inp = _inputs(9, masked_ratio=0.2)
    want = ref.run_reference(CFG, [inp], weights).y[0]
    y = L.TorchFP8Layer(weights)(inp.x, inp.x_sf, inp.topk_idx, inp.topk_weights)
    assert y.dtype == torch.bfloat16 and y.shape == want.shape
    # Power-of-two row scales keep the FP4 weights and the per-32 activations exact: what differs
    # from the reference is the requantisation of values far under their row's largest.
    assert ref.calc_diff(y, want) < 1e-4


def test_the_table_shows_na_with_the_columns_error_under_it():
    row = dict(
        shape="dsv3",
        tokens=8,
        slots=64,
        active_experts=30,
        fused_us=None,
        unfused_us=250.0,
        torch_us=900.0,
        floor_us=170.0,
        errors={"fused": "ModuleNotFoundError: No module named 'megamoe.moe'"},
    )
    text = L.format_table([row, dict(row, tokens=512)])
    lines = text.splitlines()
    assert len(lines) == 5 and lines[0].startswith("| shape |")
    assert " n/a " in lines[2] and "250.0" in lines[2]
    assert lines[4] == "n/a fused (dsv3 T=8, dsv3 T=512): ModuleNotFoundError: No module named 'megamoe.moe'"
