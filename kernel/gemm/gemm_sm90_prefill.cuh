// SM90 grouped GEMM for prefill sizes (fast mode only): tokens as the wgmma M dimension, weights
// as N, both operands in shared memory, the weights already E4M3. This file is the kernel layer:
// shared-memory layout, roles, the item loop; the pieces are
//   predecode.cuh         the pass that decodes every weight once per call (w_e4m3),
//   scheduler.cuh         the work items (the same as gemm_sm90.cuh's at kMaxN 128, 256 rows),
//   producer.cuh          stage_token_scales (the scale warps, a linear scale layout here),
//   ../epilogue/prefill_rows.cuh  the layers' epilogues in this orientation (staged, then written
//                                 by the epilogue warps).
//
// Why a second orientation: in gemm_sm90.cuh (swap-AB) a token's fp32 scale varies along the
// accumulator's columns, so each consumer thread promotes with 32 scales per 128 tokens and K
// block, and the decode into registers sits in the same warps' chain (bench/NOTES.md v13). Here a
// token's scale lies on the accumulator rows: two per thread and K block, one FFMA per accumulator.
// Decoding FP4 into shared memory inside this loop costs more than half the tensor rate (v14), so
// the weights are decoded once per call by the predecode pass and arrive here by bulk copy.
//
// CTA tile: 128 tokens (two consumer warpgroups of 64, wgmma M) x 256 weight rows (two halves of
// 128, one SS m64n128k32 group each per K block; a 256-wide group would need a 128-register
// temporary beside the 128 accumulators). Producer warpgroup: warp 0 lane 0 TMAs the activation
// tile (two 64-row boxes) and bulk-copies the weight tile (32 KB); warp 1 stages the token scales
// as fp32 with the expert base folded in (producer.cuh); warps 2-3 are the epilogue warps: the
// consumers leave each item's tile in bf16 in a staging buffer and go on to the next item's
// mainloop while these two warps write the layer's output from it (prefill_rows.cuh). Registers
// 56 / 224 (at 40 the scale and epilogue warps spilled; the mainloop needs no more than 224). The
// staging buffer (64 KB) leaves room for 3 stages.
//
// Numerics are the fast mode's (gemm_sm90.cuh): the E4M3 weights are the bytes the scaled tables
// give, the four k32 products of a K block accumulate in the tensor core and are promoted with one
// FMA by the token's fp32 scale, and after the mainloop each row (here: column) is multiplied by
// 2^(B_r - B_e) <= 1.
#pragma once

#include <cstdint>

#include "../common/ptx.cuh"
#include "../common/ue8m0.cuh"
#include "../epilogue/prefill_rows.cuh"
#include "contract.cuh"
#include "producer.cuh"
#include "scheduler.cuh"
#include "wgmma_fp8_ss.cuh"

namespace megamoe {

constexpr int kPrefillTokens = 128;   // tokens per CTA tile (wgmma M: two warpgroups of 64)
constexpr int kPrefillRows = 256;     // weight rows per CTA tile (wgmma N: two halves of 128)
constexpr int kPrefillHalf = 128;
constexpr int kPrefillTileBytes = kPrefillRows * kBlockK;   // one predecoded weight tile

// The stage ring: activations | weights (E4M3, 128-byte swizzle) | fp32 token scales (linear: the
// scale of token tok at tok; the scale warps write them through scale_index). The scale warps
// write the item's tile (pick_tile: its valid rows rounded up to a power of two, 0 past the valid
// ones); the consumers promote all 128 rows, so rows past that tile take whatever an earlier stage
// left there: their accumulators are never written out (the epilogues store valid rows only).
struct PrefillRing {
  static constexpr int kX = kPrefillTokens * kBlockK;
  static constexpr int kW = kPrefillTileBytes;
  static constexpr int kSxWords = kPrefillTokens;
  static constexpr int kStage = kX + kW + kSxWords * 4;
  static constexpr int kScaleWarps = 1;   // warps 2-3 are the epilogue warps
  static constexpr int kFullArrivals = 1 + kScaleWarps;
  __device__ __forceinline__ static int scale_index(int tok, int, int) {
    return tok;
  }

  uint8_t* x;
  uint8_t* w;
  float* sx;
  uint64_t* full;
  uint64_t* empty;
};

constexpr int kPrefillEpilogueWarps = 2;   // warps 2-3 of the producer warpgroup

template <int kLayer>
struct PrefillConfig {
  static constexpr int kThreads = 384;
  static constexpr int kScheduleBytes = (static_cast<int>(sizeof(Schedule)) + 15) / 16 * 16;
  // The staging buffer and its two barriers (epi_full, epi_empty) beside the ring.
  static constexpr int kEpilogueBytes = kPrefillStagingBytes + 16;
  static constexpr int kStagesFit = (kSmemLimit - kScheduleBytes - kEpilogueBytes) / (PrefillRing::kStage + 16);
  static constexpr int kStages = kStagesFit < kMaxStages ? kStagesFit : kMaxStages;
  static constexpr int kSmemBytes = kStages * (PrefillRing::kStage + 16) + kEpilogueBytes + kScheduleBytes;
  static_assert(kStages >= 3, "the stage ring");
  static_assert(PrefillRing::kX % 1024 == 0 && PrefillRing::kW % 1024 == 0, "swizzle atoms stay aligned");
  static constexpr int kProducerRegs = 56;
  static constexpr int kConsumerRegs = 224;
  static_assert(128 * kProducerRegs + 256 * kConsumerRegs <= kThreads * ((65536 / kThreads) / 8 * 8),
                "setmaxnreg budget exceeds the launch allocation");
};

// Shared memory at compile-time offsets from dyn_smem (1024-byte aligned: no static shared memory).
extern __shared__ __align__(1024) uint8_t dyn_smem[];

template <typename Cfg>
struct PrefillSmem {
  PrefillRing ring;
  uint8_t* staging;
  uint64_t* epi_full;    // the consumers' 256 arrivals: an item's tile is staged
  uint64_t* epi_empty;   // the epilogue warps' 64 arrivals: the staging buffer is free
  Schedule* sched;

  __device__ __forceinline__ PrefillSmem() {
    constexpr int S = Cfg::kStages;
    ring.x = dyn_smem;                                                        // [S][128 x 128]
    ring.w = ring.x + S * PrefillRing::kX;                                    // [S][256 x 128]
    staging = ring.w + S * PrefillRing::kW;                                   // [128][256] bf16
    ring.sx = reinterpret_cast<float*>(staging + kPrefillStagingBytes);       // [S][128]
    ring.full = reinterpret_cast<uint64_t*>(ring.sx + S * PrefillRing::kSxWords);
    ring.empty = ring.full + S;
    epi_full = ring.empty + S;
    epi_empty = epi_full + 1;
    sched = reinterpret_cast<Schedule*>(epi_empty + 1);
  }
};

// The predecoded tile of (expert, K block, block of 256 rows).
__device__ __forceinline__ const uint8_t* prefill_weight_tile(const GemmParams& p, int expert, int kb, int n_block) {
  const int64_t tiles = (static_cast<int64_t>(expert) * (p.k / kBlockK) + kb) * (p.n_rows / kPrefillRows) + n_block;
  return p.w_e4m3 + tiles * kPrefillTileBytes;
}

// One item of one consumer warpgroup (tokens 64 wg .. 64 wg + 63 of the tile, all 256 rows):
// acc[h][4j + 2r + c] is token 16 wq + g + 8r of the warpgroup, weight row 128 h + 8j + 2t + c.
template <typename Cfg>
__device__ __forceinline__ void prefill_mainloop(const GemmParams& p, const PrefillRing& ring, RingCursor& cur, int wg,
                                                 int sx0, float (&acc)[2][kPrefillHalf / 2]) {
  constexpr int S = Cfg::kStages;
  const int num_kb = p.k / kBlockK;
  float tmp[kPrefillHalf / 2];
#pragma unroll
  for (int h = 0; h < 2; ++h)
#pragma unroll
    for (int i = 0; i < kPrefillHalf / 2; ++i) acc[h][i] = 0.0f;
  for (int kb = 0; kb < num_kb; ++kb) {
    const int s = cur.stage;
    // The same for the whole warpgroup: broadcast, so ptxas keeps the descriptors in uniform
    // registers beside the wgmma (from threadIdx they cost R2URs).
    const uint32_t a_lo =
        __shfl_sync(0xFFFFFFFFu, ptx::smem_desc_sw128_lo(ring.x + s * PrefillRing::kX + wg * 64 * kBlockK), 0);
    const uint32_t b_lo = __shfl_sync(0xFFFFFFFFu, ptx::smem_desc_sw128_lo(ring.w + s * PrefillRing::kW), 0);
    const float* sx = ring.sx + s * PrefillRing::kSxWords + sx0;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      // Before each half (the second's passes at once): the wait's branch ends the block, so ptxas
      // cannot hoist this half's wgmmas above the last half's promotion, which would need a second
      // temporary (measured in the prefill probe: 256 bytes of spills).
      ptx::mbar_wait(&ring.full[s], cur.phase, kWaitFull, s, p.err);
      ptx::wgmma_fence();
#pragma unroll
      for (int ks = 0; ks < 4; ++ks) {
        const uint64_t da = ptx::smem_desc_sw128_from_lo(a_lo + 2 * ks);
        const uint64_t db = ptx::smem_desc_sw128_from_lo(b_lo + h * (kPrefillHalf * kBlockK >> 4) + 2 * ks);
        if (ks == 0)
          WgmmaSS<kPrefillHalf>::mma_overwrite(tmp, da, db);
        else
          WgmmaSS<kPrefillHalf>::mma(tmp, da, db, 1);
      }
      ptx::wgmma_commit();
      const float s0 = sx[0];
      const float s1 = sx[8];
      ptx::wgmma_wait<0>();
#pragma unroll
      for (int i = 0; i < kPrefillHalf / 2; ++i) ptx::fence_operand(tmp[i]);
#pragma unroll
      for (int i = 0; i < kPrefillHalf / 2; ++i) acc[h][i] = __fmaf_rn(tmp[i], (i & 2) ? s1 : s0, acc[h][i]);
#pragma unroll
      for (int i = 0; i < kPrefillHalf / 2; ++i) ptx::fence_operand(acc[h][i]);
    }
    if (ptx::elect_one()) ptx::mbar_arrive(&ring.empty[s]);
    cur.advance<S>();
  }
}

// The kernel body; kernel/gemm/instantiate_prefill.cu.in wraps it in an extern "C" __global__.
template <int kLayer, bool kFastMath, bool kDebug>
__device__ __forceinline__ void gemm_sm90_prefill_body(const GemmParams& p) {
  using Cfg = PrefillConfig<kLayer>;
  constexpr int S = Cfg::kStages;
  {
    const PrefillSmem<Cfg> sm;
    if (threadIdx.x == 0) {
      if (ptx::dynamic_smem_size() < static_cast<uint32_t>(Cfg::kSmemBytes) || (ptx::smem_addr(dyn_smem) & 1023u) != 0)
        ptx::report_trap(p.err, kLayoutCheck, static_cast<int>(ptx::smem_addr(dyn_smem) & 1023u), Cfg::kSmemBytes,
                         static_cast<int>(ptx::dynamic_smem_size()));
      for (int s = 0; s < S; ++s) {
        ptx::mbar_init(&sm.ring.full[s], PrefillRing::kFullArrivals);
        ptx::mbar_init(&sm.ring.empty[s], 8);   // one arrive per consumer warp
      }
      ptx::mbar_init(sm.epi_full, 256);
      ptx::mbar_init(sm.epi_empty, 32 * kPrefillEpilogueWarps);
      ptx::fence_mbar_init();
    }
    if (threadIdx.x < 32)
      build_schedule<kPrefillTokens>(
          *sm.sched, p.num_experts, [&](int e) { return __ldg(p.expert_offsets + e); },
          [&](int e) { return __ldg(p.num_tokens + e); });
  }
  __syncthreads();

  RingCursor cur;
  const int num_kb = p.k / kBlockK;
  const int n_rb = p.n_rows / kPrefillRows;
  if (threadIdx.x < 128) {
    ptx::setmaxnreg_dec<Cfg::kProducerRegs>();
    const PrefillSmem<Cfg> sm;
    const int num_items = sm.sched->num_items(n_rb);
    const int warp = threadIdx.x / 32;
    const int lane = threadIdx.x % 32;
    if (warp == 0 && lane == 0) {
      ptx::prefetch_tma_desc(&p.tmap_x64);
      for (int item = blockIdx.x; item < num_items; item += gridDim.x) {
        const WorkItem wi = decode_item<kPrefillTokens, kPrefillRows>(item, *sm.sched, n_rb);
        wait_token_block(p, wi);   // returns at once: the prefill path has no arrival gate (gemm.py)
        for (int kb = 0; kb < num_kb; ++kb) {
          const int s = cur.stage;
          ptx::mbar_wait(&sm.ring.empty[s], cur.phase ^ 1, kWaitEmpty, s, p.err);
          ptx::mbar_arrive_expect_tx(&sm.ring.full[s], PrefillRing::kX + PrefillRing::kW);
          // Always both boxes: rows past the expert's (or the pool's: zeros) are computed, never written.
#pragma unroll
          for (int b = 0; b < 2; ++b)
            ptx::tma_load_2d(sm.ring.x + s * PrefillRing::kX + b * kChunkN * kBlockK, &p.tmap_x64, kb * kBlockK,
                             wi.row0 + b * kChunkN, &sm.ring.full[s]);
          ptx::bulk_g2s(sm.ring.w + s * PrefillRing::kW, prefill_weight_tile(p, wi.expert, kb, wi.n_block),
                        PrefillRing::kW, &sm.ring.full[s]);
          cur.advance<S>();
        }
      }
    } else if (warp == 1) {
      stage_token_scales<kPrefillTokens, kPrefillRows, S, false>(p, sm.ring, *sm.sched, cur, warp, lane);
    } else if (warp >= 2) {
      const uint32_t staging = ptx::smem_addr(sm.staging);
      uint32_t phase = 0;
      for (int item = blockIdx.x; item < num_items; item += gridDim.x) {
        const WorkItem wi = decode_item<kPrefillTokens, kPrefillRows>(item, *sm.sched, n_rb);
        ptx::mbar_wait(sm.epi_full, phase, kWaitFull, -1, p.err);
        if constexpr (kLayer == 1)
          prefill_l1_out<kFastMath>(p, wi, staging, warp - 2, lane);
        else
          prefill_l2_out(p, wi, staging, warp - 2, lane);
        ptx::mbar_arrive(sm.epi_empty);
        phase ^= 1;
      }
    }
    return;
  }
  ptx::setmaxnreg_inc<Cfg::kConsumerRegs>();
  const PrefillSmem<Cfg> sm;
  const int ctid = ptx::thread_idx() - 128;
  const int wg = ctid / 128;
  const int num_items = sm.sched->num_items(n_rb);
  // The warpgroup's first token row of the thread: 16 wq + g (the other is + 8).
  const int sx0 = 64 * wg + 16 * (ctid / 32 % 4) + ctid % 32 / 4;
  uint32_t phase = 0;
  for (int item = blockIdx.x; item < num_items; item += gridDim.x) {
    const WorkItem wi = decode_item<kPrefillTokens, kPrefillRows>(item, *sm.sched, n_rb);
    float acc[2][kPrefillHalf / 2];
    prefill_mainloop<Cfg>(p, sm.ring, cur, wg, sx0, acc);
    prefill_stage_tile<kLayer, kDebug>(p, wi, acc, ptx::smem_addr(sm.staging), sm.epi_empty, sm.epi_full, phase);
    phase ^= 1;
  }
}

}  // namespace megamoe
