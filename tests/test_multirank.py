"""Several ranks on the CPU (gloo): megamoe.multirank.spawn returns every rank's result in rank order
and ends a run whose rank raised, died or hung with an error that names the rank; and
megamoe.ranks.agree makes every rank refuse a call when one rank refused (bad input, or anything else
that failed before its launch) or when the ranks' options differ (the fused layer calls it before
each launch, so no rank waits in the kernel for a peer that never launches)."""

from __future__ import annotations

import os
import time

import pytest
import torch
import torch.distributed as dist

from megamoe import multirank, ranks
from megamoe.reference.errors import MegaMoEInputError


def _sum_of_ranks(rank: int, size: int, scale: int) -> tuple[int, int, int]:
    t = torch.tensor([rank + 1])
    dist.all_reduce(t, group=multirank.group())
    return rank, size, int(t) * scale


def _tensors(rank: int, size: int) -> dict:
    return {"rank": torch.full((3, 4), rank), "sizes": [torch.arange(size + i) for i in range(3)]}


def _raises_on_rank_1(rank: int, size: int) -> None:
    if rank == 1:
        raise ValueError("planted failure of rank 1")
    dist.barrier(group=multirank.group())  # waits for rank 1, which never comes


def _exits_on_rank_1(rank: int, size: int) -> None:
    if rank == 1:
        os._exit(3)
    dist.barrier(group=multirank.group())


def _hangs_on_rank_0(rank: int, size: int) -> None:
    if rank == 0:
        time.sleep(600)


def _refuse_on(rank: int, size: int, refusing: list[int], kind=MegaMoEInputError) -> str | None:
    err = kind(f"argument 'topk_idx': planted on rank {rank}") if rank in refusing else None
    host = ranks.host_group(multirank.group())
    assert host is multirank.group()  # a gloo group is its own host group
    try:
        ranks.agree(host, err, ranks.call_options(debug=False, clamp=1.5), ("debug", "clamp"))
    except (MegaMoEInputError, RuntimeError) as e:
        return f"{type(e).__name__}: {e}"
    return None


def _options_on(rank: int, size: int) -> str | None:
    clamp = 0.75 if rank == size - 1 else 1.5  # the last rank's call differs
    try:
        ranks.agree(multirank.group(), None, ranks.call_options(debug=False, clamp=clamp), ("debug", "clamp"))
    except MegaMoEInputError as e:
        return str(e)
    return None


def test_spawn_returns_every_ranks_result_in_rank_order():
    assert multirank.spawn(_sum_of_ranks, 3, args=(10,)) == [(0, 3, 60), (1, 3, 60), (2, 3, 60)]


def test_spawn_returns_tensors_after_their_rank_has_exited():
    got = multirank.spawn(_tensors, 2)
    for r in range(2):
        assert torch.equal(got[r]["rank"], torch.full((3, 4), r))
        assert [t.tolist() for t in got[r]["sizes"]] == [list(range(2 + i)) for i in range(3)]


def _env(rank: int, size: int) -> dict:
    return {k: os.environ.get(k) for k in multirank.ENV}


def test_every_rank_starts_with_multicast_off_and_ranks_sharing_a_gpu_allowed():
    before = dict(os.environ)
    assert multirank.spawn(_env, 2) == [multirank.ENV] * 2
    assert dict(os.environ) == before  # the parent's environment is left as it was


def test_a_rank_that_raises_ends_the_run_with_an_error_naming_it_and_its_exception():
    with pytest.raises(multirank.RankFailed, match="rank 1 failed: ValueError: planted failure of rank 1") as e:
        multirank.spawn(_raises_on_rank_1, 2)
    assert e.value.rank == 1


def test_a_rank_that_dies_ends_the_run_with_an_error_naming_it_and_its_exit_code():
    # Rank 0's barrier fails too (the connection to rank 1 is reset): the dead rank is named first.
    with pytest.raises(multirank.RankFailed, match=r"^rank 1 died without a report \(exit code 3\)") as e:
        multirank.spawn(_exits_on_rank_1, 2)
    assert e.value.rank == 1


def test_a_rank_that_outlives_the_timeout_is_named():
    # Rank 0 sleeps far past the timeout; rank 1 returns at once, but on a loaded CI machine its
    # start (a process, torch's import, the rendezvous) alone can take longer than the timeout, so
    # it may be named too (CI once saw "ranks [0, 1]"): only rank 0 must be.
    with pytest.raises(multirank.RankFailed, match=r"ranks \[0(, 1)?\] did not finish within 8 s") as e:
        multirank.spawn(_hangs_on_rank_0, 2, timeout=8)
    assert e.value.rank == 0


def test_ranks_with_good_inputs_agree_to_launch():
    assert multirank.spawn(_refuse_on, 2, args=([],)) == [None, None]


def test_one_ranks_bad_input_is_refused_on_every_rank_before_a_launch():
    got = multirank.spawn(_refuse_on, 3, args=([1],))
    assert got[1] == "MegaMoEInputError: argument 'topk_idx': planted on rank 1"  # its own error
    for r in (0, 2):
        assert got[r] == (
            "MegaMoEInputError: rank 1 refused its call, so no rank launches: argument 'topk_idx': planted on rank 1"
        )


def test_when_several_ranks_refuse_the_others_name_the_first():
    got = multirank.spawn(_refuse_on, 3, args=([2, 1],))
    assert got[0].startswith("MegaMoEInputError: rank 1 refused its call")
    assert got[1].endswith("planted on rank 1") and got[2].endswith("planted on rank 2")


def test_a_rank_that_failed_otherwise_before_its_launch_is_named_with_its_error():
    got = multirank.spawn(_refuse_on, 2, args=([0], RuntimeError))
    assert got[0] == "RuntimeError: argument 'topk_idx': planted on rank 0"  # its own error
    assert got[1] == (
        "RuntimeError: rank 0 refused its call, so no rank launches: RuntimeError: argument 'topk_idx': "
        "planted on rank 0"
    )


def test_calls_whose_options_differ_between_ranks_are_refused_on_every_rank():
    got = multirank.spawn(_options_on, 3)
    want = "argument clamp: expected the same on every rank (rank 0 and rank 2 differ), got different calls"
    assert all(g is not None and g.startswith(want) for g in got), got


def _layer_args_on(rank: int, size: int) -> str | None:
    try:
        ranks.same_on_every_rank(multirank.group(), "MegaMoE(...)", "SM count", 132 - (rank == 1))
    except MegaMoEInputError as e:
        return str(e)
    return None


def test_a_layer_made_differently_on_one_rank_is_refused_on_every_rank():
    want = "argument 'MegaMoE(...)': expected the same SM count on every rank (rank 0: 132), got rank 1: 131"
    assert multirank.spawn(_layer_args_on, 2) == [want, want]


def test_one_rank_needs_no_group():
    assert ranks.rank_and_size(None) == (0, 1)
    assert ranks.host_group(None) is None
    ranks.same_on_every_rank(None, "MegaMoE(...)", "SM count", 132)
    ranks.agree(None, None, (1, 2))
    with pytest.raises(MegaMoEInputError, match="planted"):
        ranks.agree(None, MegaMoEInputError("planted"))
    buf, offsets = ranks.symmetric_zeros(64, torch.device("cpu"), None)
    assert offsets == [0] and buf.shape == (64,) and not buf.any()


def test_group_outside_a_spawned_rank_says_so():
    with pytest.raises(RuntimeError, match="not inside a rank"):
        multirank.group()


def _call_id_of_rank(rank: int, size: int) -> str:
    from megamoe.conformance.dump import new_call_id

    return ranks.from_rank0(ranks.host_group(multirank.group()), new_call_id())


def test_ranks_that_make_their_own_dumps_record_rank_0s_call_id():
    # What each rank of the fused layer does before it wraps its dump points (MegaMoE._dumps).
    ids = multirank.spawn(_call_id_of_rank, 2)
    assert ids[0] == ids[1] and len(ids[0]) == 32


def test_symmetric_memory_is_enabled_for_a_group_only_where_torch_still_needs_it():
    # Up to torch 2.8 a group needs enable_symm_mem_for_group before its rendezvous; later versions
    # deprecate it (a FutureWarning at every call, "no need to call this function anymore").
    import types

    from typing_extensions import deprecated

    called = []

    def enable(name):
        called.append(name)

    ranks.enable_symm_mem(types.SimpleNamespace(enable_symm_mem_for_group=enable), "g0")
    ranks.enable_symm_mem(types.SimpleNamespace(enable_symm_mem_for_group=deprecated("gone")(enable)), "g1")
    ranks.enable_symm_mem(types.SimpleNamespace(), "g2")
    assert called == ["g0"]
