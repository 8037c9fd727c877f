"""The GEMM checks shared by stage L1 (D5) and stage L2 (D7): GEMM_BOUND on random data,
GEMM_EXACT on grid-snapped inputs, against the float64 sum of the *dumped* operands."""
from __future__ import annotations

import torch

from megamoe import reference as ref

from .compare import gemm_bound, gemm_exact, guard, pool_locator
from .dump import Dump
from .result import CheckResult


def check_gemm(point: str, tensor: str, d: Dump, acc: torch.Tensor, a_codes: torch.Tensor, a_sf: torch.Tensor,
               w: torch.Tensor, w_sf: torch.Tensor) -> list[CheckResult]:
    rank, valid = d.rank, ref.valid_rows(d.tensors)
    offsets = d["D4.expert_offsets"]
    exact_sum = ref.grouped_gemm(a_codes, a_sf, offsets, w, w_sf, valid=valid, fn=ref.block_scaled_gemm_f64)
    g = guard(point, tensor, rank, bool(valid.any()) or int(d["D2.recv_totals"].sum()) == 0, "no valid pool row")
    if g:
        return [g]
    if not valid.any():
        return []
    g = guard(point, tensor, rank, bool((exact_sum[valid] != 0).any()) and bool((acc[valid] != 0).any()),
              "the expected or the dumped accumulators are all zero")
    if g:
        return [g]
    locate = pool_locator(d, rank)
    if d.meta.get("grid_snapped"):
        return [gemm_exact(point, tensor, rank, acc, exact_sum, valid, locate)]
    abs_sum = ref.grouped_gemm(a_codes, a_sf, offsets, w, w_sf, valid=valid,
                               fn=lambda *args: ref.block_scaled_gemm_f64(*args, absolute=True))
    return [gemm_bound(point, tensor, rank, acc, exact_sum, abs_sum, float(d.meta["tau"][point]), valid, locate)]
