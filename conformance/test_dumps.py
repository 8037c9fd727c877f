"""Collected by `pytest --pyargs megamoe.conformance --megamoe-dumps GLOB`: one test per dump point."""
from megamoe.conformance.result import CheckResult
from megamoe.conformance.suite import STAGES


def test_dump_point(megamoe_point, megamoe_dumps):
    fn = dict((p, f) for p, _, f in STAGES)[megamoe_point]
    results: list[CheckResult] = []
    for rank in range(len(megamoe_dumps)):
        results += fn(megamoe_dumps, rank)
    failures = [r.line() for r in results if r.failed]
    assert not failures, "\n".join(failures)
