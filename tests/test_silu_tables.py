"""The shipped SiLU tables (SPEC §3 D6 step 3): structure, and their error against float64 SiLU."""

import torch

from megamoe import reference as ref

# Measured on the shipped tables (generated on an H200 by kernel/probes/silu_tables.cu):
# fast (ex2.approx + rcp.approx) and precise (expf + IEEE division), |g| < 80, normal results.
MAX_ULP = {True: 64, False: 4}


def _ulp_error(fast: bool):
    table = ref.silu_table(fast).double()
    g = ref.decode_bf16(torch.arange(65536)).double()
    exact = g * torch.sigmoid(g)
    ok = torch.isfinite(g) & (g.abs() < 80) & (exact.abs() > 2.0**-126)
    ulp = torch.exp2(torch.floor(torch.log2(exact[ok].abs())) - 23)
    return (table[ok] - exact[ok]).abs() / ulp


def test_tables_have_the_documented_structure():
    for fast in (True, False):
        t = ref.silu_table(fast)
        assert t.shape == (65536,) and t.dtype == torch.float32
        assert t[0].item() == 0.0  # silu(+0)
        assert torch.isnan(t[0x7FC0]) and torch.isnan(t[0x7FFF])  # NaN stays NaN
        assert t[0x7F80].item() == float("inf")  # silu(+inf) = inf
        g = ref.decode_bf16(torch.arange(65536))
        big = torch.isfinite(g) & (g > 20)
        assert torch.equal(t[big], g[big])  # sigmoid rounds to 1 in fp32


def test_table_error_against_float64_silu():
    for fast in (True, False):
        err = _ulp_error(fast)
        print(f"{'fast' if fast else 'precise'} SiLU table: max {err.max():.1f} ulp, mean {err.mean():.3f} ulp")
        assert err.max() <= MAX_ULP[fast]
    assert not torch.equal(ref.silu_table(True), ref.silu_table(False))


def test_silu_probe_compiles_with_the_kernel_flags(tmp_path):
    """The probe that generates the tables builds with the kernel's own nvcc flags (CI has nvcc, no GPU)."""
    import shutil
    import subprocess

    import pytest

    from megamoe.jit.build import probe_command

    if shutil.which("nvcc") is None:
        pytest.skip("nvcc not installed")
    run = subprocess.run(
        probe_command("silu_tables", tmp_path / "probe.cubin", "-cubin"), capture_output=True, text=True
    )
    assert run.returncode == 0, run.stderr
