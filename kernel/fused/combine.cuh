// The end of the fused kernel, after every rank's L2 rows have landed in this rank's combine buffer:
//   combine   D9: y[t] = bf16(sum over k ascending with topk_idx[t, k] >= 0 of float(combine[k][t]))
//             in fp32 RN adds from +0, 8 channels (16 bytes) per thread and step;
//   cleanup   D10: the pool's arrival and L1-completion counters back to zero (snapshotted first in
//             the debug build), the cumulative receive statistics += N_e.
// The call's signal words are cleared by its last CTA (megamoe_sm90.cuh), not here.
#pragma once

#include <cstdint>
#include <cuda_bf16.h>

#include "../gemm/contract.cuh"
#include "../gemm/scheduler.cuh"

namespace megamoe {

// tid / nthreads: this thread among the CTA's threads that run the tail.
__device__ __forceinline__ void combine_tokens(const FusedParams& fp, int tid, int nthreads) {
  const int H = fp.hidden;
  const int K = fp.top_k;
  const int64_t chunks = static_cast<int64_t>(fp.num_tokens) * (H / 8);
  const int64_t stride = static_cast<int64_t>(gridDim.x) * nthreads;
  for (int64_t c = static_cast<int64_t>(blockIdx.x) * nthreads + tid; c < chunks; c += stride) {
    const int64_t t = c / (H / 8);
    const int h = static_cast<int>(c - t * (H / 8)) * 8;
    float acc[8];
#pragma unroll
    for (int i = 0; i < 8; ++i) acc[i] = 0.0f;
    for (int k = 0; k < K; ++k) {
      if (__ldg(fp.topk_idx + t * K + k) < 0) continue;
      // A plain load: the owners wrote these rows during this launch.
      const uint4 v =
          *reinterpret_cast<const uint4*>(fp.ws_combine + (static_cast<int64_t>(k) * fp.max_tokens + t) * H + h);
      const __nv_bfloat162* b = reinterpret_cast<const __nv_bfloat162*>(&v);
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const float2 f = __bfloat1622float2(b[i]);
        acc[2 * i] = __fadd_rn(acc[2 * i], f.x);
        acc[2 * i + 1] = __fadd_rn(acc[2 * i + 1], f.y);
      }
    }
    uint4 out;
    __nv_bfloat162* o = reinterpret_cast<__nv_bfloat162*>(&out);
#pragma unroll
    for (int i = 0; i < 4; ++i) o[i] = __floats2bfloat162_rn(acc[2 * i], acc[2 * i + 1]);
    *reinterpret_cast<uint4*>(fp.y + t * H + h) = out;
  }
}

// Counters of the pool blocks this call used (the others were never raised), grid-strided.
template <bool kDebug>
__device__ __forceinline__ void cleanup_counters(const FusedParams& fp, const Schedule& sched, int tid, int nthreads) {
  const int used = sched.num_experts > 0
                       ? (sched.offset[sched.num_experts - 1] +
                          (sched.count[sched.num_experts - 1] + fp.block_m - 1) / fp.block_m * fp.block_m) /
                             fp.block_m
                       : 0;
  for (int b = blockIdx.x * nthreads + tid; b < used; b += gridDim.x * nthreads) {
    if constexpr (kDebug) {
      fp.ws_snap_arrivals[b] = fp.ws_arrivals[b];
      fp.ws_snap_l1_done[b] = fp.ws_l1_done[b];
    }
    fp.ws_arrivals[b] = 0;
    fp.ws_l1_done[b] = 0;
  }
  const int per_block = fp.intermediate / 128;   // the fast mode's rebase counters (zero in exact mode)
  for (int i = blockIdx.x * nthreads + tid; i < used * per_block; i += gridDim.x * nthreads) fp.ws_rebase_count[i] = 0;
  if (blockIdx.x == 0 && fp.record_stats) {
    for (int e = tid; e < sched.num_experts; e += nthreads) fp.ws_recv_stats[e] += sched.count[e];
  }
}

}  // namespace megamoe
