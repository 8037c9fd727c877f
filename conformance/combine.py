"""Stage "combine" checker (D9): y bit-exact given the dumped combine buffer."""

from __future__ import annotations

from megamoe import reference as ref
from megamoe.reference import points as P

from .compare import exact, guard, token_locator
from .dump import Dump
from .result import CheckResult


def check_d9(dumps: list[Dump], rank: int) -> list[CheckResult]:
    d = dumps[rank]
    idx = d["inputs.topk_idx"]
    want = ref.combine(d[P.D8_COMBINE], idx)
    out = []
    g = guard(
        P.D9,
        P.D9_Y,
        rank,
        idx.shape[0] == 0 or bool((idx >= 0).sum() == 0) or bool((want.float() != 0).any()),
        "the expected y is all zero although tokens have experts",
    )
    if g:
        out.append(g)
    rows = d.tokens_checked() if d.sampled else None
    out.append(exact(P.D9, P.D9_Y, rank, d[P.D9_Y], want, kind="bf16", rows=rows, locate=token_locator()))
    return out
