"""Standalone entry points of the SM90 grouped GEMMs (L1 with the fused SwiGLU/requant epilogue,
L2 with the bf16 combine epilogue), built and launched through megamoe.jit.

Pool (SPEC D4): pool rows are grouped expert-major; expert e owns rows
[expert_offsets[e], expert_offsets[e] + num_tokens[e]) (its start BLOCK_M aligned; rows up to the
next expert's start are padding, never read into any valid output and never written).

    l1 = l1_gemm(x_pool, x_sf, expert_offsets, num_tokens, w_route, kw, ...)
    l2 = l2_gemm(l1.l2_acts, l1.l2_sf, expert_offsets, num_tokens, dst_rows, kw, combine, ...)

`kw` is megamoe.jit.layout.KernelWeights (from transform_weights).

Modes:
* mode="exact": every k32 wgmma product is promoted into fp32 with both per-32 scales
  (final += acc_k32 * 2^(sw-127) * 2^(sx-127)). GEMM_BOUND tau: EXACT_TAU.
* mode="fast": the activations are rebased to one scale per (row, K128 block) by
  `rebase_k128` (the documented operand transform: scale byte = max of the four group bytes,
  payload re-rounded RNE to payload * 2^(s_g - s_max), E4M3 subnormals included); the weight
  per-32 scales are folded into the FP4->E4M3 decode LUT relative to the largest group of each
  (row, K128 block) (exact for offsets <= 8 binades, RNE onto the E4M3 subnormal grid up to 15,
  zero beyond); the four k32 products of a K128 block accumulate in the tensor core and are
  promoted once. GEMM_BOUND tau (measured against the ORIGINAL per-32 operands): FAST_TAU.
  Pass x_sf128 (from rebase_k128) to give the already rebased operand; otherwise the entry point
  rebases with torch ops before the launch.
"""
from __future__ import annotations

import dataclasses
import struct

import torch

from megamoe.reference.quantize import rebase_k128 as ref_rebase_k128

from .jit import build as jb
from .jit import driver
from .jit.layout import KernelWeights, transform_weights, untransform_weights  # noqa: F401

BLOCK_ROWS = 128          # weight rows per CTA with 2 consumer warpgroups (64 per warpgroup)
BLOCK_K = 128
MAX_DYN_SMEM = 232448     # sm_90 opt-in limit per block
MAX_EXPERTS = 256

# GEMM_BOUND tau of the exact mode, |acc - exact| <= tau * sum_k |a_k b_k|; calibrated on the H200
# by tests/gpu/test_gemm.py (which prints the largest observed ratio).
EXACT_TAU = 2.0 ** -12
FAST_TAU = 2.0 ** -10


def pick_block_n(max_tokens: int, layer: int = 2, mode: str = "exact") -> int:
    """Token tile for a launch whose largest expert has max_tokens rows: the smallest of 8..64 that
    holds them; above 64, the fast mode takes 128 (split-N pipelined mainloop: one FP4 decode per
    128 tokens), exact-mode L2 128, exact-mode L1 64 (BN = 128 is tested, tests/gpu/
    test_gemm_fused_hooks.py, but not measured faster). block_n=64 keeps the fast mode on its
    BN <= 64 mainloop."""
    for bn in (8, 16, 32, 64):
        if max_tokens <= bn:
            return bn
    return 128 if (layer == 2 or mode == "fast") else 64


def _epi_bytes(layer: int, bn: int) -> int:
    """Epilogue staging per consumer warpgroup (kernel/epilogue/epilogue.cuh kEpilogueBytes)."""
    return bn * 32 + 4 * bn * 4 if layer == 1 else bn * 64 * 2


LUT_ENTRIES = 17          # kernel/gemm/fp4_decode.cuh kLutEntries (8-byte scaled FP4 LUTs)
BARRIER_BYTES = 8


def _barriers_per_stage(decode: str) -> int:
    return 3 if decode == "smem" else 2      # full, empty (+ ready: the decoded A tile)


def _stage_bytes(bn: int, wgs: int = 2, decode: str = "regs") -> int:
    rows = 64 * wgs
    decoded = rows * BLOCK_K if decode == "smem" else 0   # the E4M3 A tile of the decode-to-smem kernel
    return bn * BLOCK_K + decoded + rows * BLOCK_K // 2 + rows * 4 + bn * 4


def smem_bytes(layer: int, bn: int, stages: int, wgs: int = 2, decode: str = "regs") -> int:
    # mirrors gemm_smem_bytes() in kernel/gemm/gemm_sm90.cuh and gemm_ss_smem_bytes() in gemm_sm90_ss.cuh
    barriers = _barriers_per_stage(decode) * stages * BARRIER_BYTES
    return (1024 + stages * _stage_bytes(bn, wgs, decode) + _epi_bytes(layer, bn) * wgs + barriers
            + LUT_ENTRIES * 8 + (2 * MAX_EXPERTS + 1) * 4)


def spec_smem_bytes(spec: jb.GemmSpec) -> int:
    return smem_bytes(spec.layer, spec.block_n, spec.stages, spec.wgs, spec.decode)


def pick_stages(layer: int, bn: int, wgs: int = 2, decode: str = "regs") -> int:
    fixed = smem_bytes(layer, bn, 0, wgs, decode)
    per_stage = _stage_bytes(bn, wgs, decode) + 3 * BARRIER_BYTES   # (one barrier of slack for the register form)
    return max(2, min(12, (MAX_DYN_SMEM - fixed) // per_stage))


def pick_wgs(block_n: int, n_rows: int | None = None) -> int:
    """Consumer warpgroups per CTA: 4 (256 weight rows per CTA, 20 warps) for the 8-token tile,
    where the per-stage latency of each consumer warp, not HBM or the tensor core, limits and more
    warps per scheduler hide it; 2 otherwise (register budget: 640 x 96 launch registers leave the
    4-warpgroup consumers 104 each, too few for larger tiles without spills)."""
    if block_n <= 8 and (n_rows is None or n_rows % 256 == 0):
        return 4
    return 2


def pick_decode(block_n: int, mode: str) -> str:
    """Where the FP4 weights are decoded (GemmSpec.decode): always in the consumers' registers.
    The shared-memory decode (decode="smem", a transform warpgroup, SS wgmma) gives bit-identical
    results but measured 3-12 % slower at BN = 128 and 8-22 % slower at BN = 64 on the H200
    (`python -m bench.check_decode`; bench/NOTES.md v7 / v7b: shared-memory bandwidth); it stays
    selectable for that comparison."""
    return "regs"


def spec_for(layer: int, block_n: int, *, mode: str = "exact", fast_math: bool = True,
             debug: bool = False, n_rows: int | None = None, wgs: int | None = None,
             decode: str | None = None) -> jb.GemmSpec:
    if mode not in ("exact", "fast"):
        raise ValueError(f"mode: expected 'exact' or 'fast', got {mode!r}")
    decode = pick_decode(block_n, mode) if decode is None else decode
    wgs = (pick_wgs(block_n, n_rows) if decode == "regs" else 2) if wgs is None else wgs
    return jb.GemmSpec(layer=layer, block_n=block_n, stages=pick_stages(layer, block_n, wgs, decode),
                       exact=mode == "exact", fast_silu=bool(fast_math) if layer == 1 else True, debug=debug,
                       wgs=wgs, decode=decode)


def rebase_k128(x: torch.Tensor, x_sf: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The fast mode's activation operand: (payload [P, K] uint8 e4m3, scale bytes [P, K/128] uint8).
    The transform is part of the contract; its one definition is megamoe.reference.rebase_k128."""
    q = ref_rebase_k128(_u8(x), x_sf)
    return q.codes.contiguous(), q.scales.contiguous()


def _pack_params(tmap: bytes, ptrs: list[int], ints: list[int], clamp: float, has_clamp: int, err: int) -> bytes:
    """The bytes of kernel/gemm/params.cuh GemmParams (offsets pinned by static_asserts there)."""
    assert len(tmap) == 128 and len(ptrs) == 11 and len(ints) == 5
    b = (tmap + struct.pack("<11Q", *ptrs) + struct.pack("<5q", *ints) + struct.pack("<fi", clamp, has_clamp)
         + struct.pack("<Q", err))
    assert len(b) == 272
    return b + bytes(384 - len(b))


_ERR: dict[int, torch.Tensor] = {}
# kernel/common/ptx.cuh WaitKind: what a trap record names.
WAIT_NAMES = {1: "full stage barrier", 2: "empty stage barrier", 3: "arrival counter of pool block",
              4: "decoded-tile (ready) barrier of stage"}
LAYOUT_CHECK = 5


def _err_record(dev: int) -> torch.Tensor:
    """Host-mapped pinned int32[8]: the kernel's timeout record (SPEC §5), readable after a trap."""
    if dev not in _ERR:
        _ERR[dev] = torch.zeros(8, dtype=torch.int32, pin_memory=True)
    return _ERR[dev]


def timeout_message(dev: int = 0) -> str | None:
    """Words for the kernel's trap record on device `dev` (a wait that timed out, or the shared-memory
    layout check), or None when no launch trapped through it. Word 0 is 1 when the record is
    complete, 2 when the trapping thread claimed it but the trap ended the kernel before it set 1
    (its fields were written and fenced first, so they are still shown)."""
    r = _ERR.get(dev)
    if r is None or int(r[0]) == 0:
        return None
    state, what, blk, idx, exp, obs, thr = (int(v) for v in r[0:7])
    note = "" if state == 1 else " (record claimed, completion flag not seen)"
    if what == LAYOUT_CHECK:
        return (f"SM block {blk} thread {thr}: the launch gave {obs} bytes of dynamic shared memory, the "
                f"kernel's layout needs {exp}{note}")
    return (f"SM block {blk} thread {thr}: waited for {WAIT_NAMES.get(what, what)} {idx}: "
            f"expected {exp}, observed {obs}{note}")


def reset_timeout_record(dev: int = 0) -> None:
    """Clears device `dev`'s trap record (the kernel only writes it while it is clear)."""
    r = _ERR.get(dev)
    if r is not None:
        r.zero_()


def _check(name, t, dtype, shape=None, device=None):
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if t.dtype != dtype:
        raise TypeError(f"{name}: expected dtype {dtype}, got {t.dtype}")
    if shape is not None and tuple(t.shape) != tuple(shape):
        raise ValueError(f"{name}: expected shape {tuple(shape)}, got {tuple(t.shape)}")
    if device is not None and t.device != device:
        raise ValueError(f"{name}: expected device {device}, got {t.device}")
    if not t.is_contiguous():
        raise ValueError(f"{name}: must be contiguous")


def _u8(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype != torch.uint8 else t


@dataclasses.dataclass
class L1Result:
    l2_acts: torch.Tensor          # [P, I] float8_e4m3fn, natural channel order
    l2_sf: torch.Tensor            # [P, I/32] uint8
    acc1: torch.Tensor | None      # debug: [P, 2I] fp32, canonical order (gate then up)


@dataclasses.dataclass
class L2Result:
    combine: torch.Tensor          # the combine buffer that was written, [K, T, H] bf16
    acc2: torch.Tensor | None      # debug: [P, H] fp32


_FUNCS: dict[tuple[jb.GemmSpec, int], tuple[object, int]] = {}


def used_specs() -> list[jb.GemmSpec]:
    """Every specialisation the GPU tests and the benchmark launch (the CI compile gate builds these)."""
    specs = []
    for mode in ("exact", "fast"):
        for debug in (False, True):
            for bn in (8, 16, 32, 64, 128):  # exact-mode L1 at 128: tests/gpu/test_gemm_fused_hooks.py
                for fast_silu in (True, False):
                    specs.append(spec_for(1, bn, mode=mode, fast_math=fast_silu, debug=debug))
            for bn in (8, 16, 32, 64, 128):
                specs.append(spec_for(2, bn, mode=mode, debug=debug))
    # The fast mode's two decode placements at the tiles where both run (the benchmark compares them).
    for decode in ("regs", "smem"):
        for debug in (False, True):
            for bn in (64, 128):
                for spec in [spec_for(1, bn, mode="fast", fast_math=f, debug=debug, decode=decode) for f in (True, False)] \
                        + [spec_for(2, bn, mode="fast", debug=debug, decode=decode)]:
                    if spec not in specs:
                        specs.append(spec)
    return specs


def _function(spec: jb.GemmSpec, dev: int):
    key = (spec, dev)
    if key not in _FUNCS:
        built = jb.build(spec)
        smem = spec_smem_bytes(spec)
        _FUNCS[key] = (driver.get_function(built.cubin, "megamoe_gemm", dev, smem), driver.num_sms(dev))
    return _FUNCS[key]


def _launch(spec: jb.GemmSpec, x: torch.Tensor, k: int, ptrs: list[int], n_rows: int, num_experts: int,
            clamp: float, has_clamp: int, *, arrival: torch.Tensor | None = None, arrival_block: int = 0) -> None:
    """Checks the arrival gate's arguments, then launches on the current stream. ptrs[10] (the
    GemmParams::arrival pointer) is set here: the counters' address, or 0 (nullptr) without them."""
    P = x.shape[0]
    if arrival is None:
        if arrival_block:
            raise ValueError(f"arrival_block: given ({arrival_block!r}) without arrival counters (arrival=None)")
        arrival_block = 0
    else:
        if isinstance(arrival_block, bool) or not isinstance(arrival_block, int) or arrival_block <= 0:
            raise ValueError(f"arrival_block: expected a positive int (pool rows per arrival counter), "
                             f"got {arrival_block!r}")
        _check("arrival", arrival, torch.int32, (-(-P // arrival_block),), x.device)
    ptrs = list(ptrs)
    ptrs[10] = arrival.data_ptr() if arrival is not None else 0
    dev = x.device.index if x.device.index is not None else torch.cuda.current_device()
    fn, grid = _function(spec, dev)
    smem = spec_smem_bytes(spec)
    if n_rows % (64 * spec.wgs):
        raise ValueError(f"weight rows: expected a multiple of {64 * spec.wgs}, got {n_rows}")
    tmap = driver.tma_2d_u8(x.data_ptr(), k, P, k, BLOCK_K, spec.block_n)
    params = _pack_params(tmap, ptrs, [num_experts, P, k, n_rows, arrival_block], clamp, has_clamp,
                          _err_record(dev).data_ptr())
    stream = torch.cuda.current_stream(x.device).cuda_stream
    driver.launch(fn, grid, spec.threads, smem, stream, params)


def _common_checks(x, x_sf, expert_offsets, num_tokens, k, sf_group=32):
    dev = x.device
    if dev.type != "cuda":
        raise ValueError(f"x: expected a CUDA tensor, got device {dev}")
    P = x.shape[0]
    _check("x", x, x.dtype, (P, k), dev)
    if x.dtype not in (torch.uint8, torch.float8_e4m3fn):
        raise TypeError(f"x: expected float8_e4m3fn or uint8, got {x.dtype}")
    _check("x_sf", x_sf, torch.uint8, (P, k // sf_group), dev)
    E = num_tokens.shape[0]
    _check("num_tokens", num_tokens, torch.int32, (E,), dev)
    _check("expert_offsets", expert_offsets, torch.int32, (E + 1,), dev)
    if E > MAX_EXPERTS:
        raise ValueError(f"num_tokens: at most {MAX_EXPERTS} local experts, got {E}")
    if k % BLOCK_K:
        raise ValueError(f"K: expected a multiple of {BLOCK_K}, got {k}")
    if x.data_ptr() % 16 or x_sf.data_ptr() % 16:
        raise ValueError("x, x_sf: must be 16-byte aligned")
    return E


def _activation_operand(x, x_sf, x_sf128, expert_offsets, num_tokens, k: int, mode: str, k_name: str):
    """The GEMM's activation operand, checked: per-32 scales (exact mode) or, in fast mode, the
    payload and scales rebased per K128 (computed here unless the caller passes x_sf128 with an
    already rebased x). Returns (x, scales, number of experts)."""
    if mode == "fast":
        if x_sf128 is None:
            _common_checks(x, x_sf, expert_offsets, num_tokens, k)
            x, x_sf128 = rebase_k128(x, x_sf)
        x_sf = x_sf128
    num_experts = _common_checks(x, x_sf, expert_offsets, num_tokens, k, 128 if mode == "fast" else 32)
    if mode == "fast" and k % 512:
        raise ValueError(f"{k_name}: the fast mode needs a multiple of 512, got {k}")
    return x, x_sf, num_experts


def l1_gemm(x_pool: torch.Tensor, x_sf: torch.Tensor, expert_offsets: torch.Tensor, num_tokens: torch.Tensor,
            w_route: torch.Tensor, kw: KernelWeights, *, fast_math: bool = True,
            activation_clamp: float | None = None, mode: str = "exact", block_n: int | None = None,
            debug: bool = False, out: torch.Tensor | None = None, out_sf: torch.Tensor | None = None,
            max_tokens: int | None = None, x_sf128: torch.Tensor | None = None,
            arrival: torch.Tensor | None = None, arrival_block: int = 0, decode: str | None = None) -> L1Result:
    """L1 grouped GEMM + fused D6 epilogue. x_pool [P, H] e4m3, x_sf [P, H/32] UE8M0,
    expert_offsets int32 [E+1], num_tokens int32 [E], w_route fp32 [P].
    Returns l2_acts [P, I] (e4m3), l2_sf [P, I/32] and, with debug=True, acc1 [P, 2I] fp32
    (canonical: gate channels then up channels). Rows of padding are left as they were.

    out / out_sf: optional destinations (contiguous [P, I] e4m3 or uint8, 16-byte aligned; [P, I/32]
    uint8, any alignment); they may be views into a larger buffer (e.g. a peer's, through a pointer
    offset): only the valid pool rows of the view are written.

    Arrival gate (the fused kernel's hook; SPEC §5): with `arrival` (int32 [ceil(P / arrival_block)],
    one counter per `arrival_block` pool rows) the producer's TMA thread and its scale warp spin, for
    each work item, until every pool block under the item's token block has counter >= its number
    of valid rows. So another stream or GPU may write the pool rows (x_pool, their scales x_sf /
    x_sf128, w_route) while the GEMM runs and publish them by raising the counters (release order:
    rows first); expert_offsets and num_tokens must be in place at the launch. Every pool block must
    lie inside one expert (arrival_block divides the pool alignment of expert_offsets; not checked:
    that would need a device sync). A counter that never fills makes the kernel trap after its spin
    timeout (~10 s) with a record readable by timeout_message(). In fast mode pass the rebased
    operand (x_sf128): without it the rows are rebased with torch ops before the launch, which reads
    them ahead of the gate. arrival=None (default): all rows present, no gate."""
    H, inter = kw.hidden, kw.intermediate
    x_pool, x_sf, E = _activation_operand(x_pool, x_sf, x_sf128, expert_offsets, num_tokens, H, mode, "hidden")
    P = x_pool.shape[0]
    _check("w_route", w_route, torch.float32, (P,), x_pool.device)
    if kw.num_experts != E:
        raise ValueError(f"kw: expected {E} experts (len(num_tokens)), got {kw.num_experts}")
    if (2 * inter) % BLOCK_ROWS:
        raise ValueError(f"intermediate: 2I must be a multiple of {BLOCK_ROWS}, got {2 * inter}")
    if block_n is None:
        block_n = pick_block_n(max_tokens if max_tokens is not None else int(num_tokens.max().item()) if E else 1, 1, mode)
    spec = spec_for(1, block_n, mode=mode, fast_math=fast_math, debug=debug, n_rows=2 * inter, decode=decode)
    if out is None:
        out = torch.empty(P, inter, dtype=torch.float8_e4m3fn, device=x_pool.device)
    if out_sf is None:
        out_sf = torch.empty(P, inter // 32, dtype=torch.uint8, device=x_pool.device)
    if out.dtype not in (torch.float8_e4m3fn, torch.uint8):
        raise TypeError(f"out: expected float8_e4m3fn or uint8, got {out.dtype}")
    _check("out", out, out.dtype, (P, inter), x_pool.device)
    _check("out_sf", out_sf, torch.uint8, (P, inter // 32), x_pool.device)
    if out.data_ptr() % 16:
        raise ValueError(f"out: must be 16-byte aligned (the epilogue stores 16-byte vectors), "
                         f"address is {out.data_ptr() % 16} mod 16")
    acc1 = torch.full((P, 2 * inter), float("nan"), dtype=torch.float32, device=x_pool.device) if debug else None
    if activation_clamp is not None:
        c = float(torch.tensor(activation_clamp, dtype=torch.float32).to(torch.bfloat16).float())
        has_clamp = 1
    else:
        c, has_clamp = 0.0, 0
    ptrs = [kw.w1.data_ptr(), kw.w1_sf.data_ptr(), x_sf.data_ptr(), expert_offsets.data_ptr(),
            num_tokens.data_ptr(), w_route.data_ptr(), out.data_ptr(), out_sf.data_ptr(), 0,
            acc1.data_ptr() if acc1 is not None else 0, 0]
    _launch(spec, _u8(x_pool), H, ptrs, 2 * inter, E, c, has_clamp, arrival=arrival, arrival_block=arrival_block)
    return L1Result(out, out_sf, acc1)


def l2_gemm(l2_acts: torch.Tensor, l2_sf: torch.Tensor, expert_offsets: torch.Tensor, num_tokens: torch.Tensor,
            dst_rows: torch.Tensor, kw: KernelWeights, combine: torch.Tensor, *, mode: str = "exact",
            block_n: int | None = None, debug: bool = False, max_tokens: int | None = None,
            x_sf128: torch.Tensor | None = None, arrival: torch.Tensor | None = None,
            arrival_block: int = 0, decode: str | None = None) -> L2Result:
    """L2 grouped GEMM + D8 epilogue: bf16(acc2) of pool row p goes to combine.view(-1, H)[dst_rows[p]]
    (dst_rows[p] = k * T + t for a combine buffer [K, T, H]; < 0 = skip). Padding rows write nothing.
    combine (contiguous bf16 [..., H], 16-byte aligned) may be a view into a larger buffer (e.g. a
    peer's, through a pointer offset): rows no valid pool row maps to are left as they were.

    arrival / arrival_block: the arrival gate on the pool rows of l2_acts and their scales (l2_sf /
    x_sf128), as in l1_gemm; dst_rows (read through the read-only cache), expert_offsets and
    num_tokens must be in place at the launch."""
    H, inter = kw.hidden, kw.intermediate
    l2_acts, l2_sf, E = _activation_operand(l2_acts, l2_sf, x_sf128, expert_offsets, num_tokens, inter, mode,
                                            "intermediate")
    P = l2_acts.shape[0]
    _check("dst_rows", dst_rows, torch.int32, (P,), l2_acts.device)
    if combine.dtype != torch.bfloat16 or combine.shape[-1] != H or not combine.is_contiguous():
        raise ValueError(f"combine: expected a contiguous bf16 tensor [..., {H}], got {combine.dtype} {tuple(combine.shape)}")
    if combine.device != l2_acts.device:
        raise ValueError(f"combine: expected device {l2_acts.device}, got {combine.device}")
    if combine.data_ptr() % 16:
        raise ValueError(f"combine: must be 16-byte aligned (the epilogue stores 16-byte vectors), "
                         f"address is {combine.data_ptr() % 16} mod 16")
    if H % BLOCK_ROWS:
        raise ValueError(f"hidden: expected a multiple of {BLOCK_ROWS}, got {H}")
    if block_n is None:
        block_n = pick_block_n(max_tokens if max_tokens is not None else int(num_tokens.max().item()) if E else 1, 2, mode)
    spec = spec_for(2, block_n, mode=mode, debug=debug, n_rows=H, decode=decode)
    acc2 = torch.full((P, H), float("nan"), dtype=torch.float32, device=l2_acts.device) if debug else None
    ptrs = [kw.w2.data_ptr(), kw.w2_sf.data_ptr(), l2_sf.data_ptr(), expert_offsets.data_ptr(),
            num_tokens.data_ptr(), 0, combine.data_ptr(), 0, dst_rows.data_ptr(),
            acc2.data_ptr() if acc2 is not None else 0, 0]
    _launch(spec, _u8(l2_acts), inter, ptrs, H, E, 0.0, 0, arrival=arrival, arrival_block=arrival_block)
    return L2Result(combine, acc2)
