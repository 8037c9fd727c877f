"""The fast mode's two decode placements (GemmSpec.decode "regs" / "smem") timed side by side at
BN 64 and 128 (their bit-identity is tests/gpu/test_gemm_decode.py).

    python -m bench.check_decode
"""
from __future__ import annotations

import torch

from bench.gemm import E, SHAPES, rand_e4m3, random_kernel_weights, time_us
from megamoe import gemm as G


def operands(H, inter, counts, dev, layer):
    K = H if layer == 1 else inter
    offs = [0]
    for c in counts:
        offs.append(offs[-1] + (c + 63) // 64 * 64)
    P = max(offs[-1], 64)
    x = rand_e4m3((P, K), dev)
    xsf = torch.randint(120, 134, (P, K // 128), dtype=torch.uint8, device=dev)
    return (x, xsf, torch.tensor(offs, dtype=torch.int32, device=dev),
            torch.tensor(counts, dtype=torch.int32, device=dev), P)


def run(layer, kw, ops, decode, bn, debug=True):
    x, xsf, offs, ntok, P = ops
    if layer == 1:
        wr = torch.linspace(0.1, 1.0, P, device=x.device)
        r = G.l1_gemm(x, xsf, offs, ntok, wr, kw, mode="fast", x_sf128=xsf, block_n=bn, debug=debug, decode=decode)
        return [r.l2_acts.view(torch.uint8), r.l2_sf] + ([r.acc1] if debug else [])
    comb = torch.zeros(1, P, kw.hidden, dtype=torch.bfloat16, device=x.device)
    dst = torch.arange(P, dtype=torch.int32, device=x.device)
    r = G.l2_gemm(x, xsf, offs, ntok, dst, kw, comb, mode="fast", x_sf128=xsf, block_n=bn, debug=debug, decode=decode)
    return [r.combine] + ([r.acc2] if debug else [])


def main():
    dev = torch.device("cuda")
    torch.manual_seed(0)
    for shape in ("dsv3", "v4flash"):
        H, inter = SHAPES[shape]
        kw = random_kernel_weights(H, inter, dev)
        for layer in (1, 2):
            for m in (64, 512, 2048):
                ops = operands(H, inter, [m] * E, dev, layer)
                R, K = (2 * inter, H) if layer == 1 else (H, inter)
                fl = 2.0 * E * m * R * K
                line = f"{shape:8} L{layer} {m:5d}"
                for bn in ((64,) if m <= 64 else (64, 128)):
                    for decode in ("regs", "smem"):
                        t = time_us(lambda: run(layer, kw, ops, decode, bn, debug=False))
                        line += f" | bn{bn} {decode} {t:8.1f} us {fl / t / 1e6:6.1f} TF/s"
                print(line, flush=True)


if __name__ == "__main__":
    main()
