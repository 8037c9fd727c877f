"""Routing generators: Mixtral softmax top-k, DeepSeek-V3 grouped sigmoid, test distributions."""

import pytest
import torch

from megamoe import reference as ref


def test_stable_topk_breaks_ties_to_the_lower_index():
    s = torch.tensor([[-1.0, -1, -1, -1, 0.5, 0.5, 0.5, -2]])
    vals, idx = ref.stable_topk(s, 4)
    assert idx.tolist() == [[4, 5, 6, 0]]


def test_softmax_topk_renormalizes():
    g = torch.Generator().manual_seed(0)
    r = ref.softmax_topk(ref.tie_free_logits(32, 16, generator=g), 4)
    assert torch.allclose(r.topk_weights.sum(-1), torch.ones(32))
    assert (r.topk_weights[:, :-1] >= r.topk_weights[:, 1:]).all()


def test_deepseek_v3_keeps_only_top_groups_and_masks_with_minus_inf():
    t, e, n_group, topk_group = 64, 32, 8, 2
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(t, e, generator=g)
    bias = -torch.ones(e) * 2  # negative choices: zero-fill would let masked groups win
    r = ref.deepseek_v3_topk(logits, bias, 4, n_group=n_group, topk_group=topk_group, routed_scaling_factor=2.5)
    choice = torch.sigmoid(logits) + bias
    group_score = torch.sort(choice.reshape(t, n_group, -1), dim=-1, descending=True).values[..., :2].sum(-1)
    kept = torch.sort(group_score, dim=-1, descending=True, stable=True).indices[:, :topk_group]
    groups_of_choice = r.topk_idx // (e // n_group)
    assert all(set(groups_of_choice[i].tolist()) <= set(kept[i].tolist()) for i in range(t))
    assert torch.allclose(r.topk_weights.sum(-1), torch.full((t,), 2.5))
    gathered = torch.sigmoid(logits).gather(1, r.topk_idx)  # weights come from the unbiased scores
    assert torch.allclose(r.topk_weights, 2.5 * gathered / gathered.sum(-1, keepdim=True))


@pytest.mark.parametrize("dist", ref.DISTRIBUTIONS)
def test_distributions_give_distinct_experts(dist):
    r = ref.make_routing(200, 16, 4, distribution=dist, seed=2)
    s = torch.sort(r.topk_idx, dim=1).values
    assert (s[:, 1:] != s[:, :-1]).all()
    if dist == "empty_experts":
        assert (r.topk_idx < 8).all()
    if dist == "one_hot":
        assert (r.topk_idx == 0).any(dim=1).float().mean() > 0.99


def test_masked_ratio_sets_minus_one_with_zero_weight():
    r = ref.make_routing(1000, 16, 4, masked_ratio=0.3, seed=3)
    masked = r.topk_idx == -1
    assert 0.25 < masked.float().mean() < 0.35
    assert (r.topk_weights[masked] == 0).all()


def test_tie_free_logits_have_no_ties():
    logits = ref.tie_free_logits(100, 64, generator=torch.Generator().manual_seed(4))
    s = torch.sort(logits, dim=1).values
    assert (s[:, 1:] > s[:, :-1]).all()
    assert torch.equal(logits.to(torch.bfloat16).float(), logits)


def test_the_routing_helpers_give_contiguous_tensors_the_layer_takes_as_they_are():
    logits = torch.randn(16, 8).to(torch.bfloat16)
    for r in (ref.gpt_oss_topk(logits, 4), ref.softmax_topk(logits, 4)):
        assert r.topk_idx.is_contiguous() and r.topk_weights.is_contiguous()
