"""Stage "combine" (D9): the ordered sum of a token's expert outputs, bit-exact given the buffer."""

from __future__ import annotations

import torch

from . import formats as F
from .errors import check_tensor, fail


def check_combine_args(combine_buffer, topk_idx) -> None:
    """A combine buffer [K, T_max, H] bf16 (D8) and the routing [T, K] of its rank, T <= T_max."""
    check_tensor("combine_buffer", combine_buffer, torch.bfloat16, (None, None, None))
    k, t_max, _ = combine_buffer.shape
    check_tensor("topk_idx", topk_idx, torch.int64, (None, k), combine_buffer.device)
    if topk_idx.shape[0] > t_max:
        fail("topk_idx", f"at most T_max = {t_max} tokens (the combine buffer's rows)", topk_idx.shape[0])


def combine(combine_buffer: torch.Tensor, topk_idx: torch.Tensor) -> torch.Tensor:
    """y [T, H] bf16: acc = +0.0f; for k ascending with topk_idx[t, k] >= 0: acc += float(buf[k][t]).

    fp32 RN adds in that fixed order, then one bf16 RNE. A token with no valid slot gives +0.
    """
    check_combine_args(combine_buffer, topk_idx)
    t, k = topk_idx.shape
    acc = torch.zeros(t, combine_buffer.shape[2], dtype=torch.float32, device=combine_buffer.device)
    for slot in range(k):
        valid = (topk_idx[:, slot] >= 0)[:, None]
        acc = torch.where(valid, acc + combine_buffer[slot, :t].to(torch.float32), acc)
    return F.bf16_tensor(F.encode_bf16(acc))
