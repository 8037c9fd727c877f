"""How many CPU threads torch may use: one definition for the library, the CLI and the tests.

torch sizes its OpenMP pool from the cores it sees, and its threads spin while they wait for each
other. Where that pool is larger than the cores this process really gets (a CPU quota of a
container, an affinity mask, several pytest-xdist workers on one machine) the spinning threads
take the cores from the threads doing the work: on the 2-core CI machine the default-shape
reference took 38 s instead of 0.3 s that way. So the pool is cut to this process's share of the
usable cores, and never raised.

Usable is not idle: on a machine busy with other work torch's threads made the CPU reference 14x
slower (4.3 s against 0.31 s with one thread). No count can be read off the machine for that, so
the user sets it: MEGAMOE_THREADS=N (the CLI's --threads N sets the same variable, so that its
spawned ranks inherit it) fixes the pool at N threads, raised or cut, in every process that limits
its threads here (the CLI, `import megamoe.reference`, the tests).

It lives in the reference, the lowest layer, which imports nothing of megamoe outside itself: the
reference is the CPU work this limit is for, and the CLI and the tests take it from here. Importing
it imports megamoe.reference, which limits the threads (reference/__init__.py): with a bad
MEGAMOE_THREADS the import itself raises the ValueError.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")
THREADS_ENV = "MEGAMOE_THREADS"


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


def parse_threads(text: str) -> int:
    """A thread count as given by a user: a positive integer (ValueError saying what it got)."""
    try:
        n = int(text)
    except ValueError:
        n = 0
    if n < 1:
        raise ValueError(f"expected a positive number of threads, got {text!r}")
    return n


def requested_threads() -> int | None:
    """The thread count MEGAMOE_THREADS asks for; None when it is unset or empty."""
    text = os.environ.get(THREADS_ENV, "").strip()
    if not text:
        return None
    try:
        return parse_threads(text)
    except ValueError as exc:
        raise ValueError(f"{THREADS_ENV}: {exc}") from None


def limit_torch_threads(processes: int = 1, cgroup_root: Path = CGROUP_ROOT) -> int:
    """Cut torch's intra-op pool to this process's share when `processes` processes share the
    usable cores, or set it to MEGAMOE_THREADS where that is set; returns the thread count now in
    force. A bad MEGAMOE_THREADS raises ValueError naming it."""
    import torch

    requested = requested_threads()
    if requested is not None:
        if torch.get_num_threads() != requested:
            torch.set_num_threads(requested)
        return torch.get_num_threads()
    share = max(1, usable_cores(cgroup_root) // max(1, processes))
    if torch.get_num_threads() > share:
        torch.set_num_threads(share)
    return torch.get_num_threads()
