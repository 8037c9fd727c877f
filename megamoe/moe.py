"""The fused MegaMoE layer: one persistent launch per call does SPEC §3 from dispatch to combine.

    layer = MegaMoE(cfg, weights)                     # once per layer configuration
    y = layer(x, x_sf, topk_idx, topk_weights)        # bf16 [T, H]
    y, dumps = layer(x, x_sf, topk_idx, topk_weights, debug=True)   # + every dump point D1-D10
    y, tl = layer(x, x_sf, topk_idx, topk_weights, timeline=True)   # + where the kernel's time went

`MegaMoE` owns this rank's workspace (megamoe/jit/contract.py WORKSPACE: every region's offset,
dtype and shape, sized for the worst case any peer can cause), the compiled kernel
(kernel/fused/megamoe_sm90.cuh) and the weights in the kernel layout. A call checks its inputs
(SPEC §7: MegaMoEInputError before anything is launched), patches the call's pointers into the
kept kernel argument and launches on the current stream, without synchronising; calls with the
same tensors can be captured in a CUDA graph.

The GEMMs run in the exact mode (promotion "k32", the default) or the fast mode ("k128": the pull
and the L1 epilogue also write the operands rebased per 128 channels, `megamoe.reference.rebase_k128`,
and the GEMMs read those; H and I multiples of 512); megamoe.gemm.TAU is each mode's GEMM_BOUND tau.
They run on one of the GEMM core's engines (the same kernel layer as megamoe.gemm's standalone
kernels), chosen per call by the call's tokens (`engine_for`; `engine=` fixes one):
* "swapab" (decode sizes): the weights as wgmma M, decoded from FP4 in the consumers, at token tile
  64 (= BLOCK_M, which the layer requires), with four consumer warpgroups in the fast mode; items
  taken in the dynamic order (L2 items after every L1 item, each waiting only for its pool block's
  L1 tiles); in the exact mode H and I in multiples of 32 (SPEC §8), padded to its K blocks and row
  tiles inside the weights' layout and the workspace; both activations (SPEC §3, §8);
* "narrow" (decode sizes in the exact mode only: up to 8 expected rows per local expert): the
  swap-AB engine at token tile 8, whose mainloop keeps a K block's four k32 wgmmas in flight while
  it decodes the next; a pool block of more than 8 rows runs in parts of 8 rows, each streaming the
  weights again;
* "prefill" (prefill sizes): every weight of both layers decoded once per call to E4M3 inside the
  launch (into a scratch buffer of E_l * 3 * H * I bytes at whole sizes, 9/8 of it in the exact
  mode, shared with megamoe.gemm's prefill path per device and stream), then tokens as wgmma M in
  CTA tiles of 128 tokens x 256 weight rows (the exact mode: 192 x 128; contract.PREFILL_TOKENS,
  PREFILL_ROWS); the same sizes and activations as the swap-AB engine. `predecoded=True` decodes
  them once, when the layer is made (whatever `engine` says: it may be reassigned), into buffers of
  the layer's own (the same bytes and size as the scratch: E_l * 3 * H * I at whole sizes, 9/8 of
  it in the exact mode; 0.95 GB for gpt-oss's 32 experts), and its prefill calls skip the per-call
  predecode (so "auto" takes the prefill engine from fewer rows: choose_engine).

Expert parallelism (SPEC §6): with a process group of R ranks (`cfg.num_ranks` = R), every rank
makes its MegaMoE with the same arguments (a collective: the symmetric workspace is allocated and
exchanged, and the configurations are compared) and every rank calls it the same number of times.
Each rank owns experts [rank E_l, (rank + 1) E_l) and returns y for its own tokens (T may differ
per rank, 0 included). Before each launch the ranks agree with one host collective on a gloo group
(`megamoe.ranks.agree`): one rank's bad input (or a kernel that failed to build) is refused on
every rank, and so are calls whose options (debug, fast_math, clamp, record_stats, timeline) differ between
ranks, so no rank waits in the kernel for a peer that never launches. The constructor does the same
for its own checks and for the work on a rank's weights (their layout, `predecoded`'s tiles): a
rank that failed there (out of memory, say) fails every rank's constructor. `megamoe.multirank.spawn`
runs R ranks as processes, on one GPU when there is one.

Debug calls (`debug=True`) run the debug build, which keeps the fp32 accumulators (D5, D7) and
snapshots the counters before its cleanup; the dumps come back as `megamoe.conformance.dump.Dump`
objects for `megamoe.conformance.suite.check`. Before a debug call the pool, the intermediate and
the combine buffer are poisoned (NaN / 0xFF), so a stage that writes nothing cannot pass.

Timeline calls (`timeline=True`) run the timeline build: the release build with %globaltimer stamps
of each CTA's phases and items, returned as a `megamoe.timeline.Timeline` once the call has finished
(it synchronises); y is the release build's. `python -m bench.timeline` prints one.
"""

from __future__ import annotations

import contextlib
import dataclasses
import weakref

import torch

from megamoe import gemm as G
from megamoe import launch as LA
from megamoe import reference as ref
from megamoe import ranks
from megamoe import runtime as RT
from megamoe.reference.errors import check_int, check_type, fail
from megamoe.reference.validate import _check_tensor, check_rank_inputs, check_weights

from .jit import build as jb
from .jit import contract as C
from .jit import driver
from .jit.layout import transform_weights
from .launchers import FusedLauncher
from .timeline import Timeline

# The engine choice is megamoe.heuristics'; named here too (megamoe.moe.choose_engine).
from .heuristics import FUSED_PREFILL_MIN_ROWS as FUSED_PREFILL_MIN_ROWS
from .heuristics import choose_engine

PROMOTIONS = jb.PROMOTIONS


@dataclasses.dataclass
class _Workspace:
    """This rank's workspace: one allocation, a view per region."""

    buffer: torch.Tensor
    layout: dict[str, tuple[int, str, tuple[int, ...]]]

    def __getitem__(self, name: str) -> torch.Tensor:
        off, dtype, shape = self.layout[name]
        n = 1
        for d in shape:
            n *= d
        dt = getattr(torch, dtype)
        size = torch.empty(0, dtype=dt).element_size()
        return self.buffer[off : off + n * size].view(dt).view(shape)

    def ptr(self, name: str) -> int:
        return self.buffer.data_ptr() + self.layout[name][0]


def kernel_bias(b: torch.Tensor) -> torch.Tensor:
    """A bias (SPEC §8) as the kernels read it: contiguous, its first element 16-byte aligned (the
    prefill engine copies 8 columns at a time with 16-byte cp.async; a view at another offset,
    which the swap-AB engine's 2-byte loads would take, is copied)."""
    b = b.contiguous()
    return b if b.data_ptr() % 16 == 0 else b.clone()


class MegaMoE:
    """The fused layer of one rank. `weights`: canonical `ExpertWeights` of all E experts (this
    rank's E_l are taken) or of this rank's E_l experts only, on the GPU the layer runs on."""

    def __init__(
        self,
        cfg: ref.MoEConfig,
        weights: ref.ExpertWeights,
        *,
        group=None,
        device: torch.device | int | None = None,
        num_sms: int | None = None,
        promotion: str = "k32",
        engine: str = "auto",
        predecoded: bool = False,
    ):
        rank, size = ranks.rank_and_size(group)
        self.cfg, self.group, self.rank, self.promotion, self.engine = cfg, group, rank, promotion, engine
        self._host = ranks.host_group(group)  # None for one rank
        refused = None
        try:
            check_type("predecoded", predecoded, bool)
            self._check_layer(weights, size, device, promotion)
        except Exception as e:  # refused on every rank below, raised here
            refused = e
        # Several ranks refuse together (a rank that raised alone would leave its peers waiting in
        # the collectives below).
        ranks.agree(self._host, refused)
        failed = None
        try:
            self._prepare_weights(predecoded)
        except Exception as e:  # out of memory, a kernel that did not build: raised on every rank below
            failed = e
        # As above: a rank whose weights could not be prepared would leave its peers waiting for it
        # in the collectives that follow, so every rank raises.
        ranks.agree(self._host, failed)
        dev = self.device
        layout, total = C.workspace_layout(cfg)
        self.dims = C.workspace_dims(cfg)
        self._sms = driver.num_sms(dev.index) if num_sms is None else int(num_sms)
        # Every rank's kernel waits for R x (its grid) CTAs of every phase: same grid, same
        # configuration, same kernel on every rank, or the first call would time out.
        what = "configuration, promotion and SM count"
        ranks.same_on_every_rank(self._host, "MegaMoE(...)", what, (cfg.to_dict(), promotion, self._sms))
        buf, offsets = ranks.symmetric_zeros(total, dev, group, self._host)  # zero on every rank on return
        self.ws = _Workspace(buf, layout)
        self.ws["peers"].copy_(torch.tensor(offsets, dtype=torch.int64))
        # per (fast_math, debug, activation_clamp, engine, stream of the prefill engine's scratch)
        self._launches: dict[tuple, driver.Launch] = {}
        self._scratch: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}  # what those launches point into
        self._checked: set[tuple] = set()  # input tensors whose shapes, dtypes, devices passed
        # The last call's checked input tensors (weak references: a strong one would keep a tensor
        # of a CUDA graph tree's memory pool alive behind the tree's back, and its checkpointed
        # allocator state would then hand that memory out twice) and x's address.
        self._last: tuple | None = None
        self._debug_buffers: tuple[torch.Tensor, torch.Tensor] | None = None

    def _prepare_weights(self, predecoded: bool) -> None:
        """The constructor's per-rank work on this rank's weights: their kernel layout, the
        predecoded tiles where asked for, the biases in the kernel's form."""
        dev, local = self.device, self.weights
        self.kw = transform_weights(local.w1, local.w1_sf, local.w2, local.w2_sf)
        # predecoded: the prefill engine's E4M3 weight tiles of both layers, decoded here once and
        # kept (the kernel layout's copy of the weights is the layer's own, so they cannot go stale).
        self._decoded: tuple[torch.Tensor, torch.Tensor] | None = None
        if predecoded:
            with torch.cuda.device(dev):
                stream = self._stream()
                prefill = FusedLauncher(self._spec(True, False, "prefill"))
                self._decoded = prefill.predecode(self.cfg, self.kw, dev.index, stream)
                torch.cuda.current_stream(dev).synchronize()  # calls on any stream read them
        # SPEC §8's biases as the kernel reads them: bf16 [E_l, 2I] and [E_l, H], canonical rows.
        self._biases = tuple(None if b is None else kernel_bias(b) for b in (local.b1, local.b2))

    def _check_layer(self, weights: ref.ExpertWeights, size: int, device, promotion: str) -> None:
        """The constructor's argument checks (SPEC §7); sets device and this rank's weights."""
        cfg = self.cfg
        check_type("cfg", cfg, ref.MoEConfig)
        if cfg.num_ranks != size:
            fail("cfg.num_ranks", f"{size}, the size of the process group (1 for group=None)", cfg.num_ranks)
        # SPEC §8: multiples of 32, as the reference; the kernel pads them to its K block and row tiles
        # inside its layouts (the fast mode keeps its multiples of 512, below).
        for name, size in (("cfg.hidden", cfg.hidden), ("cfg.intermediate", cfg.intermediate)):
            if size % 32:
                fail(name, "a multiple of 32 (the scale groups)", size)
        if cfg.block_m != C.FUSED_BLOCK_M:
            fail("cfg.block_m", f"{C.FUSED_BLOCK_M} (the fused kernel's token tile)", cfg.block_m)
        if cfg.local_experts > C.MAX_EXPERTS:
            fail("cfg.num_experts", f"at most {C.MAX_EXPERTS} local experts", cfg.local_experts)
        if promotion not in PROMOTIONS:
            fail("promotion", f"one of {PROMOTIONS}", repr(promotion))
        self._check_engine()
        if promotion == "k128" and (cfg.hidden % 512 or cfg.intermediate % 512):
            # the scale warp reads one 4-byte word of per-128 scale bytes per four K blocks
            fail(
                "cfg.hidden / cfg.intermediate", "multiples of 512 for promotion 'k128'", (cfg.hidden, cfg.intermediate)
            )
        self.tau = {ref.points.D5: G.TAU[promotion], ref.points.D7: G.TAU[promotion]}
        # The GPU checks come before the device is looked up: on a machine without one, torch's
        # lookup would end in its own traceback instead of one line naming what is missing.
        if device is not None and not isinstance(device, int) and torch.device(device).type != "cuda":
            fail("device", "a CUDA device", device)
        check_type("weights", weights, ref.ExpertWeights)
        LA.require_cuda("weights", weights.w1)
        dev = torch.device("cuda", torch.cuda.current_device() if device is None else torch.device(device).index or 0)
        if isinstance(device, int):
            dev = torch.device("cuda", device)
        self.device = dev
        e_l = cfg.local_experts
        if weights.w1.shape[0] == cfg.num_experts:
            local = weights.slice(self.rank * e_l, (self.rank + 1) * e_l)
        else:
            local = weights
        check_weights(cfg, local, e_l)
        if local.w1.device != dev:
            fail("weights", f"tensors on {dev}", local.w1.device)
        for name, b in (("b1", local.b1), ("b2", local.b2)):
            if b is not None and b.device != dev:
                fail(f"weights.{name}", f"a tensor on {dev}", b.device)
        if promotion == "k128":
            for name, sf in (("w1_sf", local.w1_sf), ("w2_sf", local.w2_sf)):
                LA.check_fast_spread(f"weights.{name}", ref.quantize.weight_row_spread(sf), promotion)
        self.weights = local  # canonical, for the dumps

    # -----------------------------------------------------------------------------------------
    @property
    def recv_stats(self) -> torch.Tensor:
        """int64 [E_l]: the tokens each local expert received over the calls made with record_stats."""
        return self.ws["recv_stats"]

    @property
    def predecoded(self) -> bool:
        """Whether the layer was made with predecoded=True (its prefill engine reads its own buffers)."""
        return self._decoded is not None

    def engine_for(self, tokens: int) -> str:
        """The GEMM engine a call of `tokens` tokens (this rank's T) runs on (choose_engine). The
        `engine` attribute may be reassigned between calls (one workspace serves every engine): it
        is checked here as in the constructor. A predecoded layer takes the prefill engine from fewer
        rows (heuristics.FUSED_PREFILL_MIN_ROWS_PREDECODED)."""
        self._check_engine()
        return choose_engine(self.cfg, self.promotion, tokens, self.engine, self.predecoded)

    def _check_engine(self) -> None:
        """`engine`: "auto" or an engine of the layer's promotion (jit.build.FUSED_ENGINES_OF)."""
        engines = ("auto", *jb.FUSED_ENGINES_OF[self.promotion])
        if self.engine not in engines:
            fail("engine", f"one of {engines} (promotion {self.promotion!r})", repr(self.engine))

    def _spec(self, fast_math: bool, debug: bool, engine: str, timeline: bool = False) -> jb.FusedSpec:
        """The kernel build of a call in this mode."""
        return jb.FusedSpec(
            fast_math=fast_math,
            debug=debug,
            promotion=self.promotion,
            engine=engine,
            activation=self.cfg.activation,
            timeline=timeline,
        )

    def _launch(self, fast_math: bool, debug: bool, clamp_arg, engine: str, timeline: bool = False) -> driver.Launch:
        # The prefill engine's scratch is per stream (shared with megamoe.gemm's prefill path); a
        # predecoded layer's prefill engine reads its own buffers instead.
        stream = self._stream() if engine == "prefill" and self._decoded is None else None
        key = (fast_math, debug, clamp_arg, engine, stream, timeline)
        launch = self._launches.get(key)
        if launch is None:
            # SPEC §8: the gpt-oss variant clamps at bf16(limit), rounded as §2 rounds c.
            clamp, has_clamp = LA.clamp(self.cfg.limit if self.cfg.activation == "swiglu_oai" else clamp_arg)
            if debug and self._debug_buffers is None:
                P = self.dims["P"]
                self._debug_buffers = (
                    torch.zeros(P, 2 * self.cfg.intermediate, dtype=torch.float32, device=self.device),
                    torch.zeros(P, self.cfg.hidden, dtype=torch.float32, device=self.device),
                )
            launcher = FusedLauncher(self._spec(fast_math, debug, engine, timeline))
            launch, scratch = launcher.launch(
                cfg=self.cfg,
                dims=self.dims,
                ws=self.ws,
                kw=self.kw,
                rank=self.rank,
                dev=self.device.index,
                sms=self._sms,
                clamp=clamp,
                has_clamp=has_clamp,
                biases=self._biases,
                dumps=self._debug_buffers,
                stream=stream,
                decoded=self._decoded,
            )
            if scratch:
                self._scratch[key] = scratch
            self._launches[key] = launch
        return launch

    # -----------------------------------------------------------------------------------------
    def __call__(
        self,
        x: torch.Tensor,
        x_sf: torch.Tensor,
        topk_idx: torch.Tensor,
        topk_weights: torch.Tensor,
        *,
        activation_clamp: float | None | str = "config",
        fast_math: bool | None = None,
        record_stats: bool = True,
        debug: bool = False,
        check_inputs: bool = True,
        out: torch.Tensor | None = None,
        timeline: bool = False,
    ):
        """y = the layer on this rank's tokens (bf16 [T, H]); with debug=True, (y, dumps); with
        timeline=True, (y, megamoe.timeline.Timeline): the call ran on the timeline build, whose y is
        the release build's and whose stamps say where the kernel's time went (bench.timeline).

        activation_clamp / fast_math default to the config's. record_stats adds each local
        expert's received tokens to `recv_stats` (D10; False leaves them as they are).
        check_inputs=False skips the SPEC §7 checks that read the inputs' values (a duplicate
        expert, an expert id out of range, a NaN scale byte: they synchronise with the GPU, so they
        are also skipped while a CUDA graph is being captured); shapes, dtypes and devices are
        always checked. out: a bf16 [T, H] tensor to write y into (else a new one)."""
        launch, y, dcfg, x_sf = self._ready(
            x,
            x_sf,
            topk_idx,
            topk_weights,
            activation_clamp,
            fast_math,
            record_stats,
            debug,
            check_inputs,
            out,
            timeline,
        )
        if debug:
            self._poison()
            stats_before = self.ws["recv_stats"].clone()
        launch(self._stream())
        if timeline:
            return y, self._timeline(dcfg.fast_math, self.engine_for(x.shape[0]))
        if not debug:
            return y
        inputs = ref.RankInputs(x, x_sf, topk_idx, topk_weights)
        try:
            dumps = self._dumps(dcfg, inputs, y, stats_before, dcfg.fast_math, record_stats)
        finally:
            # A peer's next call writes its counts and source lists into this rank's workspace
            # before any barrier of the kernel's: no rank starts it until every rank read its dumps.
            ranks.barrier(self._host)
        return y, dumps

    def prepare(
        self,
        x: torch.Tensor,
        x_sf: torch.Tensor,
        topk_idx: torch.Tensor,
        topk_weights: torch.Tensor,
        *,
        activation_clamp: float | None | str = "config",
        fast_math: bool | None = None,
        record_stats: bool = True,
        check_inputs: bool = True,
        out: torch.Tensor | None = None,
    ) -> PreparedLayer:
        """The call `layer(x, x_sf, topk_idx, topk_weights, ...)` made ready (PreparedLayer): the same
        arguments, checked here (with several ranks, agreed here: every rank prepares, and every rank
        calls its prepared call as often as the others), y allocated here when `out` is not given,
        and nothing launched until the call. Its call launches on the stream current here and
        returns y, so its host time is the driver's launch (bench.host_probe). debug calls are
        __call__'s (their dumps are per call work)."""
        launch, y, _, _ = self._ready(
            x, x_sf, topk_idx, topk_weights, activation_clamp, fast_math, record_stats, False, check_inputs, out
        )
        own = launch.copy()  # this call's pointers, kept from the next calls' patches
        tensors = (x, x_sf, topk_idx, topk_weights, y, self)
        return PreparedLayer(own, y, self.device.index, self._stream(), tensors)

    def _ready(
        self,
        x,
        x_sf,
        topk_idx,
        topk_weights,
        activation_clamp,
        fast_math,
        record_stats,
        debug,
        check_inputs,
        out,
        timeline=False,
    ):
        """A call's host work before its launch: the checks (agreed between the ranks), y, and the
        mode's launch with this call's pointers, T and record_stats patched in. Returns (launch, y,
        the call's configuration)."""
        cfg = self.cfg
        clamp_arg = cfg.activation_clamp if activation_clamp == "config" else activation_clamp
        fm = cfg.fast_math if fast_math is None else bool(fast_math)
        if isinstance(x_sf, torch.Tensor) and x_sf.dtype == torch.int32 and x_sf.dim() == 2:
            x_sf = x_sf.view(torch.uint8)  # the packed form of the same bytes
        refused = launch = None
        try:
            if timeline and debug:
                fail("timeline", "False with debug=True (the dump build has no stamps)", timeline)
            if timeline and torch.cuda.is_current_stream_capturing():
                fail("timeline", "False while a CUDA graph is captured (its stamps are read after the call)", timeline)
            self._check_call(x, x_sf, topk_idx, topk_weights, clamp_arg, check_inputs, out)
            engine = self.engine_for(x.shape[0])
            launch = self._launch(fm, debug, clamp_arg, engine, timeline)
        except Exception as e:
            if self._host is None:
                raise
            refused = e  # raised on this rank by ranks.agree
        if self._host is not None:
            # Every rank launches or none does: a rank alone in the kernel would wait for its peers
            # until the timeouts trap. Its checks and its kernel's build are agreed, and the options
            # that choose the kernel and its work.
            opts = dict(
                debug=debug,
                fast_math=fm,
                activation_clamp=_float_or_none(clamp_arg),
                record_stats=record_stats,
                timeline=timeline,
            )
            ranks.agree(self._host, refused, ranks.call_options(**opts), tuple(opts))
        T = x.shape[0]
        y = torch.empty(T, cfg.hidden, dtype=torch.bfloat16, device=self.device) if out is None else out
        FusedLauncher.patch_call(launch, x, x_sf, topk_idx, topk_weights, y, record_stats)
        return launch, y, dataclasses.replace(cfg, activation_clamp=clamp_arg, fast_math=fm), x_sf

    def _timeline(self, fast_math: bool, engine: str) -> Timeline:
        """The stamps of the timeline build's last call in this mode, once it has finished."""
        torch.cuda.current_stream(self.device).synchronize()
        launcher = FusedLauncher(self._spec(fast_math, False, engine, timeline=True))
        kern = launcher.kernel(self.device.index)
        raw = driver.module_global(kern.module, "megamoe_timeline")
        return Timeline.from_bytes(raw, launcher.grid(kern, self._sms), engine)

    def _check_call(self, x, x_sf, topk_idx, topk_weights, clamp_arg, check_inputs: bool, out) -> None:
        """SPEC §7 on this rank's call; raises MegaMoEInputError naming the argument."""
        cfg = self.cfg
        if clamp_arg is not None and (isinstance(clamp_arg, bool) or not isinstance(clamp_arg, (int, float))):
            LA.clamp(clamp_arg)  # raises MegaMoEInputError naming the argument
        if cfg.activation == "swiglu_oai" and clamp_arg is not None:
            fail("activation_clamp", "None for activation 'swiglu_oai' (its limit clamps, SPEC §8)", repr(clamp_arg))
        # The host path of a repeated call (same tensors, same mode) is a few dictionary lookups and
        # the pointer patches: what was checked once for these tensors' shapes, dtypes and devices,
        # and the mode's launch, are remembered.
        if check_inputs and not torch.cuda.is_current_stream_capturing():
            check_rank_inputs(cfg, ref.RankInputs(x, x_sf, topk_idx, topk_weights), self.rank, self.device)
        # The same tensor objects at the same addresses as the last call: nothing to look up.
        last = self._last
        same = (
            last is not None
            and x is last[0]()
            and x_sf is last[1]()
            and topk_idx is last[2]()
            and topk_weights is last[3]()
            and x.data_ptr() == last[4]
        )
        key = None if same else (_tkey(x), _tkey(x_sf), _tkey(topk_idx), _tkey(topk_weights))
        if not same and key not in self._checked:
            _check_shapes(cfg, ref.RankInputs(x, x_sf, topk_idx, topk_weights))
            if x.device != self.device:
                fail("x", f"a tensor on {self.device}", x.device)
            if len(self._checked) > 64:
                self._checked.clear()
            self._checked.add(key)
        if not same:
            self._last = (*map(weakref.ref, (x, x_sf, topk_idx, topk_weights)), x.data_ptr())
        if out is not None:
            _check_tensor("out", out, torch.bfloat16, (x.shape[0], cfg.hidden), self.device)

    def _stream(self) -> int:
        """The current CUDA stream of the layer's device (torch's raw getter where it has one)."""
        if RT.raw_stream is not None:
            return RT.raw_stream(self.device.index)
        return torch.cuda.current_stream(self.device).cuda_stream

    def timeout_message(self) -> str | None:
        """After a call failed with a CUDA error: which wait of this rank's kernel timed out, in
        words ("rank 0, SM block 17 thread 0: waited for arrival counter of pool block 9: expected 64,
        observed 40"), or None when no wait of this device recorded one (SPEC §5)."""
        msg = RT.timeout_message(self.device.index)
        return None if msg is None else f"rank {self.rank}, {msg}"

    @contextlib.contextmanager
    def named_failures(self):
        """A context in which a CUDA error that a wait's trap caused is re-raised with the trap's
        record in words (`timeout_message`), e.g. around a rank's calls in a spawned process."""
        try:
            yield self
        except RuntimeError as exc:
            record = None if isinstance(exc, torch.cuda.OutOfMemoryError) else self.timeout_message()
            if record is None:
                raise
            raise RuntimeError(f"{exc} [the kernel trapped: {record}]") from exc

    # The waits `withhold` can make time out (SPEC §5), each by the counter it reads.
    WITHHOLD = ("dispatch", "l2_done", "decoded", "arrival", "l1_done", "epoch")

    def withhold(self, wait: str, index: int = 0) -> None:
        """A debug switch for hang tests (SPEC §5): this rank's next call misses one arrival at a
        wait, which then times out and traps with its record. The counter the wait reads starts one
        short (the kernel leaves it zero after a call, and counts up from there): "dispatch" (this
        call's dispatch counter: one CTA's post; a one-rank call of at most
        contract.LOCAL_DISPATCH_ENTRIES routing entries counts without it, and does not wait),
        "l2_done" (one CTA's L2 completion), "decoded" (one
        CTA's share of the prefill engine's predecode), "arrival" (one row of pool block `index`),
        "l1_done" (one L1 tile of pool block `index`). "epoch" counts one call more on this rank, so
        that it signals its peers' other parity (R > 1: every rank's dispatch waits). Nothing is
        launched here. The trap ends this process's CUDA context: a new process and a new layer
        recover (the workspace and its peers' views die with it)."""
        ws = self.ws
        if wait not in self.WITHHOLD:
            fail("wait", f"one of {self.WITHHOLD}", repr(wait))
        if wait == "decoded" and self._decoded is not None:
            fail("wait", "not 'decoded' on a predecoded layer (its calls never wait on that counter)", repr(wait))
        if wait == "epoch":
            ws["epoch"][0] += 1
        elif wait in ("arrival", "l1_done"):
            counters = ws["arrivals" if wait == "arrival" else "l1_done"]
            check_int("index", index, 0, counters.numel() - 1)
            counters[index] -= 1
        else:
            parity = int(ws["epoch"][0]) & 1  # the signal words of the next call (kernel/fused/sync.cuh)
            word = {"dispatch": C.SIGNAL_POSTED, "l2_done": C.SIGNAL_L2_DONE, "decoded": C.SIGNAL_DECODED}[wait]
            ws["signals"][parity, word] -= 1

    def _poison(self) -> None:
        ws = self.ws
        for name in ("pool_meta", "snap_arrivals", "snap_l1_done"):
            ws[name].view(torch.uint8).fill_(0xFF)
        # The pool's and the intermediate's padding past H and I (SPEC §8 sizes) stays zero: the
        # GEMMs multiply it by zero weights (an 0xFF code is NaN), and workspace_points checks it.
        hidden, inter = self.cfg.hidden, self.cfg.intermediate
        for name, cols in (("pool_x", hidden), ("pool_x_sf", hidden // 32), ("l2_acts", inter), ("l2_sf", inter // 32)):
            ws[name][:, :cols].fill_(0xFF)
        ws["pool_weights"].fill_(float("nan"))
        ws["combine"].fill_(float("nan"))
        for b in self._debug_buffers or ():
            b.fill_(float("nan"))

    def _dumps(self, cfg, inputs: ref.RankInputs, y: torch.Tensor, stats_before, fast_math: bool, recorded: bool):
        """This call's dump points D1-D10, read back from the workspace in canonical layouts."""
        from megamoe.conformance.dump import make_dumps, new_call_id

        # First, before anything here can fail on one rank: a collective every rank reaches.
        call_id = ranks.from_rank0(self._host, new_call_id())
        ws, pt = self.ws, ref.points
        points = workspace_points(ws, cfg)
        p_used = int(points[pt.D4_EXPERT_OFFSETS][-1])
        acc1, acc2 = self._debug_buffers
        points.update(
            {
                pt.D5_ACC1: acc1[:p_used].clone(),
                pt.D7_ACC2: acc2[:p_used].clone(),
                pt.D9_Y: y.clone(),
                pt.D10_COUNTERS: torch.cat([ws[n].reshape(-1) for n in C.COUNTERS]),
            }
        )
        # The reader against the one table of dump tensors (names, dtypes, shapes).
        pt.check_dump_tensors(points, pt.dump_dims(cfg, tokens=y.shape[0], pool_rows=p_used))
        return make_dumps(
            cfg,
            [inputs],
            self.weights,
            [points],
            kernel_mode=f"sm90-fused-{self.promotion}",
            build_id=self._spec(fast_math, True, self.engine_for(y.shape[0])).name,
            tau=self.tau,
            recv_stats_before=[stats_before],
            recv_stats_recorded=recorded,
            ranks=[self.rank],
            call_id=call_id,
        )


def workspace_points(ws, cfg: ref.MoEConfig) -> dict[str, torch.Tensor]:
    """The dump tensors a debug call reads from its workspace `ws` (a region's tensor by name), by
    the regions' links to the dump-point table (contract.WORKSPACE's `dump`): copies, a leading P
    or B cut to the call's used pool rows or blocks (the last expert offset), and the source lists
    past each pair's received count set to -1 (SPEC §3 D3's padding; the kernel leaves them as
    they were)."""
    pt = ref.points
    p_used = int(ws["expert_offsets"][-1])
    used = {"P": p_used, "B": p_used // cfg.block_m}
    points = {}
    dims = pt.config_dims(cfg)
    for r in C.WORKSPACE:
        if r.dump:
            lead = r.shape.split(",")[0].strip()
            t = ws[r.name]
            t = t[: used[lead]] if lead in used else t
            # A padded row (pool_x's H_pad, l2_acts' I_pad) cut to the dump tensor's columns. Its
            # padding must be zero (SPEC §8 sizes: the GEMMs multiply it by zero weights, and a NaN
            # code there would be a NaN product): no dump point holds it, so it is checked here.
            want = pt.shape_of(pt.TABLE[r.dump].shape, dict(dims, T=0, P=t.shape[0], B=t.shape[0]), what=r.dump)
            if t.dim() == 2 and t.shape[1] > want[1] and t[:, want[1] :].any():
                raise RuntimeError(
                    f"the workspace's {r.name} has non-zero padding past its {want[1]} columns in the used "
                    "pool rows: a kernel wrote where it must not (SPEC §8's padding is zero)"
                )
            points[r.dump] = t[(slice(None),) + tuple(slice(0, n) for n in want[1:])].clone()
    lists, counts = points[pt.D3_SOURCE_LISTS], points[pt.D2_RECV_COUNTS]
    pos = torch.arange(cfg.max_tokens_per_rank, device=lists.device)
    points[pt.D3_SOURCE_LISTS] = torch.where(pos[None, None, :] < counts.T[:, :, None], lists, -1)  # [E_l, R, T_max]
    return points


def _float_or_none(v):
    try:
        return None if v is None else float(v)
    except (TypeError, ValueError):  # a bad clamp: that rank refuses anyway
        return None


def _tkey(t) -> tuple:
    # The address names the device too (one unified address space per process).
    return (t.data_ptr(), t.dtype, t.shape, t.stride()) if isinstance(t, torch.Tensor) else (id(t),)


def _check_shapes(cfg: ref.MoEConfig, inp: ref.RankInputs) -> None:
    """The SPEC §7 checks that do not read tensor values (no device synchronisation)."""
    from megamoe.reference.validate import _check_alignment

    x = inp.x
    if not isinstance(x, torch.Tensor) or x.dim() != 2:
        fail("x", "a 2-D tensor [T, H]", getattr(x, "shape", type(x).__name__))
    t = x.shape[0]
    if t > cfg.max_tokens_per_rank:
        fail("x", f"at most T_max = {cfg.max_tokens_per_rank} tokens", t)
    _check_tensor("x", x, torch.float8_e4m3fn, (t, cfg.hidden), x.device)
    _check_tensor("x_sf", inp.x_sf, torch.uint8, (t, cfg.hidden // 32), x.device)
    _check_tensor("topk_idx", inp.topk_idx, torch.int64, (t, cfg.top_k), x.device)
    _check_tensor("topk_weights", inp.topk_weights, torch.float32, (t, cfg.top_k), x.device)
    _check_alignment("x", x)
    _check_alignment("x_sf", inp.x_sf)


class PreparedLayer(RT.PreparedCall):
    """One MegaMoE call made ready for its tensors (MegaMoE.prepare). Calling it launches the fused
    kernel on the stream it was prepared on and returns y (the same tensor each time, rewritten by
    every call). Like a CUDA graph and megamoe.gemm.PreparedGemm, it holds the tensors' addresses as
    they were when it was prepared and keeps them (and the layer) alive; new values in them are what
    it computes on, and the SPEC §7 value checks are not repeated (prepare's check_inputs checked the
    values it saw). It can be captured in a CUDA graph on its stream."""

    what = "a prepared MegaMoE call"
