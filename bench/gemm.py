"""Benchmark of the SM90 grouped GEMMs against torch's grouped GEMMs; prints one table.

    python -m bench.gemm [--shapes dsv3,v4flash] [--tokens 8,64,512,2048] [--json out.json]
                         [--modes exact,fast] [--no-baselines] [--fast-bn 64]

Shapes (32 local experts): DeepSeek-V3 slice (H 7168, I 2048), V4-Flash slice (H 4096, I 2048).
L1: rows 2I, K = H. L2: rows H, K = I. Every expert gets the same token count m.
Columns:
  ours_exact / ours_fast  our kernel time (us), median of 5 timed batches (CUDA events); the fast
           mode with the decode placement megamoe picks (GemmSpec.decode)
  fast_smem the fast mode with the FP4 decode in shared memory by a transform warpgroup
           (GemmSpec.decode="smem"), at the same token tile, for comparison (not in "best")
  fp8_rw   torch._scaled_grouped_mm, FP8 weights and activations with row-wise fp32 scales
  bf16     torch._grouped_mm, BF16
  floor    max(weight+scale bytes / 4.8 TB/s, FLOPs / 1979 TFLOP/s)
  hbm%     (weight+scale bytes / our best time) / 4.8 TB/s
  TF/s     our best TFLOP/s;  pk% = of 1979
  speedup  best baseline time / our best time
Weights are random bytes in the kernel layout (a bijection of canonical random weights), so the
numbers depend on nothing but the shapes.
"""
from __future__ import annotations

import argparse
import json
import statistics

import torch

from megamoe import gemm as G
from megamoe.jit.layout import KernelWeights

HBM = 4.8e12
PEAK = 1979e12
SHAPES = {"dsv3": (7168, 2048), "v4flash": (4096, 2048)}
E = 32
ALIGN = 64


def time_us(fn, inner: int = 5, reps: int = 5) -> float:
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        for _ in range(inner):
            fn()
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e) * 1000.0 / inner)
    return statistics.median(times)


def rand_e4m3(shape, dev):
    codes = torch.randint(0, 0x7F, shape, dtype=torch.uint8, device=dev)  # no NaN codes
    sign = torch.randint(0, 2, shape, dtype=torch.uint8, device=dev) << 7
    return (codes | sign)


def random_kernel_weights(H: int, inter: int, dev) -> KernelWeights:
    """Random bytes already in the kernel layout (timing only needs realistic scale bytes)."""
    return KernelWeights(
        w1=torch.randint(0, 256, (E, H // 128, 2 * inter // 16, 1024), dtype=torch.uint8, device=dev),
        w1_sf=torch.randint(118, 125, (E, H // 128, 2 * inter, 4), dtype=torch.uint8, device=dev),
        w2=torch.randint(0, 256, (E, inter // 128, H // 16, 1024), dtype=torch.uint8, device=dev),
        w2_sf=torch.randint(118, 125, (E, inter // 128, H, 4), dtype=torch.uint8, device=dev),
        hidden=H, intermediate=inter)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="dsv3,v4flash")
    ap.add_argument("--tokens", default="8,64,512,2048")
    ap.add_argument("--modes", default="exact,fast")
    ap.add_argument("--json", default=None)
    ap.add_argument("--no-baselines", action="store_true")
    ap.add_argument("--fast-bn", type=int, default=None, help="force the fast mode's token tile (default: auto)")
    args = ap.parse_args()
    dev = torch.device("cuda")
    rows = []
    for shape in args.shapes.split(","):
        H, inter = SHAPES[shape]
        kw = random_kernel_weights(H, inter, dev)
        for layer in (1, 2):
            R, K = (2 * inter, H) if layer == 1 else (H, inter)
            wbytes = E * (R * K // 2 + R * K // 32)
            if not args.no_baselines:
                w8 = torch.randn(E, R, K, device=dev).to(torch.float8_e4m3fn)
                wb = torch.randn(E, R, K, device=dev, dtype=torch.bfloat16)
                sb = torch.rand(E, R, device=dev) + 0.5
            for m in (int(t) for t in args.tokens.split(",")):
                mp = (m + ALIGN - 1) // ALIGN * ALIGN
                P = E * mp
                offsets = torch.arange(E + 1, dtype=torch.int32, device=dev) * mp
                ntok = torch.full((E,), m, dtype=torch.int32, device=dev)
                x = rand_e4m3((P, K), dev)
                res = {}
                for mode in args.modes.split(","):
                    # fast mode: the activation operand is already rebased per K128 (rebase_k128)
                    xsf = torch.randint(124, 131, (P, K // (32 if mode == "exact" else 128)), dtype=torch.uint8,
                                        device=dev)
                    x128 = None if mode == "exact" else xsf
                    bn = args.fast_bn if mode == "fast" and args.fast_bn and m > args.fast_bn else None
                    if layer == 1:
                        wr = torch.randn(P, device=dev)
                        out = torch.empty(P, inter, dtype=torch.float8_e4m3fn, device=dev)
                        osf = torch.empty(P, inter // 32, dtype=torch.uint8, device=dev)
                        fn = lambda: G.l1_gemm(x, xsf, offsets, ntok, wr, kw, mode=mode, out=out, out_sf=osf,  # noqa: E731
                                               max_tokens=m, x_sf128=x128, block_n=bn)
                    else:
                        comb = torch.empty(1, P, H, dtype=torch.bfloat16, device=dev)
                        dst = torch.arange(P, dtype=torch.int32, device=dev)
                        fn = lambda: G.l2_gemm(x, xsf, offsets, ntok, dst, kw, comb, mode=mode, max_tokens=m,  # noqa: E731
                                               x_sf128=x128, block_n=bn)
                    res[mode] = time_us(fn)
                    tile = bn or G.pick_block_n(m, layer, mode)
                    if mode == "fast" and tile >= 64:
                        if layer == 1:
                            fn = lambda: G.l1_gemm(x, xsf, offsets, ntok, wr, kw, mode=mode, out=out, out_sf=osf,  # noqa: E731
                                                   max_tokens=m, x_sf128=x128, block_n=bn, decode="smem")
                        else:
                            fn = lambda: G.l2_gemm(x, xsf, offsets, ntok, dst, kw, comb, mode=mode, max_tokens=m,  # noqa: E731
                                                   x_sf128=x128, block_n=bn, decode="smem")
                        res["fast_smem"] = time_us(fn)
                M = E * m
                flops = 2.0 * M * R * K
                fp8_t = bf16_t = float("nan")
                if not args.no_baselines:
                    offs = torch.arange(1, E + 1, dtype=torch.int32, device=dev) * m
                    a8 = rand_e4m3((M, K), dev).view(torch.float8_e4m3fn)
                    sa = torch.rand(M, device=dev) + 0.5
                    ab = torch.randn(M, K, device=dev, dtype=torch.bfloat16)
                    fp8_t = time_us(lambda: torch._scaled_grouped_mm(a8, w8.transpose(-2, -1), sa, sb, offs=offs,
                                                                     out_dtype=torch.bfloat16))
                    bf16_t = time_us(lambda: torch._grouped_mm(ab, wb.transpose(-2, -1), offs=offs))
                best = min(v for k, v in res.items() if k != "fast_smem")
                floor = max(wbytes / HBM, flops / PEAK) * 1e6
                base = min(fp8_t, bf16_t)
                rows.append(dict(shape=shape, layer=f"L{layer}", m=m, exact=res.get("exact"), fast=res.get("fast"),
                                 fast_smem=res.get("fast_smem"),
                                 fp8=fp8_t, bf16=bf16_t, floor=floor, hbm=wbytes / (best * 1e-6) / HBM,
                                 tflops=flops / (best * 1e-6) / 1e12, speedup=base / best))
                print("done", rows[-1], flush=True)
            if not args.no_baselines:
                del w8, wb
    hdr = (f"{'shape':8} {'GEMM':4} {'tok/exp':>7} {'ours_exact':>10} {'ours_fast':>9} {'fast_smem':>9} {'fp8_rw':>8} {'bf16':>8} "
           f"{'floor':>7} {'hbm%':>6} {'TF/s':>7} {'pk%':>5} {'speedup':>7}")
    print()
    print("time in us; hbm% = weight+scale bytes / our best time / 4.8 TB/s; pk% = TFLOP/s / 1979;")
    print("ours_fast takes its activations already rebased per K128 (rebase_k128, not timed)")
    print(hdr)
    f = lambda v: "-" if v is None or v != v else f"{v:.1f}"  # noqa: E731
    for r in rows:
        print(f"{r['shape']:8} {r['layer']:4} {r['m']:7d} {f(r['exact']):>10} {f(r['fast']):>9} {f(r['fast_smem']):>9} {f(r['fp8']):>8} "
              f"{f(r['bf16']):>8} {r['floor']:7.1f} {100 * r['hbm']:6.1f} {r['tflops']:7.1f} "
              f"{100 * r['tflops'] * 1e12 / PEAK:5.1f} {r['speedup']:7.2f}")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(rows, fh, indent=1)


if __name__ == "__main__":
    main()
