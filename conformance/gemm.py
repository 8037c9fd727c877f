"""The GEMM checks shared by stage L1 (D5) and stage L2 (D7): GEMM_BOUND on random data,
GEMM_EXACT on grid-snapped inputs, against the float64 sum of the *dumped* operands."""

from __future__ import annotations

import torch

from megamoe import reference as ref
from megamoe.reference import points as P

from .compare import gemm_bound, gemm_exact, guard, pool_locator
from .dump import Dump
from .result import GEMM_BOUND, NA, CheckResult

# dump point -> (accumulator, activation codes, activation scales, weights, weight scales)
GEMMS = {
    P.D5: (P.D5_ACC1, P.D4_POOL_X, P.D4_POOL_X_SF, "weights.w1", "weights.w1_sf"),
    P.D7: (P.D7_ACC2, P.D6_L2_ACTS, P.D6_L2_SF, "weights.w2", "weights.w2_sf"),
}


def fast_operands(d: Dump) -> bool:
    """Whether the dumps' GEMMs ran in the fast mode on its own operands (promotion k128, SPEC §3 D5),
    on random data (grid-snapped inputs are checked bitwise, on the per-32 formula)."""
    return str(d.meta.get("kernel_mode", "")).endswith("-k128") and not d.meta.get("grid_snapped")


def exact_sums(d: Dump, point: str, *, absolute: bool = False) -> torch.Tensor:
    """float64 [P, N]: Σ a·b (or Σ |a·b|) of the dumped operands of a GEMM point, valid rows only:
    in the fast mode, of the operands it makes of them (reference.fast_gemm_f64)."""
    _, a, a_sf, w, w_sf = GEMMS[point]
    gemm = ref.fast_gemm_f64 if fast_operands(d) else ref.block_scaled_gemm_f64
    fn = (lambda *args: gemm(*args, absolute=True)) if absolute else gemm
    return ref.grouped_gemm(d[a], d[a_sf], d[P.D4_EXPERT_OFFSETS], d[w], d[w_sf], valid=d.rows_checked(), fn=fn)


def error_ratios(d: Dump, point: str) -> torch.Tensor:
    """|acc - exact| / (τ Σ|ab|) over the valid, finite elements (the GEMM_BOUND statistic)."""
    acc = d[GEMMS[point][0]].to(torch.float64)
    valid = d.rows_checked()
    err = (acc - exact_sums(d, point)).abs()[valid]
    scale = float(d.meta["tau"][point]) * exact_sums(d, point, absolute=True)[valid]
    ok = torch.isfinite(err) & (scale > 0)
    return err[ok] / scale[ok]


def overflow_reach(d: Dump, point: str, abs_sum: torch.Tensor) -> torch.Tensor:
    """float64 [P, N]: how far an element's fp32 partial sums can reach (SPEC §4's overflow domain):
    Σ|a·b| · 2^(B_e - B_r), B_r the weight row's largest scale byte and B_e its expert's largest
    row's, where B_e - B_r <= FAST_ROW_SPREAD (the kernels that keep a row's accumulator relative to
    B_e: the fast mode, the exact mode's folded prefill blocks), else Σ|a·b|."""
    w_sf = d[GEMMS[point][4]]
    if w_sf.numel() == 0:
        return abs_sum
    spread = ref.quantize.row_spreads(w_sf).to(torch.float64)  # [E_l, N]
    lift = torch.exp2(torch.where(spread <= ref.quantize.FAST_ROW_SPREAD, spread, 0.0))
    offsets = d[P.D4_EXPERT_OFFSETS].to(torch.int64)
    rows = torch.arange(abs_sum.shape[0], device=offsets.device)
    expert = torch.searchsorted(offsets[1:], rows, right=True).clamp(max=lift.shape[0] - 1)
    return abs_sum * lift[expert]


def check_gemm(point: str, dumps: list[Dump], rank: int) -> list[CheckResult]:
    d = dumps[rank]
    tensor = GEMMS[point][0]
    acc, valid = d[tensor], d.rows_checked()
    if d.sampled and not valid.any():  # none of the kept tokens' slots came to this rank
        return [CheckResult(point, tensor, GEMM_BOUND, rank, NA, message="the sampled dump holds no row of this rank")]
    g = guard(point, tensor, rank, bool(valid.any()) or int(d[P.D2_RECV_TOTALS].sum()) == 0, "no valid pool row")
    if g:
        return [g]
    if not valid.any():
        return []
    exact_sum = exact_sums(d, point)
    g = guard(
        point,
        tensor,
        rank,
        bool((exact_sum[valid] != 0).any()) and bool((acc[valid] != 0).any()),
        "the expected or the dumped accumulators are all zero",
    )
    if g:
        return [g]
    locate = pool_locator(d, rank)
    if d.meta.get("grid_snapped"):
        return [gemm_exact(point, tensor, rank, acc, exact_sum, valid, locate)]
    abs_sum = exact_sums(d, point, absolute=True)
    tau = float(d.meta["tau"][point])
    reach = overflow_reach(d, point, abs_sum)
    return [gemm_bound(point, tensor, rank, acc, exact_sum, abs_sum, tau, valid, locate, reach=reach)]
