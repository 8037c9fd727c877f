// Power-of-two scale arithmetic on fp32 bit patterns (UE8M0 scale bytes, exact 2^x).
#pragma once

#include <cstdint>

namespace megamoe {

// The fp32 bits of 2^x for integer x in [-149, 127] (exact: normal, or subnormal below -126).
__host__ __device__ constexpr uint32_t exp2i_bits(int x) {
  return x >= -126 ? static_cast<uint32_t>(x + 127) << 23 : 1u << (x + 149);
}

__device__ __forceinline__ float exp2i(int x) {
  return __uint_as_float(exp2i_bits(x));
}

// The fp32 bits of 2^(b - 127) for the byte b at position k (0 .. 3) of a word of four UE8M0 bytes:
// b << 23, which for b = 0 is 0 where 2^-127 is the subnormal 0x400000, below b << 23 for every
// other value: so the larger of the two. Three instructions (shift, mask, max) where exp2i of the
// extracted byte took five; the same value for every byte value and position (checked below
// against exp2i_bits; b = 255 gives +inf there too).
__host__ __device__ constexpr uint32_t ue8m0_bits(uint32_t word, int k) {
  const uint32_t bits = (k == 3 ? word >> 1 : word << (23 - 8 * k)) & 0x7F800000u;
  return bits > 0x400000u ? bits : 0x400000u;
}

__host__ __device__ constexpr bool ue8m0_bits_are_exp2i() {
  for (uint32_t b = 0; b < 256; ++b)
    for (int k = 0; k < 4; ++k)
      if (ue8m0_bits(b << (8 * k) | (0xA5A5A5A5u & ~(0xFFu << (8 * k))), k) != exp2i_bits(static_cast<int>(b) - 127))
        return false;
  return true;
}
static_assert(ue8m0_bits_are_exp2i(), "ue8m0_bits is exp2i(b - 127) of the word's byte k, whatever its other bytes");

// 2^(b-127) of the byte b at position k of a word of UE8M0 bytes (b = 0: the subnormal 2^-127).
__device__ __forceinline__ float ue8m0_byte_to_float(uint32_t word, int k) {
  return __uint_as_float(ue8m0_bits(word, k));
}

// 2^(b-127) of one UE8M0 byte b.
__device__ __forceinline__ float ue8m0_to_float(uint32_t b) {
  return ue8m0_byte_to_float(b, 0);
}

}  // namespace megamoe
