// L1 epilogue (SPEC D6) of one consumer warpgroup's tile: bf16 rounding of the gate / up
// accumulators, optional clamp, SiLU (the device function the reference's tables come from), the
// routing-weight multiply, and the per-32 requantisation to E4M3 with UE8M0 scale bytes. In the
// debug build the fp32 accumulators (D5) are dumped first, in canonical gate-then-up order.
//
// Accumulator fragment (wgmma m64nBN, swap-AB): acc[4j + h] is weight row 16 wq + g, token column
// 8j + 2t + h; acc[4j + 2 + h] is row 16 wq + g + 8. Rows interleave gate and up with granularity
// 8, so a thread holds gate channel c in acc[4j + h] and up channel c in acc[4j + 2 + h].
#pragma once

#include <cstdint>
#include <cuda_bf16.h>

#include "../common/ptx.cuh"
#include "../common/ue8m0.cuh"
#include "../gemm/params.cuh"
#include "../gemm/scheduler.cuh"
#include "silu.cuh"

namespace megamoe {

// Staging bytes per consumer warpgroup: [BN][32] e4m3 + [4][BN] fp32 amax.
template <int BN>
constexpr int kL1EpilogueBytes = BN * 32 + 4 * BN * 4;

// wg: the consumer warpgroup (weight rows 64 wg .. 64 wg + 63 of the CTA's kBlockRows); s_epi_wg:
// its staging; named barrier 1 + wg synchronises its 128 threads.
template <int BN, int kBlockRows, bool kFastSilu, bool kDebug>
__device__ __forceinline__ void l1_epilogue(const GemmParams& p, const WorkItem& wi, const float (&acc)[BN / 2],
                                            uint8_t* s_epi_wg, int wg) {
  const int wtid = threadIdx.x % 128;
  const int wq = wtid / 32;
  const int g = (wtid % 32) / 4;
  const int t = wtid % 4;
  const int64_t p0 = wi.row0;
  // Interleaved rows (granularity 8): local row 16 rg + g is gate channel c, + 8 is up c.
  const int64_t inter = p.n_rows / 2;                       // I
  const int c_local = wg * 32 + wq * 8 + g;                 // channel within the CTA's kRows/2
  const int64_t c = static_cast<int64_t>(wi.n_block) * (kBlockRows / 2) + c_local;
  uint8_t* st_q = s_epi_wg;                                 // [BN][32] e4m3
  float* st_amax = reinterpret_cast<float*>(s_epi_wg + BN * 32);  // [4][BN]
  const float clampv = p.clamp_value;
  const bool has_clamp = p.has_clamp != 0;
  // w_route is read with plain (coherent) loads, not __ldg: in the fused kernel it arrives with the
  // rows behind the arrival gate, and the read-only path is not ordered by that acquire.
  // a = (silu(g) * u) * w_route of (token column j, h); recomputed in the second pass
  // rather than held (saves BN/4 registers; the arithmetic is deterministic).
  auto swiglu = [&](float gate, float up, int tok) -> float {
    float gf = __bfloat162float(__float2bfloat16_rn(gate));
    float uf = __bfloat162float(__float2bfloat16_rn(up));
    if (has_clamp) {
      // NaN-propagating min / clamp in bf16 (values and c are bf16-representable).
      gf = gf > clampv ? clampv : gf;
      uf = uf > clampv ? clampv : uf;
      uf = uf < -clampv ? -clampv : uf;
    }
    const float sv = silu<kFastSilu>(gf);
    const float wr = tok < wi.valid ? p.w_route[p0 + tok] : 0.0f;
    return tok < wi.valid ? __fmul_rn(__fmul_rn(sv, uf), wr) : 0.0f;
  };
  ptx::named_barrier(1 + wg, 128);
#pragma unroll
  for (int j = 0; j < BN / 8; ++j) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int tok = 8 * j + 2 * t + h;
      const float gate = acc[4 * j + h];
      const float up = acc[4 * j + 2 + h];
      if constexpr (kDebug) {
        if (tok < wi.valid) {
          p.dump[(p0 + tok) * 2 * inter + c] = gate;
          p.dump[(p0 + tok) * 2 * inter + inter + c] = up;
        }
      }
      const float a = swiglu(gate, up, tok);
      // amax over the 8 gate rows g of this warp (lanes with the same t); fmaxf drops NaN.
      float m = fmaxf(0.0f, fabsf(a));
      m = fmaxf(m, __shfl_xor_sync(0xFFFFFFFFu, m, 4));
      m = fmaxf(m, __shfl_xor_sync(0xFFFFFFFFu, m, 8));
      m = fmaxf(m, __shfl_xor_sync(0xFFFFFFFFu, m, 16));
      if (g == 0) st_amax[wq * BN + tok] = m;
    }
  }
  ptx::named_barrier(1 + wg, 128);
  const int64_t n_sf = inter / 32;
  const uint32_t st_q_s = ptx::smem_addr(st_q) + wq * 8 + g;
#pragma unroll
  for (int j = 0; j < BN / 8; ++j) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int tok = 8 * j + 2 * t + h;
      const float amax = fmaxf(fmaxf(st_amax[tok], st_amax[BN + tok]),
                               fmaxf(st_amax[2 * BN + tok], st_amax[3 * BN + tok]));
      const uint32_t bits = __float_as_uint(__fmul_rn(amax, 1.0f / 448.0f));
      const int byte = static_cast<int>((bits >> 23) & 0xFFu) + ((bits & 0x7FFFFFu) != 0u ? 1 : 0);
      const float mult = exp2i(127 - byte);               // 2^-e, e = byte - 127
      const float a = swiglu(acc[4 * j + h], acc[4 * j + 2 + h], tok);
      const uint16_t q2 = ptx::cvt_e4m3x2(__fmul_rn(a, mult), 0.0f);
      ptx::st_shared_u8(st_q_s + tok * 32, q2 & 0xFFu);
      if (wq == 0 && g == 0 && tok < wi.valid)
        p.out_sf[(p0 + tok) * n_sf + (c - c_local) / 32 + wg] = static_cast<uint8_t>(byte);
    }
  }
  ptx::named_barrier(1 + wg, 128);
  uint8_t* out = reinterpret_cast<uint8_t*>(p.out);
  for (int idx = wtid; idx < BN * 2; idx += 128) {
    const int tok = idx / 2;
    const int half = idx % 2;
    if (tok < wi.valid) {
      const uint4 v = *reinterpret_cast<const uint4*>(st_q + tok * 32 + half * 16);
      *reinterpret_cast<uint4*>(out + (p0 + tok) * inter + (c - c_local) + wg * 32 + half * 16) = v;
    }
  }
}

}  // namespace megamoe
