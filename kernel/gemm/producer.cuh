// The producer warpgroup of the grouped GEMM: fills the ring of pipeline stages (BK = 128) that the
// consumers (or the transform warpgroup) drain.
//   warp 0, lane 0: 2-D TMA of the activation tile (BN pool rows x 128 B, 128-byte swizzle), 1-D
//                   bulk copies of the packed FP4 weights and their scale bytes;
//   warp 1:         the activation scale words, by cp.async whose completion arrives on the
//                   stage's full barrier (so the warp runs ahead like the TMA thread).
// A stage's full barrier expects 1 + 32 arrivals (the TMA thread's expect_tx, the scale warp) plus
// the transaction bytes; the empty barrier is released by whoever reads the stage last.
#pragma once

#include <cstdint>

#include "../common/ptx.cuh"
#include "params.cuh"
#include "scheduler.cuh"

namespace megamoe {

constexpr int kBlockK = 128;   // K per pipeline stage (4 wgmma k32 steps)

// Where stage s of each producer-filled buffer lives.
template <int BN, int kBlockRows>
struct StageRing {
  static constexpr int kX = BN * kBlockK;                 // e4m3 activations, 128B swizzled
  static constexpr int kW = kBlockRows * kBlockK / 2;     // packed FP4, kernel layout
  static constexpr int kWsf = kBlockRows * 4;             // weight scale bytes [row][4]
  static constexpr int kXsf = BN * 4;                     // activation scale words [token]
  uint8_t* x;
  uint8_t* w;
  uint8_t* wsf;
  uint32_t* xsf;
  uint64_t* full;
  uint64_t* empty;
};

// Exact mode (kPerK32Scales): the scale word of (row, K128 block) = its four per-32 bytes. Fast
// mode: the aligned word holding the rebased byte of (row, kb) (num_kb % 4 == 0: byte kb % 4).
template <int BN, int kBlockRows, int kStages, bool kPerK32Scales>
__device__ __forceinline__ void run_producer(const GemmParams& p, const StageRing<BN, kBlockRows>& r,
                                             const int* s_prefix, const int* s_nblk, int num_items) {
  using R = StageRing<BN, kBlockRows>;
  const int warp = (threadIdx.x / 32) % 4;
  const int lane = threadIdx.x % 32;
  const int num_kb = static_cast<int>(p.k / kBlockK);
  int stage = 0;
  uint32_t phase = 0;
  if (warp == 0 && lane == 0) {
    ptx::prefetch_tma_desc(&p.tmap_x);
    for (int item = blockIdx.x; item < num_items; item += gridDim.x) {
      const WorkItem wi = decode_item<BN>(item, s_prefix, s_nblk, p);
      wait_token_block(p, wi);
      const uint8_t* w_base =
          p.w + ((static_cast<int64_t>(wi.expert) * num_kb) * (p.n_rows / 16) + wi.n_block * (kBlockRows / 16)) * 1024;
      const uint8_t* wsf_base =
          p.w_sf + (static_cast<int64_t>(wi.expert) * num_kb * p.n_rows + wi.n_block * kBlockRows) * 4;
      for (int kb = 0; kb < num_kb; ++kb) {
        ptx::mbar_wait(&r.empty[stage], phase ^ 1, ptx::kWaitEmpty, stage, p.err);
        ptx::mbar_arrive_expect_tx(&r.full[stage], R::kX + R::kW + R::kWsf);
        ptx::tma_load_2d(r.x + stage * R::kX, &p.tmap_x, kb * kBlockK, wi.row0, &r.full[stage]);
        ptx::bulk_g2s(r.w + stage * R::kW, w_base + static_cast<int64_t>(kb) * p.n_rows * 64, R::kW, &r.full[stage]);
        ptx::bulk_g2s(r.wsf + stage * R::kWsf, wsf_base + static_cast<int64_t>(kb) * p.n_rows * 4, R::kWsf,
                      &r.full[stage]);
        if (++stage == kStages) { stage = 0; phase ^= 1; }
      }
    }
  } else if (warp == 1) {
    for (int item = blockIdx.x; item < num_items; item += gridDim.x) {
      const WorkItem wi = decode_item<BN>(item, s_prefix, s_nblk, p);
      // The scales arrive with the rows: the same gate as the TMA thread's.
      if (lane == 0) wait_token_block(p, wi);
      __syncwarp();
      for (int kb = 0; kb < num_kb; ++kb) {
        ptx::mbar_wait(&r.empty[stage], phase ^ 1, ptx::kWaitEmpty, stage, p.err);
        for (int i = lane; i < BN; i += 32) {
          const int64_t row = wi.row0 + min(i, wi.valid - 1);
          const uint8_t* src = kPerK32Scales ? p.x_sf + (row * num_kb + kb) * 4 : p.x_sf + row * num_kb + (kb & ~3);
          ptx::cp_async_4(r.xsf + stage * BN + i, src, i < wi.valid ? 4u : 0u);
        }
        ptx::cp_async_mbar_arrive(&r.full[stage]);
        if (++stage == kStages) { stage = 0; phase ^= 1; }
      }
    }
  }
}

}  // namespace megamoe
