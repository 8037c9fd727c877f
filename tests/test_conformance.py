"""The conformance suite: the fault catalog is caught 100 %, each fault at its own dump point with
every earlier point clean; no false alarm on 50 clean seeded runs; dump files; the CLI and the
pytest plugin; GEMM_EXACT on grid-snapped inputs; vacuous-pass guards."""

import dataclasses
import subprocess
import sys

import pytest
import torch

from megamoe import reference as ref
from megamoe.reference import points as P
from megamoe.cli import main
from megamoe.conformance.dump import Dump, DumpFormatError, make_dumps, reference_dumps
from megamoe.conformance.faults import CATALOG, planted, scenario_inputs
from megamoe.conformance.suite import STAGES, check

REQUIRED_FAULTS = {
    "gate_up_swapped",
    "interleave_4_instead_of_8",
    "fp4_nibbles_swapped",
    "weight_scale_byte_off_by_one",
    "requant_scale_byte_off_by_one",
    "requant_scales_shifted",
    "per_128_amax",
    "floor_instead_of_rceil",
    "truncation_instead_of_rne",
    "nan_instead_of_saturation",
    "clamp_skipped",
    "clamp_both_sides_of_gate",
    "routing_weight_at_combine",
    "minus_one_slot_counted_as_expert_0",
    "token_dropped",
    "token_duplicated",
    "slots_swapped_across_tokens",
    "combine_reverse_order",
    "combine_in_bf16",
    "padding_row_leaks",
    "arrival_counter_off_by_one",
    "counters_not_reset",
    "stats_not_added",
    "stale_row_from_previous_call",
    "half_written_row",
    "wrong_metadata_rank",
    "l1_accumulator_perturbed",
}


def test_catalog_covers_the_required_faults():
    names = {f.name for f in CATALOG}
    assert len(CATALOG) >= 30
    assert REQUIRED_FAULTS <= names, REQUIRED_FAULTS - names


@pytest.mark.parametrize("fault", CATALOG, ids=[f.name for f in CATALOG])
def test_fault_is_caught_at_its_stage(fault):
    report = check(planted(fault))
    assert report.first_failure == fault.point, report.text()
    order = [p for p, _, _ in STAGES]
    for earlier in order[: order.index(fault.point)]:
        assert report.status(earlier) == "pass", earlier


@pytest.mark.parametrize("chunk", range(5))
def test_no_false_alarm_on_clean_runs(chunk):
    """50 clean seeded runs (10 per chunk): both scenarios, every routing distribution."""
    for seed in range(chunk * 10, chunk * 10 + 10):
        cfg, inputs, weights = scenario_inputs("overflow" if seed % 5 == 4 else "clamped", seed)
        if seed % 3 == 1:
            inputs = ref.make_inputs(
                cfg,
                [seed % 48, 48 - seed % 17],
                seed=seed,
                distribution=ref.DISTRIBUTIONS[seed % 4],
                masked_ratio=0.1 * (seed % 4),
            )
        cfg = dataclasses.replace(cfg, fast_math=bool(seed % 2))
        report = check(reference_dumps(cfg, inputs, weights))
        assert report.ok, f"seed {seed}:\n{report.text()}"


def _dumps(tmp_path, **kw):
    cfg, inputs, weights = scenario_inputs("clamped", 3)
    paths = []
    for d in reference_dumps(cfg, inputs, weights, **kw):
        paths.append(tmp_path / f"rank{d.rank}.pt")
        d.save(paths[-1])
    return paths


def test_dump_files_round_trip_and_refuse_foreign_or_old_files(tmp_path):
    paths = _dumps(tmp_path)
    d = Dump.load(paths[0])
    assert d.rank == 0 and d.world_size == 2 and d.meta["kernel_mode"] == "reference"
    assert check([Dump.load(p) for p in paths]).ok
    foreign = tmp_path / "foreign.pt"
    torch.save({"x": torch.zeros(3)}, foreign)
    with pytest.raises(DumpFormatError, match="not a megamoe dump: a torch file without the 'megamoe-dump' header"):
        Dump.load(foreign)
    (tmp_path / "text.pt").write_text("hello")
    with pytest.raises(DumpFormatError, match="not a megamoe dump: a text file"):
        Dump.load(tmp_path / "text.pt")
    old = torch.load(paths[0], weights_only=True)
    old["version"] = 0
    torch.save(old, tmp_path / "old.pt")
    with pytest.raises(DumpFormatError, match="dump format version 0; this megamoe reads version 1"):
        Dump.load(tmp_path / "old.pt")


def test_cli_check_passes_a_reference_dump_and_names_the_stage_of_a_mutated_one(tmp_path, capsys):
    paths = [str(p) for p in _dumps(tmp_path)]
    assert main(["check", *paths]) == 0
    assert "all stages conform" in capsys.readouterr().out
    d = Dump.load(paths[1])
    valid = ref.valid_rows(d.tensors)
    p = int(valid.nonzero()[2])
    d.tensors[P.D6_L2_ACTS][p, 5] ^= 0x01  # one FP8 code, one bit
    d.save(paths[1])
    assert main(["check", *paths]) == 1
    out = capsys.readouterr().out
    assert "first failing dump point: D6; earlier stages clean: D1, D2, D3, D4, D5" in out
    s, t, k = d[P.D4_POOL_META][p].tolist()
    assert "FAIL D6.l2_acts (rank 1, EXACT): 1 of" in out
    assert f"pool row {p} (source rank {s}, token {t}, slot {k}" in out and "column 5]" in out
    assert "got 0x" in out and "expected 0x" in out


def test_pytest_plugin_runs_the_suite_on_dump_files(tmp_path):
    _dumps(tmp_path)
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "--pyargs",
            "megamoe.conformance",
            "-q",
            "-p",
            "no:cacheprovider",
            "--megamoe-dumps",
            str(tmp_path / "rank*.pt"),
        ],
        capture_output=True,
        text=True,
        cwd=tmp_path,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    assert "20 passed" in run.stdout  # 10 dump points x 2 ranks


def _grid_snapped():
    """Small integers, unit scales, ~70 % zeros: every partial sum is exact in any accumulator."""
    cfg = ref.MoEConfig(
        hidden=256, intermediate=128, num_experts=4, top_k=2, num_ranks=2, max_tokens_per_rank=24, block_m=16
    )
    g = torch.Generator().manual_seed(5)
    inputs = ref.make_inputs(cfg, 24, seed=5)
    for inp in inputs:
        vals = torch.randint(-2, 3, inp.x.shape, generator=g).float() * (torch.rand(inp.x.shape, generator=g) < 0.3)
        inp.x.view(torch.uint8).copy_(ref.encode_e4m3(vals))
        inp.x_sf.fill_(127)
    w1 = torch.randint(-2, 3, (4, 256, 256), generator=g).float() * (torch.rand(4, 256, 256, generator=g) < 0.3)
    w2 = torch.randint(-2, 3, (4, 256, 128), generator=g).float() * (torch.rand(4, 256, 128, generator=g) < 0.3)
    weights = ref.ExpertWeights(
        ref.pack_fp4(ref.encode_e2m1(w1)),
        torch.full((4, 256, 8), 127, dtype=torch.uint8),
        ref.pack_fp4(ref.encode_e2m1(w2)),
        torch.full((4, 256, 4), 127, dtype=torch.uint8),
    )
    return cfg, inputs, weights


def test_gemm_exact_on_grid_snapped_inputs():
    cfg, inputs, weights = _grid_snapped()
    dumps = reference_dumps(cfg, inputs, weights, grid_snapped=True)
    report = check(dumps)
    assert report.ok, report.text()
    assert {r.check for r in report.results if r.point in ("D5", "D7")} == {"GEMM_EXACT"}
    d = dumps[0]
    p = int(ref.valid_rows(d.tensors).nonzero()[0])
    d.tensors[P.D5_ACC1][p, 0] = torch.nextafter(d[P.D5_ACC1][p, 0], torch.tensor(1e30))  # one ulp
    assert check(dumps).first_failure == "D5"


def test_guard_fails_a_check_that_could_not_fail():
    cfg, inputs, weights = scenario_inputs("clamped", 0)
    zero = ref.ExpertWeights(torch.zeros_like(weights.w1), weights.w1_sf, weights.w2, weights.w2_sf)
    report = check(reference_dumps(cfg, inputs, zero))
    assert report.first_failure == "D5"
    assert any(r.check == "GUARD" and "all zero" in r.message for r in report.results)


def test_cli_check_writes_error_plots(tmp_path):
    pytest.importorskip("matplotlib")
    paths = [str(p) for p in _dumps(tmp_path)]
    assert (
        main(
            [
                "check",
                *paths,
                "--plots",
                str(tmp_path / "plots"),
                "--json",
                str(tmp_path / "r.json"),
                "--markdown",
                str(tmp_path / "r.md"),
            ]
        )
        == 0
    )
    for name in ("d5_acc1_error.png", "d7_acc2_error.png", "y_end_to_end_error.png"):
        assert (tmp_path / "plots" / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "| D6.l2_acts |" in (tmp_path / "r.md").read_text()


def test_a_malformed_dump_is_reported_not_raised():
    cfg, inputs, weights = scenario_inputs("clamped", 0)
    dumps = reference_dumps(cfg, inputs, weights)
    dumps[0].tensors[P.D7_ACC2] = dumps[0][P.D7_ACC2][:, :7]  # wrong shape
    dumps[1].tensors[P.D4_POOL_META][0] = torch.tensor([1, 10_000, 99], dtype=torch.int32)  # out of range
    report = check(dumps)
    assert report.first_failure == "D4"
    assert any(r.point == "D7" and r.failed for r in report.results)


def test_a_dump_that_left_the_statistics_alone_is_judged_by_that():
    cfg = ref.MoEConfig(hidden=256, intermediate=128, num_experts=4, top_k=2, num_ranks=1, max_tokens_per_rank=8)
    inputs = ref.make_inputs(cfg, 8, seed=2)
    weights = ref.random_weights(4, 256, 128, seed=2)
    dumps = reference_dumps(cfg, inputs, weights)
    dumps[0].meta["recv_stats_recorded"] = False  # the reference accumulated: now that is wrong
    assert check(dumps).first_failure == "D10"
    dumps[0].tensors[P.D10_RECV_STATS] = dumps[0]["inputs.recv_stats_before"].clone()
    assert check(dumps).ok


def test_dumps_made_rank_by_rank_with_local_weights_equal_the_all_ranks_dumps_and_conform():
    # What each rank of the fused layer does: wrap its own points with its own experts' weights.
    cfg = ref.MoEConfig(hidden=256, intermediate=128, num_experts=8, top_k=2, num_ranks=2, max_tokens_per_rank=16)
    weights = ref.random_weights(8, 256, 128, seed=1)
    inputs = ref.make_inputs(cfg, [16, 5], seed=2, distribution="skewed")
    whole = reference_dumps(cfg, inputs, weights)
    result = ref.run_reference(cfg, inputs, weights)
    e_l = cfg.local_experts
    by_rank = [
        make_dumps(
            cfg,
            [inputs[r]],
            weights.slice(r * e_l, (r + 1) * e_l),
            [result.dumps[r]],
            kernel_mode="reference",
            build_id="reference",
            tau=whole[r].meta["tau"],
            ranks=[r],
            call_id=whole[0].call_id,  # the id the ranks agreed on (megamoe.ranks.from_rank0)
        )[0]
        for r in range(2)
    ]
    for a, b in zip(by_rank, whole):
        assert a.meta == b.meta
        assert a.tensors.keys() == b.tensors.keys()
        assert [k for k in a.tensors if not _same_bytes(a[k], b[k])] == []
    assert check(by_rank, end_to_end=True).ok


def test_every_rank_of_one_call_records_the_same_call_id_and_two_calls_differ():
    cfg, inputs, weights = scenario_inputs("clamped", 3)
    first, second = reference_dumps(cfg, inputs, weights), reference_dumps(cfg, inputs, weights)
    assert first[0].call_id == first[1].call_id and len(first[0].call_id) == 32
    assert first[0].call_id != second[0].call_id


def test_ranks_of_two_calls_are_refused_in_one_line_naming_the_files(tmp_path):
    cfg, inputs, weights = scenario_inputs("clamped", 3)
    other_inputs = scenario_inputs("clamped", 4)[1]
    for name, inp in (("a", inputs), ("b", other_inputs)):
        (tmp_path / name).mkdir()
        for d in reference_dumps(cfg, inp, weights):
            d.save(tmp_path / name / f"rank{d.rank}.pt")
    a0, b1 = tmp_path / "a/rank0.pt", tmp_path / "b/rank1.pt"
    with pytest.raises(ValueError) as exc:
        check([a0, b1])
    message = str(exc.value)
    assert "\n" not in message
    assert message.startswith("check needs the dumps of one call; these are from different calls: ")
    assert f"{a0} (call {Dump.load(a0).call_id[:8]})" in message and f"{b1} (call " in message


def test_a_dump_without_a_call_id_is_of_an_unknown_call_and_checked_with_the_others():
    # Files written before dumps had a call id (the GPU-recorded fixtures) still load and check.
    cfg, inputs, weights = scenario_inputs("clamped", 3)
    dumps = reference_dumps(cfg, inputs, weights)
    del dumps[1].meta["call_id"]
    assert dumps[1].call_id is None
    assert check(dumps).ok


def _same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:  # NaN padding compares equal to itself
    return (
        a.dtype == b.dtype
        and a.shape == b.shape
        and torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))
    )
