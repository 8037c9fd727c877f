// FP4 (E2M1) -> E4M3 decode in registers with a byte lookup (prmt): the wgmma A fragments of one
// consumer warp (16 weight rows) for one K128 stage.
//
// The kernel layout of the weights (megamoe/jit/layout.py) stores, per 32-bit word, the eight
// E2M1 codes of two wgmma A-fragment registers Ra (codes a0..a3) and Rb (codes b0..b3):
//   nibble n (n = 0..7), bits 0-2: magnitude of a_n (n < 4) or of b_(n-4) (n >= 4);
//   nibble n, bit 3:              sign of a_(n/2) (n even) or of b_((n-1)/2) (n odd).
// So the masked word is directly the prmt selector (low half for Ra, high half for Rb), and the
// sign of output byte i sits at bit 8i+3 (Ra; shift left 4 to reach bit 8i+7) or at bit 8i+7 (Rb).
// Lane l of the warp finds its four k32 steps' words in two 16-byte vectors, at 16 l and 512 + 16 l
// of the warp's 1024-byte block.
#pragma once

#include <cstdint>

#include "../common/ptx.cuh"
#include "contract.cuh"

namespace megamoe {

// E4M3 bytes of the E2M1 magnitudes {0, 0.5, 1, 1.5 | 2, 3, 4, 6}: the exact mode's table (entry
// FAST_LUT_HEADROOM of the scaled tables).
constexpr uint32_t kFp4LutLo = 0x3C383000u;
constexpr uint32_t kFp4LutHi = 0x4C484440u;
static_assert(scaled_lut_lo(6) == kFp4LutLo && scaled_lut_hi(6) == kFp4LutHi, "entry 6 of the scaled tables is 2^0");
// Four k32 groups' LUT byte offsets (8 d each) all naming entry 6: the plain table through the
// scaled tables' path (the exact mode's predecode pass).
constexpr uint32_t kPlainLutOffsets = 0x30303030u;

// Ra through table a, Rb through table b (the fast mode gives rows g and g + 8 their own tables).
__device__ __forceinline__ void decode_fp4x8(uint32_t w, uint2 lut_a, uint2 lut_b, uint32_t& ra, uint32_t& rb) {
  const uint32_t sel = w & 0x77777777u;
  ra = ptx::prmt(lut_a.x, lut_a.y, sel) | ((w << 4) & 0x80808080u);
  rb = ptx::prmt(lut_b.x, lut_b.y, sel >> 16) | (w & 0x80808080u);
}

// The A fragments of the stage's four k32 steps (steps 0-1 come from the first 16-byte vector, 2-3
// from the second). w_frag: the warp's 1024-byte block in the stage.
//
// Exact mode (promotion k32): the plain table; the scales are applied in fp32 after each k32 step.
// lut_lo: kFp4LutLo, from the caller (mainloop.cuh says why it passes it as a variable).
__device__ __forceinline__ void decode_stage_plain(const uint8_t* w_frag, int lane, uint32_t (&a)[4][4],
                                                   uint32_t lut_lo) {
  const uint2 lut = make_uint2(lut_lo, kFp4LutHi);
#pragma unroll
  for (int ks = 0; ks < 4; ++ks) {
    const uint4 v = *reinterpret_cast<const uint4*>(w_frag + (ks < 2 ? 0 : 512) + lane * 16);
    decode_fp4x8((ks & 1) ? v.z : v.x, lut, lut, a[ks][0], a[ks][1]);
    decode_fp4x8((ks & 1) ? v.w : v.y, lut, lut, a[ks][2], a[ks][3]);
  }
}

// Fast mode (promotion k128): each k32 group of rows g and g + 8 through its scaled table.
// off_a / off_b: the rows' four LUT byte offsets (8 d per k32 group, megamoe/jit/layout.py);
// s_lut: the kLutEntries (lo, hi) pairs in shared memory.
__device__ __forceinline__ void decode_stage_scaled(const uint8_t* w_frag, int lane, uint32_t off_a, uint32_t off_b,
                                                    const uint8_t* s_lut, uint32_t (&a)[4][4]) {
#pragma unroll
  for (int ks = 0; ks < 4; ++ks) {
    const uint4 v = *reinterpret_cast<const uint4*>(w_frag + (ks < 2 ? 0 : 512) + lane * 16);
    const uint2 la = *reinterpret_cast<const uint2*>(s_lut + ptx::prmt(off_a, 0u, 0x4440u | ks));
    const uint2 lb = *reinterpret_cast<const uint2*>(s_lut + ptx::prmt(off_b, 0u, 0x4440u | ks));
    decode_fp4x8((ks & 1) ? v.z : v.x, la, lb, a[ks][0], a[ks][1]);
    decode_fp4x8((ks & 1) ? v.w : v.y, la, lb, a[ks][2], a[ks][3]);
  }
}

// A 16-row group of one K128 block (one warp's 1024-byte block of the kernel layout) decoded
// through the scaled tables to E4M3 in the K-major layout of a shared-memory wgmma operand with the
// 128-byte swizzle: two 8-row atoms of 1024 bytes at shared address dst (rows 0-7, then 8-15), row
// r's 16-byte chunk c at (r % 8) x 128 + ((c ^ (r % 8)) x 16). Register i of k32 step ks holds row
// g + 8 (i & 1), bytes 32 ks + 16 (i >> 1) + 4 t .. + 3 (the A fragment of decode_stage_scaled), so
// each lane stores 4-byte words; the chunks of a warp's 8 rows are a permutation: no bank conflicts.
// One k32 step at a time, each stored at once. Used by the predecode pass and the prefill probe.
// The lane's 32 packed bytes already loaded: lo = bytes 16 lane .. (k32 steps 0, 1), hi = 512 +
// 16 lane .. (steps 2, 3) of the group's 1024.
__device__ __forceinline__ void decode_rows16_sw128(uint4 lo, uint4 hi, int lane, uint32_t off_a, uint32_t off_b,
                                                    const uint8_t* s_lut, uint32_t dst) {
  const int g = lane / 4;
  const int t = lane % 4;
#pragma unroll
  for (int ks = 0; ks < 4; ++ks) {
    const uint4 w = ks < 2 ? lo : hi;
    const uint2 v = (ks & 1) ? make_uint2(w.z, w.w) : make_uint2(w.x, w.y);
    const uint2 la = *reinterpret_cast<const uint2*>(s_lut + ptx::prmt(off_a, 0u, 0x4440u | ks));
    const uint2 lb = *reinterpret_cast<const uint2*>(s_lut + ptx::prmt(off_b, 0u, 0x4440u | ks));
    uint32_t a[4];
    decode_fp4x8(v.x, la, lb, a[0], a[1]);
    decode_fp4x8(v.y, la, lb, a[2], a[3]);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int chunk = 2 * ks + (i >> 1);
      ptx::st_shared_u32(dst + (i & 1) * 1024 + g * 128 + ((chunk ^ g) << 4) + 4 * t, a[i]);
    }
  }
}

__device__ __forceinline__ void decode_rows16_sw128(const uint8_t* w_frag, int lane, uint32_t off_a, uint32_t off_b,
                                                    const uint8_t* s_lut, uint32_t dst) {
  decode_rows16_sw128(*reinterpret_cast<const uint4*>(w_frag + lane * 16),
                      *reinterpret_cast<const uint4*>(w_frag + 512 + lane * 16), lane, off_a, off_b, s_lut, dst);
}

}  // namespace megamoe
