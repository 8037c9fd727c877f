"""CI compile gate: every kernel specialisation the GPU tests and the benchmark use compiles with
nvcc for sm_90a, and ptxas reports no register spills (and no local-memory stack frame).

Runs on a CPU-only machine; skipped when nvcc is absent. Builds go to $MEGAMOE_CACHE_DIR (a fresh
temporary directory unless set), two at a time."""
from __future__ import annotations

import os
import re
import shutil
from concurrent.futures import ThreadPoolExecutor

import pytest

from megamoe import gemm as G
from megamoe.jit import build as jb

pytestmark = pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not installed")


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    if not os.environ.get("MEGAMOE_CACHE_DIR"):
        os.environ["MEGAMOE_CACHE_DIR"] = str(tmp_path_factory.mktemp("jitcache"))
    specs = G.used_specs()
    with ThreadPoolExecutor(max_workers=max(2, min(8, os.cpu_count() or 2))) as ex:
        results = list(ex.map(jb.build, specs))
    return dict(zip(specs, results))


def test_all_specialisations_compile_without_spills(built):
    bad = []
    for spec, b in built.items():
        stack = [int(v) for v in re.findall(r"(\d+) bytes stack frame", b.log)]
        if b.spill_bytes or any(stack):
            bad.append(f"{spec.name}: {b.spill_bytes} spill bytes, stack {stack}")
        assert "sm_90a" in b.log, f"{spec.name}: not built for sm_90a"
    assert not bad, "ptxas spills:\n" + "\n".join(bad)


def test_cache_hit_and_key(built):
    spec = next(iter(built))
    again = jb.build(spec)
    assert again.cached and again.cubin == built[spec].cubin
    other = jb.GemmSpec(spec.layer, spec.block_n, spec.stages, spec.exact, spec.fast_silu, not spec.debug)
    assert jb.spec_key(other) != jb.spec_key(spec)


def test_compile_error_is_a_readable_python_error(tmp_path, monkeypatch):
    monkeypatch.setenv("MEGAMOE_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(jb.GemmSpec, "source", lambda self: '#error "planted compile error"\n')
    with pytest.raises(jb.CompileError, match=r"nvcc failed[\s\S]*planted compile error"):
        jb.build(jb.GemmSpec(layer=1, block_n=16, stages=2))


def test_spec_rejects_a_token_tile_the_kernel_cannot_have():
    with pytest.raises(ValueError, match="block_n"):
        jb.GemmSpec(layer=1, block_n=12, stages=2)


def test_registers_are_the_launch_allocation(built):
    """The setmaxnreg budgets in the kernels (producer / transform / consumers) redistribute the
    launch allocation, so they assume ptxas gave every thread the launch-bound maximum:
    65536 / threads, rounded down to a multiple of 8."""
    bad = [f"{s.name}: {b.registers} registers, expected {(65536 // s.threads) // 8 * 8}"
           for s, b in built.items() if b.registers != (65536 // s.threads) // 8 * 8]
    assert not bad, "\n".join(bad)


def test_host_shared_memory_size_matches_the_kernel_layout(tmp_path):
    """megamoe.gemm.smem_bytes (what the launch asks for) equals the kernel's own layout size
    (gemm_smem_bytes / gemm_ss_smem_bytes, constexpr on the host too) for every used
    specialisation. (The kernel also traps at run time when it gets less.)"""
    from megamoe.jit.flags import NVCC_FLAGS
    from megamoe.kernel import KERNEL_DIR

    specs = G.used_specs()
    lines = []
    for s in specs:
        if s.decode == "smem":
            lines.append(f'  std::printf("%d\\n", megamoe::gemm_ss_smem_bytes<{s.layer}, {s.block_n}, {s.stages}>());')
        else:
            lines.append(f'  std::printf("%d\\n", megamoe::gemm_smem_bytes<{s.layer}, {s.block_n}, {s.stages}, {s.wgs}>());')
    src = tmp_path / "sizes.cu"
    src.write_text('#include <cstdio>\n#include "gemm/gemm_sm90.cuh"\n#include "gemm/gemm_sm90_ss.cuh"\n'
                   "int main() {\n" + "\n".join(lines) + "\n  return 0;\n}\n")
    exe = tmp_path / "sizes"
    import subprocess

    subprocess.run([shutil.which("nvcc"), *NVCC_FLAGS, "-I", str(KERNEL_DIR), "-o", str(exe), str(src)],
                   check=True, capture_output=True, text=True)
    kernel_sizes = [int(v) for v in subprocess.run([str(exe)], check=True, capture_output=True,
                                                   text=True).stdout.split()]
    host_sizes = [G.spec_smem_bytes(s) for s in specs]
    bad = [f"{s.name}: host {h}, kernel {k}" for s, h, k in zip(specs, host_sizes, kernel_sizes) if h != k]
    assert len(kernel_sizes) == len(specs) and not bad, "\n".join(bad)
