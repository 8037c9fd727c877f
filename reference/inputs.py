"""The per-rank inputs of one call (SPEC §2) and a generator of test inputs."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .config import MoEConfig
from .errors import check_int, check_list, check_type
from .quantize import quantize_activations
from .routing import make_routing
from . import formats as F


@dataclass
class RankInputs:
    x: torch.Tensor  # float8_e4m3fn [T, H]
    x_sf: torch.Tensor  # uint8 UE8M0 [T, H/32]
    topk_idx: torch.Tensor  # int64 [T, K], -1 = no expert
    topk_weights: torch.Tensor  # fp32 [T, K]

    @property
    def num_tokens(self) -> int:
        return self.x.shape[0]

    def to(self, device) -> "RankInputs":
        return RankInputs(*(t.to(device) for t in (self.x, self.x_sf, self.topk_idx, self.topk_weights)))


def make_inputs(
    cfg: MoEConfig,
    tokens_per_rank: int | list[int] | None = None,
    *,
    seed: int = 0,
    distribution: str = "uniform",
    masked_ratio: float = 0.0,
    device="cpu",
) -> list[RankInputs]:
    """Random activations N(0, 1), quantized per 32, and a test routing, for every rank:
    `tokens_per_rank` tokens (T; default T_max), one int for every rank or a list of R."""
    check_type("cfg", cfg, MoEConfig)
    check_int("seed", seed, minimum=None)
    if tokens_per_rank is None:
        tokens_per_rank = cfg.max_tokens_per_rank
    if isinstance(tokens_per_rank, int) and not isinstance(tokens_per_rank, bool):
        tokens_per_rank = [tokens_per_rank] * cfg.num_ranks
    check_list("tokens_per_rank", tokens_per_rank, cfg.num_ranks, f"{cfg.num_ranks} token counts, one per rank")
    for t in tokens_per_rank:
        check_int("tokens_per_rank", t, 0, cfg.max_tokens_per_rank)  # SPEC §7: T <= T_max
    out = []
    for rank, t in enumerate(tokens_per_rank):
        # The draws are the CPU generator's, so the numbers are the same on every device; the
        # quantizer is the reference's (device-agnostic, bit-identical everywhere) and runs where
        # the inputs are asked for. The routing is generated on the CPU whole (make_routing): its
        # softmax is not bit-reproducible across devices.
        g = torch.Generator().manual_seed(seed * 1000 + rank)
        q = quantize_activations(torch.randn(t, cfg.hidden, generator=g).to(device))
        routing = make_routing(
            t,
            cfg.num_experts,
            cfg.top_k,
            distribution=distribution,
            masked_ratio=masked_ratio,
            seed=seed * 1000 + rank,
            device=device,
        )
        out.append(RankInputs(F.as_float8(q.codes), q.scales, *routing))
    return out


def split_global_batch(inputs: RankInputs, num_ranks: int) -> list[RankInputs]:
    """Split one batch of tokens over ranks in contiguous, as-equal-as-possible slices."""
    check_type("inputs", inputs, RankInputs)
    check_int("num_ranks", num_ranks, 1)
    t = inputs.num_tokens
    bounds = [t * r // num_ranks for r in range(num_ranks + 1)]
    return [
        RankInputs(inputs.x[a:b], inputs.x_sf[a:b], inputs.topk_idx[a:b], inputs.topk_weights[a:b])
        for a, b in zip(bounds[:-1], bounds[1:])
    ]
