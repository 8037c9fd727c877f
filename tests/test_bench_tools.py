"""The benchmark tools as a user meets them on a machine that lacks what they need: `--help` works,
and a missing GPU or tool is one line saying what is missing (and how to get it) before anything is
compiled, since a build takes minutes. CPU only: nothing here compiles or runs a kernel."""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from bench import probe, sass_stage
from megamoe.jit import build as jb

ROOT = Path(__file__).resolve().parents[1]


def _no_compiling(monkeypatch):
    def compile_(*args, **kwargs):
        raise AssertionError("compiled before checking what it needs")

    monkeypatch.setattr(probe.subprocess, "run", compile_)
    monkeypatch.setattr(jb, "build", compile_)


@pytest.mark.parametrize("name", probe.PROBES)
def test_a_probe_without_a_gpu_says_so_in_one_line_before_compiling(name, monkeypatch, capsys):
    _no_compiling(monkeypatch)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    module = importlib.import_module(f"bench.{name}")
    assert probe.run_probe(name, module.__doc__, []) == 2
    assert capsys.readouterr().err == f"bench.{name}: needs a CUDA GPU, and torch sees none on this machine\n"


@pytest.mark.parametrize("name", probe.PROBES)
def test_a_probe_answers_help_with_its_description_and_exit_0(name):
    run = subprocess.run([sys.executable, "-m", f"bench.{name}", "--help"], cwd=ROOT, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    assert run.stdout.startswith(f"usage: python -m bench.{name} [-h]")
    doc = importlib.import_module(f"bench.{name}").__doc__
    assert " ".join(doc.split()[:6]) in " ".join(run.stdout.split())


def _fake_nvidia_wheel(root: Path) -> Path:
    """site-packages/nvidia/cu13/bin/nvdisasm, as the nvidia-cuda-nvdisasm wheel lays it out."""
    tool = root / "nvidia" / "cu13" / "bin" / "nvdisasm"
    tool.parent.mkdir(parents=True)
    tool.write_text("#!/bin/sh\n")
    tool.chmod(0o755)
    return tool


def test_sass_stage_takes_the_pip_packages_nvdisasm_before_the_paths(tmp_path, monkeypatch):
    tool = _fake_nvidia_wheel(tmp_path)
    monkeypatch.delitem(sys.modules, "nvidia", raising=False)
    monkeypatch.setattr(sys, "path", [str(tmp_path)] + [p for p in sys.path if "site-packages" not in p])
    importlib.invalidate_caches()
    monkeypatch.setattr(sass_stage.shutil, "which", lambda name: f"/usr/local/cuda/bin/{name}")
    assert sass_stage.nvdisasm() == str(tool)


def test_sass_stage_without_nvdisasm_says_how_to_get_it_in_one_line_before_compiling(tmp_path, monkeypatch, capsys):
    _no_compiling(monkeypatch)
    monkeypatch.delitem(sys.modules, "nvidia", raising=False)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if "site-packages" not in p])  # no nvidia wheels
    importlib.invalidate_caches()
    monkeypatch.setattr(sass_stage.shutil, "which", lambda name: None)
    assert sass_stage.main([]) == 2
    err = capsys.readouterr().err
    assert err == f"bench.sass_stage: nvdisasm not found: {sass_stage.NVDISASM_HOW}\n"
    assert "pip install nvidia-cuda-nvdisasm" in err


def test_sass_stage_answers_help_with_exit_0():
    env = dict(os.environ, PATH="")  # --help needs no tool
    run = subprocess.run(
        [sys.executable, "-m", "bench.sass_stage", "--help"], cwd=ROOT, env=env, capture_output=True, text=True
    )
    assert run.returncode == 0, run.stderr
    assert run.stdout.startswith("usage: python -m bench.sass_stage [-h]")


def test_the_long_runs_expected_receive_counts_are_the_references_recv_totals():
    """bench.long_run checks recv_stats against the sum of its inputs' N_e (_received)."""
    from bench import long_run
    from megamoe import reference as ref

    cfg = ref.MoEConfig(**long_run.SHAPE, num_ranks=2)
    for inputs in long_run._inputs(cfg, 6, seed=3):
        totals = [d[ref.points.D2_RECV_TOTALS] for d in ref.run_reference(cfg, inputs, _weights(cfg)).dumps]
        for rank in range(2):
            assert torch.equal(long_run._received(cfg, inputs, rank), totals[rank].to(torch.int64))


def _weights(cfg):
    from megamoe import reference as ref

    return ref.random_weights(cfg.num_experts, cfg.hidden, cfg.intermediate, seed=0)


def test_the_long_run_and_the_hang_table_say_in_one_line_that_they_need_a_gpu(capsys):
    from bench import hangs, long_run

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    assert long_run.main(["--calls", "10"]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err
    with pytest.raises(SystemExit, match="needs a CUDA GPU"):
        hangs.main()


def test_the_sanitizer_table_names_an_unknown_tool_or_target_and_needs_compute_sanitizer(capsys, monkeypatch):
    from bench import sanitize

    with pytest.raises(SystemExit):
        sanitize.main(["--tools", "memcheck,leakcheck"])
    assert "unknown tool or target: leakcheck" in capsys.readouterr().err
    monkeypatch.setattr(sanitize.shutil, "which", lambda _: None)
    assert sanitize.main(["--targets", "gemm-wide-tile"]) == 2
    assert "needs compute-sanitizer" in capsys.readouterr().err


def test_the_sass_fingerprint_ignores_addresses_labels_and_file_hashes_and_sees_an_immediate():
    from bench.sass_identity import fingerprint

    a = "        /*0040*/                   IADD3 R1, R1, -0x7e, RZ ;\n        /*0050*/  BRA `(.L_x_12) ;\n"
    moved = "        /*0080*/                   IADD3 R1, R1, -0x7e, RZ ;\n        /*0090*/  BRA `(.L_x_3) ;\n"
    other = "        /*0040*/                   IADD3 R1, R1, -0x7d, RZ ;\n        /*0050*/  BRA `(.L_x_12) ;\n"
    assert fingerprint(a) == fingerprint(moved)
    assert fingerprint(a)[0] != fingerprint(other)[0]
    # a static function's name, whose hash comes from its file's text (a comment's edit moves it)
    call = "        /*0060*/  CALL.REL.NOINC `($k$_ZN64_INTERNAL_{}_33_k_cu_ca058f0d7megamoe3rowEv) ;\n"
    assert fingerprint(call.format("175c6bf0")) == fingerprint(call.format("7f02075b"))


# The end of a one-rank site's output on the H200 (bench.hangs, withheld arrival): CUDA's message
# spans lines, the record follows it, and the traceback quotes the lines that format the record and
# the seconds.
_HANG_OUT = """  File "/work/main/megamoe/moe.py", line 397, in named_failures
    raise RuntimeError(f"{exc} [the kernel trapped: {record}]") from exc
  File "/work/main/bench/hangs.py", line 67, in withheld_call
    raise RuntimeError(f"after {time.monotonic() - start:.1f} s: {exc}") from exc
RuntimeError: after 10.5 s: CUDA error: unspecified launch failure
Compile with `TORCH_USE_CUDA_DSA` to enable device-side assertions.
 [the kernel trapped: rank 0, SM block 0 thread 32: waited for arrival counter of pool block 0: expected 36, observed 35]
"""


def test_the_hang_tables_row_reads_the_seconds_and_the_record_not_the_quoted_source_line():
    from bench import hangs

    row = hangs._row(("arrival", 1, 0, "swapab"), _HANG_OUT)
    assert row == (
        "| arrival | 1 | 0 | swapab | - | 10.5 | rank 0, SM block 0 thread 32: waited for arrival counter of pool"
        " block 0: expected 36, observed 35 |"
    )
    two = hangs._row(("dispatch", 2, 1, "swapab"), "RANKFAILED 1\nrank 1 failed: " + _HANG_OUT.splitlines()[4])
    assert two.startswith("| dispatch | 2 | 1 | swapab | 1 | 10.5 | ")
    # Two ranks: the failed rank's record, not its peer's that timed out behind it and printed later.
    peer = (
        " [the kernel trapped: rank 0, SM block 3 thread 0: waited for L2 completion counter 1: expected 2, observed 1]"
    )
    two = hangs._row(
        ("arrival", 2, 1, "swapab"), "RANKFAILED 1\n" + _HANG_OUT.replace("rank 0, SM", "rank 1, SM") + peer
    )
    assert "| 1 | 10.5 | rank 1, SM block 0 thread 32: waited for arrival counter of pool block 0" in two


# Two of racecheck's hazard reports on the H200 (fused swap-AB k32), the second edited to a lane 0
# writer and another reading line, as --racecheck-report hazard --show-backtrace no prints them.
_RACE_OUT = """========= Error: Potential RAW hazard detected at __shared__ 0x2da04 in block (26,0,0) :
=========     Write Thread (33,0,0) at void megamoe::stage_token_scales<(int)64, (int)128>(const megamoe::GemmParams &)+0xca00 in producer.cuh:163
=========     Read Thread (160,0,0) at void megamoe::load_token_scales<(int)8, (int)0, (int)1>(const float *, int)+0x1fdb0 in promotion.cuh:20
=========     Current Value : 0
========= Error: Potential RAW hazard detected at __shared__ 0x2da04 in block (7,0,0) :
=========     Write Thread (32,0,0) at void megamoe::stage_token_scales<(int)64, (int)128>(const megamoe::GemmParams &)+0xca00 in producer.cuh:163
=========     Read Thread (160,0,0) at void megamoe::load_token_scales<(int)64, (int)0, (int)4>(const float *, int)+0x24c70 in promotion.cuh:26
=========     Current Value : 0
"""  # noqa: E501


def test_racechecks_hazards_are_grouped_by_their_two_sites_and_the_first_accesss_lane():
    from bench.sanitize import hazard_sites

    sites = hazard_sites(_RACE_OUT)
    first = (
        "RAW",
        "Write megamoe::stage_token_scales producer.cuh:163",
        "Read megamoe::load_token_scales promotion.cuh:20",
    )
    second = first[:2] + ("Read megamoe::load_token_scales promotion.cuh:26",)
    assert sites[first] == 1 and sites[first + ("first access not by lane 0",)] == 1
    assert sites[second] == 1 and sites[second + ("first access not by lane 0",)] == 0
    assert sum(n for k, n in sites.items() if len(k) == 3) == 2


def test_the_robustness_battery_names_its_parts_when_given_another():
    run = subprocess.run(["bash", str(ROOT / "bench" / "robustness.sh"), "5"], capture_output=True, text=True)
    assert run.returncode == 2 and run.stderr.startswith("usage: bash bench/robustness.sh [1 | 2 | 3 | 4]"), run.stderr


# A SASS listing as nvdisasm prints it: an item loop around two hot loops (one with a spilled word),
# and a loop that ptxas rotated into the second (its branch back lands inside it).
_SASS = """
.L_x_1:
        /*0000*/                   MOV R1, R2 ;
.L_x_2:
        /*0010*/                   QGMMA.64x8x32.F32.E4M3.E4M3 R24, R32, gdesc[UR8], RZ, !UPT, gsb0 ;
        /*0020*/                   QGMMA.64x8x32.F32.E4M3.E4M3 R28, R36, gdesc[UR8], RZ, !UPT, gsb0 ;
        /*0030*/                   QGMMA.64x8x32.F32.E4M3.E4M3 R24, R40, gdesc[UR8], RZ, !UPT, gsb0 ;
        /*0040*/                   QGMMA.64x8x32.F32.E4M3.E4M3 R28, R44, gdesc[UR8], RZ, !UPT, gsb0 ;
        /*0050*/               @P0 BRA `(.L_x_2) ;
.L_x_3:
        /*0060*/                   LDL R4, [R1+0x4] ;
.L_x_4:
        /*0070*/                   QGMMA.64x64x32.F32.E4M3.E4M3 R24, R32, gdesc[UR8], RZ, !UPT, gsb0 ;
        /*0080*/                   QGMMA.64x64x32.F32.E4M3.E4M3 R88, R36, gdesc[UR8], RZ, !UPT, gsb0 ;
        /*0090*/              @!P1 BRA `(.L_x_3) ;
        /*00a0*/                   BRA `(.L_x_1) ;
        /*00b0*/                   BRA `(.L_x_4) ;
"""


def test_sass_stage_finds_each_innermost_wgmma_loop_and_counts_a_stage_and_its_spills():
    hot = sass_stage.hot_loops(_SASS)
    assert [(lo, hi) for lo, hi, _ in hot] == [(0x10, 0x50), (0x60, 0x90)]  # not the loops around or into them
    assert sass_stage.loop_cost(hot[0][2], prefill=False) == (8, 5.0, 0)  # 5 instructions, 4 wgmmas: one stage
    assert sass_stage.loop_cost(hot[1][2], prefill=False) == (64, 8.0, 1)  # 4 instructions, half a stage


def test_sass_stage_counts_the_promotions_that_read_product_and_accumulator_from_one_bank():
    # A wgmma of N = 32, 16 product registers (R24 .. R39), then its promotion: R24 with R3 (two
    # banks), R25 with R5 (one: odd and odd), R26 with R8 (one: even and even); FFMAs of registers
    # just past the range (R40) and before it (R22) are not promotions.
    body = [
        "QGMMA.64x32x32.F32.E4M3.E4M3 R24, gdesc[UR28], RZ, !UPT, gsb0",
        "WARPGROUP.DEPBAR.LE gsb0, 0x0",
        "FFMA R3, R24, R196.reuse, R3",
        "FFMA R5, R25, R196, R5",
        "@P0 FFMA R8, R26, R197, R8",
        "FFMA R10, R40, R196, R10",
        "FFMA R12, R22, R196, R12",
    ]
    assert sass_stage.promotion_banks(body) == (3, 2)
    assert sass_stage.promotion_banks([t for t in body if "R5" not in t and "R8," not in t]) == (1, 0)
    assert sass_stage.promotion_banks(body[1:]) == (0, 0)  # no wgmma in the loop: no product


def test_bench_ab_names_a_variant_that_is_no_patch_and_says_in_one_line_that_it_needs_a_gpu(monkeypatch, capsys):
    from bench import ab

    with pytest.raises(SystemExit):
        ab.parse_args(["--variants", "main,no/such.patch"])
    assert "'no/such.patch' is not a file" in capsys.readouterr().err
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit, match="bench.ab needs a CUDA GPU"):
        ab.main(["--variants", "main", "--tokens", "8"])


MARKER = "// bench.ab's test marker"


def _marker_patch(tmp_path) -> Path:
    """A kernel patch as bench/patches holds them (git's unified diff, paths a/ and b/): one line
    added to a kernel source. Written by the test, so that no patch has to outlive its A/B."""
    import difflib

    rel = "kernel/gemm/gemm_sm90.cuh"
    old = (ROOT / rel).read_text().splitlines(keepends=True)
    new = [*old[:1], MARKER + "\n", *old[1:]]
    path = tmp_path / "marker.patch"
    path.write_text(f"diff --git a/{rel} b/{rel}\n" + "".join(difflib.unified_diff(old, new, f"a/{rel}", f"b/{rel}")))
    return path


def test_bench_abs_variant_tree_is_the_sources_with_the_patch_applied_and_imports_its_own_kernels(tmp_path):
    # A variant's process imports megamoe from its copy (PYTHONPATH), and the package's mapped
    # folders (kernel, reference, conformance) from the copy too: the kernels it builds are the
    # patched ones.
    from bench import ab

    patch = _marker_patch(tmp_path)
    tree = ab.prepare_tree(str(patch), tmp_path / "t")
    assert ab.prepare_tree("main", tmp_path / "m") is None
    assert MARKER in (tree / "kernel/gemm/gemm_sm90.cuh").read_text()
    assert MARKER not in (ROOT / "kernel/gemm/gemm_sm90.cuh").read_text()
    env = {**os.environ, "PYTHONPATH": str(tree)}
    code = "from megamoe.kernel import KERNEL_DIR; import megamoe.reference as r; print(KERNEL_DIR, r.__file__)"
    out = subprocess.run([sys.executable, "-c", code], env=env, cwd=tree, capture_output=True, text=True, check=True)
    kernel_dir, reference = out.stdout.split()
    assert Path(kernel_dir).resolve() == (tree / "kernel").resolve()
    assert Path(reference).resolve().is_relative_to((tree / "reference").resolve())
    with pytest.raises(RuntimeError, match="git apply failed"):
        ab.prepare_tree(f"{patch}+{patch}", tmp_path / "twice")  # the second application cannot apply


def test_bench_ab_applies_patches_with_patch_where_git_is_missing(tmp_path, monkeypatch):
    import shutil

    from bench import ab

    if shutil.which("patch") is None:
        pytest.skip("no patch program here")
    which = shutil.which
    monkeypatch.setattr(ab.shutil, "which", lambda name: None if name == "git" else which(name))
    patch = _marker_patch(tmp_path)
    tree = ab.prepare_tree(str(patch), tmp_path / "t")
    assert MARKER in (tree / "kernel/gemm/gemm_sm90.cuh").read_text()
    monkeypatch.setattr(ab.shutil, "which", lambda name: None)
    with pytest.raises(RuntimeError, match="needs git or patch"):
        ab.prepare_tree(str(patch), tmp_path / "u")


def test_bench_abs_table_has_every_rounds_time_the_bits_against_the_first_variant_and_a_failed_variant(tmp_path):
    import argparse

    from bench import ab

    args = argparse.Namespace(
        variants=["main", "a.patch", "b.patch"], tokens=[1, 8], shape="gpt-oss", engine="narrow", promotion="k32"
    )
    args.predecoded = False
    y = torch.arange(6, dtype=torch.bfloat16)
    for name, t in (("v0_r0.y1", y), ("v0_r0.y8", y), ("v1_r0.y1", y), ("v1_r0.y8", y + 1)):
        torch.save(t, tmp_path / name)
    rows = [dict(tokens=1, us=51.25, ok=True), dict(tokens=8, us=137.6, ok=True)]
    other = [dict(tokens=1, us=50.0, ok=True), dict(tokens=8, us=120.0, ok=False)]
    runs = {0: [rows, rows], 1: [other, other], 2: ["exit 1: RuntimeError: git apply failed"] * 2}
    text = ab.format_table(args, runs, {1: 11.0, 8: 55.1}, tmp_path, "NVIDIA H200")
    lines = text.splitlines()
    assert "engine narrow" in lines[0] and "floor at the NVIDIA H200's limits" in lines[0]
    assert [c.strip() for c in lines[3].strip("|").split("|")] == [
        "1",
        "51.2 / 51.2 = ok",
        "50.0 / 50.0 = ok",
        "exit 1: RuntimeError: git apply failed",
        "11.0",
    ]
    assert "120.0 / 120.0 != NONCONFORMANT" in lines[4]
