"""Instructions per K128 stage of the consumers' mainloop, counted in the SASS of the built cubins
(no GPU needed; nvcc builds them, nvdisasm reads them: the nvidia-cuda-nvdisasm wheel's, else the
PATH's):

    python -m bench.sass_stage            # one line per (promotion, token tile), and the prefill kernel,
                                          # then one per hot loop of the fused kernel

The hot loop is the innermost backward branch whose body holds wgmma (QGMMA) instructions; its
instruction count divided by the K blocks it covers (wgmmas in it / wgmmas per K block) is the
cost of one stage for one consumer warp, including loop control and the runtime guards. (The
four-warpgroup 64-token kernel has one such loop per item width, 8 to 64 tokens: the count is the
64-token one's.) The fused kernel holds every hot loop of its engine, each layer's (L1's first):
all of them are listed, with the local-memory loads and stores in them (spilled words, reloaded
where the loop runs), and their promotions (FFMAs of a wgmma's product) that read the product and
the accumulator from one register bank (promotion_banks)."""

from __future__ import annotations

import argparse
import importlib.util
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

NVDISASM_HOW = (
    "pip install nvidia-cuda-nvdisasm (its nvidia/cu13/bin/nvdisasm), or put the CUDA toolkit's bin on the PATH"
)


def nvdisasm() -> str | None:
    """nvdisasm: the pip package nvidia-cuda-nvdisasm's (site-packages/nvidia/cu13/bin/nvdisasm, the
    CUDA the kernels are built with; an older wheel's nvidia/*/bin/nvdisasm), else the PATH's; None
    when neither. `nvidia` is a namespace package of those wheels: absent, it is not an error."""
    spec = importlib.util.find_spec("nvidia")
    for base in map(Path, (spec.submodule_search_locations or []) if spec else []):
        for cand in [base / "cu13" / "bin" / "nvdisasm", *sorted(base.glob("*/bin/nvdisasm"))]:
            if cand.is_file() and os.access(cand, os.X_OK):
                return str(cand)
    return shutil.which("nvdisasm")


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


# wgmmas a K block (of 128) in a loop of this wgmma width: the swap-AB kernels' four k32 steps of
# one chunk (up to 64 tokens; the wide tiles are counted by stage_cost), the prefill kernel's tile of
# `rows` weight rows (contract.PREFILL_ROWS: the fast mode's 256, the exact mode's 128) in wgmmas of
# 128 rows (folded and fast mode: 64x128) or 64 (the exact two-scale mainloop: 64x64) per k32 step.
def wgmmas_per_stage(width: int, prefill: bool, rows: int = 256) -> int:
    return 4 * rows // width if prefill else 4


def hot_loops(sass: str) -> list[tuple[int, int, list[str]]]:
    """The innermost loops that hold wgmmas, by address: those that no shorter such loop overlaps
    (one inside them, or one whose range they cut into: a loop ptxas rotated so that an outer
    branch lands inside the mainloop)."""
    found = {(lo, hi): body for lo, hi, body in loops(sass) if any("QGMMA" in t for t in body)}
    return [
        (lo, hi, body)
        for (lo, hi), body in sorted(found.items())
        if not any(b - a < hi - lo and a <= hi and lo <= b for a, b in found)
    ]


def loop_cost(body: list[str], prefill: bool, rows: int = 256) -> tuple[int, float, int]:
    """(wgmma width, instructions a stage and consumer warp, local loads and stores) of a hot loop
    (rows: the prefill tile's)."""
    widths = [int(w) for w in re.findall(r"QGMMA\.64x(\d+)x32", "\n".join(body))]
    width = max(widths)
    stages = len(widths) / wgmmas_per_stage(width, prefill, rows)
    local = sum(re.match(r"\s*(@!?U?P\d\s+)?(LDL|STL)", t) is not None for t in body)
    return width, len(body) / stages, local


def promotion_banks(body: list[str]) -> tuple[int, int]:
    """(promotions, same-bank ones) of a hot loop: its FFMAs whose first factor is a register of a
    wgmma's product (a QGMMA's destination range: N / 2 registers from its first), and of those the
    ones whose addend (the accumulator) has that register's parity. The register file has two banks by
    parity, so such an FFMA reads both from one bank (in the gpt-oss fused prefill build, taking them
    out of its folded loop gave 0.7-0.8 % of a call: bench/NOTES.md v43)."""
    ranges = [
        (int(d), int(d) + int(n) // 2)
        for n, d in (re.search(r"QGMMA\.64x(\d+)x32\S*\s+R(\d+),", t).groups() for t in body if "QGMMA" in t)
    ]
    promotions = same = 0
    for t in body:
        m = re.match(r"\s*(?:@!?U?P\d\s+)?FFMA\s+R\d+,\s*R(\d+)(?:\.reuse)?,\s*R\d+(?:\.reuse)?,\s*R(\d+)", t)
        if m and any(lo <= int(m.group(1)) < hi for lo, hi in ranges):
            promotions += 1
            same += int(m.group(1)) % 2 == int(m.group(2)) % 2
    return promotions, same


def stage_cost(
    cubin: Path, tile: int, k32: bool, prefill: bool = False, disasm: str = "nvdisasm"
) -> tuple[float, int] | None:
    sass = subprocess.run([disasm, "-c", str(cubin)], capture_output=True, text=True, check=True).stdout
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


def main(argv: list[str] | None = None) -> int:
    argparse.ArgumentParser(
        prog="python -m bench.sass_stage", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    ).parse_args(argv)
    from megamoe.jit import build as jb
    from megamoe.jit import contract

    # Both tools before the first build: a build takes minutes, and its SASS needs nvdisasm.
    disasm = nvdisasm()
    if disasm is None:
        print(f"bench.sass_stage: nvdisasm not found: {NVDISASM_HOW}", file=sys.stderr)
        return 2
    if jb.find_nvcc() is None:
        print("bench.sass_stage: needs nvcc on the PATH (or $CUDA_HOME/bin) to build the kernels", file=sys.stderr)
        return 2
    print(f"{'promotion':9} {'tile':>4} {'wgs':>3} {'instructions / stage / warp':>28} {'generic ld/st in loop':>22}")
    for promotion in ("k128", "k32"):
        for tile, wgs in ((8, 4), (8, 2), (64, 4), (64, 2), (128, 2), (256, 2)):
            if tile > jb.max_tile_of(promotion) or (wgs == 4 and tile > jb.max_wgs4_tile(promotion)):
                continue
            spec = jb.GemmSpec(layer=1, max_tile=tile, promotion=promotion, wgs=wgs)
            cost = stage_cost(jb.build(spec).cubin, tile, promotion == "k32", disasm=disasm)
            per, generic = cost if cost else (float("nan"), -1)
            print(f"{promotion:9} {tile:4d} {wgs:3d} {per:28.1f} {generic:22d}")
    # The fast mode's prefill kernel (128 tokens x 256 weight rows per CTA: twice a swap-AB stage's MACs at tile 128)
    cost = stage_cost(
        jb.build(jb.PrefillSpec(layer=1, promotion="k128")).cubin, 128, False, prefill=True, disasm=disasm
    )
    per, generic = cost if cost else (float("nan"), -1)
    print(f"{'prefill':9} {128:4d} {2:3d} {per:28.1f} {generic:22d}")
    # The fused kernel (one activation: the loops are the same for both), every hot loop.
    print()
    print(
        f"{'fused kernel':34} {'loop':>4} {'width':>5} {'instructions / stage / warp':>28} {'local ld/st in loop':>20}"
        f" {'promotions one bank':>20}"
    )
    for promotion in ("k128", "k32"):
        for engine in jb.FUSED_ENGINES_OF[promotion]:
            spec = jb.FusedSpec(promotion=promotion, engine=engine, activation="swiglu_oai")
            sass = subprocess.run([disasm, "-c", str(jb.build(spec).cubin)], capture_output=True, text=True, check=True)
            for i, (_, _, body) in enumerate(hot_loops(sass.stdout)):
                width, per, local = loop_cost(body, engine == "prefill", contract.PREFILL_ROWS[promotion])
                promotions, same = promotion_banks(body)
                print(f"{spec.name:34} {i:4d} {width:5d} {per:28.1f} {local:20d} {f'{same} / {promotions}':>20}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
