"""Stage "L1" checker (D5): the accumulators against the exact sum of the dumped pool and weights."""

from __future__ import annotations

from megamoe.reference import points as P

from .dump import Dump
from .gemm import check_gemm
from .result import CheckResult


def check_d5(dumps: list[Dump], rank: int) -> list[CheckResult]:
    return check_gemm(P.D5, dumps, rank)
