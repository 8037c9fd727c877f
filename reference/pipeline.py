"""The whole layer as one call: y for every rank plus every expected dump point D1-D10.

Dump names are "<point>.<tensor>" (for example "D6.l2_acts"). Every stage reads its input from
the dump entries of the stages before it, exactly as a stage checker does with a kernel dump; a
`tamper` hook may change a stage's entries after it ran (the conformance suite plants its faults
this way), and the later stages then work on the changed values, like a kernel with one broken
stage.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Protocol

import torch

from .cleanup import updated_recv_stats
from .combine import combine
from .config import MoEConfig
from .dispatch import Pool, build_pool, receive_counts, region_valid, send_counts, source_lists
from .inputs import RankInputs
from .l1 import l1_gemm
from .l2 import empty_combine_buffer, l2_epilogue, l2_gemm
from .swiglu import l1_done, l1_epilogue
from .validate import check_call
from .weights import ExpertWeights

POINTS = ("D1", "D2", "D3", "D4", "D5", "D6", "D7", "D8", "D9", "D10")


@dataclass
class StageContext:
    """What a tamper hook can see besides the dump: the call and this rank's local weights."""

    cfg: MoEConfig
    inputs: list[RankInputs]
    weights: ExpertWeights  # local experts of `rank`
    rank: int


class Tamper(Protocol):
    def __call__(self, point: str, dump: dict[str, torch.Tensor], ctx: StageContext) -> None: ...


@dataclass
class ReferenceResult:
    y: list[torch.Tensor]  # bf16 [T_s, H] per rank
    dumps: list[dict[str, torch.Tensor]]  # per rank, named dump tensors
    activations: list[torch.Tensor] = field(default_factory=list)  # fp32 a before requant, per rank


def valid_rows(dump: dict[str, torch.Tensor]) -> torch.Tensor:
    """The pool rows that hold tokens, by the layout contract (D4 offsets, D2 totals)."""
    return region_valid(dump["D4.expert_offsets"], dump["D2.recv_totals"], dump["D4.pool_x"].shape[0])


def run_reference(
    cfg: MoEConfig,
    inputs: list[RankInputs],
    weights: ExpertWeights,
    recv_stats: list[torch.Tensor] | None = None,
    tamper: Tamper | Callable | None = None,
) -> ReferenceResult:
    """Run every stage for all R ranks. `weights` holds all E experts (canonical layout);
    rank r uses experts [r·E_l, (r+1)·E_l). `recv_stats` are the cumulative statistics before
    the call (per rank, int64 [E_l]); None starts them at zero."""
    check_call(cfg, inputs, weights)
    r, e_l = cfg.num_ranks, cfg.local_experts
    device = inputs[0].x.device
    dumps: list[dict[str, torch.Tensor]] = [{} for _ in range(r)]
    ctxs = [StageContext(cfg, inputs, weights.slice(s * e_l, (s + 1) * e_l), s) for s in range(r)]

    def stage(point: str, rank: int, values: dict[str, torch.Tensor]) -> None:
        dumps[rank].update(values)
        if tamper is not None:
            tamper(point, dumps[rank], ctxs[rank])

    # dispatch: every rank counts its own slots (D1), then each owner reads all counts (D2)
    for rank, inp in enumerate(inputs):
        stage("D1", rank, {"D1.send_counts": send_counts(inp.topk_idx, cfg.num_experts)})
    all_d1 = torch.stack([d["D1.send_counts"] for d in dumps])
    all_idx = [inp.topk_idx for inp in inputs]
    activations = []
    for rank in range(r):
        counts, totals = receive_counts(all_d1, rank, cfg)
        stage("D2", rank, {"D2.recv_counts": counts, "D2.recv_totals": totals})
        stage("D3", rank, {"D3.source_lists": source_lists(all_idx, rank, cfg)})
        stage("D4", rank, build_pool(inputs, rank, cfg).to_dump())
        d, local = dumps[rank], ctxs[rank].weights
        pool, valid = Pool.from_dump(d), valid_rows(d)
        stage("D5", rank, {"D5.acc1": l1_gemm(pool, local, valid)})
        l1 = l1_epilogue(
            d["D5.acc1"], d["D4.pool_weights"], valid, activation_clamp=cfg.activation_clamp, fast_math=cfg.fast_math
        )
        activations.append(l1.activation)
        stage(
            "D6",
            rank,
            {
                "D6.l2_acts": l1.l2_acts,
                "D6.l2_sf": l1.l2_sf,
                "D6.l1_done": l1_done(d["D4.block_arrivals"], cfg.intermediate),
            },
        )
        stage("D7", rank, {"D7.acc2": l2_gemm(d["D6.l2_acts"], d["D6.l2_sf"], pool, local, valid)})
    # L2 epilogue: every owner writes into the combine buffers of the source ranks
    buffers = [empty_combine_buffer(cfg.top_k, cfg.max_tokens_per_rank, cfg.hidden, device) for _ in range(r)]
    for d in dumps:
        l2_epilogue(d["D7.acc2"], d["D4.pool_meta"], valid_rows(d), buffers)
    for rank in range(r):
        stage("D8", rank, {"D8.combine": buffers[rank]})
    ys = []
    for rank, inp in enumerate(inputs):
        stage("D9", rank, {"D9.y": combine(dumps[rank]["D8.combine"], inp.topk_idx)})
        ys.append(dumps[rank]["D9.y"])
        before = None if recv_stats is None else recv_stats[rank]
        stage(
            "D10",
            rank,
            {
                "D10.recv_stats": updated_recv_stats(before, dumps[rank]["D2.recv_totals"]),
                "D10.counters": torch.zeros(0, dtype=torch.int32, device=device),
            },
        )
    return ReferenceResult(ys, dumps, activations)
