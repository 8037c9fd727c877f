"""Self-contained helpers for the SM90 GEMM tests: random pools and weights, fp64 references of
the dequantized operands, and a torch emulation of the D6 epilogue rule (SPEC §3)."""
from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from megamoe.jit import layout as L

REPO = Path(__file__).resolve().parents[2]
FP4_VALUES = torch.tensor([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6], dtype=torch.float64)


def log_result(**kw) -> None:
    """Appends one JSON line to $MEGAMOE_TEST_LOG (if set): measured ratios for the report."""
    path = os.environ.get("MEGAMOE_TEST_LOG")
    print("RESULT", json.dumps(kw))
    if path:
        with open(path, "a") as f:
            f.write(json.dumps(kw) + "\n")


def pow2_f64(e: torch.Tensor) -> torch.Tensor:
    return torch.pow(torch.tensor(2.0, dtype=torch.float64, device=e.device), e.to(torch.float64))


def dequant_fp8(codes: torch.Tensor, sf: torch.Tensor) -> torch.Tensor:
    v = codes.view(torch.float8_e4m3fn).to(torch.float64)
    s = pow2_f64(sf.to(torch.int64) - 127).repeat_interleave(32, dim=-1)
    return v * s


def dequant_fp4(packed: torch.Tensor, sf: torch.Tensor) -> torch.Tensor:
    codes = torch.stack([packed & 0xF, packed >> 4], dim=-1).flatten(-2).to(torch.int64)
    v = FP4_VALUES.to(packed.device)[codes]
    s = pow2_f64(sf.to(torch.int64) - 127).repeat_interleave(32, dim=-1)
    return v * s


def e4m3_codes(x: torch.Tensor) -> torch.Tensor:
    """fp32 -> e4m3 codes, RNE, saturating (clamp first: torch 2.11 casts overflow to NaN)."""
    x = x.to(torch.float32)
    q = x.clamp(-448.0, 448.0).to(torch.float8_e4m3fn).view(torch.uint8).clone()
    q[torch.isnan(x)] = 0x7F
    return q


class Pool:
    def __init__(self, counts, K, *, align=64, device="cuda", gen=None, grid=False, sf_lo=117, sf_hi=125,
                 grid_sf=(126, 128)):
        self.counts = list(counts)
        E = len(counts)
        offs = [0]
        for n in counts:
            offs.append(offs[-1] + (n + align - 1) // align * align)
        self.P = offs[-1] + align  # one trailing padding block (also keeps P > 0)
        self.offsets = torch.tensor(offs, dtype=torch.int32, device=device)
        self.num_tokens = torch.tensor(counts, dtype=torch.int32, device=device)
        P = self.P
        if grid:
            vals = torch.tensor([-2.0, -1.0, 0.0, 1.0, 2.0])
            idx = torch.randint(0, 5, (P, K), generator=gen)
            x = e4m3_codes(vals[idx])
            sf = torch.randint(grid_sf[0], grid_sf[1] + 1, (P, K // 32), generator=gen, dtype=torch.int32).to(torch.uint8)
        else:
            x = e4m3_codes(torch.randn(P, K, generator=gen) * 64.0)
            sf = torch.randint(sf_lo, sf_hi + 1, (P, K // 32), generator=gen, dtype=torch.int32).to(torch.uint8)
        valid = torch.zeros(P, dtype=torch.bool)
        for e, n in enumerate(counts):
            valid[offs[e]:offs[e] + n] = True
        # Padding rows hold NaN payloads and NaN-ish scale bytes: they must not leak anywhere.
        x[~valid] = 0x7F
        sf[~valid] = 0xFE
        self.valid = valid.to(device)
        self.x = x.to(device)
        self.sf = sf.to(device)
        self.w_route = torch.randn(P, generator=gen).to(device)
        self.offs = offs

    def rows(self, e):
        return slice(self.offs[e], self.offs[e] + self.counts[e])


def random_weights(E, R, K, *, gen=None, grid=False, sf_lo=113, sf_hi=118, device="cuda", grid_sf=(126, 128)):
    if grid:
        choices = torch.tensor([0, 1, 2, 4, 9, 10, 12], dtype=torch.uint8)
        codes = choices[torch.randint(0, 7, (E, R, K), generator=gen)]
        sf = torch.randint(grid_sf[0], grid_sf[1] + 1, (E, R, K // 32), generator=gen, dtype=torch.int32).to(torch.uint8)
    else:
        codes = torch.randint(0, 16, (E, R, K), generator=gen, dtype=torch.int32).to(torch.uint8)
        sf = torch.randint(sf_lo, sf_hi + 1, (E, R, K // 32), generator=gen, dtype=torch.int32).to(torch.uint8)
    packed = (codes[..., 0::2] | (codes[..., 1::2] << 4)).to(torch.uint8)
    return packed.to(device), sf.to(device)


def reference_acc(pool: Pool, x, sf, w, w_sf):
    """Per expert: (exact fp64 acc [n, R], bound fp64 sum |a b| [n, R])."""
    out = {}
    for e, n in enumerate(pool.counts):
        if n == 0:
            continue
        r = pool.rows(e)
        A = dequant_fp8(x[r], sf[r])
        B = dequant_fp4(w[e], w_sf[e])
        out[e] = (A @ B.T, A.abs() @ B.abs().T)
    return out


def bound_ratio(acc: torch.Tensor, exact: torch.Tensor, bound: torch.Tensor) -> float:
    err = (acc.to(torch.float64) - exact).abs()
    assert torch.isfinite(acc).all(), "non-finite accumulator"
    ratio = torch.where(bound > 0, err / bound.clamp_min(1e-300), torch.where(err > 0, torch.inf, 0.0))
    return float(ratio.max()) if ratio.numel() else 0.0


def silu_table(fast: bool, device) -> torch.Tensor:
    name = "silu_fast.bin" if fast else "silu_precise.bin"
    data = (REPO / "reference" / "tables" / name).read_bytes()
    return torch.frombuffer(bytearray(data), dtype=torch.int32).view(torch.float32).clone().to(device)


def emulate_d6(acc1: torch.Tensor, w_route: torch.Tensor, inter: int, fast: bool, clamp):
    """SPEC D6 on the dumped acc1 [n, 2I] (canonical): (codes [n, I] uint8, scale bytes [n, I/32])."""
    g = acc1[:, :inter].to(torch.bfloat16)
    u = acc1[:, inter:].to(torch.bfloat16)
    if clamp is not None:
        c = torch.tensor(clamp, dtype=torch.float32).to(torch.bfloat16).to(acc1.device)
        g = torch.minimum(g, c)
        u = torch.maximum(torch.minimum(u, c), -c)
    s = silu_table(fast, acc1.device)[g.view(torch.int16).to(torch.int64) & 0xFFFF]
    a = (s * u.to(torch.float32)) * w_route[:, None]
    n = a.shape[0]
    grp = a.view(n, inter // 32, 32)
    mag = grp.abs()
    amax = torch.where(torch.isnan(mag), torch.zeros_like(mag), mag).amax(-1)
    scaled = amax * torch.tensor(1.0 / 448.0, dtype=torch.float32, device=a.device)
    bits = scaled.view(torch.int32).to(torch.int64)
    byte = ((bits >> 23) & 0xFF) + ((bits & 0x7FFFFF) != 0).to(torch.int64)
    mult = pow2_f64(127 - byte).to(torch.float32)
    v = grp * mult[..., None]
    q = e4m3_codes(v).view(n, inter)
    return q, byte.to(torch.uint8)


def first_diff(a: torch.Tensor, b: torch.Tensor) -> str:
    d = (a != b)
    if not d.any():
        return "equal"
    idx = d.nonzero()[0].tolist()
    return f"{int(d.sum())} differ; first at {idx}: {a[tuple(idx)].item()} vs {b[tuple(idx)].item()}"
