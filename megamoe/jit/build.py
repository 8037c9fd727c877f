"""Compile a kernel specialisation with nvcc and cache the cubin.

The cache key is a SHA-256 over: every file under kernel/ that a build can include (path and
bytes), the nvcc flags, and the specialisation. The cubin and ptxas' resource report are stored as
<cache>/<name>-<key16>.cubin / .log. The same key is computed on any machine, so cubins compiled
on a CPU-only machine (the CI compile gate) are reused on the GPU machine when the cache directory
travels with the code.
"""
from __future__ import annotations

import dataclasses
import hashlib
import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

from megamoe.kernel import KERNEL_DIR

from .flags import NVCC_FLAGS

EXTRA_FLAGS = ["-lineinfo", "-Xptxas", "-v", "-diag-suppress", "1160"]


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
        if f.suffix in (".cuh", ".cu", ".in", ".h") and f.is_file():
            h.update(str(f.relative_to(kdir)).encode())
            h.update(b"\0")
            h.update(f.read_bytes())
            h.update(b"\0")
    return h.digest()


@dataclasses.dataclass(frozen=True)
class GemmSpec:
    """One compiled specialisation of the grouped GEMM.

    decode="regs": kernel/gemm/gemm_sm90.cuh, every consumer thread decodes its own FP4 A
    fragments into registers (RS wgmma); both modes, 2 or 4 consumer warpgroups.
    decode="smem": kernel/gemm/gemm_sm90_ss.cuh, a transform warpgroup decodes each stage's weight
    tile into shared memory once for all BN tokens (SS wgmma); fast mode only, 2 consumer
    warpgroups, BN <= 128.
    """

    layer: int            # 1 (L1 + SwiGLU/requant epilogue) or 2 (L2 + bf16 combine epilogue)
    block_n: int          # token tile (wgmma N): multiple of 8, 8..256 (8..128 picked and tested)
    stages: int           # pipeline depth
    exact: bool = True    # True: promote per k32 with both scales (exact mode)
    fast_silu: bool = True
    debug: bool = False   # dump the fp32 accumulators (D5 / D7)
    wgs: int = 2          # consumer warpgroups (64 weight rows each): 2, or 4 for small token tiles
    decode: str = "regs"  # where the FP4 weights are decoded: "regs" or "smem" (see above)

    def __post_init__(self):
        if self.block_n % 8 or not 8 <= self.block_n <= 256:
            raise ValueError(f"block_n: expected a multiple of 8 in 8..256, got {self.block_n}")
        if self.decode not in ("regs", "smem"):
            raise ValueError(f"decode: expected 'regs' or 'smem', got {self.decode!r}")
        if self.decode == "smem" and (self.exact or self.wgs != 2 or self.block_n > 128):
            raise ValueError("decode='smem' is the fast mode with 2 consumer warpgroups and block_n <= 128")

    @property
    def name(self) -> str:
        return (f"gemm_l{self.layer}_n{self.block_n}_s{self.stages}_{'exact' if self.exact else 'fast'}"
                f"_{'fsilu' if self.fast_silu else 'psilu'}_w{self.wgs}{'_ss' if self.decode == 'smem' else ''}"
                f"{'_dbg' if self.debug else ''}")

    @property
    def threads(self) -> int:
        """Threads per CTA: a producer warpgroup, a transform warpgroup (decode="smem") and the consumers."""
        return 128 * (1 + self.wgs + (self.decode == "smem"))

    def source(self) -> str:
        tmpl = (KERNEL_DIR / "gemm" / "instantiate.cu.in").read_text()
        b = lambda v: "true" if v else "false"  # noqa: E731
        if self.decode == "smem":
            header, body = "gemm/gemm_sm90_ss.cuh", "gemm_sm90_ss_body"
            args = [self.layer, self.block_n, self.stages, b(self.fast_silu), b(self.debug)]
        else:
            header, body = "gemm/gemm_sm90.cuh", "gemm_sm90_body"
            args = [self.layer, self.block_n, self.stages, b(self.exact), b(self.fast_silu), b(self.debug), self.wgs]
        fields = {"HEADER": header, "THREADS": str(self.threads), "BODY": body,
                  "TEMPLATE_ARGS": ", ".join(str(a) for a in args)}
        for k, v in fields.items():
            tmpl = tmpl.replace(f"@{k}@", v)
        return tmpl


@dataclasses.dataclass
class Built:
    cubin: Path
    log: str
    cached: bool

    @property
    def spill_bytes(self) -> int:
        return sum(int(a) + int(b) for a, b in re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads", self.log))

    @property
    def registers(self) -> int:
        m = re.search(r"Used (\d+) registers", self.log)
        return int(m.group(1)) if m else -1


def flags() -> list[str]:
    return [*NVCC_FLAGS, *EXTRA_FLAGS]


def spec_key(spec: GemmSpec) -> str:
    kdir = KERNEL_DIR
    h = hashlib.sha256()
    h.update(_sources_digest(kdir))
    h.update(" ".join(flags()).encode())
    h.update(repr(dataclasses.astuple(spec)).encode())
    return h.hexdigest()[:16]


def build(spec: GemmSpec, *, force: bool = False) -> Built:
    """The cubin of `spec`, compiled now or taken from the cache."""
    kdir = KERNEL_DIR
    key = spec_key(spec)
    out = cache_dir() / f"{spec.name}-{key}.cubin"
    log = out.with_suffix(".log")
    if out.exists() and log.exists() and not force:
        return Built(out, log.read_text(), True)
    nvcc = shutil.which("nvcc") or (os.path.join(os.environ["CUDA_HOME"], "bin", "nvcc")
                                    if os.environ.get("CUDA_HOME") else None)
    if nvcc is None or not os.path.exists(nvcc):
        raise CompileError(f"nvcc not found (needed to build {spec.name}; cache {out} is empty)")
    with tempfile.TemporaryDirectory(prefix="megamoe-jit-") as tmp:
        src = Path(tmp) / f"{spec.name}.cu"
        src.write_text(spec.source())
        tmp_out = Path(tmp) / "out.cubin"
        cmd = [nvcc, *flags(), "-cubin", "-I", str(kdir), "-o", str(tmp_out), str(src)]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        text = proc.stdout + proc.stderr
        if proc.returncode != 0:
            raise CompileError(f"nvcc failed for {spec.name} (exit {proc.returncode}):\n"
                               f"{' '.join(cmd)}\n{text}")
        fd, tmp_final = tempfile.mkstemp(dir=out.parent, suffix=".tmp")
        os.close(fd)
        shutil.copyfile(tmp_out, tmp_final)
        os.replace(tmp_final, out)
        log.write_text(text)
    return Built(out, text, False)
