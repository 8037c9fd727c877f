"""Stage "cleanup" (D10): the state a call leaves behind.

Every per-call counter and mask returns to its clean state (zero, for every region the workspace
layout marks as a counter); the cumulative per-expert receive statistics grow by N_e when the
caller asks for them. Nothing else may carry over into the next call.
"""

from __future__ import annotations

import torch

from .errors import INTEGER, check_tensor


def updated_recv_stats(recv_stats_before: torch.Tensor | None, recv_totals: torch.Tensor) -> torch.Tensor:
    """D10: cumulative_recv_stats += N_e (int64 [E_l]); a fresh zero counter when none is given."""
    check_tensor("recv_totals", recv_totals, INTEGER, (None,))
    if recv_stats_before is not None:
        check_tensor("recv_stats_before", recv_stats_before, torch.int64, tuple(recv_totals.shape), recv_totals.device)
    before = torch.zeros_like(recv_totals, dtype=torch.int64) if recv_stats_before is None else recv_stats_before
    return before.to(torch.int64) + recv_totals.to(torch.int64)
