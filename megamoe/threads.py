"""How many CPU threads torch may use: one definition for the library, the CLI and the tests.

torch sizes its OpenMP pool from the cores it sees, and its threads spin while they wait for each
other. Where that pool is larger than the cores this process really gets (a CPU quota of a
container, an affinity mask, several pytest-xdist workers on one machine) the spinning threads
take the cores from the threads doing the work: on the 2-core CI machine the default-shape
reference took 38 s instead of 0.3 s that way. So the pool is cut to this process's share of the
usable cores, and never raised.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")


def _cgroup_quota(root: Path) -> float | None:
    """The CPU quota of this process's cgroup in cores (v2 `cpu.max`, v1 `cpu.cfs_quota_us`), None
    when unlimited or unknown."""
    try:
        quota, period = (root / "cpu.max").read_text().split()[:2]
        return None if quota == "max" else int(quota) / int(period)
    except (OSError, ValueError):
        pass
    try:
        quota = int((root / "cpu" / "cpu.cfs_quota_us").read_text())
        period = int((root / "cpu" / "cpu.cfs_period_us").read_text())
        return quota / period if quota > 0 and period > 0 else None
    except (OSError, ValueError):
        return None


def usable_cores(cgroup_root: Path = CGROUP_ROOT) -> int:
    """The cores this process may run on: its affinity mask, capped by its cgroup's CPU quota."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    quota = _cgroup_quota(cgroup_root)
    if quota is not None:
        cores = min(cores, max(1, math.ceil(quota)))
    return max(1, cores)


def limit_torch_threads(processes: int = 1, cgroup_root: Path = CGROUP_ROOT) -> int:
    """Cut torch's intra-op pool to this process's share when `processes` processes share the
    usable cores; returns the thread count now in force."""
    import torch

    share = max(1, usable_cores(cgroup_root) // max(1, processes))
    if torch.get_num_threads() > share:
        torch.set_num_threads(share)
    return torch.get_num_threads()
