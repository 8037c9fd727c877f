// The layer's epilogue of one consumer warpgroup's tile: L1 (D6, SwiGLU + requant) or L2 (D8, bf16
// combine rows), and its staging bytes per consumer warpgroup.
#pragma once

#include "l1_swiglu_requant.cuh"
#include "l2_combine_rows.cuh"
#include "prefill_rows.cuh"

namespace megamoe {

// Staging per consumer warpgroup for token tiles up to kMaxN (the epilogues work in chunks of 64).
template <int kLayer, int kMaxN>
constexpr int kEpilogueBytes =
    kLayer == 1 ? kL1EpilogueBytes<chunk_width(kMaxN)> : kL2EpilogueBytes<chunk_width(kMaxN)>;

// Act: the activation policy (activation.cuh). kFused: the fused kernel's epilogue (the L1 tile also signals its pool block's L1 completion).
// kL2Early: an L2 tile whose D8 operands the caller loaded before its mainloop (`l2_ops`, l2_operands).
template <int kLayer, int N, int kRows, bool kPerK32, typename Act, bool kDebug, bool kFused, bool kL2Early = false>
__device__ __forceinline__ void layer_epilogue(const GemmParams& p, const WorkItem& wi, float (&acc)[N / 2],
                                               uint8_t* s_epi_wg, int wg, L2Operands l2_ops = {}) {
  if constexpr (kLayer == 1)
    l1_epilogue<N, kRows, kPerK32, Act, kDebug, kFused>(p, wi, acc, s_epi_wg, wg);
  else
    l2_epilogue<N, kRows, Act, kDebug, kL2Early>(p, wi, acc, s_epi_wg, wg, l2_ops);
}

}  // namespace megamoe
