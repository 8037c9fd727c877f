"""Benchmark of the SM90 grouped GEMMs against torch's grouped GEMMs; prints one table.

    python -m bench.gemm [--shapes dsv3,v4flash] [--tokens 8,64,512,2048] [--routings uniform,zipf]
                         [--promotions k32,k128] [--weights realistic|bytes] [--no-baselines] [--json out.json]

Shapes (32 local experts): DeepSeek-V3 slice (H 7168, I 2048), V4-Flash slice (H 4096, I 2048).
L1: rows 2I, K = H. L2: rows H, K = I. Weights (0.1-0.5 GB per layer) are far larger than L2.
Routings: uniform (every expert gets `tokens`), zipf (32 x `tokens` tokens, expert e's share
proportional to (e + 1)^-1.2: at 8 tokens/expert, 256 tokens with the largest expert at about 80).
Every time is the median over replays of a CUDA graph of several launches (kernel time: no host
launch cost in it); `eager` is the same call launched from Python, and `host` the Python time of one
launch (the entry point's launch key built and looked up, cuLaunchKernel), `prep` that of the same
call prepared (prepare_l1_gemm / prepare_l2_gemm: the launch alone).
Columns:
  k32 / k128   our kernel with promotion k32 (exact mode) / k128 (fast mode), graph-timed, us
  eager        the fast mode launched eagerly, us;  host  its Python time per launch, us
  prep         the Python time per launch of the same call prepared (PreparedGemm), us
  fp8_rw       torch._scaled_grouped_mm, FP8 weights and activations with row-wise fp32 scales
  bf16         torch._grouped_mm, BF16
  floor        max(weight+scale bytes / HBM, FLOPs / peak): the limits of the card it runs on (card():
               H200 4.8 TB/s, H100 SXM 3.35 TB/s; both 1979 dense FP8 TFLOP/s)
  hbm%         weight+scale bytes / our fast time / HBM
  TF/s, pk%    our fast mode's TFLOP/s, and as a share of the card's peak
  x_fp8        torch FP8 row-wise time / our fast time
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time

import torch


@dataclasses.dataclass(frozen=True)
class Card:
    """The datasheet limits a floor is taken at: HBM bytes/s and dense FP8 FLOP/s."""

    name: str  # as torch.cuda.get_device_name() reports it
    hbm: float
    peak: float


# The cards this project times on. The H100 SXM computes as fast as the H200 (the same 1980 MHz
# boost clock and SM count) but reads its HBM3 at 3.35 TB/s, not 4.8: a memory-bound call's floor
# there is 1.43x the H200's, so a ratio to the floor must use the card's own limits.
H200 = Card("NVIDIA H200", 4.8e12, 1979e12)
H100 = Card("NVIDIA H100 80GB HBM3", 3.35e12, 1979e12)
CARDS = (H200, H100)


def card(name: str | None = None) -> Card:
    """The limits of the card named (torch's name; default: this process's GPU). A card not in CARDS
    gets the H200's limits, said on stderr, so that its ratios are not read as its own."""
    if name is None:
        name = torch.cuda.get_device_name()
    for c in CARDS:
        if name == c.name:
            return c
    lim = f"{H200.hbm / 1e12:g} TB/s, {H200.peak / 1e12:g} TFLOP/s"
    print(f"bench: no limits known for {name!r}; floors at the H200's ({lim})", file=sys.stderr)
    return H200


SHAPES = {"dsv3": (7168, 2048), "v4flash": (4096, 2048)}
E = 32  # local experts (--experts)
ALIGN = 64


def graph_us(fn, launches: int = 4, reps: int = 7) -> float:
    """Kernel time of fn() (us): the median of `reps` replays of a graph of `launches` calls."""
    fn()
    torch.cuda.synchronize()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    g = torch.cuda.CUDAGraph()
    with torch.cuda.stream(s), torch.cuda.graph(g, stream=s):
        for _ in range(launches):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1000.0 / launches)
    return statistics.median(times)


def eager_us(fn, inner: int = 5, reps: int = 5) -> tuple[float, float]:
    """(time per call with eager launches, Python time per launch), us."""
    fn()
    torch.cuda.synchronize()
    times, host = [], []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        t0 = time.perf_counter()
        for _ in range(inner):
            fn()
        host.append((time.perf_counter() - t0) * 1e6 / inner)
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1000.0 / inner)
    return statistics.median(times), statistics.median(host)


def rand_e4m3(shape, dev):
    codes = torch.randint(0, 0x7F, shape, dtype=torch.uint8, device=dev)  # no NaN codes
    sign = torch.randint(0, 2, shape, dtype=torch.uint8, device=dev) << 7
    return codes | sign


def set_experts(n: int) -> None:
    global E
    E = n


def hbm_read_tbs(dev, nbytes: int = 1 << 30) -> tuple[float, float]:
    """What this GPU's memory delivers to a plain torch kernel, graph-timed in the same run: (read
    TB/s of an fp32 sum, read + write TB/s of a copy) over nbytes. (An int32 sum into int64 read at
    0.77 TB/s: torch's kernel for it is not bandwidth-bound.)"""
    a = torch.rand(nbytes // 4, device=dev)
    b = torch.empty_like(a)
    read = nbytes / (graph_us(lambda: a.sum(), launches=4) * 1e-6) / 1e12
    copy = 2 * nbytes / (graph_us(lambda: b.copy_(a), launches=4) * 1e-6) / 1e12
    return read, copy


WEIGHTS = ("realistic", "bytes")


def random_kernel_weights(H: int, inter: int, dev, kind: str = "realistic"):
    """Weights in the kernel layout. "realistic": what a checkpoint looks like, N(0, 1/fan_in)
    quantized per SPEC §1 (megamoe.reference.random_weights: scale bytes spread over a few binades
    per row, E2M1 codes concentrated near zero); "bytes": random bytes with scale bytes 118-124 (the
    tables before NOTES v22). The kernels' times differ between the two at 8 tokens per expert
    (NOTES v22), so the tables time the realistic ones."""
    from megamoe.jit.layout import KernelWeights, transform_weights

    if kind == "realistic":
        from megamoe import reference as ref

        w = ref.random_weights(E, H, inter, seed=0, device=dev)
        return transform_weights(w.w1, w.w1_sf, w.w2, w.w2_sf)
    return KernelWeights(
        w1=torch.randint(0, 256, (E, H // 128, 2 * inter // 16, 1024), dtype=torch.uint8, device=dev),
        w1_sf=torch.randint(118, 125, (E, H // 128, 2 * inter, 4), dtype=torch.uint8, device=dev),
        w2=torch.randint(0, 256, (E, inter // 128, H // 16, 1024), dtype=torch.uint8, device=dev),
        w2_sf=torch.randint(118, 125, (E, inter // 128, H, 4), dtype=torch.uint8, device=dev),
        hidden=H,
        intermediate=inter,
    )


def routing_counts(routing: str, tokens: int) -> list[int]:
    if routing == "uniform":
        return [tokens] * E
    w = [(e + 1) ** -1.2 for e in range(E)]
    total = tokens * E
    counts = [int(total * x / sum(w)) for x in w]
    counts[0] += total - sum(counts)
    return counts


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", default="dsv3,v4flash", help="comma list of dsv3, v4flash (default: both)")
    ap.add_argument("--tokens", default="8,64,512,2048", help="tokens per expert (default: 8,64,512,2048)")
    ap.add_argument("--routings", default="uniform,zipf", help="comma list of uniform, zipf (default: both)")
    ap.add_argument("--zipf-tokens", default="8,64", help="tokens per expert for the zipf rows (default: 8,64)")
    ap.add_argument("--promotions", default="k32,k128", help="comma list of k32, k128 (default: both)")
    ap.add_argument("--json", default=None, help="also write the rows as JSON to this file")
    ap.add_argument("--no-baselines", action="store_true", help="skip the torch grouped GEMMs")
    ap.add_argument(
        "--weights",
        choices=WEIGHTS,
        default="realistic",
        help="realistic: N(0, 1/fan_in) quantized per SPEC §1 (default); bytes: random bytes, scale bytes 118-124",
    )
    ap.add_argument(
        "--max-tile", type=int, default=None, help="force our kernels' largest token tile (default: picked)"
    )
    ap.add_argument(
        "--wgs", type=int, default=None, help="force our kernels' consumer warpgroups, 2 or 4 (default: picked)"
    )
    ap.add_argument(
        "--prefill",
        choices=("auto", "off"),
        default="auto",
        help="the prefill path (predecode + tokens-as-M GEMM, both promotions) where use_prefill picks it, or never",
    )
    ap.add_argument(
        "--unfolded",
        action="store_true",
        help="the exact mode's prefill path as for weights none of whose 128-row blocks fold (rows spanning"
        " more than 11 binades: the two-scale promotion; layout.fold_blocks)",
    )
    ap.add_argument(
        "--experts", type=int, default=E, help=f"local experts (default: {E}; a launch's fixed cost is the intercept)"
    )
    args = ap.parse_args()
    set_experts(args.experts)
    if not torch.cuda.is_available():
        sys.exit("bench.gemm needs a CUDA GPU (it times the SM90 kernels)")
    from megamoe import gemm as G

    dev = torch.device("cuda")
    promotions = args.promotions.split(",")
    read_tbs, copy_tbs = hbm_read_tbs(dev)
    lim = card()
    rows = []
    for shape in args.shapes.split(","):
        H, inter = SHAPES[shape]
        kw = random_kernel_weights(H, inter, dev, args.weights)
        if args.unfolded:
            kw.w1_fold.zero_()
            kw.w2_fold.zero_()
        for layer in (1, 2):
            R, K = (2 * inter, H) if layer == 1 else (H, inter)
            wbytes = E * (R * K // 2 + R * K // 32)
            if not args.no_baselines:
                w8 = torch.randn(E, R, K, device=dev).to(torch.float8_e4m3fn)
                wb = torch.randn(E, R, K, device=dev, dtype=torch.bfloat16)
                sb = torch.rand(E, R, device=dev) + 0.5
            cases = [("uniform", int(t)) for t in args.tokens.split(",")] if "uniform" in args.routings else []
            if "zipf" in args.routings:
                cases += [("zipf", int(t)) for t in args.zipf_tokens.split(",")]
            # Smallest launches first, after an idle pause: right after seconds of prefill at the
            # power cap (~690 W) the next launches ran slower (zipf 8 tok L1 165.6 us in the full
            # table, 151.9 us for the same kernel in a short run of the same call, bench/NOTES.md v12).
            cases.sort(key=lambda c: sum(routing_counts(*c)))
            if rows:
                time.sleep(3)
            for routing, m in cases:
                counts = routing_counts(routing, m)
                padded = [(n + ALIGN - 1) // ALIGN * ALIGN for n in counts]
                offs = [0]
                for n in padded:
                    offs.append(offs[-1] + n)
                P = offs[-1] + ALIGN
                offsets = torch.tensor(offs, dtype=torch.int32, device=dev)
                ntok = torch.tensor(counts, dtype=torch.int32, device=dev)
                x = rand_e4m3((P, K), dev)
                res = {}
                for promotion in promotions:
                    # k128: the activation operand is already rebased per K128 (rebase_k128)
                    xsf = torch.randint(
                        124, 131, (P, K // (32 if promotion == "k32" else 128)), dtype=torch.uint8, device=dev
                    )
                    x128 = xsf if promotion == "k128" else None
                    if layer == 1:
                        wr = torch.randn(P, device=dev)
                        out = torch.empty(P, inter, dtype=torch.float8_e4m3fn, device=dev)
                        osf = torch.empty(P, inter // 32, dtype=torch.uint8, device=dev)
                        args_ = (x, xsf, offsets, ntok, wr, kw)
                        extra = dict(out=out, out_sf=osf)
                        gemm_fn, prepare = G.l1_gemm, G.prepare_l1_gemm
                    else:
                        comb = torch.empty(1, P, H, dtype=torch.bfloat16, device=dev)
                        dst = torch.arange(P, dtype=torch.int32, device=dev)
                        args_ = (x, xsf, offsets, ntok, dst, kw, comb)
                        extra = {}
                        gemm_fn, prepare = G.l2_gemm, G.prepare_l2_gemm
                    opts = dict(
                        promotion=promotion,
                        max_tokens=max(counts),
                        x_sf128=x128,
                        max_tile=args.max_tile,
                        wgs=args.wgs,
                        prefill=None if args.prefill == "auto" else False,
                        **extra,
                    )

                    def fn(gemm_fn=gemm_fn, args_=args_, opts=opts):
                        gemm_fn(*args_, **opts)

                    res[promotion] = graph_us(fn, launches=2 if m >= 512 else 8)
                    if promotion == promotions[-1]:
                        res["eager"], res["host"] = eager_us(fn)
                        res["prep"] = eager_us(prepare(*args_, **opts))[1]
                M = sum(counts)
                flops = 2.0 * M * R * K
                auto_prefill = args.prefill == "auto" and args.max_tile is None and args.wgs is None
                fp8_t = bf16_t = float("nan")
                if not args.no_baselines:
                    boffs = torch.cumsum(torch.tensor(counts, device=dev), 0).to(torch.int32)
                    a8 = rand_e4m3((M, K), dev).view(torch.float8_e4m3fn)
                    sa = torch.rand(M, device=dev) + 0.5
                    ab = torch.randn(M, K, device=dev, dtype=torch.bfloat16)
                    launches = 2 if m >= 512 else 8
                    fp8_t = graph_us(
                        lambda: torch._scaled_grouped_mm(
                            a8, w8.transpose(-2, -1), sa, sb, offs=boffs, out_dtype=torch.bfloat16
                        ),
                        launches=launches,
                    )
                    bf16_t = graph_us(
                        lambda: torch._grouped_mm(ab, wb.transpose(-2, -1), offs=boffs), launches=launches
                    )
                fast = res.get("k128", res.get("k32"))
                rows.append(
                    dict(
                        shape=shape,
                        layer=f"L{layer}",
                        routing=routing,
                        m=m,
                        max_expert=max(counts),
                        k32=res.get("k32"),
                        k128=res.get("k128"),
                        prefill=auto_prefill and G.use_prefill(layer, max(counts), P / len(counts), "k128", R),
                        prefill_k32=auto_prefill and G.use_prefill(layer, max(counts), P / len(counts), "k32", R),
                        eager=res.get("eager"),
                        host=res.get("host"),
                        host_prepared=res.get("prep"),
                        fp8=fp8_t,
                        bf16=bf16_t,
                        floor=max(wbytes / lim.hbm, flops / lim.peak) * 1e6,
                        hbm=wbytes / (fast * 1e-6) / lim.hbm,
                        tflops=flops / (fast * 1e-6) / 1e12,
                        x_fp8=fp8_t / fast,
                    )
                )
                print("done", json.dumps(rows[-1]), flush=True)
            if not args.no_baselines:
                del w8, wb
        torch.cuda.empty_cache()
    print()
    print("time in us, CUDA-graph replays; eager / host: the fast mode launched from Python (host = Python time")
    print("per launch; prep = the same for the call prepared: prepare_l1_gemm / prepare_l2_gemm);")
    print(
        f"{lim.name}: hbm% = weight+scale bytes / fast time / {lim.hbm / 1e12:g} TB/s; pk% = TFLOP/s / {lim.peak / 1e12:g};"
    )
    print("k128 takes its activations already rebased per K128 (rebase_k128, not timed); * = the prefill path")
    print("of that promotion (predecode pass + tokens-as-M GEMM, both timed)")
    print(
        f"{E} experts, {args.weights} weights; this GPU's memory in the same run: {read_tbs:.2f} TB/s read (fp32 sum of 1 GiB, "
        f"{100 * read_tbs * 1e12 / lim.hbm:.0f} % of {lim.hbm / 1e12:g}), {copy_tbs:.2f} TB/s read + write (copy)"
    )
    print(
        f"{'shape':8} {'GEMM':4} {'routing':7} {'tok/exp':>7} {'max_e':>5} {'k32':>9} {'k128':>9} {'eager':>8} "
        f"{'host':>5} {'prep':>5} {'fp8_rw':>8} {'bf16':>8} {'floor':>7} {'hbm%':>6} {'TF/s':>7} {'pk%':>5} {'x_fp8':>6}"
    )
    f = lambda v: "-" if v is None or v != v else f"{v:.1f}"  # noqa: E731
    for r in rows:
        print(
            f"{r['shape']:8} {r['layer']:4} {r['routing']:7} {r['m']:7d} {r['max_expert']:5d} "
            f"{f(r['k32']) + ('*' if r.get('prefill_k32') else ''):>9} "
            f"{f(r['k128']) + ('*' if r.get('prefill') else ''):>9} {f(r['eager']):>8} {f(r['host']):>5} {f(r.get('host_prepared')):>5} {f(r['fp8']):>8} {f(r['bf16']):>8} "
            f"{r['floor']:7.1f} {100 * r['hbm']:6.1f} {r['tflops']:7.1f} {100 * r['tflops'] * 1e12 / lim.peak:5.1f} "
            f"{r['x_fp8']:6.2f}"
        )
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(
                dict(
                    experts=E,
                    weights=args.weights,
                    card=dataclasses.asdict(lim),
                    hbm_read_tbs=read_tbs,
                    hbm_copy_tbs=copy_tbs,
                    rows=rows,
                ),
                fh,
                indent=1,
            )


if __name__ == "__main__":
    main()
