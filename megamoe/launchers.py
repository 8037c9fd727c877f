"""One launcher per kernel kind: the compiled specialisation (its spec) paired with how it is
launched. Each launcher knows its spec, builds its kernel argument (GemmParams through
megamoe.launch.gemm_params; the fused kernel's FusedParams around two of them), computes its launch
configuration (grid; block and dynamic shared memory as the cubin says, megamoe.runtime.kernel;
cooperative or not) and makes the driver.Launch that runs it:

* GemmLauncher (jit.build.GemmSpec): the standalone swap-AB GEMM, one CTA per SM, its items in the
  dynamic order (a pair of item counters per launch object, so one launch object per stream);
* PrefillLauncher (jit.build.PrefillSpec): the standalone prefill GEMM after its predecode pass
  (PredecodeLauncher) into the stream's scratch buffer, one CTA per SM, its items in the dynamic
  order as GemmLauncher's;
* PredecodeLauncher (jit.build.PredecodeSpec): a layer's weights to the prefill kernel's E4M3
  tiles, one warp per 16-row group of one K block;
* FusedLauncher (jit.build.FusedSpec): the fused layer, one CTA per SM of the layer's SM count,
  launched cooperatively (its CTAs wait on each other), its argument patched per call.

launcher(spec) is the launcher of a spec. The entry points (megamoe.gemm) and the fused layer
(megamoe.moe) check the call's arguments, pick the spec (megamoe.heuristics) and hand the launcher
the call's tensors; the launches are cached by the standalone launchers (megamoe.runtime's launch
cache) and by the layer (per mode).

Classes beside the specs rather than methods on them: a spec is what nvcc compiles, the cubin
cache's key, which the CI compile gate builds on a machine without a GPU; a launch needs the
runtime (trap records, item counters, scratch buffers, the loaded kernel), and megamoe.runtime
imports the specs (megamoe.jit.build), so launch methods on the specs would make that an import
circle.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import torch

from megamoe.reference import MegaMoEInputError

from . import runtime as RT
from .jit import build as jb
from .jit import contract, driver
from .jit.layout import KernelWeights, padded_rows, prefill_blocks
from .launch import SHAPE_FIELDS, gemm_params, weight_fields


@dataclasses.dataclass(frozen=True)
class _Launcher:
    spec: jb.GemmSpec | jb.PrefillSpec | jb.PredecodeSpec | jb.FusedSpec
    # A cooperative launch guarantees that every CTA is resident at once (or fails).
    cooperative: ClassVar[bool] = False

    def kernel(self, dev: int) -> RT.Kernel:
        """The spec's kernel, loaded on device `dev` (built first where the cache lacks it)."""
        return RT.kernel(self.spec, dev)

    def _launch(self, kern: RT.Kernel, grid: int, params: bytes) -> driver.Launch:
        """The launch of `kern` over `grid` CTAs with its argument `params`: the block and the
        dynamic shared memory are the cubin's (threads, shared memory layout size)."""
        return driver.Launch(kern.fn, grid, kern.threads, kern.smem_bytes, params, cooperative=self.cooperative)


# ---------------------------------------------------------------------------------------------
# The standalone GEMMs (megamoe.gemm)
# ---------------------------------------------------------------------------------------------
# The fused kernel's hooks that a standalone launch leaves off (L1-completion signal, peer buffers,
# a fixed arrival count, SPEC §8's biases and alpha: the standalone GEMMs run §3's SwiGLU); w_e4m3:
# the prefill kernel's predecoded weights (PrefillLauncher).
_STANDALONE = dict(
    bias=0,
    alpha=0.0,
    signal=0,
    rebase_x=0,
    rebase_sf=0,
    rebase_count=0,
    peer_offsets=0,
    arrival_need=0,
    combine_rows=0,
    w_e4m3=0,
)


class _Sequence:
    """Launches called one after another on the same stream (the prefill path: predecode, GEMM)."""

    def __init__(self, *launches):
        self.launches = launches

    def __call__(self, stream: int) -> None:
        for launch in self.launches:
            launch(stream)


@dataclasses.dataclass(frozen=True)
class GemmLauncher(_Launcher):
    """The standalone swap-AB GEMM (kernel/gemm/gemm_sm90.cuh) of its GemmSpec."""

    spec: jb.GemmSpec

    def stream_key(self, stream: int) -> int | None:
        """The stream's part of a launch's cache key: the swap-AB and prefill kernels' launch objects
        are per stream, each holds its own item counters (runtime.item_counter)."""
        return stream

    def item_counter(self, dev: int) -> int:
        """GemmParams.item_counter: the swap-AB and prefill kernels claim their items dynamically."""
        return RT.item_counter(dev)

    def grid(self, kern: RT.Kernel) -> int:
        """Persistent: one CTA per SM."""
        return kern.num_sms

    def params(self, x: torch.Tensor, k: int, n_rows: int, num_experts: int, fields: dict, dev: int) -> bytes:
        """GemmParams of a standalone launch over the activations `x` [P, k] (uint8): the call's
        `fields` (the weights' among them), the fused kernel's hooks off."""
        fields = {**_STANDALONE, "item_counter": self.item_counter(dev), **fields}
        return gemm_params(x.data_ptr(), k, x.shape[0], n_rows, num_experts, RT.err_record(dev).data_ptr(), **fields)

    def kept(self, x: torch.Tensor, k: int, n_rows: int, num_experts: int, fields: dict, stream: int) -> driver.Launch:
        """The launch on `stream` (not made here): its tensor maps and packed parameters are built
        once per distinct (spec, tensors, arguments) and reused."""
        spec = self.spec
        dev = RT.device_index(x.device)
        P = x.shape[0]
        key = (spec, dev, self.stream_key(stream), x.data_ptr(), P, k, n_rows, num_experts, *fields.values())
        launch = RT.cached_launch(key)
        if launch is None:
            if n_rows % spec.rows_per_cta:
                raise MegaMoEInputError(f"weight rows: expected a multiple of {spec.rows_per_cta}, got {n_rows}")
            kern = self.kernel(dev)
            launch = RT.keep_launch(
                key, self._launch(kern, self.grid(kern), self.params(x, k, n_rows, num_experts, fields, dev))
            )
        return launch

    def launch(
        self, kw: KernelWeights, x: torch.Tensor, k: int, n_rows: int, num_experts: int, fields: dict, stream: int
    ) -> tuple:
        """The call of layer spec.layer over the activations `x` [P, k] (uint8) and the weights `kw`
        (k x n_rows per expert) on `stream`, `fields`: the call's GemmParams fields but the
        weights'. Returns what runs it (called with a stream) and the scratch buffer it reads
        (None: none)."""
        fields = {**weight_fields(kw, self.spec.layer, self.spec.promotion), **fields}
        return self.kept(x, k, n_rows, num_experts, fields, stream), None


@dataclasses.dataclass(frozen=True)
class PrefillLauncher(GemmLauncher):
    """The standalone prefill GEMM (kernel/gemm/gemm_sm90_prefill.cuh) of its PrefillSpec, after the
    predecode pass of its layer's weights (PredecodeLauncher of the same promotion)."""

    spec: jb.PrefillSpec

    def launch(
        self, kw: KernelWeights, x: torch.Tensor, k: int, n_rows: int, num_experts: int, fields: dict, stream: int
    ) -> tuple:
        """GemmLauncher.launch's call on the prefill path: the predecode pass into `stream`'s scratch
        buffer, then the GEMM, which reads it (w_e4m3). Returns the two launches in sequence and
        the buffer."""
        pre, scratch = PredecodeLauncher(jb.PredecodeSpec(promotion=self.spec.promotion)).launch(
            kw, self.spec.layer, x.device, k, n_rows, stream
        )
        fields = {**weight_fields(kw, self.spec.layer, self.spec.promotion), "w_e4m3": scratch.data_ptr(), **fields}
        return _Sequence(pre, self.kept(x, k, n_rows, num_experts, fields, stream)), scratch


@dataclasses.dataclass(frozen=True)
class PredecodeLauncher(_Launcher):
    """The predecode pass (kernel/gemm/predecode.cuh) of its PredecodeSpec."""

    spec: jb.PredecodeSpec

    def grid(self, kern: RT.Kernel, num_experts: int, k: int, n_rows: int) -> int:
        """One warp per 16-row group of one K block."""
        groups = num_experts * (k // contract.BLOCK_K) * (n_rows // 16)
        return groups // (kern.threads // 32)

    def params(self, weights: dict, scratch: torch.Tensor, k: int, n_rows: int, num_experts: int, dev: int) -> bytes:
        """GemmParams of the pass: the weights' fields, the scratch buffer (w_e4m3) and the shape."""
        # Every other field 0: the pass reads the weights and writes the scratch, nothing else.
        rest = {f.name: 0 for f in contract.PARAMS if f.name not in SHAPE_FIELDS}
        rest.update(weights, w_e4m3=scratch.data_ptr())
        return gemm_params(0, k, 0, n_rows, num_experts, RT.err_record(dev).data_ptr(), **rest)

    def buffer_bytes(self, num_experts: int, k: int, n_rows: int) -> int:
        """The pass's output over weights of k x n_rows per expert (K in whole blocks, the rows of the
        kernel layout): [E, K/128, R/rows] tiles of contract.PREFILL_TILE_BYTES[promotion] (rows:
        contract.PREFILL_ROWS[promotion]), E * K * R bytes, the exact mode 1/8 more for its fp32 scales."""
        tiles = num_experts * (k // contract.BLOCK_K) * prefill_blocks(n_rows, self.spec.promotion)
        return tiles * contract.PREFILL_TILE_BYTES[self.spec.promotion]

    def launch(
        self, kw: KernelWeights, layer: int, device: torch.device, k: int, n_rows: int, stream: int
    ) -> tuple[driver.Launch, torch.Tensor]:
        """The pass over `layer`'s weights (k x n_rows per expert) on `device` into the scratch buffer
        of `stream` (buffer_bytes): its launch (not made here, kept in the launch cache) and the buffer."""
        dev = RT.device_index(device)
        scratch = RT.prefill_scratch(dev, stream, layer, self.buffer_bytes(kw.num_experts, k, n_rows))
        weights = weight_fields(kw, layer, self.spec.promotion)
        key = (self.spec, dev, *weights.values(), scratch.data_ptr(), k, n_rows, kw.num_experts)
        launch = RT.cached_launch(key)
        if launch is None:
            launch = RT.keep_launch(key, self.into(kw, layer, dev, k, n_rows, scratch))
        return launch, scratch

    def into(self, kw: KernelWeights, layer: int, dev: int, k: int, n_rows: int, buffer: torch.Tensor) -> driver.Launch:
        """The pass over `layer`'s weights (k x n_rows per expert) on device `dev` into `buffer` (at
        least buffer_bytes), not made here and not cached."""
        weights = weight_fields(kw, layer, self.spec.promotion)  # the packed weights, LUT offsets or scale bytes
        kern = self.kernel(dev)
        params = self.params(weights, buffer, k, n_rows, kw.num_experts, dev)
        return self._launch(kern, self.grid(kern, kw.num_experts, k, n_rows), params)


# ---------------------------------------------------------------------------------------------
# The fused layer (megamoe.moe)
# ---------------------------------------------------------------------------------------------
_OFF = contract.FUSED_PARAMS.offsets
assert [_OFF[n] - _OFF["x"] for n in ("x", "x_sf", "topk_idx", "topk_weights", "y")] == [0, 8, 16, 24, 32]
_I32 = "<i"


@dataclasses.dataclass(frozen=True)
class FusedLauncher(_Launcher):
    """The fused layer's kernel (kernel/fused/megamoe_sm90.cuh) of its FusedSpec. Its launch holds
    the layer's workspace, weights and mode; each call patches its own pointers, T and
    record_stats into it (patch_call)."""

    spec: jb.FusedSpec
    # Every CTA waits on the others (the grid-wide phases): all resident at once, or no launch.
    cooperative: ClassVar[bool] = True

    def grid(self, kern: RT.Kernel, sms: int) -> int:
        """One CTA per SM of the layer's SM count (every rank's), at most the device's."""
        return min(sms, kern.num_sms)

    @staticmethod
    def layer_shape(cfg, layer: int) -> tuple[int, int]:
        """(k, n_rows) of `layer` in the kernel layout: K padded to whole blocks (contract.padded_k),
        the weight rows to whole row tiles (layout.padded_rows)."""
        k, rows = (cfg.hidden, 2 * cfg.intermediate) if layer == 1 else (cfg.intermediate, cfg.hidden)
        return contract.padded_k(k), padded_rows(rows)

    def predecoder(self) -> PredecodeLauncher:
        """The standalone predecode pass of this spec's promotion: the prefill engine's weight tiles."""
        return PredecodeLauncher(jb.PredecodeSpec(promotion=self.spec.promotion))

    def scratch(self, cfg, dev: int, stream: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The prefill engine's predecoded weights of each layer (PredecodeLauncher.buffer_bytes over
        layer_shape), the scratch buffers megamoe.gemm's prefill path uses for the same size on this
        device and stream."""
        pre = self.predecoder()
        return tuple(
            RT.prefill_scratch(dev, stream, layer, pre.buffer_bytes(cfg.local_experts, *self.layer_shape(cfg, layer)))
            for layer in (1, 2)
        )

    def predecode(self, cfg, kw: KernelWeights, dev: int, stream: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Both layers' weights decoded now, on `stream`, into buffers of their own (zeroed first),
        the prefill engine's w_e4m3 for launches that
        skip the per-call predecode (launch's `decoded`). The caller orders its later launches
        after this stream's work."""
        pre, out = self.predecoder(), []
        for layer in (1, 2):
            k, n_rows = self.layer_shape(cfg, layer)
            buf = torch.zeros(pre.buffer_bytes(cfg.local_experts, k, n_rows), dtype=torch.uint8, device=kw.w1.device)
            pre.into(kw, layer, dev, k, n_rows, buf)(stream)
            out.append(buf)
        return tuple(out)

    def gemm_params(
        self,
        layer: int,
        *,
        cfg,
        dims,
        ws,
        kw: KernelWeights,
        dev: int,
        clamp: float,
        has_clamp: int,
        bias,
        dump,
        w_e4m3: int,
    ) -> bytes:
        """The GemmParams of `layer` (FusedParams.l1 / l2) over the workspace `ws` (its regions'
        addresses, ws.ptr); bias: the layer's b1 / b2 (SPEC §8; else None); dump: the debug build's
        accumulators of the layer (else None); w_e4m3: the prefill engine's predecoded weights (else
        0). A "swiglu_oai" layer clamps at bf16(limit) (has_clamp, clamp: the caller's) and its L2
        reads the pool rows' routing weights (D8's b2 term)."""
        P, H, inter = dims["P"], cfg.hidden, cfg.intermediate
        oai = cfg.activation == "swiglu_oai"
        # The reduction's channels; K in whole blocks: the pool's and the intermediate's row strides
        # (contract.padded_k); L2's weight rows padded to its row tiles (layout.padded_rows); what the
        # epilogues write, natural.
        channels, k, n_rows = (
            (H, dims["H_pad"], padded_rows(2 * inter)) if layer == 1 else (inter, dims["I_pad"], padded_rows(H))
        )
        fast = self.spec.promotion == "k128"  # the GEMMs read the operands rebased per 128 channels
        x_ptr = ws.ptr(("pool_x128" if fast else "pool_x") if layer == 1 else ("l2_x128" if fast else "l2_acts"))
        x_sf = ws.ptr(("pool_sf128" if fast else "pool_x_sf") if layer == 1 else ("l2_sf128" if fast else "l2_sf"))
        return gemm_params(
            x_ptr,
            k,
            P,
            n_rows,
            cfg.local_experts,
            RT.err_record(dev).data_ptr(),
            channels=channels,
            **weight_fields(kw, layer, self.spec.promotion),
            x_sf=x_sf,
            expert_offsets=ws.ptr("expert_offsets"),
            expert_rows=ws.ptr("recv_totals"),
            w_route=ws.ptr("pool_weights") if layer == 1 or oai else 0,
            out=ws.ptr("l2_acts") if layer == 1 else ws.ptr("combine"),
            out_sf=ws.ptr("l2_sf") if layer == 1 else 0,
            dst_rows=ws.ptr("dst_rows") if layer == 2 else 0,
            peer_offsets=ws.ptr("peers") if layer == 2 else 0,
            dump=dump.data_ptr() if dump is not None else 0,
            arrival=ws.ptr("arrivals") if layer == 1 else ws.ptr("l1_done"),
            signal=ws.ptr("l1_done") if layer == 1 else 0,
            rebase_x=ws.ptr("l2_x128") if layer == 1 and fast else 0,
            rebase_sf=ws.ptr("l2_sf128") if layer == 1 and fast else 0,
            rebase_count=ws.ptr("rebase_count") if layer == 1 and fast else 0,
            item_counter=ws.ptr("item_counter"),  # every engine's dynamic order (both layers')
            arrival_block=cfg.block_m,
            arrival_need=0 if layer == 1 else inter // 32,
            combine_rows=cfg.top_k * cfg.max_tokens_per_rank,
            has_clamp=has_clamp if layer == 1 else 0,
            clamp_value=clamp if layer == 1 else 0.0,
            w_e4m3=w_e4m3,  # the prefill engine's predecoded weights (else 0)
            bias=bias.data_ptr() if oai and bias is not None else 0,
            alpha=cfg.alpha if oai and layer == 1 else 0.0,  # packed as fp32: SPEC §8's fp32(alpha)
            n_out=2 * inter if layer == 1 else H,
            out_stride=dims["I_pad"] if layer == 1 else H,
        )

    def params(
        self, *, cfg, dims, ws, kw: KernelWeights, rank: int, dev: int, clamp, has_clamp, biases, dumps, w_e4m3, decoded
    ):
        """FusedParams without a call's pointers, T and record_stats (0 until patch_call); biases:
        (b1, b2) of the layer's local experts (each None when absent), dumps: the debug build's
        accumulators of both layers (else None), w_e4m3 both layers' predecoded weights (the prefill
        engine's; else 0), decoded: whether they hold the weights already (else the kernel decodes
        them)."""
        layers = {
            name: self.gemm_params(
                layer,
                cfg=cfg,
                dims=dims,
                ws=ws,
                kw=kw,
                dev=dev,
                clamp=clamp,
                has_clamp=has_clamp,
                bias=biases[layer - 1],
                dump=dumps[layer - 1] if self.spec.debug else None,
                w_e4m3=w_e4m3[layer - 1],
            )
            for name, layer in (("l1", 1), ("l2", 2))
        }
        return contract.FUSED_PARAMS.pack(
            **layers,
            x=0,
            x_sf=0,
            topk_idx=0,
            topk_weights=0,
            y=0,
            **{f"ws_{r.name}": ws.ptr(r.name) for r in contract.WORKSPACE},
            rank=rank,
            num_tokens=0,
            # The sizes the workspace's shapes are written in (the kernel's accessors' strides).
            **{field: dims[dim] for dim, field in contract.DIM_FIELDS.items()},
            block_m=cfg.block_m,
            record_stats=0,
            weights_decoded=int(decoded),
        )

    def launch(
        self,
        *,
        cfg,
        dims,
        ws,
        kw: KernelWeights,
        rank: int,
        dev: int,
        sms: int,
        clamp,
        has_clamp,
        dumps,
        stream,
        biases=(None, None),
        decoded=None,
    ) -> tuple[driver.Launch, tuple]:
        """The layer's launch in this mode (not made here) and what it points into besides the
        layer's own tensors: the prefill engine's scratch buffers of `stream` (else ()). biases: (b1,
        b2), SPEC §8's, of the local experts (read by "swiglu_oai" kernels). decoded: the layer's
        weights predecoded before the call (predecode's buffers), which the prefill engine then reads
        instead of decoding them into the scratch (None: it decodes them)."""
        kern = self.kernel(dev)
        prefill = self.spec.engine == "prefill"
        decoded = decoded if prefill else None  # only the prefill engine reads predecoded weights
        scratch = self.scratch(cfg, dev, stream) if prefill and decoded is None else ()
        w_e4m3 = tuple(t.data_ptr() for t in decoded or scratch) or (0, 0)
        params = self.params(
            cfg=cfg,
            dims=dims,
            ws=ws,
            kw=kw,
            rank=rank,
            dev=dev,
            clamp=clamp,
            has_clamp=has_clamp,
            biases=biases,
            dumps=dumps,
            w_e4m3=w_e4m3,
            decoded=decoded is not None,
        )
        return self._launch(kern, self.grid(kern, sms), params), scratch

    @staticmethod
    def patch_call(launch: driver.Launch, x, x_sf, topk_idx, topk_weights, y, record_stats: bool) -> None:
        """A call's pointers, T (x's rows) and record_stats into the layer's launch."""
        # The call's pointers are five consecutive fields (contract.FUSED_PARAMS; asserted at import).
        launch.patch(
            _OFF["x"], "<5Q", x.data_ptr(), x_sf.data_ptr(), topk_idx.data_ptr(), topk_weights.data_ptr(), y.data_ptr()
        )
        launch.patch(_OFF["num_tokens"], _I32, x.shape[0])
        launch.patch(_OFF["record_stats"], _I32, int(record_stats))


_KINDS = {
    jb.GemmSpec: GemmLauncher,
    jb.PrefillSpec: PrefillLauncher,
    jb.PredecodeSpec: PredecodeLauncher,
    jb.FusedSpec: FusedLauncher,
}


def launcher(spec: jb.GemmSpec | jb.PrefillSpec | jb.PredecodeSpec | jb.FusedSpec) -> _Launcher:
    """The launcher of `spec`'s kernel kind."""
    return _KINDS[type(spec)](spec)
