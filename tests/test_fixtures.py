"""Kernel dumps recorded on an H200 (tests/gpu/record_fixtures.py), checked on the CPU by the
conformance suite on every CI run — and a fault planted in one is still caught at its stage.

sm90_<promotion>_rank<r>.pt: the standalone GEMM core (D5-D8 the kernel's). fused_<case>_rank<r>.pt:
the fused kernel, every dump point D1-D10 its own, saved without weights (regenerated here from the
seed the files name). sampled_<case>_rank0.pt: the fused kernel at gpt-oss-20b's shape, cut to a
few tokens of each call (conformance.dump.sample_tokens)."""

import functools
import re
from pathlib import Path

import pytest
import torch

from megamoe import reference as ref
from megamoe.conformance.dump import Dump, DumpFormatError, with_weights
from megamoe.conformance.suite import STAGES, check

from .gpu.record_fixtures import (
    FUSED_BUDGET,
    FUSED_CASES,
    FUSED_WEIGHTS_SEED,
    GPT_OSS_SEEDS,
    SAMPLED_BUDGET,
    SAMPLED_CASES,
    fused_size_estimate,
    gpt_oss_config,
    gpt_oss_weights,
    sampled_file,
    sampled_size_estimate,
)

FIXTURES = Path(__file__).parent / "fixtures"


def _load(promotion: str) -> list[Dump]:
    return [Dump.load(p) for p in sorted(FIXTURES.glob(f"sm90_{promotion}_rank*.pt"))]


@pytest.mark.parametrize("promotion", ["k32", "k128"])
def test_recorded_kernel_dumps_conform(promotion):
    dumps = _load(promotion)
    assert len(dumps) == 2 and dumps[0].meta["kernel_mode"] == f"sm90-gemm-{promotion}"
    report = check(dumps)
    assert report.ok, report.text()
    gemm = [r for r in report.results if r.point in ("D5", "D7")]
    assert gemm and all(r.max_error < 1 for r in gemm)


def test_a_flipped_code_in_a_recorded_dump_is_caught_at_d6():
    dumps = _load("k32")
    d = dumps[1]
    p = int(ref.valid_rows(d.tensors).nonzero()[0])
    d.tensors["D6.l2_acts"][p, 0] ^= 0x01
    assert check(dumps).first_failure == "D6"


# ---- the fused kernel's dumps ----------------------------------------------------------------
FUSED_RE = re.compile(r"fused_(?P<case>.+)_rank(?P<rank>\d+)\.pt")
RECORD = (
    "no fused-kernel fixture in tests/fixtures yet: record them on an H200 with "
    "`MEGAMOE_CACHE_DIR=$PWD/.jitcache python -m tests.gpu.record_fixtures tests/fixtures --fused-only`"
)


def _fused_files() -> dict[str, list[Path]]:
    """{case: its files, rank order} of every fused_<case>_rank<r>.pt present."""
    calls: dict[str, list[Path]] = {}
    for p in sorted(FIXTURES.glob("fused_*_rank*.pt")):
        m = FUSED_RE.fullmatch(p.name)
        if m:
            calls.setdefault(m["case"], []).append(p)
    return {c: sorted(ps, key=lambda p: int(FUSED_RE.fullmatch(p.name)["rank"])) for c, ps in sorted(calls.items())}


FUSED = _fused_files()


def _fused_params(only_with_tokens: bool = False):
    cases = [c for c, ps in FUSED.items() if not only_with_tokens or _tokens(ps) > 0]
    if not cases:
        return [pytest.param(None, marks=pytest.mark.skip(reason=RECORD), id="none-recorded")]
    return cases


def _tokens(paths: list[Path]) -> int:
    try:
        return sum(Dump.load(p)["inputs.x"].shape[0] for p in paths)
    except DumpFormatError:
        return 1  # collected all the same: the tests that load it say what is wrong


def _load_fused(case: str) -> list[Dump]:
    """One recorded fused call, every rank, with the weights regenerated from the seed it names
    (with_weights checks them against the SHA-256 each file holds)."""
    return with_weights([Dump.load(p) for p in FUSED[case]])


@pytest.mark.parametrize("case", _fused_params())
def test_the_fused_fixtures_are_the_fused_kernels_own_dumps_saved_without_their_weights(case):
    for path in FUSED[case]:
        d = Dump.load(path)
        assert d.meta["kernel_mode"].startswith("sm90-fused"), (path.name, d.meta["kernel_mode"])
        assert "sm90 fused kernel" in d.meta["build_id"], d.meta["build_id"]
        assert not d.has_weights and d.meta["weights"]["random_weights_seed"] == FUSED_WEIGHTS_SEED
        assert d.world_size == len(FUSED[case]) and path.name == f"fused_{case}_rank{d.rank}.pt"
        # a kernel's dump holds its counter words (a reference dump has none)
        assert d["D10.counters"].numel() > 0
    want = FUSED_CASES.get(case)
    if want is not None:  # the call record_fixtures makes under that name
        d = Dump.load(FUSED[case][0])
        assert d.config == want.config
        assert tuple(Dump.load(p)["inputs.x"].shape[0] for p in FUSED[case]) == want.tokens_per_rank


@pytest.mark.parametrize("case", _fused_params())
def test_every_dump_point_of_a_recorded_fused_call_passes_on_the_cpu(case):
    dumps = _load_fused(case)
    assert all(d.has_weights for d in dumps)
    report = check(dumps)
    assert report.ok, report.text()
    tokens = sum(d["inputs.x"].shape[0] for d in dumps)
    for point, _, _ in STAGES:
        # a call without tokens has nothing to compare at the pool-shaped points (n/a or skip)
        allowed = ("pass",) if tokens else ("pass", "n/a", "skip")
        assert report.status(point) in allowed, (point, report.status(point), report.text())
    assert report.status("D1") == report.status("D2") == report.status("D10") == "pass"
    gemm = [r for r in report.results if r.point in ("D5", "D7") and r.status == "pass"]
    assert all(r.max_error < 1 for r in gemm)


def _flip_pool_x(d: Dump) -> None:
    p = int(ref.valid_rows(d.tensors).nonzero()[0])
    d.tensors["D4.pool_x"][p, 0] ^= 0x01


def _flip_l2_act(d: Dump) -> None:
    p = int(ref.valid_rows(d.tensors).nonzero()[-1])
    d.tensors["D6.l2_acts"][p, 3] ^= 0x01


def _change_y(d: Dump) -> None:
    d.tensors["D9.y"].view(torch.int16)[-1, 5] ^= 0x01


def _dirty_counter(d: Dump) -> None:
    d.tensors["D10.counters"][0] = 1


FAULTS = {"D4": _flip_pool_x, "D6": _flip_l2_act, "D9": _change_y, "D10": _dirty_counter}


@pytest.mark.parametrize("point", list(FAULTS))
@pytest.mark.parametrize("case", _fused_params(only_with_tokens=True))
def test_a_fault_planted_in_a_recorded_fused_dump_is_caught_at_its_stage(case, point):
    dumps = _load_fused(case)
    planted = [d.copy() for d in dumps]
    FAULTS[point](planted[0])
    report = check(planted)
    assert report.first_failure == point, report.text()
    assert check(dumps).ok  # the copy took the fault, not the loaded fixture


def test_the_recorded_fused_fixtures_take_under_2_mb_for_one_rank_and_1_mb_for_two():
    if not FUSED:
        pytest.skip(RECORD)
    for ranks, budget in FUSED_BUDGET.items():
        files = [p for ps in FUSED.values() if len(ps) == ranks for p in ps]
        total = sum(p.stat().st_size for p in files)
        assert total < budget, f"{total:,} bytes in {len(files)} {ranks}-rank fused fixtures (budget {budget:,})"


def test_the_planned_fused_fixtures_would_take_under_2_mb_for_one_rank_and_1_mb_for_two():
    # record_fixtures' calls, estimated from the reference on the CPU, before any GPU records them
    for ranks, budget in FUSED_BUDGET.items():
        sizes = {c: fused_size_estimate(c) for c, f in FUSED_CASES.items() if len(f.tokens_per_rank) == ranks}
        assert sizes and sum(sizes.values()) < budget, (ranks, sizes)


def test_check_takes_one_dump_file_as_a_string_or_a_path_as_well_as_a_list_of_them():
    # A string is no list of file names: check("rank0.pt") once tried to load the file "r".
    path = FIXTURES / "fused_one_hot_rank0.pt"
    for one in (str(path), path, [str(path)], Dump.load(path)):
        report = check(one)
        assert report.ok, report.text()
    with pytest.raises(ref.MegaMoEInputError, match=r"argument 'dumps': expected Dump objects or dump file paths"):
        check([path, 3])
    with pytest.raises(ref.MegaMoEInputError, match=r"argument 'weights': expected ExpertWeights, got dict"):
        check(path, weights={})


# ---- the fused kernel at gpt-oss-20b's shape, sampled ----------------------------------------
# Recorded on the H200 (bench/NOTES.md v30); record again with
# `MEGAMOE_CACHE_DIR=$PWD/.jitcache python -m tests.gpu.record_fixtures tests/fixtures --sampled-only`.
SAMPLED = {c: FIXTURES / sampled_file(c) for c in SAMPLED_CASES}


def test_every_gpt_oss_20b_call_has_its_recorded_fixture():
    missing = [p.name for p in SAMPLED.values() if not p.exists()]
    assert not missing, f"missing from tests/fixtures: {missing}"


@functools.lru_cache(maxsize=1)
def _gpt_oss_weights() -> ref.ExpertWeights:
    return gpt_oss_weights()  # E 32 at 2880: ~40 s on two cores, once per session


def _load_sampled(case: str) -> list[Dump]:
    return with_weights([Dump.load(SAMPLED[case])], _gpt_oss_weights())


@pytest.mark.parametrize("case", list(SAMPLED))
def test_every_dump_point_of_a_recorded_gpt_oss_20b_call_passes_on_the_cpu_for_the_tokens_it_holds(case):
    tokens, keep = SAMPLED_CASES[case]
    bare = Dump.load(SAMPLED[case])
    assert bare.sampled and not bare.has_weights and bare.config == gpt_oss_config()
    assert bare.meta["kernel_mode"] == "sm90-fused-k32" and "sm90 fused kernel" in bare.meta["build_id"]
    seeds = bare.meta["weights"]
    assert (seeds["random_weights_seed"], seeds["random_biases_seed"]) == GPT_OSS_SEEDS
    assert bare["inputs.topk_idx"].shape[0] == tokens and bare.tokens_checked().nonzero().flatten().tolist() == keep
    report = check(_load_sampled(case))
    assert report.ok, report.text()
    for point, _, _ in STAGES:
        assert report.status(point) == "pass", (point, report.text())


def test_a_fault_planted_in_a_recorded_gpt_oss_20b_dump_is_caught_at_its_stage():
    d = _load_sampled(next(iter(SAMPLED)))[0].copy()
    d.tensors["D6.l2_acts"][int(d.rows_checked().nonzero()[0]), 7] ^= 0x01
    assert check([d]).first_failure == "D6"


def test_the_gpt_oss_20b_fixtures_take_under_their_budget_recorded_and_planned():
    planned = {c: sampled_size_estimate(c) for c in SAMPLED_CASES}
    assert sum(planned.values()) < SAMPLED_BUDGET, planned
    recorded = sum(p.stat().st_size for p in SAMPLED.values() if p.exists())
    assert recorded < SAMPLED_BUDGET, f"{recorded:,} bytes in {len(SAMPLED)} sampled fixtures"
