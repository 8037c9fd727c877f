"""Dumps cut to some tokens (conformance.dump.sample_tokens), as the CI fixtures of calls too large
to keep whole are: they round-trip through a file at a fraction of the bytes, conform, and a fault
in any row they hold is still caught at its own dump point."""

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


def _call(**kw):
    inputs = ref.make_inputs(CFG, [39, 30], seed=3, masked_ratio=0.1)
    return reference_dumps(CFG, inputs, ref.random_weights(8, 256, 128, seed=3), **kw)


def _saved(d: Dump, tmp_path) -> tuple[Dump, int]:
    path = tmp_path / f"rank{d.rank}.pt"
    d.save(path)
    return Dump.load(path), path.stat().st_size


def test_a_sampled_call_round_trips_through_its_files_at_a_fraction_of_the_bytes_and_conforms(tmp_path):
    whole = _call()
    cut = sample_tokens(whole, KEEP)
    back, sizes = zip(*(_saved(d, tmp_path) for d in cut))
    (tmp_path / "whole").mkdir()
    bare = [_saved(d.without_weights(3), tmp_path / "whole")[1] for d in whole]
    assert sum(_saved(d.without_weights(3), tmp_path)[1] for d in cut) < sum(bare) / 3
    for b, c in zip(back, cut):
        assert b.sampled and set(b.tensors) == set(c.tensors)
        # bit for bit (an unwritten combine slot holds a NaN)
        assert all(torch.equal(b[n].view(torch.uint8), c[n].view(torch.uint8)) for n in c.tensors), "what was held"
    report = check(list(back))
    assert report.ok, report.text()
    for point, _, _ in STAGES:
        assert report.status(point) == "pass", (point, report.text())
    # The payload checks compared the kept rows only: rank 0's D9 the 3 tokens kept, its D5 their slots.
    y0 = next(r for r in report.results if r.tensor == P.D9_Y and r.rank == 0)
    assert y0.elements == 3 * CFG.hidden
    kept_rows = int(back[0].rows_checked().sum())
    d5 = next(r for r in report.results if r.point == P.D5 and r.rank == 0)
    assert (
        0 < kept_rows < int(ref.valid_rows(back[0].tensors).sum()) and d5.elements == kept_rows * 2 * CFG.intermediate
    )


def _kept_row(d: Dump) -> int:
    return int(d.rows_checked().nonzero()[0])


def _flip_pool_x(d):
    d.tensors[P.D4_POOL_X][_kept_row(d), 3] ^= 0x01


def _bump_acc1(d):
    d.tensors[P.D5_ACC1][_kept_row(d), 7] += 1.0


def _flip_l2_acts(d):
    d.tensors[P.D6_L2_ACTS][_kept_row(d), 0] ^= 0x01


def _bump_acc2(d):
    d.tensors[P.D7_ACC2][_kept_row(d), 2] += 1.0


def _flip_combine(d):
    k, t = (d["inputs.topk_idx"][17] >= 0).nonzero()[0].item(), 17
    d.tensors[P.D8_COMBINE].view(torch.int16)[k, t, 5] ^= 0x0001


def _flip_y(d):
    d.tensors[P.D9_Y].view(torch.int16)[38, 9] ^= 0x0001


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
def test_a_fault_in_a_kept_row_of_a_sampled_call_is_caught_at_its_point(tmp_path, plant, point):
    cut = sample_tokens(_call(), KEEP)
    plant(cut[0])
    back = [_saved(d, tmp_path)[0] for d in cut]
    assert check(back).first_failure == point


def test_sample_tokens_takes_one_list_of_tokens_per_rank():
    with pytest.raises(ref.MegaMoEInputError, match="argument 'tokens': expected one list of token indices per rank"):
        sample_tokens(_call(), [[0]])
