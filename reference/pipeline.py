"""The whole layer as one call: y for every rank plus every expected dump point D1-D10.

Dump names are "<point>.<tensor>" (for example "D6.l2_acts"); the stage functions they come from
are importable one by one, so a checker can recompute any stage from the dumped stage before it.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .cleanup import updated_recv_stats
from .combine import combine
from .config import MoEConfig
from .dispatch import build_pool, receive_counts, send_counts, source_lists
from .inputs import RankInputs
from .l1 import l1_gemm
from .l2 import empty_combine_buffer, l2_epilogue, l2_gemm
from .swiglu import l1_done, l1_epilogue
from .validate import check_call
from .weights import ExpertWeights


@dataclass
class ReferenceResult:
    y: list[torch.Tensor]  # bf16 [T_s, H] per rank
    dumps: list[dict[str, torch.Tensor]]  # per rank, named dump tensors
    activations: list[torch.Tensor] = field(default_factory=list)  # fp32 a before requant, per rank


def run_reference(cfg: MoEConfig, inputs: list[RankInputs], weights: ExpertWeights,
                  recv_stats: list[torch.Tensor] | None = None) -> ReferenceResult:
    """Run every stage for all R ranks. `weights` holds all E experts (canonical layout);
    rank r uses experts [r·E_l, (r+1)·E_l). `recv_stats` are the cumulative statistics before
    the call (per rank, int64 [E_l]); None starts them at zero."""
    check_call(cfg, inputs, weights)
    r, e_l = cfg.num_ranks, cfg.local_experts
    device = inputs[0].x.device
    d1 = torch.stack([send_counts(inp.topk_idx, cfg.num_experts) for inp in inputs])
    all_idx = [inp.topk_idx for inp in inputs]
    combine_buffers = [empty_combine_buffer(cfg.top_k, cfg.max_tokens_per_rank, cfg.hidden, device)
                       for _ in range(r)]
    dumps: list[dict[str, torch.Tensor]] = [{} for _ in range(r)]
    activations = []
    for rank in range(r):
        local = weights.slice(rank * e_l, (rank + 1) * e_l)
        counts, totals = receive_counts(d1, rank, cfg)
        pool = build_pool(inputs, rank, cfg)
        acc1 = l1_gemm(pool, local)
        l1 = l1_epilogue(acc1, pool.weights, pool.valid, activation_clamp=cfg.activation_clamp,
                         fast_math=cfg.fast_math)
        acc2 = l2_gemm(l1.l2_acts, l1.l2_sf, pool, local)
        l2_epilogue(acc2, pool.meta, combine_buffers)
        before = None if recv_stats is None else recv_stats[rank]
        activations.append(l1.activation)
        dumps[rank].update({
            "D1.send_counts": d1[rank],
            "D2.recv_counts": counts,
            "D2.recv_totals": totals,
            "D3.source_lists": source_lists(all_idx, rank, cfg),
            "D4.pool_x": pool.x,
            "D4.pool_x_sf": pool.x_sf,
            "D4.pool_weights": pool.weights,
            "D4.pool_meta": pool.meta,
            "D4.expert_offsets": pool.expert_offsets,
            "D4.block_arrivals": pool.block_arrivals,
            "D5.acc1": acc1,
            "D6.l2_acts": l1.l2_acts,
            "D6.l2_sf": l1.l2_sf,
            "D6.l1_done": l1_done(pool.block_arrivals, cfg.intermediate),
            "D7.acc2": acc2,
            "D10.recv_stats": updated_recv_stats(before, totals),
        })
    ys = []
    for rank, inp in enumerate(inputs):
        y = combine(combine_buffers[rank], inp.topk_idx)
        dumps[rank]["D8.combine"] = combine_buffers[rank]
        dumps[rank]["D9.y"] = y
        ys.append(y)
    return ReferenceResult(ys, dumps, activations)
