"""Stage "L2" checkers: D7 accumulators (GEMM), D8 bf16 rows in the source ranks' combine buffers."""

from __future__ import annotations

import torch

from megamoe import reference as ref
from megamoe.reference import points as P

from .compare import exact
from .dump import Dump
from .gemm import check_gemm
from .result import CheckResult


def check_d7(dumps: list[Dump], rank: int) -> list[CheckResult]:
    return check_gemm(P.D7, dumps, rank)


def check_d8(dumps: list[Dump], rank: int) -> list[CheckResult]:
    """The combine buffer of source rank `rank`: every valid slot holds bf16(acc2) of the pool row
    (on whichever owner) whose metadata names it, with the owner's routing-weighted b2 added first
    where the layer has it (SPEC §8 D8); rows are given by every owner's dump."""
    d = dumps[rank]
    buf = d[P.D8_COMBINE]
    want = buf.clone()
    written = torch.zeros(buf.shape[:2], dtype=torch.bool)
    for owner in dumps:
        valid = owner.rows_checked()
        meta = owner[P.D4_POOL_META].long()
        in_range = (meta[:, 1] >= 0) & (meta[:, 1] < buf.shape[1]) & (meta[:, 2] >= 0) & (meta[:, 2] < buf.shape[0])
        rows = (valid & in_range & (meta[:, 0] == rank)).nonzero().flatten()
        if rows.numel():
            k, t = meta[rows, 2], meta[rows, 1]
            acc2 = owner[P.D7_ACC2]
            bias = ref.l2_bias_args(owner.config, owner.tensors, owner.tensors.get("weights.b2"))  # SPEC §8's b2
            if bias:
                acc2 = ref.add_l2_bias(acc2, **bias)
            want[k, t] = ref.bf16_tensor(ref.encode_bf16(acc2[rows]))
            written[k, t] = True
    idx = d["inputs.topk_idx"]
    slots = torch.zeros_like(written)
    slots[:, : idx.shape[0]] = (idx >= 0).T & d.tokens_checked()[None, :]
    cover = exact(
        P.D8,
        f"{P.D8_COMBINE} (slots written)",
        rank,
        written,
        slots,
        kind="int",
        locate=lambda c: f"slot {c[0]}, token {c[1]}",
    )
    mask = (slots & written).reshape(-1)
    k_t = buf.reshape(-1, buf.shape[2])
    check = exact(
        P.D8,
        P.D8_COMBINE,
        rank,
        k_t,
        want.reshape(-1, buf.shape[2]),
        kind="bf16",
        rows=mask,
        locate=lambda c: f"slot {c[0] // buf.shape[1]}, token {c[0] % buf.shape[1]}, channel {c[1]}",
    )
    return [cover, check] if cover.failed else [check]
