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

// The combine's loads in flight: one load at a time made it latency-bound (a fifth of the prefill
// engine's time at 8192 tokens, ncu: 128 threads an SM, each waiting for one 16-byte row), and the
// tail's registers (40 in the four-warpgroup kernel) hold few rows. So the rows land in shared
// memory by cp.async, which costs no register: a thread's chunk (a token's 8 channels) is cut into
// units of up to kUnitSlots slots, and kCombineSlots / kUnitSlots units are in flight, each unit's
// copies one commit group, laid out [unit][slot][thread] (a warp's 16-byte accesses on distinct
// banks), each slot's topk_idx entry beside its row ([unit][slot][thread], 8 bytes, after all the
// rows). Units of 8 slots, or of 4 where K <= 4 (twice as many chunks in flight in the same shared
// memory: at top-4 half of the 8-slot units' memory sat unused, bench/NOTES.md v40).
// Every slot's row is copied and a slot whose entry is negative is skipped where the rows are
// summed: a copy sized by the entry waited for the entry's load before it was issued, a round trip
// a unit (ncu at gpt-oss T = 4096: the combine at ~1.4 TB/s; bench/NOTES.md v39). A skipped slot's
// row is read and not used: the combine buffer's (zeroed when the workspace was made, or an earlier
// call's).
constexpr int kCombineSlots = 32;   // a thread's slots in flight
template <int kThreads>
constexpr int kCombineRowBytes = kCombineSlots * kThreads * 16;
template <int kThreads>
constexpr int kCombineSmemBytes = kCombineRowBytes<kThreads> + kCombineSlots * kThreads * 8;

// combine_tokens (below) in units of kUnitSlots slots. kOneGroup: K <= kUnitSlots, so a chunk is one
// unit (every top-k up to 8): unit u is chunk first + u * stride, and its token is kept by adding the
// stride's whole tokens and chunks (one division before the loop, where each unit divided by the
// chunks of a token and by the units of a chunk: ~340 instructions a unit, a warp an SMSP, NOTES v43).
// A chunk's row k starts at 8 c + k T_max H of combine [K, T_max, H] (t H + 8 (c - t H / 8) = 8 c).
template <int kThreads, int kUnitSlots, bool kOneGroup>
__device__ __forceinline__ void combine_tokens_in_units(const FusedParams& fp, int tid, uint8_t* smem) {
  constexpr int kCombineUnits = kCombineSlots / kUnitSlots;   // units in flight
  const int H = fp.hidden;
  const int K = fp.top_k;
  const int per_unit = kOneGroup || K < kUnitSlots ? K : kUnitSlots;
  const int groups = kOneGroup ? 1 : (K + per_unit - 1) / per_unit;   // units of one chunk
  // 32-bit counts (T H / 8 < 2^31: T_max H is a workspace region's size): the tail runs at the
  // producer's registers.
  const int per_token = H / 8;   // chunks of a token
  const int chunks = fp.num_tokens * per_token;
  const int first = static_cast<int>(blockIdx.x) * kThreads + tid;
  const int stride = static_cast<int>(gridDim.x) * kThreads;
  const int units = (first < chunks ? (chunks - 1 - first) / stride + 1 : 0) * groups;
  const int64_t slot_stride = static_cast<int64_t>(fp.max_tokens) * H;   // combine's k stride
  const uint32_t base = ptx::smem_addr(smem) + 16 * tid;
  const uint32_t idx_base = ptx::smem_addr(smem) + kCombineRowBytes<kThreads> + 8 * tid;
  // kOneGroup: the next unit's chunk and token (issue side), and the next finished chunk (sums).
  const int stride_tokens = stride / per_token, stride_rest = stride % per_token;
  int issue_c = first, issue_t = first / per_token, issue_r = first % per_token;
  int sum_c = first;
  float acc[8];
#pragma unroll
  for (int i = 0; i < 8; ++i) acc[i] = 0.0f;
  for (int u = 0; u < units + kCombineUnits - 1; ++u) {
    if (u < units) {   // unit u's copies
      int c, t, k0;
      if constexpr (kOneGroup) {
        c = issue_c, t = issue_t, k0 = 0;
        issue_c += stride;
        issue_t += stride_tokens;
        issue_r += stride_rest;
        if (issue_r >= per_token) issue_r -= per_token, ++issue_t;
      } else {
        c = first + (u / groups) * stride;
        t = c / per_token;
        k0 = (u % groups) * per_unit;
      }
      const uint32_t dst = base + 16 * kThreads * kUnitSlots * (u % kCombineUnits);
      const uint32_t idx_dst = idx_base + 8 * kThreads * kUnitSlots * (u % kCombineUnits);
      // The owners wrote these rows during this launch: read through L2 (cp.async.cg). Element
      // (k0 + j, t, 8 (c % (H / 8))) of combine [K, T_max, H] (ws_combine_index), written out here
      // (above: 8 c + k T_max H), which is what lets the loop keep no token's remainder.
      const uint16_t* src = fp.ws_combine + k0 * slot_stride + 8 * static_cast<int64_t>(c);
      const int64_t* idx = fp.topk_idx + static_cast<int64_t>(t) * K + k0;
#pragma unroll
      for (int j = 0; j < kUnitSlots; ++j) {
        if (j >= per_unit || k0 + j >= K) break;
        ptx::cp_async_16(dst + 16 * kThreads * j, src + j * slot_stride, 16u);
        ptx::cp_async_8(idx_dst + 8 * kThreads * j, idx + j);
      }
    }
    ptx::cp_async_commit();
    if (u < kCombineUnits - 1) continue;
    ptx::cp_async_wait<kCombineUnits - 1>();   // unit v has landed
    const int v = u - (kCombineUnits - 1);
    const int k0 = kOneGroup ? 0 : (v % groups) * per_unit;
    const uint32_t src = base + 16 * kThreads * kUnitSlots * (v % kCombineUnits);
    const uint32_t idx_src = idx_base + 8 * kThreads * kUnitSlots * (v % kCombineUnits);
#pragma unroll
    for (int j = 0; j < kUnitSlots; ++j) {
      if (j >= per_unit || k0 + j >= K) break;
      // The entry's high word holds its sign: -1 (no expert) skips the slot.
      if (static_cast<int>(ptx::ld_shared_u32(idx_src + 8 * kThreads * j + 4)) < 0) continue;
      const uint4 w = ptx::ld_shared_v4(src + 16 * kThreads * j);
      const uint32_t words[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
      for (int i = 0; i < 4; ++i) {   // bf16 pairs, the lower channel in the low half
        acc[2 * i] = __fadd_rn(acc[2 * i], __uint_as_float(words[i] << 16));
        acc[2 * i + 1] = __fadd_rn(acc[2 * i + 1], __uint_as_float(words[i] & 0xFFFF0000u));
      }
    }
    if (kOneGroup || v % groups == groups - 1) {   // the chunk's last unit: y, then a fresh sum
      // token c / (H / 8), channels 8 (c % (H / 8)) ..: y's 16 bytes at 8 c
      const int c = kOneGroup ? sum_c : first + (v / groups) * stride;
      sum_c += stride;
      uint4 out;
      __nv_bfloat162* o = reinterpret_cast<__nv_bfloat162*>(&out);
#pragma unroll
      for (int i = 0; i < 4; ++i) o[i] = __floats2bfloat162_rn(acc[2 * i], acc[2 * i + 1]);
      *reinterpret_cast<uint4*>(fp.y + 8 * static_cast<int64_t>(c)) = out;
#pragma unroll
      for (int i = 0; i < 8; ++i) acc[i] = 0.0f;
    }
  }
}

// tid / kThreads: this thread among the CTA's threads that run the tail; smem: kCombineSmemBytes
// free bytes of shared memory. Skipping a slot is adding +0.0 to the sum, which leaves its bits as
// they are (it starts at +0.0, so it is never -0.0): SPEC D9's sum over the valid slots in
// ascending k.
template <int kThreads>
__device__ __forceinline__ void combine_tokens(const FusedParams& fp, int tid, uint8_t* smem) {
  if (fp.top_k <= 4)
    combine_tokens_in_units<kThreads, 4, true>(fp, tid, smem);
  else if (fp.top_k <= 8)
    combine_tokens_in_units<kThreads, 8, true>(fp, tid, smem);
  else
    combine_tokens_in_units<kThreads, 8, false>(fp, tid, smem);
}

// Every counter region of the workspace goes back to zero after the call (D10): arrivals, l1_done
// and rebase_count here, the call's signal words by its last CTA (megamoe_sm90.cuh). A counter
// region added to contract.py WORKSPACE fails this until it is cleared too and named here.
static_assert(kWsCounters == (kWsArrivals | kWsL1Done | kWsRebaseCount | kWsSignals),
              "a counter region that cleanup_counters or the last CTA does not clear");

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
