"""compute-sanitizer over small calls of every kernel path: `python -m bench.sanitize`.

    python -m bench.sanitize                                  # every tool on every target
    python -m bench.sanitize --tools racecheck --targets fused-swapab-k32
    python -m bench.sanitize --run fused-swapab-k32           # the workload alone (what the tool runs)
    python -m bench.sanitize --probe                          # racecheck on kernel/probes/warp_publish.cu

Each (tool, target) runs `compute-sanitizer --tool TOOL --target-processes all` over this module's
`--run TARGET` in a new process, and the table gives the tool's summary line (errors, or
racecheck's hazards). Targets: the fused layer on each engine and promotion at R = 1, on each
engine at SPEC §8's activation and sizes (K tails, rows padded past H and 2I), the
fused layer at R = 2 (two processes on one GPU: --target-processes all follows them), and the GEMM core's
standalone paths (swap-AB at a decode tile, the wide tile, the prefill path with its predecode
pass, L2). The shapes are small: the tools slow a kernel by 10-1000x.

racecheck groups any hazards it reports by their two sites under the target's row. It reported
tens of thousands on every target while one lane of a warp arrived for the warp's accesses to a
stage's scales; since every thread arrives for its own (kernel/gemm/producer.cuh), none
(bench/NOTES.md v28). `--probe` runs racecheck on that pattern alone, with one lane arriving and
with every lane arriving (kernel/probes/warp_publish.cu says why both are ordered)."""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

SHAPE = dict(hidden=512, intermediate=512, num_experts=4, top_k=2, max_tokens_per_rank=32)
TOOLS = ("memcheck", "racecheck", "synccheck", "initcheck")
HAZARDS: dict[str, Counter] = {}  # racecheck's hazards of each target, by site (hazard_sites)


def _fused(engine: str, promotion: str, ranks: int = 1, rank: int = 0, predecoded: bool = False, **shape) -> None:
    """One release and one debug call of the fused layer; `shape` overrides SHAPE's fields (with
    activation "swiglu_oai", the layer gets biases); predecoded: MegaMoE(predecoded=True)."""
    import torch

    from megamoe import multirank
    from megamoe import reference as ref
    from megamoe.moe import MegaMoE

    cfg = ref.MoEConfig(**{**SHAPE, **shape}, num_ranks=ranks)
    w = ref.random_weights(cfg.num_experts, cfg.hidden, cfg.intermediate, seed=1)
    if cfg.activation == "swiglu_oai":
        w.b1, w.b2 = ref.random_biases(cfg.num_experts, cfg.hidden, cfg.intermediate, seed=1)
    w = w.to("cuda")
    group = multirank.group() if ranks > 1 else None
    layer = MegaMoE(cfg, w, group=group, promotion=promotion, engine=engine, predecoded=predecoded)
    inp = ref.make_inputs(cfg, 32, seed=1, distribution="skewed", masked_ratio=0.1, device="cuda")[rank]
    with layer.named_failures():
        layer(inp.x, inp.x_sf, inp.topk_idx, inp.topk_weights)
        layer(inp.x, inp.x_sf, inp.topk_idx, inp.topk_weights, debug=True)
        torch.cuda.synchronize()


def _fused_rank(rank: int, ranks: int) -> None:
    _fused("swapab", "k32", ranks, rank)


def _two_ranks() -> None:
    from bench import sanitize  # by its module name, not __main__: spawn imports the function
    from megamoe import multirank

    multirank.spawn(sanitize._fused_rank, 2)


def _gemm(max_tile: int | None, prefill: bool, promotion: str = "k32") -> None:
    import torch

    from megamoe import gemm as G
    from megamoe import reference as ref

    H, inter, E = SHAPE["hidden"], SHAPE["intermediate"], SHAPE["num_experts"]
    w = ref.random_weights(E, H, inter, seed=1, device="cuda")
    kw = G.transform_weights(w.w1, w.w1_sf, w.w2, w.w2_sf)
    counts = [40, 0, 64, 7]
    offsets = [0]
    for n in counts:
        offsets.append(offsets[-1] + -(-n // 64) * 64)
    P = offsets[-1]
    x = ref.quantize_activations(torch.randn(P, H, device="cuda"))
    cnt = torch.tensor(counts, dtype=torch.int32, device="cuda")
    off = torch.tensor(offsets, dtype=torch.int32, device="cuda")
    opts = dict(promotion=promotion, max_tile=max_tile, prefill=prefill)
    l1 = G.l1_gemm(ref.as_float8(x.codes), x.scales, off, cnt, torch.ones(P, device="cuda"), kw, **opts)
    dst = torch.arange(P, dtype=torch.int32, device="cuda")
    combine = torch.empty(P, H, dtype=torch.bfloat16, device="cuda")
    G.l2_gemm(l1.l2_acts, l1.l2_sf, off, cnt, dst, kw, combine, **opts)
    torch.cuda.synchronize()


TARGETS = {
    "fused-swapab-k32": lambda: _fused("swapab", "k32"),
    "fused-swapab-k128": lambda: _fused("swapab", "k128"),
    "fused-narrow-k32": lambda: _fused("narrow", "k32"),
    "fused-prefill-k32": lambda: _fused("prefill", "k32"),
    "fused-prefill-k128": lambda: _fused("prefill", "k128"),
    # MegaMoE(predecoded=True): the standalone pass writes the layer's own buffers, the kernel skips
    # its predecode; SPEC §8's padded sizes included
    "fused-prefill-predecoded-oai-padded": lambda: _fused(
        "prefill", "k32", hidden=352, intermediate=192, activation="swiglu_oai", predecoded=True
    ),
    # SPEC §8's activation and sizes: K tails (352, 192 of 384, 256) and both layers' rows padded
    # (L1 384 rows, L2 384: layout.padded_rows), on each engine
    "fused-prefill-oai-padded": lambda: _fused("prefill", "k32", hidden=352, intermediate=192, activation="swiglu_oai"),
    "fused-swapab-oai-padded": lambda: _fused("swapab", "k32", hidden=352, intermediate=192, activation="swiglu_oai"),
    "fused-R2": lambda: _two_ranks(),
    "gemm-swapab-tile8": lambda: _gemm(8, False),
    "gemm-wide-tile": lambda: _gemm(None, False),
    "gemm-prefill-predecode": lambda: _gemm(None, True),
    "gemm-prefill-k128": lambda: _gemm(None, True, "k128"),
}

_SUMMARY = re.compile(r"(ERROR SUMMARY: .*|RACECHECK SUMMARY: .*)")
_HAZARD = re.compile(r"Potential (\w+) hazard detected")
_ACCESS = re.compile(r"(Write|Read) Thread \((\d+),\d+,\d+\) at (?:void )?([\w:]+).* in (\S+:\d+)")


def hazard_sites(out: str) -> Counter:
    """racecheck's hazards by (kind, first access's site, second access's site), each site the
    function and file:line; the count of hazards, and, because a warp's lane 0 often publishes for
    its warp, of those whose first access was by a thread other than its warp's lane 0."""
    sites: Counter = Counter()
    lines = out.splitlines()
    for i, line in enumerate(lines):
        kind = _HAZARD.search(line)
        if not kind:
            continue
        acc = [m for m in (_ACCESS.search(x) for x in lines[i + 1 : i + 3]) if m]
        if len(acc) < 2:
            continue
        key = (kind.group(1), *(f"{m.group(1)} {m.group(3)} {m.group(4)}" for m in acc))
        sites[key] += 1
        sites[key + ("first access not by lane 0",)] += int(acc[0].group(2)) % 32 != 0
    return sites


def sanitize(tool: str, target: str, timeout: float, log_dir: Path | None = None) -> tuple[str, float]:
    cmd = ["compute-sanitizer", "--tool", tool, "--target-processes", "all"]
    # racecheck: every hazard (no print limit), without backtraces, for the grouping by site below
    racecheck = ["--racecheck-report", "hazard", "--print-limit", "0", "--show-backtrace", "no"]
    cmd += racecheck if tool == "racecheck" else ["--print-limit", "20"]
    cmd += [sys.executable, "-m", "bench.sanitize", "--run", target]
    start = time.monotonic()
    try:
        run = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return f"timed out after {timeout:.0f} s", time.monotonic() - start
    out = run.stdout + run.stderr
    if log_dir is not None:
        log_dir.mkdir(parents=True, exist_ok=True)
        (log_dir / f"{tool}-{target}.log").write_text(out)
    if tool == "racecheck":
        HAZARDS[target] = hazard_sites(out)
    found = _SUMMARY.findall(out)
    summary = "; ".join(found) if found else f"no summary (exit {run.returncode}): {out.strip()[-200:]}"
    if run.returncode and "0 errors" in summary:
        summary += f" (exit {run.returncode})"
    return summary, time.monotonic() - start


PROBE_MODES = {
    0: "RAW, lane 0 arrives after __syncwarp",
    1: "RAW, every lane arrives (the scale warps)",
    2: "WAR, lane 0 arrives after __syncwarp",
    3: "WAR, every lane arrives (the consumers' release)",
}


def probe(timeout: float) -> int:
    """racecheck on kernel/probes/warp_publish.cu in each of its modes: one table."""
    import tempfile

    from megamoe.jit.build import probe_command

    with tempfile.TemporaryDirectory() as tmp:
        exe = Path(tmp) / "warp_publish"
        build = subprocess.run(probe_command("warp_publish", exe), capture_output=True, text=True)
        if build.returncode:
            print(f"nvcc failed to build kernel/probes/warp_publish.cu:\n{build.stderr}", file=sys.stderr)
            return 1
        print("| racecheck probe | mode | summary | the probe's check |")
        print("|---|---|---|---|")
        for mode, words in PROBE_MODES.items():
            cmd = ["compute-sanitizer", "--tool", "racecheck", "--racecheck-report", "hazard", str(exe), str(mode)]
            run = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
            out = run.stdout + run.stderr
            found = _SUMMARY.findall(out)
            check = "ok" if f"mode {mode} ok" in out else "FAILED"
            print(
                f"| warp_publish | {mode}: {words} | {'; '.join(found) or out.strip()[-200:]} | {check} |", flush=True
            )
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.sanitize", description=__doc__.split("\n\n")[0])
    p.add_argument("--tools", default=",".join(TOOLS), help=f"comma-separated, of {', '.join(TOOLS)}")
    p.add_argument("--targets", default=",".join(TARGETS), help=f"comma-separated, of {', '.join(TARGETS)}")
    p.add_argument("--timeout", type=float, default=300, help="seconds per (tool, target) (default 300)")
    p.add_argument("--log-dir", type=Path, help="keep each run's whole output in DIR/TOOL-TARGET.log")
    p.add_argument("--run", choices=list(TARGETS), help="run one target's workload (what the tool runs)")
    p.add_argument("--probe", action="store_true", help="racecheck on kernel/probes/warp_publish.cu's four modes")
    args = p.parse_args(argv)
    if args.run:
        TARGETS[args.run]()
        return 0
    tools, targets = args.tools.split(","), args.targets.split(",")
    bad = [t for t in tools if t not in TOOLS] + [t for t in targets if t not in TARGETS]
    if bad:
        p.error(f"unknown tool or target: {', '.join(bad)}")
    if shutil.which("compute-sanitizer") is None:
        print("bench.sanitize needs compute-sanitizer on the PATH (CUDA toolkit) and a GPU", file=sys.stderr)
        return 2
    if args.probe:
        return probe(args.timeout)
    print("| tool | target | summary | s |")
    print("|---|---|---|---|")
    clean = True
    for tool in tools:
        for target in targets:
            summary, seconds = sanitize(tool, target, args.timeout, args.log_dir)
            clean &= summary.startswith(("ERROR SUMMARY: 0 errors", "RACECHECK SUMMARY: 0 hazards"))
            print(f"| {tool} | {target} | {summary} | {seconds:.0f} |", flush=True)
            # racecheck's hazards by their two sites, under the target's row as soon as it ends (a run
            # cut short keeps the sites of the targets it finished).
            sites = HAZARDS.get(target, {}) if tool == "racecheck" else {}
            for key, n in sorted(sites.items(), key=lambda kv: -kv[1]):
                if len(key) == 3:
                    lanes = sites[key + ("first access not by lane 0",)]
                    print(f"| | | {key[0]}: {key[1]} -> {key[2]}: {n} ({lanes} first accesses not by lane 0) | |")
    return 0 if clean else 1


if __name__ == "__main__":
    sys.exit(main())
