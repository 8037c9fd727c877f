"""Launch one GEMM configuration, or one fused layer call, a few times (for ncu):

    python -m bench.profile_one LAYER TOKENS_PER_EXPERT PROMOTION [SHAPE [MAX_TILE [WGS]]]
    python -m bench.profile_one fused SHAPE TOKENS [PROMOTION [ENGINE [predecoded]]]

The second form is bench.layer's layer of SHAPE (dsv3, v4flash, gpt-oss) at T = TOKENS, uniform
routing, its weights and inputs (promotion k32 and engine auto unless given; `predecoded`: the layer
made with predecoded=True, so a prefill call has no predecode phase); ncu's kernel name for it is
megamoe_fused (bench/ncu_stalls.sh and ncu_device.sh pick it from the first word)."""

import sys

import torch

from .gemm import ALIGN, SHAPES, E, rand_e4m3, random_kernel_weights


def fused(shape: str, tokens: int, promotion: str = "k32", engine: str = "auto", predecoded: str = "") -> None:
    from .layer import ROUTINGS, SEED, layer_config, make_fused, shape_weights

    from megamoe import reference as ref

    if predecoded not in ("", "predecoded"):
        sys.exit(f"bench.profile_one fused: the sixth argument is 'predecoded' or nothing, got {predecoded!r}")
    cfg = layer_config(shape, tokens)
    call = make_fused(cfg, shape_weights(shape), promotion, engine, predecoded == "predecoded")
    inp = ref.make_inputs(cfg, tokens, seed=SEED, distribution=ROUTINGS["uniform"], device="cuda")[0]
    for _ in range(3):
        call(inp.x, inp.x_sf, inp.topk_idx, inp.topk_weights)
    torch.cuda.synchronize()


def main():
    if not torch.cuda.is_available():
        sys.exit("bench.profile_one needs a CUDA GPU")
    if len(sys.argv) > 1 and sys.argv[1] == "fused":
        if len(sys.argv) < 4:
            sys.exit(__doc__)
        fused(sys.argv[2], int(sys.argv[3]), *sys.argv[4:7])
        return
    from megamoe import gemm as G

    layer, m, promotion = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    H, inter = SHAPES[sys.argv[4] if len(sys.argv) > 4 else "dsv3"]
    max_tile = int(sys.argv[5]) if len(sys.argv) > 5 else None
    wgs = int(sys.argv[6]) if len(sys.argv) > 6 else None
    dev = torch.device("cuda")
    kw = random_kernel_weights(H, inter, dev)
    K = H if layer == 1 else inter
    mp = (m + ALIGN - 1) // ALIGN * ALIGN
    P = E * mp
    offsets = torch.arange(E + 1, dtype=torch.int32, device=dev) * mp
    ntok = torch.full((E,), m, dtype=torch.int32, device=dev)
    x = rand_e4m3((P, K), dev)
    xsf = torch.randint(124, 131, (P, K // (32 if promotion == "k32" else 128)), dtype=torch.uint8, device=dev)
    x128 = None if promotion == "k32" else xsf
    for _ in range(3):
        if layer == 1:
            G.l1_gemm(
                x,
                xsf,
                offsets,
                ntok,
                torch.randn(P, device=dev),
                kw,
                promotion=promotion,
                max_tokens=m,
                x_sf128=x128,
                max_tile=max_tile,
                wgs=wgs,
            )
        else:
            comb = torch.empty(1, P, H, dtype=torch.bfloat16, device=dev)
            G.l2_gemm(
                x,
                xsf,
                offsets,
                ntok,
                torch.arange(P, dtype=torch.int32, device=dev),
                kw,
                comb,
                promotion=promotion,
                max_tokens=m,
                x_sf128=x128,
                max_tile=max_tile,
                wgs=wgs,
            )
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
