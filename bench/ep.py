"""Benchmark of the fused layer with expert parallelism: R ranks, one process each; prints one table.

    python -m bench.ep [--ranks 8] [--shapes dsv3,v4flash] [--experts 256] [--tokens 1,8,64,512,4096,8192]
                       [--promotion k128] [--out FILE.json]

Every rank owns E / R experts (DeepSeek-V3: H 7168, I 2048, 256 experts, top-8; V4-Flash: H 4096)
and routes T tokens (uniform top-k) to all E. Ranks are processes started by megamoe.multirank.spawn,
rank r on GPU r % (GPUs); with fewer GPUs than ranks they time-slice one GPU, and the times say
nothing about speed (the table says so). Weights and inputs are random bytes drawn on the GPU (valid
codes and scale bytes, no NaN): the times do not depend on the values, and drawing 256 experts'
weights through the reference's quantizer would take many minutes per rank.

Columns, per (shape, T), the slowest rank's time:
  fused      megamoe.MegaMoE(group=...): one persistent launch per rank per call; the median of
             CUDA-graph replays (bench.gemm.graph_us); every rank replays in step (the kernel's
             cross-rank waits make a call last as long as the slowest rank's)
  torch-ep   the naive torch pipeline over NCCL: slots sorted by owner, packed rows
             (E4M3 codes, scale bytes, routing weight, local expert) exchanged with
             all_to_all_single, bench.layer.TorchFP8Layer (row-wise FP8 _scaled_grouped_mm, SwiGLU,
             requant) on the received rows, bf16 rows sent back, a weighted sum per token; eager
             (the split sizes are read back to the host), the mean over timed iterations after a
             barrier. Needs one GPU per rank (NCCL); n/a otherwise
  x_torch    torch-ep / fused
  TF/s       per GPU: 2 x valid slots x 3 H I over all ranks / fused time / R
  xfer GB/s  per GPU: bytes that cross ranks in the fused layer (a row pulled from a peer,
             H + H/32 + 4 bytes; a bf16 row written back, 2H) over all ranks / fused time / R
  published  the published 8 x H200 FP8 MegaMoE figures for DeepSeek-V3 shapes at EP8, where given
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch

from megamoe import reference as ref

from .gemm import SHAPES, graph_us
from .layer import TorchFP8Layer, launches_for, markdown_table

TOP_K = 8
DEFAULT_TOKENS = "1,8,64,512,4096,8192"
# DeepGEMM's SM90 FP8 MegaMoE on 8 x H200 (EP8, DeepSeek-V3 shape), as posted on DeepGEMM PR 352.
PUBLISHED_EP8_DSV3_US = {8: 404.0, 8192: 7490.0}
TIMED_ITERS = 5


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m bench.ep", description=__doc__.split("\n")[0])
    ap.add_argument("--ranks", type=int, default=8, help="R, one process each (default: %(default)s)")
    ap.add_argument("--shapes", default="dsv3,v4flash", help="comma list of dsv3, v4flash (default: %(default)s)")
    ap.add_argument("--experts", type=int, default=256, help="E over all ranks (default: %(default)s)")
    ap.add_argument("--tokens", default=DEFAULT_TOKENS, help="tokens per rank T, comma list (default: %(default)s)")
    ap.add_argument("--promotion", default="k128", choices=("k32", "k128"), help="GEMM mode (default: %(default)s)")
    ap.add_argument("--out", default=None, metavar="FILE.json", help="also write every number as JSON to this file")
    args = ap.parse_args(argv)
    args.shapes = args.shapes.split(",")
    if any(s not in SHAPES for s in args.shapes):
        ap.error(f"--shapes: choose from {', '.join(SHAPES)}, got {args.shapes}")
    try:
        args.tokens = [int(t) for t in args.tokens.split(",")]
    except ValueError:
        ap.error(f"--tokens: expected a comma list of integers, got {args.tokens!r}")
    if args.ranks < 1 or args.experts % args.ranks or any(t < 1 for t in args.tokens):
        ap.error("--ranks must divide --experts, and every T must be positive")
    return args


# ---------------------------------------------------------------------------------------------
# Random operands drawn on the device (device-agnostic: the CPU tests draw them too)
# ---------------------------------------------------------------------------------------------
def fast_weights(num_experts: int, hidden: int, inter: int, seed: int, device) -> ref.ExpertWeights:
    """Canonical FP4 weights of random bytes with scale bytes 2^-7 .. 2^-3 (no NaN byte)."""
    g = torch.Generator(device=device).manual_seed(seed)

    def draw(shape, low=0, high=256):
        return torch.randint(low, high, shape, generator=g, device=device, dtype=torch.uint8)

    return ref.ExpertWeights(
        draw((num_experts, 2 * inter, hidden // 2)),
        draw((num_experts, 2 * inter, hidden // 32), 120, 125),
        draw((num_experts, hidden, inter // 2)),
        draw((num_experts, hidden, inter // 32), 120, 125),
    )


def fast_inputs(tokens: int, hidden: int, experts: int, top_k: int, seed: int, device) -> ref.RankInputs:
    """E4M3 codes without the NaN codes, scale bytes 2^-7 .. 2^0, uniform top-k routing (k distinct
    experts per token), softmax routing weights."""
    g = torch.Generator(device=device).manual_seed(seed)
    magnitude = torch.randint(0, 0x7F, (tokens, hidden), generator=g, device=device, dtype=torch.uint8)
    sign = torch.randint(0, 2, (tokens, hidden), generator=g, device=device, dtype=torch.uint8) << 7
    x = (magnitude | sign).view(torch.float8_e4m3fn)
    x_sf = torch.randint(120, 128, (tokens, hidden // 32), generator=g, device=device, dtype=torch.uint8)
    idx = torch.rand(tokens, experts, generator=g, device=device).topk(top_k, dim=1).indices
    w = torch.softmax(torch.rand(tokens, top_k, generator=g, device=device), dim=1)
    return ref.RankInputs(x, x_sf, idx.to(torch.int64), w.to(torch.float32))


# ---------------------------------------------------------------------------------------------
# The torch baseline over a process group
# ---------------------------------------------------------------------------------------------
class TorchEP:
    """Dispatch and combine with all_to_all_single; `experts(x, x_sf, local_expert, weight)` maps the
    received rows (x E4M3 [n, H], scale bytes [n, H/32], int64 [n], fp32 [n]) to bf16 rows [n, H]
    with the routing weight applied (bench.layer.TorchFP8Layer with top-1 routing, or a stand-in in
    the CPU tests). The combine adds each token's returned rows in fp32, in slot order."""

    def __init__(self, experts, group, num_experts: int):
        import torch.distributed as dist

        self.dist, self.experts, self.group = dist, experts, group
        self.ranks = dist.get_world_size(group)
        self.local = num_experts // self.ranks

    def _exchange(self, rows: torch.Tensor, send: list[int], recv: list[int]) -> torch.Tensor:
        out = rows.new_empty((sum(recv), *rows.shape[1:]))
        self.dist.all_to_all_single(out, rows, recv, send, group=self.group)
        return out

    def __call__(self, x, x_sf, topk_idx, topk_weights) -> torch.Tensor:
        t, k = topk_idx.shape
        h = x.shape[1]
        flat = topk_idx.reshape(-1)
        owner = torch.where(flat >= 0, flat // self.local, self.ranks)  # masked slots sort last
        order = torch.sort(owner, stable=True).indices
        counts = torch.bincount(owner, minlength=self.ranks + 1)[: self.ranks]
        recv_counts = torch.empty_like(counts)
        self.dist.all_to_all_single(recv_counts, counts, group=self.group)
        send, recv = counts.tolist(), recv_counts.tolist()
        slots = order[: sum(send)]
        token = slots // k
        packed = torch.cat(
            [
                x.view(torch.uint8).index_select(0, token),
                x_sf.index_select(0, token),
                topk_weights.reshape(-1).index_select(0, slots).to(torch.float32).view(torch.uint8).reshape(-1, 4),
                (flat.index_select(0, slots) % self.local).to(torch.int32).view(torch.uint8).reshape(-1, 4),
            ],
            dim=1,
        )
        got = self._exchange(packed, send, recv)
        n = got.shape[0]
        rows = torch.empty(n, h, dtype=torch.bfloat16, device=x.device)
        if n:
            rows = self.experts(
                got[:, :h].contiguous().view(torch.float8_e4m3fn),
                got[:, h : h + h // 32].contiguous(),
                got[:, -4:].contiguous().view(torch.int32).reshape(-1).to(torch.int64),
                got[:, -8:-4].contiguous().view(torch.float32).reshape(-1),
            )
        back = self._exchange(rows, recv, send)
        y = torch.zeros(t, h, dtype=torch.float32, device=x.device)
        return y.index_add_(0, token, back.to(torch.float32)).to(torch.bfloat16)


def torch_experts(weights: ref.ExpertWeights):
    layer = TorchFP8Layer(weights)
    return lambda x, x_sf, e, w: layer(x, x_sf, e[:, None], w[:, None])


def cross_rank_bytes(topk_idx: torch.Tensor, rank: int, local: int, hidden: int) -> int:
    """Bytes this rank's slots move across ranks in the fused layer: each slot owned by a peer is
    pulled by it (codes, scale bytes, routing weight) and written back as a bf16 row."""
    remote = int(((topk_idx >= 0) & (topk_idx // local != rank)).sum())
    return remote * (hidden + hidden // 32 + 4 + 2 * hidden)


# ---------------------------------------------------------------------------------------------
# One rank
# ---------------------------------------------------------------------------------------------
def rank_main(rank: int, ranks: int, args: argparse.Namespace) -> list[dict]:
    import torch.distributed as dist

    from megamoe import multirank
    from megamoe.moe import MegaMoE

    own_gpu = torch.cuda.device_count() >= ranks
    nccl = dist.new_group(backend="nccl") if own_gpu else None  # collective: every rank or none
    rows = []
    for shape in args.shapes:
        hidden, inter = SHAPES[shape]
        local = args.experts // ranks
        cfg = ref.MoEConfig(
            hidden, inter, args.experts, TOP_K, num_ranks=ranks, max_tokens_per_rank=max(args.tokens), block_m=64
        )
        weights = fast_weights(local, hidden, inter, seed=rank, device="cuda")
        layer = MegaMoE(cfg, weights, group=multirank.group(), promotion=args.promotion)
        baseline = TorchEP(torch_experts(weights), nccl, args.experts) if own_gpu else None
        for tokens in args.tokens:
            inp = fast_inputs(tokens, hidden, args.experts, TOP_K, seed=1000 * rank + tokens, device="cuda")
            call = (inp.x, inp.x_sf, inp.topk_idx, inp.topk_weights)
            with layer.named_failures():
                fused = graph_us(lambda: layer(*call, check_inputs=False), launches=launches_for(tokens))
            torch_us, error = None, None
            if baseline is not None:
                try:
                    torch_us = _eager_us(lambda: baseline(*call), nccl)
                except Exception as exc:  # the baseline's failure must not end the table
                    error = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
            rows.append(
                dict(
                    shape=shape,
                    tokens=tokens,
                    fused_us=fused,
                    torch_us=torch_us,
                    torch_error=error,
                    slots=int((inp.topk_idx >= 0).sum()),
                    cross_bytes=cross_rank_bytes(inp.topk_idx, rank, local, hidden),
                )
            )
        layer = baseline = weights = None  # this shape's workspace and weights go before the next's
        torch.cuda.empty_cache()
    return rows


def _eager_us(fn, group) -> float:
    import torch.distributed as dist

    fn()
    torch.cuda.synchronize()
    dist.barrier(group=group)
    t0 = time.perf_counter()
    for _ in range(TIMED_ITERS):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) * 1e6 / TIMED_ITERS


# ---------------------------------------------------------------------------------------------
# The table
# ---------------------------------------------------------------------------------------------
def merge(per_rank: list[list[dict]], ranks: int, experts: int, shared_gpu: bool) -> list[dict]:
    """One row per (shape, T): the slowest rank's times, totals over ranks, the derived columns."""
    out = []
    for rows in zip(*per_rank):
        first = rows[0]
        hidden, inter = SHAPES[first["shape"]]
        fused = max(r["fused_us"] for r in rows)
        torch_us = None if any(r["torch_us"] is None for r in rows) else max(r["torch_us"] for r in rows)
        slots = sum(r["slots"] for r in rows)
        flops = 2 * slots * 3 * hidden * inter
        dsv3_ep8 = (first["shape"], ranks, experts) == ("dsv3", 8, 256)
        published = PUBLISHED_EP8_DSV3_US.get(first["tokens"]) if dsv3_ep8 else None
        out.append(
            dict(
                shape=first["shape"],
                tokens=first["tokens"],
                ranks=ranks,
                fused_us=fused,
                torch_us=torch_us,
                torch_error=next((r["torch_error"] for r in rows if r["torch_error"]), None),
                speedup_vs_torch=None if torch_us is None else torch_us / fused,
                tflops_per_gpu=flops / (fused * 1e-6) / ranks / 1e12,
                xfer_gbps_per_gpu=sum(r["cross_bytes"] for r in rows) / (fused * 1e-6) / ranks / 1e9,
                published_us=published,
                shared_gpu=shared_gpu,
            )
        )
    return out


TABLE = (
    ("shape", "shape", "{}"),
    ("R", "ranks", "{}"),
    ("T/rank", "tokens", "{}"),
    ("fused", "fused_us", "{:.1f}"),
    ("torch-ep", "torch_us", "{:.1f}"),
    ("x_torch", "speedup_vs_torch", "{:.2f}"),
    ("TF/s/GPU", "tflops_per_gpu", "{:.1f}"),
    ("xfer GB/s/GPU", "xfer_gbps_per_gpu", "{:.1f}"),
    ("published", "published_us", "{:.0f}"),
)


def format_table(rows: list[dict]) -> str:
    cells = [[("-" if r.get(k) is None else f.format(r[k])) for _, k, f in TABLE] for r in rows]
    out = markdown_table([h for h, _, _ in TABLE], cells)
    errors = {r["torch_error"] for r in rows if r.get("torch_error")}
    out += [f"n/a torch-ep: {e}" for e in sorted(errors)]
    if any(r["shared_gpu"] for r in rows):
        out.append("the ranks time-sliced one GPU: these times are no speed figures; torch-ep needs a GPU per rank")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("bench.ep needs a CUDA GPU (it times the layer on the device)")
    from megamoe import multirank

    shared = torch.cuda.device_count() < args.ranks
    print(f"[bench.ep] {args.ranks} ranks on {torch.cuda.device_count()} GPU(s)", file=sys.stderr, flush=True)
    per_rank = multirank.spawn(rank_main, args.ranks, args=(args,), timeout=3600)
    rows = merge(per_rank, args.ranks, args.experts, shared)
    print(format_table(rows))
    print(f"times in us per layer call, the slowest rank's; fused: promotion {args.promotion}, CUDA-graph replays")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
