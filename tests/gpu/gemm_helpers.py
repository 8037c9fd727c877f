"""Helpers for the SM90 GEMM tests: random pools (with poisoned padding) and weights, fp64 sums of
the dequantized operands; the formats and the D6 rule come from megamoe.reference."""

from __future__ import annotations

import copy
import json
import os

import torch

from megamoe import gemm as G
from megamoe import reference as ref
from megamoe.jit import layout as L

# Expert sizes of the standalone tests (pool alignment 64): none, one, BLOCK_M - 1, BLOCK_M + 1,
# BLOCK_M, several token blocks.
COUNTS = [0, 1, 63, 65, 64, 170, 300]  # at tile 256: items of 1, 2, 3 and 4 chunks


def log_result(**kw) -> None:
    """Appends one JSON line to $MEGAMOE_TEST_LOG (if set): measured ratios for the report."""
    path = os.environ.get("MEGAMOE_TEST_LOG")
    print("RESULT", json.dumps(kw))
    if path:
        with open(path, "a") as f:
            f.write(json.dumps(kw) + "\n")


# The formats and the D6 rule have one definition: the reference's.
dequant_fp8 = ref.dequantize_e4m3  # (codes, scale bytes) -> float64 values
dequant_fp4 = ref.dequantize_fp4  # (packed, scale bytes) -> float64 values
e4m3_codes = ref.encode_e4m3  # fp32 -> codes, RNE, saturating, NaN -> 0x7F


class Pool:
    def __init__(
        self, counts, K, *, align=64, device="cuda", gen=None, grid=False, sf_lo=117, sf_hi=125, grid_sf=(126, 128)
    ):
        self.counts = list(counts)
        offs = ref.pool_offsets(self.counts, align).tolist()
        self.P = offs[-1] + align  # one trailing padding block (also keeps P > 0)
        self.offsets = torch.tensor(offs, dtype=torch.int32, device=device)
        self.expert_rows = torch.tensor(counts, dtype=torch.int32, device=device)
        P = self.P
        if grid:
            vals = torch.tensor([-2.0, -1.0, 0.0, 1.0, 2.0])
            idx = torch.randint(0, 5, (P, K), generator=gen)
            x = e4m3_codes(vals[idx])
            sf = torch.randint(grid_sf[0], grid_sf[1] + 1, (P, K // 32), generator=gen, dtype=torch.int32).to(
                torch.uint8
            )
        else:
            x = e4m3_codes(torch.randn(P, K, generator=gen) * 64.0)
            sf = torch.randint(sf_lo, sf_hi + 1, (P, K // 32), generator=gen, dtype=torch.int32).to(torch.uint8)
        valid = torch.zeros(P, dtype=torch.bool)
        for e, n in enumerate(counts):
            valid[offs[e] : offs[e] + n] = True
        # Padding rows hold NaN payloads and NaN-ish scale bytes: they must not leak anywhere.
        x[~valid] = 0x7F
        sf[~valid] = 0xFE
        self.valid = valid.to(device)
        self.x = x.to(device)
        self.sf = sf.to(device)
        self.w_route = torch.randn(P, generator=gen).to(device)
        self.offs = offs

    def rows(self, e):
        return slice(self.offs[e], self.offs[e] + self.counts[e])


def random_weights(E, R, K, *, gen=None, grid=False, sf_lo=113, sf_hi=118, device="cuda", grid_sf=(126, 128)):
    if grid:
        choices = torch.tensor([0, 1, 2, 4, 9, 10, 12], dtype=torch.uint8)
        codes = choices[torch.randint(0, 7, (E, R, K), generator=gen)]
        sf = torch.randint(grid_sf[0], grid_sf[1] + 1, (E, R, K // 32), generator=gen, dtype=torch.int32).to(
            torch.uint8
        )
    else:
        codes = torch.randint(0, 16, (E, R, K), generator=gen, dtype=torch.int32).to(torch.uint8)
        sf = torch.randint(sf_lo, sf_hi + 1, (E, R, K // 32), generator=gen, dtype=torch.int32).to(torch.uint8)
    return ref.pack_fp4(codes).to(device), sf.to(device)


def reference_acc(pool: Pool, x, sf, w, w_sf):
    """Per expert: (exact fp64 acc [n, R], bound fp64 sum |a b| [n, R])."""
    out = {}
    for e, n in enumerate(pool.counts):
        if n == 0:
            continue
        r = pool.rows(e)
        A = dequant_fp8(x[r], sf[r])
        B = dequant_fp4(w[e], w_sf[e])
        out[e] = (A @ B.T, A.abs() @ B.abs().T)
    return out


def bound_ratio(acc: torch.Tensor, exact: torch.Tensor, bound: torch.Tensor) -> float:
    err = (acc.to(torch.float64) - exact).abs()
    assert torch.isfinite(acc).all(), "non-finite accumulator"
    ratio = torch.where(bound > 0, err / bound.clamp_min(1e-300), torch.where(err > 0, torch.inf, 0.0))
    return float(ratio.max()) if ratio.numel() else 0.0


def worst_bound_ratio(acc: torch.Tensor, pool: Pool, w, w_sf) -> float:
    """The largest GEMM_BOUND ratio of a dumped accumulator [P, R] over every expert's valid rows,
    against the pool's own operands (pool.x, pool.sf) and the canonical weights (w, w_sf)."""
    return max(
        bound_ratio(acc[pool.rows(e)], ex, b) for e, (ex, b) in reference_acc(pool, pool.x, pool.sf, w, w_sf).items()
    )


def emulate_d6(acc1: torch.Tensor, w_route: torch.Tensor, inter: int, fast: bool, clamp):
    """SPEC D6 on the dumped acc1 [n, 2I] (canonical), by the reference: (codes [n, I], scale bytes [n, I/32])."""
    valid = torch.ones(acc1.shape[0], dtype=torch.bool, device=acc1.device)
    out = ref.l1_epilogue(acc1, w_route, valid, activation_clamp=clamp, fast_math=fast)
    return out.l2_acts, out.l2_sf


def prefill_weights(promotion: str, kw):
    """(promotion, weights) for a test's promotion name: "k32/unfolded" is the exact mode with every
    128-row block on the prefill path's two-scale promotion (no block folded, layout.fold_blocks:
    the weights the tests make otherwise all fold)."""
    if promotion != "k32/unfolded":
        return promotion, kw
    unfolded = copy.copy(kw)
    unfolded.w1_fold = torch.zeros_like(kw.w1_fold)
    unfolded.w2_fold = torch.zeros_like(kw.w2_fold)
    return "k32", unfolded


def first_diff(a: torch.Tensor, b: torch.Tensor) -> str:
    d = a != b
    if not d.any():
        return "equal"
    idx = d.nonzero()[0].tolist()
    return f"{int(d.sum())} differ; first at {idx}: {a[tuple(idx)].item()} vs {b[tuple(idx)].item()}"


def setup_l1(H, inter, counts, seed, grid=False, align=64, **kw):
    """A pool of `counts` rows per expert (pool alignment `align`) with K = H, and random weights of
    both layers: (pool, (w1, s1, w2, s2), KernelWeights)."""
    gen = torch.Generator().manual_seed(seed)
    pool = Pool(counts, H, gen=gen, grid=grid, align=align)
    E = len(counts)
    w1, s1 = random_weights(E, 2 * inter, H, gen=gen, grid=grid, **kw)
    w2, s2 = random_weights(E, H, inter, gen=gen, grid=grid, **kw)
    kw_ = L.transform_weights(w1, s1, w2, s2)
    return pool, (w1, s1, w2, s2), kw_


def check_l1_epilogue(pool, res, inter, fast, clamp, tag):
    """D6 bit-exact on every expert's valid rows, given the dumped acc1 (res from a debug launch)."""
    for e, n in enumerate(pool.counts):
        if n == 0:
            continue
        r = pool.rows(e)
        q, sb = emulate_d6(res.acc1[r], pool.w_route[r], inter, fast, clamp)
        got_q = res.l2_acts[r].view(torch.uint8)
        assert torch.equal(got_q, q), f"{tag} D6 l2_acts expert {e}: {first_diff(got_q, q)}"
        assert torch.equal(res.l2_sf[r], sb), f"{tag} D6 l2_sf expert {e}: {first_diff(res.l2_sf[r], sb)}"


def combine_rows(pool: Pool, H: int, K: int = 1, *, gen=None, fill=float("nan")):
    """An L2 destination: combine buffer [K, T, H] (T = valid rows) filled with `fill`, and dst_rows
    [P] int32 mapping the valid pool rows to distinct combine rows (a random choice among the K * T
    when gen is given, else in order), -1 on padding rows. Returns (combine, dst_rows)."""
    T = sum(pool.counts)
    comb = torch.full((K, T, H), fill, dtype=torch.bfloat16, device=pool.x.device)
    dst = torch.full((pool.P,), -1, dtype=torch.int32, device=pool.x.device)
    rows = torch.randperm(K * T, generator=gen)[:T] if gen is not None else torch.arange(T)
    dst[pool.valid] = rows.to(torch.int32).to(pool.x.device)
    return comb, dst


def check_l2_epilogue(pool, acc2, combine, dst, tag):
    """D8 bit-exact: combine row dst[p] == bf16(acc2[p]) for every valid pool row p."""
    flat = combine.view(-1, combine.shape[-1])
    for e, n in enumerate(pool.counts):
        if n == 0:
            continue
        r = pool.rows(e)
        want = acc2[r].to(torch.bfloat16).view(torch.int16)
        got = flat[dst[r].long()].view(torch.int16)
        assert torch.equal(got, want), f"{tag} D8 expert {e}: {first_diff(got, want)}"


def pool_arrivals(pool: Pool, block: int) -> torch.Tensor:
    """The arrival counters of a complete pool: int32 [ceil(P / block)], valid rows per block of
    `block` pool rows (what the fused kernel's dispatch leaves in them; reference D4.block_arrivals)."""
    nb = -(-pool.P // block)
    valid = torch.zeros(nb * block, dtype=torch.int32, device=pool.valid.device)
    valid[: pool.P] = pool.valid.to(torch.int32)
    return valid.view(nb, block).sum(1, dtype=torch.int32)


def pool_l1(pool: Pool, kw, **kwargs):
    """l1_gemm on a pool's operands (x, sf, offsets, expert_rows, w_route) and the weights `kw`."""
    return G.l1_gemm(pool.x, pool.sf, pool.offsets, pool.expert_rows, pool.w_route, kw, **kwargs)


def pool_l2(pool: Pool, dst, kw, combine, **kwargs):
    """l2_gemm on a pool's operands (x and sf as the L2 activations) into `combine` at rows `dst`."""
    return G.l2_gemm(pool.x, pool.sf, pool.offsets, pool.expert_rows, dst, kw, combine, **kwargs)
