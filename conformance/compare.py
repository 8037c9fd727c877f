"""The comparisons behind the check classes (SPEC §4), with failures written out in words:
which elements, both values as raw bits and decoded, and where they belong (rank, pool row,
token, slot, expert)."""

from __future__ import annotations

from typing import Callable

import torch

from megamoe import reference as ref
from megamoe.reference import points as P

from .result import EXACT, FAIL, GEMM_BOUND, GEMM_EXACT, GUARD, MULTISET, NA, PASS, CheckResult

FIRST = 4  # how many differing elements a failure lists
FP32_MAX = torch.finfo(torch.float32).max

Locator = Callable[[tuple[int, ...]], str]


def bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bit patterns of a tensor, as an integer tensor of the same shape."""
    if t.dtype == torch.bfloat16:
        return t.contiguous().view(torch.int16)
    if t.dtype == torch.float32:
        return t.contiguous().view(torch.int32)
    if t.dtype == torch.float64:
        return t.contiguous().view(torch.int64)
    if t.dtype == torch.float8_e4m3fn:
        return t.contiguous().view(torch.uint8)
    return t


def _raw(v: int, t: torch.Tensor) -> str:
    width = {torch.bfloat16: 4, torch.float32: 8, torch.uint8: 2, torch.float8_e4m3fn: 2}.get(t.dtype)
    if width is None:
        return str(v)
    return f"0x{v & ((1 << (4 * width)) - 1):0{width}x}"


def decoder(kind: str) -> Callable[[int], str]:
    """Human-readable value of one raw element: 'e4m3', 'ue8m0', 'bf16', 'fp32' or 'int'."""

    def e4m3(v):
        return f"{ref.decode_e4m3(torch.tensor([v & 0xFF], dtype=torch.uint8)).item():g}"

    def ue8m0(v):
        return "NaN" if v == 255 else f"2^{v - 127}"

    def bf16(v):
        return f"{ref.decode_bf16(torch.tensor([v])).item():.6g}"

    def fp32(v):
        return f"{torch.tensor([v], dtype=torch.int32).view(torch.float32).item():.8g}"

    return {"e4m3": e4m3, "ue8m0": ue8m0, "bf16": bf16, "fp32": fp32, "int": str}[kind]


def pool_locator(dump, point_rank: int) -> Locator:
    """Coordinates [p, ...] of a pool-shaped tensor -> 'pool row p (source rank s, token t, slot k, expert e)'."""
    meta = dump[P.D4_POOL_META]
    offs = dump[P.D4_EXPERT_OFFSETS].tolist()
    e_l = len(offs) - 1

    def locate(coord):
        p = coord[0]
        e = next((i for i in range(e_l) if offs[i] <= p < offs[i + 1]), None)
        s, t, k = meta[p].tolist() if p < meta.shape[0] else (-1, -1, -1)
        expert = "?" if e is None else f"{e} (global {point_rank * e_l + e})"
        rest = f", column {coord[1]}" if len(coord) > 1 else ""
        return f"pool row {p} (source rank {s}, token {t}, slot {k}, local expert {expert}){rest}"

    return locate


def token_locator(prefix: str = "") -> Locator:
    def locate(coord):
        names = ("slot", "token", "channel") if len(coord) == 3 else ("token", "channel")
        return prefix + ", ".join(f"{n} {c}" for n, c in zip(names, coord))

    return locate


def _describe(got: torch.Tensor, want: torch.Tensor, diff: torch.Tensor, kind: str, locate: Locator | None) -> str:
    coords = diff.nonzero()[:FIRST].tolist()
    gb, wb = bits(got), bits(want)
    dec = decoder(kind)
    parts = []
    for c in coords:
        c = tuple(c)
        g, w = int(gb[c]), int(wb[c])
        where = locate(c) if locate else f"index {list(c)}"
        parts.append(f"[{where}] got {_raw(g, got)} ({dec(g)}), expected {_raw(w, want)} ({dec(w)})")
    return "; ".join(parts)


def exact(
    point: str,
    tensor: str,
    rank: int,
    got: torch.Tensor,
    want: torch.Tensor,
    *,
    kind: str,
    rows: torch.Tensor | None = None,
    locate: Locator | None = None,
    check: str = EXACT,
) -> CheckResult:
    """Byte equality of got and want, on the rows selected by `rows` (bool over dim 0)."""
    if got.shape != want.shape:
        return CheckResult(
            point, tensor, check, rank, FAIL, message=f"shape {list(got.shape)}, expected {list(want.shape)}"
        )
    diff = bits(got) != bits(want)
    if rows is not None:
        diff &= rows.reshape(-1, *([1] * (diff.dim() - 1)))
        compared = int(rows.sum()) * (got[0].numel() if got.dim() > 1 and got.shape[0] else 1)
    else:
        compared = got.numel()
    n = int(diff.sum())
    if compared == 0:
        return CheckResult(point, tensor, check, rank, NA, message="nothing to compare (0 elements)")
    if n == 0:
        return CheckResult(point, tensor, check, rank, PASS, elements=compared)
    msg = f"{n} of {compared} elements differ; first: " + _describe(got, want, diff, kind, locate)
    return CheckResult(point, tensor, check, rank, FAIL, elements=compared, mismatches=n, message=msg)


def multiset(point: str, tensor: str, rank: int, got: torch.Tensor, want: torch.Tensor, *, what: str) -> CheckResult:
    """Equality of two collections of rows (int tensors [n, c]) after sorting."""

    def rows(t):
        return sorted(tuple(r) for r in t.tolist())

    g, w = rows(got), rows(want)
    if not g and not w:
        return CheckResult(point, tensor, MULTISET, rank, NA, message=f"nothing to compare (no {what})")
    if g == w:
        return CheckResult(point, tensor, MULTISET, rank, PASS, elements=len(w))
    from collections import Counter

    extra = list((Counter(g) - Counter(w)).elements())
    missing = list((Counter(w) - Counter(g)).elements())
    msg = (
        f"{len(g)} {what}, expected {len(w)}; {len(missing)} missing (first {missing[:FIRST]}), "
        f"{len(extra)} unexpected (first {extra[:FIRST]})"
    )
    return CheckResult(
        point, tensor, MULTISET, rank, FAIL, elements=len(w), mismatches=len(missing) + len(extra), message=msg
    )


def gemm_bound(
    point: str,
    tensor: str,
    rank: int,
    got: torch.Tensor,
    exact_sum: torch.Tensor,
    abs_sum: torch.Tensor,
    tau: float,
    rows: torch.Tensor,
    locate: Locator | None,
    reach: torch.Tensor | None = None,
) -> CheckResult:
    """|got - exact| <= τ Σ|a_k b_k| on the valid rows; `accepted` are the elements that pass
    whatever their error (both NaN, the infinities SPEC §4 allows). reach: where an
    element's fp32 partial sums can exceed the fp32 range (conformance.gemm.overflow_reach; default
    Σ|a_k b_k|), ±inf and NaN are allowed too (SPEC §4, the overflow domain)."""
    g = got.to(torch.float64)[rows]
    e = exact_sum[rows]
    # An exact sum beyond the fp32 range counts as the largest fp32 of its sign (a truncating
    # accumulator stays finite there) or its infinity...
    overflow = torch.isfinite(e) & (e.abs() > FP32_MAX)
    accepted = overflow & torch.isinf(g) & (torch.sign(g) == torch.sign(e))
    e = torch.where(overflow, e.clamp(-FP32_MAX, FP32_MAX), e)
    accepted |= torch.isinf(e) & (g == e)
    # ...and where the partial sums can leave the range, they may overflow in whatever order the
    # adds run, to either sign, or to NaN when both signs overflow: any non-finite result passes.
    reach = (abs_sum if reach is None else reach)[rows]
    accepted |= (reach > FP32_MAX) & ~torch.isfinite(g)
    # A NaN expected from a NaN scale byte (255: only the kernel's own requantization of an
    # overflowed row makes one, SPEC §3 D6 step 5) is 2^128 = inf on the tensor core's scale path:
    # any non-finite result passes where NaN is expected.
    accepted |= torch.isnan(e) & ~torch.isfinite(g)
    err = (g - e).abs()
    bound = tau * abs_sum[rows]
    bad = ~accepted & ~(err <= bound)  # NaN on one side only is a violation
    finite = torch.isfinite(err) & (abs_sum[rows] > 0)
    ratio = float((err[finite] / (tau * abs_sum[rows][finite])).max()) if finite.any() else 0.0
    n = int(bad.sum())
    if n == 0:
        return CheckResult(point, tensor, GEMM_BOUND, rank, PASS, elements=g.numel(), max_error=ratio)
    idx = rows.nonzero().flatten()
    coords = bad.nonzero()[:FIRST].tolist()
    parts = []
    for r, c in coords:
        where = locate((int(idx[r]), c)) if locate else f"row {int(idx[r])}, column {c}"
        parts.append(
            f"[{where}] got {float(g[r, c]):.8g}, exact {float(e[r, c]):.8g}, "
            f"|err| {float(err[r, c]):.3g} > tau*sum|ab| {float(bound[r, c]):.3g}"
        )
    msg = f"{n} of {g.numel()} elements outside tau = {tau:.3g}; max ratio {ratio:.3g}; first: " + "; ".join(parts)
    return CheckResult(
        point, tensor, GEMM_BOUND, rank, FAIL, elements=g.numel(), mismatches=n, max_error=ratio, message=msg
    )


def gemm_exact(
    point: str,
    tensor: str,
    rank: int,
    got: torch.Tensor,
    exact_sum: torch.Tensor,
    rows: torch.Tensor,
    locate: Locator | None,
) -> CheckResult:
    """Grid-snapped inputs: every partial sum is exact, so got must equal fp32(exact) bit for bit."""
    return exact(
        point, tensor, rank, got, exact_sum.to(torch.float32), kind="fp32", rows=rows, locate=locate, check=GEMM_EXACT
    )


def guard(point: str, tensor: str, rank: int, ok: bool, why: str) -> CheckResult | None:
    """A vacuous-pass guard: None when fine, a failure naming the reason otherwise."""
    if ok:
        return None
    return CheckResult(point, tensor, GUARD, rank, FAIL, message=why)
