"""The fused-kernel hook scenarios of tests/gpu/test_gemm_fused_hooks.py that can end in a trap
(which kills the process's CUDA context), run in a subprocess from the repository root:

    python -m tests.gpu.gemm_hooks_worker gated [VARIANT ...]      # default: every variant
    python -m tests.gpu.gemm_hooks_worker gated --list
    python -m tests.gpu.gemm_hooks_worker timeout [--block B] [--observed N]

gated: the GEMM runs on one stream with its arrival counters at zero while a second stream, after
a delay, writes the real pool rows block by block (half the rows and a partial count first, then
the rest and the full count) over a poisoned copy; the output must equal the ungated launch's, bit
for bit. The GEMM's persistent grid has one CTA per SM, so the shapes keep the number of work
items well under the number of SMs: CTAs without items exit and leave SMs to the filler. Should
the filler still be starved, the GEMM traps after its spin timeout (~10 s) instead of hanging.

timeout: every counter full but pool block B's, which stays at N < its valid rows; the kernel
must trap and leave a timeout record naming that counter (megamoe.gemm.timeout_message()).

Each scenario prints one line `HOOKS_RESULT <json>` (per variant) and the process exits 0 once it
is done, trap or not; argument errors exit 2, no CUDA device exits 3.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

from .gemm_helpers import Pool, combine_rows, first_diff, pool_arrivals, setup_l1

PREFIX = "HOOKS_RESULT "

# Shapes: L1 2I = 1024 and L2 H = 1024 weight rows (8 N blocks of 128); pool alignment and arrival
# block 64 (BLOCK_M). Pool blocks: 0 (1 valid row), 1 (63), 2 (64), 3 (1), 4 (64), 5 (64), 6 (2),
# 7 (padding only).
H, INTER = 1024, 512
COUNTS = [0, 1, 63, 65, 130]
BLOCK = 64
DELAY_MS = 20.0  # before the filler writes anything
STEP_MS = 1.0  # between two writes of the filler
SEED = 31

# name -> (layer, promotion, max_tile, poisoned input, order in which the pool blocks are filled)
VARIANTS = {
    "l1-exact-bn32-x": (1, "k32", 32, "x", "forward"),
    "l1-exact-bn32-x_sf": (1, "k32", 32, "x_sf", "forward"),
    "l1-exact-bn32-w_route": (1, "k32", 32, "w_route", "forward"),
    "l1-fast-bn128-x-forward": (1, "k128", 128, "x", "forward"),
    "l1-fast-bn128-x-reverse": (1, "k128", 128, "x", "reverse"),
    "l2-exact-bn64-x": (2, "k32", 64, "x", "forward"),
}


def emit(**kw) -> None:
    print(PREFIX + json.dumps(kw), flush=True)


def make_problem(layer: int):
    """(pool, KernelWeights) of the scenario, on the GPU: the pool's K is H (L1) or I (L2)."""
    pool, _, kw = setup_l1(H, INTER, COUNTS, SEED, align=BLOCK)
    if layer == 2:
        pool = Pool(COUNTS, INTER, gen=torch.Generator().manual_seed(SEED + 1), align=BLOCK)
    return pool, kw


def block_arrivals_host() -> list[int]:
    """Valid rows of each pool block (computed on the CPU, same layout as on the GPU)."""
    pool = Pool(COUNTS, 128, gen=torch.Generator().manual_seed(0), align=BLOCK, device="cpu")
    return pool_arrivals(pool, BLOCK).tolist()


def cycles_per_ms() -> float:
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(1_000_000)
    a.record()
    torch.cuda._sleep(20_000_000)
    b.record()
    b.synchronize()
    return 20_000_000 / a.elapsed_time(b)


class Launcher:
    """One layer's launch on given (x, scales, w_route) into preallocated outputs."""

    def __init__(self, layer: int, promotion: str, max_tile: int):
        from megamoe import gemm as G

        self.G, self.layer, self.promotion, self.max_tile = G, layer, promotion, max_tile
        self.pool, self.kw = make_problem(layer)
        pool = self.pool
        if promotion == "k128":
            self.x, self.sf = G.rebase_k128(pool.x, pool.sf)
        else:
            self.x, self.sf = pool.x, pool.sf
        if layer == 2:
            _, self.dst = combine_rows(pool, H, K=2, gen=torch.Generator().manual_seed(SEED + 2))
        n_rows = 2 * INTER if layer == 1 else H
        wgs = G.spec_for(layer, promotion=promotion, n_rows=n_rows, max_tile=max_tile).wgs
        self.items = sum(-(-n // max_tile) for n in COUNTS) * (n_rows // (64 * wgs))

    def outputs(self):
        P = self.pool.P
        if self.layer == 1:
            return (
                torch.full((P, INTER), 0x55, dtype=torch.uint8, device="cuda"),
                torch.full((P, INTER // 32), 0x55, dtype=torch.uint8, device="cuda"),
            )
        comb = torch.full((2, sum(COUNTS), H), 0x7FA5, dtype=torch.int16, device="cuda")
        return (comb,)

    def launch(self, outs, x, sf, w_route, **gate):
        pool, G = self.pool, self.G
        sf128 = sf if self.promotion == "k128" else None
        if self.layer == 1:
            G.l1_gemm(
                x,
                sf,
                pool.offsets,
                pool.num_tokens,
                w_route,
                self.kw,
                promotion=self.promotion,
                max_tile=self.max_tile,
                out=outs[0].view(torch.float8_e4m3fn),
                out_sf=outs[1],
                x_sf128=sf128,
                **gate,
            )
        else:
            G.l2_gemm(
                x,
                sf,
                pool.offsets,
                pool.num_tokens,
                self.dst,
                self.kw,
                outs[0].view(torch.bfloat16),
                promotion=self.promotion,
                max_tile=self.max_tile,
                x_sf128=sf128,
                **gate,
            )


def run_gated(name: str, cpm: float) -> bool:
    """One variant; returns False when the CUDA context is lost (a trap)."""
    layer, promotion, max_tile, poison, order = VARIANTS[name]
    la = Launcher(layer, promotion, max_tile)
    pool = la.pool
    sms = torch.cuda.get_device_properties(pool.x.device).multi_processor_count
    base = dict(
        variant=name,
        layer=layer,
        promotion=promotion,
        max_tile=max_tile,
        poison=poison,
        order=order,
        items=la.items,
        sms=sms,
        delay_ms=DELAY_MS,
    )
    if la.items > sms - 8:
        emit(**base, skipped=f"{la.items} work items leave too few of the {sms} SMs to the filler stream")
        return True

    ref = la.outputs()
    la.launch(ref, la.x, la.sf, pool.w_route)
    torch.cuda.synchronize()

    real = {"x": la.x, "x_sf": la.sf, "w_route": pool.w_route}
    gated = {k: v.clone() for k, v in real.items()}
    poison_value = {"x": 0x7F, "x_sf": 0xFE, "w_route": float("nan")}[poison]
    gated[poison][pool.valid] = poison_value
    full = pool_arrivals(pool, BLOCK)
    counters = torch.zeros_like(full)
    outs = la.outputs()
    blocks = [b for b, n in enumerate(full.tolist()) if n > 0]
    if order == "reverse":
        blocks.reverse()
    need = full.tolist()
    torch.cuda.synchronize()

    s_gemm, s_fill = torch.cuda.Stream(), torch.cuda.Stream()
    ev = {k: torch.cuda.Event(enable_timing=True) for k in ("start", "gemm_end", "fill_end")}
    error = None
    try:
        with torch.cuda.stream(s_gemm):
            ev["start"].record()
            la.launch(outs, gated["x"], gated["x_sf"], gated["w_route"], arrival=counters, arrival_block=BLOCK)
            ev["gemm_end"].record()
        with torch.cuda.stream(s_fill):
            torch.cuda._sleep(int(DELAY_MS * cpm))
            dst, src = gated[poison], real[poison]
            for b in blocks:
                r0, half = b * BLOCK, need[b] // 2
                if half > 0:  # first half of the valid rows, and a partial count
                    torch.cuda._sleep(int(STEP_MS * cpm))
                    dst[r0 : r0 + half].copy_(src[r0 : r0 + half])
                    counters[b : b + 1].fill_(half)
                torch.cuda._sleep(int(STEP_MS * cpm))
                dst[r0 + half : r0 + BLOCK].copy_(src[r0 + half : r0 + BLOCK])
                counters[b : b + 1].fill_(need[b])
            ev["fill_end"].record()
        torch.cuda.synchronize()
    except Exception as e:  # noqa: BLE001 (a trap: report it, the context is gone)
        error = f"{type(e).__name__}: {e}"
    if error is not None:
        from megamoe import gemm as G

        emit(**base, error=error, timeout_message=G.timeout_message(pool.x.device.index or 0))
        return False
    equal = all(torch.equal(a, b) for a, b in zip(outs, ref))
    diff = "; ".join(first_diff(a, b) for a, b in zip(outs, ref))
    emit(
        **base,
        equal=equal,
        diff=diff,
        gemm_ms=ev["start"].elapsed_time(ev["gemm_end"]),
        fill_ms=ev["start"].elapsed_time(ev["fill_end"]),
    )
    return True


def run_timeout(block: int, observed: int, need: int) -> None:
    from megamoe import gemm as G

    la = Launcher(1, "k32", 64)
    pool = la.pool
    counters = pool_arrivals(pool, BLOCK)
    assert int(counters[block]) == need
    counters[block] = observed
    outs = la.outputs()
    torch.cuda.synchronize()
    dev = pool.x.device.index or 0
    t0 = time.monotonic()
    error = None
    try:
        la.launch(outs, la.x, la.sf, pool.w_route, arrival=counters, arrival_block=BLOCK)
        torch.cuda.synchronize()
    except Exception as e:  # noqa: BLE001
        error = f"{type(e).__name__}: {e}"
    elapsed = time.monotonic() - t0
    rec = G._ERR.get(dev)
    emit(
        scenario="timeout",
        block=block,
        need=need,
        observed=observed,
        error=error,
        elapsed_s=elapsed,
        timeout_message=G.timeout_message(dev),
        record=rec.tolist() if rec is not None else None,
    )


def parse_args(argv):
    ap = argparse.ArgumentParser(prog="python -m tests.gpu.gemm_hooks_worker", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="scenario", required=True)
    g = sub.add_parser("gated", help="arrival gate with counters filled late by a second stream")
    g.add_argument("variants", nargs="*", metavar="VARIANT", help="default: all of --list")
    g.add_argument("--list", action="store_true", help="print the variants and exit")
    t = sub.add_parser("timeout", help="a counter that never fills: trap with a timeout record")
    t.add_argument("--block", type=int, default=5, help="pool block whose counter stays short (default 5)")
    t.add_argument("--observed", type=int, default=40, help="the value it stays at (default 40)")
    args = ap.parse_args(argv)
    if args.scenario == "gated":
        bad = [v for v in args.variants if v not in VARIANTS]
        if bad:
            ap.error(f"unknown variant(s) {', '.join(bad)}; known: {', '.join(VARIANTS)}")
        args.variants = args.variants or list(VARIANTS)
    else:
        need = block_arrivals_host()
        if not 0 <= args.block < len(need) or need[args.block] == 0:
            ap.error(
                f"--block: expected a pool block with valid rows, one of "
                f"{[b for b, n in enumerate(need) if n]}, got {args.block}"
            )
        if not 0 <= args.observed < need[args.block]:
            ap.error(
                f"--observed: expected 0 <= N < {need[args.block]} (the valid rows of block {args.block}), "
                f"got {args.observed}"
            )
        args.need = need[args.block]
    return args


def main(argv=None) -> None:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    if args.scenario == "gated" and args.list:
        for name, v in VARIANTS.items():
            print(name, "layer={} promotion={} max_tile={} poison={} order={}".format(*v))
        return
    if not torch.cuda.is_available():
        print("gemm_hooks_worker: needs a CUDA device", file=sys.stderr)
        sys.exit(3)
    if args.scenario == "gated":
        cpm = cycles_per_ms()
        for i, name in enumerate(args.variants):
            if not run_gated(name, cpm):
                for rest in args.variants[i + 1 :]:
                    emit(variant=rest, error="not run: the CUDA context was lost by an earlier variant")
                break
    else:
        run_timeout(args.block, args.observed, args.need)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # skip CUDA teardown, which can fail or hang after a trap


if __name__ == "__main__":
    main()
