// Power-of-two scale arithmetic on fp32 bit patterns (UE8M0 scale bytes, exact 2^x).
#pragma once

#include <cstdint>

namespace megamoe {

// 2^(b-127) of a UE8M0 byte as an fp32 (byte 0 is the subnormal 2^-127 = 0x00400000; it was
// 0x00200000 = 2^-128 until tests/gpu/test_gemm_edges.py put byte 0 through the exact mode).
__device__ __forceinline__ float ue8m0_to_float(uint32_t b) {
  return b == 0 ? __uint_as_float(0x00400000u) : __uint_as_float(b << 23);
}

// 2^x for integer x in [-149, 127] as an exact fp32.
__device__ __forceinline__ float exp2i(int x) {
  return x >= -126 ? __uint_as_float(static_cast<uint32_t>(x + 127) << 23) : __uint_as_float(1u << (x + 149));
}

}  // namespace megamoe
