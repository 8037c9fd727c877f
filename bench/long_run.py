"""Many calls in a row on one fused layer: `python -m bench.long_run --calls 10000 [--ranks 2]`.

One layer (R = 1, or R ranks as processes on the GPUs there are) takes `--calls` calls, each on one
of `--inputs` prepared inputs (varying T, routing distribution and masked fraction; the order drawn
from a seed). Every `--every` calls it synchronises and checks, on every rank:
* y of the last `--inputs` calls equals, bit for bit, y of a fresh layer (made once, called once per
  input at the start) for the same input;
* `recv_stats` equals the sum of N_e over every call so far (from the inputs' routing);
* every counter region of the workspace is zero (contract.COUNTERS: D10's clean state) and the
  epoch counts the calls;
* memory: torch's allocated bytes, against the start.
It prints one row per window: calls so far, µs per call over the window (CUDA events, calls queued
without synchronising), and the checks; the exit code is 1 when any check failed."""

from __future__ import annotations

import argparse
import random
import sys

SHAPE = dict(hidden=1024, intermediate=512, num_experts=16, top_k=4, max_tokens_per_rank=128)
DISTRIBUTIONS = ("uniform", "skewed", "one_hot", "empty_experts")


def _inputs(cfg, n: int, seed: int):
    """n inputs of every rank: T per rank, distribution and masked fraction drawn from the seed."""
    from megamoe import reference as ref

    rnd = random.Random(seed)
    out = []
    for i in range(n):
        tokens = [rnd.choice((0, 1, 7, 64, cfg.max_tokens_per_rank, rnd.randint(1, cfg.max_tokens_per_rank)))]
        tokens += [rnd.randint(0, cfg.max_tokens_per_rank) for _ in range(cfg.num_ranks - 1)]
        dist = rnd.choice(DISTRIBUTIONS)
        masked = rnd.choice((0.0, 0.0, 0.3, 1.0))
        out.append(ref.make_inputs(cfg, tokens, seed=seed * 1000 + i, distribution=dist, masked_ratio=masked))
    return out


def _received(cfg, inputs, rank: int):
    """int64 [E_l]: N_e of this rank's local experts for one call's inputs (every rank's slots)."""
    import torch

    e_l = cfg.local_experts
    idx = torch.cat([inp.topk_idx.flatten() for inp in inputs])
    local = idx[(idx >= rank * e_l) & (idx < (rank + 1) * e_l)] - rank * e_l
    return torch.bincount(local, minlength=e_l).to(torch.int64)


def run_rank(rank: int, ranks: int, calls: int, every: int, n_inputs: int, seed: int) -> list[dict]:
    import torch

    from megamoe import multirank
    from megamoe import reference as ref
    from megamoe.jit import contract as C
    from megamoe.moe import MegaMoE

    group = multirank.group() if ranks > 1 else None
    cfg = ref.MoEConfig(**SHAPE, num_ranks=ranks)
    weights = ref.random_weights(cfg.num_experts, cfg.hidden, cfg.intermediate, seed=seed, device="cuda")
    inputs = _inputs(cfg, n_inputs, seed)
    mine = [inp[rank].to("cuda") for inp in inputs]
    received = [_received(cfg, inp, rank).cuda() for inp in inputs]
    # What a fresh layer gives for each input: its first call on that input.
    expected = []
    for inp in mine:
        fresh = MegaMoE(cfg, weights, group=group)
        expected.append(fresh(inp.x, inp.x_sf, inp.topk_idx, inp.topk_weights).clone())
        del fresh
    torch.cuda.synchronize()
    layer = MegaMoE(cfg, weights, group=group)
    order = random.Random(seed + 1).choices(range(n_inputs), k=calls)
    made = [0] * n_inputs  # calls made on each input (host counts: nothing added to the timed window)
    epoch0 = int(layer.ws["epoch"][0])
    mem0 = torch.cuda.memory_allocated()
    rows = []
    ys: dict[int, torch.Tensor] = {}
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    done = 0
    with layer.named_failures():
        while done < calls:
            window = order[done : done + every]
            start.record()
            for i in window:
                inp = mine[i]
                ys[i] = layer(inp.x, inp.x_sf, inp.topk_idx, inp.topk_weights)
                made[i] += 1
            end.record()
            torch.cuda.synchronize()
            done += len(window)
            last = set(window[-n_inputs:])
            same = all(torch.equal(ys[i].view(torch.int16), expected[i].view(torch.int16)) for i in last)
            clean = all(not layer.ws[name].any() for name in C.COUNTERS)
            rows.append(
                dict(
                    calls=done,
                    us_per_call=start.elapsed_time(end) * 1000 / len(window),
                    y_equal=same,
                    recv_stats=bool(torch.equal(layer.recv_stats, sum(n * r for n, r in zip(made, received)))),
                    counters_clean=clean,
                    epoch=int(layer.ws["epoch"][0]) - epoch0 == done,
                    mem_delta=torch.cuda.memory_allocated() - mem0,
                )
            )
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.long_run", description=__doc__.split("\n\n")[0])
    p.add_argument("--calls", type=int, default=10000, help="calls in a row (default 10000)")
    p.add_argument("--every", type=int, default=500, help="calls per window between checks (default 500)")
    p.add_argument("--inputs", type=int, default=16, help="prepared inputs the calls cycle through (default 16)")
    p.add_argument("--ranks", type=int, default=1, help="R (processes; default 1)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if min(args.calls, args.every, args.inputs, args.ranks) < 1:
        p.error("--calls, --every, --inputs and --ranks must be at least 1")
    import torch

    if not torch.cuda.is_available():
        print("bench.long_run needs a CUDA GPU (it calls the fused kernel)", file=sys.stderr)
        return 2
    run = (args.calls, args.every, args.inputs, args.seed)
    if args.ranks == 1:
        per_rank = [run_rank(0, 1, *run)]
    else:
        from megamoe import multirank

        per_rank = multirank.spawn(run_rank, args.ranks, args=run, timeout=3600)
    print(f"{args.calls} calls, R = {args.ranks}, {args.inputs} inputs, shape {SHAPE}")
    print(
        "| calls | µs/call (rank 0) | y = fresh layer's | recv_stats exact | counters zero | epoch = calls | memory Δ bytes |"
    )
    print("|---|---|---|---|---|---|---|")
    ok = True
    for w, rows in enumerate(zip(*per_rank)):
        flags = [all(r[k] for r in rows) for k in ("y_equal", "recv_stats", "counters_clean", "epoch")]
        ok &= all(flags)
        mem = max(r["mem_delta"] for r in rows)
        cells = " | ".join("yes" if f else "NO" for f in flags)
        print(f"| {rows[0]['calls']} | {rows[0]['us_per_call']:.1f} | {cells} | {mem} |")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
