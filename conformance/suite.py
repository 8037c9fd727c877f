"""The conformance suite: every stage checker over every rank's dump, in pipeline order.

    report = check(dumps)          # one line from a kernel test
    assert report.ok, report.text()

A failure is reported at the first dump point where it shows, with the earlier points named as
clean, because every checker recomputes its expectation from the *dumped* output of the stage
before it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable

from megamoe import reference as ref
from megamoe.reference import points as P
from megamoe.reference.errors import check_type, fail

from .cleanup import check_d10
from .combine import check_d9
from .dispatch import check_d1, check_d2, check_d3
from .dump import Dump, global_weights, one_call, with_weights
from .l1 import check_d5
from .l2 import check_d7, check_d8
from .pool import check_d4
from .result import END_TO_END, FAIL, GUARD, INFO, NA, PASS, CheckResult
from .swiglu import check_d6

# The checker of each dump point; the points, their order and their stage names are the table's
# (megamoe.reference.points), so a point without a checker fails here, at import.
CHECKERS: dict[str, Callable] = {
    P.D1: check_d1,
    P.D2: check_d2,
    P.D3: check_d3,
    P.D4: check_d4,
    P.D5: check_d5,
    P.D6: check_d6,
    P.D7: check_d7,
    P.D8: check_d8,
    P.D9: check_d9,
    P.D10: check_d10,
}
STAGES: tuple[tuple[str, str, Callable], ...] = tuple((p, P.stage_of(p), CHECKERS[p]) for p in P.POINTS)


# What the table's columns mean; printed under it by `megamoe check`, and in docs/conformance.md.
LEGEND = """\
elements: how many elements the check compared (valid pool rows only for pool-shaped tensors; of a
  sampled dump, the rows and tokens it holds).
mismatches: how many of them broke the check's rule.
max error: GEMM_BOUND rows: the largest |acc - exact| / (tau * sum|a*b|) over the elements, the
  bound's own scale, so a value <= 1 passes and 0.25 means a quarter of the allowed error;
  END_TO_END rows: calc_diff = 1 - 2*sum(x*y) / sum(x^2 + y^2) of y against the float64 oracle
  (report only, never a failure). Empty for the checks that compare bytes.
status: pass, fail, info (reported, not judged) or n/a (nothing to compare: 0 elements; never a pass)."""


@dataclass
class SuiteReport:
    results: list[CheckResult]

    @property
    def ok(self) -> bool:
        return not any(r.failed for r in self.results)

    def status(self, point: str) -> str:
        """fail, pass (at least one check passed, none failed), n/a (nothing to compare) or skip."""
        rs = [r for r in self.results if r.point == point and r.status in (PASS, FAIL)]
        if rs:
            return FAIL if any(r.failed for r in rs) else PASS
        return NA if any(r.point == point and r.status == NA for r in self.results) else "skip"

    @property
    def first_failure(self) -> str | None:
        return next((p for p, _, _ in STAGES if self.status(p) == FAIL), None)

    def text(self) -> str:
        lines = [self.table(), "", LEGEND, ""]
        first = self.first_failure
        if first is None:
            # A point with nothing to compare on any rank (a call without tokens) is named, so
            # that "conform" never stands for checks that did not happen.
            empty = [p for p, _, _ in STAGES if self.status(p) in (NA, "skip")]
            lines.append("all stages conform" + (f"; nothing to compare at {', '.join(empty)}" if empty else ""))
        else:
            clean = [p for p, _, _ in STAGES[: [p for p, _, _ in STAGES].index(first)]]
            lines.append(f"first failing dump point: {first}; earlier stages clean: {', '.join(clean) or 'none'}")
            lines += [r.line() for r in self.results if r.failed]
        return "\n".join(lines)

    def table(self) -> str:
        rows = [
            "| point | stage | check | rank | status | elements | mismatches | max error |",
            "|---|---|---|---:|---|---:|---:|---:|",
        ]
        names = {p: s for p, s, _ in STAGES}
        for r in self.results:
            err = "" if r.max_error is None else f"{r.max_error:.3g}"
            rows.append(
                f"| {r.tensor} | {names.get(r.point, r.point)} | {r.check} | {r.rank} | {r.status} | "
                f"{r.elements} | {r.mismatches} | {err} |"
            )
        return "\n".join(rows)

    def to_json(self) -> str:
        return json.dumps(
            {"ok": self.ok, "first_failure": self.first_failure, "results": [r.to_dict() for r in self.results]},
            indent=2,
        )


def _end_to_end(dumps: list[Dump]) -> list[CheckResult]:
    """END_TO_END (report only): y against the float64 oracle of the dumped inputs (of a sampled
    dump, its tokens: a token's y depends on its own x only)."""
    cfg = dumps[0].config
    inputs = [d.inputs() for d in dumps]
    oracle = ref.run_oracle(cfg, inputs, global_weights(dumps))
    out = []
    for d, orc in zip(dumps, oracle):
        held = d.tokens_checked()
        y, want = d[P.D9_Y].float()[held], orc.y[held]
        diff = ref.calc_diff(y, want)
        err = (y.double() - want).abs()
        peak = float(want.abs().max()) if want.numel() else 0.0
        out.append(
            CheckResult(
                P.D9,
                "y vs float64 oracle",
                END_TO_END,
                d.rank,
                INFO,
                elements=y.numel(),
                max_error=diff,
                message=f"calc_diff {diff:.3e}, max abs err "
                f"{float(err.max()) if err.numel() else 0:.3e}, rel (inf-norm) "
                f"{float(err.max()) / peak if peak else 0:.3e}",
            )
        )
    return out


def check_point(point: str, dumps: list[Dump], rank: int) -> list[CheckResult]:
    """One dump point of one rank (the dumps: all ranks, in rank order)."""
    fn = next(f for p, _, f in STAGES if p == point)
    try:
        return fn(dumps, rank)
    except Exception as exc:  # a malformed dump is a failure of its point, not a crash
        return [
            CheckResult(
                point,
                f"{point}.*",
                GUARD,
                rank,
                FAIL,
                message=f"the checker could not run on this dump: {type(exc).__name__}: {exc}",
            )
        ]


def all_ranks(dumps: list[Dump]) -> list[Dump]:
    """The dumps in rank order, refused (ValueError) unless they are every rank of one call once:
    a missing rank, or a rank of another call, would show up as D2/D3/D4/D8 failures that are no
    fault of the kernel."""
    if not dumps:
        raise ValueError("check needs the dumps of one call, got none")
    one_call(dumps)
    dumps = sorted(dumps, key=lambda d: d.rank)
    world = dumps[0].world_size
    ranks = [d.rank for d in dumps]
    if ranks != list(range(world)) or any(d.world_size != world for d in dumps):
        raise ValueError(f"check needs the dumps of all {world} ranks of one call, got ranks {ranks}")
    if any(d.meta.get("config") != dumps[0].meta.get("config") for d in dumps):
        raise ValueError("check needs the dumps of one call; these hold different configs (shapes or modes)")
    return dumps


def check(
    dumps: Iterable[Dump | str | Path] | Dump | str | Path,
    *,
    end_to_end: bool = False,
    progress: Callable[[str], None] | None = None,
    weights: ref.ExpertWeights | None = None,
) -> SuiteReport:
    """Run every checker on the dumps of one call (all ranks): Dump objects or dump file paths, a
    list of them or one (the one rank of a one-rank call). Dumps saved without their weights get
    them from `weights` (global, all experts) or from their seed."""
    if isinstance(dumps, (Dump, str, Path)):
        dumps = [dumps]  # one file: a string is not a sequence of file names
    if not isinstance(dumps, Iterable):
        fail("dumps", "Dump objects or dump file paths (a list, or one)", type(dumps).__name__)
    dumps = list(dumps)
    for d in dumps:
        if not isinstance(d, (Dump, str, Path)):
            fail("dumps", "Dump objects or dump file paths (a list, or one)", f"an entry of type {type(d).__name__}")
    if weights is not None:
        check_type("weights", weights, ref.ExpertWeights)
    dumps = with_weights(all_ranks([d if isinstance(d, Dump) else Dump.load(d) for d in dumps]), weights)
    world = len(dumps)
    results: list[CheckResult] = []
    for point, stage, _ in STAGES:
        if progress:
            progress(f"checking {point} ({stage}) on {world} rank(s)")
        for rank in range(world):
            results += check_point(point, dumps, rank)
    if end_to_end:
        results += _end_to_end(dumps)
    return SuiteReport(results)
