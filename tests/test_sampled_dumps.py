"""Dumps cut to some tokens (conformance.dump.sample_tokens), as the CI fixtures of calls too large
to keep whole are: they round-trip through a file at a fraction of the bytes, conform, and a fault
in any row they hold is still caught at its own dump point, on every rank."""

import pytest
import torch

from megamoe import reference as ref
from megamoe.conformance.dump import Dump, reference_dumps, sample_tokens
from megamoe.conformance.suite import STAGES, check
from megamoe.reference import points as P

CFG = ref.MoEConfig(
    hidden=256, intermediate=128, num_experts=8, top_k=4, num_ranks=2, max_tokens_per_rank=40, block_m=16
)
KEEP = [[0, 17, 38], [5, 29]]  # rank 0 has 39 tokens, rank 1 has 30


def _call(inputs=None):
    inputs = inputs or ref.make_inputs(CFG, [39, 30], seed=3, masked_ratio=0.1)
    return reference_dumps(CFG, inputs, ref.random_weights(8, 256, 128, seed=3))


def _saved(d: Dump, tmp_path) -> tuple[Dump, int]:
    path = tmp_path / f"rank{d.rank}.pt"
    d.save(path)
    return Dump.load(path), path.stat().st_size


def test_a_sampled_call_round_trips_through_its_files_at_a_fraction_of_the_bytes_and_conforms(tmp_path):
    whole = _call()
    cut = sample_tokens(whole, KEEP)
    back = [_saved(d, tmp_path)[0] for d in cut]
    for b, c in zip(back, cut):
        assert b.sampled and set(b.tensors) == set(c.tensors)
        # bit for bit (an unwritten combine slot holds a NaN)
        assert all(torch.equal(b[n].view(torch.uint8), c[n].view(torch.uint8)) for n in c.tensors), "what was held"
    (tmp_path / "whole").mkdir()
    bare = sum(_saved(d.without_weights(3), tmp_path / "whole")[1] for d in whole)
    assert sum(_saved(d.without_weights(3), tmp_path)[1] for d in cut) < bare / 3
    report = check(back)
    assert report.ok, report.text()
    for point, _, _ in STAGES:
        assert report.status(point) == "pass", (point, report.text())
    # The payload checks compared the rows held, no more: rank 0's y its 3 tokens, each pool-shaped
    # tensor the rows of their slots on that rank.
    y0 = next(r for r in report.results if r.tensor == P.D9_Y and r.rank == 0)
    assert y0.elements == 3 * CFG.hidden
    kept_rows = int(back[0].rows_checked().sum())
    assert 0 < kept_rows < int(ref.valid_rows(back[0].tensors).sum())
    widths = {P.D4_POOL_X: 256, P.D5_ACC1: 256, P.D6_L2_ACTS: 128, P.D7_ACC2: 256}
    for tensor, width in widths.items():
        got = next(r for r in report.results if r.tensor == tensor and r.rank == 0)
        assert got.elements == kept_rows * width, (tensor, got.elements)
    # The end-to-end row: the kept tokens' y against the oracle (a token's y needs its own x only).
    e2e = [r for r in check(back, end_to_end=True).results if r.check == "END_TO_END"]
    assert [r.elements for r in e2e] == [3 * 256, 2 * 256] and all(r.max_error < 1e-3 for r in e2e)
    # Sampling copied: the call's own dumps are whole and conform.
    assert not any(d.sampled for d in whole) and check(whole).ok


def test_a_rank_that_holds_no_kept_token_or_receives_none_of_their_slots_still_conforms():
    inputs = ref.make_inputs(CFG, [39, 30], seed=3)
    # token 0 of rank 0 and token 4 of rank 1 routed to rank 0's experts only (0-3): rank 1 receives
    # none of the kept tokens' slots
    for inp, t in zip(inputs, (0, 4)):
        inp.topk_idx[t] = torch.tensor([0, 1, 2, 3])
    cut = sample_tokens(_call(inputs), [[0], [4]])
    assert not cut[1].rows_checked().any()
    assert check(cut).ok, check(cut).text()
    # and a rank that keeps no token at all
    cut = sample_tokens(_call(), [KEEP[0], []])
    assert check(cut).ok, check(cut).text()


def _kept_row(d: Dump) -> int:
    return int(d.rows_checked().nonzero()[-1])


def _flip_pool_x(d, token):
    d.tensors[P.D4_POOL_X][_kept_row(d), 3] ^= 0x01


def _bump_acc1(d, token):
    d.tensors[P.D5_ACC1][_kept_row(d), 7] += 1.0


def _flip_l2_acts(d, token):
    d.tensors[P.D6_L2_ACTS][_kept_row(d), 0] ^= 0x01


def _bump_acc2(d, token):
    d.tensors[P.D7_ACC2][_kept_row(d), 2] += 1.0


def _flip_combine(d, token):
    k = int((d["inputs.topk_idx"][token] >= 0).nonzero()[0])
    d.tensors[P.D8_COMBINE].view(torch.int16)[k, token, 5] ^= 0x0001


def _flip_y(d, token):
    d.tensors[P.D9_Y].view(torch.int16)[token, 9] ^= 0x0001


@pytest.mark.parametrize("rank,token", [(0, 17), (1, 29)])
@pytest.mark.parametrize(
    "plant,point",
    [
        (_flip_pool_x, "D4"),
        (_bump_acc1, "D5"),
        (_flip_l2_acts, "D6"),
        (_bump_acc2, "D7"),
        (_flip_combine, "D8"),
        (_flip_y, "D9"),
    ],
    ids=["pool_x", "acc1", "l2_acts", "acc2", "combine", "y"],
)
def test_a_fault_in_a_kept_row_of_a_sampled_call_is_caught_at_its_point(tmp_path, plant, point, rank, token):
    cut = sample_tokens(_call(), KEEP)
    plant(cut[rank], token)
    back = [_saved(d, tmp_path)[0] for d in cut]
    assert check(back).first_failure == point


def test_sample_tokens_takes_one_list_of_tokens_per_rank_each_in_range():
    with pytest.raises(ref.MegaMoEInputError, match="argument 'tokens': expected one list of token indices per rank"):
        sample_tokens(_call(), [[0]])
    with pytest.raises(ref.MegaMoEInputError, match=r"argument 'tokens': expected rank 1's token indices in \[0, 30\)"):
        sample_tokens(_call(), [[0], [30]])
    with pytest.raises(ref.MegaMoEInputError, match="argument 'tokens'"):
        sample_tokens(_call(), [[-1], [0]])
