"""Compile a kernel specialisation with nvcc and cache the cubin.

The cache key is a SHA-256 over: every file under kernel/ that a build can include (path and
bytes), the nvcc flags, and the specialisation. The cubin and ptxas' resource report are stored as
<cache>/<name>-<key16>.cubin / .log. The same key is computed on any machine, so cubins compiled
on a CPU-only machine (the CI compile gate) are reused on the GPU machine when the cache directory
travels with the code.
"""

from __future__ import annotations

import dataclasses
import fcntl
import hashlib
import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

from megamoe.kernel import KERNEL_DIR
from megamoe.reference.config import ACTIVATIONS

from . import contract
from .flags import NVCC_FLAGS

PROMOTIONS = contract.PROMOTIONS  # "k32", "k128": the instantiation units' Promotion::k32, ::k128

EXTRA_FLAGS = ["-lineinfo", "-Xptxas", "-v", "-diag-suppress", "1160"]


def _check_promotion(promotion: str) -> None:
    """Every specialisation's promotion field: one of PROMOTIONS."""
    if promotion not in PROMOTIONS:
        raise ValueError(f"promotion: expected one of {PROMOTIONS}, got {promotion!r}")


def _check_activation(activation: str) -> None:
    """FusedSpec's activation field: one of reference.config.ACTIVATIONS (SPEC §3, §8)."""
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation: expected one of {ACTIVATIONS}, got {activation!r}")


def activation_policy(activation: str, fast_math: bool) -> str:
    """The kernels' activation policy (kernel/epilogue/activation.cuh) of a specialisation."""
    policy = {"swiglu": "Swiglu", "swiglu_oai": "SwigluOai"}[activation]
    return f"megamoe::{policy}<{'true' if fast_math else 'false'}>"


def _activation_tag(activation: str, fast_math: bool) -> str:
    """The activation in a specialisation's name: fsilu / psilu (SPEC §3), foai / poai (§8)."""
    return ("f" if fast_math else "p") + ("silu" if activation == "swiglu" else "oai")


class CompileError(RuntimeError):
    """nvcc failed; the message carries nvcc's output."""


def cache_dir() -> Path:
    d = os.environ.get("MEGAMOE_CACHE_DIR")
    path = Path(d) if d else Path.home() / ".cache" / "megamoe"
    path.mkdir(parents=True, exist_ok=True)
    return path


def _sources_digest(kdir: Path) -> bytes:
    h = hashlib.sha256()
    for f in sorted(kdir.rglob("*")):
        # The probes (kernel/probes) are programs of their own: no kernel includes them.
        if f.suffix in (".cuh", ".cu", ".in", ".h") and f.is_file() and f.parent.name != "probes":
            h.update(str(f.relative_to(kdir)).encode())
            h.update(b"\0")
            h.update(f.read_bytes())
            h.update(b"\0")
    return h.digest()


def max_tile_of(promotion: str) -> int:
    """The largest token tile of a promotion (contract.MAX_TILE says why)."""
    return contract.MAX_TILE[promotion]


def max_wgs4_tile(promotion: str) -> int:
    """The largest token tile of a kernel with four consumer warpgroups (contract.MAX_WGS4_TILE)."""
    return contract.MAX_WGS4_TILE[promotion]


@dataclasses.dataclass(frozen=True, kw_only=True)
class GemmSpec:
    """One compiled specialisation of the grouped GEMM (kernel/gemm/gemm_sm90.cuh): the knobs have
    the same names from the Python API to the kernel's template (promotion -> Promotion::k32 or
    ::k128, whose per_k32 is the templates' kPerK32; fast_math -> kFastMath, max_tile -> kMaxN,
    wgs -> kWGs)."""

    layer: int  # 1 (L1 + SwiGLU/requant epilogue) or 2 (L2 + bf16 combine epilogue)
    max_tile: int  # the largest token tile (contract.TOKEN_TILES); items of <= 8 rows run at 8
    promotion: str  # "k32" (exact mode) or "k128" (fast mode): how often products are promoted
    fast_math: bool = True  # L1: the SiLU approximation (SPEC D6 step 3)
    debug: bool = False  # dump the fp32 accumulators (D5 / D7)
    wgs: int = 2  # consumer warpgroups (64 weight rows each): 2, or 4 up to max_wgs4_tile
    kernel = "megamoe_gemm"  # the cubin's entry point

    def __post_init__(self):
        if self.max_tile not in contract.TOKEN_TILES:
            raise ValueError(f"max_tile: expected one of {contract.TOKEN_TILES}, got {self.max_tile}")
        _check_promotion(self.promotion)
        if self.max_tile > max_tile_of(self.promotion):
            raise ValueError(
                f"max_tile: promotion {self.promotion!r} goes up to {max_tile_of(self.promotion)}, got {self.max_tile}"
            )
        if self.wgs not in (2, 4) or (self.wgs == 4 and self.max_tile > max_wgs4_tile(self.promotion)):
            raise ValueError(
                f"wgs: 2, or 4 with max_tile up to {max_wgs4_tile(self.promotion)} (promotion {self.promotion!r});"
                f" got wgs={self.wgs}, max_tile={self.max_tile}"
            )
        if self.layer not in (1, 2):
            raise ValueError(f"layer: expected 1 or 2, got {self.layer}")

    @property
    def name(self) -> str:
        silu = ("_fsilu" if self.fast_math else "_psilu") if self.layer == 1 else ""
        return f"gemm_l{self.layer}_n{self.max_tile}_{self.promotion}{silu}_w{self.wgs}{'_dbg' if self.debug else ''}"

    @property
    def threads(self) -> int:
        """Threads per CTA: a producer warpgroup and the consumers."""
        return 128 * (1 + self.wgs)

    @property
    def rows_per_cta(self) -> int:
        """Weight rows per CTA tile: 64 per consumer warpgroup."""
        return contract.ROWS_PER_WG * self.wgs

    def source(self) -> str:
        tmpl = (KERNEL_DIR / "gemm" / "instantiate.cu.in").read_text()
        b = lambda v: "true" if v else "false"  # noqa: E731
        fields = {
            "LAYER": str(self.layer),
            "MAX_N": str(self.max_tile),
            "PROMOTION": self.promotion,
            "ACT": activation_policy("swiglu", self.fast_math),
            "DEBUG": b(self.debug),
            "WGS": str(self.wgs),
        }
        for k, v in fields.items():
            tmpl = tmpl.replace(f"@{k}@", v)
        return tmpl


# The fused kernel's GEMM engines (kernel/fused/megamoe_sm90.cuh): "swapab" (weights as wgmma M,
# FP4 decoded in the consumers, token tile contract.FUSED_MAX_TILE: decode sizes), "narrow" (the
# same at token tile 8, exact mode only: the smallest calls) and "prefill" (the weights predecoded
# once per call inside the launch, tokens as wgmma M: prefill sizes).
FUSED_ENGINES = ("swapab", "narrow", "prefill")
# The engines a promotion runs: the narrow engine's 8-token mainloop is the exact mode's.
FUSED_ENGINES_OF = {"k32": FUSED_ENGINES, "k128": ("swapab", "prefill")}
# Every (promotion, engine) the fused kernel is built for.
FUSED_MODES = tuple((promotion, engine) for promotion in PROMOTIONS for engine in FUSED_ENGINES_OF[promotion])


# The fused builds whose exact prefill loop keeps its accumulators in swapped pairs
# (MEGAMOE_SWAP_ACC_PAIRS, kernel/gemm/gemm_sm90_prefill.cuh): there ptxas gave each promotion FFMA's
# product and accumulator registers one parity, so both came from one register bank (bench/NOTES.md
# v43). Which builds need it is the register allocator's choice, not a rule of the code:
# tests/test_compile_gate.py reads every prefill build's loop and fails on a same-parity pair.
SWAP_ACC_PAIRS = frozenset({"megamoe_fused_k32_prefill_foai", "megamoe_fused_k32_prefill_poai"})


@dataclasses.dataclass(frozen=True, kw_only=True)
class FusedSpec:
    """One compiled specialisation of the fused layer (kernel/fused/megamoe_sm90.cuh) and its GEMM
    engine: "swapab" at token tile contract.FUSED_MAX_TILE with four consumer warpgroups in the fast
    mode (its 16 .. 64-token serial mainloop; the fast mode's H and I are multiples of 512, so its
    weight rows fill 256-row CTAs) and two in the exact mode (k32 has no four-warpgroup 64-token
    tile), "narrow" (exact mode: the swap-AB engine at token tile 8, three consumer warpgroups; a pool
    block of more rows runs in parts), or "prefill"."""

    fast_math: bool = True  # the SiLU approximation (SPEC D6 step 3)
    debug: bool = False  # keep every dump point (D5 / D7 accumulators, counter snapshots)
    promotion: str  # "k32" (exact mode) or "k128" (fast mode), as GemmSpec.promotion
    engine: str = "swapab"  # FUSED_ENGINES
    activation: str = "swiglu"  # SPEC §3, or "swiglu_oai" (§8)
    # The release build with %globaltimer stamps of each CTA's phases and items (kernel/common/timeline.cuh,
    # megamoe.timeline): a measurement build, never the one a plain call runs.
    timeline: bool = False
    kernel = "megamoe_fused"  # the cubin's entry point

    def __post_init__(self):
        _check_promotion(self.promotion)
        if self.engine not in FUSED_ENGINES_OF[self.promotion]:
            raise ValueError(
                f"engine: promotion {self.promotion!r} runs {FUSED_ENGINES_OF[self.promotion]}, got {self.engine!r}"
            )
        _check_activation(self.activation)
        if self.timeline and self.debug:
            raise ValueError("timeline: a stamped release build; debug=True is the dump build (choose one)")

    @property
    def wgs(self) -> int:
        """Consumer warpgroups (64 weight rows each; the prefill engine's 64 tokens each)."""
        if self.engine == "narrow":
            return 3  # 192-row CTA tiles: three consumer warps a scheduler (bench/NOTES.md v38)
        if self.engine == "prefill":
            return contract.PREFILL_TOKENS[self.promotion] // 64  # 64 tokens each (PrefillShape)
        four = self.engine == "swapab" and contract.FUSED_MAX_TILE <= max_wgs4_tile(self.promotion)
        return 4 if four else 2

    @property
    def name(self) -> str:
        act = _activation_tag(self.activation, self.fast_math)
        build = "_dbg" if self.debug else "_tl" if self.timeline else ""
        return f"megamoe_fused_{self.promotion}_{self.engine}_{act}{build}"

    @property
    def threads(self) -> int:
        return 128 * (1 + self.wgs)

    def source(self) -> str:
        tmpl = (KERNEL_DIR / "fused" / "instantiate.cu.in").read_text()
        b = lambda v: "true" if v else "false"  # noqa: E731
        # kPerK32: the instantiation unit's bool of its promotion (instantiate.cu.in).
        act = activation_policy(self.activation, self.fast_math)
        if self.engine == "prefill":
            engine = f"PrefillEngine<kPerK32, {act}, {b(self.debug)}>"
        else:
            tile = "megamoe::kSmallTile" if self.engine == "narrow" else "megamoe::kFusedMaxN"
            engine = f"SwapAbEngine<{self.wgs}, {tile}, kPerK32, {act}, {b(self.debug)}>"
        fields = {"ENGINE": engine, "PROMOTION": self.promotion, "DEBUG": b(self.debug)}
        for k, v in fields.items():
            tmpl = tmpl.replace(f"@{k}@", v)
        defines = ("#define MEGAMOE_TIMELINE 1\n" if self.timeline else "") + (
            "#define MEGAMOE_SWAP_ACC_PAIRS 1\n" if self.name in SWAP_ACC_PAIRS else ""
        )
        return defines + tmpl


@dataclasses.dataclass(frozen=True, kw_only=True)
class PrefillSpec:
    """One compiled specialisation of the prefill GEMM (kernel/gemm/gemm_sm90_prefill.cuh: tokens as
    wgmma M, weights predecoded to E4M3 by PredecodeSpec's pass of the same promotion): per CTA 128
    tokens x 256 weight rows with two consumer warpgroups (fast mode), 192 x 128 with three (exact
    mode; contract.PREFILL_TOKENS, PREFILL_ROWS)."""

    layer: int  # 1 (L1 + SwiGLU/requant epilogue) or 2 (L2 + bf16 combine epilogue)
    fast_math: bool = True  # L1: the SiLU approximation (SPEC D6 step 3)
    debug: bool = False  # dump the fp32 accumulators (D5 / D7)
    promotion: str  # "k32" (exact mode) or "k128" (fast mode), as GemmSpec.promotion
    kernel = "megamoe_prefill"

    def __post_init__(self):
        if self.layer not in (1, 2):
            raise ValueError(f"layer: expected 1 or 2, got {self.layer}")
        _check_promotion(self.promotion)

    @property
    def name(self) -> str:
        silu = ("_fsilu" if self.fast_math else "_psilu") if self.layer == 1 else ""
        exact = "_k32" if self.promotion == "k32" else ""
        return f"prefill_l{self.layer}{silu}{exact}{'_dbg' if self.debug else ''}"

    @property
    def rows_per_cta(self) -> int:
        """Weight rows per CTA tile (PrefillShape::kRows)."""
        return contract.PREFILL_ROWS[self.promotion]

    @property
    def threads(self) -> int:
        """A producer warpgroup and a consumer warpgroup per 64 tokens of the tile."""
        return 128 * (1 + contract.PREFILL_TOKENS[self.promotion] // 64)

    def source(self) -> str:
        tmpl = (KERNEL_DIR / "gemm" / "instantiate_prefill.cu.in").read_text()
        b = lambda v: "true" if v else "false"  # noqa: E731
        fields = {
            "LAYER": str(self.layer),
            "ACT": activation_policy("swiglu", self.fast_math),
            "DEBUG": b(self.debug),
            "PROMOTION": self.promotion,
        }
        for k, v in fields.items():
            tmpl = tmpl.replace(f"@{k}@", v)
        return tmpl


@dataclasses.dataclass(frozen=True, kw_only=True)
class PredecodeSpec:
    """The predecode pass (kernel/gemm/predecode.cuh): a layer's FP4 weights to the prefill
    kernel's tiles of the same promotion (contract.PREFILL_TILE_BYTES each), once per call."""

    promotion: str  # as GemmSpec.promotion
    kernel = "megamoe_predecode"
    threads = 256
    debug = False

    def __post_init__(self):
        _check_promotion(self.promotion)

    @property
    def name(self) -> str:
        return "predecode_k32" if self.promotion == "k32" else "predecode"

    def source(self) -> str:
        tmpl = (KERNEL_DIR / "gemm" / "instantiate_predecode.cu.in").read_text()
        return tmpl.replace("@PROMOTION@", self.promotion)


@dataclasses.dataclass
class Built:
    cubin: Path
    log: str
    cached: bool

    @property
    def spill_bytes(self) -> int:
        return sum(
            int(a) + int(b) for a, b in re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads", self.log)
        )

    @property
    def registers(self) -> int:
        m = re.search(r"Used (\d+) registers", self.log)
        return int(m.group(1)) if m else -1


def probe_command(name: str, out: Path | str, *extra: str, nvcc: str = "nvcc") -> list[str]:
    """The nvcc command that builds kernel/probes/<name>.cu into `out` with the kernel's own flags
    (extra: e.g. "-cubin" or "-c" for a compile-only check), so a probe measures or rounds as the
    kernel does."""
    return [nvcc, *NVCC_FLAGS, *extra, "-o", str(out), str(KERNEL_DIR / "probes" / f"{name}.cu")]


def flags() -> list[str]:
    return [*NVCC_FLAGS, *EXTRA_FLAGS]


def spec_key(spec: GemmSpec | FusedSpec | PrefillSpec | PredecodeSpec) -> str:
    kdir = KERNEL_DIR
    h = hashlib.sha256()
    h.update(_sources_digest(kdir))
    h.update(" ".join(flags()).encode())
    h.update(f"{type(spec).__name__}{dataclasses.astuple(spec)!r}".encode())
    # The instantiation unit as built: what Python writes into it (its fields, its defines) is part of
    # the build, as the kernel sources are (a define chosen by a table here changed no field).
    h.update(spec.source().encode())
    return h.hexdigest()[:16]


def build(spec: GemmSpec | FusedSpec | PrefillSpec | PredecodeSpec, *, force: bool = False) -> Built:
    """The cubin of `spec`, compiled now or taken from the cache."""
    key = spec_key(spec)
    out = cache_dir() / f"{spec.name}-{key}.cubin"
    log = out.with_suffix(".log")
    if out.exists() and log.exists() and not force:
        return Built(out, log.read_text(), True)
    # One build per specialisation even when several processes (pytest-xdist workers) ask at once:
    # the others wait on the lock, then find the cubin.
    with open(out.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if out.exists() and log.exists() and not force:
            return Built(out, log.read_text(), True)
        return _compile(spec, out, log)


def find_nvcc() -> str | None:
    """The nvcc that builds the kernels: the PATH's, else $CUDA_HOME/bin/nvcc; None when neither."""
    nvcc = shutil.which("nvcc") or (
        os.path.join(os.environ["CUDA_HOME"], "bin", "nvcc") if os.environ.get("CUDA_HOME") else None
    )
    return nvcc if nvcc is not None and os.path.exists(nvcc) else None


def _compile(spec: GemmSpec | FusedSpec | PrefillSpec | PredecodeSpec, out: Path, log: Path) -> Built:
    kdir = KERNEL_DIR
    nvcc = find_nvcc()
    if nvcc is None:
        raise CompileError(f"nvcc not found (needed to build {spec.name}; cache {out} is empty)")
    with tempfile.TemporaryDirectory(prefix="megamoe-jit-") as tmp:
        src = Path(tmp) / f"{spec.name}.cu"
        src.write_text(spec.source())
        tmp_out = Path(tmp) / "out.cubin"
        cmd = [nvcc, *flags(), "-cubin", "-I", str(kdir), "-o", str(tmp_out), str(src)]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        text = proc.stdout + proc.stderr
        if proc.returncode != 0:
            raise CompileError(f"nvcc failed for {spec.name} (exit {proc.returncode}):\n{' '.join(cmd)}\n{text}")
        fd, tmp_final = tempfile.mkstemp(dir=out.parent, suffix=".tmp")
        os.close(fd)
        shutil.copyfile(tmp_out, tmp_final)
        os.replace(tmp_final, out)
        log.write_text(text)
    return Built(out, text, False)
