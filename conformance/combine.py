"""Stage "combine" checker (D9): y bit-exact given the dumped combine buffer."""

from __future__ import annotations

from megamoe import reference as ref

from .compare import exact, guard, token_locator
from .dump import Dump
from .result import CheckResult


def check_d9(dumps: list[Dump], rank: int) -> list[CheckResult]:
    d = dumps[rank]
    idx = d["inputs.topk_idx"]
    want = ref.combine(d["D8.combine"], idx)
    out = []
    g = guard(
        "D9",
        "D9.y",
        rank,
        idx.shape[0] == 0 or bool((idx >= 0).sum() == 0) or bool((want.float() != 0).any()),
        "the expected y is all zero although tokens have experts",
    )
    if g:
        out.append(g)
    out.append(exact("D9", "D9.y", rank, d["D9.y"], want, kind="bf16", locate=token_locator()))
    return out
