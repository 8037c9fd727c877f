"""Standalone entry points of the SM90 grouped GEMMs (L1 with the fused SwiGLU/requant epilogue,
L2 with the bf16 combine epilogue), built and launched through megamoe.jit.

Pool (SPEC D4): pool rows are grouped expert-major; expert e owns rows
[expert_offsets[e], expert_offsets[e] + expert_rows[e]) (its start BLOCK_M aligned; rows up to the
next expert's start are padding, never read into any valid output and never written).

    l1 = l1_gemm(x_pool, x_sf, expert_offsets, expert_rows, w_route, kw, ...)
    l2 = l2_gemm(l1.l2_acts, l1.l2_sf, expert_offsets, expert_rows, dst_rows, kw, combine, ...)

`kw` is megamoe.jit.layout.KernelWeights (from transform_weights).

What the entry points launch through lives beside this module: the launcher of each kernel kind
(its spec, launch configuration, parameters and launch) in megamoe.launchers, the per-device
runtime (trap records, item counters, loaded kernels, launch caches, prefill scratch buffers) in
megamoe.runtime, the choices of path and specialisation (use_prefill, pick_max_tile, pick_wgs,
spec_for) in megamoe.heuristics, GemmParams' builder, the weights' parameter fields and the
argument checks the fused layer makes too in megamoe.launch. The names users reach here
(megamoe.gemm.use_prefill, megamoe.gemm.timeout_message, ...) are still named here.

The `promotion` knob (GemmSpec.promotion, the kernel's kPerK32) says how often the tensor core's
products are promoted into fp32 with their scales:
* "k32" (the exact mode): every k32 product, with both per-32 scales
  (final += acc_k32 * 2^(sw-127) * 2^(sx-127)). GEMM_BOUND tau: TAU["k32"].
* "k128" (the fast mode): once per K128 block. The activations are rebased to one scale per
  (row, K128 block) by `rebase_k128` (scale byte = max of the four group bytes, payload re-rounded
  RNE to payload * 2^(s_g - s_max), E4M3 subnormals included); the weights are decoded through
  per-row scaled tables (megamoe.reference.quantize.dequantize_fp4_fast: exact for every group
  within 14 binades of its row's largest, rounded onto E4M3's subnormal grid 15-18 binades under
  it, zero beyond). GEMM_BOUND tau (against the ORIGINAL per-32 operands, typical data):
  TAU["k128"]. Pass x_sf128 (from rebase_k128) to give the already rebased operand; otherwise the
  entry point rebases with torch ops before the launch.

Token tiles: a launch's kernel has a largest token tile (max_tile: 8..256 for k128, 8..64 for k32,
picked from max_tokens; without it, the largest); each work item (an expert's block of up to
max_tile tokens) with at most 8 rows runs at the 8-token tile, the others at max_tile, so the
many small experts of a skewed routing cost what they cost in a uniform one. The wide tile (256,
k128) runs every item at its one mainloop, charged per 64-token chunk its rows fill (computed in
pairs); so do the fast mode's four-warpgroup kernels of tiles 16..64 (pick_wgs), whose one
mainloop runs an item as one wgmma group of 8, 16, 32 or 64 tokens, the smallest that holds its
rows. The entry points never synchronise with the device, cache the launch (tensor maps and packed
parameters) for the same tensors and arguments, and can be captured in a CUDA graph.
prepare_l1_gemm / prepare_l2_gemm take the same arguments and return the call made ready
(PreparedGemm): calling it compares the current stream with its own and launches, with no
argument checks and no key to build.

Prefill path (both promotions; use_prefill, `prefill=`): from PREFILL_MIN_TOKENS tokens per expert
(the largest and the mean) a launch first decodes the layer's weights into an E4M3 scratch buffer
(the predecode pass, kernel/gemm/predecode.cuh; E * K * R bytes per device, stream and layer, the
exact mode 1/8 more for its fp32 scales, freed by release_prefill_buffers() once no prepared call
holds it), then runs the GEMM
with tokens as the wgmma M dimension (kernel/gemm/gemm_sm90_prefill.cuh). Each promotion keeps its
numerics: the fast mode's operand rule and per-K128 promotion (the same E4M3 weight bytes,
TAU["k128"]), the exact mode's per-k32 promotion with both scales (TAU["k32"]); the tensor core's
sums need not be bitwise those of the swap-AB kernels. The exact mode folds the weight scales of
each 128-row block whose rows span at most 11 binades, and lie within 32 of the expert's largest
row base (layout.fold_blocks, KernelWeights.w*_fold), into the predecoded bytes (the fast mode's
scaled tables) and promotes each k32 product with one FMA by the token scale times 2^(B_e - 133),
the rows' factors 2^(B_r - B_e) after the mainloop: the same bits as the two-scale promotion, which
the other blocks take (tested), unless the folded scale 2^(s_x + B_e - 260) falls under 2^-149
where the two-scale product 2^(s_x + s_w - 254) does not, or the folded accumulator (the two-scale
one times 2^(B_e - B_r) <= 2^32) overflows. The same epilogues (D6 / D8, bit-exact given the dumps) and
dumps.
"""

from __future__ import annotations

import dataclasses
import inspect

import torch

from megamoe.reference import MegaMoEInputError
from megamoe.reference.errors import fail
from megamoe.reference.quantize import rebase_k128 as ref_rebase_k128

from . import runtime as RT
from .jit import build as jb
from .jit import contract
from .jit.layout import KernelWeights, transform_weights, untransform_weights  # noqa: F401
from .launch import (
    check_fast_spread,
    check_weights_device,
    clamp,
    kw_key,
    layer_weights,
    require_cuda,
)
from .launchers import launcher

# Defined in megamoe.heuristics and megamoe.runtime, named here too: megamoe.gemm is where users
# and the docs reach them (megamoe.gemm.use_prefill, megamoe.gemm.timeout_message, ...).
from .heuristics import PREFILL_MIN_MEAN_ROWS as PREFILL_MIN_MEAN_ROWS
from .heuristics import PREFILL_MIN_TOKENS as PREFILL_MIN_TOKENS
from .heuristics import PREFILL_ROWS as PREFILL_ROWS
from .heuristics import prefill_path, spec_for
from .heuristics import pick_max_tile as pick_max_tile
from .heuristics import pick_wgs as pick_wgs
from .heuristics import use_prefill as use_prefill
from .heuristics import used_specs as used_specs
from .runtime import Kernel as Kernel
from .runtime import PreparedCall
from .runtime import kernel as kernel
from .runtime import prefill_scratch as prefill_scratch
from .runtime import release_prefill_buffers as release_prefill_buffers
from .runtime import timeout_message as timeout_message

BLOCK_K = contract.BLOCK_K
ROWS_PER_CTA = 2 * contract.ROWS_PER_WG  # weight rows per CTA with 2 consumer warpgroups
MAX_EXPERTS = contract.MAX_EXPERTS
PROMOTIONS = jb.PROMOTIONS

# GEMM_BOUND tau per promotion, |acc - exact| <= tau * sum_k |a_k b_k|; calibrated on the H200 by
# tests/gpu/test_gemm.py (which logs the largest observed ratio). k32 was 2^-12 until the fused
# layer's L2 on the default shape (`megamoe run`, 256 tokens, I 512) measured 1.16 x 2^-12 on 2 of
# 524288 elements: the tensor core's truncating sum of 32 products with cancellation; 2^-11 keeps
# that at 0.58.
TAU = {"k32": 2.0**-11, "k128": 2.0**-10}


def rebase_k128(x: torch.Tensor, x_sf: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The fast mode's activation operand: (payload [P, K] uint8 e4m3, scale bytes [P, K/128] uint8).
    The transform is part of the contract; its one definition is megamoe.reference.rebase_k128."""
    q = ref_rebase_k128(_u8(x), x_sf)
    return q.codes.contiguous(), q.scales.contiguous()


# ---------------------------------------------------------------------------------------------
# Arguments (SPEC §7: a clear MegaMoEInputError naming the argument, before any launch)
# ---------------------------------------------------------------------------------------------
def _check(name, t, dtypes, shape=None, device=None):
    if not isinstance(t, torch.Tensor):
        fail(name, "a torch.Tensor", type(t).__name__)
    if t.dtype not in dtypes:
        fail(name, f"dtype {' or '.join(map(str, dtypes))}", t.dtype)
    if shape is not None and tuple(t.shape) != tuple(shape):
        fail(name, f"shape {tuple(shape)}", tuple(t.shape))
    if device is not None and t.device != device:
        fail(name, f"device {device}", t.device)
    if not t.is_contiguous():
        fail(name, "a contiguous tensor", f"strides {t.stride()}")


def _check_aligned(name, t, align=16):
    if t.data_ptr() % align:
        fail(name, f"a {align}-byte aligned address", f"{t.data_ptr() % align} mod {align}")


_E4M3 = (torch.float8_e4m3fn, torch.uint8)
_U8 = (torch.uint8,)
_I32 = (torch.int32,)


def _u8(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype != torch.uint8 else t


def _pool_checks(x, x_sf, expert_offsets, expert_rows, k: int, sf_group: int, k_name: str, names: tuple) -> int:
    """The pool operand x [P, K] and its scales; `names`: their parameters' names in the caller's
    signature (x_pool / l2_acts, x_sf / l2_sf / x_sf128)."""
    x_name, sf_name = names
    if not isinstance(x, torch.Tensor) or x.dim() != 2:
        raise MegaMoEInputError(f"argument '{x_name}': expected a 2-D tensor [P, {k_name}]")
    require_cuda(x_name, x)
    dev = x.device
    P = x.shape[0]
    _check(x_name, x, _E4M3, (P, k), dev)
    _check(sf_name, x_sf, _U8, (P, k // sf_group), dev)
    _check("expert_rows", expert_rows, _I32, None, dev)
    if expert_rows.dim() != 1:
        fail("expert_rows", "a 1-D tensor [E]", f"shape {tuple(expert_rows.shape)}")
    E = expert_rows.shape[0]
    _check("expert_offsets", expert_offsets, _I32, (E + 1,), dev)
    if E > MAX_EXPERTS:
        raise MegaMoEInputError(f"argument 'expert_rows': expected at most {MAX_EXPERTS} local experts, got {E}")
    if k % BLOCK_K:
        fail(k_name, f"a multiple of {BLOCK_K}", k)
    _check_aligned(x_name, x)
    _check_aligned(sf_name, x_sf)
    return E


def _check_whole_k_blocks(hidden: int, inter: int) -> None:
    """The standalone GEMMs take H and I in whole K blocks (128); sizes in multiples of 32 (SPEC §8)
    run in the fused layer, whose workspace holds the operands padded."""
    if hidden % contract.BLOCK_K or inter % contract.BLOCK_K:
        fail("kw", f"H and I multiples of {contract.BLOCK_K} for the standalone GEMMs", f"H = {hidden}, I = {inter}")


def _activation_operand(x, x_sf, x_sf128, expert_offsets, expert_rows, k: int, promotion: str, k_name: str, names):
    """The GEMM's activation operand, checked: per-32 scales (k32) or, for k128, the payload and
    scales rebased per K128 (computed here unless the caller passes x_sf128 with an already rebased
    x). `names`: the caller's parameters for x and x_sf. Returns (x, scales, number of experts)."""
    if promotion not in PROMOTIONS:
        fail("promotion", f"one of {PROMOTIONS}", repr(promotion))
    if promotion == "k128":
        if k % 512:
            raise MegaMoEInputError(f"argument '{k_name}': promotion 'k128' needs a multiple of 512, got {k}")
        if x_sf128 is None:
            _pool_checks(x, x_sf, expert_offsets, expert_rows, k, 32, k_name, names)
            x, x_sf128 = rebase_k128(x, x_sf)
        x_sf, names = x_sf128, (names[0], "x_sf128")
    E = _pool_checks(x, x_sf, expert_offsets, expert_rows, k, 128 if promotion == "k128" else 32, k_name, names)
    return x, x_sf, E


def _arrival(arrival, arrival_block, P: int, dev) -> tuple[int, int]:
    if arrival is None:
        if arrival_block:
            raise MegaMoEInputError(
                f"argument 'arrival_block': given ({arrival_block!r}) without arrival counters (arrival=None)"
            )
        return 0, 0
    if isinstance(arrival_block, bool) or not isinstance(arrival_block, int) or arrival_block <= 0:
        fail("arrival_block", "a positive int (pool rows per arrival counter)", repr(arrival_block))
    _check("arrival", arrival, _I32, (-(-P // arrival_block),), dev)
    return arrival.data_ptr(), arrival_block


@dataclasses.dataclass
class L1Result:
    l2_acts: torch.Tensor  # [P, I] float8_e4m3fn, natural channel order
    l2_sf: torch.Tensor  # [P, I/32] uint8
    acc1: torch.Tensor | None  # debug: [P, 2I] fp32, canonical order (gate then up)


@dataclasses.dataclass
class L2Result:
    combine: torch.Tensor  # the combine buffer that was written, [K, T, H] bf16
    acc2: torch.Tensor | None  # debug: [P, H] fp32


# ---------------------------------------------------------------------------------------------
# Launches (their launchers: megamoe.launchers; caches and per-device state: megamoe.runtime)
# ---------------------------------------------------------------------------------------------
# A tensor's (or another argument's) part of an entry point's cache key (runtime.cached_call).
def _tkey(t):
    if isinstance(t, torch.Tensor):
        return (t.data_ptr(), t.dtype, t.shape, t.stride())
    return t if t is None or isinstance(t, (int, float, str)) else (type(t).__name__, id(t))


class PreparedGemm(PreparedCall):
    """One l1_gemm / l2_gemm call made ready for its tensors (prepare_l1_gemm, prepare_l2_gemm).
    Calling it launches the kernel (the prefill path: the predecode pass, then the GEMM) on the
    stream that was current when it was prepared, and returns `result`, the same object each time
    (the destination tensors, rewritten by every call). It compares the current stream with its own
    (another one is an input error: its launch holds that stream's item counters and scratch buffer)
    and checks and looks up nothing else, so its host time is about the driver's launch alone, where
    a repeated l1_gemm call also builds and looks up the key of its tensors (bench.host_probe and
    bench.gemm's `prep` column measure both).

    Like a CUDA graph, it holds the tensors' addresses as they were when it was prepared. It keeps
    the tensors alive (the weights' too, and the prefill path's scratch buffer past
    release_prefill_buffers(), after which the next prefill-path call allocates another), and new
    values in them are what it computes on; a tensor that gets another shape, strides or storage in
    place afterwards (resize_, set_, as_strided_) is not seen, and is the caller's to avoid. Tensors
    made on another stream than the call's are torch's usual case (synchronise, or record_stream,
    before they are freed).

    CUDA graphs: prepare it under `with torch.cuda.stream(s)` and capture it with
    `torch.cuda.graph(g, stream=s)` (a bare torch.cuda.graph(g) captures on a stream of its own, and
    the call refuses it); the graph then shares the call's item counters and scratch buffer, so it
    must not be replayed while calls on `s` run."""

    what = "a prepared GEMM call"


def l1_gemm(
    x_pool: torch.Tensor,
    x_sf: torch.Tensor,
    expert_offsets: torch.Tensor,
    expert_rows: torch.Tensor,
    w_route: torch.Tensor,
    kw: KernelWeights,
    *,
    fast_math: bool = True,
    activation_clamp: float | None = None,
    promotion: str = "k32",
    max_tokens: int | None = None,
    max_tile: int | None = None,
    wgs: int | None = None,
    debug: bool = False,
    out: torch.Tensor | None = None,
    out_sf: torch.Tensor | None = None,
    x_sf128: torch.Tensor | None = None,
    arrival: torch.Tensor | None = None,
    arrival_block: int = 0,
    prefill: bool | None = None,
) -> L1Result:
    """L1 grouped GEMM + fused D6 epilogue. x_pool [P, H] e4m3, x_sf [P, H/32] UE8M0,
    expert_offsets int32 [E+1], expert_rows int32 [E], w_route fp32 [P].
    Returns l2_acts [P, I] (e4m3), l2_sf [P, I/32] and, with debug=True, acc1 [P, 2I] fp32
    (canonical: gate channels then up channels). Rows of padding are left as they were.

    max_tokens: the largest expert's row count, if known (picks the kernel's largest token tile;
    without it the largest tile is taken, which is right for any routing). max_tile / wgs force the
    specialisation (benchmarks, tests).

    out / out_sf: optional destinations (contiguous [P, I] e4m3 or uint8, 16-byte aligned; [P, I/32]
    uint8, any alignment); they may be views into a larger buffer (e.g. a peer's, through a pointer
    offset): only the valid pool rows of the view are written.

    Arrival gate (the fused kernel's hook; SPEC §5): with `arrival` (int32 [ceil(P / arrival_block)],
    one counter per `arrival_block` pool rows) the producer's TMA thread and its scale warp spin, for
    each work item, until every pool block under the item's token block has counter >= its number
    of valid rows. So another stream or GPU may write the pool rows (x_pool, their scales x_sf /
    x_sf128, w_route) while the GEMM runs and publish them by raising the counters (release order:
    rows first); expert_offsets and expert_rows must be in place at the launch. Every pool block must
    lie inside one expert (arrival_block divides the pool alignment of expert_offsets; not checked:
    that would need a device sync). A counter that never fills makes the kernel trap after its spin
    timeout (~10 s) with a record readable by timeout_message(). With promotion "k128" pass the
    rebased operand (x_sf128): without it the rows are rebased with torch ops before the launch,
    which reads them ahead of the gate. arrival=None (default): all rows present, no gate.

    prefill: the prefill path (the weights decoded once into an E4M3 scratch buffer of E * H * 2I
    bytes, 1/8 more in the exact mode, kept per device, stream and layer until
    release_prefill_buffers(), then the GEMM with tokens as wgmma M);
    None (default) takes it where use_prefill says (max_tokens >= PREFILL_MIN_TOKENS[(promotion, 1)],
    the mean pool rows per expert >= PREFILL_MIN_MEAN_ROWS[(promotion, 1)], no gate, no forced
    max_tile / wgs)."""
    args = dict(locals())  # the arguments as given, for _plan_l1 (before any other local is bound)
    # (no stream for what is not a CUDA tensor: the checks below name it)
    stream = RT.stream(x_pool) if isinstance(x_pool, torch.Tensor) and x_pool.is_cuda else None
    key = (
        1,
        stream,  # the prefill path's scratch buffer is per stream
        promotion,
        prefill,
        fast_math,
        _tkey(activation_clamp),
        max_tokens,
        max_tile,
        wgs,
        arrival_block,
        *kw_key(kw, 1),
        *map(_tkey, (x_pool, x_sf, expert_offsets, expert_rows, w_route, out, out_sf, x_sf128, arrival)),
    )
    cacheable = (
        not debug
        and out is not None
        and out_sf is not None
        and promotion in PROMOTIONS
        and (promotion == "k32" or x_sf128 is not None)
    )
    return RT.cached_call(key if cacheable else None, stream, _plan_l1, args, lambda: L1Result(out, out_sf, None))


def _plan_l1(
    x_pool,
    x_sf,
    expert_offsets,
    expert_rows,
    w_route,
    kw,
    *,
    fast_math,
    activation_clamp,
    promotion,
    max_tokens,
    max_tile,
    wgs,
    debug,
    out,
    out_sf,
    x_sf128,
    arrival,
    arrival_block,
    prefill,
) -> PreparedGemm:
    """l1_gemm's call, checked and made ready on the current stream (not launched)."""
    if not isinstance(kw, KernelWeights):
        fail("kw", "KernelWeights (transform_weights)", type(kw).__name__)
    H, inter = kw.hidden, kw.intermediate
    _check_whole_k_blocks(H, inter)
    x_pool, x_sf, E = _activation_operand(
        x_pool, x_sf, x_sf128, expert_offsets, expert_rows, H, promotion, "hidden", ("x_pool", "x_sf")
    )
    P, dev = x_pool.shape[0], x_pool.device
    _check("w_route", w_route, (torch.float32,), (P,), dev)
    if kw.num_experts != E:
        fail("kw", f"{E} experts (len(expert_rows))", kw.num_experts)
    check_weights_device(kw, dev)
    check_fast_spread("kw", kw.row_spread, promotion)
    if (2 * inter) % ROWS_PER_CTA:
        raise MegaMoEInputError(f"argument 'kw': 2I must be a multiple of {ROWS_PER_CTA}, got {2 * inter}")
    c, has_clamp = clamp(activation_clamp)
    if prefill_path(1, prefill, max_tokens, P / max(E, 1), promotion, 2 * inter, arrival, max_tile, wgs):
        spec = jb.PrefillSpec(layer=1, fast_math=bool(fast_math), debug=debug, promotion=promotion)
    else:
        spec = spec_for(
            1,
            promotion=promotion,
            fast_math=fast_math,
            debug=debug,
            max_tokens=max_tokens,
            n_rows=2 * inter,
            max_tile=max_tile,
            wgs=wgs,
            rows_per_expert=P / max(E, 1),
        )
    if out is None:
        out = torch.empty(P, inter, dtype=torch.float8_e4m3fn, device=dev)
    if out_sf is None:
        out_sf = torch.empty(P, inter // 32, dtype=torch.uint8, device=dev)
    _check("out", out, _E4M3, (P, inter), dev)
    _check("out_sf", out_sf, _U8, (P, inter // 32), dev)
    _check_aligned("out", out)
    acc1 = torch.full((P, 2 * inter), float("nan"), dtype=torch.float32, device=dev) if debug else None
    arrival_ptr, arrival_block = _arrival(arrival, arrival_block, P, dev)
    stream = RT.stream(x_pool)
    run, w_e4m3 = launcher(spec).launch(
        kw,
        _u8(x_pool),
        H,
        2 * inter,
        E,
        dict(
            x_sf=x_sf.data_ptr(),
            expert_offsets=expert_offsets.data_ptr(),
            expert_rows=expert_rows.data_ptr(),
            w_route=w_route.data_ptr(),
            out=out.data_ptr(),
            out_sf=out_sf.data_ptr(),
            dst_rows=0,
            dump=acc1.data_ptr() if acc1 is not None else 0,
            arrival=arrival_ptr,
            arrival_block=arrival_block,
            has_clamp=has_clamp,
            clamp_value=c,
            n_out=2 * inter,
            out_stride=inter,
        ),
        stream,
    )
    return PreparedGemm(
        run,
        L1Result(out, out_sf, acc1),
        dev.index,
        stream,
        (x_pool, x_sf, expert_offsets, expert_rows, w_route, *layer_weights(kw, 1), out, out_sf, acc1, arrival, w_e4m3),
    )


def l2_gemm(
    l2_acts: torch.Tensor,
    l2_sf: torch.Tensor,
    expert_offsets: torch.Tensor,
    expert_rows: torch.Tensor,
    dst_rows: torch.Tensor,
    kw: KernelWeights,
    combine: torch.Tensor,
    *,
    promotion: str = "k32",
    max_tokens: int | None = None,
    max_tile: int | None = None,
    wgs: int | None = None,
    debug: bool = False,
    x_sf128: torch.Tensor | None = None,
    arrival: torch.Tensor | None = None,
    arrival_block: int = 0,
    prefill: bool | None = None,
) -> L2Result:
    """L2 grouped GEMM + D8 epilogue: bf16(acc2) of pool row p goes to combine.view(-1, H)[dst_rows[p]]
    (dst_rows[p] = k * T + t for a combine buffer [K, T, H]; < 0 = skip). Padding rows write nothing.
    combine (contiguous bf16 [..., H], 16-byte aligned) may be a view into a larger buffer (e.g. a
    peer's, through a pointer offset): rows no valid pool row maps to are left as they were.

    max_tokens / max_tile / wgs, arrival / arrival_block and prefill (its scratch: E * I * H bytes):
    as in l1_gemm; dst_rows, expert_offsets and expert_rows must be in place at the launch."""
    args = dict(locals())  # the arguments as given, for _plan_l2 (before any other local is bound)
    # (no stream for what is not a CUDA tensor: the checks below name it)
    stream = RT.stream(l2_acts) if isinstance(l2_acts, torch.Tensor) and l2_acts.is_cuda else None
    key = (
        2,
        stream,  # the prefill path's scratch buffer is per stream
        promotion,
        prefill,
        max_tokens,
        max_tile,
        wgs,
        arrival_block,
        *kw_key(kw, 2),
        *map(_tkey, (l2_acts, l2_sf, expert_offsets, expert_rows, dst_rows, combine, x_sf128, arrival)),
    )
    cacheable = not debug and promotion in PROMOTIONS and (promotion == "k32" or x_sf128 is not None)
    return RT.cached_call(key if cacheable else None, stream, _plan_l2, args, lambda: L2Result(combine, None))


def _plan_l2(
    l2_acts,
    l2_sf,
    expert_offsets,
    expert_rows,
    dst_rows,
    kw,
    combine,
    *,
    promotion,
    max_tokens,
    max_tile,
    wgs,
    debug,
    x_sf128,
    arrival,
    arrival_block,
    prefill,
) -> PreparedGemm:
    """l2_gemm's call, checked and made ready on the current stream (not launched)."""
    if not isinstance(kw, KernelWeights):
        fail("kw", "KernelWeights (transform_weights)", type(kw).__name__)
    H, inter = kw.hidden, kw.intermediate
    _check_whole_k_blocks(H, inter)
    l2_acts, l2_sf, E = _activation_operand(
        l2_acts, l2_sf, x_sf128, expert_offsets, expert_rows, inter, promotion, "intermediate", ("l2_acts", "l2_sf")
    )
    P, dev = l2_acts.shape[0], l2_acts.device
    check_weights_device(kw, dev)
    check_fast_spread("kw", kw.row_spread, promotion)
    _check("dst_rows", dst_rows, _I32, (P,), dev)
    if not isinstance(combine, torch.Tensor) or combine.dim() < 1 or combine.shape[-1] != H:
        raise MegaMoEInputError(f"argument 'combine': expected a bf16 tensor [..., {H}]")
    _check("combine", combine, (torch.bfloat16,), None, dev)
    _check_aligned("combine", combine)
    if kw.num_experts != E:
        fail("kw", f"{E} experts (len(expert_rows))", kw.num_experts)
    if H % ROWS_PER_CTA:
        raise MegaMoEInputError(f"argument 'kw': hidden must be a multiple of {ROWS_PER_CTA}, got {H}")
    if prefill_path(2, prefill, max_tokens, P / max(E, 1), promotion, H, arrival, max_tile, wgs):
        spec = jb.PrefillSpec(layer=2, fast_math=True, debug=debug, promotion=promotion)
    else:
        spec = spec_for(
            2,
            promotion=promotion,
            debug=debug,
            max_tokens=max_tokens,
            n_rows=H,
            max_tile=max_tile,
            wgs=wgs,
            rows_per_expert=P / max(E, 1),
        )
    acc2 = torch.full((P, H), float("nan"), dtype=torch.float32, device=dev) if debug else None
    arrival_ptr, arrival_block = _arrival(arrival, arrival_block, P, dev)
    stream = RT.stream(l2_acts)
    run, w_e4m3 = launcher(spec).launch(
        kw,
        _u8(l2_acts),
        inter,
        H,
        E,
        dict(
            x_sf=l2_sf.data_ptr(),
            expert_offsets=expert_offsets.data_ptr(),
            expert_rows=expert_rows.data_ptr(),
            w_route=0,
            out=combine.data_ptr(),
            out_sf=0,
            dst_rows=dst_rows.data_ptr(),
            dump=acc2.data_ptr() if acc2 is not None else 0,
            arrival=arrival_ptr,
            arrival_block=arrival_block,
            has_clamp=0,
            clamp_value=0.0,
            n_out=H,
            out_stride=H,
        ),
        stream,
    )
    return PreparedGemm(
        run,
        L2Result(combine, acc2),
        dev.index,
        stream,
        (l2_acts, l2_sf, expert_offsets, expert_rows, dst_rows, *layer_weights(kw, 2), combine, acc2, arrival, w_e4m3),
    )


# ---------------------------------------------------------------------------------------------
# Prepared calls: the checks and the launch's lookup done once (PreparedGemm)
# ---------------------------------------------------------------------------------------------
_L1_SIGNATURE = inspect.signature(l1_gemm)
_L2_SIGNATURE = inspect.signature(l2_gemm)


def _preparable(arguments: dict, entry: str) -> None:
    """What a prepared call cannot do that its entry point does: compute the fast mode's rebased
    operand (torch ops run on each call), or give a fresh NaN-filled debug dump each call."""
    if arguments["debug"]:
        fail(
            "debug", f"False for a prepared call (its dump buffer would keep the last call's values: use {entry})", True
        )
    if arguments["promotion"] == "k128" and arguments["x_sf128"] is None:
        fail("x_sf128", "the rebased operand (rebase_k128) for a prepared call with promotion 'k128'", None)


def prepare_l1_gemm(*args, **kwargs) -> PreparedGemm:
    """l1_gemm's call made ready (PreparedGemm): the same arguments, checked here, and nothing is
    launched until the call. out and out_sf are allocated here when not given; promotion "k128"
    needs x_sf128 (with the rebased x); debug=True is l1_gemm's."""
    bound = _L1_SIGNATURE.bind(*args, **kwargs)
    bound.apply_defaults()
    _preparable(bound.arguments, "l1_gemm")
    return _plan_l1(**bound.arguments)


def prepare_l2_gemm(*args, **kwargs) -> PreparedGemm:
    """l2_gemm's call made ready (PreparedGemm), as prepare_l1_gemm: the same arguments as l2_gemm,
    checked here; promotion "k128" needs x_sf128; debug=True is l2_gemm's."""
    bound = _L2_SIGNATURE.bind(*args, **kwargs)
    bound.apply_defaults()
    _preparable(bound.arguments, "l2_gemm")
    return _plan_l2(**bound.arguments)


# help() and inspect show the entry points' parameters.
prepare_l1_gemm.__signature__ = _L1_SIGNATURE.replace(return_annotation=PreparedGemm)
prepare_l2_gemm.__signature__ = _L2_SIGNATURE.replace(return_annotation=PreparedGemm)
