"""The documentation as a user meets it: the README opens with the two commands CI relies on and its
CPU examples run; every "SPEC §n" citation names a section of the contract, docs/SPEC.md; no file
outside the logs points at material kept outside the repository or at issue numbers; and the
package ships its licence and its typing marker."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
SPEC = ROOT / "docs" / "SPEC.md"

# The set-up + main job, and the test command .ci/run runs: the README's first code block.
SETUP_AND_RUN = "bash ci/setup.sh && .venv/bin/megamoe run"
TEST_COMMAND = ".venv/bin/python -m pytest -n 2 -q"


def readme_examples(where: str) -> list[str]:
    """The README's Python examples whose first line is the comment `# CPU` or `# GPU ...`."""
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    return [b for b in blocks if b.splitlines()[0].split()[:2] == ["#", where]]


def run_example(code: str, cwd: Path, timeout: float) -> subprocess.CompletedProcess:
    """One example as a script of its own (a spawned rank must import its function by name)."""
    script = cwd / "example.py"
    script.write_text(code)
    return subprocess.run(
        [sys.executable, str(script)], cwd=cwd, capture_output=True, text=True, timeout=timeout, env=dict(os.environ)
    )


# ------------------------------------------------------------------------------------ README


def test_the_readme_opens_with_the_set_up_and_main_job_then_the_test_command_ci_runs():
    first = re.search(r"```bash\n(.*?)```", README.read_text(), flags=re.S).group(1)
    commands = [line.split("#")[0].strip() for line in first.splitlines() if line.strip()]
    assert commands == [SETUP_AND_RUN, TEST_COMMAND]
    ci = (ROOT / ".ci" / "run").read_text()
    assert "bash ci/setup.sh" in ci and TEST_COMMAND in ci.splitlines()


def test_every_python_example_in_the_readme_says_where_it_runs():
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    assert len(blocks) == len(readme_examples("CPU")) + len(readme_examples("GPU"))
    assert readme_examples("CPU") and readme_examples("GPU")
    for block in blocks:
        compile(block, "README example", "exec")  # at least valid Python, GPU ones included


@pytest.mark.parametrize("index", range(len(readme_examples("CPU"))))
def test_the_readmes_cpu_examples_run(index, tmp_path):
    run = run_example(readme_examples("CPU")[index], tmp_path, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr


# ------------------------------------------------------------------------------------ the contract


def _spec_sections() -> dict[int, str]:
    parts = re.split(r"^## (\d+)\. ", SPEC.read_text(), flags=re.M)
    return {int(n): text for n, text in zip(parts[1::2], parts[2::2])}


def test_the_contract_keeps_its_numbered_sections_and_dump_points():
    text = SPEC.read_text()
    assert "the contract" in text.splitlines()[0]
    assert sorted(_spec_sections()) == list(range(1, 9))
    for n in range(1, 11):
        assert f"**D{n}," in _spec_sections()[3], f"SPEC §3 does not define D{n}"


def _text_files() -> list[Path]:
    """The files git knows of (tracked, or new and not ignored) that are text."""
    names = subprocess.run(
        ["git", "-C", str(ROOT), "ls-files", "--cached", "--others", "--exclude-standard"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.splitlines()
    out = []
    for name in sorted(set(names)):
        path = ROOT / name
        if path.is_file() and b"\0" not in path.read_bytes()[:8192]:
            out.append(path)
    return out


needs_git = pytest.mark.skipif(
    shutil.which("git") is None or not (ROOT / ".git").exists(), reason="needs the git checkout"
)


@needs_git
def test_every_spec_citation_names_a_section_of_the_contract():
    sections = _spec_sections()
    wrong = []
    for path in _text_files():
        for lineno, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            for n in re.findall(r"\bSPEC §(\d+)", line):
                if int(n) not in sections:
                    wrong.append(f"{path.relative_to(ROOT)}:{lineno}: SPEC §{n}")
    assert not wrong, "citations of sections docs/SPEC.md does not have:\n" + "\n".join(wrong)


def test_the_contract_says_whether_its_gpt_oss_variant_is_implemented():
    code = [p for d in ("megamoe", "reference", "conformance", "kernel") for p in (ROOT / d).rglob("*.py")]
    code += [p for p in (ROOT / "kernel").rglob("*.cuh")]
    implemented = any("swiglu_oai" in p.read_text(errors="replace") for p in code)
    says_not = "not yet implemented" in _spec_sections()[8].split("\n\n")[1]
    assert implemented != says_not, "SPEC §8's status line no longer says what the code does"


# ------------------------------------------------------------------------------------ citations

# What a file must not point at: the contract's or the background notes' old place outside the
# repository, and issue numbers (the history lives in bench/NOTES.md and the git log; docs/ may
# name upstream sources). Written so that this file does not match itself.
OUTSIDE = re.compile(r"shared[/\\]SPEC|shared\s+folder|research\s+note|\bissues?\s*#?\d+", re.IGNORECASE)
EXEMPT = ("bench/NOTES.md", "docs/")


@needs_git
def test_no_file_points_outside_the_repository_or_at_issue_numbers():
    found = []
    for path in _text_files():
        name = path.relative_to(ROOT).as_posix()
        if name.startswith(EXEMPT):
            continue
        for lineno, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            m = OUTSIDE.search(line)
            if m:
                found.append(f"{name}:{lineno}: {m.group(0)!r}")
    assert not found, "point into the repository instead (docs/SPEC.md, bench/NOTES.md):\n" + "\n".join(found)


def test_the_pattern_catches_what_it_is_for():
    # Pieced together, so that the scan of this file does not find them.
    for text in ("see ../shared" + "/SPEC.md", "the Shared " + " Folder", "a research" + " note", "(issue" + " 8)"):
        assert OUTSIDE.search(text), text
    assert OUTSIDE.search("Issue " + "#30")
    for text in ("SPEC §3", "docs/SPEC.md", "issued by the TMA thread", "the issue slots", "tissue 3"):
        assert not OUTSIDE.search(text), text


# ------------------------------------------------------------------------------------ packaging


def test_the_package_ships_its_licence_and_typing_marker():
    tomllib = pytest.importorskip("tomllib")
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    license_field = project["project"]["license"]
    assert "Apache-2.0" in (license_field if isinstance(license_field, str) else license_field["text"])
    licence = (ROOT / "LICENSE").read_text()
    assert "Apache License" in licence and "Version 2.0" in licence
    assert "Copyright 2026 the megamoe authors" in licence
    assert (ROOT / "megamoe" / "py.typed").is_file()
    assert "py.typed" in project["tool"]["setuptools"]["package-data"]["megamoe"]


def test_the_changelog_has_an_entry_for_the_packages_version():
    import megamoe

    assert re.search(rf"^## \[{re.escape(megamoe.__version__)}\]", (ROOT / "CHANGELOG.md").read_text(), flags=re.M)
