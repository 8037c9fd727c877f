"""Instructions per K128 stage of the consumers' mainloop, counted in the SASS of the built cubins
(no GPU needed; nvdisasm from the nvidia-cuda-nvdisasm wheel or the CUDA toolkit):

    python -m bench.sass_stage            # one line per (promotion, token tile), and the prefill kernel

The hot loop is the innermost backward branch whose body holds wgmma (QGMMA) instructions; its
instruction count divided by the K blocks it covers (wgmmas in it / wgmmas per K block) is the
cost of one stage for one consumer warp, including loop control and the runtime guards. (The
four-warpgroup 64-token kernel has one such loop per item width, 8 to 64 tokens: the count is the
64-token one's.)"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path


def nvdisasm() -> str:
    found = shutil.which("nvdisasm")
    if found:
        return found
    import nvidia

    for base in nvidia.__path__:
        for cand in Path(base).rglob("nvdisasm"):
            return str(cand)
    sys.exit("nvdisasm not found (pip install nvidia-cuda-nvdisasm)")


def loops(sass: str):
    """(start, end, instructions) of every backward-branch loop."""
    insts = re.findall(r"/\*([0-9a-f]{4,})\*/\s+([^;]*);", sass)
    addr = [int(a, 16) for a, _ in insts]
    labels = {m.group(1): int(m.group(2), 16) for m in re.finditer(r"\.(L_x_\d+):\s*\n\s*/\*([0-9a-f]+)\*/", sass)}
    out = []
    for i, (a, text) in enumerate(insts):
        m = re.search(r"BRA\s+`?\(?\.?(L_x_\d+)", text)
        if m and m.group(1) in labels and labels[m.group(1)] < addr[i]:
            lo, hi = labels[m.group(1)], addr[i]
            body = [t for ad, (_, t) in zip(addr, insts) if lo <= ad <= hi]
            out.append((lo, hi, body))
    return out


def stage_cost(cubin: Path, tile: int, k32: bool, prefill: bool = False) -> tuple[float, int] | None:
    sass = subprocess.run([nvdisasm(), "-c", str(cubin)], capture_output=True, text=True, check=True).stdout
    # wgmma width: the tile up to 64 tokens, 64-token chunks up to 128, pairs of chunks in the
    # wide tile's serial schedule (kernel/gemm/mainloop.cuh); the prefill kernel: 128 weight rows
    # per wgmma, two halves per K block
    gw = 128 if prefill else min(tile, 64) if tile <= 128 else 128
    want = f"QGMMA.64x{gw}x32"
    per_stage = 8 if prefill else 4 * (tile // gw)  # wgmmas per K block
    best = None
    for lo, hi, body in loops(sass):
        q = sum(t.strip().startswith(want) or f" {want}" in t for t in body)
        if q and (best is None or (hi - lo) < (best[1] - best[0])):
            best = (lo, hi, len(body), q, sum(re.match(r"\s*(@!?U?P\d\s+)?(LD|ST)\.E", t) is not None for t in body))
    if best is None:
        return None
    return best[2] / (best[3] / per_stage), best[4]


def main() -> None:
    from megamoe.jit import build as jb

    print(f"{'promotion':9} {'tile':>4} {'wgs':>3} {'instructions / stage / warp':>28} {'generic ld/st in loop':>22}")
    for promotion in ("k128", "k32"):
        for tile, wgs in ((8, 4), (8, 2), (64, 4), (64, 2), (128, 2), (256, 2)):
            if tile > jb.max_tile_of(promotion) or (wgs == 4 and tile > jb.max_wgs4_tile(promotion)):
                continue
            spec = jb.GemmSpec(layer=1, max_tile=tile, promotion=promotion, wgs=wgs)
            cost = stage_cost(jb.build(spec).cubin, tile, promotion == "k32")
            per, generic = cost if cost else (float("nan"), -1)
            print(f"{promotion:9} {tile:4d} {wgs:3d} {per:28.1f} {generic:22d}")
    # The prefill kernel (128 tokens x 256 weight rows per CTA: twice a swap-AB stage's MACs at tile 128)
    cost = stage_cost(jb.build(jb.PrefillSpec(1)).cubin, 128, False, prefill=True)
    per, generic = cost if cost else (float("nan"), -1)
    print(f"{'prefill':9} {128:4d} {2:3d} {per:28.1f} {generic:22d}")


if __name__ == "__main__":
    main()
