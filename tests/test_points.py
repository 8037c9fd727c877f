"""The dump-point table (megamoe.reference.points) is the one definition of every dump tensor: the
reference produces exactly its tensors with its dtypes and shapes, recorded kernel dumps hold the
same names, the suite checks every point and tensor of it with the declared check classes, and its
validation names what is wrong with a kernel's dump dict."""

import dataclasses
import re
from pathlib import Path

import pytest
import torch

from megamoe import reference as ref
from megamoe.conformance import result
from megamoe.conformance.dump import Dump, reference_dumps
from megamoe.conformance.faults import CATALOG, scenario_inputs
from megamoe.conformance.gemm import GEMMS
from megamoe.conformance.suite import STAGES, check
from megamoe.reference import points as P

FIXTURES = Path(__file__).parent / "fixtures"

SMALL = ref.MoEConfig(
    hidden=256, intermediate=128, num_experts=8, top_k=2, num_ranks=2, max_tokens_per_rank=40, block_m=16
)


def _dims(cfg: ref.MoEConfig, dump, tokens: int, counter_words: int | None = None) -> dict[str, int]:
    return P.dump_dims(cfg, tokens=tokens, pool_rows=int(dump[P.D4_EXPERT_OFFSETS][-1]), counter_words=counter_words)


def _reference(tokens, cfg=SMALL, seed=0):
    inputs = ref.make_inputs(cfg, tokens, seed=seed, masked_ratio=0.2)
    weights = ref.random_weights(cfg.num_experts, cfg.hidden, cfg.intermediate, seed=seed)
    return cfg, inputs, ref.run_reference(cfg, inputs, weights)


# ------------------------------------------------------------------------ the table itself


def test_the_stages_are_the_project_vocabulary_in_pipeline_order():
    assert P.STAGES == ("dispatch", "pool", "L1", "SwiGLU/requant", "L2", "combine", "cleanup")
    assert P.POINTS == tuple(f"D{n}" for n in range(1, 11))
    assert [P.stage_of(p) for p in ("D1", "D4", "D5", "D6", "D7", "D8", "D10")] == [
        "dispatch",
        "pool",
        "L1",
        "SwiGLU/requant",
        "L2",
        "L2",
        "cleanup",
    ]


def test_every_point_has_tensors_and_every_tensor_belongs_to_its_point_and_stage():
    for point in P.POINTS:
        assert P.tensors_of(point), point
    for name, t in P.TABLE.items():
        assert name == t.name and name.startswith(t.point + ".") and t.stage == P.stage_of(t.point)
        assert isinstance(t.dtype, torch.dtype) and t.shape and t.doc
        assert t.checks and set(t.checks) <= {P.EXACT, P.MULTISET, P.GEMM_BOUND, P.GEMM_EXACT, P.END_TO_END}


def test_every_tensor_has_a_constant_named_after_it_and_no_constant_names_anything_else():
    for name in P.NAMES:
        assert getattr(P, name.upper().replace(".", "_")) == name
    for point in P.POINTS:
        assert getattr(P, point) == point
    constants = {k for k, v in vars(P).items() if k[0] == "D" and k[1:2].isdigit() and isinstance(v, str)}
    assert constants == {n.upper().replace(".", "_") for n in P.NAMES} | set(P.POINTS)


def test_the_check_classes_of_the_suite_are_the_tables():
    for name in ("EXACT", "MULTISET", "GEMM_BOUND", "GEMM_EXACT", "END_TO_END", "GUARD"):
        assert getattr(result, name) == getattr(P, name) == name


def test_the_reference_and_the_suite_list_the_tables_points_in_its_order_with_its_stage_names():
    assert ref.POINTS == P.POINTS
    assert [(p, s) for p, s, _ in STAGES] == [(p, P.stage_of(p)) for p in P.POINTS]


def test_the_gemm_checks_are_the_points_whose_accumulators_the_table_bounds():
    bounded = {t.point: t.name for t in P.TABLE.values() if P.GEMM_BOUND in t.checks}
    assert {p: GEMMS[p][0] for p in GEMMS} == bounded


# ------------------------------------------------------------------------ the reference produces it


@pytest.mark.parametrize("tokens", [[40, 17], [0, 3], [0, 0]], ids=["full-and-partial", "one-rank-empty", "no-tokens"])
def test_the_reference_pipeline_produces_every_table_tensor_with_its_dtype_and_shape(tokens):
    cfg, inputs, res = _reference(tokens)
    for rank, dump in enumerate(res.dumps):
        assert set(dump) == set(P.NAMES)
        dims = _dims(cfg, dump, inputs[rank].num_tokens, counter_words=0)
        for name, t in P.TABLE.items():
            assert dump[name].dtype == t.dtype, (name, dump[name].dtype)
            assert tuple(dump[name].shape) == t.shape_of(dims), (name, tuple(dump[name].shape), t.shape)
        P.check_dump_tensors(dump, dims)  # the same, through the validation function


def test_a_pool_that_is_not_empty_has_p_rows_and_b_blocks():
    cfg, inputs, res = _reference([40, 17])
    dump = res.dumps[0]
    dims = _dims(cfg, dump, inputs[0].num_tokens)
    assert dims["P"] > 0 and dims["P"] % cfg.block_m == 0 and dims["B"] == dims["P"] // cfg.block_m
    assert dump[P.D4_POOL_X].shape == (dims["P"], cfg.hidden)
    assert dump[P.D6_L1_DONE].shape == (dims["B"],)


def test_recorded_kernel_dumps_hold_exactly_the_table_names_with_its_dtypes_and_shapes():
    files = sorted(FIXTURES.glob("*.pt"))
    assert files, "tests/fixtures holds no recorded dump"
    for path in files:
        d = Dump.load(path)
        points = {k for k in d.tensors if k.partition(".")[0] in P.POINT}
        assert points == set(P.NAMES), path.name
        P.check_dump_tensors(d.tensors, _dims(d.config, d, d["inputs.x"].shape[0]))  # C: the kernel's


# ------------------------------------------------------------------------ the suite checks it


def _checked(r: result.CheckResult) -> str:
    """The table tensor a result judges: its own name, less a note ("D8.combine (slots written)");
    an END_TO_END result is labelled "y vs float64 oracle" and judges its point's END_TO_END tensor."""
    if r.check == P.END_TO_END:
        return next(n for n in P.tensors_of(r.point) if P.END_TO_END in P.TABLE[n].checks)
    return r.tensor.split(" (")[0]


def test_every_checker_result_names_a_table_tensor_of_its_point_with_a_declared_check_class():
    cfg, inputs, weights = scenario_inputs("clamped")
    for snapped in (False, True):  # GEMM_BOUND on random data, GEMM_EXACT on grid-snapped inputs
        report = check(reference_dumps(cfg, inputs, weights, grid_snapped=snapped), end_to_end=True)
        assert report.ok, report.text()
        for r in report.results:
            t = P.TABLE[_checked(r)]
            assert r.point == t.point, r
            assert r.check in t.checks + (P.GUARD,), r
        assert {_checked(r) for r in report.results} == set(P.NAMES)  # every tensor is checked
        assert {r.check for r in report.results if r.point in GEMMS} == {P.GEMM_EXACT if snapped else P.GEMM_BOUND}


def test_every_fault_is_planted_at_a_point_of_the_table_and_every_point_has_one():
    assert {f.point for f in CATALOG} == set(P.POINTS)


# ------------------------------------------------------------------------ the validation function


@pytest.fixture(scope="module")
def good():
    cfg, inputs, res = _reference([40, 17])
    dump = res.dumps[0]
    return cfg, dump, _dims(cfg, dump, inputs[0].num_tokens, counter_words=0)


def _problem(tensors, dims) -> str:
    with pytest.raises(ValueError, match="do not match the dump-point table") as info:
        P.check_dump_tensors(tensors, dims)
    return str(info.value)


def test_the_validation_rejects_a_wrong_dtype_naming_the_tensor_and_both_dtypes(good):
    _, dump, dims = good
    msg = _problem(dict(dump, **{P.D5_ACC1: dump[P.D5_ACC1].to(torch.float64)}), dims)
    assert f"{P.D5_ACC1}: dtype float64, expected float32" in msg and "1 dump tensor(s)" in msg


def test_the_validation_rejects_a_wrong_shape_naming_the_tensor_and_the_expected_shape(good):
    _, dump, dims = good
    msg = _problem(dict(dump, **{P.D7_ACC2: dump[P.D7_ACC2][:, :7]}), dims)
    assert f"{P.D7_ACC2}: shape [{dims['P']}, 7], expected [{dims['P']}, {dims['H']}] = [P, H]" in msg


def test_the_validation_rejects_a_tensor_with_a_missing_axis(good):
    _, dump, dims = good
    msg = _problem(dict(dump, **{P.D9_Y: dump[P.D9_Y].flatten()}), dims)
    assert f"{P.D9_Y}: shape [{dump[P.D9_Y].numel()}], expected [{dims['T']}, {dims['H']}] = [T, H]" in msg


def test_the_validation_rejects_a_missing_tensor_naming_it_with_its_dtype_and_shape(good):
    _, dump, dims = good
    msg = _problem({k: v for k, v in dump.items() if k != P.D6_L1_DONE}, dims)
    assert f"{P.D6_L1_DONE}: missing (int32 [B])" in msg


def test_the_validation_rejects_a_name_the_table_does_not_know_at_a_dump_point(good):
    _, dump, dims = good
    typo = f"{P.D4}.pool_xs"
    msg = _problem(dict(dump, **{typo: dump[P.D4_POOL_X]}), dims)
    assert f"{typo}: not a tensor of the dump-point table" in msg


def test_the_validation_lists_every_problem_at_once(good):
    _, dump, dims = good
    bad = {k: v for k, v in dump.items() if k != P.D1_SEND_COUNTS}
    bad[P.D2_RECV_TOTALS] = bad[P.D2_RECV_TOTALS].long()
    problems = P.dump_problems(bad, dims)
    assert [p.split(":")[0] for p in problems] == [P.D1_SEND_COUNTS, P.D2_RECV_TOTALS]


def test_the_validation_leaves_inputs_and_weights_alone_and_a_kernels_counter_length_free(good):
    cfg, dump, dims = good
    free = {k: v for k, v in dims.items() if k != "C"}
    kernel_like = dict(dump, **{P.D10_COUNTERS: torch.zeros(17, dtype=torch.int32), "inputs.x": torch.zeros(1)})
    assert P.dump_problems(kernel_like, free) == []
    assert P.dump_problems(kernel_like, dims) == [f"{P.D10_COUNTERS}: shape [17], expected [0] = [C]"]


def test_the_validation_checks_only_the_points_asked_for(good):
    _, dump, dims = good
    gemm_only = {k: v for k, v in dump.items() if P.TABLE[k].point in (P.D4, P.D5)}
    assert P.dump_problems(gemm_only, dims, points=[P.D4, P.D5]) == []
    assert P.dump_problems(gemm_only, dims, points=[P.D6]) == [
        f"{n}: missing ({str(P.TABLE[n].dtype).removeprefix('torch.')} [{P.TABLE[n].shape}])"
        for n in P.tensors_of(P.D6)
    ]
    with pytest.raises(ValueError, match=r"argument 'points': expected dump points of the table \(D1, .*\), got D11"):
        P.dump_problems(gemm_only, dims, points=["D11"])


def test_a_shape_with_a_dim_the_caller_did_not_give_is_a_usage_error(good):
    _, dump, dims = good
    with pytest.raises(ValueError, match=re.escape(f"{P.D4_POOL_X} has shape [P, H]: the dims given lack P")):
        P.check_dump_tensors(dump, {k: v for k, v in dims.items() if k not in ("P", "B")})


def test_the_dims_follow_the_config(good):
    cfg, _, _ = good
    other = dataclasses.replace(cfg, num_ranks=4)
    dims = P.dump_dims(other, tokens=5, pool_rows=64)
    assert dims == {
        "H": 256,
        "I": 128,
        "E": 8,
        "E_l": 2,
        "K": 2,
        "R": 4,
        "T_max": 40,
        "T": 5,
        "P": 64,
        "B": 4,
    }
    assert P.TABLE[P.D4_EXPERT_OFFSETS].shape_of(dims) == (3,)
    assert P.TABLE[P.D5_ACC1].shape_of(dims) == (64, 256)
    assert P.TABLE[P.D6_L2_SF].shape_of(dims) == (64, 4)
    assert P.TABLE[P.D10_COUNTERS].shape_of(dims) == (None,)
