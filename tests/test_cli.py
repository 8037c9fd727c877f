"""The `megamoe` command as a user meets it: every bad option or input file is one line on stderr and
exit code 2 (never a traceback), every option's help shows its default and its choices, what the
README tells a user to run leaves nothing for git to pick up, and dumps can leave their weights out."""

import argparse
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megamoe.cli import build_parser, main
from megamoe.conformance.dump import Dump, DumpFormatError, global_weights
from megamoe.conformance.suite import check

ROOT = Path(__file__).resolve().parents[1]
SMALL = ["--hidden", "256", "--intermediate", "128", "--experts", "8", "--tokens", "16"]


def _one_line_error(capsys, argv: list[str]) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert "Traceback" not in err
    return err


def _error_after_progress(capsys, argv: list[str]) -> str:
    """The one error line of bad input found during the work, after that work's progress lines."""
    assert main(argv) == 2
    *progress, err = capsys.readouterr().err.strip().splitlines()
    assert all(line.startswith("[megamoe] ") for line in progress), progress
    return err


@pytest.mark.parametrize(
    "argv,words",
    [
        (["report", "--device", "bogus"], "argument --device: invalid choice: 'bogus'"),
        (["report", "--masked-ratio", "2"], "argument --masked-ratio: expected a fraction in [0, 1], got 2"),
        (["report", "--masked-ratio", "-1"], "argument --masked-ratio: expected a fraction in [0, 1], got -1"),
        (["report", "--hidden", "0"], "argument --hidden: expected a multiple of 32"),
        (["run", "--intermediate", "abc"], "argument --intermediate: expected an integer, got 'abc'"),
        (["report", "--tokens", "-1"], "argument --tokens: expected an integer >= 0, got -1"),
        (["report", "--experts", "0"], "argument --experts: expected an integer >= 1, got 0"),
        (["report", *SMALL, "--experts", "7"], "argument --experts: expected a positive multiple of --ranks = 2"),
        (["report", *SMALL, "--top-k", "9"], "argument --top-k: expected a value in [1, 8], got 9"),
        (["report", "--ranks", "0"], "argument --ranks: expected an integer >= 1, got 0"),
        (["report", "--clamp", "0"], "argument --clamp: expected a finite number > 0, got 0"),
        (["report", "--clamp", "nan"], "argument --clamp: expected a finite number > 0, got nan"),
        (["dump", "--distribution", "zipf"], "argument --distribution: invalid choice: 'zipf'"),
        (["dump", "--seed", "-3"], "argument --seed: expected an integer >= 0 and below 4294967296, got -3"),
        (["faults", "--seed", "x"], "argument --seed: expected an integer, got 'x'"),
        (["check", "x.pt", "--threads", "0"], "argument --threads: expected a positive number of threads, got '0'"),
        (
            ["report", *SMALL, "--distribution", "empty_experts", "--top-k", "5"],
            "argument --top-k: expected at most E/2 = 4 for the distribution 'empty_experts', got 5",
        ),
    ],
)
def test_a_bad_option_is_one_line_naming_it_and_exit_code_2(capsys, argv, words):
    err = _one_line_error(capsys, argv)
    assert err.startswith(f"megamoe {argv[0]}: error: "), err
    assert words in err, err


def test_a_bad_megamoe_threads_variable_is_one_line_naming_it(capsys, monkeypatch):
    monkeypatch.setenv("MEGAMOE_THREADS", "many")
    err = _one_line_error(capsys, ["faults"])
    assert err == "megamoe: error: MEGAMOE_THREADS: expected a positive number of threads, got 'many'"


def test_a_bad_megamoe_threads_variable_is_one_line_in_a_fresh_process_too():
    # Where nothing has imported megamoe.reference yet, importing it (the thread limit's home) is
    # what raises; the CLI must import it where that becomes its one line.
    env = dict(os.environ, MEGAMOE_THREADS="many")
    run = subprocess.run([sys.executable, "-m", "megamoe", "faults"], env=env, capture_output=True, text=True)
    assert run.returncode == 2
    assert run.stderr.strip() == "megamoe: error: MEGAMOE_THREADS: expected a positive number of threads, got 'many'"


def test_report_on_cuda_without_a_gpu_is_one_line_not_a_traceback(capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    err = _one_line_error(capsys, ["report", "--device", "cuda"])
    assert "argument --device: cuda needs a CUDA GPU" in err


def test_run_on_several_processes_without_a_gpu_is_one_line_not_the_reference(capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    err = _one_line_error(capsys, ["run", "--processes"])
    assert "argument --processes: runs the kernel on several ranks, which needs a CUDA GPU" in err


def test_an_output_path_that_is_a_folder_is_refused_before_the_run(capsys, tmp_path):
    err = _one_line_error(capsys, ["report", "--json", str(tmp_path)])
    assert f"argument --json: {tmp_path} is a folder" in err
    (tmp_path / "f").write_text("")
    err = _one_line_error(capsys, ["check", "x.pt", "--plots", str(tmp_path / "f")])
    assert "argument --plots:" in err


@pytest.mark.parametrize(
    "argv",
    [
        ["report", *SMALL, "--json", "{missing}/report.json"],
        ["run", *SMALL, "--markdown", "{missing}/report.md"],
        ["check", "x.pt", "--json", "{missing}/check.json"],
        ["check", "x.pt", "--plots", "{missing}/plots"],
        ["dump", *SMALL, "--prefix", "{missing}/dumps/"],
        ["dump", *SMALL, "--prefix", "{missing}/run1-"],
    ],
)
def test_an_output_under_a_missing_folder_is_refused_before_any_work_and_nothing_is_made(capsys, tmp_path, argv):
    missing = tmp_path / "no" / "such"
    argv = [a.format(missing=missing) for a in argv]
    err = _one_line_error(capsys, argv)  # one line: no progress line of a computation before it
    option = next(a for a in argv if a in ("--json", "--markdown", "--plots", "--prefix"))
    assert f"argument {option}: the folder " in err and "does not exist; make it first" in err, err
    assert not (tmp_path / "no").exists()


def test_an_output_folder_is_made_when_its_parent_exists(capsys, tmp_path):
    assert main(["dump", *SMALL, "--tokens", "2", "--prefix", f"{tmp_path}/dumps/"]) == 0
    assert (tmp_path / "dumps" / "rank1.pt").is_file()


def test_an_option_error_found_after_parsing_is_its_one_line_without_the_banner(capsys, monkeypatch):
    # `megamoe run` without a GPU announces the CPU reference; a bad shape must be refused before that.
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    err = _one_line_error(capsys, ["run", "--experts", "7"])
    assert err.startswith("megamoe run: error: argument --experts: expected a positive multiple of --ranks"), err


def test_more_tokens_than_int32_pool_rows_allow_is_one_line_naming_the_limit(capsys, monkeypatch, tmp_path):
    monkeypatch.setattr("megamoe.cli._available_memory", lambda device: None)  # the index limit alone
    err = _one_line_error(capsys, ["dump", "--tokens", "999999999999", "--prefix", f"{tmp_path}/d/"])
    # R*T*K + E_l*(BLOCK_M - 1), rounded up to BLOCK_M, <= 2^31 - 1 at R 2, K 4, E_l 8, BLOCK_M 64
    assert "argument --tokens: expected at most 268435385 tokens per rank for this shape" in err, err
    assert "overflows the int32 row indices" in err and err.endswith("got 999999999999")
    assert not (tmp_path / "d").exists()


def test_a_call_whose_dumps_exceed_the_free_memory_is_refused_before_any_allocation(capsys, monkeypatch):
    monkeypatch.setattr("megamoe.cli._available_memory", lambda device: 10**9)
    err = _one_line_error(capsys, ["report", "--tokens", "100000000"])
    assert "argument --tokens: expected at most" in err and "more than the 1.0 GB free" in err, err
    err = _one_line_error(capsys, ["dump", "--hidden", str(128 * 10**6), "--tokens", "1"])
    assert "argument --hidden/--intermediate/--experts: this shape cannot run here at all" in err, err


def test_an_allocation_that_fails_anyway_is_one_line_not_a_traceback(capsys, monkeypatch):
    def no_memory(*args, **kwargs):
        raise RuntimeError("[enforce fail at alloc_cpu.cpp:127] DefaultCPUAllocator: can't allocate memory: 1 byte")

    monkeypatch.setattr("megamoe.reference.make_inputs", no_memory)
    err = _error_after_progress(capsys, ["dump", *SMALL])
    assert err.startswith("megamoe dump: error: out of memory, choose a smaller shape: "), err


def test_version_prints_the_package_version(capsys):
    import megamoe

    assert main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == f"megamoe {megamoe.__version__}"


def test_the_package_version_has_one_source():
    import importlib.metadata

    import megamoe

    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert "version" not in project["project"] and "version" in project["project"]["dynamic"]
    assert project["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "megamoe.__version__"}
    assert importlib.metadata.version("megamoe") == megamoe.__version__  # the installed metadata agrees


def test_dump_offers_no_report_files_it_would_ignore(capsys, tmp_path):
    for option in ("--json", "--markdown"):
        err = _one_line_error(capsys, ["dump", option, str(tmp_path / "r")])
        assert f"unrecognized arguments: {option}" in err
        assert not (tmp_path / "r").exists()


def _subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(sub.choices)


def test_every_option_says_its_default_and_its_choices():
    parser = build_parser()
    subcommands = _subcommands(parser)
    assert set(subcommands) == {"run", "report", "check", "dump", "faults"}
    for name, sub in subcommands.items():
        formatter = sub._get_formatter()
        for action in sub._actions:
            if isinstance(action, argparse._HelpAction) or not action.option_strings:
                continue
            text = formatter._expand_help(action) if action.help else ""
            assert "default" in text, f"megamoe {name} {action.option_strings[0]}: {text!r}"
            for choice in action.choices or ():
                assert str(choice) in text, f"megamoe {name} {action.option_strings[0]} lacks choice {choice}"
            if action.default not in (None, False):
                assert f"default: {action.default}" in text, f"megamoe {name} {action.option_strings[0]}: {text!r}"


def test_help_exits_0_and_shows_the_defaults(capsys):
    assert main(["report", "--help"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "(default: 1024)" in out and "(choices: cpu, cuda; default: cpu)" in out


@pytest.mark.parametrize(
    "content,words",
    [
        (None, "no such file"),
        (b"hello, I am text\n", "not a megamoe dump: a text file, not a torch.save zip archive"),
        (bytes(range(256)) * 20, "not a megamoe dump: binary data, not a torch.save zip archive"),
        (b"", "not a megamoe dump: an empty file"),
        ("pickle", "not a megamoe dump: it holds Python objects other than tensors"),
        ("foreign", "not a megamoe dump: a torch file without the 'megamoe-dump' header"),
        ("folder", "is a folder, not a dump file"),
    ],
)
def test_check_on_something_that_is_no_dump_says_so_in_one_line(capsys, tmp_path, content, words):
    path = tmp_path / "rank0.pt"
    if content == "pickle":
        torch.save({"when": argparse.Namespace(a=1)}, path)  # an object weights_only refuses to load
    elif content == "foreign":
        torch.save({"x": torch.zeros(2)}, path)
    elif content == "folder":
        path.mkdir()
    elif content is not None:
        path.write_bytes(content)
    err = _one_line_error(capsys, ["check", str(path)])
    assert err.startswith(f"megamoe check: error: {path}: {words}"), err
    assert "weights_only" not in err  # never suggest loading code from a file


def test_check_of_one_rank_of_two_is_refused_like_a_bad_file(capsys, tmp_path):
    assert main(["dump", *SMALL, "--prefix", f"{tmp_path}/"]) == 0
    capsys.readouterr()
    err = _one_line_error(capsys, ["check", str(tmp_path / "rank0.pt")])
    assert "check needs the dumps of all 2 ranks of one call, got ranks [0]" in err


def test_check_of_rank_files_of_two_calls_says_so_instead_of_reporting_a_kernel_failure(capsys, tmp_path):
    for name, seed in (("a", "0"), ("b", "1")):
        assert main(["dump", *SMALL, "--seed", seed, "--prefix", f"{tmp_path}/{name}/"]) == 0
    capsys.readouterr()
    a0, b1 = tmp_path / "a/rank0.pt", tmp_path / "b/rank1.pt"
    err = _one_line_error(capsys, ["check", str(a0), str(b1)])
    assert "these are from different calls" in err and str(a0) in err and str(b1) in err, err


def _ignored_by_git(path: str) -> bool:
    run = subprocess.run(["git", "-C", str(ROOT), "check-ignore", "-q", "--no-index", path])
    return run.returncode == 0


@pytest.mark.skipif(shutil.which("git") is None or not (ROOT / ".git").exists(), reason="needs the git checkout")
def test_dumps_written_as_the_readme_says_are_ignored_by_git():
    readme = (ROOT / "README.md").read_text()
    commands = re.findall(r"^megamoe dump[^\n#]*", readme, flags=re.M)
    assert commands, "the README shows no `megamoe dump` command"
    default = build_parser().parse_args(["dump"]).prefix
    for command in commands:
        m = re.search(r"--prefix\s+(\S+)", command)
        prefix = m.group(1) if m else default
        assert _ignored_by_git(f"{prefix}rank0.pt"), f"`{command.strip()}` leaves {prefix}rank0.pt for git to see"


def test_a_dump_without_weights_is_smaller_and_checked_against_the_weights_given(capsys, tmp_path):
    assert main(["dump", *SMALL, "--prefix", f"{tmp_path}/full/"]) == 0
    assert main(["dump", *SMALL, "--prefix", f"{tmp_path}/lean/", "--no-weights"]) == 0
    capsys.readouterr()
    full, lean = Dump.load(tmp_path / "full/rank0.pt"), Dump.load(tmp_path / "lean/rank0.pt")
    weight_bytes = sum(full[f"weights.{n}"].numel() for n in ("w1", "w1_sf", "w2", "w2_sf"))
    saved = (tmp_path / "full/rank0.pt").stat().st_size - (tmp_path / "lean/rank0.pt").stat().st_size
    assert saved >= weight_bytes and not lean.has_weights
    # The CLI regenerates the weights from the recorded seed and checks them by their SHA-256.
    lean_paths = [str(tmp_path / f"lean/rank{r}.pt") for r in (0, 1)]
    assert main(["check", *lean_paths]) == 0
    assert "all stages conform" in capsys.readouterr().out
    # From Python, weights given separately must be the ones the dump was made with.
    right = global_weights([full, Dump.load(tmp_path / "full/rank1.pt")])
    assert check(lean_paths, weights=right).ok
    wrong = type(right)(right.w1.clone(), right.w1_sf.clone(), right.w2, right.w2_sf)
    wrong.w1[3, 0, 0] ^= 0x01
    with pytest.raises(DumpFormatError, match=r"rank 0: the weights given are not the ones this dump was made with"):
        check(lean_paths, weights=wrong)
    # A dump whose recorded seed is wrong is refused in one line, not reported as stage failures
    # (after the progress lines of regenerating the weights, which is how it is found).
    for path in lean_paths:
        obj = torch.load(path, weights_only=True)
        obj["meta"]["weights"]["random_weights_seed"] = 1
        torch.save(obj, path)
    err = _error_after_progress(capsys, ["check", *lean_paths])
    assert err.startswith("megamoe check: error: rank 0: the weights given are not the ones this dump was made with")


def test_check_of_dumps_without_weights_shows_progress_while_it_regenerates_them(capsys, tmp_path):
    assert main(["dump", *SMALL, "--prefix", f"{tmp_path}/", "--no-weights", "--seed", "5"]) == 0
    capsys.readouterr()
    assert main(["check", str(tmp_path / "rank0.pt"), str(tmp_path / "rank1.pt")]) == 0
    err = capsys.readouterr().err
    steps = [
        "the dumps hold no weights: regenerating those of 8 experts (H=256 I=128) from random_weights seed 5",
        "weights regenerated in ",
        "rank 0: comparing its weights with the SHA-256 its dump names",
        "rank 1: comparing its weights with the SHA-256 its dump names",
        "checking D1",
    ]
    at = [err.find(step) for step in steps]
    assert -1 not in at and at == sorted(at), err


def test_the_silu_probe_says_it_needs_nvcc_and_a_gpu_instead_of_a_traceback(tmp_path):
    env = dict(os.environ, PATH=str(tmp_path))  # no nvcc on this PATH, whatever the machine has
    run = subprocess.run(
        [sys.executable, "-m", "megamoe.silu_probe", str(tmp_path / "out")], env=env, capture_output=True, text=True
    )
    assert run.returncode == 2
    assert run.stderr.strip() == "megamoe.silu_probe: needs nvcc and a CUDA GPU; no nvcc on the PATH"
