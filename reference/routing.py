"""Routing: the two routers the reference implements and the test distributions.

The kernel consumes precomputed `topk_idx` / `topk_weights` (SPEC §2); these generators only make
inputs. Ties are broken deterministically (value descending, lower expert index first) because
`torch.topk` gives no stable order on ties and differs between CPU and CUDA.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from .errors import FLOATING, check_int, check_tensor, check_type, fail


class Routing(NamedTuple):
    topk_idx: torch.Tensor  # int64 [T, K], -1 = no expert
    topk_weights: torch.Tensor  # fp32 [T, K]


def stable_topk(scores: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k by value descending, ties to the lower index (deterministic on every device), as
    contiguous tensors (the layer takes its routing contiguous; a slice of the sort is not)."""
    check_tensor("scores", scores, min_dim=1)
    check_int("k", k, 1, scores.shape[-1])  # torch would return fewer than k silently
    values, idx = torch.sort(scores, dim=-1, descending=True, stable=True)
    return values[..., :k].contiguous(), idx[..., :k].contiguous()


def softmax_topk(logits: torch.Tensor, k: int, *, renormalize: bool = True) -> Routing:
    """Mixtral: softmax over all experts in fp32, top-k, renormalised by the sum of the k."""
    check_tensor("logits", logits, FLOATING, min_dim=1)
    probs = torch.softmax(logits.to(torch.float32), dim=-1)
    weights, idx = stable_topk(probs, k)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return Routing(idx.to(torch.int64), weights.to(torch.float32))


def gpt_oss_topk(logits: torch.Tensor, k: int) -> Routing:
    """gpt-oss: the top k of the router logits, then a softmax over those k, computed in the
    logits' own dtype as gpt-oss's published models do (bf16 there), returned as fp32."""
    check_tensor("logits", logits, FLOATING, min_dim=1)
    values, idx = stable_topk(logits, k)
    return Routing(idx.to(torch.int64), torch.softmax(values, dim=-1).to(torch.float32))


def deepseek_v3_topk(
    logits: torch.Tensor,
    correction_bias: torch.Tensor,
    k: int,
    *,
    n_group: int,
    topk_group: int,
    routed_scaling_factor: float = 1.0,
    normalize: bool = True,
) -> Routing:
    """DeepSeek-V3 "noaux_tc": sigmoid scores, biased choice, top-2-sum group selection.

    Experts of groups not kept are masked with -inf (not 0: the bias can make choices negative),
    the weights are gathered from the *unbiased* sigmoid, normalised by their sum and multiplied
    by the scaling factor.
    """
    check_tensor("logits", logits, FLOATING, (None, None))
    t, e = logits.shape
    check_tensor("correction_bias", correction_bias, FLOATING, (e,), logits.device)
    check_int("n_group", n_group, 1)
    if e % n_group or e // n_group < 2:  # a group's score is the sum of its top 2
        fail("n_group", f"a divisor of the {e} experts into groups of at least 2", n_group)
    check_int("topk_group", topk_group, 1, n_group)
    check_int("k", k, 1, topk_group * (e // n_group))  # from the kept groups' experts
    scores = torch.sigmoid(logits.to(torch.float32))
    choice = scores + correction_bias.to(torch.float32)
    grouped = choice.reshape(t, n_group, e // n_group)
    group_scores = stable_topk(grouped, 2)[0].sum(dim=-1)
    _, kept = stable_topk(group_scores, topk_group)
    group_mask = torch.zeros(t, n_group, dtype=torch.bool, device=logits.device)
    group_mask.scatter_(1, kept, True)
    expert_mask = group_mask.repeat_interleave(e // n_group, dim=1)
    masked = choice.masked_fill(~expert_mask, float("-inf"))
    _, idx = stable_topk(masked, k)
    weights = scores.gather(1, idx)
    if normalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return Routing(idx.to(torch.int64), (weights * routed_scaling_factor).to(torch.float32))


def tie_free_logits(num_tokens: int, num_experts: int, *, generator: torch.Generator) -> torch.Tensor:
    """Logits with no ties: a random permutation of 0..E-1 per token, divided by 32 (exact in bf16)."""
    check_int("num_tokens", num_tokens, 0)
    check_int("num_experts", num_experts, 1)
    check_type("generator", generator, torch.Generator)
    perms = torch.argsort(torch.rand(num_tokens, num_experts, generator=generator), dim=-1)
    return perms.to(torch.float32) / 32.0


DISTRIBUTIONS = ("uniform", "skewed", "one_hot", "empty_experts")


def make_routing(
    num_tokens: int,
    num_experts: int,
    k: int,
    *,
    distribution: str = "uniform",
    masked_ratio: float = 0.0,
    seed: int = 0,
    device="cpu",
) -> Routing:
    """Test routings: k distinct experts per token drawn from a named distribution.

    uniform        every expert equally likely
    skewed         Zipf-like, p(e) ∝ 1/(e+1)^1.2: a few hot experts, a long tail
    one_hot        expert 0 is in (almost) every token
    empty_experts  the upper half of the experts is never chosen (needs k <= E/2)
    masked_ratio   this fraction of all slots becomes -1 (no expert); their weights are 0
    The weights are a softmax over k random logits (positive, summing to 1 before masking).
    """
    check_int("num_tokens", num_tokens, 0)
    check_int("num_experts", num_experts, 1)
    check_int("k", k, 1, num_experts)
    check_int("seed", seed, minimum=None)
    if distribution not in DISTRIBUTIONS:
        fail("distribution", f"one of {DISTRIBUTIONS}", repr(distribution))
    # a ratio of 2 or -1 would silently mean "all" or "none"
    if isinstance(masked_ratio, bool) or not isinstance(masked_ratio, (int, float)) or not 0.0 <= masked_ratio <= 1.0:
        fail("masked_ratio", "a fraction in [0, 1]", masked_ratio)
    g = torch.Generator().manual_seed(seed)
    p = torch.ones(num_experts)
    if distribution == "skewed":
        p = 1.0 / (torch.arange(num_experts, dtype=torch.float32) + 1) ** 1.2
    elif distribution == "one_hot":
        p[0] = 1e6
    elif distribution == "empty_experts":
        p[num_experts // 2 :] = 0
        if k > num_experts // 2:
            fail("top_k", f"at most E/2 = {num_experts // 2} for the distribution 'empty_experts'", k)
    if num_tokens == 0:
        idx = torch.zeros(0, k, dtype=torch.int64)
    else:
        idx = torch.multinomial(p.expand(num_tokens, num_experts), k, replacement=False, generator=g)
    weights = torch.softmax(torch.randn(num_tokens, k, generator=g), dim=-1)
    if masked_ratio > 0:
        mask = torch.rand(num_tokens, k, generator=g) < masked_ratio
        idx = idx.masked_fill(mask, -1)
        weights = weights.masked_fill(mask, 0.0)
    return Routing(idx.to(torch.int64).to(device), weights.to(torch.float32).to(device))
