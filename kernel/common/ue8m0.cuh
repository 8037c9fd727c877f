// Power-of-two scale arithmetic on fp32 bit patterns (UE8M0 scale bytes, exact 2^x).
#pragma once

#include <cstdint>

namespace megamoe {

// 2^x for integer x in [-149, 127] as an exact fp32.
__device__ __forceinline__ float exp2i(int x) {
  return x >= -126 ? __uint_as_float(static_cast<uint32_t>(x + 127) << 23) : __uint_as_float(1u << (x + 149));
}

// 2^(b-127) of a UE8M0 byte as an fp32 (byte 0 is the subnormal 2^-127): exp2i, the one
// definition of an exact power of two (a hand-written subnormal constant here once said 2^-128).
__device__ __forceinline__ float ue8m0_to_float(uint32_t b) {
  return exp2i(static_cast<int>(b) - 127);
}

}  // namespace megamoe
