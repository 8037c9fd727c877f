"""What the host and the SM90 GEMM kernel must agree on, written once: the kernel's parameter struct,
its shared constants, the promotions, the fast mode's scaled FP4 lookup table, the trap codes, and
the fused kernel's workspace (its regions' pointers and an accessor of each multi-dimensional one).

`kernel/gemm/contract.cuh` is generated from this module (`python -m megamoe.jit.contract --write`
rewrites it, `--check` exits 1 when it is stale; a CPU test runs the check),
and `pack_params` writes the struct's bytes from the same field list, so a field added, moved or
retyped here moves on both sides at once. The C++ side pins every offset with a static_assert.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
import struct
import sys
from pathlib import Path

from megamoe.reference import points as DP
from megamoe.reference import quantize as Q

# The GEMM's two promotions (how often the tensor core's sums are scaled into fp32, megamoe/gemm.py):
# "k32" every k32 product with both per-32 scales (the exact mode), "k128" once per K128 block (the
# fast mode). The kernels' enum class Promotion has the same names, and its values are their
# positions here; the instantiation units name it (megamoe/jit/build.py fills @PROMOTION@).
PROMOTIONS = ("k32", "k128")
BLOCK_K = 128  # K per pipeline stage (four k32 wgmma steps)
CHUNK_N = 64  # tokens per wgmma chunk of the wide token tiles
TOKEN_TILES = (8, 16, 32, 64, 128, 256)  # a kernel's largest token tile kMaxN (wgmma N, or chunks of 64)
SMALL_TILE = 8  # every kernel runs items of at most this many rows at this tile
MAX_EXPERTS = 256  # local experts of one launch (the schedule's shared-memory tables)
SMEM_LIMIT = 232448  # sm_90 opt-in dynamic shared memory per block
MAX_STAGES = 12
ROWS_PER_WG = 64  # weight rows per consumer warpgroup (wgmma M)
# The largest token tile of each promotion, and of its kernels with four consumer warpgroups (104
# registers a consumer thread). The exact mode's per-k32 promotion needs more registers: at 128
# tokens its L1 epilogue spills (precise SiLU, debug builds), and with four warpgroups it needs the
# pipelined schedule's two temporaries (8 tokens); the fast mode's four-warpgroup items up to 64
# tokens run the serial schedule, one temporary. The kernel static_asserts the same limits.
MAX_TILE = {"k32": 64, "k128": 256}
MAX_WGS4_TILE = {"k32": 8, "k128": 64}
# The prefill path (kernel/gemm/gemm_sm90_prefill.cuh), per promotion: CTA tiles of PREFILL_TOKENS
# tokens (64 a consumer warpgroup, wgmma M) x PREFILL_ROWS weight rows, the weights predecoded once per
# call into tiles of one (expert, K block, PREFILL_ROWS rows), each moved by one bulk copy: the E4M3
# bytes [rows][128] (128-byte swizzle), and in the exact mode (k32) the rows' per-32 scales as fp32
# after them, 4 x rows (predecode.cuh prefill_wsf_index gives the order). The fast mode: 128 x 256,
# two warpgroups (an item's 128 L1 channels are one K128 block of L2: the fused kernel's rebase). The
# exact mode: 192 x 128, three warpgroups, each one wgmma -> wait -> promote chain; three chains
# interleave on the tensor core where two left it idle (bench.exact_rate: 47.1 % of the peak against
# 40.3 % at 128 x 256, bench/NOTES.md v39).
PREFILL_TOKENS = {"k128": 128, "k32": 192}
PREFILL_ROWS = {"k128": 256, "k32": 128}
PREFILL_TILE_BYTES = {
    p: PREFILL_ROWS[p] * BLOCK_K + (4 * PREFILL_ROWS[p] * 4 if p == "k32" else 0) for p in PREFILL_ROWS
}

# Trap record codes (kernel/common/ptx.cuh report_trap; megamoe.gemm.timeout_message words them).
WAITS = {
    1: "full stage barrier",
    2: "empty stage barrier",
    3: "arrival counter of pool block",
    5: "L1 completion counter of pool block",
    6: "dispatch counter (source ranks' CTAs that staged their tokens and posted their counts)",
    7: "L2 completion counter (CTAs of every rank that finished their L2 tiles)",
    8: "predecode counter (this rank's CTAs that decoded their share of the weights, fused prefill path)",
}
# Their C++ names (kWait<name>).
WAIT_NAMES = {1: "Full", 2: "Empty", 3: "Arrival", 5: "L1Done", 6: "Dispatch", 7: "L2Done", 8: "Decoded"}
LAYOUT_CHECK = 4  # the launch's dynamic shared memory is smaller than the kernel's layout

# The fast mode's scaled FP4 -> E4M3 tables: one definition, in the reference.
LUT_ENTRIES = Q.FAST_LUT_ENTRIES
LUT_HEADROOM = Q.FAST_LUT_HEADROOM


@dataclasses.dataclass(frozen=True)
class Field:
    name: str
    kind: str  # "tmap" (CUtensorMap, 128 B), "ptr", "i32", "f32", "struct" (ctype names a Struct)
    ctype: str
    doc: str


# The one kernel argument (a __grid_constant__ struct). Order is layout: keep the tensor maps first
# (128-byte aligned), then 8-byte pointers, then 4-byte scalars.
PARAMS = (
    Field("tmap_x8", "tmap", "CUtensorMap", "activations [P, K] e4m3, box {128 B, 8 rows}, 128-byte swizzle"),
    Field("tmap_x64", "tmap", "CUtensorMap", "the same tensor, box {128 B, 64 rows}"),
    Field("w", "ptr", "const uint8_t*", "packed FP4 weights, kernel layout (megamoe/jit/layout.py)"),
    Field(
        "w_sf",
        "ptr",
        "const uint8_t*",
        "promotion k32: weight scale bytes [E, K/128, R, 4]; k128: LUT byte offsets (8 d), same shape",
    ),
    Field(
        "w_row_base",
        "ptr",
        "const uint8_t*",
        "promotion k128 (and k32's folded prefill items): [E, R] base scale byte B_r of each weight row",
    ),
    Field(
        "w_expert_base",
        "ptr",
        "const uint8_t*",
        "promotion k128 (and k32's folded prefill items): [E] largest row base of each expert",
    ),
    Field(
        "w_fold",
        "ptr",
        "const uint8_t*",
        "prefill, promotion k32: [E, ceil(R/128)] 1 where every row of the 128-row block (PREFILL_ROWS) has all its scale bytes within"
        " FOLD_BINADES of its row base, and that within FOLD_ROW_SPREAD of the expert's: that block's weights are"
        " predecoded through the scaled tables and promoted with one FMA per k32 step (layout.py fold_blocks)",
    ),
    Field(
        "w_e4m3",
        "ptr",
        "uint8_t*",
        "prefill: the weights decoded to E4M3, [E, K/128, ceil(R/rows)] tiles of PREFILL_TILE_BYTES: [rows][128] bytes"
        " with the 128-byte swizzle (k32: then the rows' fp32 scales, where the block does not fold) (written by the predecode pass, read by"
        " the prefill kernel)",
    ),
    Field("x_sf", "ptr", "const uint8_t*", "activation scale bytes: k32 [P, K/32]; k128 [P, K/128] (rebase_k128)"),
    Field("expert_offsets", "ptr", "const int*", "[E + 1] first pool row of each expert"),
    Field("expert_rows", "ptr", "const int*", "[E] valid pool rows of each expert"),
    Field("w_route", "ptr", "const float*", "L1: [P] routing weight of each pool row"),
    Field("out", "ptr", "void*", "L1: l2_acts e4m3 [P, I]; L2: combine rows bf16 [*, H]"),
    Field("out_sf", "ptr", "uint8_t*", "L1: l2_sf [P, I/32]"),
    Field(
        "dst_rows",
        "ptr",
        "const int*",
        "L2: [P] combine row of each pool row (s * combine_rows + row with peer_offsets), < 0 = none",
    ),
    Field(
        "peer_offsets",
        "ptr",
        "const int64_t*",
        "L2: [R] byte offset from out to rank r's copy of it (symmetric memory), nullptr = one rank",
    ),
    Field("dump", "ptr", "float*", "debug build: fp32 accumulators [P, R], canonical channel order"),
    Field("arrival", "ptr", "const int*", "per pool block arrival counters, nullptr = all rows present"),
    Field("signal", "ptr", "int*", "L1 (fused): per pool block L1-completion counters (complete at I/32)"),
    Field(
        "rebase_x",
        "ptr",
        "uint8_t*",
        "L1 (fused, k128): [P, I] the intermediate rebased per 128 channels for L2 (nullptr = off)",
    ),
    Field("rebase_sf", "ptr", "uint8_t*", "L1 (fused, k128): [P, I/128] its scale bytes"),
    Field("rebase_count", "ptr", "int*", "L1 (fused, k128): [B, I/128] warpgroup tiles written per 128 channels"),
    Field(
        "item_counter",
        "ptr",
        "int*",
        "standalone swap-AB and prefill kernels: int[2], zero before the launch (each launch leaves it zero): work"
        " items claimed past the first gridDim.x, CTAs done claiming (scheduler.cuh claim_item); one per launch"
        " object",
    ),
    Field("err", "ptr", "int*", "trap record (host-mapped), nullptr = trap without a record"),
    Field("num_experts", "i32", "int32_t", "E"),
    Field("num_pool_rows", "i32", "int32_t", "P"),
    Field("k", "i32", "int32_t", "reduction length padded to K blocks (padded_k): H (L1) or I (L2)"),
    Field("n_rows", "i32", "int32_t", "weight rows R of the kernel layout: 2I (L1) or H padded to the row tiles (L2)"),
    Field("arrival_block", "i32", "int32_t", "pool rows per arrival counter"),
    Field("arrival_need", "i32", "int32_t", "0: a counter must reach its block's valid rows; > 0: this count"),
    Field("combine_rows", "i32", "int32_t", "L2 with peer_offsets: combine rows per rank (K * T_max)"),
    Field("has_clamp", "i32", "int32_t", "L1: apply clamp_value"),
    Field("clamp_value", "f32", "float", "L1: bf16-representable activation clamp c (swiglu_oai: bf16(limit))"),
    Field(
        "bias",
        "ptr",
        "const uint16_t*",
        "swiglu_oai kernels (SPEC §8): bf16 [E, n_out] in canonical row order, L1 b1 (gate rows, then up),"
        " L2 b2; nullptr = none",
    ),
    Field("alpha", "f32", "float", "swiglu_oai kernels, L1: fp32(alpha) of the glu factor"),
    Field("n_out", "i32", "int32_t", "rows the epilogue writes: 2I (L1) or H (L2); n_rows past it are padding"),
    Field("out_stride", "i32", "int32_t", "elements per row of out: I padded to K blocks (L1) or H (L2)"),
    Field(
        "k32_steps",
        "i32",
        "int32_t",
        "k32 steps that hold channels: H/32 (L1) or I/32 (L2); those of k past them are the layout's zero"
        " padding, which the exact mode's prefill consumers skip",
    ),
)

_SIZE = {"tmap": 128, "ptr": 8, "i32": 4, "f32": 4}
_ALIGN = {"tmap": 128, "ptr": 8, "i32": 4, "f32": 4}  # CUtensorMap is 128-byte aligned (CUDA 13)
_FMT = {"ptr": "<Q", "i32": "<i", "f32": "<f"}


@dataclasses.dataclass(frozen=True)
class Struct:
    """A C struct: its fields in layout order, its size a multiple of `align` (a kernel argument's:
    128, the CUtensorMap's alignment). A field of kind "struct" nests another Struct (its ctype is
    that struct's name)."""

    name: str
    fields: tuple
    align: int = 128

    def _member(self, f: Field) -> tuple[int, int]:
        if f.kind == "struct":
            inner = STRUCTS[f.ctype]
            return inner.size, 128
        return _SIZE[f.kind], _ALIGN[f.kind]

    @property
    def offsets(self) -> dict[str, int]:
        return self._layout()[0]

    @property
    def size(self) -> int:
        return self._layout()[1]

    def _layout(self) -> tuple[dict[str, int], int]:
        offsets, off = {}, 0
        for f in self.fields:
            size, align = self._member(f)
            off = -(-off // align) * align
            offsets[f.name] = off
            off += size
        return offsets, -(-off // self.align) * self.align

    def pack(self, **values) -> bytes:
        """The struct's bytes: every field by name (tensor maps as their 128 bytes, nested structs as
        their packed bytes, pointers as ints, 0 for nullptr)."""
        names = {f.name for f in self.fields}
        missing, extra = names - values.keys(), values.keys() - names
        if missing or extra:
            raise KeyError(f"{self.name} fields: missing {sorted(missing)}, unknown {sorted(extra)}")
        offsets = self.offsets
        buf = bytearray(self.size)
        for f in self.fields:
            v, o = values[f.name], offsets[f.name]
            if f.kind in ("tmap", "struct"):
                size = self._member(f)[0]
                assert len(v) == size, f.name
                buf[o : o + size] = v
            else:
                struct.pack_into(_FMT[f.kind], buf, o, v)
        return bytes(buf)

    def cpp(self) -> list[str]:
        """The C++ definition with every offset pinned by a static_assert."""
        lines = [f"struct {self.name} {{"]
        lines += [f"  {f.ctype} {f.name};  // {f.doc}" for f in self.fields]
        lines += ["};", ""]
        offsets = self.offsets
        lines += [
            f'static_assert(offsetof({self.name}, {f.name}) == {offsets[f.name]}, "{self.name} layout");'
            for f in self.fields
        ]
        lines.append(f'static_assert(sizeof({self.name}) == {self.size}, "{self.name} layout");')
        return lines


GEMM_PARAMS = Struct("GemmParams", PARAMS)

# The trap record (GemmParams.err: pinned host memory, megamoe.runtime.err_record): written by the
# first waiter whose wait expires (kernel/common/ptx.cuh report_trap), read by the host after the
# trap (megamoe.gemm.timeout_message).
TRAP_RECORD = Struct(
    "TrapRecord",
    (
        Field("state", "i32", "int", "0 free, 2 claimed and being written, 1 complete"),
        Field("what", "i32", "int", "the wait (WaitKind) or kLayoutCheck"),
        Field("block", "i32", "int", "blockIdx.x of the writer"),
        Field("index", "i32", "int", "the wait's index (stage, pool block, ...); kLayoutCheck: smem offset mod 1024"),
        Field("expected", "i32", "int", "the count (or parity, or layout bytes) waited for"),
        Field("observed", "i32", "int", "the count seen last (-1: an mbarrier); kLayoutCheck: launch bytes"),
        Field("thread", "i32", "int", "threadIdx.x of the writer"),
        Field("reserved", "i32", "int", "0"),
    ),
    align=4,
)
STRUCTS = {"GemmParams": GEMM_PARAMS}
OFFSETS, PARAMS_BYTES = GEMM_PARAMS.offsets, GEMM_PARAMS.size


def pack_params(**values) -> bytes:
    """The bytes of GemmParams: every field by name (tensor maps as their 128 bytes, pointers as ints,
    0 for nullptr)."""
    return GEMM_PARAMS.pack(**values)


# ---------------------------------------------------------------------------------------------
# The fused kernel (kernel/fused/): its workspace and its argument
# ---------------------------------------------------------------------------------------------
FUSED_MAX_TILE = 64  # the swap-AB engine's token tile: one pool block (BLOCK_M 64) per token block
FUSED_BLOCK_M = 64
SIGNAL_WORDS = 4  # per call parity: dispatch posts, L2 completions, CTAs done, CTAs that predecoded
SIGNAL_POSTED, SIGNAL_L2_DONE, SIGNAL_EXIT, SIGNAL_DECODED = 0, 1, 2, 3
# One rank and at most this many routing entries (T K): every CTA counts every expert itself from
# topk_idx (kernel/fused/dispatch.cuh count_locally), so the call has no dispatch counter to wait on.
# Each thread of a CTA takes one entry and one expert (the fused kernels have at least 384 threads,
# and at most MAX_EXPERTS experts) and reads all T K entries from shared memory.
LOCAL_DISPATCH_ENTRIES = 256


@dataclasses.dataclass(frozen=True)
class Region:
    """One region of a rank's workspace. `shape` is in SPEC's notation (H, I, E, E_l, K, R, T_max)
    plus P (pool rows, sized for the worst case any peer can cause) and B = P / BLOCK_M.
    kind: "counter" (back to zero after every call: D10), "peer" (other ranks write or read it
    through symmetric memory), "local". index: the names of a multi-dimensional region's indices,
    one per dimension: the parameters of its generated accessor (kernel/gemm/contract.cuh). dump:
    the dump tensor (reference.points) a debug call reads from it, its leading P or B cut to the
    call's used pool rows or blocks (megamoe.moe reads them so; a test holds the two tables' dtypes
    and shapes equal)."""

    name: str
    dtype: str
    shape: str
    kind: str
    doc: str
    index: str = ""
    dump: str = ""


# The fused kernel's timeline build (build.FusedSpec.timeline; megamoe.timeline reads it back, bench.timeline
# prints it): %globaltimer stamps (ns) of each CTA's phases and of its first TIMELINE_ITEMS items, in the
# cubin's __device__ array megamoe_timeline, [TIMELINE_CTAS][TIMELINE_STRIDE] uint64. A CTA's row: one word
# per phase (0: not reached, or not a phase of its engine), its item count, then per item its tag
# (TIMELINE_ITEM_TAG: the layer and the item's index among that layer's items) and its stamps.
TIMELINE_PHASES = (
    ("entry", "the CTA starts"),
    (
        "posted",
        "every rank's CTAs posted their counts (thread 0 past the dispatch counter; one rank's local dispatch: the CTA's own count)",
    ),
    ("scheduled", "the pool layout and the schedule built (the CTA's barrier after them)"),
    ("pulled", "prefill engine: the CTA's share of the pull done (the predecode's first barrier)"),
    ("decoded", "prefill engine: the CTA's share of the predecode done"),
    ("decoded_all", "prefill engine: every CTA's share decoded (thread 0 past the predecode counter)"),
    ("gemm", "the GEMM roles start (the CTA's barrier before them)"),
    ("issued", "the TMA thread issued its last item's last stage"),
    ("written", "the CTA's last item written (the producers' tail starts)"),
    ("l2_done", "every rank's CTAs wrote their L2 rows (thread 0 past the L2-done counter)"),
    ("combined", "the CTA's combine and cleanup done"),
)
TIMELINE_ITEM_STAMPS = (
    ("taken", "the TMA thread starts the item (the narrow engine: its token side, producer warp 3)"),
    ("gated", "its gate passed: its pool rows (L1) or their L1 tiles (L2) are there"),
    ("issued", "its last stage issued (the ring then holds the rest of the item; narrow: the token side's)"),
    ("computed", "the consumers' mainloop of it done (its last part's; the later of the consumer warpgroups)"),
    ("written", "its epilogue done: the consumers' (swap-AB, narrow), the epilogue warps' (prefill; the later)"),
    ("ready", "prefill engine: its first stage landed, as the consumers see it (the later warpgroup)"),
    ("staged", "prefill engine: its tile in the staging buffer (the later consumer warpgroup)"),
)
TIMELINE_ITEMS = 256
TIMELINE_CTAS = 256
TIMELINE_ITEM_WORDS = 1 + len(TIMELINE_ITEM_STAMPS)
TIMELINE_STRIDE = len(TIMELINE_PHASES) + 1 + TIMELINE_ITEMS * TIMELINE_ITEM_WORDS
TIMELINE_ITEM_TAG = 32  # an item's tag: layer << 32 | its index among the layer's items


def _camel(name: str) -> str:
    return "".join(w[:1].upper() + w[1:] for w in name.split("_"))


def timeline_header_lines() -> list[str]:
    return [
        "// The fused kernel's timeline build (contract.py TIMELINE_*, kernel/common/timeline.cuh): the rows of",
        "// megamoe_timeline, one per CTA: its phases' stamps, its item count, then its items' tags and stamps.",
        "enum TimelinePhase : int {",
        *[f"  kTl{_camel(n)} = {i},  // {d}" for i, (n, d) in enumerate(TIMELINE_PHASES)],
        f"  kTlPhases = {len(TIMELINE_PHASES)},",
        "};",
        "enum TimelineItemStamp : int {",
        *[f"  kTlItem{_camel(n)} = {i},  // {d}" for i, (n, d) in enumerate(TIMELINE_ITEM_STAMPS)],
        "};",
        f"constexpr int kTimelineItems = {TIMELINE_ITEMS}, kTimelineCtas = {TIMELINE_CTAS};",
        f"constexpr int kTimelineItemWords = {TIMELINE_ITEM_WORDS}, kTimelineStride = {TIMELINE_STRIDE};",
        f"constexpr int kTimelineItemTag = {TIMELINE_ITEM_TAG};   // tag = layer << kTimelineItemTag | index",
    ]


_CTYPE = {"int32": "int*", "int64": "int64_t*", "uint8": "uint8_t*", "float32": "float*", "bfloat16": "uint16_t*"}
_ITEMSIZE = {"int32": 4, "int64": 8, "uint8": 1, "float32": 4, "bfloat16": 2}

WORKSPACE = (
    Region(
        "signals",
        "int32",
        f"2, {SIGNAL_WORDS}",
        "counter",
        "per call parity (epoch & 1): dispatch posts, L2 completions (both raised by every rank's CTAs), "
        "CTAs done, CTAs that decoded their share of the weights (the prefill path); the last CTA of a call "
        "clears its parity",
        "parity, word",
    ),
    Region("arrivals", "int32", "B", "counter", "D4: rows pulled into each pool block"),
    Region("l1_done", "int32", "B", "counter", "D6: L1 warpgroup tiles written of each pool block (I/32 = complete)"),
    Region("epoch", "int32", "4", "local", "word 0: calls made on this workspace (selects the signals' parity)"),
    Region("peers", "int64", "R", "local", "byte offset from this rank's workspace to rank r's"),
    Region("send_counts", "int32", "E", "local", "D1", dump=DP.D1_SEND_COUNTS),
    Region(
        "recv_counts",
        "int32",
        "R, E_l",
        "peer",
        "D2: row s written by source rank s",
        "source, expert",
        dump=DP.D2_RECV_COUNTS,
    ),
    Region("recv_totals", "int32", "E_l", "local", "D2: N_e", dump=DP.D2_RECV_TOTALS),
    Region(
        "expert_offsets",
        "int32",
        "E_l + 1",
        "local",
        "D4: first pool row of each local expert, then P",
        dump=DP.D4_EXPERT_OFFSETS,
    ),
    Region(
        "source_lists",
        "int32",
        "E_l, R, T_max",
        "peer",
        "D3: t*K+k per (local expert, source), ascending",
        "expert, source, i",
        dump=DP.D3_SOURCE_LISTS,
    ),
    Region("stage_x", "uint8", "T_max, H", "peer", "this rank's x, read by the experts' owners (R > 1)", "t, channel"),
    Region("stage_x_sf", "uint8", "T_max, H // 32", "peer", "this rank's x_sf (R > 1)", "t, group"),
    Region("stage_weights", "float32", "T_max, K", "peer", "this rank's topk_weights (R > 1)", "t, k"),
    Region(
        "pool_x", "uint8", "P, H_pad", "local", "D4: pulled rows (E4M3), zero past H", "row, channel", dump=DP.D4_POOL_X
    ),
    Region(
        "pool_x_sf",
        "uint8",
        "P, H_pad // 32",
        "local",
        "D4: their scale bytes, zero past H / 32",
        "row, group",
        dump=DP.D4_POOL_X_SF,
    ),
    Region("pool_weights", "float32", "P", "local", "D4: their routing weights", dump=DP.D4_POOL_WEIGHTS),
    Region("pool_meta", "int32", "P, 3", "local", "D4: (source rank, token, slot)", "row, field", dump=DP.D4_POOL_META),
    Region("dst_rows", "int32", "P", "local", "combine row s * K * T_max + k * T_max + t of each pool row"),
    Region(
        "l2_acts",
        "uint8",
        "P, I_pad",
        "local",
        "D6: the E4M3 intermediate, zero past I",
        "row, channel",
        dump=DP.D6_L2_ACTS,
    ),
    Region(
        "l2_sf",
        "uint8",
        "P, I_pad // 32",
        "local",
        "D6: its scale bytes, zero past I / 32",
        "row, group",
        dump=DP.D6_L2_SF,
    ),
    Region(
        "pool_x128",
        "uint8",
        "P, H",
        "local",
        "fast mode: the pool's rows rebased per 128 (rebase_k128)",
        "row, channel",
    ),
    Region("pool_sf128", "uint8", "P, H // 128", "local", "fast mode: their scale bytes", "row, block"),
    Region(
        "l2_x128", "uint8", "P, I", "local", "fast mode: the intermediate rebased per 128, L2's operand", "row, channel"
    ),
    Region("l2_sf128", "uint8", "P, I // 128", "local", "fast mode: its scale bytes", "row, block"),
    Region(
        "rebase_count",
        "int32",
        "B, I // 128",
        "counter",
        "fast mode: L1 warpgroup tiles written of each (pool block, 128 channels); the 4th rebases them",
        "pool_block, block",
    ),
    Region(
        "combine",
        "bfloat16",
        "K, T_max, H",
        "peer",
        "D8: written by the experts' owners",
        "k, t, channel",
        dump=DP.D8_COMBINE,
    ),
    Region("recv_stats", "int64", "E_l", "local", "D10: cumulative N_e", dump=DP.D10_RECV_STATS),
    Region(
        "snap_arrivals", "int32", "B", "local", "debug build: arrivals before the cleanup", dump=DP.D4_BLOCK_ARRIVALS
    ),
    Region("snap_l1_done", "int32", "B", "local", "debug build: l1_done before the cleanup", dump=DP.D6_L1_DONE),
    Region(
        "item_counter",
        "int32",
        "2",
        "local",
        "the swap-AB and prefill engines' dynamic item order (GemmParams.item_counter): items claimed past the first"
        " gridDim.x, CTAs done claiming; zero between calls (a call's last claiming CTA zeroes it)",
    ),
)
COUNTERS = tuple(r.name for r in WORKSPACE if r.kind == "counter")
assert len(WORKSPACE) <= 64, "the generated WsRegion bits are one uint64_t"


def pool_rows(max_tokens: int, top_k: int, local_experts: int, num_ranks: int, block_m: int) -> int:
    """P: the pool's rows in the worst case over every routing of every rank (all their tokens sent
    here, each to min(K, E_l) of this rank's experts), each expert padded to BLOCK_M."""
    rows = num_ranks * max_tokens * min(top_k, local_experts) + local_experts * (block_m - 1)
    return max(block_m, -(-rows // block_m) * block_m)


def workspace_dims(cfg) -> dict[str, int]:
    """The sizes the regions' shapes are written in, for a MoEConfig: the configuration's (those
    of the dump tensors' shapes too, reference.points.config_dims) and the worst-case P and B."""
    p = pool_rows(cfg.max_tokens_per_rank, cfg.top_k, cfg.local_experts, cfg.num_ranks, cfg.block_m)
    pads = {"H_pad": padded_k(cfg.hidden), "I_pad": padded_k(cfg.intermediate)}
    return {**DP.config_dims(cfg), **pads, "P": p, "B": p // cfg.block_m}


def padded_k(size: int) -> int:
    """A reduction length (H for L1, I for L2) padded to whole K blocks: the row stride of the GEMMs'
    operands in the workspace and of the weights' kernel layout (SPEC §8: sizes in multiples of 32;
    the padding is the layout's, its codes and scale bytes zero)."""
    return -(-size // BLOCK_K) * BLOCK_K


def workspace_layout(cfg) -> tuple[dict[str, tuple[int, str, tuple[int, ...]]], int]:
    """{region: (byte offset, dtype, shape)} and the total bytes; every region 128-byte aligned
    (TMA reads the pool and the intermediate)."""
    dims = workspace_dims(cfg)
    out, off = {}, 0
    for r in WORKSPACE:
        shape = DP.shape_of(r.shape, dims, what=f"region {r.name}")
        out[r.name] = (off, r.dtype, shape)
        n = _ITEMSIZE[r.dtype]
        for d in shape:
            n *= d
        off += -(-n // 128) * 128
    return out, off


# The FusedParams field that holds each size the regions' shapes are written in: the host fills
# these fields from workspace_dims through this table (megamoe/launchers.py), and the generated accessors
# take their strides from them. B is only ever a leading dimension (no stride): it needs no field.
DIM_FIELDS = {
    "H": "hidden",
    "I": "intermediate",
    "E": "num_experts",
    "E_l": "local_experts",
    "K": "top_k",
    "R": "num_ranks",
    "T_max": "max_tokens",
    "P": "pool_rows",
    "H_pad": "hidden_pad",
    "I_pad": "intermediate_pad",
}
# The sizes that make a region larger than 2^31 elements at real shapes (tokens, pool rows,
# channels): the accessor of a region with one of them indexes in 64 bits, the others' in int.
WIDE_DIMS = ("T_max", "P", "H", "I", "H_pad", "I_pad")

FUSED_PARAMS = Struct(
    "FusedParams",
    (
        Field("l1", "struct", "GemmParams", "L1 over the pool (gate: arrivals; signals l1_done)"),
        Field("l2", "struct", "GemmParams", "L2 over l2_acts (gate: l1_done; rows to the tokens' ranks)"),
        Field("x", "ptr", "const uint8_t*", "this call's x [T, H] e4m3"),
        Field("x_sf", "ptr", "const uint8_t*", "x_sf [T, H/32]"),
        Field("topk_idx", "ptr", "const int64_t*", "[T, K], -1 = no expert"),
        Field("topk_weights", "ptr", "const float*", "[T, K]"),
        Field("y", "ptr", "uint16_t*", "bf16 [T, H] (D9)"),
        *(Field(f"ws_{r.name}", "ptr", _CTYPE[r.dtype], f"{r.shape}: {r.doc}") for r in WORKSPACE),
        Field("rank", "i32", "int32_t", "this rank"),
        Field("num_ranks", "i32", "int32_t", "R"),
        Field("num_tokens", "i32", "int32_t", "T of this call on this rank"),
        Field("max_tokens", "i32", "int32_t", "T_max"),
        Field("hidden", "i32", "int32_t", "H"),
        Field("intermediate", "i32", "int32_t", "I"),
        Field("num_experts", "i32", "int32_t", "E"),
        Field("local_experts", "i32", "int32_t", "E_l"),
        Field("top_k", "i32", "int32_t", "K"),
        Field("block_m", "i32", "int32_t", "pool rows per block (each expert starts on a multiple)"),
        Field("pool_rows", "i32", "int32_t", "P"),
        Field("record_stats", "i32", "int32_t", "add N_e to recv_stats (D10)"),
        Field("hidden_pad", "i32", "int32_t", "H padded to whole K blocks (padded_k): the pool's row stride"),
        Field("intermediate_pad", "i32", "int32_t", "I padded to whole K blocks: the intermediate's row stride"),
        Field(
            "weights_decoded",
            "i32",
            "int32_t",
            "1: l1 / l2.w_e4m3 hold the weights predecoded before the call (MegaMoE(predecoded=True)), so the "
            "prefill engine skips its predecode",
        ),
    ),
)
STRUCTS["FusedParams"] = FUSED_PARAMS


def _dims(r: Region) -> list[str]:
    return [d.strip() for d in r.shape.split(",")]


_SYMBOL = re.compile(r"[A-Za-z_]\w*")


def _cpp_dim(dim: str) -> str:
    """A shape dimension as a C++ expression over the sizes named as in SPEC (// is the integer
    division it is for these positive sizes)."""
    out = dim.replace("//", "/")
    return out if re.fullmatch(r"\w+", out) else f"({out})"


def accessor_lines(r: Region) -> list[str]:
    """The two accessors of a multi-dimensional region:
    ws_<name>_index(index..., sizes...): the element's index, row-major over the region's shape,
      given the sizes of its strides (named as in SPEC: R, T_max, H, ...); for a caller that holds
      them already (a kernel's `const int H = fp.hidden`: its register, not a second read) or that
      indexes a peer's copy (peer_ptr(fp, r, fp.ws_<name>)[ws_<name>_index(...)], fused/sync.cuh);
    ws_<name>(p, index...): a reference to the element in this rank's copy, the sizes read from
      FusedParams (DIM_FIELDS)."""
    dims, names = _dims(r), [n.strip() for n in r.index.split(",")]
    if len(names) != len(dims):
        raise ValueError(f"region {r.name}: index {r.index!r} names {len(names)} of {len(dims)} dimensions")
    sizes = list(dict.fromkeys(m for d in dims[1:] for m in _SYMBOL.findall(d)))
    missing = [m for m in sizes if m not in DIM_FIELDS]
    if missing:
        raise ValueError(f"region {r.name}: {missing} have no FusedParams field (DIM_FIELDS)")
    # Each index is below its dimension (an int); where the region can exceed 2^31 elements the
    # leading one is taken as int64_t, so the arithmetic is 64-bit from its first product.
    wide = any(m in WIDE_DIMS for d in dims for m in _SYMBOL.findall(d))
    itype = "int64_t" if wide else "int"
    flat = names[0]
    for dim, name in zip(dims[1:], names[1:]):
        flat = f"{flat if flat == names[0] else f'({flat})'} * {_cpp_dim(dim)} + {name}"
    params = [f"{itype} {names[0]}"] + [f"int {n}" for n in names[1:]] + [f"int {m}" for m in sizes]
    call = names + [f"p.{DIM_FIELDS[m]}" for m in sizes]
    return [
        f"// {r.name} [{', '.join(dims)}]",
        f"__device__ __forceinline__ {itype} ws_{r.name}_index({', '.join(params)}) {{",
        f"  return {flat};",
        "}",
        f"__device__ __forceinline__ {_CTYPE[r.dtype][:-1]}& ws_{r.name}(const FusedParams& p, "
        f"{', '.join(params[: len(names)])}) {{",
        f"  return p.ws_{r.name}[ws_{r.name}_index({', '.join(call)})];",
        "}",
    ]


def _region_bit(name: str) -> str:
    return "kWs" + _camel(name)


def fused_header_lines() -> list[str]:
    return [
        "// The fused kernel (kernel/fused/): its token tile, the signal words of each call parity, and",
        "// its argument (one pointer per workspace region, megamoe/jit/contract.py WORKSPACE, and the sizes",
        "// its shapes are written in, DIM_FIELDS).",
        f"constexpr int kFusedMaxN = {FUSED_MAX_TILE};",
        f"constexpr int kSignalWords = {SIGNAL_WORDS};",
        f"constexpr int kSignalPosted = {SIGNAL_POSTED};   // + 1 by every CTA of every rank after its dispatch",
        f"constexpr int kSignalL2Done = {SIGNAL_L2_DONE};   // + 1 by every CTA of every rank after its L2 tiles",
        f"constexpr int kSignalExit = {SIGNAL_EXIT};     // + 1 by every CTA of this rank at its end",
        f"constexpr int kSignalDecoded = {SIGNAL_DECODED};  // + 1 by every CTA of this rank after its predecode share",
        f"constexpr int kLocalDispatchEntries = {LOCAL_DISPATCH_ENTRIES};   // R = 1, T K at most this: no dispatch counter",
        "",
        *FUSED_PARAMS.cpp(),
        "",
        "// The workspace's multi-dimensional regions (contract.py WORKSPACE), row-major over their shapes:",
        "// ws_<region>_index(index..., sizes...) the element's index given the sizes of its strides (a caller's",
        "// registers, or a peer's copy: peer_ptr(fp, r, fp.ws_<region>)[index]), ws_<region>(p, index...) a",
        "// reference to it in this rank's copy, the sizes read from FusedParams. An index is 64-bit where a",
        "// dimension counts tokens, pool rows or channels (WIDE_DIMS), else int.",
        *[line for r in WORKSPACE if len(_dims(r)) > 1 for line in accessor_lines(r)],
        "",
        '// The workspace\'s regions as bits, and its counters (kind "counter": zero after every call, D10).',
        "// The kernel static_asserts that it clears exactly these (kernel/fused/combine.cuh).",
        "enum WsRegion : uint64_t {",
        *[f"  {_region_bit(r.name)} = 1ull << {i}," for i, r in enumerate(WORKSPACE)],
        "};",
        f"constexpr uint64_t kWsCounters = {' | '.join(_region_bit(n) for n in COUNTERS)};",
    ]


def header() -> str:
    """The text of kernel/gemm/contract.cuh."""
    lut = Q.scaled_fp4_lut()
    lines = [
        "// GENERATED by megamoe/jit/contract.py (python -m megamoe.jit.contract): do not edit by hand.",
        "// clang-format off",
        "// What the host and the kernel agree on: the kernel argument, shared constants, the promotions, trap",
        "// codes, the fast mode's scaled FP4 lookup tables and the fused kernel's workspace accessors.",
        "#pragma once",
        "",
        "#include <cstddef>",
        "#include <cstdint>",
        "#include <cuda.h>",
        "",
        "namespace megamoe {",
        "",
        f"constexpr int kBlockK = {BLOCK_K};        // K per pipeline stage",
        f"constexpr int kChunkN = {CHUNK_N};         // tokens per wgmma chunk of the wide token tiles",
        f"constexpr int kMaxExperts = {MAX_EXPERTS};",
        f"constexpr int kSmemLimit = {SMEM_LIMIT};  // dynamic shared memory per block (sm_90 opt-in)",
        f"constexpr int kMaxStages = {MAX_STAGES};",
        f"constexpr int kRowsPerWg = {ROWS_PER_WG};      // weight rows per consumer warpgroup (wgmma M)",
        "// A kernel's items run at kSmallTile when they have at most that many rows, else at its largest",
        "// tile kMaxN (scheduler.cuh pick_tile; the host picks kMaxN from TOKEN_TILES).",
        f"constexpr int kSmallTile = {SMALL_TILE};",
        "// The GEMM's promotions (contract.py PROMOTIONS): the instantiation units name one, and the kernels'",
        "// templates take it as the bool kPerK32 = per_k32(promotion).",
        f"enum class Promotion : int {{ {', '.join(f'{p} = {i}' for i, p in enumerate(PROMOTIONS))} }};",
        "__host__ __device__ constexpr bool per_k32(Promotion p) { return p == Promotion::k32; }",
        "",
        "// The largest token tile of each promotion (exact k32, fast k128), and with four consumer warpgroups.",
        f"constexpr int kMaxTileExact = {MAX_TILE['k32']}, kMaxTileFast = {MAX_TILE['k128']};",
        f"constexpr int kMaxWgs4TileExact = {MAX_WGS4_TILE['k32']}, kMaxWgs4TileFast = {MAX_WGS4_TILE['k128']};",
        "// The prefill path's CTA tile of each promotion (contract.py PREFILL_TOKENS, PREFILL_ROWS: 64 tokens a",
        "// consumer warpgroup, wgmmas of 128 rows) and its predecoded weight tile's bytes (exact: + fp32 scales).",
        "template <bool kPerK32>",
        "struct PrefillShape {",
        f"  static constexpr int kTokens = kPerK32 ? {PREFILL_TOKENS['k32']} : {PREFILL_TOKENS['k128']};",
        f"  static constexpr int kRows = kPerK32 ? {PREFILL_ROWS['k32']} : {PREFILL_ROWS['k128']};",
        f"  static constexpr int kTile = kPerK32 ? {PREFILL_TILE_BYTES['k32']} : {PREFILL_TILE_BYTES['k128']};",
        "  static constexpr int kWgs = kTokens / 64;",
        "  static constexpr int kConsumers = 128 * kWgs;",
        "  static constexpr int kHalves = kRows / 128;",
        "};",
        "",
        "// Trap record codes (megamoe.gemm.timeout_message).",
        "enum WaitKind : int {",
        *[f"  kWait{WAIT_NAMES[code]} = {code},  // {name}" for code, name in WAITS.items()],
        f"  kLayoutCheck = {LAYOUT_CHECK},  // the launch's dynamic shared memory is smaller than the layout",
        "};",
        "",
        f"// Fast mode (promotion k128): entry d = E4M3 codes of the E2M1 magnitudes x 2^({LUT_HEADROOM} - d),",
        "// as the (lo, hi) prmt table pair (bytes 0-3: magnitudes 0, 0.5, 1, 1.5; bytes 4-7: 2, 3, 4, 6).",
        f"constexpr int kLutEntries = {LUT_ENTRIES}, kLutHeadroom = {LUT_HEADROOM};",
        _table("uint32_t", "scaled_lut_lo", [_word(lut[d, :4]) for d in range(LUT_ENTRIES)]),
        _table("uint32_t", "scaled_lut_hi", [_word(lut[d, 4:]) for d in range(LUT_ENTRIES)]),
        "",
        "// The trap record a timed-out wait writes (kernel/common/ptx.cuh report_trap).",
        *TRAP_RECORD.cpp(),
        "",
        "// The GEMM's argument, passed by value as one __grid_constant__ struct.",
        *GEMM_PARAMS.cpp(),
        "",
        *fused_header_lines(),
        "",
        *timeline_header_lines(),
        "",
        "}  // namespace megamoe",
        "",
    ]
    return "\n".join(lines)


def _table(ctype: str, name: str, values: list[str]) -> str:
    """A constant table as a constexpr function (device code cannot index a constexpr array); called
    with compile-time indices it folds to an immediate."""
    chain = " : ".join(f"i == {i} ? {v}" for i, v in enumerate(values[:-1])) + f" : {values[-1]}"
    return f"__host__ __device__ constexpr {ctype} {name}(int i) {{ return {chain}; }}"


def _word(b) -> str:
    v = sum(int(x) << (8 * i) for i, x in enumerate(b.tolist()))
    return f"0x{v:08X}u"


def header_path() -> Path:
    from megamoe.kernel import KERNEL_DIR

    return KERNEL_DIR / "gemm" / "contract.cuh"


def main(argv: list[str] | None = None) -> int:
    """python -m megamoe.jit.contract --check | --write; without either, its usage (exit 2): a
    command that rewrites a source file does so only when asked."""
    parser = argparse.ArgumentParser(
        prog="python -m megamoe.jit.contract",
        description="kernel/gemm/contract.cuh, the C++ side of the host <-> kernel contract, is generated "
        "from megamoe/jit/contract.py: check that the committed file is what it generates, or write it.",
    )
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument(
        "--check", action="store_true", help="exit 1 if the committed header is stale, naming it; 0 if it is current"
    )
    mode.add_argument("--write", action="store_true", help="write the header from this module")
    args = parser.parse_args(argv)
    path = header_path()
    if args.check:
        if not path.is_file() or path.read_text() != header():
            print(f"{path} is stale: run python -m megamoe.jit.contract --write")
            return 1
        print(f"{path} is current")
        return 0
    if args.write:
        path.write_text(header())
        print(f"wrote {path}")
        return 0
    parser.error("choose --check or --write")


if __name__ == "__main__":
    sys.exit(main())
