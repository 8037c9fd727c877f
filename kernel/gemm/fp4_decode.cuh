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
#include "../common/ue8m0.cuh"

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

// Fast mode: thread d (< kLutEntries) of a CTA writes the scaled LUT d, the E4M3 bytes of the
// FP4 magnitudes x 2^-d (RNE, subnormals included), as the (lo, hi) prmt table pair.
__device__ __forceinline__ void init_scaled_lut(uint2* s_lut, int d) {
  const float mags[8] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f};
  uint32_t lo = 0, hi = 0;
#pragma unroll
  for (int c = 0; c < 4; ++c) {
    lo |= (static_cast<uint32_t>(ptx::cvt_e4m3x2(__fmul_rn(mags[c], exp2i(-d)), 0.0f)) & 0xFFu) << (8 * c);
    hi |= (static_cast<uint32_t>(ptx::cvt_e4m3x2(__fmul_rn(mags[c + 4], exp2i(-d)), 0.0f)) & 0xFFu) << (8 * c);
  }
  s_lut[d] = make_uint2(lo, hi);
}

// Fast mode: the wgmma A fragments of one 16-row group for one K128 stage, decoded with the
// per-32 weight scales folded in relative to the largest group of each (row, K128) block.
//   w_frag: the group's 1024 packed bytes in the stage (lane l's 32 bytes at 16 l and 512 + 16 l);
//   sf_a / sf_b: the four scale bytes of rows g and g + 8;
//   a[ks][0..3]: the A registers of k32 step ks; ma / mb: the largest scale byte of each row.
__device__ __forceinline__ void decode_fast_fragments(const uint8_t* w_frag, int lane, uint32_t sf_a, uint32_t sf_b,
                                                      const uint2* s_lut, uint32_t (&a)[4][4], uint32_t& ma,
                                                      uint32_t& mb) {
  const uint4 wv0 = *reinterpret_cast<const uint4*>(w_frag + lane * 16);
  const uint4 wv1 = *reinterpret_cast<const uint4*>(w_frag + 512 + lane * 16);
  ma = __vmaxu4(sf_a, sf_a >> 16);
  ma = __vmaxu4(ma, ma >> 8) & 0xFFu;
  mb = __vmaxu4(sf_b, sf_b >> 16);
  mb = __vmaxu4(mb, mb >> 8) & 0xFFu;
#pragma unroll
  for (int ks = 0; ks < 4; ++ks) {
    const uint32_t da = min(ma - ((sf_a >> (8 * ks)) & 0xFFu), static_cast<uint32_t>(kLutEntries - 1));
    const uint32_t db = min(mb - ((sf_b >> (8 * ks)) & 0xFFu), static_cast<uint32_t>(kLutEntries - 1));
    const uint2 la = s_lut[da];
    const uint2 lb = s_lut[db];
    const uint32_t w0 = ks == 0 ? wv0.x : ks == 1 ? wv0.z : ks == 2 ? wv1.x : wv1.z;
    const uint32_t w1 = ks == 0 ? wv0.y : ks == 1 ? wv0.w : ks == 2 ? wv1.y : wv1.w;
    decode_fp4x8_2lut(w0, la, lb, a[ks][0], a[ks][1]);
    decode_fp4x8_2lut(w1, la, lb, a[ks][2], a[ks][3]);
  }
}

}  // namespace megamoe
