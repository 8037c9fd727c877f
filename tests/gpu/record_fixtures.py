"""Record the kernel's dumps of a few small calls on a GPU, as CI fixtures (SPEC §5: a dump captured
on a GPU is checked later on a CPU).

    python -m tests.gpu.record_fixtures OUT_DIR                 # every set below
    python -m tests.gpu.record_fixtures OUT_DIR --fused-only    # the fused kernel's only
    python -m tests.gpu.record_fixtures OUT_DIR --sampled-only  # the gpt-oss-20b calls only

writes
  OUT_DIR/sm90_<promotion>_rank<r>.pt   the standalone GEMM core (reference D1-D4, the kernel's
                                        D5-D8) for promotion k32 (H 256, I 128) and k128 (H 512,
                                        I 512), 2 ranks, weights included;
  OUT_DIR/fused_<case>_rank<r>.pt       the fused kernel (megamoe.moe.MegaMoE, debug=True: every
                                        dump point D1-D10 is the kernel's own), one file per rank,
                                        for the calls in FUSED_CASES (one rank, and one call on two
                                        ranks run as two processes by megamoe.multirank.spawn),
                                        saved WITHOUT weights: the file names the random_weights
                                        seed and the weights' SHA-256, and the checker regenerates
                                        them (conformance/dump.py with_weights);
  OUT_DIR/sampled_<case>_rank0.pt       the fused kernel at gpt-oss-20b's shape (E 32, H = I = 2880,
                                        top-4, SPEC §8's activation and biases), T = 1, 64 and 1000
                                        (SAMPLED_CASES), each cut to a few tokens (sample_tokens),
                                        without weights (both seeds named).
tests/test_fixtures.py checks them with the conformance suite on every CI run.

Size of a fused fixture (torch.save stores the tensors uncompressed): the pool-shaped dump points
hold p_used <= T*K + E_l*(BLOCK_M - 1) rows (every expert that receives a token pads to BLOCK_M =
64), and per pool row D5.acc1 takes 2I * 4 bytes and D7.acc2 H * 4 bytes, fp32 accumulators that
dominate; then D4.pool_x H, D6.l2_acts I, the scale bytes, plus D8.combine (K * T_max * H bf16)
and D9.y (T * H bf16). At H 256, I 128 that is ~2.5 KB per pool row: with E 8, top-4 (p_used 512)
one call alone is 1.36 MB, so the fused calls use E 4, top-2 (p_used 256): ~0.70 MB a call with
tokens, ~0.04 MB without, ~1.44 MB for the three one-rank calls together; the two-rank call
(E_l 2 per rank, so 2 x 128 pool rows, mostly padding) ~0.70 MB. `fused_size_estimate` computes
them on the CPU from the reference; tests/test_fixtures.py keeps the plan and the files under
FUSED_BUDGET, per rank count: the one-rank calls under 2 MB (the project's bound for CI fixtures), the
two-rank call under 1 MB.
"""

from __future__ import annotations

import argparse
import dataclasses
import io
import math
import sys
from pathlib import Path

import torch

from megamoe import reference as ref

CALLS = {
    "k32": ref.MoEConfig(
        hidden=256,
        intermediate=128,
        num_experts=8,
        top_k=4,
        num_ranks=2,
        max_tokens_per_rank=32,
        block_m=64,
        activation_clamp=1.5,
        fast_math=True,
    ),
    "k128": ref.MoEConfig(
        hidden=512,
        intermediate=512,
        num_experts=4,
        top_k=2,
        num_ranks=2,
        max_tokens_per_rank=16,
        block_m=64,
        activation_clamp=None,
        fast_math=False,
    ),
}


# ---- the fused kernel's calls ----------------------------------------------------------------
FUSED_BUDGET = {1: 2_000_000, 2: 1_000_000}  # bytes of the fused_*.pt files of the calls with that many ranks
FUSED_WEIGHTS_SEED = 1  # random_weights(E, H, I, seed=1): what the checker regenerates
FUSED_SHAPE = dict(
    hidden=256, intermediate=128, num_experts=4, top_k=2, num_ranks=1, max_tokens_per_rank=32, block_m=64
)


@dataclasses.dataclass(frozen=True)
class FusedCase:
    """One recorded call of the fused layer: its tokens, routing and SiLU / clamp mode."""

    tokens: int | tuple[int, ...]  # one rank's, or each rank's (then the call has that many ranks)
    distribution: str
    masked_ratio: float
    activation_clamp: float | None
    fast_math: bool
    seed: int  # of make_inputs

    @property
    def tokens_per_rank(self) -> tuple[int, ...]:
        return self.tokens if isinstance(self.tokens, tuple) else (self.tokens,)

    @property
    def config(self) -> ref.MoEConfig:
        return ref.MoEConfig(
            **{**FUSED_SHAPE, "num_ranks": len(self.tokens_per_rank)},
            activation_clamp=self.activation_clamp,
            fast_math=self.fast_math,
        )

    def inputs(self, device="cpu") -> list[ref.RankInputs]:
        return ref.make_inputs(
            self.config,
            list(self.tokens_per_rank),
            seed=self.seed,
            distribution=self.distribution,
            masked_ratio=self.masked_ratio,
            device=device,
        )


FUSED_CASES = {
    # a Zipf-like routing with 10 % of the slots masked, fewer tokens than T_max, clamp, fast SiLU
    "skewed": FusedCase(29, "skewed", 0.1, 1.5, True, seed=2),
    # expert 0 in every token (one full-height expert, the others sharing the second slot),
    # precise SiLU, no clamp
    "one_hot": FusedCase(32, "one_hot", 0.0, None, False, seed=3),
    # a call without tokens: every count 0, nothing pooled, y empty, the counters still clean
    "no_tokens": FusedCase(0, "uniform", 0.0, 1.5, True, seed=4),
    # two ranks (expert parallelism through symmetric memory), uneven T, masked slots
    "two_ranks": FusedCase((16, 9), "skewed", 0.1, 1.5, True, seed=5),
}


def fused_file(case: str, rank: int = 0) -> str:
    return f"fused_{case}_rank{rank}.pt"


def _saved_bytes(d) -> int:
    """The bytes `Dump.save` writes for this dump (written into memory)."""
    buf = io.BytesIO()
    d.save(buf)
    return len(buf.getvalue())


def fused_size_estimate(case: str) -> int:
    """The bytes of every rank's fused_<case>_rank<r>.pt, estimated on the CPU: the reference's dumps
    of the same call (the kernel's dump points have the reference's shapes), without weights, plus
    the kernel's counter words (D10.counters: one word per pool block per counter)."""
    from megamoe.conformance.dump import reference_dumps
    from megamoe.jit import contract as C

    c = FUSED_CASES[case]
    cfg = c.config
    weights = ref.random_weights(cfg.num_experts, cfg.hidden, cfg.intermediate, seed=FUSED_WEIGHTS_SEED)
    total = 0
    for d in reference_dumps(cfg, c.inputs(), weights):
        d = d.without_weights(FUSED_WEIGHTS_SEED)
        d.tensors["D10.counters"] = torch.zeros(len(C.COUNTERS) * C.workspace_dims(cfg)["B"], dtype=torch.int32)
        d.meta.update(kernel_mode="sm90-fused-k32", recv_stats_recorded=True)
        total += _saved_bytes(d)
    return total


def _fused_call(rank: int, ranks: int, case: str):
    """One rank's debug call of a FUSED_CASES call (in this process, or in a spawned one)."""
    from megamoe import multirank
    from megamoe.moe import MegaMoE

    c = FUSED_CASES[case]
    cfg = c.config
    weights = ref.random_weights(cfg.num_experts, cfg.hidden, cfg.intermediate, seed=FUSED_WEIGHTS_SEED, device="cuda")
    layer = MegaMoE(cfg, weights, group=multirank.group() if ranks > 1 else None)
    inp = c.inputs("cuda")[rank]
    _, dumps = layer(inp.x, inp.x_sf, inp.topk_idx, inp.topk_weights, debug=True)
    torch.cuda.synchronize()
    return dumps[0]


def record_fused(out: Path) -> list[Path]:
    """Run every FUSED_CASES call through the fused layer's debug build, check its dumps with the
    suite here (a fixture that does not conform is not written), save them without weights."""
    from megamoe import multirank
    from megamoe.conformance.suite import check

    written = []
    for case, c in FUSED_CASES.items():
        ranks = len(c.tokens_per_rank)
        if ranks == 1:
            dumps = [_fused_call(0, 1, case)]
        else:
            dumps = multirank.spawn(_fused_call, ranks, args=(case,))
        report = check(dumps)
        if not report.ok:
            sys.exit(f"fused case {case!r}: the kernel's dumps do not conform; not recorded\n{report.text()}")
        for d in dumps:
            spec = d.meta["build_id"]
            d.meta["build_id"] = f"sm90 fused kernel {spec}, {torch.cuda.get_device_name()}, torch {torch.__version__}"
            path = out / fused_file(case, d.rank)
            d.without_weights(FUSED_WEIGHTS_SEED).save(path)
            written.append(path)
    totals = dict.fromkeys(FUSED_BUDGET, 0)
    for path in written:
        size = path.stat().st_size
        case = path.stem.removeprefix("fused_").rpartition("_rank")[0]
        totals[len(FUSED_CASES[case].tokens_per_rank)] += size
        print(f"{path}  {size:,} bytes (the call's files estimated {fused_size_estimate(case):,})")
    for ranks, total in totals.items():
        print(f"fused fixtures of {ranks}-rank calls: {total:,} bytes (budget {FUSED_BUDGET[ranks]:,})")
        if total >= FUSED_BUDGET[ranks]:
            sys.exit(f"the {ranks}-rank fused fixtures take {total:,} bytes, over budget: choose smaller calls")
    return written


# ---- the fused kernel at gpt-oss-20b's shape, sampled ---------------------------------------
# SPEC §8's layer at its real size (E 32, H = I = 2880, top-4, b1 and b2, the exact mode). A whole
# call's dumps take ~10 MB at T = 1 and ~240 MB at T = 1000 (a pool row alone ~40 KB), so each file
# keeps a few tokens (conformance.dump.sample_tokens: their x, pool rows, combine rows and y; all of
# the routing, counts, source lists, pool metadata and counters), without weights (regenerated
# from the two seeds the files name).
GPT_OSS_SHAPE = dict(hidden=2880, intermediate=2880, num_experts=32, top_k=4, num_ranks=1, activation="swiglu_oai")
GPT_OSS_SEEDS = (1, 2)  # random_weights', random_biases'
GPT_OSS_T_MAX = 1000  # one layer for every case
SAMPLED_BUDGET = 3_000_000  # bytes of every sampled_*.pt together
SAMPLED_CASES = {  # name: (T, the tokens kept), inputs make_inputs(seed=7, uniform routing)
    "gpt_oss_20b_t1": (1, [0]),
    "gpt_oss_20b_t64": (64, [0, 21, 42, 63]),
    "gpt_oss_20b_t1000": (1000, [0, 333, 666, 999]),
}


def gpt_oss_config() -> ref.MoEConfig:
    return ref.MoEConfig(**GPT_OSS_SHAPE, max_tokens_per_rank=GPT_OSS_T_MAX)


def gpt_oss_weights(device="cpu") -> ref.ExpertWeights:
    """The weights and biases of every SAMPLED_CASES call (global: E = 32)."""
    cfg, (w_seed, b_seed) = gpt_oss_config(), GPT_OSS_SEEDS
    w = ref.random_weights(cfg.num_experts, cfg.hidden, cfg.intermediate, seed=w_seed, device=device)
    w.b1, w.b2 = ref.random_biases(cfg.num_experts, cfg.hidden, cfg.intermediate, seed=b_seed, device=device)
    return w


def sampled_file(case: str) -> str:
    return f"sampled_{case}_rank0.pt"


def sampled_size_estimate(case: str) -> int:
    """About the bytes of sampled_<case>_rank0.pt, from the dump-point table: every tensor at its
    size for T and the pool's most rows (T K + E (block_m - 1)), the kept ones at the rows they
    keep (K a token), inputs and counters included; the masks and torch.save's framing on top."""
    from megamoe.conformance.dump import SAMPLED_ROWS
    from megamoe.jit import contract as C
    from megamoe.reference import points as P

    cfg = gpt_oss_config()
    tokens, keep = SAMPLED_CASES[case]
    pool = tokens * cfg.top_k + cfg.num_experts * (cfg.block_m - 1)
    dims = P.dump_dims(cfg, tokens=tokens, pool_rows=pool, counter_words=len(C.COUNTERS) * pool // cfg.block_m)
    kept = {**dict.fromkeys(SAMPLED_ROWS, cfg.top_k * len(keep)), P.D9_Y: len(keep), P.D8_COMBINE: None}
    total = 0
    for name, t in P.TABLE.items():
        shape = list(t.shape_of(dims))
        if name == P.D8_COMBINE:
            shape[1] = len(keep)
        elif name in kept:
            shape[0] = kept[name]
        total += math.prod(shape) * t.dtype.itemsize
    inputs = len(keep) * cfg.hidden + tokens * (cfg.hidden // 32 + cfg.top_k * (8 + 4))  # x kept rows only
    return total + inputs + pool + tokens + 64 * 1024


def record_sampled(out: Path) -> list[Path]:
    """Run every SAMPLED_CASES call through the fused layer's debug build, cut its dumps to the
    case's tokens, check those here as CI will (a fixture that does not conform is not written),
    and save them without weights."""
    from megamoe.conformance.dump import sample_tokens
    from megamoe.conformance.suite import check
    from megamoe.moe import MegaMoE

    cfg = gpt_oss_config()
    weights = gpt_oss_weights("cuda")
    layer = MegaMoE(cfg, weights)
    written = []
    for case, (tokens, keep) in SAMPLED_CASES.items():
        inp = ref.make_inputs(cfg, tokens, seed=7, device="cuda")[0]
        _, dumps = layer(inp.x, inp.x_sf, inp.topk_idx, inp.topk_weights, debug=True)
        torch.cuda.synchronize()
        cut = sample_tokens(dumps, [keep])
        report = check(cut)
        if not report.ok:
            sys.exit(f"sampled case {case!r}: the kernel's dumps do not conform; not recorded\n{report.text()}")
        d = cut[0]
        d.meta["build_id"] = (
            f"sm90 fused kernel {d.meta['build_id']}, {torch.cuda.get_device_name()}, torch {torch.__version__}"
        )
        path = out / sampled_file(case)
        d.without_weights(*GPT_OSS_SEEDS).save(path)
        written.append(path)
        print(f"{path}  {path.stat().st_size:,} bytes (estimated {sampled_size_estimate(case):,})")
    total = sum(p.stat().st_size for p in written)
    print(f"sampled fixtures: {total:,} bytes (budget {SAMPLED_BUDGET:,})")
    if total >= SAMPLED_BUDGET:
        sys.exit(f"the sampled fixtures take {total:,} bytes, over budget: keep fewer tokens")
    return written


def record_standalone(out: Path) -> None:
    from .test_gemm_conformance import kernel_dumps

    for promotion, cfg in CALLS.items():
        inputs = [
            i.to("cuda")
            for i in ref.make_inputs(
                cfg,
                [cfg.max_tokens_per_rank, cfg.max_tokens_per_rank - 5],
                seed=1,
                distribution="skewed",
                masked_ratio=0.1,
            )
        ]
        weights = ref.random_weights(cfg.num_experts, cfg.hidden, cfg.intermediate, seed=1, device="cuda")
        for d in kernel_dumps(cfg, inputs, weights, promotion):
            d.meta["build_id"] = f"sm90 standalone GEMMs, {torch.cuda.get_device_name()}, torch {torch.__version__}"
            d.save(out / f"sm90_{promotion}_rank{d.rank}.pt")
            print(out / f"sm90_{promotion}_rank{d.rank}.pt")


def main(out: Path, fused_only: bool = False, sampled_only: bool = False) -> None:
    if not torch.cuda.is_available():
        sys.exit("record_fixtures needs a CUDA GPU (it records the kernel's own dumps)")
    out.mkdir(parents=True, exist_ok=True)
    if not fused_only:
        record_standalone(out)
    if not sampled_only:
        record_fused(out)
    record_sampled(out)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(
        prog="python -m tests.gpu.record_fixtures",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("out_dir", type=Path, help="where the .pt files go (tests/fixtures to update CI's)")
    parser.add_argument(
        "--fused-only", action="store_true", help="record only the fused kernel's fused_*.pt and sampled_*.pt"
    )
    parser.add_argument("--sampled-only", action="store_true", help="record only the sampled_*.pt (gpt-oss-20b)")
    args = parser.parse_args()
    main(args.out_dir, fused_only=args.fused_only or args.sampled_only, sampled_only=args.sampled_only)
