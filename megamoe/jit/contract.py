"""What the host and the SM90 GEMM kernel must agree on, written once: the kernel's parameter struct,
its shared constants, the fast mode's scaled FP4 lookup table and the trap codes.

`kernel/gemm/contract.cuh` is generated from this module (`python -m megamoe.jit.contract`
rewrites it; a CPU test fails when the committed header differs from what this module generates),
and `pack_params` writes the struct's bytes from the same field list, so a field added, moved or
retyped here moves on both sides at once. The C++ side pins every offset with a static_assert.
"""

from __future__ import annotations

import dataclasses
import struct
from pathlib import Path

from megamoe.reference import quantize as Q

BLOCK_K = 128  # K per pipeline stage (four k32 wgmma steps)
CHUNK_N = 64  # tokens per wgmma chunk of the wide token tiles
TOKEN_TILES = (8, 16, 32, 64, 128)  # a kernel's largest token tile kMaxN (wgmma N, or chunks of 64)
SMALL_TILE = 8  # every kernel runs items of at most this many rows at this tile
MAX_EXPERTS = 256  # local experts of one launch (the schedule's shared-memory tables)
SMEM_LIMIT = 232448  # sm_90 opt-in dynamic shared memory per block
MAX_STAGES = 12
ROWS_PER_WG = 64  # weight rows per consumer warpgroup (wgmma M)

# Trap record codes (kernel/common/ptx.cuh report_trap; megamoe.gemm.timeout_message words them).
WAITS = {1: "full stage barrier", 2: "empty stage barrier", 3: "arrival counter of pool block"}
LAYOUT_CHECK = 4  # the launch's dynamic shared memory is smaller than the kernel's layout

# The fast mode's scaled FP4 -> E4M3 tables: one definition, in the reference.
LUT_ENTRIES = Q.FAST_LUT_ENTRIES
LUT_HEADROOM = Q.FAST_LUT_HEADROOM


@dataclasses.dataclass(frozen=True)
class Field:
    name: str
    kind: str  # "tmap" (CUtensorMap, 128 B), "ptr", "i32", "f32"
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
    Field("w_row_base", "ptr", "const uint8_t*", "promotion k128: [E, R] base scale byte B_r of each weight row"),
    Field("w_expert_base", "ptr", "const uint8_t*", "promotion k128: [E] largest row base of each expert"),
    Field("x_sf", "ptr", "const uint8_t*", "activation scale bytes: k32 [P, K/32]; k128 [P, K/128] (rebase_k128)"),
    Field("expert_offsets", "ptr", "const int*", "[E + 1] first pool row of each expert"),
    Field("num_tokens", "ptr", "const int*", "[E] valid pool rows of each expert"),
    Field("w_route", "ptr", "const float*", "L1: [P] routing weight of each pool row"),
    Field("out", "ptr", "void*", "L1: l2_acts e4m3 [P, I]; L2: combine rows bf16 [*, H]"),
    Field("out_sf", "ptr", "uint8_t*", "L1: l2_sf [P, I/32]"),
    Field("dst_rows", "ptr", "const int*", "L2: [P] combine row of each pool row, < 0 = none"),
    Field("dump", "ptr", "float*", "debug build: fp32 accumulators [P, R], canonical channel order"),
    Field("arrival", "ptr", "const int*", "per pool block arrival counters, nullptr = all rows present"),
    Field("err", "ptr", "int*", "trap record (host-mapped), nullptr = trap without a record"),
    Field("num_experts", "i32", "int32_t", "E"),
    Field("num_pool_rows", "i32", "int32_t", "P"),
    Field("k", "i32", "int32_t", "reduction length: H (L1) or I (L2)"),
    Field("n_rows", "i32", "int32_t", "weight rows R: 2I (L1) or H (L2)"),
    Field("arrival_block", "i32", "int32_t", "pool rows per arrival counter"),
    Field("has_clamp", "i32", "int32_t", "L1: apply clamp_value"),
    Field("clamp_value", "f32", "float", "L1: bf16-representable activation clamp c"),
)

_SIZE = {"tmap": 128, "ptr": 8, "i32": 4, "f32": 4}
_ALIGN = {"tmap": 128, "ptr": 8, "i32": 4, "f32": 4}  # CUtensorMap is 128-byte aligned (CUDA 13)
_FMT = {"ptr": "<Q", "i32": "<i", "f32": "<f"}


def _layout() -> tuple[dict[str, int], int]:
    offsets, off = {}, 0
    for f in PARAMS:
        off = -(-off // _ALIGN[f.kind]) * _ALIGN[f.kind]
        offsets[f.name] = off
        off += _SIZE[f.kind]
    return offsets, -(-off // 128) * 128


OFFSETS, PARAMS_BYTES = _layout()


def pack_params(**values) -> bytes:
    """The bytes of GemmParams: every field by name (tensor maps as their 128 bytes, pointers as ints,
    0 for nullptr)."""
    missing = {f.name for f in PARAMS} - values.keys()
    extra = values.keys() - {f.name for f in PARAMS}
    if missing or extra:
        raise KeyError(f"GemmParams fields: missing {sorted(missing)}, unknown {sorted(extra)}")
    buf = bytearray(PARAMS_BYTES)
    for f in PARAMS:
        v = values[f.name]
        if f.kind == "tmap":
            assert len(v) == 128, f.name
            buf[OFFSETS[f.name] : OFFSETS[f.name] + 128] = v
        else:
            struct.pack_into(_FMT[f.kind], buf, OFFSETS[f.name], v)
    return bytes(buf)


def header() -> str:
    """The text of kernel/gemm/contract.cuh."""
    lut = Q.scaled_fp4_lut()
    lines = [
        "// GENERATED by megamoe/jit/contract.py (python -m megamoe.jit.contract): do not edit by hand.",
        "// clang-format off",
        "// What the host and the kernel agree on: the kernel argument, shared constants, trap codes and",
        "// the fast mode's scaled FP4 lookup tables.",
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
        "",
        "// Trap record codes (megamoe.gemm.timeout_message).",
        "enum WaitKind : int {",
        *[
            f"  kWait{''.join(w.title() for w in name.split()[:1])} = {code},  // {name}"
            for code, name in WAITS.items()
        ],
        f"  kLayoutCheck = {LAYOUT_CHECK},  // the launch's dynamic shared memory is smaller than the layout",
        "};",
        "",
        f"// Fast mode (promotion k128): entry d = E4M3 codes of the E2M1 magnitudes x 2^({LUT_HEADROOM} - d),",
        "// as the (lo, hi) prmt table pair (bytes 0-3: magnitudes 0, 0.5, 1, 1.5; bytes 4-7: 2, 3, 4, 6).",
        f"constexpr int kLutEntries = {LUT_ENTRIES};",
        _table("uint32_t", "scaled_lut_lo", [_word(lut[d, :4]) for d in range(LUT_ENTRIES)]),
        _table("uint32_t", "scaled_lut_hi", [_word(lut[d, 4:]) for d in range(LUT_ENTRIES)]),
        "",
        "// The kernel argument, passed by value as one __grid_constant__ struct.",
        "struct GemmParams {",
    ]
    for f in PARAMS:
        lines.append(f"  {f.ctype} {f.name};  // {f.doc}")
    lines.append("};")
    lines.append("")
    for f in PARAMS:
        lines.append(f'static_assert(offsetof(GemmParams, {f.name}) == {OFFSETS[f.name]}, "GemmParams layout");')
    lines.append(f'static_assert(sizeof(GemmParams) == {PARAMS_BYTES}, "GemmParams layout");')
    lines += ["", "}  // namespace megamoe", ""]
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


if __name__ == "__main__":
    header_path().write_text(header())
    print(f"wrote {header_path()}")
