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
    held = d.tokens_checked()  # every token, or those a sampled dump holds
    out = []
    g = guard(
        P.D9,
        P.D9_Y,
        rank,
        not held.any() or bool((idx[held] >= 0).sum() == 0) or bool((want[held].float() != 0).any()),
        "the expected y is all zero although tokens have experts",
    )
    if g:
        out.append(g)
    out.append(exact(P.D9, P.D9_Y, rank, d[P.D9_Y], want, kind="bf16", rows=held, locate=token_locator()))
    return out
