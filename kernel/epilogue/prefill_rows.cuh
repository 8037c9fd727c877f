// The layers' epilogues in the prefill kernel's orientation (gemm_sm90_prefill.cuh: tokens as rows
// of the accumulator). The arithmetic is D6's and D8's as in l1_swiglu_requant.cuh and
// l2_combine_rows.cuh (swiglu_routed, requant_scale_byte: one definition); only the fragment
// differs: consumer thread (warpgroup wg, warp wq, lane g * 4 + t) holds acc[h][4j + 2r + c] =
// token 64 wg + 16 wq + g + 8r of the tile, weight row 128 h + 8j + 2t + c of its 256. Rows
// interleave gate and up with granularity 8, so j even is gate and j + 1 up of the same channels
// 64 h + 8 (j / 2) + 2t + c: a thread has both halves of its SwiGLUs, and a 32-channel group
// (jp = j / 2 in 4q .. 4q + 3, all t, both c) lies in the four lanes of one g: two shuffles.
#pragma once

#include <cstdint>
#include <cuda_bf16.h>

#include "../common/ptx.cuh"
#include "../common/ue8m0.cuh"
#include "../gemm/contract.cuh"
#include "../gemm/scheduler.cuh"
#include "l1_swiglu_requant.cuh"

namespace megamoe {

template <bool kFastMath, bool kDebug>
__device__ __forceinline__ void prefill_l1_rows(const GemmParams& p, const WorkItem& wi, float (&acc)[2][64], int tok0,
                                                int t) {
  const int64_t inter = p.n_rows / 2;
  const int64_t n_sf = inter / 32;
  const int64_t ch_cta = static_cast<int64_t>(wi.n_block) * 128;   // the tile's first channel
  const float bound = clamp_bound(p);
  uint8_t* out = reinterpret_cast<uint8_t*>(p.out);
  // Both rows' routing weights before any store: a store may alias w_route for the compiler, so a
  // load after the first row's stores would wait its whole latency there. Plain (coherent) loads,
  // as in l1_epilogue.
  float wrs[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) wrs[r] = tok0 + 8 * r < wi.valid ? p.w_route[wi.row0 + tok0 + 8 * r] : 0.0f;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int tok = tok0 + 8 * r;
    const bool valid = tok < wi.valid;
    const int64_t row = wi.row0 + tok;
    const float wr = wrs[r];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
#pragma unroll
      for (int q = 0; q < 2; ++q) {   // the 32-channel group 2h + q of the tile
        float m = 0.0f;
#pragma unroll
        for (int jp = 4 * q; jp < 4 * q + 4; ++jp) {
#pragma unroll
          for (int c = 0; c < 2; ++c) {
            float& gate = acc[h][8 * jp + 2 * r + c];
            const float up = acc[h][8 * jp + 4 + 2 * r + c];
            if constexpr (kDebug) {
              if (valid) {
                const int64_t ch = ch_cta + 64 * h + 8 * jp + 2 * t + c;
                p.dump[row * 2 * inter + ch] = gate;
                p.dump[row * 2 * inter + inter + ch] = up;
              }
            }
            // Unconditional (no branch between the SwiGLUs): a row past the item's valid ones holds
            // whatever its accumulators and wr = 0 give, and its group maximum (the four lanes of
            // one token) and its bytes are never used.
            gate = swiglu_routed<kFastMath>(gate, up, wr, bound);
            m = fmaxf(m, fabsf(gate));   // fmaxf drops NaN
          }
        }
        m = fmaxf(m, __shfl_xor_sync(0xFFFFFFFFu, m, 1));
        m = fmaxf(m, __shfl_xor_sync(0xFFFFFFFFu, m, 2));
        const int byte = requant_scale_byte(m);
        const float mult = exp2i(127 - byte);   // 2^-e, e = byte - 127
        if (valid) {
#pragma unroll
          for (int jp = 4 * q; jp < 4 * q + 4; ++jp) {
            const uint16_t q2 =
                ptx::cvt_e4m3x2(__fmul_rn(acc[h][8 * jp + 2 * r], mult), __fmul_rn(acc[h][8 * jp + 2 * r + 1], mult));
            *reinterpret_cast<uint16_t*>(out + row * inter + ch_cta + 64 * h + 8 * jp + 2 * t) = q2;
          }
          if (t == 0) p.out_sf[row * n_sf + (ch_cta + 64 * h + 32 * q) / 32] = static_cast<uint8_t>(byte);
        }
      }
    }
  }
}

template <bool kDebug>
__device__ __forceinline__ void prefill_l2_rows(const GemmParams& p, const WorkItem& wi, const float (&acc)[2][64],
                                                int tok0, int t) {
  const int64_t hidden = p.n_rows;
  const int64_t col_cta = static_cast<int64_t>(wi.n_block) * 256;
  // Both rows' combine rows before any store (a store may alias dst_rows for the compiler). Plain
  // loads, as in l2_epilogue (the fused kernel's dispatch writes dst_rows).
  int rows[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) rows[r] = tok0 + 8 * r < wi.valid ? p.dst_rows[wi.row0 + tok0 + 8 * r] : -1;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int tok = tok0 + 8 * r;
    if (tok >= wi.valid) continue;
    const int64_t prow = wi.row0 + tok;
    if constexpr (kDebug) {
#pragma unroll
      for (int h = 0; h < 2; ++h)
#pragma unroll
        for (int j = 0; j < 16; ++j)
#pragma unroll
          for (int c = 0; c < 2; ++c)
            p.dump[prow * hidden + col_cta + 128 * h + 8 * j + 2 * t + c] = acc[h][4 * j + 2 * r + c];
    }
    int row = rows[r];
    if (row < 0) continue;
    __nv_bfloat16* dst = reinterpret_cast<__nv_bfloat16*>(p.out);
    // peer_offsets: D8 as l2_epilogue reads it; the prefill path's launches (standalone) pass none.
    if (p.peer_offsets != nullptr) {   // row s * combine_rows + r: row r of rank s's buffer
      const int s = row / p.combine_rows;
      row -= s * p.combine_rows;
      dst = reinterpret_cast<__nv_bfloat16*>(reinterpret_cast<char*>(p.out) + __ldg(p.peer_offsets + s));
    }
    __nv_bfloat16* out_row = dst + static_cast<int64_t>(row) * hidden + col_cta + 2 * t;
#pragma unroll
    for (int h = 0; h < 2; ++h)
#pragma unroll
      for (int j = 0; j < 16; ++j) {
        const __nv_bfloat162 v = __halves2bfloat162(__float2bfloat16_rn(acc[h][4 * j + 2 * r]),
                                                    __float2bfloat16_rn(acc[h][4 * j + 2 * r + 1]));
        *reinterpret_cast<__nv_bfloat162*>(out_row + 128 * h + 8 * j) = v;
      }
  }
}

// The fast mode's row factors 2^(B_r - B_e) <= 1 (static weight data, here per column), then the
// layer's epilogue.
template <int kLayer, bool kFastMath, bool kDebug>
__device__ __forceinline__ void prefill_epilogue(const GemmParams& p, const WorkItem& wi, float (&acc)[2][64]) {
  const int ctid = ptx::thread_idx() - 128;   // re-read: held across the mainloop it is spilled
  const int wtid = ctid % 128;
  const int t = wtid % 4;
  const int tok0 = 64 * (ctid / 128) + 16 * (wtid / 32) + (wtid % 32) / 4;
  const uint8_t* rb = p.w_row_base + static_cast<int64_t>(wi.expert) * p.n_rows + wi.n_block * 256 + 2 * t;
  const int expert_base = __ldg(p.w_expert_base + wi.expert);
#pragma unroll
  for (int h = 0; h < 2; ++h)
#pragma unroll
    for (int j = 0; j < 16; ++j) {
      const uint32_t pair = __ldg(reinterpret_cast<const uint16_t*>(rb + 128 * h + 8 * j));
      const float f0 = exp2i(static_cast<int>(pair & 0xFFu) - expert_base);
      const float f1 = exp2i(static_cast<int>(pair >> 8) - expert_base);
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        acc[h][4 * j + 2 * r] = __fmul_rn(acc[h][4 * j + 2 * r], f0);
        acc[h][4 * j + 2 * r + 1] = __fmul_rn(acc[h][4 * j + 2 * r + 1], f1);
      }
    }
  if constexpr (kLayer == 1)
    prefill_l1_rows<kFastMath, kDebug>(p, wi, acc, tok0, t);
  else
    prefill_l2_rows<kDebug>(p, wi, acc, tok0, t);
}

}  // namespace megamoe
