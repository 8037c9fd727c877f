"""Kernel dumps recorded on an H200 (tests/gpu/record_fixtures.py), checked on the CPU by the
conformance suite on every CI run — and a fault planted in one is still caught at its stage."""

from pathlib import Path

import pytest

from megamoe import reference as ref
from megamoe.conformance.dump import Dump
from megamoe.conformance.suite import check

FIXTURES = Path(__file__).parent / "fixtures"


def _load(promotion: str) -> list[Dump]:
    return [Dump.load(p) for p in sorted(FIXTURES.glob(f"sm90_{promotion}_rank*.pt"))]


@pytest.mark.parametrize("promotion", ["k32", "k128"])
def test_recorded_kernel_dumps_conform(promotion):
    dumps = _load(promotion)
    assert len(dumps) == 2 and dumps[0].meta["kernel_mode"] == f"sm90-gemm-{promotion}"
    report = check(dumps)
    assert report.ok, report.text()
    gemm = [r for r in report.results if r.point in ("D5", "D7")]
    assert gemm and all(r.max_error < 1 for r in gemm)


def test_a_flipped_code_in_a_recorded_dump_is_caught_at_d6():
    dumps = _load("k32")
    d = dumps[1]
    p = int(ref.valid_rows(d.tensors).nonzero()[0])
    d.tensors["D6.l2_acts"][p, 0] ^= 0x01
    assert check(dumps).first_failure == "D6"
