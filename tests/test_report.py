"""The oracle, calc_diff, the tolerance report and the `megamoe` command."""

import json

import pytest

import torch

from megamoe import reference as ref
from megamoe.cli import main
from megamoe.report import tolerance_report, to_markdown, ulp_histogram

CFG = ref.MoEConfig(
    hidden=256, intermediate=128, num_experts=8, top_k=2, num_ranks=2, max_tokens_per_rank=32, block_m=16
)


def test_calc_diff():
    x = torch.randn(100, dtype=torch.float64)
    assert ref.calc_diff(x, x) == 0.0 and ref.calc_diff(torch.zeros(3), torch.zeros(3)) == 0.0
    assert abs(ref.calc_diff(x, -x) - 2.0) < 1e-12


def test_ulp_histogram_buckets():
    h = ulp_histogram(torch.tensor([0.0, 0.3, 1.0, 1.5, 100.0]))
    assert h["0"] == 1 and h["<=0.5"] == 1 and h["<=1"] == 1 and h["<=2"] == 1 and h[">64"] == 1


def test_report_stage_local_errors_are_roundings():
    inputs = ref.make_inputs(CFG, seed=0)
    weights = ref.random_weights(8, 256, 128, seed=0)
    report = tolerance_report(CFG, inputs, weights)
    by_name = {s["stage"]: s for s in report["stages"]}
    assert by_name["L1 (D5 acc1) local = end-to-end"]["max_ulp"] <= 0.5  # one rounding of an exact sum
    assert by_name["L2 (D7 acc2) local"]["max_ulp"] <= 0.5
    assert by_name["combine (D9 y) local"]["max_ulp"] <= 0.5 + 2**-8  # fp32 adds, then one bf16 RNE
    assert by_name["SwiGLU/requant (D6 l2_acts) local"]["max_ulp"] < 1.0
    assert by_name["combine (D9 y) end-to-end"]["calc_diff"] < 1e-3
    assert "| stage |" in to_markdown(report)


def test_cli_run_on_cpu_says_so(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    out = tmp_path / "r.json"
    assert (
        main(
            ["run", "--hidden", "256", "--intermediate", "128", "--experts", "8", "--tokens", "16", "--json", str(out)]
        )
        == 0
    )
    captured = capsys.readouterr()
    assert "No CUDA GPU found: running the CPU reference" in captured.err
    assert "combine (D9 y) end-to-end" in captured.out
    assert json.loads(out.read_text())["stages"]


def test_cli_bad_shape_is_a_clear_error(capsys):
    assert main(["report", "--hidden", "200"]) == 2
    assert "argument --hidden: expected a multiple of 32" in capsys.readouterr().err


def test_the_tolerance_table_explains_its_rows_and_columns():
    inputs = ref.make_inputs(CFG, 8, seed=1)
    text = to_markdown(tolerance_report(CFG, inputs, ref.random_weights(8, 256, 128, seed=1)))
    legend = text.split("\n\n", 1)[1]  # under the table
    for words in (
        "**local** rows",
        "**end-to-end** rows",
        "**format**",
        "**calc_diff** = 1 - 2 sum(x y)",
        "**rel err",
        "**ulp 0 ... ulp >64**",
        "**max ulp**",
    ):
        assert words in legend, words


def test_the_kernels_report_reads_its_dumps_and_equals_the_references_on_the_references_dumps():
    from megamoe.conformance.dump import reference_dumps
    from megamoe.reference import points as P
    from megamoe.report import kernel_report

    inputs = ref.make_inputs(CFG, 24, seed=2)
    weights = ref.random_weights(8, 256, 128, seed=2)
    dumps = reference_dumps(CFG, inputs, weights)
    ours, theirs = kernel_report(dumps), tolerance_report(CFG, inputs, weights)
    assert ours["source"] == "fused kernel" and theirs["source"] == "reference"
    assert ours["stages"] == theirs["stages"]
    # as `megamoe run --processes` sends them: without weights, which the report regenerates
    assert kernel_report([d.without_weights(2) for d in dumps])["stages"] == theirs["stages"]
    # A y one bf16 step off in one element: the combine's local row sees it (so the rows are the dumps').
    y = dumps[1].tensors[P.D9_Y]
    y[3, 5] = (y[3, 5].float() * (1 + 2**-6)).to(y.dtype)
    row = {s["stage"]: s for s in kernel_report(dumps)["stages"]}["combine (D9 y) local"]
    assert row["max_ulp"] >= 1.5


def test_the_kernels_report_refuses_a_pool_in_another_order_and_sampled_dumps():
    from megamoe.conformance.dump import reference_dumps, sample_tokens
    from megamoe.conformance.suite import check
    from megamoe.reference import points as P
    from megamoe.report import kernel_report

    dumps = reference_dumps(CFG, ref.make_inputs(CFG, 24, seed=2), ref.random_weights(8, 256, 128, seed=2))
    # Two valid rows of one expert swapped in every pool-shaped tensor: conformant (SPEC §3 leaves
    # the order within an expert free), but the report would pair them with the wrong oracle rows.
    d = dumps[0]
    a, b = [int(p) for p in ref.valid_rows(d.tensors).nonzero()[:2]]
    for name, t in d.tensors.items():
        if name.startswith(("D4.pool", "D5.", "D6.l2", "D7.")) and name != P.D4_EXPERT_OFFSETS:
            t[[a, b]] = t[[b, a]]
    assert check(dumps).ok
    with pytest.raises(ref.MegaMoEInputError, match="the reference's pool order"):
        kernel_report(dumps)
    with pytest.raises(ref.MegaMoEInputError, match="whole dumps"):
        kernel_report(sample_tokens(dumps, [[0], [1]]))
