"""Stage "SwiGLU/requant" checker (D6): bit-exact given the dumped acc1 and routing weights."""

from __future__ import annotations

from megamoe import reference as ref

from .compare import exact, guard, pool_locator
from .dump import Dump
from .result import CheckResult


def check_d6(dumps: list[Dump], rank: int) -> list[CheckResult]:
    d, cfg = dumps[rank], dumps[rank].config
    valid = ref.valid_rows(d.tensors)
    want = ref.l1_epilogue(
        d["D5.acc1"], d["D4.pool_weights"], valid, activation_clamp=cfg.activation_clamp, fast_math=cfg.fast_math
    )
    locate = pool_locator(d, rank)
    out = []
    g = guard(
        "D6",
        "D6.l2_acts",
        rank,
        not valid.any() or bool((want.l2_acts[valid] & 0x7F).any()),
        "every expected code is zero: the check could not fail",
    )
    if g:
        out.append(g)
    out.append(exact("D6", "D6.l2_acts", rank, d["D6.l2_acts"], want.l2_acts, kind="e4m3", rows=valid, locate=locate))
    out.append(exact("D6", "D6.l2_sf", rank, d["D6.l2_sf"], want.l2_sf, kind="ue8m0", rows=valid, locate=locate))
    done = ref.l1_done(d["D4.block_arrivals"], cfg.intermediate)
    out.append(
        exact("D6", "D6.l1_done", rank, d["D6.l1_done"], done, kind="int", locate=lambda c: f"pool block {c[0]}")
    )
    return out
