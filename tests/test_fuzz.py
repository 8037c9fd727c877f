"""The fuzzer (megamoe/fuzz.py): its cases are reproducible from two numbers, reach every edge the
issue names, put those edges into the tensors, pass the suite on the reference (the CPU-sized
subset CI runs), and a planted fault fails its case with the command that reproduces it."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from megamoe import fuzz
from megamoe import reference as ref
from megamoe.reference import points as P

DRAWS = [fuzz.draw(0, i) for i in range(600)]


def test_a_case_is_drawn_from_its_seed_and_index_alone():
    assert fuzz.draw(3, 17) == fuzz.draw(3, 17)
    assert fuzz.draw(3, 17) != fuzz.draw(4, 17)
    a, b = fuzz.case_tensors(fuzz.draw(3, 17))[1:], fuzz.case_tensors(fuzz.draw(3, 17))[1:]
    assert all(torch.equal(s.x.view(torch.uint8), t.x.view(torch.uint8)) for s, t in zip(a[0], b[0]))
    assert torch.equal(a[1].w1_sf, b[1].w1_sf)


def test_every_draw_is_a_shape_the_layer_takes():
    for c in DRAWS:
        cfg = c.cfg  # MoEConfig checks the fields
        # the fast mode's multiples of 512; the exact mode's SPEC §8 sizes (multiples of 32)
        hm, im = (512, 512) if c.promotion == "k128" else (32, 32)
        assert c.hidden % hm == 0 and c.intermediate % im == 0, c
        assert cfg.num_experts % cfg.num_ranks == 0 and cfg.local_experts <= 256, c
        assert all(0 <= t <= c.max_tokens for t in c.tokens), c
        if c.distribution == "empty_experts":
            assert c.top_k <= c.experts // 2, c


@pytest.mark.parametrize(
    "what,seen",
    [
        ("every R", lambda cs: {c.ranks for c in cs} == {1, 2, 4}),
        ("both promotions", lambda cs: {c.promotion for c in cs} == {"k32", "k128"}),
        ("sizes not in whole K blocks", lambda cs: any(c.hidden % 128 or c.intermediate % 128 for c in cs)),
        ("both activations", lambda cs: {c.activation for c in cs} == {"swiglu", "swiglu_oai"}),
        (
            "SPEC §8's activation and sizes on the prefill engine",
            lambda cs: (
                any(c.engine == "prefill" and c.activation == "swiglu_oai" for c in cs)
                and any(c.engine == "prefill" and (c.hidden % 256 or c.intermediate % 128) for c in cs)
            ),
        ),
        ("every engine", lambda cs: {c.engine for c in cs} == {*fuzz.ENGINES, "narrow"}),
        (
            "the narrow engine in the exact mode only",
            lambda cs: {c.promotion for c in cs if c.engine == "narrow"} == {"k32"},
        ),
        (
            "a predecoded layer on the prefill engine, both promotions",
            lambda cs: {c.promotion for c in cs if c.predecoded and c.engine == "prefill"} == {"k32", "k128"},
        ),
        ("every activation scale mode", lambda cs: {c.x_scales for c in cs} == set(fuzz.SCALE_MODES)),
        ("every weight scale mode", lambda cs: {c.w_scales for c in cs} == set(fuzz.SCALE_MODES)),
        ("every routing weight mode", lambda cs: {c.route_weights for c in cs} == set(fuzz.ROUTE_WEIGHTS)),
        ("every distribution", lambda cs: {c.distribution for c in cs} == set(ref.routing.DISTRIBUTIONS)),
        ("T = 0 on one rank of several", lambda cs: any(0 in c.tokens and max(c.tokens) > 0 for c in cs)),
        ("T = T_max", lambda cs: any(c.max_tokens in c.tokens for c in cs)),
        ("uneven T", lambda cs: any(len(set(c.tokens)) > 1 for c in cs)),
        ("every slot masked", lambda cs: any(c.masked == 1.0 for c in cs)),
        ("some slots masked", lambda cs: any(0.0 < c.masked < 1.0 for c in cs)),
        ("clamp on and off", lambda cs: {c.clamp is None for c in cs} == {True, False}),
        ("both SiLU tables", lambda cs: {c.fast_math for c in cs} == {True, False}),
        ("NaN payloads", lambda cs: any(c.nan_payloads for c in cs)),
        ("a full expert", lambda cs: any(c.distribution == "one_hot" and c.masked == 0.0 for c in cs)),
    ],
)
def test_the_draws_reach_every_edge(what, seen):
    assert seen(DRAWS), what


def _case(**kw) -> fuzz.Case:
    base = fuzz.draw(0, 0, small=True)
    fields = dict(ranks=1, experts=4, top_k=2, tokens=(33,), max_tokens=33, hidden=256, intermediate=128)
    return dataclasses.replace(base, **{**fields, **kw})


def test_extreme_scales_put_bytes_0_and_254_into_activations_and_weights():
    _, inputs, weights = fuzz.case_tensors(_case(x_scales="extreme", w_scales="extreme"))
    for sf in (inputs[0].x_sf, weights.w1_sf, weights.w2_sf):
        assert (sf == 0).any() and (sf == 254).any()


def test_the_fast_modes_extreme_weights_reach_254_within_its_row_spread():
    _, _, weights = fuzz.case_tensors(_case(promotion="k128", hidden=512, intermediate=512, w_scales="extreme"))
    for sf in (weights.w1_sf, weights.w2_sf):
        assert (sf == 254).any() and (sf == 0).any()
        assert ref.quantize.weight_row_spread(sf) <= ref.quantize.FAST_ROW_SPREAD


def test_wide_scales_put_groups_20_binades_under_their_rows_largest():
    _, inputs, weights = fuzz.case_tensors(_case(x_scales="wide", w_scales="wide"))
    for sf in (inputs[0].x_sf, weights.w1_sf):
        spread = sf.amax(dim=-1, keepdim=True).int() - sf.int()
        assert (spread >= 20).any()


def test_zero_groups_hold_only_signed_zeros_and_nan_payloads_reach_x():
    _, inputs, weights = fuzz.case_tensors(_case(x_scales="zero", w_scales="zero", nan_payloads=True))
    x = inputs[0].x.view(torch.uint8).view(33, -1, 32)
    assert ((x & 0x7F) == 0).all(dim=-1).any() and (x == 0x80).all(dim=-1).any()
    w = weights.w1.view(*weights.w1_sf.shape, 16)
    assert (w == 0x88).all(dim=-1).any() and (w == 0).all(dim=-1).any()
    assert ((x & 0x7F) == 0x7F).any()


def test_cancelling_experts_are_exact_negatives_under_equal_weights():
    _, inputs, weights = fuzz.case_tensors(_case(route_weights="cancel", top_k=3, masked=0.0))
    assert torch.equal(weights.w1[1], weights.w1[0]) and torch.equal(weights.w2[1], weights.w2[0] ^ 0x88)
    rows = (inputs[0].topk_weights[:, :2] == 2.0**10).all(dim=1)
    assert rows.any() and (inputs[0].topk_idx[rows, :2] == torch.tensor([0, 1])).all()


def test_a_cpu_sized_run_passes_the_suite(capsys):
    assert fuzz.main(["--cases", "16", "--seed", "1"]) == 0
    assert "16 cases on cpu: 16 passed, 0 failed" in capsys.readouterr().out


def test_a_planted_fault_fails_its_case_and_prints_the_command_that_reproduces_it(monkeypatch, capsys):
    from megamoe.conformance import dump as dump_module

    def flip_one_intermediate_code(point, d, ctx):
        if point == P.D6 and ctx.rank == 0:
            rows = ref.valid_rows(d).nonzero()
            if len(rows):
                d[P.D6_L2_ACTS].view(torch.uint8)[rows[0, 0], 0] ^= 1

    real = dump_module.reference_dumps
    monkeypatch.setattr(
        dump_module, "reference_dumps", lambda *a, tamper=None, **kw: real(*a, **kw, tamper=flip_one_intermediate_code)
    )
    case = next(c for c in (fuzz.draw(5, i, small=True) for i in range(50)) if c.tokens[0] > 0 and c.masked == 0)
    assert fuzz.main(["--seed", "5", "--case", str(case.index)]) == 1
    captured = capsys.readouterr()
    assert f"reproduce: python -m megamoe.fuzz --device cpu --seed 5 --case {case.index}" in captured.err
    assert "D6" in captured.err and "Traceback" not in captured.err and f"FAILED case {case.index}" in captured.out
