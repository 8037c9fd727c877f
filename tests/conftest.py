import os

import pytest
import torch
from hypothesis import HealthCheck, settings

# CI runs derandomized: the same examples on every run, so a red CI is reproducible.
settings.register_profile("ci", derandomize=True, max_examples=25, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("dev", max_examples=25, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("ci" if os.environ.get("CI") else os.environ.get("HYPOTHESIS_PROFILE", "dev"))


def _share_cores_between_workers() -> None:
    """Give each pytest-xdist worker its share of the cores, not all of them.

    torch's OpenMP pool spins while it waits. Two workers that each run one thread per core
    on a 2-core machine spin against each other and against nvcc: the default-shape reference
    ran 38 s instead of 0.3 s on CI that way (reproduced here: 22 s against 1 s).
    """
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    torch.set_num_threads(max(1, min(torch.get_num_threads(), cores // workers)))


_share_cores_between_workers()

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
