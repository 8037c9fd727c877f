// Fast-mode promotion: one K128 block's tensor-core products into the fp32 result, with the row's
// and the token's K128 scales.
//
// The scale 2^(smax - 127) (weight row) x 2^(sx - 127) (token) is built on the fp32 bits with one
// integer add per (row, token): ((smax - 127) << 23) + (sx << 23). Equal to the fp32 product
// whenever that is a normal number (both factors are powers of two); products under 2^-126 (never
// met by real scales: both factors tiny) are not supported in the fast mode.
#pragma once

#include <cstdint>

#include "../common/ptx.cuh"

namespace megamoe {

// (smax - 127) << 23 of a weight row, from its four per-32 scale bytes: the row's K128 scale bits.
__device__ __forceinline__ int row_scale_bits(uint32_t sf4) {
  uint32_t m = __vmaxu4(sf4, sf4 >> 16);
  m = __vmaxu4(m, m >> 8) & 0xFFu;
  return static_cast<int>(m << 23) - (127 << 23);
}

// acc[4j + h] += prod[4j + h] * scale(row_a, token 8j + 2t + h), acc[4j + 2 + h] likewise for row
// row_a + 8 (the wgmma fragment layout), over kCols token columns. xsf: the stage's scale words
// of those columns (byte kb % 4 of each is this K128 block's); rba / rbb: row_scale_bits of the
// thread's two rows.
template <int kCols>
__device__ __forceinline__ void promote_k128(float* acc, const float* prod, const uint32_t* xsf, int t, int kb,
                                             int rba, int rbb) {
  const uint32_t sel = 0x4440u | static_cast<uint32_t>(kb & 3);
#pragma unroll
  for (int j = 0; j < kCols / 8; ++j) {
    const uint2 v = *reinterpret_cast<const uint2*>(xsf + 8 * j + 2 * t);
    const int tb0 = static_cast<int>(ptx::prmt(v.x, 0u, sel)) << 23;
    const int tb1 = static_cast<int>(ptx::prmt(v.y, 0u, sel)) << 23;
    acc[4 * j + 0] = __fmaf_rn(prod[4 * j + 0], __int_as_float(rba + tb0), acc[4 * j + 0]);
    acc[4 * j + 1] = __fmaf_rn(prod[4 * j + 1], __int_as_float(rba + tb1), acc[4 * j + 1]);
    acc[4 * j + 2] = __fmaf_rn(prod[4 * j + 2], __int_as_float(rbb + tb0), acc[4 * j + 2]);
    acc[4 * j + 3] = __fmaf_rn(prod[4 * j + 3], __int_as_float(rbb + tb1), acc[4 * j + 3]);
  }
}

}  // namespace megamoe
