// FP4 (E2M1) -> E4M3 decode in registers with a byte lookup (prmt).
//
// The kernel layout of the weights (megamoe/jit/layout.py) stores, per 32-bit word, the eight
// E2M1 codes of two wgmma A-fragment registers Ra (codes a0..a3) and Rb (codes b0..b3):
//   nibble n (n = 0..7), bits 0-2: magnitude of a_n (n < 4) or of b_(n-4) (n >= 4);
//   nibble n, bit 3:              sign of a_(n/2) (n even) or of b_((n-1)/2) (n odd).
// So the masked word is directly the prmt selector (low half for Ra, high half for Rb), and the
// sign of output byte i sits at bit 8i+3 (Ra; shift left 4 to reach bit 8i+7) or at bit 8i+7 (Rb).
#pragma once

#include <cstdint>

#include "../common/ptx.cuh"

namespace megamoe {

// E4M3 bytes of the E2M1 magnitudes {0, 0.5, 1, 1.5 | 2, 3, 4, 6}.
constexpr uint32_t kFp4LutLo = 0x3C383000u;
constexpr uint32_t kFp4LutHi = 0x4C484440u;

__device__ __forceinline__ void decode_fp4x8(uint32_t w, uint32_t lut_lo, uint32_t lut_hi,
                                             uint32_t& ra, uint32_t& rb) {
  const uint32_t sel = w & 0x77777777u;
  ra = ptx::prmt(lut_lo, lut_hi, sel) | ((w << 4) & 0x80808080u);
  rb = ptx::prmt(lut_lo, lut_hi, sel >> 16) | (w & 0x80808080u);
}

// Two lookup tables: Ra (row g) through LUT a, Rb (row g + 8) through LUT b (the fast mode folds
// each row's per-32 weight scale offset into its LUT).
__device__ __forceinline__ void decode_fp4x8_2lut(uint32_t w, uint2 lut_a, uint2 lut_b, uint32_t& ra,
                                                  uint32_t& rb) {
  const uint32_t sel = w & 0x77777777u;
  ra = ptx::prmt(lut_a.x, lut_a.y, sel) | ((w << 4) & 0x80808080u);
  rb = ptx::prmt(lut_b.x, lut_b.y, sel >> 16) | (w & 0x80808080u);
}

// Number of scaled LUTs of the fast mode: entry d (0..kLutEntries-1) holds
// E4M3_RNE(fp4 magnitude x 2^-d); exact for d <= 8, rounded to the E4M3 subnormal grid for
// 9 <= d <= 15, all zero for d >= 16 (every FP4 value x 2^-16 rounds to 0).
constexpr int kLutEntries = 17;

}  // namespace megamoe
