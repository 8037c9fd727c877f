// The layer's epilogue of one consumer warpgroup's tile: L1 (D6, SwiGLU + requant) or L2 (D8, bf16
// combine rows), and its staging bytes per consumer warpgroup.
#pragma once

#include "l1_swiglu_requant.cuh"
#include "l2_combine_rows.cuh"

namespace megamoe {

template <int kLayer, int BN>
constexpr int kEpilogueBytes = kLayer == 1 ? kL1EpilogueBytes<BN> : kL2EpilogueBytes<BN>;

template <int kLayer, int BN, int kBlockRows, bool kFastSilu, bool kDebug>
__device__ __forceinline__ void layer_epilogue(const GemmParams& p, const WorkItem& wi, const float (&acc)[BN / 2],
                                               uint8_t* s_epi_wg, int wg) {
  if constexpr (kLayer == 1)
    l1_epilogue<BN, kBlockRows, kFastSilu, kDebug>(p, wi, acc, s_epi_wg, wg);
  else
    l2_epilogue<BN, kBlockRows, kDebug>(p, wi, acc, s_epi_wg, wg);
}

}  // namespace megamoe
