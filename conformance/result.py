"""The outcome of one check, and how a failure is put into words."""

from __future__ import annotations

from dataclasses import asdict, dataclass

# The check classes of SPEC §4, defined with the dump-point table (which gives each tensor's) and
# imported from here by the checkers.
from megamoe.reference.points import END_TO_END, EXACT, GEMM_BOUND, GEMM_EXACT, GUARD, MULTISET  # noqa: F401

# NA: the check had nothing to compare (0 elements, e.g. D10.counters of a reference dump, which
# has no counters): shown as such, never as a pass, so a check that could not fail is not green.
PASS, FAIL, SKIP, INFO, NA = "pass", "fail", "skip", "info", "n/a"


@dataclass
class CheckResult:
    point: str  # "D6"
    tensor: str  # "D6.l2_acts"
    check: str  # a check class
    rank: int
    status: str
    elements: int = 0  # elements compared
    mismatches: int = 0
    max_error: float | None = None  # GEMM_BOUND: max |err| / (τ Σ|ab|); END_TO_END: calc_diff
    message: str = ""

    @property
    def failed(self) -> bool:
        return self.status == FAIL

    def to_dict(self) -> dict:
        return asdict(self)

    def line(self) -> str:
        head = f"{self.tensor} (rank {self.rank}, {self.check})"
        if self.status == FAIL:
            return f"FAIL {head}: {self.message}"
        extra = (
            f", max ratio to bound {self.max_error:.3g}"
            if self.check in (GEMM_BOUND,) and self.max_error is not None
            else ""
        )
        return f"{self.status} {head}: {self.elements} elements{extra}{': ' + self.message if self.message else ''}"
