"""Launch one GEMM configuration a few times (for ncu): python -m bench.profile_one L M MODE [SHAPE [DECODE]]"""
import sys

import torch

from megamoe import gemm as G

from .gemm import ALIGN, SHAPES, E, rand_e4m3, random_kernel_weights


def main():
    layer, m, mode = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    H, inter = SHAPES[sys.argv[4] if len(sys.argv) > 4 else "dsv3"]
    decode = sys.argv[5] if len(sys.argv) > 5 else None
    dev = torch.device("cuda")
    kw = random_kernel_weights(H, inter, dev)
    K = H if layer == 1 else inter
    mp = (m + ALIGN - 1) // ALIGN * ALIGN
    P = E * mp
    offsets = torch.arange(E + 1, dtype=torch.int32, device=dev) * mp
    ntok = torch.full((E,), m, dtype=torch.int32, device=dev)
    x = rand_e4m3((P, K), dev)
    xsf = torch.randint(124, 131, (P, K // (32 if mode == "exact" else 128)), dtype=torch.uint8, device=dev)
    x128 = None if mode == "exact" else xsf
    for _ in range(3):
        if layer == 1:
            G.l1_gemm(x, xsf, offsets, ntok, torch.randn(P, device=dev), kw, mode=mode, max_tokens=m, x_sf128=x128,
                      decode=decode)
        else:
            comb = torch.empty(1, P, H, dtype=torch.bfloat16, device=dev)
            G.l2_gemm(x, xsf, offsets, ntok, torch.arange(P, dtype=torch.int32, device=dev), kw, comb, mode=mode,
                      max_tokens=m, x_sf128=x128, decode=decode)
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
