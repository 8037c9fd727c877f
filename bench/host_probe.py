"""Host time of one fused-layer call on a GPU, by part: `python -m bench.host_probe` (us per call,
200 calls queued without synchronising; the small default-like shape at 8 tokens).

What it answers: how much of a call is Python (checks, y's allocation, pointer patches) and how
much is the driver's launch, cooperative or not; and the same for the standalone L1 GEMM (a
repeated call, a prepared call, the launch alone)."""

import sys
import time

import torch

from megamoe import gemm as G
from megamoe import runtime
from megamoe import reference as ref
from megamoe.moe import MegaMoE


def per_call_us(f, n: int = 200) -> float:
    f()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(n):
        f()
    end = time.perf_counter()
    torch.cuda.synchronize()
    return (end - start) / n * 1e6


def main() -> None:
    if not torch.cuda.is_available():
        sys.exit("bench.host_probe needs a CUDA GPU (it times launches on the device)")
    cfg = ref.MoEConfig(hidden=1024, intermediate=512, num_experts=16, top_k=4, num_ranks=1, max_tokens_per_rank=8)
    layer = MegaMoE(cfg, ref.random_weights(16, 1024, 512, seed=1, device="cuda"))
    inp = ref.make_inputs(cfg, 8, seed=1, device="cuda")[0]
    args = (inp.x, inp.x_sf, inp.topk_idx, inp.topk_weights)
    y = layer(*args, check_inputs=False)
    torch.cuda.synchronize()
    launch = next(iter(layer._launches.values()))
    stream = runtime.stream(inp.x)
    plain = launch.copy(cooperative=False)
    rows = {
        "call, no value checks": lambda: layer(*args, check_inputs=False),
        "call, no value checks, out=": lambda: layer(*args, check_inputs=False, out=y),
        "prepared call (MegaMoE.prepare)": layer.prepare(*args, check_inputs=False),
        "call with the value checks (device sync)": lambda: layer(*args),
        "cooperative launch alone": lambda: launch(stream),
        "plain launch alone": lambda: plain(stream),
        "torch.empty of y": lambda: torch.empty(8, 1024, dtype=torch.bfloat16, device="cuda"),
    }
    rows.update(_gemm_rows())
    for name, f in rows.items():
        print(f"{name:44s} {per_call_us(f, 50 if 'sync' in name else 200):6.1f} us")


def _gemm_rows() -> dict:
    """The standalone L1 GEMM's host path at the fused layer's small shape (exact mode, 8 tokens per
    expert): a repeated call (the launch cache's key built and looked up), a prepared call (its stream
    checked) and its launch alone."""
    from megamoe.jit import layout as L

    E, H, inter, n = 16, 1024, 512, 8
    g = torch.Generator().manual_seed(0)
    w1 = torch.randint(0, 256, (E, 2 * inter, H // 2), generator=g, dtype=torch.int32).to(torch.uint8)
    w2 = torch.randint(0, 256, (E, H, inter // 2), generator=g, dtype=torch.int32).to(torch.uint8)
    kw = L.transform_weights(
        w1.cuda(),
        torch.full((E, 2 * inter, H // 32), 120, dtype=torch.uint8, device="cuda"),
        w2.cuda(),
        torch.full((E, H, inter // 32), 120, dtype=torch.uint8, device="cuda"),
    )
    P = 64 * E
    x = torch.zeros(P, H, dtype=torch.uint8, device="cuda")
    sf = torch.full((P, H // 32), 127, dtype=torch.uint8, device="cuda")
    offsets = torch.arange(0, P + 1, 64, dtype=torch.int32, device="cuda")
    counts = torch.full((E,), n, dtype=torch.int32, device="cuda")
    w_route = torch.ones(P, device="cuda")
    out = torch.empty(P, inter, dtype=torch.uint8, device="cuda")
    out_sf = torch.empty(P, inter // 32, dtype=torch.uint8, device="cuda")

    def call():
        return G.l1_gemm(x, sf, offsets, counts, w_route, kw, max_tokens=n, out=out, out_sf=out_sf)

    call()
    prepared = G.prepare_l1_gemm(x, sf, offsets, counts, w_route, kw, max_tokens=n, out=out, out_sf=out_sf)
    torch.cuda.synchronize()
    return {
        "l1_gemm, repeated call": call,
        "prepared l1_gemm call (prepare_l1_gemm)": prepared,
        "l1_gemm's launch alone": lambda: prepared.run(prepared.stream),
    }


if __name__ == "__main__":
    main()
