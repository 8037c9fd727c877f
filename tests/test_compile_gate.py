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
