"""Benchmark of a whole MoE layer on one rank (R = 1, every expert local); prints one table.

    python -m bench.layer [--shapes dsv3,v4flash] [--tokens 1,8,64,512,4096,8192] [--out FILE.json] [--quick]
                          [--engine auto|swapab|narrow|prefill] [--predecoded] [--zipf-tokens 256]
    python -m bench.layer --shapes gpt-oss --tokens 8,4096

Shapes: the slices of bench/gemm.py (32 local experts; DeepSeek-V3 H 7168, I 2048; V4-Flash H 4096,
I 2048), top-8 routing; and, by name only, gpt-oss (H = I = 2880, top-4, SPEC §8's activation with
biases: gpt-oss-20b's 32 experts on one rank, and gpt-oss-120b's rank of EP4, 32 of its 128). At
gpt-oss the unfused and fast-mode columns are n/a (whole K blocks and multiples of 512), and torch
runs the plain SwiGLU without biases: a time beside the fused layer, not the same formula. T = tokens per rank (the layer's batch), routed uniform top-k by
megamoe.reference.make_inputs, and for the --zipf-tokens T also Zipf-skewed (its "skewed"
distribution: expert e drawn with weight 1 / (e + 1)^1.2); weights from megamoe.reference.random_weights. --quick: dsv3 at
T = 8 and 512 (a smoke run; an explicit --shapes or --tokens still wins).

Every time is bench.gemm's graph_us: the median over replays of a CUDA graph of several calls of
the whole layer (no host launch cost). Columns, per (shape, T):
  fused        megamoe.moe.MegaMoE(cfg, weights, promotion="k32"): the fused layer, us (its GEMM engine:
               the layer's per-call choice, or --engine's; the engine column names it; --predecoded:
               MegaMoE(..., predecoded=True), whose prefill engine reads weights decoded when the
               layer was made instead of decoding them in every call)
  unfused      torch dispatch (vectorised, on the GPU) + megamoe.gemm.l1_gemm / l2_gemm (k32) + torch
               combine, us;  unf-k128  the same with promotion k128 (megamoe.gemm.rebase_k128, timed)
  torch        naive torch FP8: gather, torch._scaled_grouped_mm (row-wise FP8, power-of-two row
               scales) for L1, SwiGLU with the routing weight and row-wise FP8 requantisation,
               _scaled_grouped_mm for L2, combine, us
  floor        max(bytes / HBM, FLOPs / peak) at the limits of the card it runs on (bench.gemm.card: the
               H200's 4.8 TB/s, the H100 SXM's 3.35; both 1979 TFLOP/s): bytes = FP4 weights + scale bytes of the
               experts that receive a token (both layers) + the layer's own traffic (x and its scales
               read, topk_idx / topk_weights read, y written); FLOPs = 2 slots (H 2I + I H)
  fused/floor  the fused time over the floor;  x_unf, x_torch  unfused / fused, torch / fused
  TF/s         the fused layer's TFLOP/s
  d_fused, d_torch  calc_diff (1 - 2 sum xy / sum(x^2 + y^2)) of fused's y and torch's y against
               unfused k32's y: a wiring check, not a conformance result (not timed)
A column that cannot be built or run shows n/a; its exception's first line is printed under the
table. Progress goes to stderr (a full run takes minutes: the weights are drawn on the CPU).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time

import torch
import torch.nn.functional as TF

from megamoe import reference as ref
from megamoe.jit import build as jb
from megamoe.jit import contract
from megamoe.reference import formats as F

from .gemm import ALIGN, E, H200, SHAPES, Card, card, eager_us, graph_us

# bench/gemm.py times the GEMMs alone and names no top-k; DeepSeek-V3 routes top-8, and the V4-Flash
# slice is given the same so that the two rows differ only in H.
TOP_K = {"dsv3": 8, "v4flash": 8}
# The shapes by name only (not in the default run): gpt-oss's experts (SPEC §8), top-4.
EXTRA_SHAPES = {"gpt-oss": (2880, 2880)}
LAYER_SHAPES = {**SHAPES, **EXTRA_SHAPES}
LAYER_TOP_K = {**TOP_K, "gpt-oss": 4}
ACTIVATION = {"gpt-oss": "swiglu_oai"}  # else SPEC §3's SwiGLU
DEFAULT_TOKENS = "1,8,64,512,4096,8192"
QUICK_SHAPES, QUICK_TOKENS = "dsv3", "8,512"
SEED = 0
COLUMNS = ("fused", "fused-k128", "unfused", "unfused-k128", "torch")


# ---------------------------------------------------------------------------------------------
# Arguments
# ---------------------------------------------------------------------------------------------
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """args.shapes: list of SHAPES keys; args.tokens: list of positive ints; args.out; args.quick."""
    ap = argparse.ArgumentParser(prog="python -m bench.layer", description=__doc__.split("\n")[0])
    ap.add_argument(
        "--shapes", default=None, help="comma list of dsv3, v4flash, gpt-oss (default: dsv3,v4flash; --quick: dsv3)"
    )
    ap.add_argument(
        "--tokens", default=None, help=f"tokens per rank T, comma list (default: {DEFAULT_TOKENS}; --quick: 8,512)"
    )
    ap.add_argument("--out", default=None, metavar="FILE.json", help="also write every number as JSON to this file")
    ap.add_argument("--quick", action="store_true", help="a reduced set for smoke runs: dsv3, T = 8 and 512")
    ap.add_argument(
        "--zipf-tokens",
        default="",
        help="comma list of T that also get a row of Zipf-skewed routing (default: none)",
    )
    ap.add_argument(
        "--engine",
        default="auto",
        choices=("auto", *jb.FUSED_ENGINES),
        help="the fused layer's GEMM engine (default: the layer's choice per call, MegaMoE.engine_for)",
    )
    ap.add_argument(
        "--predecoded",
        action="store_true",
        help="the fused layers keep their weights predecoded (MegaMoE(predecoded=True)): the prefill engine "
        "skips its per-call predecode",
    )
    args = ap.parse_args(argv)
    shapes = (args.shapes or (QUICK_SHAPES if args.quick else ",".join(SHAPES))).split(",")
    unknown = [s for s in shapes if s not in LAYER_SHAPES]
    if unknown or not shapes:
        ap.error(f"--shapes: unknown {unknown}; choose from {', '.join(LAYER_SHAPES)}")
    try:
        tokens = [int(t) for t in (args.tokens or (QUICK_TOKENS if args.quick else DEFAULT_TOKENS)).split(",")]
    except ValueError:
        ap.error(f"--tokens: expected a comma list of integers, got {args.tokens!r}")
    if any(t <= 0 for t in tokens):
        ap.error(f"--tokens: every T must be positive, got {tokens}")
    try:
        zipf = [int(t) for t in args.zipf_tokens.split(",") if t]
    except ValueError:
        ap.error(f"--zipf-tokens: expected a comma list of integers, got {args.zipf_tokens!r}")
    if any(t <= 0 for t in zipf):
        ap.error(f"--zipf-tokens: every T must be positive, got {zipf}")
    args.shapes, args.tokens, args.zipf_tokens = shapes, tokens, zipf
    return args


# ---------------------------------------------------------------------------------------------
# The roofline
# ---------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Floor:
    hbm_bytes: int
    flops: int
    us: float


def layer_floor(
    hidden: int, intermediate: int, tokens: int, top_k: int, active_experts: int, slots: int, lim: Card = H200
) -> Floor:
    """The layer's roofline. Weight bytes: each expert that receives a token reads its L1 (2I x H)
    and L2 (H x I) FP4 weights once, half a byte per element plus one UE8M0 byte per 32. The rest is
    what any implementation must move: x (1 byte) and its scales (1 per 32) read, topk_idx (int64)
    and topk_weights (fp32) read, y (bf16) written. The pool, the intermediate activations and the
    combine buffer are left out: a fused layer may keep them on chip. The time is at lim's limits."""
    elems = 3 * hidden * intermediate  # 2I x H + H x I per expert
    weight_bytes = active_experts * (elems // 2 + elems // 32)
    layer_bytes = tokens * (hidden + hidden // 32 + top_k * (8 + 4) + 2 * hidden)
    hbm_bytes = weight_bytes + layer_bytes
    flops = 2 * slots * (hidden * 2 * intermediate + intermediate * hidden)
    return Floor(hbm_bytes, flops, max(hbm_bytes / lim.hbm, flops / lim.peak) * 1e6)


# ---------------------------------------------------------------------------------------------
# Torch building blocks. All of them are device-agnostic (the CPU tests run them) and have static
# shapes without a host sync (no nonzero, bincount, boolean indexing or .item()), so that a CUDA
# graph can capture them.
# ---------------------------------------------------------------------------------------------
def slot_rows(
    topk_idx: torch.Tensor, num_experts: int, align: int, sentinel: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The expert-major layout of the (t, k) slots, each expert starting on a multiple of `align`.

    Returns rows int64 [T*K] (the row of slot t*K + k; `sentinel` for a masked slot, idx < 0),
    counts int32 [E] and offsets int32 [E + 1] (each expert's first row, then the end). Within an
    expert the slots keep their t*K + k order, the reference pool's (build_pool) for one rank. No
    sort: a slot's place in its expert is the number of earlier slots of that expert, a cumsum over
    a one-hot [T*K, E + 1] (masked slots in the last column), which is cheap at E = 32."""
    flat = topk_idx.reshape(-1)
    valid = flat >= 0
    expert = torch.where(valid, flat, num_experts)
    onehot = (expert[:, None] == torch.arange(num_experts + 1, device=flat.device)).to(torch.int64)
    earlier = onehot.cumsum(0) - onehot
    place = earlier.gather(1, expert[:, None]).squeeze(1)
    counts = onehot.sum(0)[:num_experts]
    padded = (counts + align - 1) // align * align
    offsets = TF.pad(padded.cumsum(0), (1, 0))
    rows = torch.where(valid, offsets[expert.clamp(max=num_experts - 1)] + place, sentinel)
    return rows, counts.to(torch.int32), offsets.to(torch.int32)


@dataclasses.dataclass
class TorchPool:
    """The pool of SPEC D4 at its worst-case size: rows [expert_offsets[e], + expert_rows[e]) hold
    expert e's slots; dst_rows[p] = k * T_max + t of the slot in row p, -1 on every other row.
    Padding rows of x / x_sf / weights keep what the last call left (the GEMMs never read them)."""

    x: torch.Tensor  # uint8 E4M3 [P, H]
    x_sf: torch.Tensor  # uint8 [P, H/32]
    weights: torch.Tensor  # fp32 [P]
    dst_rows: torch.Tensor  # int32 [P]
    expert_offsets: torch.Tensor  # int32 [E + 1]
    expert_rows: torch.Tensor  # int32 [E]


class PoolDispatch:
    """Dispatch D1-D4 in torch ops into buffers made once: the GEMM entry points cache their launch
    by tensor address, and a graph replays fixed addresses. The buffers have one row more than the
    pool; masked slots (topk_idx < 0) write into it, so that no write needs a data-dependent mask."""

    def __init__(self, cfg: ref.MoEConfig, device):
        self.num_experts, self.block_m, self.t_max = cfg.local_experts, cfg.block_m, cfg.max_tokens_per_rank
        # The fused layer's P (the same worst case over every routing), so both hold the same pool.
        p = contract.pool_rows(cfg.max_tokens_per_rank, cfg.top_k, cfg.local_experts, cfg.num_ranks, cfg.block_m)
        h = cfg.hidden
        self._x = torch.zeros(p + 1, h, dtype=torch.uint8, device=device)
        self._x_sf = torch.zeros(p + 1, h // 32, dtype=torch.uint8, device=device)
        self._weights = torch.zeros(p + 1, dtype=torch.float32, device=device)
        self._dst = torch.full((p + 1,), -1, dtype=torch.int32, device=device)
        self.pool = TorchPool(
            self._x[:p],
            self._x_sf[:p],
            self._weights[:p],
            self._dst[:p],
            torch.zeros(cfg.local_experts + 1, dtype=torch.int32, device=device),
            torch.zeros(cfg.local_experts, dtype=torch.int32, device=device),
        )

    @property
    def capacity(self) -> int:
        return self.pool.x.shape[0]

    def __call__(self, x, x_sf, topk_idx, topk_weights) -> TorchPool:
        t, k = topk_idx.shape
        rows, counts, offsets = slot_rows(topk_idx, self.num_experts, self.block_m, self.capacity)
        slot = torch.arange(t * k, device=topk_idx.device)
        token = slot // k
        self._x.index_copy_(0, rows, F.as_codes(x).index_select(0, token))
        self._x_sf.index_copy_(0, rows, x_sf.index_select(0, token))
        self._weights.index_copy_(0, rows, topk_weights.reshape(-1).to(torch.float32))
        self._dst.fill_(-1)
        self._dst.index_copy_(0, rows, ((slot % k) * self.t_max + token).to(torch.int32))
        self.pool.expert_offsets.copy_(offsets)
        self.pool.expert_rows.copy_(counts)
        return self.pool


def combine_slots(buffer: torch.Tensor, topk_idx: torch.Tensor) -> torch.Tensor:
    """D9 in torch ops: y [T, H] bf16 = the fp32 sum over k ascending of the valid slots' rows
    buffer[k, t], then one RNE to bf16 (megamoe.reference.combine's order; K small kernels)."""
    t = topk_idx.shape[0]
    acc = torch.zeros(t, buffer.shape[-1], dtype=torch.float32, device=buffer.device)
    for k in range(topk_idx.shape[1]):
        acc = torch.where(topk_idx[:, k : k + 1] >= 0, acc + buffer[k, :t].to(torch.float32), acc)
    return acc.to(torch.bfloat16)


def rowwise_e4m3(values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 [..., N, K] -> (e4m3 [..., N, K], fp32 scales [..., N]): the operand format of
    torch._scaled_grouped_mm's row-wise mode, one scale per row. The scale is amax / 448 rounded up
    to a power of two: dividing by it is exact, so a value keeps its bits unless it falls under
    E4M3's normal range (2^-6 of the scale); FP4 weights and per-32 E4M3 activations stay exact.
    With amax / 448 itself every value would be re-rounded."""
    amax = values.abs().amax(dim=-1, keepdim=True).clamp_min(2.0**-100)
    scale = F.pow2_f32(F.ceil_exponent(amax * (1.0 / 448.0)))
    q = (values / scale).to(torch.float8_e4m3fn)  # |values / scale| <= 448: no saturation
    return q, scale.squeeze(-1)


def dequantize_per32(codes: torch.Tensor, scale_bytes: torch.Tensor) -> torch.Tensor:
    """E4M3 [T, H] with UE8M0 per-32 scales -> fp32 (native cast and exact powers of two: no table)."""
    t, h = codes.shape
    v = F.as_codes(codes).view(torch.float8_e4m3fn).to(torch.float32).reshape(t, h // 32, 32)
    return (v * F.pow2_f32(scale_bytes.to(torch.int32) - 127)[..., None]).reshape(t, h)


# ---------------------------------------------------------------------------------------------
# The layers that are timed
# ---------------------------------------------------------------------------------------------
class UnfusedLayer:
    """Dispatch in torch, the two GEMM-core kernels, combine in torch. Buffers and the launch are
    prepared once; one call runs on the device without a sync."""

    def __init__(self, cfg: ref.MoEConfig, kw, promotion: str, device):
        from megamoe import gemm as G

        self.G, self.cfg, self.kw, self.promotion = G, cfg, kw, promotion
        self.dispatch = PoolDispatch(cfg, device)
        p, inter = self.dispatch.capacity, cfg.intermediate
        self.l1_out = torch.empty(p, inter, dtype=torch.float8_e4m3fn, device=device)
        self.l1_sf = torch.empty(p, inter // 32, dtype=torch.uint8, device=device)
        self.combine = torch.zeros(cfg.top_k, cfg.max_tokens_per_rank, cfg.hidden, dtype=torch.bfloat16, device=device)

    def __call__(self, x, x_sf, topk_idx, topk_weights) -> torch.Tensor:
        pool = self.dispatch(x, x_sf, topk_idx, topk_weights)
        # An expert receives each token at most once, so T_max bounds its rows: the tile choice a
        # layer can make without reading the routing back to the host.
        common = dict(promotion=self.promotion, max_tokens=self.cfg.max_tokens_per_rank)
        x1, x1_128 = pool.x, None
        if self.promotion == "k128":
            x1, x1_128 = self.G.rebase_k128(pool.x, pool.x_sf)
        self.G.l1_gemm(
            x1,
            pool.x_sf,
            pool.expert_offsets,
            pool.expert_rows,
            pool.weights,
            self.kw,
            fast_math=self.cfg.fast_math,
            activation_clamp=self.cfg.activation_clamp,
            out=self.l1_out,
            out_sf=self.l1_sf,
            x_sf128=x1_128,
            **common,
        )
        x2, x2_128 = self.l1_out, None
        if self.promotion == "k128":
            x2, x2_128 = self.G.rebase_k128(self.l1_out, self.l1_sf)
        self.G.l2_gemm(
            x2,
            self.l1_sf,
            pool.expert_offsets,
            pool.expert_rows,
            pool.dst_rows,
            self.kw,
            self.combine,
            x_sf128=x2_128,
            **common,
        )
        return combine_slots(self.combine, topk_idx)


class TorchFP8Layer:
    """The naive torch pipeline with row-wise FP8 grouped GEMMs. The canonical FP4 weights are
    dequantised and requantised row-wise to E4M3 once, here (bench/gemm.py's torch baseline format)."""

    def __init__(self, weights: ref.ExpertWeights):
        self.w1, self.s1 = self._rowwise(weights.w1, weights.w1_sf)  # [E, 2I, H], [E, 2I]
        self.w2, self.s2 = self._rowwise(weights.w2, weights.w2_sf)  # [E, H, I], [E, H]
        self.num_experts, self.inter = self.w1.shape[0], self.w2.shape[2]

    @staticmethod
    def _rowwise(packed, scale_bytes):
        # One expert at a time: the fp32 copy of all of DSV3's w1 alone would be 3.8 GB.
        parts = [rowwise_e4m3(ref.dequantize_fp4(packed[e], scale_bytes[e], torch.float32)) for e in range(len(packed))]
        return torch.stack([q for q, _ in parts]), torch.stack([s for _, s in parts])

    def __call__(self, x, x_sf, topk_idx, topk_weights) -> torch.Tensor:
        t, k = topk_idx.shape
        n, h, inter = t * k, x.shape[1], self.inter
        # Row-wise operands: the layer's input comes with per-32 scales, the GEMM takes one per row.
        xq, xs = rowwise_e4m3(dequantize_per32(x, x_sf))
        rows, _, offsets = slot_rows(topk_idx, self.num_experts, 1, n)
        token = torch.arange(n, device=x.device) // k
        # Gather the slots expert-major, without padding (grouped-GEMM offsets are any row); one row
        # more takes the masked slots.
        a = torch.empty(n + 1, h, dtype=torch.uint8, device=x.device)
        a.index_copy_(0, rows, xq.view(torch.uint8).index_select(0, token))
        sa = torch.empty(n + 1, dtype=torch.float32, device=x.device).index_copy_(0, rows, xs.index_select(0, token))
        wr = torch.empty(n + 1, dtype=torch.float32, device=x.device)
        wr.index_copy_(0, rows, topk_weights.reshape(-1).to(torch.float32))
        ends = offsets[1:]
        h1 = torch._scaled_grouped_mm(
            a[:n].view(torch.float8_e4m3fn),
            self.w1.transpose(-2, -1),
            sa[:n],
            self.s1,
            offs=ends,
            out_dtype=torch.bfloat16,
        )
        act = TF.silu(h1[:, :inter].float()) * h1[:, inter:].float() * wr[:n, None]
        aq, as_ = rowwise_e4m3(act)
        out = torch._scaled_grouped_mm(aq, self.w2.transpose(-2, -1), as_, self.s2, offs=ends, out_dtype=torch.bfloat16)
        # Back to [K, T, H], slot (t, k) at [k, t]; masked slots read row 0 and are skipped by combine.
        src = rows.clamp(max=n - 1).view(t, k).t().reshape(-1)
        return combine_slots(out.index_select(0, src).view(k, t, h), topk_idx)


# ---------------------------------------------------------------------------------------------
# Measurement
# ---------------------------------------------------------------------------------------------
def progress(msg: str) -> None:
    print(f"[bench.layer {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0]}" if text else type(exc).__name__


@dataclasses.dataclass
class Column:
    us: float | None = None
    y: torch.Tensor | None = None
    error: str | None = None
    host_us: float | None = None  # Python time per eager call (launches queue behind the GPU)


def launches_for(tokens: int) -> int:
    """Calls per captured graph: enough that a replay is well above the event timer's resolution."""
    return 8 if tokens <= 64 else 4 if tokens <= 512 else 2


def measure(make, inputs, launches: int) -> Column:
    """Builds one column's layer (make()), graph-times layer(*inputs) and keeps one output for the
    wiring check. Any exception, in the build or the run, becomes the column's error."""
    try:
        layer = make()

        def call():
            return layer(*inputs)

        us = graph_us(call, launches=launches)
        _, host = eager_us(call)
        y = call().clone()
        torch.cuda.synchronize()
        return Column(us, y, host_us=host)
    except Exception as exc:  # one column's failure must not end the table
        try:
            torch.cuda.synchronize()
        except Exception:  # a sticky device error: the first exception is the one to report
            pass
        return Column(error=first_line(exc))


def built(obj):
    """obj, or raise the exception stored in its place when the shape's preparation failed."""
    if isinstance(obj, Exception):
        raise obj
    return obj


def make_fused(cfg, weights, promotion: str = "k32", engine: str = "auto", predecoded: bool = False):
    from megamoe.moe import MegaMoE  # written alongside this benchmark; imported late on purpose

    layer = MegaMoE(cfg, weights, promotion=promotion, engine=engine, predecoded=predecoded)
    # The value checks of SPEC §7 read the inputs (a device sync); the benchmark's inputs are valid.
    return lambda *inputs: layer(*inputs, check_inputs=False)


ROUTINGS = {"uniform": "uniform", "zipf": "skewed"}  # the table's name: make_inputs' distribution


def layer_config(shape: str, tokens: int) -> ref.MoEConfig:
    """The layer of a named shape on one rank holding all E experts, for calls of up to `tokens`."""
    hidden, inter = LAYER_SHAPES[shape]
    return ref.MoEConfig(
        hidden,
        inter,
        E,
        LAYER_TOP_K[shape],
        num_ranks=1,
        max_tokens_per_rank=tokens,
        block_m=ALIGN,
        activation=ACTIVATION.get(shape, "swiglu"),
    )


def shape_weights(shape: str) -> ref.ExpertWeights:
    """The benchmark's weights of a named shape on the GPU (random, SEED; gpt-oss's with biases)."""
    hidden, inter = LAYER_SHAPES[shape]
    progress(f"{shape}: drawing and quantizing the weights of {E} experts on the CPU (a minute or two)")
    weights = ref.random_weights(E, hidden, inter, seed=SEED, device="cuda")
    if ACTIVATION.get(shape) == "swiglu_oai":  # SPEC §8's biases, as gpt-oss's checkpoints have them
        weights.b1, weights.b2 = ref.random_biases(E, hidden, inter, seed=SEED, device="cuda")
    return weights


def bench_case(
    shape: str,
    tokens: int,
    weights,
    kw,
    torch_layer,
    engine: str = "auto",
    routing: str = "uniform",
    predecoded: bool = False,
    lim: Card = H200,
) -> dict:
    """One row of the table: every column at (shape, T, routing) on the same inputs; the floor at lim's limits."""
    hidden, inter = LAYER_SHAPES[shape]
    top_k = LAYER_TOP_K[shape]
    cfg = layer_config(shape, tokens)
    inp = ref.make_inputs(cfg, tokens, seed=SEED, distribution=ROUTINGS[routing], device="cuda")[0]
    inputs = (inp.x, inp.x_sf, inp.topk_idx, inp.topk_weights)
    counts = ref.send_counts(inp.topk_idx, E)
    active, slots = int((counts > 0).sum()), int(counts.sum())
    floor = layer_floor(hidden, inter, tokens, top_k, active, slots, lim)
    launches = launches_for(tokens)

    # An engine the fast mode does not run (the narrow one) leaves its column the layer's choice.
    engine_k128 = engine if engine in jb.FUSED_ENGINES_OF["k128"] else "auto"
    makes = {
        "fused": lambda: make_fused(cfg, weights, "k32", engine, predecoded),
        "fused-k128": lambda: make_fused(cfg, weights, "k128", engine_k128, predecoded),
        "unfused": lambda: UnfusedLayer(cfg, built(kw), "k32", "cuda"),
        "unfused-k128": lambda: UnfusedLayer(cfg, built(kw), "k128", "cuda"),
        "torch": lambda: built(torch_layer),
    }
    cols = {}
    # The fused layer runs last: a device fault in a kernel under development then cannot take the
    # baselines of its own row with it.
    for name in ("unfused", "unfused-k128", "torch", "fused", "fused-k128"):
        progress(f"{shape} T={tokens} {routing}: {name}")
        cols[name] = measure(makes[name], inputs, launches)
        if cols[name].error:
            progress(f"{shape} T={tokens} {routing}: {name} n/a: {cols[name].error}")
        torch.cuda.empty_cache()

    def ratio(a, b):
        return a / b if a is not None and b is not None else None

    def diff(name):  # against unfused k32, whose kernels are the conformance-tested GEMM core
        a, b = cols[name].y, cols["unfused"].y
        return ref.calc_diff(a, b) if a is not None and b is not None else None

    fused = cols["fused"].us
    from megamoe.moe import choose_engine

    return dict(
        routing=routing,
        engine_k32=choose_engine(cfg, "k32", tokens, engine, predecoded=predecoded),
        engine_k128=choose_engine(cfg, "k128", tokens, engine_k128, predecoded=predecoded),
        predecoded=predecoded,
        shape=shape,
        hidden=hidden,
        intermediate=inter,
        experts=E,
        top_k=top_k,
        tokens=tokens,
        slots=slots,
        active_experts=active,
        launches_per_graph=launches,
        **{f"{name}_us": cols[name].us for name in COLUMNS},
        fused_host_us=cols["fused"].host_us,
        floor_us=floor.us,
        floor_bytes=floor.hbm_bytes,
        flops=floor.flops,
        fused_over_floor=ratio(fused, floor.us),
        fused_k128_over_floor=ratio(cols["fused-k128"].us, floor.us),
        fused_k128_tflops=ratio(floor.flops / 1e6, cols["fused-k128"].us),
        speedup_vs_unfused=ratio(cols["unfused"].us, fused),
        speedup_vs_torch=ratio(cols["torch"].us, fused),
        fused_tflops=ratio(floor.flops / 1e6, fused),
        diff_fused=diff("fused"),
        diff_fused_k128=diff("fused-k128"),
        diff_unfused_k128=diff("unfused-k128"),
        diff_torch=diff("torch"),
        errors={name: cols[name].error for name in COLUMNS if cols[name].error},
    )


# ---------------------------------------------------------------------------------------------
# Output
# ---------------------------------------------------------------------------------------------
TABLE = (  # (header, row key, format)
    ("shape", "shape", "{}"),
    ("T", "tokens", "{}"),
    ("routing", "routing", "{}"),
    ("slots", "slots", "{}"),
    ("experts", "active_experts", "{}"),
    ("fused", "fused_us", "{:.1f}"),
    ("eng", "engine_k32", "{}"),
    ("fused-k128", "fused-k128_us", "{:.1f}"),
    ("eng-k128", "engine_k128", "{}"),
    ("unfused", "unfused_us", "{:.1f}"),
    ("unf-k128", "unfused-k128_us", "{:.1f}"),
    ("torch", "torch_us", "{:.1f}"),
    ("floor", "floor_us", "{:.1f}"),
    ("fused/floor", "fused_over_floor", "{:.2f}"),
    ("k128/floor", "fused_k128_over_floor", "{:.2f}"),
    ("x_unf", "speedup_vs_unfused", "{:.2f}"),
    ("x_torch", "speedup_vs_torch", "{:.2f}"),
    ("TF/s", "fused_tflops", "{:.1f}"),
    ("k128 TF/s", "fused_k128_tflops", "{:.1f}"),
    ("host", "fused_host_us", "{:.1f}"),
    ("d_fused", "diff_fused", "{:.1e}"),
    ("d_k128", "diff_fused_k128", "{:.1e}"),
    ("d_torch", "diff_torch", "{:.1e}"),
)
ERROR_CELL = {
    "fused_us": "fused",
    "fused-k128_us": "fused-k128",
    "unfused_us": "unfused",
    "unfused-k128_us": "unfused-k128",
    "torch_us": "torch",
}


def markdown_table(headers: list[str], cells: list[list[str]]) -> list[str]:
    """The lines of a Markdown table, every column right-aligned to its widest cell."""
    widths = [max(len(h), *(len(c[i]) for c in cells)) for i, h in enumerate(headers)]
    out = ["| " + " | ".join(h.rjust(w) for h, w in zip(headers, widths)) + " |"]
    out.append("|" + "|".join("-" * (w + 1) + ":" for w in widths) + "|")
    out += ["| " + " | ".join(c.rjust(w) for c, w in zip(line, widths)) + " |" for line in cells]
    return out


def format_table(rows: list[dict]) -> str:
    """The Markdown table, then one line per distinct column error (n/a cells)."""
    cells = []
    for r in rows:
        line = []
        for _, key, fmt in TABLE:
            v = r.get(key)
            if v is None:
                line.append("n/a" if ERROR_CELL.get(key) in r.get("errors", {}) else "-")
            else:
                line.append(fmt.format(v))
        cells.append(line)
    out = markdown_table([h for h, _, _ in TABLE], cells)
    notes: dict[tuple[str, str], list[str]] = {}
    for r in rows:
        for name, err in r.get("errors", {}).items():
            notes.setdefault((name, err), []).append(f"{r['shape']} T={r['tokens']}")
    for (name, err), where in notes.items():
        out.append(f"n/a {name} ({', '.join(where)}): {err}")
    return "\n".join(out)


LEGEND = (
    "times in us per layer call, median of CUDA-graph replays;\n"
    "fused = the fused layer, exact GEMM mode (k32); fused-k128 = its fast mode; eng = their GEMM engines;\n"
    "floor = max(bytes / {hbm:g} TB/s, FLOPs / {peak:g} TFLOP/s), the {name}'s limits; fused/floor = fused time / floor;\n"
    "x_unf / x_torch = unfused k32 / torch time over fused; d_* = calc_diff of y against unfused k32's y;\n"
    "host = Python time per eager fused call (no input value checks), us"
)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("bench.layer needs a CUDA GPU (it times the layer on the device)")
    from megamoe.jit.layout import transform_weights

    lim = card()  # once: every row's floor and the legend
    rows = []
    for shape in args.shapes:
        weights = shape_weights(shape)
        # Prepared once per shape, outside every timed region; a failure here is the column's error.
        try:
            kw = transform_weights(weights.w1, weights.w1_sf, weights.w2, weights.w2_sf)
        except Exception as exc:
            kw = RuntimeError(f"transform_weights: {first_line(exc)}")
        try:
            torch_layer = TorchFP8Layer(weights)
        except Exception as exc:
            torch_layer = RuntimeError(f"row-wise FP8 weights: {first_line(exc)}")
        torch.cuda.empty_cache()
        for tokens in args.tokens:
            rows.append(
                bench_case(shape, tokens, weights, kw, torch_layer, args.engine, "uniform", args.predecoded, lim)
            )
        for tokens in args.zipf_tokens:
            rows.append(bench_case(shape, tokens, weights, kw, torch_layer, args.engine, "zipf", args.predecoded, lim))
        del weights, kw, torch_layer
        torch.cuda.empty_cache()
    print(LEGEND.format(name=lim.name, hbm=lim.hbm / 1e12, peak=lim.peak / 1e12))
    if args.predecoded:
        print("--predecoded: the fused layers' weights decoded when they were made (prefill engine calls skip it)")
    print(format_table(rows))
    if args.out:
        meta = dict(
            device=torch.cuda.get_device_name(),
            torch=torch.__version__,
            hbm_bytes_per_s=lim.hbm,
            peak_flops=lim.peak,
            routings=sorted({r["routing"] for r in rows}),
            seed=SEED,
            date=time.strftime("%Y-%m-%d %H:%M:%S"),
        )
        with open(args.out, "w") as fh:
            json.dump(dict(meta=meta, rows=rows), fh, indent=1)
        progress(f"wrote {args.out}")


if __name__ == "__main__":
    main()
