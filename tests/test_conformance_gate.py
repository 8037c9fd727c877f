"""The conformance suite as a CI gate cannot pass by accident: no dumps, a glob that matches nothing
or an incomplete set of ranks stops the run; each (dump point, rank) is its own test, so a CI log
names the failing rank; a check over 0 elements is "not applicable", never a pass."""

import subprocess
import sys

import torch

from megamoe.reference import points as P
from megamoe.conformance.compare import exact, multiset
from megamoe.conformance.dump import reference_dumps
from megamoe.conformance.faults import scenario_inputs
from megamoe.conformance.result import NA, PASS
from megamoe.conformance.suite import LEGEND, check


def _write_dumps(folder):
    cfg, inputs, weights = scenario_inputs("clamped", 3)
    dumps = reference_dumps(cfg, inputs, weights)
    for d in dumps:
        d.save(folder / f"rank{d.rank}.pt")
    return dumps


def _gate(cwd, *args):
    """The README's CI command, in a folder of its own."""
    return subprocess.run(
        [sys.executable, "-m", "pytest", "--pyargs", "megamoe.conformance", "-q", "-p", "no:cacheprovider", *args],
        capture_output=True,
        text=True,
        cwd=cwd,
    )


def test_the_gate_without_dumps_is_an_error_not_a_skip(tmp_path):
    run = _gate(tmp_path)
    assert run.returncode not in (0, 5), run.stdout
    assert "the megamoe conformance tests need dump files: pass --megamoe-dumps GLOB" in run.stdout
    assert "skipped" not in run.stdout


def test_a_glob_that_matches_no_file_is_a_usage_error(tmp_path):
    run = _gate(tmp_path, "--megamoe-dumps", str(tmp_path / "rnu/rank*.pt"))
    assert run.returncode == 4, run.stdout + run.stderr
    assert f"--megamoe-dumps '{tmp_path / 'rnu/rank*.pt'}' matches no file" in run.stderr


def test_an_incomplete_set_of_ranks_is_refused_as_the_cli_refuses_it(tmp_path):
    _write_dumps(tmp_path)
    run = _gate(tmp_path, "--megamoe-dumps", str(tmp_path / "rank0.pt"))
    assert run.returncode not in (0, 5), run.stdout
    assert "check needs the dumps of all 2 ranks of one call, got ranks [0]" in run.stdout
    assert "FAILED" not in run.stdout  # not reported as D2/D3/D4/D8 failures


def test_each_dump_point_and_rank_is_its_own_test_so_the_log_names_the_failing_rank(tmp_path):
    d = _write_dumps(tmp_path)[1]
    d.tensors[P.D9_Y].view(torch.int16)[0, 0] ^= 0x0001  # the last stage: nothing after it reads y
    d.save(tmp_path / "rank1.pt")
    run = _gate(tmp_path, "--megamoe-dumps", str(tmp_path / "rank*.pt"), "-rA")
    assert run.returncode == 1, run.stdout
    assert "FAILED test_dumps.py::test_dump_point[D9-rank1]" in run.stdout
    assert "PASSED test_dumps.py::test_dump_point[D9-rank0]" in run.stdout
    assert "1 failed, 19 passed" in run.stdout


def test_a_check_over_zero_elements_is_not_applicable_not_a_pass():
    empty = torch.zeros(0, dtype=torch.int32)
    assert exact(P.D10, P.D10_COUNTERS, 0, empty, empty, kind="int").status == NA
    no_rows = torch.zeros(4, 3, dtype=torch.int32)
    assert (
        exact(P.D6, P.D6_L2_ACTS, 0, no_rows, no_rows, kind="int", rows=torch.zeros(4, dtype=torch.bool)).status == NA
    )
    assert multiset(P.D3, P.D3_SOURCE_LISTS, 0, torch.zeros(0, 3), torch.zeros(0, 3), what="entries").status == NA
    cfg, inputs, weights = scenario_inputs("clamped", 0)
    report = check(reference_dumps(cfg, inputs, weights))  # the reference has no counters: D10.counters is empty
    counters = [r for r in report.results if r.tensor == P.D10_COUNTERS]
    assert counters and all(r.status == NA and r.elements == 0 for r in counters)
    assert all(r.status != PASS for r in report.results if r.elements == 0)
    assert "| D10.counters | cleanup | EXACT | 0 | n/a | 0 | 0 |  |" in report.table()
    assert report.ok  # not applicable is no failure either


def test_a_call_without_tokens_does_not_claim_its_empty_points_conform():
    cfg, inputs, weights = scenario_inputs("clamped", 0)
    empty = [type(inp)(inp.x[:0], inp.x_sf[:0], inp.topk_idx[:0], inp.topk_weights[:0]) for inp in inputs]
    report = check(reference_dumps(cfg, empty, weights))
    assert report.ok
    last = report.text().splitlines()[-1]
    assert last.startswith("all stages conform; nothing to compare at ") and "D5" in last and "D9" in last


def test_the_check_report_explains_its_columns():
    cfg, inputs, weights = scenario_inputs("clamped", 0)
    text = check(reference_dumps(cfg, inputs, weights)).text()
    assert LEGEND in text
    assert "max error: GEMM_BOUND rows: the largest |acc - exact| / (tau * sum|a*b|)" in LEGEND
    assert "END_TO_END rows: calc_diff" in LEGEND and "n/a (nothing to compare" in LEGEND
