"""Seeded random calls of the fused layer, each through the whole conformance suite.

    python -m megamoe.fuzz --device cuda --cases 300 --jobs 8   # the GPU run: the fused kernel
    python -m megamoe.fuzz --cases 20                           # CPU: the reference and the suite
    python -m megamoe.fuzz --device cuda --seed 0 --case 17     # one case again

Case `i` of seed `s` is drawn from `random.Random(f"{s}:{i}")` alone (and generators of its own
for what came later: SPEC §8's sizes and activation, the exact mode's narrow engine, the layer's
predecoded weights; a seed's cases drawn before that engine came may now run on it), so a case is reproduced by its two numbers
whatever else ran; every failure prints the command that runs it again. A case draws: R in {1, 2,
4} (several ranks as processes, `megamoe.multirank.spawn`), H and I (multiples the promotion
supports: in a quarter of the exact mode's cases multiples of 32 that are not of 128), SPEC §8's
activation with biases (a fifth of the cases), E, top-k, T_max, T per rank (0, T_max, or between; uneven across ranks), the
routing (uniform, skewed, one-hot, empty experts; masked fractions 0 to 1; routing weights softmax,
spanning many binades with either sign, or pairs of exactly cancelling experts), the clamp, the
SiLU table, the promotion and the engine (and in a quarter of the cases a layer made with
predecoded=True, whose prefill engine reads weights decoded when it was made), and what is done to the scale bytes of the activations
and of the weights independently:

    plain    as quantized
    wide     a quarter of the groups 20 to 40 binades under their neighbours (the fast mode's
             rebase drops them to zero: SPEC §3 D4's rule beyond its tables)
    zero     some groups all zero: codes +0 or -0, with their byte or byte 0
    extreme  some groups at scale bytes 0 and 254 (overflow to inf included: SPEC §4's overflow
             domain); the fast mode's weights reach 254 by one expert lifted whole (SPEC §2)

and NaN payloads in x. On the GPU a case is one debug call (every dump point D1-D10 of every rank
through `megamoe.conformance.suite.check`), then a release call that must give the same y bit for
bit. On the CPU (`--device cpu`, what CI runs) the reference's dumps of the same case go through
the suite: the generator, the reference and the checkers on every edge above, at smaller shapes.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
import subprocess
import sys
import tempfile
import time
import traceback
from collections import Counter
from dataclasses import dataclass

import torch

from megamoe import reference as ref

SCALE_MODES = ("plain", "wide", "zero", "extreme")
ROUTE_WEIGHTS = ("softmax", "wide", "cancel")
ENGINES = ("auto", "swapab", "prefill")  # drawn for every case; the exact mode's "narrow" from its own draw


@dataclass(frozen=True)
class Case:
    seed: int
    index: int
    ranks: int
    promotion: str  # "k32" (exact) or "k128" (fast)
    engine: str  # "auto", "swapab", "narrow" (exact mode) or "prefill"
    hidden: int
    intermediate: int
    experts: int
    top_k: int
    max_tokens: int
    tokens: tuple[int, ...]  # T per rank
    distribution: str  # reference.routing.DISTRIBUTIONS
    masked: float
    route_weights: str  # ROUTE_WEIGHTS
    clamp: float | None
    fast_math: bool
    x_scales: str  # SCALE_MODES
    w_scales: str
    nan_payloads: bool
    activation: str = "swiglu"  # or "swiglu_oai" (SPEC §8: with biases; clamp None)
    predecoded: bool = False  # MegaMoE(predecoded=True): the prefill engine skips its per-call predecode

    @property
    def cfg(self) -> ref.MoEConfig:
        return ref.MoEConfig(
            hidden=self.hidden,
            intermediate=self.intermediate,
            num_experts=self.experts,
            top_k=self.top_k,
            num_ranks=self.ranks,
            max_tokens_per_rank=self.max_tokens,
            block_m=64,  # the fused layer's pool alignment
            activation_clamp=self.clamp,
            fast_math=self.fast_math,
            activation=self.activation,
        )

    def command(self, device: str) -> str:
        return f"python -m megamoe.fuzz --device {device} --seed {self.seed} --case {self.index}"

    def describe(self) -> str:
        clamp = "none" if self.clamp is None else f"{self.clamp:g}"
        return (
            f"R={self.ranks} {self.promotion} {self.engine} H={self.hidden} I={self.intermediate} E={self.experts} "
            f"K={self.top_k} Tmax={self.max_tokens} T={list(self.tokens)} {self.distribution} "
            f"masked={self.masked:.2f} route={self.route_weights} clamp={clamp} "
            f"silu={'fast' if self.fast_math else 'precise'} x={self.x_scales} w={self.w_scales}"
            + (" nan" if self.nan_payloads else "")
            + (f" {self.activation}" if self.activation != "swiglu" else "")
            + (" predecoded" if self.predecoded else "")
        )


def draw(seed: int, index: int, *, small: bool = False) -> Case:
    """Case `index` of `seed`. small: CPU-sized shapes (the reference in CI)."""
    rnd = random.Random(f"{seed}:{index}")
    ranks = rnd.choices((1, 2, 4), (5, 3, 2))[0]
    promotion = rnd.choice(("k32", "k128"))
    if promotion == "k128":  # H and I multiples of 512
        hidden = rnd.choice((512, 1024) if small else (512, 1024, 1536, 2048))
        intermediate = 512 if small else rnd.choice((512, 1024))
    else:
        hidden = rnd.choice((128, 256, 384) if small else (128, 256, 384, 512, 768, 1024, 2048))
        intermediate = rnd.choice((128, 256) if small else (128, 256, 384, 512, 1024))
    local = rnd.choice((1, 2, 3, 4, 8) if small else (1, 2, 3, 4, 8, 16))
    experts = ranks * local
    top_k = rnd.randint(1, min(8, experts))
    max_tokens = rnd.choice((1, 5, 16, 33) if small else (1, 8, 31, 64, 100, 128, 256, 512))

    def rank_tokens() -> int:
        return rnd.choices((max_tokens, 0, rnd.randint(1, max_tokens)), (3, 1 if ranks > 1 else 0.3, 6))[0]

    tokens = tuple(rank_tokens() for _ in range(ranks))
    distribution = rnd.choices(ref.routing.DISTRIBUTIONS, (4, 2.5, 1.5, 2))[0]
    if distribution == "empty_experts" and top_k > experts // 2:
        distribution = "uniform"
    masked = rnd.choices((0.0, rnd.random(), 1.0), (6, 3, 1))[0]
    route_weights = rnd.choices(ROUTE_WEIGHTS, (6, 2.5, 1.5))[0]
    if route_weights == "cancel" and (top_k < 3 or experts < top_k + 1):
        route_weights = "wide"
    # The engine: mostly the layer's own choice; each engine fixed now and then (every engine runs
    # every layer the kernel takes).
    engine = rnd.choices(ENGINES, (6, 1.5, 2.5))[0]
    clamp = rnd.choices((None, rnd.choice((0.25, 1.5, 7.0)), round(rnd.uniform(0.1, 10.0), 3)), (5, 3, 2))[0]
    fast_math = rnd.random() < 0.5
    x_scales, w_scales = (rnd.choices(SCALE_MODES, (4, 2.5, 1.5, 2))[0] for _ in range(2))
    nan_payloads = rnd.random() < 0.15
    # SPEC §8's sizes (multiples of 32, not of 128) in a quarter of the exact mode's cases:
    # H and I 32-96 off their draw (down, or up from 128). From a generator of their own, so the draws
    # above are what they were before these sizes came (a seed's other cases unchanged).
    tails = random.Random(f"{seed}:{index}:tails")
    if promotion == "k32" and tails.random() < 0.25:
        hidden += 32 * tails.randint(1, 3) * (-1 if hidden > 128 else 1)
        intermediate += 32 * tails.randint(1, 3) * (-1 if intermediate > 128 else 1)
    # SPEC §8's activation, with biases, in a fifth of the cases (its own generator too); it clamps
    # at its limit, not at a drawn clamp.
    oai = random.Random(f"{seed}:{index}:activation")
    activation = "swiglu_oai" if oai.random() < 0.2 else "swiglu"
    if activation == "swiglu_oai":
        clamp = None
    # The exact mode's narrow engine fixed in a sixth of its cases (its own generator too): every
    # pool block of more than 8 rows then runs in parts.
    if promotion == "k32" and random.Random(f"{seed}:{index}:narrow").random() < 1 / 6:
        engine = "narrow"
    # A layer made with predecoded=True in a quarter of the cases (its own generator too): its prefill
    # engine's calls read the weights the standalone pass decoded when the layer was made.
    predecoded = random.Random(f"{seed}:{index}:predecoded").random() < 0.25
    return Case(
        seed=seed,
        index=index,
        ranks=ranks,
        promotion=promotion,
        engine=engine,
        hidden=hidden,
        intermediate=intermediate,
        experts=experts,
        top_k=top_k,
        max_tokens=max_tokens,
        tokens=tokens,
        distribution=distribution,
        masked=round(masked, 3),
        route_weights=route_weights,
        clamp=clamp,
        fast_math=fast_math,
        x_scales=x_scales,
        w_scales=w_scales,
        nan_payloads=nan_payloads,
        activation=activation,
        predecoded=predecoded,
    )


# ---------------------------------------------------------------------------------------------
# The case's tensors (on the CPU, from the case's own generator: the same bits for every device)


def _groups(scales: torch.Tensor, fraction: float, g: torch.Generator) -> torch.Tensor:
    """A random mask of `fraction` of the scale groups, drawn on the CPU, on the scales' device."""
    return _rand(scales, g) < fraction


def _rand(like: torch.Tensor, g: torch.Generator) -> torch.Tensor:
    """Uniform draws of the CPU generator (the same numbers for every device), on like's device."""
    return torch.rand(like.shape, generator=g).to(like.device)


def _spread(codes: torch.Tensor, scales: torch.Tensor, mode: str, g: torch.Generator, fp4: bool, fast: bool) -> None:
    """Apply a SCALE_MODES mode in place to one operand: codes [..., K] (E4M3 bytes) or [..., K/2]
    (packed FP4), scales [..., K/32] bytes; fast: the weights of a fast-mode case."""
    per_group = 16 if fp4 else 32  # code bytes of one 32-element group
    grouped = codes.view(*scales.shape, per_group)
    if mode == "wide":
        pick = _groups(scales, 0.25, g)
        drop = torch.randint(20, 41, scales.shape, generator=g, dtype=torch.int16).to(scales.device)
        lowered = (scales.to(torch.int16) - drop).clamp(min=0).to(torch.uint8)
        scales.copy_(torch.where(pick, lowered, scales))
    elif mode == "zero":
        pick = _groups(scales, 0.15, g)
        negative = _rand(scales, g) < 0.5  # -0: the sign bit alone
        zero = torch.where(negative, 0x88 if fp4 else 0x80, 0).to(torch.uint8)
        grouped.copy_(torch.where(pick[..., None], zero[..., None], grouped))
        to_byte0 = pick & (_rand(scales, g) < 0.5)
        scales.masked_fill_(to_byte0, 0)
    elif mode == "extreme":
        u = _rand(scales, g)
        scales.masked_fill_(u < 0.03, 0)
        if not fp4 or not fast:
            scales.masked_fill_(u > 0.995, 254)
        else:
            # The fast mode takes rows at most FAST_ROW_SPREAD binades under their expert's largest
            # (SPEC §2): byte 254 by lifting one expert's every byte so that its largest is 254.
            e = int(torch.randint(scales.shape[0], (1,), generator=g))
            lifted = scales[e].to(torch.int16) + (254 - int(scales[e].max()))
            scales[e] = torch.where(scales[e] == 0, 0, lifted.clamp(max=254)).to(torch.uint8)


def case_tensors(case: Case, device="cpu") -> tuple[ref.MoEConfig, list[ref.RankInputs], ref.ExpertWeights]:
    """The configuration, every rank's inputs (CPU tensors) and the global weights of a case (on
    `device`: the same bits on every device; quantizing the weights is most of a case's host time)."""
    cfg = case.cfg
    wseed = case.seed * 100_003 + case.index
    weights = ref.random_weights(case.experts, case.hidden, case.intermediate, seed=wseed, device=device)
    inputs = ref.make_inputs(
        cfg, list(case.tokens), seed=wseed, distribution=case.distribution, masked_ratio=case.masked
    )
    g = torch.Generator().manual_seed(wseed)
    for codes, scales in ((weights.w1, weights.w1_sf), (weights.w2, weights.w2_sf)):
        _spread(codes, scales, case.w_scales, g, fp4=True, fast=case.promotion == "k128")
    for inp in inputs:
        if inp.num_tokens == 0:
            continue
        x = inp.x.view(torch.uint8)
        _spread(x, inp.x_sf, case.x_scales, g, fp4=False, fast=False)
        if case.nan_payloads:  # E4M3 NaN codes (either sign) in a few elements of a few tokens
            nan = torch.rand(x.shape, generator=g) < 0.002
            x.copy_(
                torch.where(nan, torch.where(torch.rand(x.shape, generator=g) < 0.5, 0x7F, 0xFF), x).to(torch.uint8)
            )
        _route(case, cfg, inp, weights, g)
    if case.route_weights == "cancel":
        # Expert 1 is expert 0 with every w2 sign flipped: slots of experts 0 and 1 under equal
        # weights cancel exactly, and only an order that adds them first keeps the small slots.
        weights.w1[1], weights.w1_sf[1], weights.w2_sf[1] = weights.w1[0], weights.w1_sf[0], weights.w2_sf[0]
        weights.w2[1] = weights.w2[0] ^ 0x88
    if case.activation == "swiglu_oai":  # SPEC §8's biases, last: the draws above are the same
        b1 = torch.randn(case.experts, 2 * case.intermediate, generator=g).mul(4)
        b1 = torch.where(torch.rand(b1.shape, generator=g) < 0.05, -0.0, b1)  # some -0.0 biases
        weights.b1 = b1.to(torch.bfloat16).to(device)
        weights.b2 = torch.randn(case.experts, case.hidden, generator=g).to(torch.bfloat16).to(device)
    return cfg, inputs, weights


def _route(case: Case, cfg: ref.MoEConfig, inp: ref.RankInputs, weights: ref.ExpertWeights, g) -> None:
    t, k = inp.topk_idx.shape
    valid = inp.topk_idx >= 0
    if case.route_weights == "wide":  # 2^-24 .. 2^24, either sign
        binades = torch.randint(-24, 25, (t, k), generator=g).to(torch.float32)
        sign = torch.where(torch.rand(t, k, generator=g) < 0.3, -1.0, 1.0)
        inp.topk_weights.copy_(torch.where(valid, inp.topk_weights * sign * torch.exp2(binades), 0.0))
    elif case.route_weights == "cancel":
        # Half of the tokens: slots 0 and 1 on experts 0 and 1 under 2^10, the others small.
        rows = torch.rand(t, generator=g) < 0.5
        for r in rows.nonzero().flatten().tolist():
            others = [e for e in torch.randperm(cfg.num_experts, generator=g).tolist() if e > 1][: k - 2]
            inp.topk_idx[r] = torch.tensor([0, 1, *others])
            inp.topk_weights[r] = torch.tensor([2.0**10, 2.0**10] + [2.0**-10] * (k - 2))


# ---------------------------------------------------------------------------------------------
# Running cases


@dataclass
class Outcome:
    index: int
    ok: bool
    seconds: float
    detail: str = ""  # the suite's first failure, or the error


def check_dumps(dumps, *, plain: bool) -> tuple[bool, str]:
    """The suite on one call's dumps (every rank, each with its weights); end to end only where it
    says something."""
    from megamoe.conformance.suite import check

    report = check(dumps, end_to_end=plain)
    return report.ok, "" if report.ok else report.text()


def _plain(case: Case) -> bool:
    return min(case.tokens) > 0 and case.masked < 1.0


def run_cpu(case: Case, *, tamper=None) -> Outcome:
    """The reference's dumps of a case through the suite (no GPU)."""
    from megamoe.conformance.dump import reference_dumps

    start = time.monotonic()
    cfg, inputs, weights = case_tensors(case)
    dumps = reference_dumps(cfg, inputs, weights, tamper=tamper)
    ok, detail = check_dumps(dumps, plain=_plain(case))
    return Outcome(case.index, ok, time.monotonic() - start, detail)


def _lost_context(e: Exception) -> bool:
    """Whether an error is a CUDA error, after which this process runs nothing more on the GPU."""
    return "CUDA" in str(e) or "AcceleratorError" in type(e).__name__


def _gpu_call(case: Case, rank: int, group) -> tuple:
    """One rank's part of a GPU case: the debug call's dumps (with this rank's weights, which the
    judge then needs not make again) and whether the release call gave the same y bits."""
    from megamoe.moe import MegaMoE

    cfg, inputs, weights = case_tensors(case, "cuda")
    inp = inputs[rank].to("cuda")
    layer = MegaMoE(cfg, weights, group=group, promotion=case.promotion, engine=case.engine, predecoded=case.predecoded)
    with layer.named_failures():
        y, dumps = layer(inp.x, inp.x_sf, inp.topk_idx, inp.topk_weights, debug=True)
        y2 = layer(inp.x, inp.x_sf, inp.topk_idx, inp.topk_weights)
        same = torch.equal(y.view(torch.int16), y2.view(torch.int16))
    torch.cuda.synchronize()
    return dumps[0], same


def _rank_cases(rank: int, ranks: int, cases: list[Case]) -> list:
    """In a spawned rank: every case of this R, in order; an error is this case's outcome and,
    when it is a CUDA error (the context is lost), ends the list."""
    from megamoe import multirank

    torch.set_num_threads(max(1, (os.cpu_count() or ranks) // ranks))  # R processes share the cores
    out = []
    for case in cases:
        start = time.monotonic()
        try:
            out.append((case.index, *_gpu_call(case, rank, multirank.group()), None, time.monotonic() - start))
        except Exception as e:
            out.append((case.index, None, False, f"{type(e).__name__}: {e}", time.monotonic() - start))
            if _lost_context(e):
                break
    return out


def run_gpu(cases: list[Case], say) -> list[Outcome]:
    """The cases on the GPU: R = 1 in this process, each R > 1 in one spawn of R ranks."""
    outcomes: list[Outcome] = []
    by_ranks: dict[int, list[Case]] = {}
    for c in cases:
        by_ranks.setdefault(c.ranks, []).append(c)
    for ranks, group in sorted(by_ranks.items()):
        if ranks == 1:
            for case in group:
                start = time.monotonic()
                try:
                    dump, same = _gpu_call(case, 0, None)
                    outcomes.append(_judged(case, [dump], same, time.monotonic() - start))
                except Exception as e:
                    outcomes.append(Outcome(case.index, False, time.monotonic() - start, f"{type(e).__name__}: {e}"))
                    say(case, outcomes[-1])
                    if _lost_context(e):
                        return outcomes + _not_run(group[group.index(case) + 1 :], case)
                    continue
                say(case, outcomes[-1])
            continue
        for chunk in range(0, len(group), SPAWN_CASES):
            outcomes += _spawned(ranks, group[chunk : chunk + SPAWN_CASES], say)
    return outcomes


# Cases per spawn of several ranks: a spawn starts in about 5 s, and its results come back when its
# last case is done.
SPAWN_CASES = 24


def _spawned(ranks: int, group: list[Case], say) -> list[Outcome]:
    """Cases of R ranks in one spawn of R processes, judged here."""
    from megamoe import multirank

    outcomes: list[Outcome] = []
    try:
        per_rank = multirank.spawn(_rank_cases, ranks, args=(group,), timeout=120 + 60 * len(group))
    except multirank.RankFailed as e:
        for case in group:
            outcomes.append(Outcome(case.index, False, 0.0, f"the spawn of R={ranks} failed: {e}"))
            say(case, outcomes[-1])
        return outcomes
    done = {entry[0]: [] for entry in per_rank[0]}
    for rank_out in per_rank:
        for index, dump, same, error, seconds in rank_out:
            done.setdefault(index, []).append((dump, same, error, seconds))
    for case in group:
        got = done.get(case.index)
        if got is None or len(got) < ranks:
            outcomes.append(Outcome(case.index, False, 0.0, "not run: an earlier case lost the CUDA context"))
        elif any(error for _, _, error, _ in got):
            errors = [f"rank {r}: {error}" for r, (_, _, error, _) in enumerate(got) if error]
            outcomes.append(Outcome(case.index, False, max(s for *_, s in got), "\n".join(errors)))
        else:
            seconds = max(s for *_, s in got)
            outcomes.append(_judged(case, [d for d, *_ in got], all(s for _, s, _, _ in got), seconds))
        say(case, outcomes[-1])
    return outcomes


def _not_run(cases: list[Case], after: Case) -> list[Outcome]:
    return [Outcome(c.index, False, 0.0, f"not run: case {after.index} lost the CUDA context") for c in cases]


def _judged(case: Case, dumps, same: bool, seconds: float) -> Outcome:
    start = time.monotonic()
    ok, detail = check_dumps(dumps, plain=_plain(case))
    if not same:
        ok, detail = False, (detail + "\n" if detail else "") + "the release call's y differs from the debug call's"
    return Outcome(case.index, ok, seconds + time.monotonic() - start, detail)


# ---------------------------------------------------------------------------------------------
# Command line


def _say_line(total: int, device: str):
    counter = [0]

    def say(case: Case, outcome: Outcome) -> None:
        counter[0] += 1
        stream = sys.stderr
        status = "ok  " if outcome.ok else "FAIL"
        print(
            f"[{counter[0]}/{total}] {status} case {case.index} ({outcome.seconds:.1f} s) {case.describe()}",
            file=stream,
        )
        if not outcome.ok:
            print(f"    reproduce: {case.command(device)}", file=stream)
            for line in outcome.detail.strip().splitlines()[:40]:
                print(f"    {line}", file=stream)
        stream.flush()

    return say


def run(cases: list[Case], device: str, say) -> list[Outcome]:
    if device == "cpu":
        outcomes = []
        for case in cases:
            try:
                outcomes.append(run_cpu(case))
            except Exception:
                outcomes.append(Outcome(case.index, False, 0.0, traceback.format_exc()))
            say(case, outcomes[-1])
        return outcomes
    return run_gpu(cases, say)


def _sharded(args, cases: list[Case]) -> list[Outcome]:
    """--jobs J on the GPU: the one-rank cases in J processes at once, then the cases of several ranks
    one spawn after another in this process. (Ranks time-slice the GPU and wait for each other inside
    the kernel: beside other processes' kernels every such wait took a turn of all of them, and one
    case of two ranks took 85 s.) On the CPU every case goes to the J processes."""
    one = [c for c in cases if c.ranks == 1 or args.device == "cpu"]
    many = [c for c in cases if c not in one]
    with tempfile.TemporaryDirectory(prefix="megamoe-fuzz-") as tmp:
        procs = []
        for j in range(min(args.jobs, len(one))):
            out = os.path.join(tmp, f"shard{j}.json")
            cmd = [sys.executable, "-m", "megamoe.fuzz", "--device", args.device, "--seed", str(args.seed)]
            cmd += ["--indices", ",".join(str(c.index) for c in one[j :: args.jobs]), "--jobs", str(args.jobs)]
            cmd += ["--json", out]
            cmd += ["--small"] if args.small else []
            procs.append((subprocess.Popen(cmd), out))
        outcomes = []
        for p, out in procs:
            p.wait()
            if os.path.exists(out):
                with open(out) as f:
                    outcomes += [Outcome(**o) for o in json.load(f)]
    outcomes += run(many, args.device, _say_line(len(many), args.device))
    seen = {o.index for o in outcomes}
    outcomes += [Outcome(c.index, False, 0.0, "its shard ended without a result") for c in cases if c.index not in seen]
    return outcomes


def summary(cases: list[Case], outcomes: list[Outcome], device: str) -> str:
    by_index = {c.index: c for c in cases}
    failed = [o for o in outcomes if not o.ok]
    lines = [f"{len(outcomes)} cases on {device}: {len(outcomes) - len(failed)} passed, {len(failed)} failed"]
    fields = ("ranks", "promotion", "engine", "activation", "x_scales", "w_scales", "route_weights", "distribution")
    for field in fields:
        counts = Counter(getattr(by_index[o.index], field) for o in outcomes)
        lines.append(f"  {field:14s} " + ", ".join(f"{k}: {v}" for k, v in sorted(counts.items(), key=str)))
    extra = Counter()
    for o in outcomes:
        c = by_index[o.index]
        extra["T = 0 on a rank"] += 0 in c.tokens
        extra["T = T_max on a rank"] += c.max_tokens in c.tokens
        extra["uneven T"] += len(set(c.tokens)) > 1
        extra["every slot masked"] += c.masked == 1.0
        extra["clamp"] += c.clamp is not None
        extra["precise SiLU"] += not c.fast_math
        extra["NaN payloads"] += c.nan_payloads
        extra["H or I not whole K blocks"] += bool(c.hidden % 128 or c.intermediate % 128)
        extra["predecoded layer"] += c.predecoded
    lines.append("  " + ", ".join(f"{k}: {v}" for k, v in extra.items()))
    for o in failed:
        lines.append(f"FAILED case {o.index}: {by_index[o.index].command(device)}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m megamoe.fuzz", description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--device", choices=("cpu", "cuda"), default="cpu", help="cuda: the fused kernel; cpu: the reference"
    )
    p.add_argument("--seed", type=int, default=0, help="the run's seed (default 0)")
    p.add_argument("--cases", type=int, default=20, help="how many cases (default 20)")
    p.add_argument("--first", type=int, default=0, help="the first case's index (default 0)")
    p.add_argument("--case", type=int, help="run this one case only (what a failure prints)")
    p.add_argument("--small", action="store_true", help="CPU-sized shapes (the default on the CPU)")
    p.add_argument(
        "--jobs",
        type=int,
        default=1,
        help="processes at once (default 1; on the GPU the cases of several ranks run after them, one at a time)",
    )
    p.add_argument(
        "--ranks",
        help="only the drawn cases of these R, comma-separated (e.g. 1, or 2,4: a run in two parts)",
    )
    p.add_argument("--indices", help=argparse.SUPPRESS)  # a shard's cases (--jobs)
    p.add_argument("--json", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.cases < 1 or args.jobs < 1 or args.first < 0:
        p.error("--cases and --jobs must be at least 1, --first at least 0")
    if args.device == "cuda" and not torch.cuda.is_available():
        print("megamoe.fuzz: --device cuda needs a CUDA GPU; --device cpu fuzzes the reference", file=sys.stderr)
        return 2
    small = args.small or args.device == "cpu"
    args.small = small
    if args.indices:
        indices = [int(i) for i in args.indices.split(",")]
    elif args.case is not None:
        indices = [args.case]
    else:
        indices = list(range(args.first, args.first + args.cases))
    cases = [draw(args.seed, i, small=small) for i in indices]
    if args.ranks:
        try:
            keep = {int(r) for r in args.ranks.split(",")}
        except ValueError:
            p.error(f"--ranks: comma-separated rank counts, got {args.ranks!r}")
        cases = [c for c in cases if c.ranks in keep]
        if not cases:
            p.error(f"--ranks {args.ranks}: none of the drawn cases has that R")
    if args.jobs > 1 and len(cases) > 1 and not args.indices:
        outcomes = _sharded(args, cases)
    else:
        if args.indices:
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // args.jobs))
        outcomes = run(cases, args.device, _say_line(len(cases), args.device))
    if args.json:
        with open(args.json, "w") as f:
            json.dump([dataclasses.asdict(o) for o in outcomes], f)
        return 0
    print(summary(cases, outcomes, args.device))
    return 0 if all(o.ok for o in outcomes) else 1


if __name__ == "__main__":
    sys.exit(main())
