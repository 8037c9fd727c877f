"""Stage "pool" checker (D4): layout, pulled rows, routing weights, metadata, arrival counters."""

from __future__ import annotations

import torch

from megamoe import reference as ref
from megamoe.reference import points as P

from .compare import exact, guard, multiset, pool_locator
from .dump import Dump
from .result import CheckResult


def check_d4(dumps: list[Dump], rank: int) -> list[CheckResult]:
    d, cfg = dumps[rank], dumps[rank].config
    out = []
    offsets = ref.pool_offsets(d[P.D2_RECV_TOTALS].tolist(), cfg.block_m)
    out.append(
        exact(
            P.D4,
            P.D4_EXPERT_OFFSETS,
            rank,
            d[P.D4_EXPERT_OFFSETS],
            offsets,
            kind="int",
            locate=lambda c: f"local expert {c[0]}",
        )
    )
    if out[-1].failed:
        return out  # nothing below can be located without the layout
    valid = ref.valid_rows(d.tensors)
    meta = d[P.D4_POOL_META].long()
    g = guard(
        P.D4,
        P.D4_POOL_META,
        rank,
        int(valid.sum()) == int(d[P.D2_RECV_TOTALS].sum()) and (valid.any() or int(d[P.D2_RECV_TOTALS].sum()) == 0),
        "no valid pool row to check",
    )
    if g:
        return out + [g]
    # which (s, t, k) each local expert must hold, from the inputs of every rank
    e_l = cfg.local_experts
    row_expert = torch.bucketize(torch.arange(valid.numel()), d[P.D4_EXPERT_OFFSETS][1:].long(), right=True)
    got_rows = torch.cat([row_expert[valid, None], meta[valid]], dim=1)
    want_rows = []
    for le in range(e_l):
        for s, src in enumerate(dumps):
            t, k = (src["inputs.topk_idx"] == rank * e_l + le).nonzero(as_tuple=True)
            want_rows.append(torch.stack([torch.full_like(t, le), torch.full_like(t, s), t, k], dim=1))
    want_rows = torch.cat(want_rows) if want_rows else torch.zeros(0, 4, dtype=torch.long)
    out.append(
        multiset(P.D4, P.D4_POOL_META, rank, got_rows, want_rows, what="(local expert, source rank, token, slot) rows")
    )
    # every valid row is a byte copy of its source row, scales and routing weight
    want_x, want_sf, want_w = d[P.D4_POOL_X].clone(), d[P.D4_POOL_X_SF].clone(), d[P.D4_POOL_WEIGHTS].clone()
    in_range = valid & (meta[:, 0] >= 0) & (meta[:, 0] < len(dumps))
    for p in in_range.nonzero().flatten().tolist():
        s, t, k = meta[p].tolist()
        src = dumps[s]
        if not (0 <= t < src["inputs.x"].shape[0] and 0 <= k < cfg.top_k):
            in_range[p] = False
            continue
        want_x[p], want_sf[p], want_w[p] = src["inputs.x"][t], src["inputs.x_sf"][t], src["inputs.topk_weights"][t, k]
    bad_meta = valid & ~in_range
    if bad_meta.any():
        p = int(bad_meta.nonzero()[0])
        out.append(
            multiset(
                P.D4,
                P.D4_POOL_META,
                rank,
                meta[bad_meta],
                torch.zeros(0, 3, dtype=torch.long),
                what=f"valid rows with out-of-range metadata (first: pool row {p})",
            )
        )
    locate = pool_locator(d, rank)
    held = in_range & d.rows_checked()  # the rows whose payload a sampled dump holds (its metadata is whole)
    out.append(exact(P.D4, P.D4_POOL_X, rank, d[P.D4_POOL_X], want_x, kind="e4m3", rows=held, locate=locate))
    out.append(exact(P.D4, P.D4_POOL_X_SF, rank, d[P.D4_POOL_X_SF], want_sf, kind="ue8m0", rows=held, locate=locate))
    out.append(
        exact(P.D4, P.D4_POOL_WEIGHTS, rank, d[P.D4_POOL_WEIGHTS], want_w, kind="fp32", rows=in_range, locate=locate)
    )
    arrivals = (
        valid.reshape(-1, cfg.block_m).sum(dim=1).to(torch.int32)
        if valid.numel()
        else torch.zeros(0, dtype=torch.int32)
    )
    out.append(
        exact(
            P.D4,
            P.D4_BLOCK_ARRIVALS,
            rank,
            d[P.D4_BLOCK_ARRIVALS],
            arrivals,
            kind="int",
            locate=lambda c: f"pool block {c[0]} (rows {c[0] * cfg.block_m}..{(c[0] + 1) * cfg.block_m - 1})",
        )
    )
    return out
