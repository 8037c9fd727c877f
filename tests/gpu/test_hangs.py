"""Hangs become errors (SPEC §5): every wait of the fused kernel, made to time out by
`MegaMoE.withhold`, ends the call in an error that names the rank, the wait, its index and the
expected and observed counts, on one rank and through `megamoe.multirank.spawn` on two, which names
the failed rank. Each site runs in its own process (the trap ends the CUDA context), all at once.
The seconds each took are bench.hangs' table (no timed assert here)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

from bench import hangs

WORDS = {
    "dispatch": "dispatch counter",
    "arrival": "arrival counter of pool block 0",
    "l1_done": "L1 completion counter of pool block 0",
    "l2_done": "L2 completion counter",
    "decoded": "predecode counter",
    "epoch": "dispatch counter",
}

_OUTS: dict = {}


def _outs() -> dict:
    if not _OUTS:
        with ThreadPoolExecutor(len(hangs.SITES)) as ex:
            _OUTS.update(zip(hangs.SITES, ex.map(lambda s: hangs.run_site(*s), hangs.SITES)))
    return _OUTS


@pytest.mark.parametrize("site", hangs.SITES, ids=[f"{w}-R{r}-on{o}-{e}" for w, r, o, e in hangs.SITES])
def test_a_withheld_arrival_ends_in_an_error_naming_the_rank_and_the_wait(site):
    wait, ranks, on_rank, _ = site
    out = _outs()[site]
    assert "RESULT" not in out, out
    assert "[the kernel trapped: rank " in out and "expected" in out and "observed" in out, out
    assert WORDS[wait] in out, out
    if ranks == 1:
        assert "[the kernel trapped: rank 0, SM block" in out, out
    else:
        assert "RANKFAILED" in out, out  # spawn named the rank that failed, and printed its record
        failed = int(next(ln.split()[1] for ln in out.splitlines() if ln.startswith("RANKFAILED")))
        assert f"rank {failed} failed" in out or f"rank {failed} died" in out, out
