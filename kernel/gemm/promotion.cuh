// Promotion: one wgmma group's tensor-core products into the fp32 result, with the scales of its
// K block. One definition per promotion mode, used by every token tile.
//
// Accumulator fragment of a chunk of cw tokens (wgmma m64 x cw, swap-AB): element 4j + 2r + h is
// weight row g + 8r of the warp's 16 and token column 8j + 2t + h (g = lane / 4, t = lane % 4). The
// producer's scale warp stages the chunk's fp32 token scales so that thread t reads its cw/4
// scales (index 2j + h) contiguously: StageRing::scale_index.
#pragma once

#include <cstdint>

namespace megamoe {

// Thread t's scales of a chunk, or (kFirst, kLast) only the 4-scale vectors [kFirst, kLast) of
// them: a mainloop may load part of them before a wait and the rest after it.
template <int CW, int kFirst = 0, int kLast = (CW < 16 ? 1 : CW / 16)>
__device__ __forceinline__ void load_token_scales(const float* sx, int t, float (&s)[CW / 4]) {
  const float* src = sx + t * (CW / 4);
  if constexpr (CW == 8) {
    const float2 v = *reinterpret_cast<const float2*>(src);
    s[0] = v.x;
    s[1] = v.y;
  } else {
#pragma unroll
    for (int i = kFirst; i < kLast; ++i) {
      const float4 v = *reinterpret_cast<const float4*>(src + 4 * i);
      s[4 * i + 0] = v.x;
      s[4 * i + 1] = v.y;
      s[4 * i + 2] = v.z;
      s[4 * i + 3] = v.w;
    }
  }
}

// Fast mode (K128): acc += prod * 2^(sx - 127 + B_e - 133), the token's K128 scale with the
// expert's weight base folded in by the producer: one FMA per accumulator. The weight rows' own
// factors 2^(B_r - B_e) are constant over K and applied once, after the mainloop. s: the chunk's
// token scales (load_token_scales), loaded before the wgmma wait so that their latency hides there.
template <int CW>
__device__ __forceinline__ void promote_k128(float* acc, const float* prod, const float (&s)[CW / 4]) {
#pragma unroll
  for (int j = 0; j < CW / 8; ++j)
#pragma unroll
    for (int i = 0; i < 4; ++i) acc[4 * j + i] = __fmaf_rn(prod[4 * j + i], s[2 * j + (i & 1)], acc[4 * j + i]);
}

// Exact mode (K32), one accumulator: acc + prod * (2^(sw - 127) * 2^(sx - 127)) with the weight
// row's and the token's per-32 scales of the k32 step as fp32 (their product rounds only where it
// underflows). The swap-AB kernels (promote_k32) and the prefill kernel use this one definition.
__device__ __forceinline__ float promote_k32_one(float acc, float prod, float sw, float sx) {
  return __fmaf_rn(prod, __fmul_rn(sw, sx), acc);
}

// Exact mode over a swap-AB chunk (swa: row g, swb: row g + 8; s as for promote_k128).
template <int CW>
__device__ __forceinline__ void promote_k32(float* acc, const float* prod, const float (&s)[CW / 4], float swa,
                                            float swb) {
#pragma unroll
  for (int j = 0; j < CW / 8; ++j)
#pragma unroll
    for (int i = 0; i < 4; ++i)
      acc[4 * j + i] = promote_k32_one(acc[4 * j + i], prod[4 * j + i], i < 2 ? swa : swb, s[2 * j + (i & 1)]);
}

}  // namespace megamoe
