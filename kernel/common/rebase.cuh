// The fast GEMM mode's activation operand (megamoe.reference.rebase_k128): per (row, 128-channel
// block) the four per-32 scale bytes give way to their largest, s_max, and every E4M3 payload of
// group g becomes e4m3_satfinite(RNE(value * 2^(s_g - s_max))), the product exact in fp32 (a
// power of two under 2^-149 is 0), rounded once by the conversion the reference models.
#pragma once

#include <cstdint>

#include "ptx.cuh"
#include "ue8m0.cuh"

namespace megamoe {

// The largest of the four scale bytes of a word.
__device__ __forceinline__ uint32_t max_byte4(uint32_t w) {
  const uint32_t a = max(w & 0xFFu, (w >> 8) & 0xFFu);
  const uint32_t b = max((w >> 16) & 0xFFu, w >> 24);
  return max(a, b);
}

// Two E4M3 codes (low byte first) times 2^-d, d >= 0.
__device__ __forceinline__ uint32_t rebase_e4m3x2(uint32_t two, float mult) {  // -> 16 bits
  uint32_t h2;
  asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(h2) : "h"(static_cast<uint16_t>(two)));
  float lo, hi;
  asm("{\n.reg .f16 l, h;\nmov.b32 {l, h}, %2;\ncvt.f32.f16 %0, l;\ncvt.f32.f16 %1, h;\n}"
      : "=f"(lo), "=f"(hi)
      : "r"(h2));
  return ptx::cvt_e4m3x2(__fmul_rn(lo, mult), __fmul_rn(hi, mult));
}

// 16 payload bytes of one group times 2^-d (d = s_max - s_g >= 0; d = 0 leaves them as they are).
__device__ __forceinline__ uint4 rebase_e4m3x16(uint4 v, int d) {
  if (d == 0) return v;
  const float mult = d > 149 ? 0.0f : exp2i(-d);
  uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
  for (int i = 0; i < 4; ++i)
    w[i] = rebase_e4m3x2(w[i] & 0xFFFFu, mult) | (static_cast<uint32_t>(rebase_e4m3x2(w[i] >> 16, mult)) << 16);
  return make_uint4(w[0], w[1], w[2], w[3]);
}

}  // namespace megamoe
