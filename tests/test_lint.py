"""The formatter and linter of both languages run by CI: ci/lint.sh fails on a lint finding or an
unformatted file in Python (ruff) or CUDA (clang-format), passes a clean tree, and .ci/run calls it
after set-up. Checked on a small tree of its own, with the repository's configs."""

import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.prefix) / "bin"

pytestmark = pytest.mark.skipif(
    not all((BIN / t).exists() or shutil.which(t) for t in ("ruff", "clang-format")) or not shutil.which("git"),
    reason="needs ruff, clang-format (bash ci/setup.sh) and git",
)

CLEAN_PY = textwrap.dedent('''\
    """A module."""

    import math


    def area(radius: float) -> float:
        return math.pi * radius * radius  # a line well within the 120 columns the configs allow, kept as written
''')
CLEAN_CUH = textwrap.dedent("""\
    // A header.
    #pragma once

    namespace demo {

    __device__ __forceinline__ float twice(float x) {
      return 2.0f * x;
    }

    }  // namespace demo
""")


@pytest.fixture
def tree(tmp_path):
    (tmp_path / "ci").mkdir()
    shutil.copy(ROOT / "ci" / "lint.sh", tmp_path / "ci" / "lint.sh")
    shutil.copy(ROOT / "pyproject.toml", tmp_path)
    shutil.copy(ROOT / ".clang-format", tmp_path)
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "mod.py").write_text(CLEAN_PY)
    (tmp_path / "pkg" / "twice.cuh").write_text(CLEAN_CUH)
    subprocess.run(["git", "init", "-q", str(tmp_path)], check=True)
    return tmp_path


def _lint(tree):
    env = dict(os.environ, PATH=f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}")
    return subprocess.run(["bash", "ci/lint.sh"], cwd=tree, env=env, capture_output=True, text=True)


def test_lint_passes_a_clean_tree(tree):
    run = _lint(tree)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "clang-format --dry-run -Werror (1 files)" in run.stdout


@pytest.mark.parametrize(
    "path,text,tool",
    [
        ("pkg/unused.py", "import os\n", "ruff check"),
        ("pkg/ugly.py", "x = [1,2 ,  3]\n", "ruff format"),
        ("pkg/ugly.cu", "__global__ void k(float*p){p[0]=1;}\n", "clang-format"),
    ],
)
def test_lint_fails_on_a_finding_in_either_language(tree, path, text, tool):
    (tree / path).write_text(text)
    run = _lint(tree)
    assert run.returncode == 1, run.stdout + run.stderr
    assert Path(path).name in run.stdout + run.stderr, (tool, run.stdout + run.stderr)


def test_lint_ignores_what_git_ignores(tree):
    (tree / ".gitignore").write_text("build/\n")
    (tree / "build").mkdir()
    (tree / "build" / "gen.cu").write_text("__global__ void k(float*p){p[0]=1;}\n")
    assert _lint(tree).returncode == 0


def test_ci_runs_the_lint_after_setup_and_before_the_tests():
    run = (ROOT / ".ci" / "run").read_text()
    setup, lint, tests = run.index("bash ci/setup.sh"), run.index("bash ci/lint.sh"), run.index("-m pytest")
    assert setup < lint < tests
    assert 'exit "$lint"' in run  # a lint finding fails CI even though the tests still run


def test_setup_installs_the_pinned_lint_tools():
    setup = (ROOT / "ci" / "setup.sh").read_text()
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert ".[test,plots,lint]" in setup
    assert 'lint = ["ruff==' in pyproject and '"clang-format==' in pyproject
