"""Set-up as the README uses it: after `. .venv/bin/activate` the bare `pytest` and `megamoe` are the
venv's own (whatever the system has installed), and the library and the CLI keep torch's CPU
thread pool within the cores the process really has, by the definition the tests use."""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from megamoe.reference.threads import usable_cores

VENV = Path(sys.prefix)
in_venv = pytest.mark.skipif(sys.prefix == sys.base_prefix, reason="not run from a virtual environment")


def _activated_env() -> dict:
    """What `. .venv/bin/activate` does to the environment that matters here."""
    env = dict(os.environ, VIRTUAL_ENV=str(VENV), PATH=f"{VENV / 'bin'}{os.pathsep}{os.environ.get('PATH', '')}")
    env.pop("PYTHONHOME", None)
    return env


@in_venv
@pytest.mark.parametrize("command", ["pytest", "megamoe", "ruff", "clang-format"])
def test_the_venv_has_its_own_script_for_each_command_the_readme_and_ci_use(command):
    assert (VENV / "bin" / command).is_file(), f"ci/setup.sh wrote no .venv/bin/{command}"


@in_venv
def test_a_bare_pytest_after_activate_runs_with_the_venvs_torch(tmp_path):
    (tmp_path / "test_probe.py").write_text(
        textwrap.dedent("""
        import sys

        def test_probe():
            import megamoe.reference
            import torch
            print("PREFIX", sys.prefix, torch.__version__)
    """)
    )
    run = subprocess.run(
        ["pytest", "-q", "-s", "-p", "no:cacheprovider", "test_probe.py"],
        cwd=tmp_path,
        env=_activated_env(),
        capture_output=True,
        text=True,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    assert f"PREFIX {VENV}" in run.stdout


@in_venv
def test_a_bare_megamoe_after_activate_is_the_venvs():
    run = subprocess.run(["megamoe", "faults", "--help"], env=_activated_env(), capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    assert "seed of the fault scenarios" in run.stdout


def _threads_after(statement: str, **env: str) -> int:
    """torch's thread count after `statement`, in a process limited to one core that asked for 3."""
    prog = textwrap.dedent(f"""
        import os, torch
        os.sched_setaffinity(0, {{min(os.sched_getaffinity(0))}})
        torch.set_num_threads(3)
        {statement}
        print("THREADS", torch.get_num_threads())
    """)
    env = {**{k: v for k, v in os.environ.items() if k != "MEGAMOE_THREADS"}, **env}
    run = subprocess.run([sys.executable, "-c", prog], capture_output=True, text=True, env=env)
    assert run.returncode == 0, run.stderr
    return int(run.stdout.split("THREADS")[-1])


needs_affinity = pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="needs sched_setaffinity")


@needs_affinity
def test_importing_the_reference_limits_torch_threads_to_the_usable_cores():
    assert _threads_after("import megamoe.reference") == 1


@needs_affinity
def test_the_cli_limits_torch_threads_to_the_usable_cores():
    assert _threads_after("from megamoe.cli import main; main(['faults', '--help'])") == 1


@needs_affinity
def test_megamoe_threads_sets_the_count_raised_or_cut_for_a_busy_machine():
    assert _threads_after("import megamoe.reference", MEGAMOE_THREADS="2") == 2  # above the one usable core
    assert _threads_after("import megamoe.reference", MEGAMOE_THREADS="1") == 1


@needs_affinity
def test_the_cli_threads_option_holds_for_the_reference_it_runs(tmp_path):
    # After the run, which imported megamoe.reference (it limits the threads again on import).
    run = f"from megamoe.cli import main; main(['dump', '--tokens', '0', '--threads', '2', '--prefix', '{tmp_path}/'])"
    assert _threads_after(run) == 2


def test_a_container_cpu_quota_caps_the_usable_cores(tmp_path):
    affinity = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    (tmp_path / "cpu.max").write_text("100000 100000\n")  # cgroup v2: one core's worth
    assert usable_cores(tmp_path) == 1
    (tmp_path / "cpu.max").write_text("max 100000\n")  # unlimited
    assert usable_cores(tmp_path) == affinity
    v1 = tmp_path / "v1"
    (v1 / "cpu").mkdir(parents=True)
    (v1 / "cpu" / "cpu.cfs_quota_us").write_text("50000\n")  # half a core rounds up to one
    (v1 / "cpu" / "cpu.cfs_period_us").write_text("100000\n")
    assert usable_cores(v1) == 1
    assert usable_cores(tmp_path / "none") == affinity


def test_the_tests_use_the_same_definition_as_the_library():
    conftest = (Path(__file__).parent / "conftest.py").read_text()
    assert "from megamoe.reference.threads import limit_torch_threads" in conftest
    assert "set_num_threads" not in conftest  # no second definition
