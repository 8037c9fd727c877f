"""Stage "dispatch" checkers: D1 send counts, D2 receive counts, D3 source lists."""

from __future__ import annotations

import torch

from megamoe import reference as ref
from megamoe.reference import points as P

from .compare import exact, multiset
from .dump import Dump
from .result import CheckResult


def check_d1(dumps: list[Dump], rank: int) -> list[CheckResult]:
    d = dumps[rank]
    want = ref.send_counts(d["inputs.topk_idx"], d.config.num_experts)
    return [
        exact(P.D1, P.D1_SEND_COUNTS, rank, d[P.D1_SEND_COUNTS], want, kind="int", locate=lambda c: f"expert {c[0]}")
    ]


def check_d2(dumps: list[Dump], rank: int) -> list[CheckResult]:
    """Stage-local: the owner's receive counts from the *dumped* send counts of every rank."""
    d, cfg = dumps[rank], dumps[rank].config
    all_d1 = torch.stack([x[P.D1_SEND_COUNTS] for x in dumps])
    counts, totals = ref.receive_counts(all_d1, rank, cfg)
    return [
        exact(
            P.D2,
            P.D2_RECV_COUNTS,
            rank,
            d[P.D2_RECV_COUNTS],
            counts,
            kind="int",
            locate=lambda c: f"source rank {c[0]}, local expert {c[1]}",
        ),
        exact(
            P.D2,
            P.D2_RECV_TOTALS,
            rank,
            d[P.D2_RECV_TOTALS],
            totals,
            kind="int",
            locate=lambda c: f"local expert {c[0]}",
        ),
    ]


def _entries(lists: torch.Tensor) -> torch.Tensor:
    """[E_l, R, n] -1-padded lists -> rows (local expert, source rank, t·K+k)."""
    e, s, _ = (lists >= 0).nonzero(as_tuple=True)
    return torch.stack([e, s, lists[lists >= 0].long()], dim=1) if e.numel() else torch.zeros(0, 3, dtype=torch.long)


def check_d3(dumps: list[Dump], rank: int) -> list[CheckResult]:
    d, cfg = dumps[rank], dumps[rank].config
    want = ref.source_lists([x["inputs.topk_idx"] for x in dumps], rank, cfg)
    return [
        multiset(
            P.D3,
            P.D3_SOURCE_LISTS,
            rank,
            _entries(d[P.D3_SOURCE_LISTS]),
            _entries(want),
            what="(local expert, source rank, t*K+k) entries",
        )
    ]
