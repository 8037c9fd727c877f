"""pytest plugin: the conformance suite as pytest tests over recorded dump files.

    pytest --pyargs megamoe.conformance --megamoe-dumps "run1/rank*.pt" -n 2

One test per (dump point, rank); each fails with the checker's words. Installed as the `megamoe`
pytest11 entry point, so the option exists wherever megamoe is installed.
"""
from __future__ import annotations

import glob

import pytest


def pytest_addoption(parser):
    parser.addoption("--megamoe-dumps", action="append", default=[],
                     help="glob of the dump files of one call (all ranks); may be repeated")


def dump_paths(config) -> list[str]:
    paths = []
    for pattern in config.getoption("--megamoe-dumps") or []:
        paths += sorted(glob.glob(pattern))
    return paths


def pytest_generate_tests(metafunc):
    if "megamoe_point" in metafunc.fixturenames:
        from megamoe.conformance.suite import STAGES

        paths = dump_paths(metafunc.config)
        params = [p for p, _, _ in STAGES] if paths else []
        metafunc.parametrize("megamoe_point", params)


@pytest.fixture(scope="session")
def megamoe_dumps(request):
    from megamoe.conformance.dump import Dump

    return [Dump.load(p) for p in dump_paths(request.config)]
