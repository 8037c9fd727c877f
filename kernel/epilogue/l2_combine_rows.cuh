// L2 epilogue (SPEC D8) of one consumer warpgroup's tile: bf16(acc2) of each valid pool row into
// its combine row dst_rows[p] (= k * T_max + t of a [K, T_max, H] buffer; < 0 = none), natural
// channel order. The fused kernel passes peer_offsets: dst_rows then also names the token's rank s
// (s * combine_rows + k * T_max + t) and the row goes to rank s's buffer through symmetric memory.
// In the debug build the fp32 accumulators (D7) are dumped first. The gpt-oss variant (Act::kOai,
// SPEC §8 D8) adds fp32(w_route · b2[h]) to each before the rounding (w_route: the pool row's
// routing weight, p.w_route).
//
// Accumulator fragment (per chunk of cw = min(N, 64) tokens): element c cw/2 + 4j + h is weight
// row 16 wq + g, token column c cw + 8j + 2t + h; element ... + 2 + h is row 16 wq + g + 8. The
// tile is staged and written one chunk at a time.
#pragma once

#include <cstdint>
#include <cuda_bf16.h>

#include "../common/ptx.cuh"
#include "../gemm/contract.cuh"
#include "../gemm/scheduler.cuh"
#include "activation.cuh"

namespace megamoe {

// Staging bytes per consumer warpgroup for chunks of up to cw tokens: [cw][64] bf16.
template <int kCw>
constexpr int kL2EpilogueBytes = kCw * 64 * 2;

// The combine buffer that a dst_rows entry (row >= 0) names, and the row in it: with peer_offsets
// (the fused kernel) entry s * combine_rows + r is row r of rank s's buffer (symmetric memory), else
// row r of out. The one definition for l2_epilogue and the prefill kernel's prefill_l2_out.
__device__ __forceinline__ __nv_bfloat16* combine_buffer(const GemmParams& p, int& row) {
  __nv_bfloat16* out = reinterpret_cast<__nv_bfloat16*>(p.out);
  if (p.peer_offsets != nullptr) {
    const int s = row / p.combine_rows;
    row -= s * p.combine_rows;
    out = reinterpret_cast<__nv_bfloat16*>(reinterpret_cast<char*>(out) + __ldg(p.peer_offsets + s));
  }
  return out;
}

// A consumer thread's place in its warpgroup's tile of an L2 item: its warpgroup thread wtid, warp
// wq (a 16-row group), rows g and g + 8 of the group, token columns 2t, 2t + 1 of every 8; h_base:
// the warpgroup's first hidden row, h: the thread's first (row g). l2_epilogue and l2_operands.
struct L2Lane {
  int wtid, wq, g, t;
  int64_t h_base, h;
};

template <int kRows>
__device__ __forceinline__ L2Lane l2_lane(const WorkItem& wi, int wg) {
  const int wtid = ptx::thread_idx() % 128;  // re-read: values kept from before the mainloop would cost registers there
  const int wq = wtid / 32;
  const int g = (wtid % 32) / 4;
  const int64_t h_base = static_cast<int64_t>(wi.n_block) * kRows + wg * 64;
  return {wtid, wq, g, wtid % 4, h_base, h_base + wq * 16 + g};
}

// D8's operands from global memory of one consumer thread at token tile 8 (the narrow engine: one
// chunk, one store vector a thread), loaded before the item's mainloop so that their latency hides
// under it: loaded after it, they were rounds of memory latency under the weight stream in every L2
// item's epilogue (its `written - computed` 1.7 us of 13, bench/NOTES.md v49). Loaded once the
// item's first stage is in: the pull wrote w_route and dst_rows during this launch, before the
// item's gate, which the ring's token side (producer.cuh issue_token_side) passed before it filled
// that stage (whose full barrier the caller waited on). Raw bits, widened in l2_epilogue after the
// caller's mainloop (bias_bits): no instruction before the mainloop reads a loaded value (the two
// biases or'ed into one word there stalled every L2 item's start for a load's latency under the
// weight stream, bench/NOTES.md v60).
struct L2Operands {
  uint32_t bias_lo, bias_hi;  // b2 (bias_bits) of the thread's rows g and g + 8; 0 past H
  float wr[2];  // w_route of token columns 2t, 2t + 1; 0 past the valid rows
  int row;  // dst_rows of the thread's store vector (its column wtid / 8); -1: none
};

template <int kRows, typename Act>
__device__ __forceinline__ L2Operands l2_operands(const GemmParams& p, const WorkItem& wi) {
  const L2Lane l = l2_lane<kRows>(wi, ptx::thread_idx() / 128 - 1);
  L2Operands o{0u, 0u, {0.0f, 0.0f}, -1};
  if constexpr (Act::kOai) {
    if (l.h < p.n_out) {
      o.bias_lo = bias_bits(p, wi.expert, l.h);
      o.bias_hi = bias_bits(p, wi.expert, l.h + 8);
    }
#pragma unroll
    for (int c = 0; c < 2; ++c)
      if (2 * l.t + c < wi.valid) o.wr[c] = p.w_route[wi.row0 + 2 * l.t + c];
  }
  if (l.wtid < 64 && l.wtid / 8 < wi.valid) o.row = p.dst_rows[wi.row0 + l.wtid / 8];
  return o;
}

// kEarly: D8's global operands are `ops` (l2_operands, token tile 8), else loaded here.
template <int N, int kRows, typename Act, bool kDebug, bool kEarly = false>
__device__ __forceinline__ void l2_epilogue(const GemmParams& p, const WorkItem& wi, const float (&acc)[N / 2],
                                            uint8_t* s_epi_wg, int wg, L2Operands ops = {}) {
  static_assert(!kEarly || N == 8, "l2_operands holds one chunk of 8 tokens");
  if constexpr (kEarly) {  // their first uses (the widening, the row's address) after the mainloop
    ptx::fence_operand(ops.bias_lo);
    ptx::fence_operand(ops.bias_hi);
    ptx::fence_operand(ops.wr[0]);
    ptx::fence_operand(ops.wr[1]);
    ptx::fence_operand(reinterpret_cast<uint32_t&>(ops.row));
  }
  constexpr int CW = chunk_width(N);
  const L2Lane l = l2_lane<kRows>(wi, wg);
  const int wtid = l.wtid, wq = l.wq, g = l.g, t = l.t;
  const int64_t h_base = l.h_base;
  const int64_t p0 = wi.row0;
  const int64_t hidden = p.n_out;  // H: the rows past it (n_rows' padding to the CTA tiles) are not written
  __nv_bfloat16* st = reinterpret_cast<__nv_bfloat16*>(s_epi_wg);  // [CW][64]
  const uint32_t st_s = ptx::smem_addr(st) + (wq * 16 + g) * 2;
  float b_lo = 0.0f, b_hi = 0.0f;  // b2 of the thread's two hidden rows (SPEC §8 D8)
  if constexpr (Act::kOai && kEarly) {
    b_lo = __uint_as_float(ops.bias_lo << 16);
    b_hi = __uint_as_float(ops.bias_hi << 16);
  } else if constexpr (Act::kOai) {
    if (l.h < hidden) {  // b2 has H rows; the padding's are never written
      b_lo = bias_or_neg_zero(p, wi.expert, l.h);
      b_hi = bias_or_neg_zero(p, wi.expert, l.h + 8);
    }
  }
#pragma unroll
  for (int c = 0; c < N / CW; ++c) {
    if (c > 0 && c * CW >= wi.valid) break;  // chunks without rows (wide kernels charge only the filled ones)
    // The staging of the previous chunk (or item) is read out by every thread before it is rewritten.
    ptx::named_barrier(1 + wg, 128);
#pragma unroll
    for (int j = 0; j < CW / 8; ++j) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int col = 8 * j + 2 * t + h;
        float v0 = acc[c * (CW / 2) + 4 * j + h];  // row 16 wq + g
        float v1 = acc[c * (CW / 2) + 4 * j + 2 + h];  // row 16 wq + g + 8
        if constexpr (kDebug) {
          // H is a multiple of 32: a thread's 16-row group (rows g, g + 8) is all in or all out.
          if (c * CW + col < wi.valid && l.h < hidden) {
            p.dump[(p0 + c * CW + col) * hidden + l.h] = v0;
            p.dump[(p0 + c * CW + col) * hidden + l.h + 8] = v1;
          }
        }
        if constexpr (Act::kOai) {  // a plain (coherent) load, as l1_epilogue's
          const float wr = kEarly ? ops.wr[h] : c * CW + col < wi.valid ? p.w_route[p0 + c * CW + col] : 0.0f;
          v0 = __fadd_rn(v0, routed_bias(p, wr, b_lo));
          v1 = __fadd_rn(v1, routed_bias(p, wr, b_hi));
        }
        ptx::st_shared_u16(st_s + col * 128, __bfloat16_as_ushort(__float2bfloat16_rn(v0)));
        ptx::st_shared_u16(st_s + col * 128 + 16, __bfloat16_as_ushort(__float2bfloat16_rn(v1)));
      }
    }
    ptx::named_barrier(1 + wg, 128);
    // The thread's 16-byte vectors idx = wtid + 128 k: their combine rows are loaded first, all at
    // once (a plain load: in the fused kernel the dispatch wrote dst_rows during this launch), then
    // the vectors are stored (loaded one per vector, each was waited for in turn).
    constexpr int kVecs = (CW * 8 + 127) / 128;
    int rows[kVecs];
#pragma unroll
    for (int k = 0; k < kVecs; ++k) {
      const int idx = wtid + 128 * k;
      const int col = idx / 8;
      rows[k] = kEarly ? ops.row : idx < CW * 8 && c * CW + col < wi.valid ? p.dst_rows[p0 + c * CW + col] : -1;
    }
#pragma unroll
    for (int k = 0; k < kVecs; ++k) {
      const int idx = wtid + 128 * k;
      const int col = idx / 8;
      const int part = idx % 8;
      int row = rows[k];
      if (row >= 0 && h_base + part * 8 < hidden) {
        __nv_bfloat16* dst = combine_buffer(p, row);
        const uint4 v = *reinterpret_cast<const uint4*>(st + col * 64 + part * 8);
        *reinterpret_cast<uint4*>(dst + static_cast<int64_t>(row) * p.out_stride + h_base + part * 8) = v;
      }
    }
  }
}

}  // namespace megamoe
