"""The fused-kernel hook scenarios of tests/gpu/test_gemm_fused_hooks.py that can end in a trap
(which kills the process's CUDA context), run in a subprocess from the repository root:

    python -m tests.gpu.gemm_hooks_worker gated [VARIANT ...]      # default: every variant
    python -m tests.gpu.gemm_hooks_worker gated --list
    python -m tests.gpu.gemm_hooks_worker timeout [--block B] [--observed N]

gated: the GEMM runs on one stream with its arrival counters at zero while a second stream (the
filler), after a delay, writes the real values of one input of the pool rows over a poisoned copy,
block by block (half the rows and a partial count first, then the rest and the full count). The
late input is the payload x, its scales x_sf, or the routing weights w_route (L1 only); the others
are in place at the launch. A variant is one layer, promotion and largest token tile (every tile
of contract.TOKEN_TILES the promotion has: 8..64 for k32, 8..256 for k128), one late input and one
fill order. The output must equal the ungated launch's, bit for bit; a snapshot of the output taken
just before the last counter is raised (that block's rows are already real) must still hold the
sentinel on that block's rows (only the gate can have held them) and hold final rows elsewhere
(the GEMM ran while the filler did). The GEMM's persistent grid has one CTA per SM, so the shapes
keep the number of work items well under the number of SMs: CTAs without items exit and leave SMs
to the filler. Should the filler still be starved, the GEMM traps after its spin timeout (~10 s)
instead of hanging.

Module loading: see load_filler_kernels. The worker sets CUDA_MODULE_LOADING=EAGER unless the
environment already names a mode; CUDA_MODULE_LOADING=LAZY checks the warm-up alone.

timeout: every counter full but pool block B's, which stays at N < its valid rows; the kernel
must trap and leave a timeout record naming that counter (megamoe.gemm.timeout_message()).

Each scenario prints one line `HOOKS_RESULT <json>` (per variant) and the process exits 0 once it
is done, trap or not; argument errors exit 2, no CUDA device exits 3. After a trap the variants
left are reported as not run (the context is gone).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time

import torch

from megamoe.jit import build as jb
from megamoe.jit import contract

from .gemm_helpers import Pool, combine_rows, first_diff, pool_arrivals, setup_l1

PREFIX = "HOOKS_RESULT "

# Shapes: L1 2I = 1024 and L2 H = 1024 weight rows; pool alignment and arrival block 64 (BLOCK_M).
# Experts of 0, 1, 9, 17 and 70 rows: pool blocks 0 (1 valid row), 1 (9), 2 (17), 3 (64), 4 (6),
# 5 (padding only). Small enough that every token tile, 8 included, leaves SMs to the filler
# (work items: 60 at tile 8 with 4 consumer warpgroups, 72 at 16, 48 at 32, 40 at 64, 32 at 128),
# and every tile has items at both of its kernel's tiles (items of <= 8 rows run at 8) and an
# expert over two pool blocks (at tile 128 one item waits for both).
H, INTER = 1024, 512
COUNTS = [0, 1, 9, 17, 70]
BLOCK = 64
DELAY_MS = 20.0  # before the filler writes anything
STEP_MS = 1.0  # between two writes of the filler
SEED = 31
SPARE_SMS = 8  # SMs that must stay free of GEMM CTAs for the filler's kernels
TIMEOUT_BLOCK = 3  # the timeout scenario's default block: 64 valid rows
SENTINEL_U8 = 0x55
SENTINEL_I16 = 0x7FA5  # a bf16 NaN payload the kernel never writes
POISON = {"x": 0x7F, "x_sf": 0xFE, "w_route": float("nan")}  # e4m3 NaN, scale 2^127, NaN


@dataclasses.dataclass(frozen=True)
class Variant:
    layer: int
    promotion: str
    max_tile: int
    late: str  # the input written by the filler: "x", "x_sf" or "w_route"
    order: str = "forward"  # the order in which the filler completes the pool blocks

    @property
    def name(self) -> str:
        tail = "" if self.order == "forward" else f"-{self.order}"
        return f"l{self.layer}-{self.promotion}-t{self.max_tile}-{self.late}{tail}"

    @property
    def group(self) -> str:
        """Variants run together in one worker process (one CUDA start-up for all of them)."""
        return f"l{self.layer}-{self.promotion}"


def _variants() -> list[Variant]:
    out = []
    for layer in (1, 2):
        for promotion in jb.PROMOTIONS:
            tiles = [t for t in contract.TOKEN_TILES if t <= jb.max_tile_of(promotion)]
            for tile in tiles:
                for late in ("x", "x_sf", "w_route") if layer == 1 else ("x", "x_sf"):
                    out.append(Variant(layer, promotion, tile, late))
            # Last block first, at the largest tile: at 128, expert 4's one item waits for blocks 3
            # and 4, and the block that completes it is then the earlier one.
            out.append(Variant(layer, promotion, tiles[-1], "x", "reverse"))
    return out


VARIANTS = {v.name: v for v in _variants()}


def n_rows_of(layer: int) -> int:
    return 2 * INTER if layer == 1 else H


def spec_of(v: Variant):
    """The specialisation a variant launches (what l1_gemm / l2_gemm pick for these arguments)."""
    from megamoe import gemm as G

    return G.spec_for(v.layer, promotion=v.promotion, n_rows=n_rows_of(v.layer), max_tile=v.max_tile)


def work_items(v: Variant) -> int:
    return sum(-(-n // v.max_tile) for n in COUNTS) * (n_rows_of(v.layer) // (contract.ROWS_PER_WG * spec_of(v).wgs))


def emit(**kw) -> None:
    print(PREFIX + json.dumps(kw), flush=True)


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


_PROBLEMS: dict[int, tuple] = {}


def problem(layer: int):
    """(pool, KernelWeights) of a layer, on the GPU (built once per process): the pool's K is H (L1)
    or I (L2)."""
    if layer not in _PROBLEMS:
        pool, _, kw = setup_l1(H, INTER, COUNTS, SEED, align=BLOCK)
        if layer == 2:
            pool = Pool(COUNTS, INTER, gen=torch.Generator().manual_seed(SEED + 1), align=BLOCK)
        _PROBLEMS[layer] = (pool, kw)
    return _PROBLEMS[layer]


class Launcher:
    """One layer's launch at one promotion and largest tile, on given (x, scales, w_route), into
    preallocated outputs; the ungated launch's outputs are computed once (reference())."""

    def __init__(self, layer: int, promotion: str, max_tile: int):
        from megamoe import gemm as G

        self.G, self.layer, self.promotion, self.max_tile = G, layer, promotion, max_tile
        self.pool, self.kw = problem(layer)
        pool = self.pool
        if promotion == "k128":
            self.x, self.sf = G.rebase_k128(pool.x, pool.sf)
        else:
            self.x, self.sf = pool.x, pool.sf
        if layer == 2:
            _, self.dst = combine_rows(pool, H, K=2, gen=torch.Generator().manual_seed(SEED + 2))
        self._ref = None

    def outputs(self):
        P = self.pool.P
        if self.layer == 1:
            return (
                torch.full((P, INTER), SENTINEL_U8, dtype=torch.uint8, device="cuda"),
                torch.full((P, INTER // 32), SENTINEL_U8, dtype=torch.uint8, device="cuda"),
            )
        return (torch.full((2, sum(COUNTS), H), SENTINEL_I16, dtype=torch.int16, device="cuda"),)

    def reference(self):
        if self._ref is None:
            self._ref = self.outputs()
            self.launch(self._ref, self.x, self.sf, self.pool.w_route)
            torch.cuda.synchronize()
        return self._ref

    def rows(self, outs, pool_rows: torch.Tensor) -> list[torch.Tensor]:
        """The output rows of the given pool rows, one 2-D tensor per output."""
        if self.layer == 1:
            return [o[pool_rows] for o in outs]
        return [outs[0].view(-1, H)[self.dst[pool_rows].long()]]

    def launch(self, outs, x, sf, w_route, **gate):
        pool, G = self.pool, self.G
        sf128 = sf if self.promotion == "k128" else None
        if self.layer == 1:
            G.l1_gemm(
                x,
                sf,
                pool.offsets,
                pool.expert_rows,
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
                pool.expert_rows,
                self.dst,
                self.kw,
                outs[0].view(torch.bfloat16),
                promotion=self.promotion,
                max_tile=self.max_tile,
                x_sf128=sf128,
                **gate,
            )


_LAUNCHERS: dict[tuple, Launcher] = {}


def launcher(v: Variant) -> Launcher:
    key = (v.layer, v.promotion, v.max_tile)
    if key not in _LAUNCHERS:
        _LAUNCHERS[key] = Launcher(*key)
    return _LAUNCHERS[key]


def fill_plan(order: str) -> list[tuple[int, int, int]]:
    """(pool block, rows written first, valid rows) for each block with valid rows, in fill order."""
    need = block_arrivals_host()
    plan = [(b, n // 2, n) for b, n in enumerate(need) if n > 0]
    return plan[::-1] if order == "reverse" else plan


def feed(plan, dst, src, counters, outs, snaps, delay_cycles: int, step_cycles: int) -> None:
    """The filler, enqueued on the current stream: after a delay, for each pool block, its first
    rows and a partial count, then the rest and the full count; just before the last full count,
    a snapshot of the outputs (snaps)."""
    torch.cuda._sleep(delay_cycles)
    for i, (b, half, need) in enumerate(plan):
        r0 = b * BLOCK
        if half > 0:
            torch.cuda._sleep(step_cycles)
            dst[r0 : r0 + half].copy_(src[r0 : r0 + half])
            counters[b : b + 1].fill_(half)
        torch.cuda._sleep(step_cycles)
        dst[r0 + half : r0 + BLOCK].copy_(src[r0 + half : r0 + BLOCK])
        if i == len(plan) - 1:
            for s, o in zip(snaps, outs):
                s.copy_(o)
        counters[b : b + 1].fill_(need)


def load_filler_kernels(stream, plan, dst, src, counters, outs, snaps) -> None:
    """Runs the filler once on copies of its tensors before the gated launch.

    Why: with lazy module loading (CUDA's default since 12.2; torch also asks for it), the first
    launch of a kernel loads it, and the load waits for the work already running on the device. A
    filler kernel launched for the first time while the gated GEMM spins therefore waits for the
    GEMM, which waits for the filler's counters: a deadlock that ends in the gate's spin-timeout
    trap (observed on the H200 before this warm-up existed).
    The same calls on tensors of the same dtypes, shapes and offsets (fresh allocations are
    aligned alike, so the same vectorised or unrolled kernel is picked) load every kernel the
    filler will launch. The worker also runs with CUDA_MODULE_LOADING=EAGER, which loads every
    kernel at start-up: the warm-up alone covers only the calls in feed(), EAGER also any launch
    that feed() does not show (a torch op changing its kernel between releases, one added later);
    EAGER alone would leave the harness correct only under an environment variable that a hand run
    or another launcher can drop."""
    copies = (dst.clone(), torch.zeros_like(counters), [s.clone() for s in snaps])
    torch.cuda.synchronize()
    with torch.cuda.stream(stream):
        feed(plan, copies[0], src, copies[1], outs, copies[2], 1, 1)
    torch.cuda.synchronize()


def record_after_trap(dev: int) -> dict:
    """The trap record, read once the driver has reported the failure on the device as a whole
    (the failing call may be another stream's launch)."""
    from megamoe import runtime

    try:
        torch.cuda.synchronize()
    except Exception:  # noqa: BLE001 (the context is gone: this only waits for the driver to say so)
        pass
    rec = runtime._ERR.get(dev)
    return dict(timeout_message=runtime.timeout_message(dev), record=rec.tolist() if rec is not None else None)


def _rows_equal(a: list[torch.Tensor], b: list[torch.Tensor]) -> torch.Tensor:
    """Per row: all outputs equal."""
    eq = torch.ones(a[0].shape[0], dtype=torch.bool, device=a[0].device)
    for x, y in zip(a, b):
        eq &= (x == y).reshape(x.shape[0], -1).all(1)
    return eq


def run_gated(v: Variant, cpm: float) -> bool:
    """One variant; returns False when the CUDA context is lost (a trap)."""
    la = launcher(v)
    pool = la.pool
    dev = pool.x.device.index or 0
    sms = torch.cuda.get_device_properties(pool.x.device).multi_processor_count
    items = work_items(v)
    base = dict(
        variant=v.name,
        layer=v.layer,
        promotion=v.promotion,
        max_tile=v.max_tile,
        late=v.late,
        order=v.order,
        items=items,
        sms=sms,
        delay_ms=DELAY_MS,
        module_loading=os.environ.get("CUDA_MODULE_LOADING"),
    )
    if items > sms - SPARE_SMS:
        emit(**base, skipped=f"{items} work items leave too few of the {sms} SMs to the filler stream")
        return True

    ref = la.reference()
    real = {"x": la.x, "x_sf": la.sf, "w_route": pool.w_route}
    gated = dict(real)
    gated[v.late] = real[v.late].clone()
    gated[v.late][pool.valid] = POISON[v.late]
    counters = torch.zeros_like(pool_arrivals(pool, BLOCK))
    outs, fresh = la.outputs(), la.outputs()
    snaps = [o.clone() for o in outs]
    plan = fill_plan(v.order)
    s_gemm, s_fill = torch.cuda.Stream(), torch.cuda.Stream()
    load_filler_kernels(s_fill, plan, gated[v.late], real[v.late], counters, outs, snaps)

    ev = {k: torch.cuda.Event(enable_timing=True) for k in ("start", "gemm_end", "fill_end")}
    error = None
    try:
        with torch.cuda.stream(s_gemm):
            ev["start"].record()
            la.launch(outs, gated["x"], gated["x_sf"], gated["w_route"], arrival=counters, arrival_block=BLOCK)
            ev["gemm_end"].record()
        with torch.cuda.stream(s_fill):
            feed(plan, gated[v.late], real[v.late], counters, outs, snaps, int(DELAY_MS * cpm), int(STEP_MS * cpm))
            ev["fill_end"].record()
        torch.cuda.synchronize()
    except Exception as e:  # noqa: BLE001 (a trap: report it, the context is gone)
        error = f"{type(e).__name__}: {e}"
    if error is not None:
        emit(**base, error=error, **record_after_trap(dev))
        return False

    last = plan[-1][0]
    in_last = torch.zeros_like(pool.valid)
    in_last[last * BLOCK : (last + 1) * BLOCK] = True
    last_rows = (pool.valid & in_last).nonzero().flatten()
    other_rows = (pool.valid & ~in_last).nonzero().flatten()
    held = _rows_equal(la.rows(snaps, last_rows), la.rows(fresh, last_rows))
    early = _rows_equal(la.rows(snaps, other_rows), la.rows(ref, other_rows))
    emit(
        **base,
        equal=all(torch.equal(a, b) for a, b in zip(outs, ref)),
        diff="; ".join(first_diff(a, b) for a, b in zip(outs, ref)),
        last_block=last,
        last_block_rows=len(last_rows),
        last_block_rows_held=int(held.sum()),
        rows_done_before_last_count=int(early.sum()),
        other_rows=len(other_rows),
        gemm_ms=ev["start"].elapsed_time(ev["gemm_end"]),
        fill_ms=ev["start"].elapsed_time(ev["fill_end"]),
    )
    return True


def run_timeout(block: int, observed: int, need: int) -> None:
    la = Launcher(1, "k32", 64)
    pool = la.pool
    counters = pool_arrivals(pool, BLOCK)
    assert int(counters[block]) == need
    counters[block] = observed
    outs = la.outputs()
    torch.cuda.synchronize()
    dev = pool.x.device.index or 0
    sms = torch.cuda.get_device_properties(pool.x.device).multi_processor_count
    t0 = time.monotonic()
    error = None
    try:
        la.launch(outs, la.x, la.sf, pool.w_route, arrival=counters, arrival_block=BLOCK)
        torch.cuda.synchronize()
    except Exception as e:  # noqa: BLE001
        error = f"{type(e).__name__}: {e}"
    elapsed = time.monotonic() - t0
    emit(
        scenario="timeout",
        block=block,
        need=need,
        observed=observed,
        sms=sms,
        error=error,
        elapsed_s=elapsed,
        module_loading=os.environ.get("CUDA_MODULE_LOADING"),
        **record_after_trap(dev),
    )


def parse_args(argv):
    ap = argparse.ArgumentParser(prog="python -m tests.gpu.gemm_hooks_worker", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="scenario", required=True)
    g = sub.add_parser("gated", help="arrival gate with counters filled late by a second stream")
    g.add_argument("variants", nargs="*", metavar="VARIANT", help="default: all of --list")
    g.add_argument("--list", action="store_true", help="print the variants and exit")
    t = sub.add_parser("timeout", help="a counter that never fills: trap with a timeout record")
    t.add_argument(
        "--block",
        type=int,
        default=TIMEOUT_BLOCK,
        help=f"pool block whose counter stays short (default {TIMEOUT_BLOCK})",
    )
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
            print(name, f"layer={v.layer} promotion={v.promotion} max_tile={v.max_tile} late={v.late} order={v.order}")
        return
    # Before anything starts CUDA (the driver reads it once): see load_filler_kernels for why.
    os.environ.setdefault("CUDA_MODULE_LOADING", "EAGER")
    if not torch.cuda.is_available():
        print("gemm_hooks_worker: needs a CUDA device", file=sys.stderr)
        sys.exit(3)
    if args.scenario == "gated":
        cpm = cycles_per_ms()
        for i, name in enumerate(args.variants):
            if not run_gated(VARIANTS[name], cpm):
                for rest in args.variants[i + 1 :]:
                    emit(variant=rest, error=f"not run: the CUDA context was lost by variant {name}")
                break
    else:
        run_timeout(args.block, args.observed, args.need)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # skip CUDA teardown, which can fail or hang after a trap


if __name__ == "__main__":
    main()
