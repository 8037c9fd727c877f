"""Every test under tests/gpu is a GPU test: one place marks them `gpu` and skips them without a
CUDA device (so `pytest -m "not gpu"` and CI's skip list agree with the folder)."""

from pathlib import Path

import pytest
import torch

_HERE = Path(__file__).parent


def pytest_collection_modifyitems(config, items):
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if _HERE in Path(str(item.fspath)).parents:
            item.add_marker(pytest.mark.gpu)
            if not torch.cuda.is_available():
                item.add_marker(skip)
