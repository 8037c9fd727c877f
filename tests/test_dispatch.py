"""Stages dispatch (D1-D3) and pool (D4) for several ranks in one process."""

import torch

from megamoe import reference as ref

CFG = ref.MoEConfig(
    hidden=256, intermediate=128, num_experts=8, top_k=3, num_ranks=4, max_tokens_per_rank=40, block_m=16
)


def _inputs(seed=0):
    return ref.make_inputs(CFG, [40, 0, 17, 33], seed=seed, distribution="skewed", masked_ratio=0.2)


def test_counts_agree_across_d1_d2_d3():
    inputs = _inputs()
    d1 = torch.stack([ref.send_counts(i.topk_idx, CFG.num_experts) for i in inputs])
    total_valid = sum(int((i.topk_idx >= 0).sum()) for i in inputs)
    assert int(d1.sum()) == total_valid
    for rank in range(CFG.num_ranks):
        counts, totals = ref.receive_counts(d1, rank, CFG)
        lists = ref.source_lists([i.topk_idx for i in inputs], rank, CFG)
        assert torch.equal((lists >= 0).sum(-1).T.to(torch.int32), counts)
        assert torch.equal(counts.sum(0), totals)
        for le in range(CFG.local_experts):
            for s, inp in enumerate(inputs):
                pairs = lists[le, s][lists[le, s] >= 0]
                t, k = pairs // CFG.top_k, pairs % CFG.top_k
                assert (inp.topk_idx[t.long(), k.long()] == rank * CFG.local_experts + le).all()


def test_pool_rows_are_byte_copies_in_an_aligned_expert_major_layout():
    inputs = _inputs(1)
    for rank in range(CFG.num_ranks):
        pool = ref.build_pool(inputs, rank, CFG)
        offs = pool.expert_offsets.tolist()
        assert all(o % CFG.block_m == 0 for o in offs) and offs[-1] == pool.num_rows
        for le in range(CFG.local_experts):
            rows = pool.expert_rows(le)
            meta = pool.meta[rows]
            valid = meta[:, 0] >= 0
            n = int(valid.sum())
            assert valid[:n].all() and not valid[n:].any()  # valid rows first, then padding
            assert offs[le + 1] - offs[le] == ref.align_up(n, CFG.block_m)
            for row, (s, t, k) in zip(range(offs[le], offs[le] + n), meta[:n].tolist()):
                inp = inputs[s]
                assert inp.topk_idx[t, k] == rank * CFG.local_experts + le
                assert torch.equal(pool.x[row], ref.as_codes(inp.x)[t])
                assert torch.equal(pool.x_sf[row], inp.x_sf[t])
                assert pool.weights[row].view(torch.int32) == inp.topk_weights[t, k].view(torch.int32)
        assert torch.equal(pool.block_arrivals, pool.valid.reshape(-1, CFG.block_m).sum(1).int())
