"""Publication order in the fused kernel, read from its PTX (SPEC §3 and §6): every place where the
kernel publishes data through a counter or flag releases it at the right scope, after the fences its
data needs, and every place that waits on one acquires at the same scope.

Ranks on one GPU cannot show a missing fence (their memory is one device's), so this is checked
statically: nvcc's PTX of each fused kernel (the release builds of both promotions and both engines,
with the kernel's own flags) keeps, with -lineinfo, the chain of inlined call sites of every
instruction (`.loc ... inlined_at ...`). A site is a line of the kernel sources, found by its text;
the instructions inlined from it must include the site's release (or acquire) and fences. A site
whose line is missing from a kernel that should have it fails too (a renamed call is not a pass).
CPU only; needs nvcc (as tests/test_compile_gate.py)."""

from __future__ import annotations

import functools
import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest

from megamoe.jit import build as jb
from megamoe.kernel import KERNEL_DIR

pytestmark = pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not found (the PTX is nvcc's)")

SPECS = [
    jb.FusedSpec(fast_math=True, debug=False, promotion=promotion, engine=engine)
    for promotion, engine in jb.FUSED_MODES
]


# Fences a site needs right before or after it (the text of the line, within three lines of the
# site, and the PTX it must inline): for data that TMA reads next, the generic-to-async proxy fence;
# around a relaxed atomic that publishes or reads others' writes, a gpu-scope fence. A release RMW
# (red.release.gpu) needs no fence before it: it is one, cumulative over the writes its thread
# observed (its warpgroup's, through the barrier before it); a __threadfence() there was a second
# membar on the consumers' path at every tile (bench/NOTES.md v37).
GPU_FENCE = ("__threadfence();", "membar.gl")
PROXY_FENCE = ("fence_proxy_async_global();", "fence.proxy.async.global")

# (what is published or awaited, source file, text of the site's line, PTX it must inline, fences
# right above it, fences right below it, the specs that have it: "all", or promotion / engine names
# joined by "-", all of which must match; "a|b": either)
SITES = [
    # D4: a pulled pool row, then its block's arrival counter (read by this rank's L1 producers).
    (
        "pool row -> arrival counter",
        "fused/dispatch.cuh",
        "red_release_gpu_add(fp.ws_arrivals",
        ["red.release.gpu"],
        [],
        [],
        "all",
    ),
    # D6: an L1 tile of the swap-AB engine, then its pool block's L1-completion counter (read by
    # this rank's L2 producers through TMA).
    (
        "L1 tile -> L1-completion counter",
        "epilogue/l1_swiglu_requant.cuh",
        "red_release_gpu_add(p.signal + wi.row0 / p.arrival_block, 1)",
        ["red.release.gpu"],
        [PROXY_FENCE],
        [],
        "swapab-k32",
    ),
    # The fast mode: an L1 tile counts itself in its (pool block, 128 channels) rebase counter, a
    # relaxed atomic between two fences (the other tiles' writes before, the rebasing reads after)...
    (
        "L1 tile -> rebase counter",
        "epilogue/l1_swiglu_requant.cuh",
        "atomicAdd(p.rebase_count",
        ["atom.global.add"],
        [GPU_FENCE],
        [GPU_FENCE],
        "swapab-k128",
    ),
    # ... and the fourth one, having rebased the 128 channels, adds their 4 scale groups.
    (
        "rebased L2 operand -> L1-completion counter",
        "epilogue/l1_swiglu_requant.cuh",
        "red_release_gpu_add(p.signal + blk, 4)",
        ["red.release.gpu"],
        [PROXY_FENCE],
        [],
        "swapab-k128",
    ),
    # D6 in the prefill engine and the narrow engine: their epilogue warps count a tile's scale
    # groups per pool block (the narrow engine's at an item's last part).
    (
        "L1 rows of the epilogue warps -> L1-completion counter",
        "epilogue/prefill_rows.cuh",
        "red_release_gpu_add(p.signal + (wi.row0 + 64 * lane) / p.arrival_block, groups",
        ["red.release.gpu"],
        [PROXY_FENCE],
        [],
        "prefill|narrow",
    ),
    # The prefill engine's predecoded weight tiles, then the CTAs' count (TMA reads the tiles).
    (
        "predecoded tiles -> decoded count",
        "fused/megamoe_sm90.cuh",
        "red_release_gpu_add(sig + kSignalDecoded, 1)",
        ["red.release.gpu"],
        [PROXY_FENCE],
        [],
        "prefill",
    ),
    # Cross-rank (SPEC §6): the counts, source lists and staged inputs a CTA wrote into its peers'
    # workspaces, and the L2 rows it wrote into the tokens' ranks' combine buffers, are published by
    # signal_all_ranks: a system-scope fence, then a system-scope release to every rank (with one
    # rank, whose words no peer reads: a gpu-scope release).
    (
        "dispatch posted / L2 done -> every rank",
        "fused/megamoe_sm90.cuh",
        "signal_all_ranks(",
        ["fence.acq_rel.sys", "red.release.sys", "red.release.gpu"],
        [],
        [],
        "all",
    ),
    # The waits: system scope for the counters every rank raises, gpu scope for those only this
    # rank's CTAs raise (wait_all_ranks with one rank; the prefill engine's decoded count).
    (
        "wait for every rank",
        "fused/sync.cuh",
        "wait_counter(sig + word,",
        ["ld.acquire.sys", "ld.acquire.gpu"],
        [],
        [],
        "all",
    ),
    (
        "wait for this rank's CTAs",
        "fused/megamoe_sm90.cuh",
        "wait_counter(sig + kSignalDecoded, gridDim.x, false,",
        ["ld.acquire.gpu"],
        [],
        [],
        "prefill",
    ),
    (
        "gate of a token block",
        "gemm/scheduler.cuh",
        "(void)ptx::ld_acquire_gpu(p.arrival + b);",
        ["ld.acquire.gpu"],
        [],
        [],
        "swapab|narrow",
    ),
]


def applies(spec: jb.FusedSpec, which: str) -> bool:
    """Whether the site is in spec's kernel: every "-"-joined part names its promotion or engine, one
    of a part's "|"-joined alternatives enough (the narrow engine is the swap-AB engine's roles)."""
    return all(any(alt in ("all", spec.promotion, spec.engine) for alt in part.split("|")) for part in which.split("-"))


@functools.cache
def ptx_of(spec: jb.FusedSpec) -> str:
    with tempfile.TemporaryDirectory(prefix="megamoe-ptx-") as tmp:
        src = Path(tmp) / f"{spec.name}.cu"
        src.write_text(spec.source())
        out = Path(tmp) / "out.ptx"
        cmd = ["nvcc", *jb.flags(), "-ptx", "-I", str(KERNEL_DIR), "-o", str(out), str(src)]
        run = subprocess.run(cmd, capture_output=True, text=True)
        assert run.returncode == 0, run.stdout + run.stderr
        return out.read_text()


_LOC = re.compile(r"^\s*\.loc\s+(\d+)\s+(\d+)\s+(\d+)(?:,.*?inlined_at\s+(\d+)\s+(\d+)\s+(\d+))?")
_FILE = re.compile(r'^\s*\.file\s+(\d+)\s+"([^"]+)"')


def instructions(ptx: str) -> list[tuple[str, frozenset]]:
    """Each instruction of the PTX with the (source path, line) of every level of its inline chain.
    nvcc writes a chain as consecutive .loc lines, outermost first, each inlined_at the one before."""
    files = {m.group(1): os.path.normpath(m.group(2)) for m in map(_FILE.match, ptx.splitlines()) if m}
    chain: list[tuple[str, str, str]] = []
    out = []
    for line in ptx.splitlines():
        m = _LOC.match(line)
        if m:
            here = m.group(1, 2, 3)
            if m.group(4) is None:
                chain = [here]
            else:
                caller = m.group(4, 5, 6)
                at = max((i for i, c in enumerate(chain) if c == caller), default=None)
                chain = (chain[: at + 1] if at is not None else [caller]) + [here]
            continue
        text = line.strip()
        if not text or text.startswith(("//", ".", "{", "}", "$")) or text.endswith(":"):
            continue
        out.append((text, frozenset((files.get(f, f), int(n)) for f, n, _ in chain)))
    return out


def site_lines(rel: str, text: str) -> list[tuple[str, int]]:
    path = KERNEL_DIR / rel
    lines = path.read_text().splitlines()
    found = [(os.path.normpath(str(path)), i + 1) for i, line in enumerate(lines) if text in line]
    assert found, f"{rel}: no line contains {text!r} (the site moved: update SITES)"
    return found


def check(spec: jb.FusedSpec, ptx: str) -> list[str]:
    """The sites of `spec` whose instructions lack a required release, acquire or fence."""
    insts = instructions(ptx)

    def under(site):
        return [op for op, where in insts if site in where]

    def lacks(site, need):
        return not any(op.startswith(need) for op in under(site))

    bad = []
    for what, rel, text, needs, before, after, which in SITES:
        if not applies(spec, which):
            continue
        source = (KERNEL_DIR / rel).read_text().splitlines()
        for site in site_lines(rel, text):
            if not under(site):
                bad.append(f"{spec.name}: {what}: no instruction from {rel}:{site[1]}")
                continue
            bad += [f"{spec.name}: {what}: {rel}:{site[1]} has no {need}" for need in needs if lacks(site, need)]
            for fences, step in ((before, -1), (after, 1)):
                for fence_text, need in fences:
                    near = [site[1] + step * d for d in (1, 2, 3) if fence_text in source[site[1] + step * d - 1]]
                    if not near or lacks((site[0], near[0]), need):
                        where = "before" if step < 0 else "after"
                        bad.append(f"{spec.name}: {what}: {rel}:{site[1]} has no {need} right {where} it")
    return bad


@pytest.mark.parametrize("spec", SPECS, ids=[s.name for s in SPECS])
def test_every_publication_releases_and_every_wait_acquires_at_its_scope(spec):
    bad = check(spec, ptx_of(spec))
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize(
    "mutation",
    [
        ("red.release.sys", "red.relaxed.sys"),  # a cross-rank release weakened
        ("fence.acq_rel.sys", "fence.acq_rel.gpu"),  # its fence at the wrong scope
        ("membar.gl", "// membar.gl"),  # the rebase count's fences dropped
        ("fence.proxy.async.global", "// fence.proxy.async.global"),  # TMA reads without the proxy fence
        ("red.release.gpu", "red.relaxed.gpu"),  # a local release weakened
        ("ld.acquire.sys", "ld.relaxed.sys"),  # a cross-rank wait without its acquire
    ],
    ids=lambda m: m[1].replace(" ", ""),
)
def test_the_check_catches_a_weakened_release_fence_or_acquire(mutation):
    spec = jb.FusedSpec(fast_math=True, debug=False, promotion="k128", engine="swapab")
    ptx = ptx_of(spec)
    assert mutation[0] in ptx
    assert check(spec, ptx.replace(*mutation)), f"{mutation}: not caught"
