// The predecode pass of the prefill path: every FP4 weight of a layer decoded once per call to the
// E4M3 bytes the fast mode's scaled tables give (fp4_decode.cuh), written as the prefill kernel's
// weight tiles (gemm_sm90_prefill.cuh: [E, K/128, R/256] tiles of 256 rows x 128 bytes, 128-byte
// swizzle, each one bulk copy). Decoding inside the prefill kernel instead costs more than half the
// tensor rate (bench/NOTES.md v14); here it costs 1.5 bytes of HBM traffic per weight.
//
// One warp per 16-row group of one K block: its 1024 packed bytes (the kernel layout) and the LUT
// offsets of its rows in, 2 KB out (two swizzle atoms, contiguous in the tile), staged in shared
// memory so that the global stores are whole 16-byte vectors.
#pragma once

#include <cstdint>

#include "../common/ptx.cuh"
#include "contract.cuh"
#include "fp4_decode.cuh"

namespace megamoe {

constexpr int kPredecodeWarps = 8;
constexpr int kPredecodeThreads = 32 * kPredecodeWarps;
constexpr int kPredecodeSmemBytes = kLutEntries * 8 + kPredecodeWarps * 2048;

// Grid: (E * K/128 * R/16) / kPredecodeWarps blocks (R % 256 == 0, so it divides).
__device__ __forceinline__ void predecode_body(const GemmParams& p) {
  extern __shared__ __align__(1024) uint8_t smem[];
  uint8_t* stage = smem;                              // [warps][2048]
  uint8_t* lut = smem + kPredecodeWarps * 2048;       // the scaled tables
  if (threadIdx.x < kLutEntries)
    reinterpret_cast<uint2*>(lut)[threadIdx.x] = make_uint2(scaled_lut_lo(threadIdx.x), scaled_lut_hi(threadIdx.x));
  __syncthreads();
  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  // Row group `grp` of the layer: (expert, K block) major, then the 16-row groups of R. The kernel
  // layout keeps a K block's groups contiguous (1024 bytes each), the tiles do too (2048 bytes).
  const int64_t grp = static_cast<int64_t>(blockIdx.x) * kPredecodeWarps + warp;
  const int64_t row0 = grp * 16 % p.n_rows;    // first row of the group within R
  const int64_t ekb = grp * 16 / p.n_rows;     // expert * K/128 + kb
  const uint8_t* w_frag = p.w + grp * 1024;
  const int row_a = static_cast<int>(row0) + lane / 4;
  const uint8_t* offs = p.w_sf + (ekb * p.n_rows) * 4;
  const uint32_t off_a = __ldg(reinterpret_cast<const uint32_t*>(offs + row_a * 4));
  const uint32_t off_b = __ldg(reinterpret_cast<const uint32_t*>(offs + (row_a + 8) * 4));
  // Decoded into the warp's staging (the packed bytes are read from global memory, as loaded),
  // then copied out as 16-byte vectors.
  uint8_t* mine = stage + warp * 2048;
  decode_rows16_sw128(w_frag, lane, off_a, off_b, lut, ptx::smem_addr(mine));
  __syncwarp();
  // Out: the tile of (expert, kb, row0 / 256) holds this group at (row0 % 256) / 16 * 2048.
  uint8_t* dst = p.w_e4m3 + (ekb * (p.n_rows / 256) + row0 / 256) * (256 * kBlockK) + (row0 % 256) / 16 * 2048;
  for (int i = lane; i < 128; i += 32) reinterpret_cast<uint4*>(dst)[i] = reinterpret_cast<const uint4*>(mine)[i];
}

}  // namespace megamoe
