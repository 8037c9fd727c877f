// L1 epilogue (SPEC D6) of one consumer warpgroup's tile: bf16 rounding of the gate / up
// accumulators (the gpt-oss variant adds b1 first), the activation policy's steps 2-4 (Act:
// activation.cuh; clamp, SiLU or the glu factor, the routing-weight multiply), and the per-32
// requantisation to E4M3 with UE8M0 scale bytes. In the debug build the fp32 accumulators (D5) are
// dumped first, in canonical gate-then-up order.
//
// Accumulator fragment (wgmma m64 x cw per chunk of cw = min(N, 64) tokens, swap-AB): element
// c cw/2 + 4j + h is weight row 16 wq + g, token column c cw + 8j + 2t + h; element ... + 2 + h is
// row 16 wq + g + 8. Rows interleave gate and up with granularity 8, so a thread holds gate channel
// ch in the first and up channel ch in the second. The tile is staged and written one chunk at a
// time, so the staging is sized for 64 tokens whatever the tile.
#pragma once

#include <cstdint>
#include <cuda_bf16.h>

#include "../common/ptx.cuh"
#include "../common/rebase.cuh"
#include "../common/ue8m0.cuh"
#include "../gemm/contract.cuh"
#include "../gemm/scheduler.cuh"
#include "activation.cuh"

namespace megamoe {

// Staging bytes per consumer warpgroup for chunks of up to cw tokens: [cw][32] e4m3 + [4][cw] fp32 amax.
template <int kCw>
constexpr int kL1EpilogueBytes = kCw * 32 + 4 * kCw * 4;

// D6 step 5: the UE8M0 scale byte of a 32-channel group whose largest |a| is amax (NaN-free, >= 0):
// the exponent of amax / 448, rounded up to the next power of two unless exact.
__device__ __forceinline__ int requant_scale_byte(float amax) {
  const uint32_t bits = __float_as_uint(__fmul_rn(amax, 1.0f / 448.0f));
  return static_cast<int>((bits >> 23) & 0xFFu) + ((bits & 0x7FFFFFu) != 0u ? 1 : 0);
}

// The fast mode's L2 operand (fused kernel): L2 promotes once per 128 intermediate channels, which
// four warpgroup tiles of L1 (two CTAs) write. Each tile counts itself in rebase_count of its (pool
// block, 128 channels); the warpgroup that brings it to 4 rebases those 128 channels of the block's
// rows (rebase_k128 of the canonical D6 output, which the others wrote and released) into
// rebase_x / rebase_sf and adds their 4 scale groups to the block's L1-completion counter, so the
// block is complete at I/32 in both modes.
__device__ __forceinline__ void rebase_l1_tile(const GemmParams& p, const WorkItem& wi, uint8_t* s_epi_wg, int wg,
                                               int wtid, int64_t ch0) {
  const int64_t inter = p.n_out / 2;   // I (the fast mode's: a multiple of 512, no padded rows)
  const int blk = wi.row0 / p.arrival_block;
  const int j = static_cast<int>(ch0 / 128);   // the 128 channels holding this warpgroup's 32
  int* flag = reinterpret_cast<int*>(s_epi_wg);
  if (wtid == 0) {
    __threadfence();
    const int before = atomicAdd(p.rebase_count + static_cast<int64_t>(blk) * (inter / 128) + j, 1);
    __threadfence();
    *flag = before;
  }
  ptx::named_barrier(1 + wg, 128);
  const bool last = *flag == 3;
  ptx::named_barrier(1 + wg, 128);   // the staging is rewritten by the next item only after this
  if (!last) return;
  // 8 vectors of 16 bytes per row (128 channels), over the warpgroup's 128 threads.
  const int64_t ld = p.out_stride;   // the canonical intermediate's row stride (= I: the fast mode's I)
  const int n_sf = static_cast<int>(ld / 32);
  for (int idx = wtid; idx < wi.valid * 8; idx += 128) {
    const int64_t row = wi.row0 + idx / 8;
    const int v = idx % 8;   // 16-byte vector of the 128 channels; group v / 2
    // L2 loads (ld.cg): the other warpgroups' tiles were written by other SMs during this launch.
    const uint32_t sf = __ldcg(reinterpret_cast<const unsigned int*>(p.out_sf + row * n_sf + 4 * j));
    const uint32_t smax = max_byte4(sf);
    const int d = static_cast<int>(smax - ((sf >> (8 * (v / 2))) & 0xFFu));
    const uint4 x =
        __ldcg(reinterpret_cast<const uint4*>(reinterpret_cast<const uint8_t*>(p.out) + row * ld + 128 * j + 16 * v));
    *reinterpret_cast<uint4*>(p.rebase_x + row * inter + 128 * j + 16 * v) = rebase_e4m3x16(x, d);
    if (v == 0) p.rebase_sf[row * (inter / 128) + j] = static_cast<uint8_t>(smax);
  }
  ptx::named_barrier(1 + wg, 128);
  if (wtid == 0) {
    ptx::fence_proxy_async_global();
    ptx::red_release_gpu_add(p.signal + blk, 4);
  }
}

// wg: the consumer warpgroup (weight rows 64 wg .. 64 wg + 63 of the CTA's kRows); s_epi_wg: its
// staging; named barrier 1 + wg synchronises its 128 threads.
template <int N, int kRows, bool kPerK32, typename Act, bool kDebug, bool kFused>
__device__ __forceinline__ void l1_epilogue(const GemmParams& p, const WorkItem& wi, float (&acc)[N / 2],
                                            uint8_t* s_epi_wg, int wg) {
  constexpr int CW = chunk_width(N);
  const int wtid = ptx::thread_idx() % 128;  // re-read: values kept from before the mainloop would cost registers there
  const int wq = wtid / 32;
  const int g = (wtid % 32) / 4;
  const int t = wtid % 4;
  const int64_t p0 = wi.row0;
  // Interleaved rows (granularity 8): local row 16 rg + g is gate channel ch, + 8 is up ch.
  const int64_t inter = p.n_out / 2;  // I
  const int64_t ld = p.out_stride;  // the intermediate's row stride: I padded to K blocks
  const int c_local = wg * 32 + wq * 8 + g;  // channel within the CTA's kRows / 2
  const int64_t ch = static_cast<int64_t>(wi.n_block) * (kRows / 2) + c_local;
  const int64_t ch0 = ch - c_local + wg * 32;  // the warpgroup's first channel
  uint8_t* st_q = s_epi_wg;  // [CW][32] e4m3
  float* st_amax = reinterpret_cast<float*>(s_epi_wg + CW * 32);  // [4][CW]
  // Where I is not a multiple of 64 (SPEC §8: the fused layer's exact mode only), the last CTA
  // tile's second warpgroup holds only the weights' zero padding rows (channels I .. I + 31): it
  // computes zeros, and reads no bias, dumps nothing, stores nothing and counts nothing (the block
  // is complete at I / 32 tiles; the intermediate's padding stays the workspace's zeros). Guards,
  // not an early return: that cost the plain exact kernels up to 120 bytes of spills; true at
  // compile time elsewhere (the standalone fast-mode kernels spilled 16 bytes for the test).
  const bool real = !(kFused && kPerK32) || ch0 < inter;
  const float bound = clamp_bound(p);
  // SPEC §8 D6 step 1's biases of the thread's gate and up channel (-0.0 without: the add is then
  // the identity).
  float b_gate = 0.0f, b_up = 0.0f;
  if constexpr (Act::kOai) {
    if (real) {
      b_gate = bias_or_neg_zero(p, wi.expert, ch);
      b_up = bias_or_neg_zero(p, wi.expert, inter + ch);
    }
  }
  // D6 steps 1-4: a = (silu(g) * u) * wr (wr: the token's routing weight; the policy's routed), kept
  // in the gate's accumulator (dead after it).
  auto swiglu = [&](float gate, float up, int tok, float wr) -> float {
    if constexpr (Act::kOai) {
      gate = __fadd_rn(gate, b_gate);
      up = __fadd_rn(up, b_up);
    }
    const float a = Act::routed(__bfloat162float(__float2bfloat16_rn(gate)), __bfloat162float(__float2bfloat16_rn(up)),
                                wr, bound, p);
    return tok < wi.valid ? a : 0.0f;
  };
  const int64_t n_sf = ld / 32;
  const uint32_t st_q_s = ptx::smem_addr(st_q) + wq * 8 + g;
  uint8_t* out = reinterpret_cast<uint8_t*>(p.out);
#pragma unroll
  for (int c = 0; c < N / CW; ++c) {
    if (c > 0 && c * CW >= wi.valid) break;  // chunks without rows (wide kernels charge only the filled ones)
    float* ac = acc + c * (CW / 2);
    // The routing weights of 32 tokens at a time (at j % 4 == 0, lane l of every warp loads that of
    // token 8 j + l) and the SwiGLUs take theirs by shuffle: loaded per token pair, every pair waited
    // for its own load (3 % of the 64-token tile's stall samples, ncu). Plain (coherent) loads, not
    // __ldg: in the fused kernel w_route arrives with the rows behind the arrival gate, and the
    // read-only path is not ordered by that acquire.
    float wr_lane = 0.0f;
#pragma unroll
    for (int j = 0; j < CW / 8; ++j) {
      if (j % 4 == 0) {
        const int col = 8 * j + wtid % 32;
        wr_lane = col < CW && c * CW + col < wi.valid ? p.w_route[p0 + c * CW + col] : 0.0f;
      }
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int col = 8 * j + 2 * t + h;
        const int tok = c * CW + col;
        const float gate = ac[4 * j + h];
        const float up = ac[4 * j + 2 + h];
        if constexpr (kDebug) {
          if (tok < wi.valid && real) {
            p.dump[(p0 + tok) * 2 * inter + ch] = gate;
            p.dump[(p0 + tok) * 2 * inter + inter + ch] = up;
          }
        }
        const float wr = __shfl_sync(0xFFFFFFFFu, wr_lane, 8 * j % 32 + 2 * t + h);
        const float a = swiglu(gate, up, tok, wr);
        ac[4 * j + h] = a;
        // amax over the 8 gate rows g of this warp (lanes with the same t); fmaxf drops NaN.
        float m = fmaxf(0.0f, fabsf(a));
        m = fmaxf(m, __shfl_xor_sync(0xFFFFFFFFu, m, 4));
        m = fmaxf(m, __shfl_xor_sync(0xFFFFFFFFu, m, 8));
        m = fmaxf(m, __shfl_xor_sync(0xFFFFFFFFu, m, 16));
        if (g == 0) st_amax[wq * CW + col] = m;
      }
      // One token pair at a time: unbounded, ptxas overlaps all CW/4 SwiGLUs and shuffle chains
      // and the epilogue becomes the register peak of the whole kernel.
      __syncwarp();
    }
    ptx::named_barrier(1 + wg, 128);
#pragma unroll
    for (int j = 0; j < CW / 8; ++j) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int col = 8 * j + 2 * t + h;
        const int tok = c * CW + col;
        const float amax =
            fmaxf(fmaxf(st_amax[col], st_amax[CW + col]), fmaxf(st_amax[2 * CW + col], st_amax[3 * CW + col]));
        const int byte = requant_scale_byte(amax);
        const float mult = exp2i(127 - byte);  // 2^-e, e = byte - 127
        const float a = ac[4 * j + h];
        const uint16_t q2 = ptx::cvt_e4m3x2(__fmul_rn(a, mult), 0.0f);
        ptx::st_shared_u8(st_q_s + col * 32, q2 & 0xFFu);
        if (wq == 0 && g == 0 && tok < wi.valid && real)
          p.out_sf[(p0 + tok) * n_sf + ch0 / 32] = static_cast<uint8_t>(byte);
      }
    }
    ptx::named_barrier(1 + wg, 128);
    // The chunk's rows out: 16-byte vectors, two per token (the warpgroup's 32 channels).
    for (int idx = wtid; idx < CW * 2; idx += 128) {
      const int col = idx / 2;
      const int half = idx % 2;
      if (c * CW + col < wi.valid && real) {
        const uint4 v = *reinterpret_cast<const uint4*>(st_q + col * 32 + half * 16);
        *reinterpret_cast<uint4*>(out + (p0 + c * CW + col) * ld + ch0 + half * 16) = v;
      }
    }
    // The next chunk (or item) rewrites st_amax only after every thread passed the barrier above,
    // and st_q only after the barrier that follows its own first pass.
  }
  // Fused kernel: the warpgroup's tile (32 channels = one scale group of every row) is written;
  // count it in the L1-completion counter of its pool block (the item is one pool block; in parts,
  // its last part counts it: scheduler.cuh item_part). The L2
  // of a block reads by TMA once its counter is full, hence the proxy fence before the release.
  if constexpr (kFused) {  // compiled into the fused kernel only: the fast mode's branch costs registers
    ptx::named_barrier(1 + wg, 128);
    if constexpr (kPerK32) {
      if (wtid == 0 && real && wi.last) {  // (an item in parts: its last, scheduler.cuh item_part)
        ptx::fence_proxy_async_global();
        ptx::red_release_gpu_add(p.signal + wi.row0 / p.arrival_block, 1);  // (ptx.cuh: the release is the fence)
      }
    } else {  // the fast mode's L2 reads the intermediate rebased per 128 channels
      rebase_l1_tile(p, wi, s_epi_wg, wg, wtid, ch0);
    }
  }
}

}  // namespace megamoe
