// The predecode pass of the prefill path: every FP4 weight of a layer decoded once per call, written
// as the prefill kernel's weight tiles (gemm_sm90_prefill.cuh: [E, K/128, R/rows] tiles of one
// expert, K block and PrefillShape's rows, each one bulk copy: prefill_blocks; PrefillShape::kTile
// bytes). Decoding inside the
// prefill kernel instead costs more than half the tensor rate (bench/NOTES.md v14); here it costs
// 1.5 bytes of HBM traffic per weight (the exact mode's two-scale blocks ~1.66: their scale bytes in,
// fp32 scales out).
//   Fast mode (k128): the E4M3 bytes the scaled tables give (fp4_decode.cuh), [256][128] with the
//     128-byte swizzle.
//   Exact mode (k32), a block of 128 rows that folds (p.w_fold, megamoe/jit/layout.py fold_blocks:
//     every row's scales within 11 binades of its base): the fast mode's bytes, its LUT offsets
//     8 (B_r - s_g) made here from the scale bytes; the tile's last 2 KB are not written.
//   Exact mode, other blocks: the same layout through the plain table (the E2M1 values
//     themselves), then the rows' per-32 scales as fp32, [4 k32 steps][128 rows] in the order the
//     prefill consumers read them (prefill_wsf_index): 2 KB more a tile, so the kernel's promotion
//     multiplies two fp32 scales and converts nothing.
//
// One warp per 16-row group of one K block: its 1024 packed bytes (the kernel layout) and the LUT
// offsets (or scale bytes) of its rows in, 2 KB out (two swizzle atoms, contiguous in the tile),
// staged in shared memory so that the global stores are whole 16-byte vectors.
#pragma once

#include <cstdint>

#include "../common/ptx.cuh"
#include "../common/ue8m0.cuh"
#include "contract.cuh"
#include "fp4_decode.cuh"
#include "scheduler.cuh"

namespace megamoe {

// A layer's blocks of PrefillShape's rows (the prefill kernel's CTA tile, and its predecoded tiles'
// height): whole, the rows padded to 128 (layout.py padded_rows) and the fast mode's sizes multiples
// of 512.
template <bool kPerK32>
__device__ __forceinline__ int prefill_blocks(const GemmParams& p) {
  return row_blocks<PrefillShape<kPerK32>::kRows>(p);
}

constexpr int kPredecodeWarps = 8;
constexpr int kPredecodeThreads = 32 * kPredecodeWarps;
constexpr int kPredecodeSmemBytes = kLutEntries * 8 + kPredecodeWarps * 2048;

// The place of weight row n's (of the tile's kRows) fp32 scale of k32 step ks among the exact tile's
// 4 kRows: consumer thread t of the prefill kernel holds rows 128 h + 8 j + 2 t + c (j < 16, c < 2)
// of half h, those of one step and half as eight 16-byte vectors (j = 2 i, 2 i + 1; a 64-row step
// reads four of them), the four threads t side by side (64 contiguous bytes: no bank conflicts; the
// lanes of one t read the same words).
template <int kRows>
__host__ __device__ constexpr int prefill_wsf_index(int ks, int n) {
  return (((ks * (kRows / 128) + (n >> 7)) * 8 + ((n >> 4) & 7)) * 4 + ((n >> 1) & 3)) * 4 + ((n >> 3) & 1) * 2 +
         (n & 1);
}

// The scaled tables' byte offsets 8 d of a row's four k32 groups, d = B_r - s_g (<= 11 where the
// host's fold flag is set, layout.py fold_blocks), from its base and scale bytes; each d is taken as
// |B_r - s_g| and clamped to the last table, so flags that do not match the scales cannot index
// past the tables.
__device__ __forceinline__ uint32_t fold_offsets(uint32_t row_base, uint32_t scale_bytes) {
  return __vminu4(__vabsdiffu4(row_base * 0x01010101u, scale_bytes), (kLutEntries - 1) * 0x01010101u) << 3;
}

// What one lane reads of a row group: its 32 packed bytes, its rows' LUT offsets (or the plain
// table's), and in the exact mode's two-scale blocks its row's two scale bytes. Loaded apart from
// the decode so that a warp can keep several groups' loads in flight (the fused kernel's phase:
// twelve warps an SM, each one group at a time, were latency-bound).
struct PredecodeIn {
  uint4 lo, hi;
  uint32_t off_a, off_b;
  uint32_t scale_bytes;   // exact mode, blocks that do not fold
  bool fold;
};

// One warp's loads of row group `grp` of the layer ((expert, K block) major, then the 16-row groups
// of R; the kernel layout keeps a K block's groups contiguous, 1024 bytes each, and the tiles do
// too, 2048 bytes each).
template <bool kPerK32>
__device__ __forceinline__ PredecodeIn predecode_load(const GemmParams& p, int64_t grp, int lane) {
  const int64_t row0 = grp * 16 % p.n_rows;    // first row of the group within R
  const int64_t ekb = grp * 16 / p.n_rows;     // expert * K/128 + kb
  const uint8_t* w_frag = p.w + grp * 1024;
  const int row_a = static_cast<int>(row0) + lane / 4;
  const uint8_t* offs = p.w_sf + (ekb * p.n_rows) * 4;
  const int n_rb = prefill_blocks<kPerK32>(p);
  const int64_t expert = ekb / (p.k / kBlockK);
  PredecodeIn in;
  in.lo = *reinterpret_cast<const uint4*>(w_frag + lane * 16);
  in.hi = *reinterpret_cast<const uint4*>(w_frag + 512 + lane * 16);
  // Exact mode: w_sf holds the scale bytes s_g. A folded block: the offsets 8 (B_r - s_g) of the
  // fast mode (fold_offsets); else the plain table.
  in.fold = kPerK32 && __ldg(p.w_fold + expert * n_rb + row0 / PrefillShape<kPerK32>::kRows) != 0;
  in.scale_bytes = 0;
  if (!kPerK32) {
    in.off_a = __ldg(reinterpret_cast<const uint32_t*>(offs + row_a * 4));
    in.off_b = __ldg(reinterpret_cast<const uint32_t*>(offs + (row_a + 8) * 4));
  } else if (in.fold) {
    const uint8_t* base = p.w_row_base + expert * p.n_rows;
    in.off_a = fold_offsets(__ldg(base + row_a), __ldg(reinterpret_cast<const uint32_t*>(offs + row_a * 4)));
    in.off_b = fold_offsets(__ldg(base + row_a + 8), __ldg(reinterpret_cast<const uint32_t*>(offs + (row_a + 8) * 4)));
  } else {
    in.off_a = in.off_b = kPlainLutOffsets;
    // Lane l: row l / 2 of the group, k32 steps 2 (l % 2) and 2 (l % 2) + 1.
    in.scale_bytes = __ldg(reinterpret_cast<const uint16_t*>(offs + (row0 + lane / 2) * 4 + 2 * (lane % 2)));
  }
  return in;
}

// One warp: row group `grp` decoded from its loads, staged in `mine` (2048 bytes of shared memory)
// through the tables at `lut`, and written out as its tile's 2 KB.
template <bool kPerK32>
__device__ __forceinline__ void predecode_store(const GemmParams& p, int64_t grp, const PredecodeIn& in, uint8_t* mine,
                                                const uint8_t* lut, int lane) {
  using Shape = PrefillShape<kPerK32>;
  const int64_t row0 = grp * 16 % p.n_rows;
  const int64_t ekb = grp * 16 / p.n_rows;
  decode_rows16_sw128(in.lo, in.hi, lane, in.off_a, in.off_b, lut, ptx::smem_addr(mine));
  __syncwarp();
  // Out: the tile of (expert, kb, row0 / rows) holds this group at (row0 % rows) / 16 * 2048.
  uint8_t* tile = p.w_e4m3 + (ekb * prefill_blocks<kPerK32>(p) + row0 / Shape::kRows) * Shape::kTile;
  uint8_t* dst = tile + (row0 % Shape::kRows) / 16 * 2048;
  for (int i = lane; i < 128; i += 32) reinterpret_cast<uint4*>(dst)[i] = reinterpret_cast<const uint4*>(mine)[i];
  if (kPerK32 && !in.fold) {
    const int n = static_cast<int>(row0 % Shape::kRows) + lane / 2;
    const int ks = 2 * (lane % 2);
    float* wsf = reinterpret_cast<float*>(tile + Shape::kRows * kBlockK);
    wsf[prefill_wsf_index<Shape::kRows>(ks, n)] = ue8m0_to_float(in.scale_bytes & 0xFFu);
    wsf[prefill_wsf_index<Shape::kRows>(ks + 1, n)] = ue8m0_to_float(in.scale_bytes >> 8);
  }
  __syncwarp();   // the staging is rewritten by the warp's next group
}

// The scaled tables into shared memory (kLutEntries x 8 bytes), by the first kLutEntries threads.
__device__ __forceinline__ void stage_scaled_luts(uint8_t* lut) {
  if (threadIdx.x < kLutEntries)
    reinterpret_cast<uint2*>(lut)[threadIdx.x] = make_uint2(scaled_lut_lo(threadIdx.x), scaled_lut_hi(threadIdx.x));
}

// The standalone pass: one warp per group. Grid: (E * K/128 * R/16) / kPredecodeWarps blocks (R a
// multiple of 128, the kernel layout's row tiles, so it divides); the prefill path's, and a fused
// layer's made with predecoded=True (megamoe/launchers.py FusedLauncher.predecode: its own k and rows).
template <bool kPerK32>
__device__ __forceinline__ void predecode_body(const GemmParams& p) {
  extern __shared__ __align__(1024) uint8_t smem[];
  uint8_t* stage = smem;                              // [warps][2048]
  uint8_t* lut = smem + kPredecodeWarps * 2048;       // the scaled tables
  stage_scaled_luts(lut);
  __syncthreads();
  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  const int64_t grp = static_cast<int64_t>(blockIdx.x) * kPredecodeWarps + warp;
  predecode_store<kPerK32>(p, grp, predecode_load<kPerK32>(p, grp, lane), stage + warp * 2048, lut, lane);
}

}  // namespace megamoe
