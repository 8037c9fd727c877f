import os

import pytest
import torch
from hypothesis import HealthCheck, settings

from megamoe.reference.threads import limit_torch_threads

# CI runs derandomized: the same examples on every run, so a red CI is reproducible.
settings.register_profile(
    "ci", derandomize=True, max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
settings.register_profile("dev", max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("ci" if os.environ.get("CI") else os.environ.get("HYPOTHESIS_PROFILE", "dev"))


# Each pytest-xdist worker takes its share of the cores, by the definition the library and the
# CLI use (megamoe.reference.threads says why; with spinning OpenMP pools, two workers that each take every
# core ran the default-shape reference in 38 s instead of 0.3 s on CI).
limit_torch_threads(processes=int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")))

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
