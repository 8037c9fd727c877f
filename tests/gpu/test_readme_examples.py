"""The README's GPU examples run as written, each as a script of its own (the multi-rank one spawns
its ranks, which import the script's function by name). Their CPU examples run in
tests/test_docs.py."""

import pytest

from ..test_docs import readme_examples, run_example


@pytest.mark.parametrize("index", range(len(readme_examples("GPU"))))
def test_the_readmes_gpu_examples_run(index, tmp_path):
    run = run_example(readme_examples("GPU")[index], tmp_path, timeout=1200)
    assert run.returncode == 0, run.stdout + run.stderr
