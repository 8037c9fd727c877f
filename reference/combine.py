"""Stage "combine" (D9): the ordered sum of a token's expert outputs, bit-exact given the buffer."""

from __future__ import annotations

import torch

from . import formats as F


def combine(combine_buffer: torch.Tensor, topk_idx: torch.Tensor) -> torch.Tensor:
    """y [T, H] bf16: acc = +0.0f; for k ascending with topk_idx[t, k] >= 0: acc += float(buf[k][t]).

    fp32 RN adds in that fixed order, then one bf16 RNE. A token with no valid slot gives +0.
    """
    t, k = topk_idx.shape
    acc = torch.zeros(t, combine_buffer.shape[2], dtype=torch.float32, device=combine_buffer.device)
    for slot in range(k):
        valid = (topk_idx[:, slot] >= 0)[:, None]
        acc = torch.where(valid, acc + combine_buffer[slot, :t].to(torch.float32), acc)
    return F.bf16_tensor(F.encode_bf16(acc))
