"""SPEC §8 (gpt-oss's clamped SwiGLU with biases) in the reference, its float64 oracle and the
conformance suite's D6 and D8 checks.

The glu factor's tables are made on a GPU from the kernel's device function (megamoe.silu_probe;
tests/gpu/test_reference_gpu.py regenerates the shipped ones bit for bit). Most tests here stand in
a table of their own (`_table`), which the float32 implementation written here reads too: every
step around the table lookup is what is tested, bit for bit."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from megamoe import reference as ref
from megamoe.conformance import suite
from megamoe.conformance.dump import (
    Dump,
    DumpFormatError,
    global_weights,
    reference_dumps,
    weights_digest,
    with_weights,
)
from megamoe.reference import points as P
from megamoe.reference import silu_tables

ALPHA = np.float32(ref.GPT_OSS_ALPHA)


def _table(fast_math: bool) -> torch.Tensor:
    """A stand-in glu table: fp32 of g * sigmoid(alpha g) in float64 (fast and precise differ in
    the last bit, so that a mix-up of the two shows)."""
    g = torch.arange(65536, dtype=torch.int32).mul(65536).view(torch.float32).to(torch.float64)
    t = (g * torch.sigmoid(float(ALPHA) * g)).to(torch.float32)
    return t if fast_math else torch.nextafter(t, torch.full_like(t, float("inf")))


@pytest.fixture(autouse=True)
def glu_tables(monkeypatch):
    real = silu_tables._load

    def load(name: str) -> torch.Tensor:
        for fast, file in silu_tables.GLU_TABLE_FILES.items():
            if name == file:
                return _table(fast)
        return real(name)

    monkeypatch.setattr(silu_tables, "_load", load)


CFG = ref.MoEConfig(
    hidden=256, intermediate=128, num_experts=4, top_k=2, num_ranks=2, max_tokens_per_rank=32, activation="swiglu_oai"
)


def _weights(cfg=CFG, seed=0, biases=True):
    w = ref.random_weights(cfg.num_experts, cfg.hidden, cfg.intermediate, seed=seed)
    if biases:
        g = torch.Generator().manual_seed(seed)
        w.b1 = torch.randn(cfg.num_experts, 2 * cfg.intermediate, generator=g).mul(2).to(torch.bfloat16)
        w.b2 = torch.randn(cfg.num_experts, cfg.hidden, generator=g).to(torch.bfloat16)
    return w


# ------------------------------------------------------------------------------- configuration


def test_a_gpt_oss_layer_is_chosen_by_its_activation_with_gpt_osss_alpha_and_limit():
    assert (CFG.alpha, CFG.limit) == (1.702, 7.0)
    assert ref.MoEConfig(**dict(CFG.to_dict(), limit=10.0)).limit == 10.0


@pytest.mark.parametrize(
    "change,arg",
    [
        (dict(activation="gelu"), "activation"),
        (dict(activation="swiglu", alpha=1.5), "alpha"),
        (dict(activation="swiglu", limit=3.0), "limit"),
        (dict(alpha=1.0), "alpha"),
        (dict(limit=0.0), "limit"),
        (dict(limit=float("inf")), "limit"),
        (dict(limit=True), "limit"),
        (dict(activation_clamp=3.0), "activation_clamp"),
    ],
)
def test_a_config_that_mixes_the_two_activations_parameters_is_refused_naming_the_argument(change, arg):
    with pytest.raises(ref.MegaMoEInputError, match=f"argument '{arg}'"):
        ref.MoEConfig(**dict(CFG.to_dict(), **change))


def test_biases_on_a_plain_swiglu_layer_are_refused_naming_them():
    cfg = dataclasses.replace(CFG, activation="swiglu")
    inputs = ref.make_inputs(cfg, 8, seed=1)
    with pytest.raises(ref.MegaMoEInputError, match="argument 'b1'"):
        ref.run_reference(cfg, inputs, _weights(cfg))


@pytest.mark.parametrize("fast_math", [True, False])
def test_the_shipped_glu_tables_are_the_glu_factor_of_every_bf16_value(monkeypatch, fast_math):
    # What the kernel's device function gives (made on the H200), against float64 over every bf16
    # g: within 2^-17 relative (exp's argument rounding grows with |g|: 64 ulp at g = -29.75), far
    # inside the bf16 rounding that follows; under 2^-100 it may flush to zero (it does from g =
    # -51.5 on: the reciprocal of a huge 1 + exp(-alpha g)).
    monkeypatch.undo()  # the shipped tables, not the stand-ins
    shipped = silu_tables.glu_table(fast_math).to(torch.float64)
    g = torch.arange(65536, dtype=torch.int32).mul(65536).view(torch.float32).to(torch.float64)
    exact = g * torch.sigmoid(float(ALPHA) * g)
    finite = torch.isfinite(g)
    large = finite & (exact.abs() >= 2.0**-100)
    assert ((shipped - exact).abs()[large] <= 2.0**-17 * exact.abs()[large]).all()
    assert ((shipped - exact).abs()[finite & ~large] <= 2.0**-100).all()
    assert (shipped[g == 0] == 0).all() and shipped[torch.isnan(g)].isnan().all()


def test_a_missing_activation_table_says_how_to_make_it(monkeypatch):
    monkeypatch.undo()  # the real loader, not the stand-in tables
    with pytest.raises(FileNotFoundError, match="python -m megamoe.silu_probe"):
        silu_tables._load("no_such_table.bin")


# ------------------------------------------------------------------------------- D6, bit for bit


def _bf16(x: np.ndarray) -> np.ndarray:
    """fp32 -> bf16 -> fp32, RNE (NaN kept NaN)."""
    bits = x.astype(np.float32).view(np.uint32).astype(np.uint64)
    rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16 << 16).astype(np.uint32)
    out = rounded.view(np.float32)
    return np.where(np.isnan(x), x, out).astype(np.float32)


def _d6_scalar(acc1: np.ndarray, w: np.ndarray, b1: np.ndarray | None, limit: float, fast: bool) -> np.ndarray:
    """SPEC §8 D6 steps 1-4 in numpy float32, element by element in the SPEC's order."""
    i = acc1.shape[1] // 2
    table = _table(fast).numpy()
    gate, up = acc1[:, :i].astype(np.float32), acc1[:, i:].astype(np.float32)
    if b1 is not None:
        gate = gate + b1[:, :i].astype(np.float32)
        up = up + b1[:, i:].astype(np.float32)
    bound = _bf16(np.array([limit], dtype=np.float32))[0]
    g, u = _bf16(gate), _bf16(up)
    g = np.where(np.isnan(g), g, np.minimum(g, bound))
    u = np.where(np.isnan(u), u, np.minimum(np.maximum(u, -bound), bound))
    s = table[(g.view(np.uint32) >> 16).astype(np.int64)]
    return ((u + np.float32(1.0)) * s) * w[:, None].astype(np.float32)


def _acc1_with_edges(rows: int, i: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    acc = torch.randn(rows, 2 * i, generator=g) * 6  # beyond +-7 on both sides
    acc[0, 0], acc[0, i] = -0.0, -0.0  # keeps its sign without b1
    acc[1, 1], acc[1, i + 1] = float("nan"), float("nan")
    acc[2, i + 2] = -1.0  # u = -1: the factor (u + 1) is exactly 0
    acc[3, 3], acc[3, i + 3] = 1e30, -1e30  # clamped to L and -L
    return acc


@pytest.mark.parametrize("fast", [True, False])
@pytest.mark.parametrize("with_bias", [True, False])
def test_d6_of_the_gpt_oss_variant_is_the_specs_float32_steps_bit_for_bit(fast, with_bias):
    rows, i = 40, 64
    acc1 = _acc1_with_edges(rows, i, seed=3)
    w = torch.rand(rows, generator=torch.Generator().manual_seed(4)) * 2
    b1 = (torch.randn(rows, 2 * i) * 3).to(torch.bfloat16) if with_bias else None
    got = ref.swiglu(acc1, w, activation_clamp=None, fast_math=fast, activation="swiglu_oai", limit=7.0, b1=b1).numpy()
    want = _d6_scalar(acc1.numpy(), w.numpy(), None if b1 is None else b1.float().numpy(), 7.0, fast)
    nan = np.isnan(want)
    assert nan.any() and np.array_equal(np.isnan(got), nan)  # NaN stays NaN (its payload is §3's rule)
    assert np.array_equal(got[~nan].view(np.uint32), want[~nan].view(np.uint32))


def test_d6_adds_the_bias_before_rounding_to_bf16_not_after():
    # gate 1 + 2^-8 - 2^-10 with bias 2^-9: added in fp32 first, 1 + 2^-8 + 2^-10 rounds up to
    # 1 + 2^-7 (bf16 keeps 7 fraction bits); rounded first, the gate is 1 and 1 + 2^-9 rounds to 1.
    acc1 = torch.tensor([[1.0 + 2.0**-8 - 2.0**-10, 0.5]])
    b1 = torch.tensor([[2.0**-9, 0.0]]).to(torch.bfloat16)
    w = torch.ones(1)
    got = ref.swiglu(acc1, w, activation_clamp=None, fast_math=True, activation="swiglu_oai", b1=b1)
    g_first = float(ref.round_bf16(acc1[:, :1] + b1[:, :1].float()))
    g_late = float(ref.round_bf16(ref.round_bf16(acc1[:, :1]) + b1[:, :1].float()))
    assert g_first != g_late
    assert float(got[0, 0]) == float((0.5 + 1.0) * _table(True)[int(ref.encode_bf16(torch.tensor([g_first])))])


def test_bias_rows_give_each_pool_row_its_experts_bias_and_zeros_past_the_last_expert():
    bias = torch.arange(12, dtype=torch.float32).reshape(3, 4).to(torch.bfloat16)
    offsets = torch.tensor([0, 2, 2, 5], dtype=torch.int32)
    rows = ref.bias_rows(bias, offsets, 7)
    assert rows[:, 0].tolist() == [0, 0, 8, 8, 8, 0, 0]
    assert rows.dtype == torch.bfloat16


# ------------------------------------------------------------------------------- D8, bit for bit


def test_d8_adds_the_routing_weighted_b2_in_two_roundings_not_one_fma():
    # acc2 + w b2 where the product's rounding matters: w b2 = (1 + 2^-23)(1 + 2^-7) is not an fp32.
    acc2 = torch.tensor([[-1.0]], dtype=torch.float32)
    w = torch.tensor([1.0 + 2.0**-23])
    b2 = torch.tensor([[1.0 + 2.0**-7]]).to(torch.bfloat16)
    got = float(ref.add_l2_bias(acc2, b2=b2, route_weights=w))
    two = float(np.float32(np.float32(-1.0) + np.float32(np.float32(w[0]) * np.float32(b2.float()[0, 0]))))
    fma = float(np.float32(-1.0 + float(w[0]) * float(b2.float()[0, 0])))  # one rounding
    assert got == two and two != fma


# ------------------------------------------------------------------------------- whole calls


def _call(cfg=CFG, biases=True, seed=5):
    inputs = ref.make_inputs(cfg, [32, 19], seed=seed, distribution="skewed", masked_ratio=0.1)
    return inputs, _weights(cfg, seed=seed, biases=biases)


@pytest.mark.parametrize("biases", [True, False])
def test_the_reference_of_a_gpt_oss_call_conforms_at_every_dump_point(biases):
    inputs, weights = _call(biases=biases)
    report = suite.check(reference_dumps(CFG, inputs, weights))
    assert report.ok, report.text()


def _tampered(point: str, change):
    def tamper(at, dump, ctx):
        if at == point:
            change(dump, ctx)

    return tamper


def _d6_without_b1(dump, ctx):
    valid = ref.valid_rows(dump)
    l1 = ref.l1_epilogue(dump[P.D5_ACC1], dump[P.D4_POOL_WEIGHTS], valid, **ref.activation_args(CFG, dump, None))
    dump[P.D6_L2_ACTS], dump[P.D6_L2_SF] = l1.l2_acts, l1.l2_sf


def _d6_plain_swiglu(dump, ctx):
    valid = ref.valid_rows(dump)
    l1 = ref.l1_epilogue(dump[P.D5_ACC1], dump[P.D4_POOL_WEIGHTS], valid, activation_clamp=7.0, fast_math=True)
    dump[P.D6_L2_ACTS], dump[P.D6_L2_SF] = l1.l2_acts, l1.l2_sf


def _d8_without_b2(dump, ctx):
    # rank 0's combine buffer as if no owner added its bias (owners' acc2 rows of rank 0's tokens)
    dump[P.D8_COMBINE][:] = float("nan")


@pytest.mark.parametrize(
    "point,change", [(P.D6, _d6_without_b1), (P.D6, _d6_plain_swiglu), (P.D8, _d8_without_b2)], ids=["b1", "silu", "b2"]
)
def test_the_suite_catches_a_gpt_oss_stage_that_departs_from_the_spec_at_its_point(point, change):
    inputs, weights = _call()
    report = suite.check(reference_dumps(CFG, inputs, weights, tamper=_tampered(point, change)))
    assert report.first_failure == point, report.text()


def test_the_d8_check_fails_when_the_kernel_leaves_b2_out():
    inputs, weights = _call()
    dumps = reference_dumps(CFG, inputs, weights)
    no_bias = dataclasses.replace(weights, b2=None)
    # What a kernel without the bias would have written: the same call's combine buffers without b2.
    plain = reference_dumps(CFG, inputs, no_bias)
    for d, p in zip(dumps, plain):
        d.tensors[P.D8_COMBINE] = p[P.D8_COMBINE]
    assert suite.check(dumps).status(P.D8) == "fail"


def test_the_oracle_of_a_gpt_oss_call_is_close_to_the_reference():
    inputs, weights = _call()
    result = ref.run_reference(CFG, inputs, weights)
    oracle = ref.run_oracle(CFG, inputs, weights)
    for y, orc in zip(result.y, oracle):
        assert ref.calc_diff(y.to(torch.float64), orc.y) < 1e-3
    # ... and the oracle is the variant's: the plain SwiGLU's oracle is far from it
    plain = ref.run_oracle(
        dataclasses.replace(CFG, activation="swiglu"), inputs, dataclasses.replace(weights, b1=None, b2=None)
    )
    assert ref.calc_diff(result.y[0].to(torch.float64), plain[0].y) > 1e-2


# ------------------------------------------------------------------------------- dumps


def test_a_dump_of_a_layer_with_biases_carries_them_through_save_load_and_weights_put_back(tmp_path):
    inputs, weights = _call()
    dumps = reference_dumps(CFG, inputs, weights)
    dumps[0].save(tmp_path / "r0.pt")
    loaded = Dump.load(tmp_path / "r0.pt")
    assert torch.equal(loaded.weights().b1, weights.b1[: CFG.local_experts])
    assert torch.equal(global_weights(dumps).b2, weights.b2)
    bare = [d.without_weights() for d in dumps]
    back = with_weights(bare, weights)
    assert torch.equal(back[1].weights().b2, weights.b2[CFG.local_experts :])
    unbiased = dataclasses.replace(weights, b1=None, b2=None)
    assert weights_digest(weights) != weights_digest(unbiased)
    with pytest.raises(ValueError, match="not the ones this dump was made with"):
        with_weights(bare, unbiased)


def test_gpt_oss_routing_is_the_top_k_logits_then_a_softmax_over_them_in_the_logits_dtype():
    logits = torch.tensor([[0.5, 3.0, -1.0, 3.0, 2.0], [1.0, 1.0, 1.0, 1.0, 1.0]]).to(torch.bfloat16)
    r = ref.gpt_oss_topk(logits, 3)
    assert r.topk_idx.tolist() == [[1, 3, 4], [0, 1, 2]]  # ties to the lower index
    want = torch.softmax(logits[0, [1, 3, 4]], dim=-1).float()  # bf16 softmax, as gpt-oss runs it
    assert torch.equal(r.topk_weights[0], want) and r.topk_weights.dtype == torch.float32
    assert torch.equal(r.topk_weights[1], torch.full((3,), 1 / 3).to(torch.bfloat16).float())


def test_the_gpt_oss_shape_runs_and_conforms_in_the_reference_without_padding():
    # H = I = 2880 = 90 x 32 (SPEC §8 shapes): x [T, 2880], x_sf [T, 90], no caller-side padding
    cfg = ref.MoEConfig(
        hidden=2880,
        intermediate=2880,
        num_experts=4,
        top_k=2,
        max_tokens_per_rank=8,
        block_m=8,
        activation="swiglu_oai",
    )
    inputs = ref.make_inputs(cfg, 8, seed=7)
    assert tuple(inputs[0].x_sf.shape) == (8, 90)
    report = suite.check(reference_dumps(cfg, inputs, _weights(cfg, seed=7)))
    assert report.ok, report.text()


# ------------------------------------------------------------------------------- command line


def _cli(capsys, *argv):
    from megamoe.cli import main

    code = main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


def test_megamoe_run_of_a_gpt_oss_model_goes_through_a_checkpoint_and_conforms(capsys, monkeypatch):
    pytest.importorskip("safetensors")
    from megamoe import cli

    monkeypatch.setitem(cli.GPT_OSS_MODELS, "gpt-oss-20b", 4)  # the model's shape, but 4 of its 32 experts
    code, out, err = _cli(capsys, "run", "--model", "gpt-oss-20b", "--tokens", "4", "--ranks", "1")
    assert code == 0, err
    assert "written as a gpt-oss checkpoint" in err and "H=2880 I=2880 E=4 top-4" in err
    assert "D8" in out


def test_megamoe_run_of_a_checkpoint_layer_takes_the_files_shape(capsys, tmp_path):
    pytest.importorskip("safetensors")
    from megamoe.checkpoints import gpt_oss_layer_shape, save_gpt_oss_experts

    cfg = dataclasses.replace(CFG, num_ranks=1)
    save_gpt_oss_experts(tmp_path / "m.safetensors", {3: _weights(cfg, seed=9)})
    assert gpt_oss_layer_shape(tmp_path / "m.safetensors", 3) == (4, 256, 128)
    code, out, err = _cli(capsys, "run", "--checkpoint", str(tmp_path), "--layer", "3", "--tokens", "8", "--ranks", "1")
    assert code == 0, err
    assert "loading layer 3's experts" in err and "H=256 I=128 E=4 top-4" in err


@pytest.mark.parametrize(
    "argv,words",
    [
        (["--checkpoint", "x"], "argument --checkpoint: needs --layer N"),
        (["--layer", "2"], "argument --layer: a layer of --checkpoint, which is not given"),
        (["--model", "gpt-oss-20b", "--clamp", "3"], "argument --clamp: gpt-oss's activation clamps"),
        (["--checkpoint", "/no/such/file", "--layer", "0"], "expected a .safetensors file or a folder"),
        (["--model", "gpt-oss-20b", "--checkpoint", "x", "--layer", "0"], "not both"),
    ],
)
def test_megamoe_runs_gpt_oss_options_are_refused_in_one_line_before_any_work(capsys, argv, words):
    code, out, err = _cli(capsys, "run", *argv)
    assert code == 2 and words in err and len(err.strip().splitlines()) == 1, err


def test_a_missing_glu_table_is_one_line_of_the_command_line_tool(capsys, monkeypatch):
    monkeypatch.undo()  # the real loader, pointed at table names that are not installed
    monkeypatch.setattr(silu_tables, "GLU_TABLE_FILES", {True: "no_glu_fast.bin", False: "no_glu_precise.bin"})
    code, out, err = _cli(capsys, "report", "--model", "gpt-oss-20b", "--tokens", "1", "--ranks", "1")
    assert code == 2 and "python -m megamoe.silu_probe" in err and len(err.strip().splitlines()) == 1, err


def test_a_plain_swiglu_dump_that_carries_a_b2_is_checked_without_it():
    # SPEC §3 D8 has no bias: a b2 in a "swiglu" layer's dump (which check_weights would refuse) is
    # not applied by the D8 check.
    cfg = dataclasses.replace(CFG, activation="swiglu")
    inputs, _ = _call(cfg)
    dumps = reference_dumps(cfg, inputs, _weights(cfg, biases=False))
    for d in dumps:
        d.tensors["weights.b2"] = torch.ones(cfg.local_experts, cfg.hidden, dtype=torch.bfloat16)
    assert suite.check(dumps).ok


def test_a_dump_with_biases_names_the_seed_of_its_biases_beside_that_of_its_weights():
    inputs, weights = _call()
    dump = reference_dumps(CFG, inputs, weights)[0]
    with pytest.raises(ref.MegaMoEInputError, match="argument 'biases_seed': expected the seed of random_biases too"):
        dump.without_weights(seed=5)
    cfg = CFG
    made = ref.random_weights(cfg.num_experts, cfg.hidden, cfg.intermediate, seed=5)
    made.b1, made.b2 = ref.random_biases(cfg.num_experts, cfg.hidden, cfg.intermediate, seed=6)
    dumps = reference_dumps(cfg, inputs, made)
    back = with_weights([d.without_weights(seed=5, biases_seed=6) for d in dumps])
    assert all(torch.equal(a["weights.b1"], b["weights.b1"]) for a, b in zip(back, dumps))
    assert suite.check(back).ok
    with pytest.raises(DumpFormatError, match="not the ones this dump was made with"):
        with_weights([d.without_weights(seed=5, biases_seed=7) for d in dumps])
