"""pytest plugin: the conformance suite as pytest tests over recorded dump files.

    pytest --pyargs megamoe.conformance --megamoe-dumps "run1/rank*.pt" -n 2

One test per (dump point, rank), named like `test_dump_point[D6-rank1]`, so a CI log names the
failing stage and rank; each fails with the checker's words, and a point with nothing to compare
on a rank is skipped as "not applicable", never passed. The run is a gate, so it cannot pass by
accident: a glob that matches no file is a usage error (exit code 4); no `--megamoe-dumps`, a file
that is no dump or an incomplete set of ranks is a collection error (exit code 2; 1 under xdist)
naming the problem in one line. None of them is a skipped run, nor a failure of some stage.

Installed as the `megamoe` pytest11 entry point, so the option exists wherever megamoe is
installed; it does nothing unless the conformance tests are collected or the option is given.
"""

from __future__ import annotations

import glob

import pytest

_DUMPS = pytest.StashKey[list]()


def pytest_addoption(parser):
    parser.addoption(
        "--megamoe-dumps",
        action="append",
        default=[],
        help="glob of the dump files of one call (all ranks); may be repeated",
    )


def dump_paths(config) -> list[str]:
    """The files the --megamoe-dumps globs match; a glob matching nothing is a usage error."""
    paths = []
    for pattern in config.getoption("--megamoe-dumps") or []:
        matched = sorted(glob.glob(pattern))
        if not matched:
            raise pytest.UsageError(f"--megamoe-dumps {pattern!r} matches no file")
        paths += matched
    return sorted(set(paths))


def pytest_configure(config):
    dump_paths(config)  # a typo in a CI path stops the run before anything is collected


def load_dumps(config) -> list:
    """Every rank of one call, loaded once per process, or a usage error saying what is wrong."""
    if _DUMPS not in config.stash:
        from megamoe.conformance.dump import Dump, DumpFormatError, with_weights
        from megamoe.conformance.suite import all_ranks

        paths = dump_paths(config)
        if not paths:
            raise pytest.UsageError(
                "the megamoe conformance tests need dump files: pass --megamoe-dumps GLOB "
                "(the dumps of all ranks of one call)"
            )
        try:
            config.stash[_DUMPS] = with_weights(all_ranks([Dump.load(p) for p in paths]))
        except (DumpFormatError, ValueError) as exc:
            raise pytest.UsageError(f"--megamoe-dumps: {exc}") from None
    return config.stash[_DUMPS]


def pytest_generate_tests(metafunc):
    if "megamoe_point_rank" in metafunc.fixturenames:
        from megamoe.conformance.suite import STAGES

        try:
            ranks, error = range(len(load_dumps(metafunc.config))), None
        except pytest.UsageError as exc:
            ranks, error = range(0), str(exc)
        if error:
            # A collection error that shows just this line, also under xdist, whose workers
            # collect on their own (a UsageError raised there would crash xdist's controller).
            pytest.fail(error, pytrace=False)
        params = [(point, rank) for point, _, _ in STAGES for rank in ranks]
        metafunc.parametrize("megamoe_point_rank", params, ids=[f"{p}-rank{r}" for p, r in params])


@pytest.fixture(scope="session")
def megamoe_dumps(request):
    return load_dumps(request.config)
