"""Where a fused layer call's time goes: `python -m bench.timeline`.

    python -m bench.timeline --shape gpt-oss --tokens 4096                  # the bars' prefill size
    python -m bench.timeline --shape dsv3 --tokens 8 --promotion k128 --engine swapab

One layer of a bench.layer shape (one rank holding its E experts, the same weights and inputs), run
on the fused kernel's timeline build (megamoe.timeline: the release build with %globaltimer stamps of
each CTA's phases and items). Prints the release build's graph-timed call beside the stamped call's
span (what the stamps cost), then the stamps' two tables: each phase's min / median / max over the
CTAs, and each layer's items with their gate waits (an L1 item waits for its pool rows, an L2 item for
its rows' L1 tiles). The split this gives is what bench/NOTES.md's plans start from (v22 did it with a
build that was not kept)."""

from __future__ import annotations

import argparse
import sys

import torch

from megamoe import reference as ref
from megamoe.jit import build as jb

from .gemm import eager_us, graph_us
from .layer import LAYER_SHAPES, ROUTINGS, SEED, launches_for, layer_config, progress, shape_weights


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m bench.timeline", description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", choices=sorted(LAYER_SHAPES), default="gpt-oss")
    p.add_argument("--tokens", type=int, default=4096, help="T, the call's tokens (default 4096)")
    p.add_argument("--promotion", choices=("k32", "k128"), default="k32", help="exact (k32, default) or fast mode")
    p.add_argument("--engine", choices=("auto", *jb.FUSED_ENGINES), default="auto")
    p.add_argument("--routing", choices=sorted(ROUTINGS), default="uniform")
    p.add_argument(
        "--predecoded", action="store_true", help="MegaMoE(predecoded=True): the prefill engine's weights decoded once"
    )
    p.add_argument("--calls", type=int, default=3, help="timeline calls; the last one's stamps are printed")
    args = p.parse_args(argv)
    if args.tokens < 1 or args.calls < 1:
        p.error("--tokens and --calls: at least 1")
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("bench.timeline needs a CUDA GPU (it runs the layer's kernel)")
    from megamoe.moe import MegaMoE  # imported late: bench.layer's reasons

    cfg = layer_config(args.shape, args.tokens)
    layer = MegaMoE(
        cfg, shape_weights(args.shape), promotion=args.promotion, engine=args.engine, predecoded=args.predecoded
    )
    inp = ref.make_inputs(cfg, args.tokens, seed=SEED, distribution=ROUTINGS[args.routing], device="cuda")[0]
    inputs = (inp.x, inp.x_sf, inp.topk_idx, inp.topk_weights)
    progress(f"{args.shape} T={args.tokens} {args.promotion}: the release build, graph-timed")
    release_us = graph_us(lambda: layer(*inputs, check_inputs=False), launches=launches_for(args.tokens))
    release_eager_us = eager_us(lambda: layer(*inputs, check_inputs=False))[0]
    progress(f"{args.shape} T={args.tokens} {args.promotion}: {args.calls} calls of the timeline build")
    spans, timed = [], []
    for _ in range(args.calls):
        # Event-timed too (one eager call: the launch's host latency included, some us), so that a
        # gap between the release build's time and the stamped span tells whether it is the stamps'
        # coverage (entry and exit, which they cannot see) or the release build itself.
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        _, tl = layer(*inputs, check_inputs=False, timeline=True)
        b.record()
        b.synchronize()
        spans.append(tl.span_us)
        timed.append(a.elapsed_time(b) * 1000.0)
    print(
        f"{args.shape} T={args.tokens} {args.routing}, promotion {args.promotion}, engine {tl.engine}"
        f"{' (predecoded)' if args.predecoded else ''}: release build"
        f" {release_us:.1f} us a call (CUDA-graph replay; {release_eager_us:.1f} eager, back to back); timeline build, first CTA entry to last combine:"
        f" {', '.join(f'{s:.1f}' for s in spans)} us (event-timed, launch included: {', '.join(f'{t:.1f}' for t in timed)})"
    )
    print(tl.format())


if __name__ == "__main__":
    main()
