"""Stage "dispatch" (D1-D3) and stage "pool" (D4) of SPEC §3, for R ranks in one process.

D1  send_counts[e]            tokens-topk pairs of this rank routed to global expert e
D2  recv_counts[s][e_l]       pairs from source rank s to local expert e_l; recv_totals[e_l] = N_e
D3  source_lists[e_l][s][:]   the set {t·K + k} of those pairs, ascending, padded with -1
D4  the pool                  local experts expert-major, each starting on a BLOCK_M-aligned row

The reference pool order inside an expert is deterministic: source rank ascending, then t·K + k
ascending. A kernel may fill rows in any order; the checker maps rows back through `meta`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .config import MoEConfig
from .errors import INTEGER, check_int, check_list, check_tensor, check_type, fail
from .inputs import RankInputs
from . import formats as F
from . import points as P
from .validate import check_all_inputs, check_expert_ids


def send_counts(topk_idx: torch.Tensor, num_experts: int) -> torch.Tensor:
    """D1: int32 [E]."""
    check_int("num_experts", num_experts, 1)
    check_tensor("topk_idx", topk_idx, torch.int64, (None, None))
    check_expert_ids("topk_idx", topk_idx, num_experts)  # an id >= E would lengthen the counts
    valid = topk_idx[topk_idx >= 0]
    return torch.bincount(valid.flatten(), minlength=num_experts).to(torch.int32)


def receive_counts(all_send_counts: torch.Tensor, rank: int, cfg: MoEConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """D2: from the stacked D1 of every rank ([R, E]) -> (recv_counts [R, E_l], recv_totals [E_l])."""
    _check_rank(rank, cfg)
    check_tensor("all_send_counts", all_send_counts, INTEGER, (cfg.num_ranks, cfg.num_experts))
    e_l = cfg.local_experts
    counts = all_send_counts[:, rank * e_l : (rank + 1) * e_l].to(torch.int32).contiguous()
    return counts, counts.sum(dim=0).to(torch.int32)


def _check_rank(rank: int, cfg: MoEConfig) -> None:
    check_type("cfg", cfg, MoEConfig)
    check_int("rank", rank, 0, cfg.num_ranks - 1)


def _pairs(topk_idx: torch.Tensor, expert: int) -> torch.Tensor:
    """t·K + k of the slots routed to `expert`, ascending."""
    k = topk_idx.shape[1]
    t, slot = (topk_idx == expert).nonzero(as_tuple=True)
    return t * k + slot


def source_lists(all_topk_idx: list[torch.Tensor], rank: int, cfg: MoEConfig) -> torch.Tensor:
    """D3: int32 [E_l, R, T_max]: for each (local expert, source rank) the t·K+k list, -1 padded.

    A token holds an expert at most once, so one list never exceeds T_max entries.
    """
    _check_rank(rank, cfg)
    check_list("all_topk_idx", all_topk_idx, cfg.num_ranks, f"{cfg.num_ranks} topk_idx tensors, one per rank")
    device = None
    for s, idx in enumerate(all_topk_idx):
        check_tensor(f"all_topk_idx[{s}]", idx, torch.int64, (None, cfg.top_k), device)
        if idx.shape[0] > cfg.max_tokens_per_rank:  # a list holds at most T_max entries
            fail(f"all_topk_idx[{s}]", f"at most T_max = {cfg.max_tokens_per_rank} tokens", idx.shape[0])
        check_expert_ids(f"all_topk_idx[{s}]", idx, cfg.num_experts)
        device = idx.device
    e_l = cfg.local_experts
    out = torch.full((e_l, cfg.num_ranks, cfg.max_tokens_per_rank), -1, dtype=torch.int32, device=device)
    for le in range(e_l):
        for s, idx in enumerate(all_topk_idx):
            pairs = _pairs(idx, rank * e_l + le)
            out[le, s, : pairs.numel()] = pairs.to(torch.int32)
    return out


@dataclass
class Pool:
    """D4: the receiving rank's token pool. Padding rows are zero with meta = -1."""

    x: torch.Tensor  # uint8 E4M3 codes [P, H]
    x_sf: torch.Tensor  # uint8 UE8M0 [P, H/32]
    weights: torch.Tensor  # fp32 [P], bit copy of topk_weights_s[t, k]
    meta: torch.Tensor  # int32 [P, 3]: (source rank s, token t, slot k); -1 on padding rows
    expert_offsets: torch.Tensor  # int32 [E_l + 1]: first row of each local expert, then P
    block_arrivals: torch.Tensor  # int32 [P / BLOCK_M]: valid rows per pool block

    @property
    def valid(self) -> torch.Tensor:
        """Rows holding a pulled token (the reference writes meta = -1 on padding rows)."""
        return self.meta[:, 0] >= 0

    @classmethod
    def from_dump(cls, dump: dict) -> "Pool":
        return cls(
            dump[P.D4_POOL_X],
            dump[P.D4_POOL_X_SF],
            dump[P.D4_POOL_WEIGHTS],
            dump[P.D4_POOL_META],
            dump[P.D4_EXPERT_OFFSETS],
            dump[P.D4_BLOCK_ARRIVALS],
        )

    def to_dump(self) -> dict:
        return {
            P.D4_POOL_X: self.x,
            P.D4_POOL_X_SF: self.x_sf,
            P.D4_POOL_WEIGHTS: self.weights,
            P.D4_POOL_META: self.meta,
            P.D4_EXPERT_OFFSETS: self.expert_offsets,
            P.D4_BLOCK_ARRIVALS: self.block_arrivals,
        }

    @property
    def num_rows(self) -> int:
        return self.x.shape[0]

    def expert_rows(self, local_expert: int) -> slice:
        return slice(int(self.expert_offsets[local_expert]), int(self.expert_offsets[local_expert + 1]))


def check_pool(pool: Pool, arg: str = "pool") -> None:
    """A Pool's tensors (D4), as the stages after it read them; `arg`: the caller's name for it."""
    check_type(arg, pool, Pool)
    x = F.as_codes(pool.x, f"{arg}.x")
    check_tensor(f"{arg}.x", x, shape=(None, None))
    p, h, device = *x.shape, x.device
    check_tensor(f"{arg}.x_sf", pool.x_sf, torch.uint8, (p, h // 32), device)
    check_tensor(f"{arg}.weights", pool.weights, torch.float32, (p,), device)
    check_tensor(f"{arg}.meta", pool.meta, torch.int32, (p, 3), device)
    check_tensor(f"{arg}.expert_offsets", pool.expert_offsets, INTEGER, (None,), device)
    if pool.expert_offsets.numel() < 2:
        fail(f"{arg}.expert_offsets", "E_l + 1 >= 2 row offsets", list(pool.expert_offsets.shape))


def region_valid(expert_offsets: torch.Tensor, recv_totals: torch.Tensor, num_rows: int) -> torch.Tensor:
    """bool [P]: the valid pool rows by the layout contract — the first N_e rows of expert e's
    region. This is what a checker uses for a kernel dump, whose padding metadata is unspecified."""
    check_tensor("recv_totals", recv_totals, INTEGER, (None,))
    e_l = recv_totals.numel()
    check_tensor("expert_offsets", expert_offsets, INTEGER, (e_l + 1,), recv_totals.device)
    if not e_l:
        fail("recv_totals", "one count per local expert (at least one)", "an empty tensor")
    check_int("num_rows", num_rows, 0)
    row = torch.arange(num_rows, device=expert_offsets.device)
    expert = torch.bucketize(row, expert_offsets[1:].to(torch.int64), right=True)
    expert = expert.clamp(max=recv_totals.numel() - 1)
    start = expert_offsets[:-1].to(torch.int64)[expert]
    return (row - start) < recv_totals.to(torch.int64)[expert]


def align_up(n: int, block: int) -> int:
    """n rounded up to a multiple of block."""
    check_int("n", n, 0)
    check_int("block", block, 1)
    return (n + block - 1) // block * block


def pool_offsets(counts: list[int], block_m: int, device="cpu") -> torch.Tensor:
    """int32 [E_l + 1]: each local expert's first pool row (expert-major, BLOCK_M-aligned), then P."""
    check_int("block_m", block_m, 1)
    if isinstance(counts, torch.Tensor):
        check_tensor("counts", counts, INTEGER, (None,))
        counts = counts.tolist()
    check_list("counts", counts, None, "row counts, one per local expert")
    for n in counts:
        check_int("counts", n, 0)
    offsets = [0]
    for n in counts:
        offsets.append(offsets[-1] + align_up(n, block_m))
    return torch.tensor(offsets, dtype=torch.int32, device=device)


def build_pool(all_inputs: list[RankInputs], rank: int, cfg: MoEConfig) -> Pool:
    """D4: pull every (s, t, k) routed to this rank's experts into the expert-major pool."""
    _check_rank(rank, cfg)
    device = check_all_inputs(cfg, all_inputs, "all_inputs")
    e_l, bm = cfg.local_experts, cfg.block_m
    per_expert = []  # list over local experts of (s, t, k) int64 [n, 3]
    for le in range(e_l):
        expert = rank * e_l + le
        rows = []
        for s, inp in enumerate(all_inputs):
            t, k = (inp.topk_idx == expert).nonzero(as_tuple=True)
            rows.append(torch.stack([torch.full_like(t, s), t, k], dim=1))
        per_expert.append(torch.cat(rows) if rows else torch.zeros(0, 3, dtype=torch.int64, device=device))
    offsets = pool_offsets([r.shape[0] for r in per_expert], bm, device)
    p, h = int(offsets[-1]), cfg.hidden
    pool = Pool(
        x=torch.zeros(p, h, dtype=torch.uint8, device=device),
        x_sf=torch.zeros(p, h // 32, dtype=torch.uint8, device=device),
        weights=torch.zeros(p, dtype=torch.float32, device=device),
        meta=torch.full((p, 3), -1, dtype=torch.int32, device=device),
        expert_offsets=offsets,
        block_arrivals=torch.zeros(p // bm, dtype=torch.int32, device=device),
    )
    for le, rows in enumerate(per_expert):
        start = int(offsets[le])
        for s, inp in enumerate(all_inputs):
            sel = rows[rows[:, 0] == s]
            if sel.numel() == 0:
                continue
            dst = start + torch.arange(sel.shape[0], device=device)
            start += sel.shape[0]
            pool.x[dst] = F.as_codes(inp.x)[sel[:, 1]]
            pool.x_sf[dst] = inp.x_sf[sel[:, 1]]
            pool.weights[dst] = inp.topk_weights[sel[:, 1], sel[:, 2]]
            pool.meta[dst] = sel.to(torch.int32)
    valid_per_block = pool.valid.reshape(-1, bm).sum(dim=1) if p else torch.zeros(0, device=device)
    pool.block_arrivals.copy_(valid_per_block.to(torch.int32))
    return pool
