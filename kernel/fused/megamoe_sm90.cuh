// The fused MegaMoE layer for SM90 (SPEC §3), one persistent launch per call on every rank. This
// file is the kernel layer only: it orders the phases and hands each to its piece:
//   dispatch.cuh    stage / count / layout / pull (D1-D4), every thread of every CTA;
//   ../gemm/        the GEMM core's roles over L1 items, then L2 items, through one stage ring:
//                   the L1 TMA waits on each pool block's arrival counter, the L1 epilogue
//                   (SwiGLU + requant, D6) counts its tiles in the block's L1-completion counter,
//                   the L2 TMA waits until that counter is full, the L2 epilogue writes bf16 rows
//                   into the token's rank's combine buffer (D8);
//   combine.cuh     after every rank's CTAs finished their L2 tiles: y (D9), the counters' cleanup
//                   and the receive statistics (D10).
// Between the phases, two system-scope counters per call (sync.cuh): dispatch posted (the layout
// needs every rank's counts) and L2 done (the combine needs every rank's rows). Each CTA's last
// thread out clears its call's signal words; the signals alternate between two sets by call parity,
// so a peer that runs ahead into its next call never touches words this call still uses.
//
// Every CTA must be resident at once (the counters are waited on by all of them): the host
// launches one CTA per SM, cooperatively. L1 items never wait on L2 items, and each CTA runs all
// its L1 items before its L2 items, so the gates cannot deadlock.
#pragma once

#include <cstdint>

#include "../common/ptx.cuh"
#include "../gemm/contract.cuh"
#include "../gemm/gemm_sm90.cuh"
#include "combine.cuh"
#include "dispatch.cuh"
#include "sync.cuh"

namespace megamoe {

// Two consumer warpgroups at token tile kFusedMaxN = BLOCK_M, so a token block is one pool block
// and its L1-completion count is I / 32 whatever the tile of its items. kPerK32: the exact
// promotion (k32), else the fast one (k128: the pull and the L1 epilogue also write the operands
// rebased per 128 channels, which the GEMMs read).
template <bool kPerK32>
using FusedConfig = GemmConfig<0, kFusedMaxN, kPerK32, 2>;
constexpr int kTailBarrier = 3;   // named barrier of the producers' tail (1 + wg are the epilogues')

template <bool kPerK32, bool kFastMath, bool kDebug>
__device__ __forceinline__ void megamoe_fused_body(const FusedParams& fp) {
  using Cfg = FusedConfig<kPerK32>;
  gemm_setup<Cfg, kPerK32>(fp.l1.err);
  // Until the GEMM starts, the ring's activation buffers are the dispatch's scratch.
  int* scratch = reinterpret_cast<int*>(GemmSmem<Cfg>().ring.x);
  const int groups = fp.local_experts * fp.num_ranks;
  const PullTables tables{scratch + 64, scratch + 64 + groups + 1};

  stage_inputs(fp);
  count_and_list(fp, scratch);
  __syncthreads();
  if (threadIdx.x < 32) {
    if (threadIdx.x == 0) {
      int* sig = call_signals(fp, call_epoch(fp));
      signal_all_ranks(fp, sig, kSignalPosted);
      wait_counter_sys(sig + kSignalPosted, fp.num_ranks * gridDim.x, kWaitDispatch, fp.rank, fp.l1.err);
      build_layout(fp, *GemmSmem<Cfg>().sched, tables);
    }
    __syncwarp();
    Schedule& sched = *GemmSmem<Cfg>().sched;
    build_schedule<kFusedMaxN>(
        sched, fp.local_experts, [&](int e) { return sched.offset[e]; }, [&](int e) { return sched.count[e]; });
  }
  __syncthreads();
  pull_rows<!kPerK32>(fp, tables);
  ptx::fence_proxy_async_smem();   // the scratch's generic writes before the TMA's into the ring
  __syncthreads();

  // The GEMM roles, L1 items then L2 items. The consumers end with their item loop (see
  // run_consumer: a region that does anything after it loses its registers); the producer
  // warpgroup finishes the call once the consumers' last item is written.
  RingCursor cur;
  if (threadIdx.x / 32 >= 4) {
    ptx::setmaxnreg_inc<Cfg::kConsumerRegs>();
    run_consumer<Cfg, kFusedMaxN, kPerK32, kFastMath, kDebug, 1, 2>(fp.l1, fp.l2, cur, GemmSmem<Cfg>().done);
    return;
  }
  ptx::setmaxnreg_dec<Cfg::kProducerRegs>();
  run_producer<kFusedMaxN, Cfg::kRows, Cfg::kStages, kPerK32>(fp.l1, GemmSmem<Cfg>().ring, *GemmSmem<Cfg>().sched, cur);
  run_producer<kFusedMaxN, Cfg::kRows, Cfg::kStages, kPerK32>(fp.l2, GemmSmem<Cfg>().ring, *GemmSmem<Cfg>().sched, cur);

  constexpr int kTail = 128;
  const int tail_tid = ptx::thread_idx();
  {
    const GemmSmem<Cfg> sm;
    const int b = blockIdx.x;
    if (b < sm.sched->num_items(fp.l1.n_rows / Cfg::kRows) || b < sm.sched->num_items(fp.l2.n_rows / Cfg::kRows))
      ptx::mbar_wait(sm.done, 0, kWaitL2Done, -1, fp.l1.err);
  }
  if (tail_tid == 0) {
    int* sig = call_signals(fp, call_epoch(fp));
    signal_all_ranks(fp, sig, kSignalL2Done);
    wait_counter_sys(sig + kSignalL2Done, fp.num_ranks * gridDim.x, kWaitL2Done, fp.rank, fp.l1.err);
  }
  ptx::named_barrier(kTailBarrier, kTail);
  combine_tokens(fp, tail_tid, kTail);
  cleanup_counters<kDebug>(fp, *GemmSmem<Cfg>().sched, tail_tid, kTail);
  ptx::named_barrier(kTailBarrier, kTail);
  if (tail_tid == 0) {
    const int epoch = call_epoch(fp);
    int* sig = call_signals(fp, epoch);
    __threadfence();
    if (atomicAdd(sig + kSignalExit, 1) == static_cast<int>(gridDim.x) - 1) {
      // Last CTA of this rank's call: every CTA passed both waits, so nothing reads these words
      // again in this call, and peers add into them only in the call after next.
      sig[kSignalPosted] = 0;
      sig[kSignalL2Done] = 0;
      sig[kSignalExit] = 0;
      fp.ws_epoch[0] = epoch + 1;
    }
  }
}

}  // namespace megamoe
