"""Stage "SwiGLU/requant" checker (D6): bit-exact given the dumped acc1 and routing weights."""

from __future__ import annotations

from megamoe import reference as ref
from megamoe.reference import points as P

from .compare import exact, guard, pool_locator
from .dump import Dump
from .result import CheckResult


def check_d6(dumps: list[Dump], rank: int) -> list[CheckResult]:
    d, cfg = dumps[rank], dumps[rank].config
    valid = d.rows_checked()  # of a sampled dump, the rows it holds
    b1 = d.tensors.get("weights.b1")  # SPEC §8's gate/up biases, where the layer has them
    want = ref.l1_epilogue(d[P.D5_ACC1], d[P.D4_POOL_WEIGHTS], valid, **ref.activation_args(cfg, d.tensors, b1))
    locate = pool_locator(d, rank)
    out = []
    g = guard(
        P.D6,
        P.D6_L2_ACTS,
        rank,
        not valid.any() or bool((want.l2_acts[valid] & 0x7F).any()),
        "every expected code is zero: the check could not fail",
    )
    if g:
        out.append(g)
    out.append(exact(P.D6, P.D6_L2_ACTS, rank, d[P.D6_L2_ACTS], want.l2_acts, kind="e4m3", rows=valid, locate=locate))
    out.append(exact(P.D6, P.D6_L2_SF, rank, d[P.D6_L2_SF], want.l2_sf, kind="ue8m0", rows=valid, locate=locate))
    done = ref.l1_done(d[P.D4_BLOCK_ARRIVALS], cfg.intermediate)
    out.append(
        exact(P.D6, P.D6_L1_DONE, rank, d[P.D6_L1_DONE], done, kind="int", locate=lambda c: f"pool block {c[0]}")
    )
    return out
