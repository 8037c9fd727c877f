"""The whole layer as one call: y for every rank plus every expected dump point D1-D10.

Dump names are "<point>.<tensor>" (for example "D6.l2_acts"); the dump-point table
(megamoe.reference.points) defines every one, and this file names them through it (P.D6_L2_ACTS).
Every stage reads its input from the dump entries of the stages before it, exactly as a stage
checker does with a kernel dump; a `tamper` hook may change a stage's entries after it ran (the
conformance suite plants its faults this way), and the later stages then work on the changed
values, like a kernel with one broken stage.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Callable, Protocol

import torch

from .cleanup import updated_recv_stats
from .combine import combine
from .config import MoEConfig
from .dispatch import Pool, build_pool, receive_counts, region_valid, send_counts, source_lists
from .errors import check_list, check_tensor, check_type, fail
from .inputs import RankInputs
from .l1 import l1_gemm
from .l2 import empty_combine_buffer, l2_epilogue, l2_gemm
from . import points as P
from .swiglu import bias_rows, l1_done, l1_epilogue
from .validate import check_call
from .weights import ExpertWeights

POINTS = P.POINTS  # D1-D10, in pipeline order: the table's


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
    needed = (P.D4_EXPERT_OFFSETS, P.D2_RECV_TOTALS, P.D4_POOL_X)
    if not isinstance(dump, Mapping):
        fail("dump", "a dict of dump tensors (Dump.tensors)", type(dump).__name__)
    missing = [n for n in needed if n not in dump]
    if missing:
        fail("dump", f"the tensors {', '.join(needed)}", f"none named {', '.join(missing)}")
    check_tensor(P.D4_POOL_X, dump[P.D4_POOL_X], min_dim=1)
    return region_valid(dump[P.D4_EXPERT_OFFSETS], dump[P.D2_RECV_TOTALS], dump[P.D4_POOL_X].shape[0])


def activation_args(cfg: MoEConfig, dump: dict, b1: torch.Tensor | None) -> dict:
    """l1_epilogue's activation keywords for a layer `cfg`: its clamp and SiLU table, and for
    "swiglu_oai" (SPEC §8) its limit and each pool row's b1 (from the dump's D4 expert offsets)."""
    check_type("cfg", cfg, MoEConfig)
    if not isinstance(dump, Mapping):
        fail("dump", "a dict of dump tensors (Dump.tensors)", type(dump).__name__)
    args = dict(activation_clamp=cfg.activation_clamp, fast_math=cfg.fast_math, activation=cfg.activation)
    if cfg.activation == "swiglu_oai":
        args["limit"] = cfg.limit
        if b1 is not None:
            args["b1"] = bias_rows(b1, dump[P.D4_EXPERT_OFFSETS], dump[P.D5_ACC1].shape[0])
    return args


def l2_bias_args(cfg: MoEConfig, dump: dict, b2: torch.Tensor | None) -> dict:
    """l2_epilogue's bias keywords for a layer `cfg` (SPEC §8 D8): for "swiglu_oai" with b2, each
    pool row's b2 and routing weight; else none (§3 D8 has no bias)."""
    check_type("cfg", cfg, MoEConfig)
    if not isinstance(dump, Mapping):
        fail("dump", "a dict of dump tensors (Dump.tensors)", type(dump).__name__)
    if b2 is None or cfg.activation != "swiglu_oai":
        return {}
    rows = dump[P.D7_ACC2].shape[0]
    return dict(b2=bias_rows(b2, dump[P.D4_EXPERT_OFFSETS], rows), route_weights=dump[P.D4_POOL_WEIGHTS])


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
    if recv_stats is not None:
        check_list("recv_stats", recv_stats, r, f"{r} int64 [E_l] tensors, one per rank")
        for s, stats in enumerate(recv_stats):
            check_tensor(f"recv_stats[{s}]", stats, torch.int64, (e_l,), device)
    if tamper is not None and not callable(tamper):
        fail("tamper", "None or a callable (point, dump, ctx)", type(tamper).__name__)
    dumps: list[dict[str, torch.Tensor]] = [{} for _ in range(r)]
    ctxs = [StageContext(cfg, inputs, weights.slice(s * e_l, (s + 1) * e_l), s) for s in range(r)]

    def stage(point: str, rank: int, values: dict[str, torch.Tensor]) -> None:
        dumps[rank].update(values)
        if tamper is not None:
            tamper(point, dumps[rank], ctxs[rank])

    # dispatch: every rank counts its own slots (D1), then each owner reads all counts (D2)
    for rank, inp in enumerate(inputs):
        stage(P.D1, rank, {P.D1_SEND_COUNTS: send_counts(inp.topk_idx, cfg.num_experts)})
    all_d1 = torch.stack([d[P.D1_SEND_COUNTS] for d in dumps])
    all_idx = [inp.topk_idx for inp in inputs]
    activations = []
    for rank in range(r):
        counts, totals = receive_counts(all_d1, rank, cfg)
        stage(P.D2, rank, {P.D2_RECV_COUNTS: counts, P.D2_RECV_TOTALS: totals})
        stage(P.D3, rank, {P.D3_SOURCE_LISTS: source_lists(all_idx, rank, cfg)})
        stage(P.D4, rank, build_pool(inputs, rank, cfg).to_dump())
        d, local = dumps[rank], ctxs[rank].weights
        pool, valid = Pool.from_dump(d), valid_rows(d)
        stage(P.D5, rank, {P.D5_ACC1: l1_gemm(pool, local, valid)})
        l1 = l1_epilogue(d[P.D5_ACC1], d[P.D4_POOL_WEIGHTS], valid, **activation_args(cfg, d, local.b1))
        activations.append(l1.activation)
        stage(
            P.D6,
            rank,
            {
                P.D6_L2_ACTS: l1.l2_acts,
                P.D6_L2_SF: l1.l2_sf,
                P.D6_L1_DONE: l1_done(d[P.D4_BLOCK_ARRIVALS], cfg.intermediate),
            },
        )
        stage(P.D7, rank, {P.D7_ACC2: l2_gemm(d[P.D6_L2_ACTS], d[P.D6_L2_SF], pool, local, valid)})
    # L2 epilogue: every owner writes into the combine buffers of the source ranks
    buffers = [empty_combine_buffer(cfg.top_k, cfg.max_tokens_per_rank, cfg.hidden, device) for _ in range(r)]
    for d, ctx in zip(dumps, ctxs):
        l2_epilogue(d[P.D7_ACC2], d[P.D4_POOL_META], valid_rows(d), buffers, **l2_bias_args(cfg, d, ctx.weights.b2))
    for rank in range(r):
        stage(P.D8, rank, {P.D8_COMBINE: buffers[rank]})
    ys = []
    for rank, inp in enumerate(inputs):
        stage(P.D9, rank, {P.D9_Y: combine(dumps[rank][P.D8_COMBINE], inp.topk_idx)})
        ys.append(dumps[rank][P.D9_Y])
        before = None if recv_stats is None else recv_stats[rank]
        stage(
            P.D10,
            rank,
            {
                P.D10_RECV_STATS: updated_recv_stats(before, dumps[rank][P.D2_RECV_TOTALS]),
                P.D10_COUNTERS: torch.zeros(0, dtype=torch.int32, device=device),
            },
        )
    return ReferenceResult(ys, dumps, activations)
