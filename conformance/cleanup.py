"""Stage "cleanup" checker (D10): counters back to their clean state, statistics accumulated."""

from __future__ import annotations

import torch

from megamoe import reference as ref
from megamoe.reference import points as P

from .compare import exact
from .dump import Dump
from .result import CheckResult


def check_d10(dumps: list[Dump], rank: int) -> list[CheckResult]:
    d = dumps[rank]
    # A call may leave the statistics alone (the kernel's record_stats=False; the dump says so).
    if d.meta.get("recv_stats_recorded", True):
        stats = ref.updated_recv_stats(d["inputs.recv_stats_before"], d[P.D2_RECV_TOTALS])
    else:
        stats = d["inputs.recv_stats_before"].to(torch.int64)
    out = [
        exact(
            P.D10,
            P.D10_RECV_STATS,
            rank,
            d[P.D10_RECV_STATS],
            stats,
            kind="int",
            locate=lambda c: f"local expert {c[0]}",
        )
    ]
    counters = d[P.D10_COUNTERS]
    out.append(
        exact(
            P.D10,
            P.D10_COUNTERS,
            rank,
            counters,
            torch.zeros_like(counters),
            kind="int",
            locate=lambda c: f"counter word {c[0]}",
        )
    )
    return out
