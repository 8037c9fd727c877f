"""bench/ep.py on the CPU: its random operands are valid inputs of the layer (no NaN code or scale
byte, k distinct experts per token), and its torch baseline's dispatch and combine over a process
group (gloo here, NCCL on GPUs) deliver every slot to its expert's owner and every row back to its
token, so that the baseline computes the layer's sum (checked with an exact stand-in for the experts)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from bench.ep import TorchEP, cross_rank_bytes, fast_inputs, fast_weights, format_table, merge
from megamoe import multirank
from megamoe import reference as ref
from megamoe.reference.validate import check_rank_inputs, check_weights

H, E, K = 256, 6, 2


def test_the_random_operands_are_valid_layer_inputs():
    cfg = ref.MoEConfig(hidden=H, intermediate=128, num_experts=E, top_k=K, num_ranks=2, max_tokens_per_rank=64)
    check_weights(cfg, fast_weights(3, H, 128, seed=0, device="cpu"), 3)
    inp = fast_inputs(64, H, E, K, seed=1, device="cpu")
    check_rank_inputs(cfg, inp, 0)  # no NaN scale byte, no expert twice in a token
    assert not torch.isnan(inp.x.to(torch.float32)).any()
    assert torch.allclose(inp.topk_weights.sum(1), torch.ones(64))


def _stand_in(rank: int):
    # An exact expert: small dyadic values, so that every fp32 sum is exact in any order.
    def experts(x, x_sf, local_expert, weight):
        small = (x.view(torch.uint8) & 7).to(torch.float32) + x_sf[:, :1].to(torch.float32) % 2
        return (small * ((rank + 1) * (local_expert + 1) * weight)[:, None]).to(torch.bfloat16)

    return experts


def _dyadic_inputs(rank: int, tokens: int) -> ref.RankInputs:
    inp = fast_inputs(tokens, H, E, K, seed=rank, device="cpu")
    w = torch.tensor([0.25, 0.5])[
        torch.randint(0, 2, inp.topk_weights.shape, generator=torch.Generator().manual_seed(rank))
    ]
    idx = inp.topk_idx.clone()
    idx[::5, 1] = -1  # masked slots go nowhere
    return ref.RankInputs(inp.x, inp.x_sf, idx, w)


def _expected(rank: int, inp: ref.RankInputs, ranks: int) -> torch.Tensor:
    local = E // ranks
    y = torch.zeros(inp.x.shape[0], H)
    for k in range(K):
        e = inp.topk_idx[:, k]
        for t in (e >= 0).nonzero().flatten().tolist():
            owner, le = int(e[t]) // local, int(e[t]) % local
            row = _stand_in(owner)(
                inp.x[t : t + 1], inp.x_sf[t : t + 1], torch.tensor([le]), inp.topk_weights[t, k : k + 1]
            )
            y[t] += row[0].to(torch.float32)
    return y.to(torch.bfloat16)


def _ep_rank(rank: int, ranks: int, tokens: list[int]) -> bool:
    inp = _dyadic_inputs(rank, tokens[rank])
    layer = TorchEP(_stand_in(rank), multirank.group(), E)
    got = layer(inp.x, inp.x_sf, inp.topk_idx, inp.topk_weights)
    dist.barrier(group=multirank.group())
    return torch.equal(got.view(torch.int16), _expected(rank, inp, ranks).view(torch.int16))


def test_the_baseline_delivers_every_slot_to_its_owner_and_every_row_back_on_two_ranks():
    assert multirank.spawn(_ep_rank, 2, args=([40, 0],)) == [True, True]  # one rank without tokens


def test_the_baseline_delivers_every_slot_to_its_owner_and_every_row_back_on_three_ranks():
    assert multirank.spawn(_ep_rank, 3, args=([17, 33, 8],)) == [True, True, True]


def test_cross_rank_bytes_count_only_the_slots_a_peer_owns():
    idx = torch.tensor([[0, 3], [4, -1], [1, 2]])  # local 3 experts per rank: owners 0 1 / 1 - / 0 0
    row = H + H // 32 + 4 + 2 * H
    assert cross_rank_bytes(idx, 0, 3, H) == 2 * row
    assert cross_rank_bytes(idx, 1, 3, H) == 3 * row


def test_the_table_takes_the_slowest_rank_and_says_when_ranks_shared_a_gpu():
    per_rank = [
        [dict(shape="dsv3", tokens=8, fused_us=100.0, torch_us=None, torch_error=None, slots=64, cross_bytes=10**6)],
        [dict(shape="dsv3", tokens=8, fused_us=120.0, torch_us=None, torch_error=None, slots=64, cross_bytes=10**6)],
    ]
    (row,) = merge(per_rank, 2, 64, shared_gpu=True)
    assert row["fused_us"] == 120.0 and row["torch_us"] is None
    assert abs(row["xfer_gbps_per_gpu"] - 2e6 / 120e-6 / 2 / 1e9) < 1e-9
    lines = format_table([row]).splitlines()
    assert [c.strip() for c in lines[2].split("|")[1:5]] == ["dsv3", "2", "8", "120.0"], lines
    assert "time-sliced one GPU" in lines[-1]
    (ep8,) = merge([[dict(per_rank[0][0], fused_us=390.0)]] * 8, 8, 256, shared_gpu=False)
    assert ep8["published_us"] == 404.0 and "time-sliced" not in format_table([ep8])
