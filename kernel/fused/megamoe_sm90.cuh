// The fused MegaMoE layer for SM90 (SPEC §3), one persistent launch per call on every rank. This
// file is the kernel layer only: it orders the phases and hands each to its piece:
//   dispatch.cuh    stage / count / layout / pull (D1-D4), every thread of every CTA (one rank's
//                   few routing entries counted by every CTA itself: no dispatch counter);
//   a GEMM engine   the GEMM core's roles over L1 items, then L2 items, through one stage ring (the
//                   same roles as the standalone kernels: one kernel layer). The L1 producer waits on
//                   each pool block's arrival counter, the L1 epilogue (SwiGLU + requant, D6) counts
//                   its tiles in the block's L1-completion counter, the L2 producer waits until that
//                   counter is full, the L2 epilogue writes bf16 rows into the token's rank's
//                   combine buffer (D8). Three engines, chosen per call by the host (megamoe/moe.py):
//                     SwapAbEngine   ../gemm/gemm_sm90.cuh: weights as wgmma M, FP4 decoded in the
//                                    consumers, tokens as N up to 64 a pool block, two or four
//                                    consumer warpgroups, the dynamic item order (decode sizes); at
//                                    token tile 8 with three, the narrow engine (the exact mode's
//                                    smallest calls; its L1 epilogue in a producer warp);
//                     PrefillEngine  ../gemm/gemm_sm90_prefill.cuh: every weight decoded once per
//                                    call by every CTA after the pull (predecode.cuh; or kept
//                                    decoded from the layer's construction), then tokens as wgmma
//                                    M, 128 a CTA tile (prefill sizes);
//   combine.cuh     after every rank's CTAs finished their L2 tiles: y (D9), the counters' cleanup
//                   and the receive statistics (D10).
// Between the phases, two system-scope counters per call (sync.cuh): dispatch posted (the layout
// needs every rank's counts; a one-rank call that the swap-AB engines count locally skips it) and
// L2 done (the combine needs every rank's rows); the prefill engine adds a third, local one: every
// CTA decoded its share of the weights. Each CTA's last thread out
// clears its call's signal words; the signals alternate between two sets by call parity, so a peer
// that runs ahead into its next call never touches words this call still uses.
//
// Every CTA must be resident at once (the counters are waited on by all of them): the host
// launches one CTA per SM, cooperatively. L1 items never wait on L2 items, and the items are taken
// in an order in which every L1 item comes before every L2 item (scheduler.cuh), so the gates cannot
// deadlock.
#pragma once

#include <cstdint>

#include "../common/ptx.cuh"
#include "../common/timeline.cuh"
#include "../gemm/contract.cuh"
#include "../gemm/gemm_sm90.cuh"
#include "../gemm/gemm_sm90_prefill.cuh"
#include "../gemm/predecode.cuh"
#include "combine.cuh"
#include "dispatch.cuh"
#include "sync.cuh"

namespace megamoe {

// The named barrier of the producers' tail. The consumer warpgroups' epilogues take 1 + wg, so with
// three or four of them it is also warpgroup 2's: the tail starts after the consumers' `done`, which
// follows their last use of it.
constexpr int kTailBarrier = 3;
constexpr int kTailThreads = 128;  // the producer warpgroup

// The swap-AB engine: kWGs consumer warpgroups, token blocks of kFusedMaxN = BLOCK_M rows, so a
// token block is one pool block and its L1-completion count is I / 32 whatever the tile of its
// items. Token tile kMaxN: kFusedMaxN (with four warpgroups the serial mainloop runs an item at 8,
// 16, 32 or 64 tokens: scheduler.cuh pick_tile), or kSmallTile, the narrow engine (exact mode, three
// warpgroups): only 8-token mainloops (mainloop.cuh mainloop_k32_narrow, which beside the
// 64-token one made ptxas serialise the wgmmas, and for items of at most two tokens
// mainloop_k32_steps), a ring of 2 KB activation slots (the TMA's tile and four step tiles), an item of more
// than 8 rows in parts (scheduler.cuh item_part), and its L1 tiles written by producer warp 2
// (gemm_sm90.cuh run_epilogue_warp), so that the consumers go on to the next item.
// kPerK32: the exact promotion (k32), else the fast one (k128: the pull and the L1 epilogue also
// write the operands rebased per 128 channels, which the GEMMs read).
template <int kWGs, int kMaxN, bool kPerK32, typename Act, bool kDebug>
struct SwapAbEngine {
  static_assert(kMaxN == kFusedMaxN || (kMaxN == kSmallTile && kPerK32), "the token tiles: 64, or 8 (exact mode)");
  using Cfg = GemmConfig<0, kMaxN, kPerK32, kWGs>;
  static constexpr int kThreads = Cfg::kThreads, kSmemBytes = Cfg::kSmemBytes, kStages = Cfg::kStages;
  static constexpr int kTokenBlock = kFusedMaxN;
  // The exact mode's layouts are padded to 128 weight rows (SPEC §8's sizes: megamoe/jit/layout.py
  // padded_rows), so CTA tiles of three warpgroups (the narrow engine's 192 rows) may end in a
  // partial block (the fast mode's sizes fill its 256-row tiles).
  static constexpr bool kPartial = kWGs > 2 && kPerK32;
  static constexpr bool kPredecode = false;
  static constexpr bool kLocalDispatch = true;  // one rank's few routing entries: dispatch.cuh count_locally
  static_assert(Cfg::kStages * Cfg::Ring::kStage >= kCombineSmemBytes<kTailThreads>, "the combine's rows fit the ring");

  __device__ static void setup(int* err) {
    gemm_setup<Cfg, kPerK32>(err);
  }
  // Until the GEMM starts, the ring's activation buffers are the dispatch's scratch.
  __device__ static uint8_t* scratch() {
    return GemmSmem<Cfg>().ring.x;
  }
  __device__ static Schedule& sched() {
    return *GemmSmem<Cfg>().sched;
  }
  // The GEMM roles, L1 items then L2 items. Returns false in the consumers, which end with their
  // item loop (run_consumer: a region that does anything after it loses its registers; a
  // setmaxnreg.dec after it, to let them join the tail, cost the prefill engine's consumers their
  // budget), and true in the producer warpgroup once the CTA's items are written (the consumers'
  // `done` barrier).
  __device__ static bool run(const FusedParams& fp) {
    RingCursor cur;
    if (threadIdx.x / 32 >= 4) {
      ptx::setmaxnreg_inc<Cfg::kConsumerRegs>();
      run_consumer<Cfg, kMaxN, kPerK32, Act, kDebug, 1, 2, kTokenBlock, kPartial>(fp.l1, fp.l2, cur);
      return false;
    }
    ptx::setmaxnreg_dec<Cfg::kProducerRegs>();
    {
      const GemmSmem<Cfg> sm;
      run_producer<kMaxN, Cfg::kRows, Cfg::kStages, kPerK32, true, kTokenBlock, kPartial>(fp.l1, fp.l2, sm.ring,
                                                                                          *sm.sched, cur, sm.queue);
    }
    if constexpr (Cfg::kEpilogueWarp) {
      if (threadIdx.x / 32 == 2) run_epilogue_warp<Cfg, Act, kPartial>(fp.l1, fp.l2);
    }
    const GemmSmem<Cfg> sm;
    if (static_cast<int>(blockIdx.x) < launch_items<Cfg::kRows, true, kPartial>(*sm.sched, fp.l1, fp.l2))
      ptx::mbar_wait(sm.done, 0, kWaitL2Done, -1, fp.l1.err);
    return true;
  }
};

// The prefill engine: the weights of both layers decoded to E4M3 tiles by every CTA after the pull
// (fp.l1.w_e4m3, fp.l2.w_e4m3: megamoe/moe.py's scratch; or once, before the first call, by the
// standalone pass into the layer's own buffers: fp.weights_decoded), then the prefill kernel's roles over
// blocks of PrefillShape's tokens (two pool blocks; the exact mode's three) in the dynamic order; its
// epilogue warps count each pool block's L1 tiles (count_l1_tiles).
template <bool kPerK32, typename Act, bool kDebug>
struct PrefillEngine {
  using Cfg = PrefillConfig<0, kPerK32>;
  static constexpr int kThreads = Cfg::kThreads, kSmemBytes = Cfg::kSmemBytes, kStages = Cfg::kStages;
  static constexpr int kTokenBlock = PrefillShape<kPerK32>::kTokens;
  static constexpr bool kPredecode = true;
  // Never the local dispatch: its calls are large (the auto engine's choice from T), and the local
  // path's code moved ptxas's register banks in this engine's exact promotions (bench/NOTES.md v53).
  static constexpr bool kLocalDispatch = false;
  static_assert(Cfg::kStages * Cfg::Ring::kStage >= kCombineSmemBytes<kTailThreads>, "the combine's rows fit the ring");

  __device__ static void setup(int* err) {
    prefill_setup<Cfg>(err);
  }
  __device__ static uint8_t* scratch() {
    return PrefillSmem<Cfg>().ring.x;
  }
  __device__ static Schedule& sched() {
    return *PrefillSmem<Cfg>().sched;
  }
  __device__ static bool run(const FusedParams& fp) {
    if (!prefill_roles<Cfg, Act, kDebug, kPerK32, 1, 2>(fp.l1, fp.l2)) return false;
    ptx::named_barrier(kTailBarrier, kTailThreads);  // the epilogue warps wrote the CTA's last item
    return true;
  }
};

// Every weight of both layers to the prefill kernel's E4M3 tiles (predecode.cuh), warp w of the grid
// taking groups w, w + warps, ... of L1's then L2's, kPredecodeAhead groups' loads in flight, then
// the CTAs' count (local, gpu scope): the TMA thread (thread 0) bulk-copies tiles of any CTA, so it
// waits for every CTA's. smem: 2 KB per warp and the scaled tables, free until the GEMM starts.
constexpr int kPredecodeAhead = 4;

template <bool kPerK32>
__device__ __forceinline__ void predecode_layers(const FusedParams& fp, uint8_t* smem) {
  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  uint8_t* lut = smem;
  uint8_t* mine = smem + 1024 + warp * 2048;
  stage_scaled_luts(lut);
  __syncthreads();
  timeline::cta_stamp(kTlPulled);
  const int64_t g1 = static_cast<int64_t>(fp.l1.num_experts) * (fp.l1.k / kBlockK) * (fp.l1.n_rows / 16);
  const int64_t total = g1 + static_cast<int64_t>(fp.l2.num_experts) * (fp.l2.k / kBlockK) * (fp.l2.n_rows / 16);
  const int64_t nwarps = static_cast<int64_t>(gridDim.x) * (blockDim.x / 32);
  const int64_t g0 = static_cast<int64_t>(blockIdx.x) * (blockDim.x / 32) + warp;
  auto load = [&](int64_t g) {
    return g < g1 ? predecode_load<kPerK32>(fp.l1, g, lane) : predecode_load<kPerK32>(fp.l2, g - g1, lane);
  };
  PredecodeIn in[kPredecodeAhead];
#pragma unroll
  for (int j = 0; j < kPredecodeAhead; ++j)
    if (g0 + j * nwarps < total) in[j] = load(g0 + j * nwarps);
  for (int64_t g = g0; g < total; g += kPredecodeAhead * nwarps) {
#pragma unroll
    for (int j = 0; j < kPredecodeAhead; ++j) {
      const int64_t gj = g + j * nwarps;
      if (gj >= total) break;
      const PredecodeIn cur = in[j];
      if (gj + kPredecodeAhead * nwarps < total) in[j] = load(gj + kPredecodeAhead * nwarps);
      if (gj < g1)
        predecode_store<kPerK32>(fp.l1, gj, cur, mine, lut, lane);
      else
        predecode_store<kPerK32>(fp.l2, gj - g1, cur, mine, lut, lane);
    }
  }
  __syncthreads();
  timeline::cta_stamp(kTlDecoded);
  if (threadIdx.x == 0) {
    int* sig = call_signals(fp, call_epoch(fp));
    ptx::fence_proxy_async_global();
    ptx::red_release_gpu_add(sig + kSignalDecoded, 1);
    wait_counter(sig + kSignalDecoded, gridDim.x, false, kWaitDecoded, fp.rank, fp.l1.err);
    timeline::stamp(kTlDecodedAll);
    ptx::fence_proxy_async_global();  // the tiles were written by generic stores; TMA reads them
  }
}

template <typename Engine, bool kPerK32, bool kDebug>
__device__ __forceinline__ void megamoe_fused_body(const FusedParams& fp) {
  timeline::cta_stamp(kTlEntry);
  Engine::setup(fp.l1.err);
  int* scratch = reinterpret_cast<int*>(Engine::scratch());
  const int groups = fp.local_experts * fp.num_ranks;
  // The scratch's ints: count_and_list's first 64, then the pull's two tables of E_l R + 1.
  constexpr int kPullTablesAt = 64;
  const PullTables tables{scratch + kPullTablesAt, scratch + kPullTablesAt + groups + 1};

  // One rank's few entries counted by every CTA (dispatch.cuh LocalDispatch): past the pull's tables
  // at R = 1 (2 (E + 1) ints at most), from a 512-byte boundary; 4 KB of the scratch (every engine's
  // ring of activations is larger).
  const bool local = Engine::kLocalDispatch && local_dispatch(fp);
  constexpr int kLocalDispatchAt = (kPullTablesAt + 2 * (kMaxExperts + 1) + 127) / 128 * 128;
  const LocalDispatch ld{scratch + kLocalDispatchAt, scratch + kLocalDispatchAt + kLocalDispatchEntries,
                         scratch + kLocalDispatchAt + 2 * kLocalDispatchEntries,
                         scratch + kLocalDispatchAt + 2 * kLocalDispatchEntries + kMaxExperts};
  static_assert(Engine::kThreads >= kLocalDispatchEntries && Engine::kThreads >= kMaxExperts,
                "count_locally: a thread for each entry and for each expert");

  stage_inputs(fp);
  if (local)
    count_locally(fp, ld);
  else
    count_and_list(fp, scratch);
  __syncthreads();
  if (threadIdx.x < 32) {
    if (threadIdx.x == 0) {
      if (!local) {
        int* sig = call_signals(fp, call_epoch(fp));
        signal_all_ranks(fp, sig, kSignalPosted);
        wait_all_ranks(fp, sig, kSignalPosted, kWaitDispatch);
      }
      timeline::stamp(kTlPosted);
    }
    __syncwarp();
    build_layout(fp, Engine::sched(), tables, local ? ld.count : nullptr);
    __syncwarp();
    Schedule& sched = Engine::sched();
    build_schedule<Engine::kTokenBlock>(
        sched, fp.local_experts, [&](int e) { return sched.offset[e]; }, [&](int e) { return sched.count[e]; });
  }
  __syncthreads();
  if (local) {
    place_locally(fp, ld, tables.pair_prefix);
    __syncthreads();
  }
  timeline::cta_stamp(kTlScheduled);
  pull_rows<!kPerK32>(fp, tables, local ? ld.list : nullptr);
  if constexpr (Engine::kPredecode) {
    // Past the pull's tables (kPullTablesAt + 2 (groups + 1) ints, groups <= kMaxExperts x 8 ranks). Weights
    // decoded before the call (the standalone pass, a launch that ended before this one) skip it.
    if (!fp.weights_decoded) predecode_layers<kPerK32>(fp, Engine::scratch() + 20 * 1024);
  }
  ptx::fence_proxy_async_smem();  // the scratch's generic writes before the TMA's into the ring
  __syncthreads();
  timeline::cta_stamp(kTlGemm);

  if (!Engine::run(fp)) return;  // the consumers

  // The tail, in the producer warpgroup once the CTA's items are written. The combine's rows land in
  // shared memory (the ring's, free now) by cp.async, many in flight a thread (combine.cuh).
  const int tid = ptx::thread_idx();
  if (tid == 0) {
    timeline::stamp(kTlWritten);
    int* sig = call_signals(fp, call_epoch(fp));
    signal_all_ranks(fp, sig, kSignalL2Done);
    wait_all_ranks(fp, sig, kSignalL2Done, kWaitL2Done, ptx::kLastWaitTimeoutNs);
    timeline::stamp(kTlL2Done);
  }
  ptx::named_barrier(kTailBarrier, kTailThreads);
  combine_tokens<kTailThreads>(fp, tid, Engine::scratch());
  cleanup_counters<kDebug>(fp, Engine::sched(), tid, kTailThreads);
  ptx::named_barrier(kTailBarrier, kTailThreads);
  if (tid == 0) {
    timeline::stamp(kTlCombined);
    const int epoch = call_epoch(fp);
    int* sig = call_signals(fp, epoch);
    __threadfence();
    if (atomicAdd(sig + kSignalExit, 1) == static_cast<int>(gridDim.x) - 1) {
      // Last CTA of this rank's call: every CTA passed every wait, so nothing reads these words
      // again in this call, and peers add into them only in the call after next.
      sig[kSignalPosted] = 0;
      sig[kSignalL2Done] = 0;
      sig[kSignalDecoded] = 0;
      sig[kSignalExit] = 0;
      fp.ws_epoch[0] = epoch + 1;
    }
  }
}

}  // namespace megamoe
