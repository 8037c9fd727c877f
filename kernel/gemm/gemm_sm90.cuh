// SM90 grouped GEMM: FP8 (E4M3, per-32 UE8M0) activations x FP4 (E2M1, per-32 UE8M0) weights,
// fp32 accumulation, with the fused L1 (SwiGLU + requant, SPEC D6) or L2 (bf16 combine rows, D8)
// epilogue. This file is the kernel layer only: it lays out shared memory, assigns the roles and
// walks the work items; the pieces are
//   scheduler.cuh  the work items (per-item token tile) and the arrival gate,
//   producer.cuh   TMA / bulk copies of each stage and the fp32 token scales,
//   mainloop.cuh   the consumers' pipelined FP4 decode + wgmma + promotion,
//   ../epilogue/   the layer's epilogue.
//
// Orientation (swap-AB): weight rows are the wgmma M dimension (64 per consumer warpgroup), pool
// rows (tokens) are the wgmma N dimension. The weights travel packed (FP4) into shared memory and
// are decoded to E4M3 in registers (prmt byte lookup), so they are the register (A) operand of an
// RS wgmma; the activations are the shared-memory (B) operand, K-major, written by a 2-D TMA with
// the 128-byte swizzle (the fused narrow engine's items of at most two tokens: step tiles without
// swizzle, which the scale warp builds from that TMA tile, producer.cuh StageRing).
//
// Warp specialisation: 128 x (1 + kWGs) threads. Warpgroup 0 is the producer; warpgroups 1 .. kWGs
// are consumers, each owning 64 of the CTA's 64 kWGs weight rows (kWGs = 2, or 4 for token tiles
// up to 64 in the fast mode and 8 in the exact mode, or 3 in the fused narrow engine, whose L1
// epilogue an idle producer warp runs: kEpilogueWarp). Stages (BK = 128) are handed over through
// full / empty mbarriers. Token tiles 8 .. 128 (two per kernel), the four-warpgroup tiles 16 .. 64
// (fast mode; one mainloop, each item as wide as its rows) and the wide tile 256 (fast mode;
// charged per 64-token chunk): see scheduler.cuh and the serial schedule in mainloop.cuh.
//
// Promotion (kPerK32 = true, promotion "k32", the exact mode): every k32 product is added into the
// fp32 result with both per-32 scales. kPerK32 = false ("k128", the fast mode): each weight row r
// has a base byte B_r (its largest per-32 scale) and its groups are decoded through scaled tables
// relative to it (fp4 x 2^(6 - (B_r - s_g)), exact within 14 binades); the activations are rebased
// per K128 (rebase_k128); the four k32 products of a K128 block accumulate in the tensor core and
// are promoted with one FMA per accumulator by the token's fp32 scale 2^(sx - 127 + B_e - 133),
// where B_e is the expert's largest row base. After the mainloop each row is multiplied by
// 2^(B_r - B_e) <= 1, which is exact (both factors are powers of two) unless the result is
// subnormal. The reference of this operand rule is megamoe.reference.quantize.dequantize_fp4_fast.
#pragma once

#include <cstdint>
#include <type_traits>

#include "../common/ptx.cuh"
#include "../common/ue8m0.cuh"
#include "../epilogue/epilogue.cuh"
#include "contract.cuh"
#include "mainloop.cuh"
#include "producer.cuh"
#include "scheduler.cuh"

namespace megamoe {

// Everything about a specialisation that follows from its template arguments: tile, stage ring,
// register split and shared-memory layout. kLayer 1 or 2 is a standalone GEMM of that layer; 0 is
// the fused kernel, which runs both layers' items through one ring (its epilogue staging is the
// larger of the two). The host reads kSmemBytes from the cubin (megamoe_smem_bytes), so nothing
// here is mirrored in Python.
template <int kLayer, int kMaxN, bool kPerK32, int kWGs_>
struct GemmConfig {
  static constexpr int kWGs = kWGs_;
  static constexpr bool kFused = kLayer == 0;
  static_assert(kWGs >= 2 && kWGs <= 4, "consumer warpgroups");
  static constexpr int kThreads = 128 * (1 + kWGs);
  static constexpr int kRows = kRowsPerWg * kWGs;   // weight rows per CTA
  using Ring = StageRing<kMaxN, kRows, kPerK32>;
  static constexpr int kEpiPerWg =
      kLayer != 0
          ? kEpilogueBytes<kLayer, kMaxN>
          : (kEpilogueBytes<1, kMaxN> > kEpilogueBytes<2, kMaxN> ? kEpilogueBytes<1, kMaxN> : kEpilogueBytes<2, kMaxN>);
  static constexpr int kScheduleBytes = (static_cast<int>(sizeof(Schedule)) + 15) / 16 * 16;
  // Every swap-AB kernel takes its items in the dynamic order (scheduler.cuh claim_item), through
  // the TMA thread's item queue.
  // The fused narrow engine hands each L1 tile to an idle warp of the producer warpgroup (warp 2; the
  // scale warp is warp 1), which writes it (l1_stage_handoff, then prefill_l1_out), so that the
  // consumers go on to the next item: two L1Handoff buffers, used in turn. One warp writes every
  // part of an item, so the last part's release covers them all (the L1-completion count's meaning);
  // a part's D6 takes it ~1-2 µs, its mainloop several.
  static constexpr bool kEpilogueWarp = kFused && kMaxN == kSmallTile;
  static_assert(!kEpilogueWarp || Ring::kScaleWarps == 1, "warp 2 is free");
  static_assert(!kEpilogueWarp || kPerK32, "its prefill_l1_out writes no rebased L2 operand (fast mode)");
  static constexpr int kHandoffBytes = kEpilogueWarp ? 2 * static_cast<int>(sizeof(L1Handoff)) : 0;
  // Besides the ring: the consumers' done barrier (16 bytes, keeping the staging 16-byte aligned),
  // the epilogue staging, the scaled tables, the schedule, the item queue, the L1 handoff.
  static constexpr int kFixedBytes =
      16 + kWGs * kEpiPerWg + kLutEntries * 8 + kScheduleBytes + kItemQueueBytes + kHandoffBytes;
  // A stage's barriers: full and empty, and with step-major columns the token tile's (16 bytes, so
  // that what follows stays 16-byte aligned).
  static constexpr int kBarrierBytes = Ring::kSteps ? 32 : 16;
  static constexpr int kStagesFit = (kSmemLimit - kFixedBytes) / (Ring::kStage + kBarrierBytes);
  // The fused narrow engine takes every stage that fits (14 of its 15 KB stages): its T = 8 calls
  // stream the weights with the consumers waiting at the full barrier (bench/NOTES.md v47); 12
  // stages took ~0.8 us more of gpt-oss's T = 8 on the H200 (NOTES v57).
  static constexpr int kStageCap = kEpilogueWarp ? kStagesFit : kMaxStages;
  static constexpr int kStages = kStagesFit < kStageCap ? kStagesFit : kStageCap;
  static constexpr int kSmemBytes = kStages * (Ring::kStage + kBarrierBytes) + kFixedBytes;
  static_assert(kStages >= 2, "the stage ring does not fit in shared memory");
  static_assert(kSmemBytes <= kSmemLimit, "shared memory");
  // setmaxnreg moves registers inside the CTA's launch allocation (threads x launch count): what
  // the consumers gain, the producer must give up. 2 WGs: 384 x 168 -> 128 x 56 + 256 x 224, or
  // for the wide tile (its 128 accumulators) 128 x 40 + 256 x 232, where the TMA thread's and the
  // scale warps' loops are written to fit 40; 3 WGs: 512 x 128 -> 128 x 56 + 384 x 152; 4 WGs:
  // 640 x 96 -> 128 x 40 + 512 x 104. (The fused kernel's producer warpgroup also runs the dispatch
  // tail and the combine.)
  static constexpr int kLaunchRegs = (65536 / kThreads) / 8 * 8;   // what ptxas allocates (compile gate)
  static constexpr bool kWide = kMaxN > kWideTile;
  static constexpr int kProducerRegs = kWGs == 4 || kWide ? 40 : 56;
  static constexpr int kConsumerRegs = kWGs == 4 ? 104 : kWGs == 3 ? 152 : kWide ? 232 : 224;
  static_assert(128 * kProducerRegs + 128 * kWGs * kConsumerRegs <= kThreads * kLaunchRegs,
                "setmaxnreg budget exceeds the launch allocation");
  static_assert(kMaxN <= (kPerK32 ? kMaxTileExact : kMaxTileFast), "the promotion's largest token tile");
  static_assert(kWGs == 2 || kMaxN <= (kPerK32 ? kMaxWgs4TileExact : kMaxWgs4TileFast),
                "the largest token tile of four consumer warpgroups");
};

// The kernels' dynamic shared memory. They have no static shared memory, so it starts the CTA's
// window and is 1024-byte aligned (the 128-byte swizzle atoms need it; checked in gemm_setup).
extern __shared__ __align__(1024) uint8_t dyn_smem[];

// The CTA's shared memory, carved at compile-time offsets from dyn_smem: addresses are immediates,
// not registers. Each role builds its own copy where it needs it, so no pointer is held (in
// registers) across a role's work.
template <typename Cfg>
struct GemmSmem {
  typename Cfg::Ring ring;
  uint64_t* done;   // the consumers' last item is written (fused kernel; run_consumer)
  uint8_t* epi;     // [kWGs][kEpiPerWg] epilogue staging
  uint2* lut;       // the fast mode's scaled tables
  Schedule* sched;
  ItemQueue* queue;   // the dynamic order's (scheduler.cuh)
  L1Handoff* handoff;   // [2]: the narrow engine's L1 tiles to its epilogue warp (Cfg::kEpilogueWarp)

  __device__ __forceinline__ GemmSmem() {
    uint8_t* smem = dyn_smem;
    using Ring = typename Cfg::Ring;
    constexpr int kStages = Cfg::kStages;
    ring.x = smem;                                                     // [kStages][Ring::kX]
    ring.w = ring.x + kStages * Ring::kX;                              // [kStages][rows * 64]
    ring.wsf = ring.w + kStages * Ring::kW;                            // [kStages][rows * 4]
    ring.sx = reinterpret_cast<float*>(ring.wsf + kStages * Ring::kWsf);   // [kStages][kSxWords]
    ring.full = reinterpret_cast<uint64_t*>(ring.sx + kStages * Ring::kSxWords);
    ring.empty = ring.full + kStages;
    done = ring.empty + kStages + (Ring::kSteps ? 2 * kStages : 0);   // kSteps: x_full, padded to 16 B
    epi = reinterpret_cast<uint8_t*>(done + 2);
    lut = reinterpret_cast<uint2*>(epi + Cfg::kWGs * Cfg::kEpiPerWg);
    sched = reinterpret_cast<Schedule*>(lut + kLutEntries);
    queue = reinterpret_cast<ItemQueue*>(reinterpret_cast<uint8_t*>(sched) + Cfg::kScheduleBytes);
    handoff = reinterpret_cast<L1Handoff*>(reinterpret_cast<uint8_t*>(queue) + kItemQueueBytes);
  }
};

// Before the roles split: the layout check, the ring's barriers and the fast mode's tables (the
// schedule is the caller's). Thread 0 and warp 1 work here; the caller's __syncthreads publishes it.
template <typename Cfg, bool kPerK32>
__device__ __forceinline__ void gemm_setup(int* err) {
  const GemmSmem<Cfg> sm;
  const uint8_t* smem = dyn_smem;
  const int tid = threadIdx.x;
  if (tid == 0) {
    if (ptx::dynamic_smem_size() < static_cast<uint32_t>(Cfg::kSmemBytes) || (ptx::smem_addr(smem) & 1023u) != 0)
      ptx::report_trap(err, kLayoutCheck, static_cast<int>(ptx::smem_addr(smem) & 1023u), Cfg::kSmemBytes,
                       static_cast<int>(ptx::dynamic_smem_size()));
    for (int s = 0; s < Cfg::kStages; ++s) {
      ptx::mbar_init(&sm.ring.full[s], Cfg::Ring::kFullArrivals);
      ptx::mbar_init(&sm.ring.empty[s], 128 * Cfg::kWGs);   // every consumer thread (producer.cuh says why)
      if constexpr (Cfg::Ring::kSteps)
        ptx::mbar_init(sm.ring.template x_full<Cfg::kStages>(s), 1);  // the token side's expect_tx (issue_token_side)
    }
    ptx::mbar_init(sm.done, 4 * Cfg::kWGs);
    // Every reading warp: the scale warps, the consumers' and (kSplitIssue) the token side's.
    init_item_queue(*sm.queue, Cfg::Ring::kScaleWarps + 4 * Cfg::kWGs + (Cfg::Ring::kSplitIssue ? 1 : 0));
    if constexpr (Cfg::kEpilogueWarp) {
      for (int b = 0; b < 2; ++b) {
        ptx::mbar_init(&sm.handoff[b].full, 128 * Cfg::kWGs);  // every consumer thread
        ptx::mbar_init(&sm.handoff[b].empty, 32);  // the epilogue warp's lanes
      }
    }
    ptx::fence_mbar_init();
  } else if (tid == 32 && !kPerK32) {
#pragma unroll
    for (int d = 0; d < kLutEntries; ++d) sm.lut[d] = make_uint2(scaled_lut_lo(d), scaled_lut_hi(d));
  }
}

// One work item of one consumer warpgroup at token tile N: mainloop, the fast mode's row factors,
// the epilogue of layer kLayer (Cfg: the kernel's config, whose ring the mainloop drains).
// tl_item: the item's number among the CTA's (the timeline build's stamps; unused elsewhere).
// handoffs: the L1 tiles the consumers handed to the epilogue warp so far (Cfg::kEpilogueWarp).
template <int N, int kLayer, typename Cfg, int kMaxN, bool kPerK32, typename Act, bool kDebug, typename Ctx>
__device__ __forceinline__ void run_item(const Ctx& ctx, RingCursor& cur, const WorkItem& wi, bool steps, int tl_item,
                                         int& handoffs) {
  float acc[N / 2];
  // The fast mode's row factors 2^(B_r - B_e) <= 1 are static weight data. In kernels of token
  // tiles up to 64 they are loaded before the mainloop, so that their global-memory latency hides
  // under it instead of stalling every consumer warp of the item at its end (short items: decode
  // sizes). In a kernel with the 128-token tile, three registers held across any of its mainloops
  // cost more per stage (253 -> 257 instructions at tile 128, bench.sass_stage) than one stall
  // per long item; nor in the four-warpgroup serial kernels (104 registers: the L1 epilogue spilled).
  constexpr bool kEarly = !kPerK32 && kMaxN <= kChunkN && !narrow_serial(kMaxN, Cfg::kRows);
  int row_base_a = 0, row_base_b = 0, expert_base = 0;
  auto load_row_bases = [&] {
    const GemmParams& p = *ctx.p;
    const uint8_t* rb = p.w_row_base + static_cast<int64_t>(wi.expert) * p.n_rows + wi.n_block * Cfg::kRows;
    expert_base = __ldg(p.w_expert_base + wi.expert);
    // After the mainloop the thread's row is re-read from threadIdx (held across the wide tile's
    // mainloop it is spilled).
    const int row_a = kEarly ? ctx.row_a : consumer_row_a(ptx::thread_idx());
    row_base_a = __ldg(rb + row_a);
    row_base_b = __ldg(rb + row_a + 8);
  };
  if constexpr (kEarly) load_row_bases();
  constexpr bool kHandoff = kLayer == 1 && Cfg::kEpilogueWarp;
  uint2 bias{};  // raw bf16 bits (handoff_bias)
  if constexpr (kHandoff && Act::kOai) bias = handoff_bias<Cfg::kRows>(*ctx.p, wi);
  // The narrow engine's L2 items: D8's global operands, once the item's first stage is in
  // (l2_combine_rows.cuh L2Operands).
  constexpr bool kL2Early = kLayer == 2 && Cfg::kEpilogueWarp;
  L2Operands l2_ops{};
  if constexpr (kL2Early) {
    ptx::mbar_wait(&ctx.ring.full[cur.stage], cur.phase, kWaitFull, cur.stage, ctx.p->err);
    l2_ops = l2_operands<Cfg::kRows, Act>(*ctx.p, wi);
  }
  mainloop<N, kMaxN, Cfg::kRows, Cfg::kStages, kPerK32>(ctx, cur, ctx.p->k / kBlockK, wi.tile, steps, acc);
  if (wi.last) timeline::item_stamp_at(tl_item, kTlItemComputed, 128);
  if constexpr (!kPerK32) {
    if constexpr (!kEarly) load_row_bases();
    const float fa = exp2i(row_base_a - expert_base);
    const float fb = exp2i(row_base_b - expert_base);
#pragma unroll
    for (int i = 0; i < N / 2; ++i) acc[i] = __fmul_rn(acc[i], (i & 2) ? fb : fa);
  }
  if constexpr (kHandoff) {
    // The n-th handoff: buffer n % 2, at that buffer's (n / 2)-th use. The epilogue warp stamps the
    // item's `written`.
    const int n = handoffs++;
    l1_stage_handoff<Cfg::kRows, Act, kDebug>(*ctx.p, wi, acc, bias, GemmSmem<Cfg>().handoff[n % 2], (n / 2) & 1,
                                              tl_item);
  } else {
    // The warpgroup and its epilogue staging, from threadIdx after the mainloop, so that neither is
    // an argument held across it (measured: the four-warpgroup fused kernel's spills, 244 bytes, the
    // same either way; kept as the simpler signature).
    const int wg = ptx::thread_idx() / 128 - 1;
    uint8_t* s_epi_wg = GemmSmem<Cfg>().epi + wg * Cfg::kEpiPerWg;
    layer_epilogue<kLayer, N, Cfg::kRows, kPerK32, Act, kDebug, Cfg::kFused, kL2Early>(*ctx.p, wi, acc, s_epi_wg, wg,
                                                                                       l2_ops);
    if (wi.last) timeline::item_stamp_at(tl_item, kTlItemWritten, 128);
  }
}

// The consumer side of a launch's items, as one loop: layer kLayerA's (standalone), or those of
// kLayerA and then those of kLayerB (the fused kernel: L1, then L2), in the dynamic order the TMA
// thread posts them (scheduler.cuh). One loop and nothing after it: ptxas gives the consumers'
// setmaxnreg budget only to a region that ends there (a second loop or any code after the loop made
// it fall back to the launch's 168 registers and spill; measured on the fused kernel). So the work
// that follows the items is signalled from inside the loop: after its last item each consumer warp
// arrives on the `done` barrier (kLayerB: the fused kernel's producer warpgroup waits on it). Nothing
// that can be re-read from shared memory is held across the items (the four-warpgroup kernels have
// 104 registers a thread, and the mainloop spilled with the item count and the barrier's address
// held): the launch's item count and an item's layer are read from the schedule where needed.
// kBlock: the schedule's token block, when wider than kMaxN (the fused narrow engine: each item in
// parts, scheduler.cuh item_part). kPartial: a layer's last block of weight rows may be partial (the
// narrow engine's 192-row CTA tiles over a layout padded to 128 rows: scheduler.cuh row_blocks).
template <typename Cfg, int kMaxN, bool kPerK32, typename Act, bool kDebug, int kLayerA, int kLayerB = 0,
          int kBlock = kMaxN, bool kPartial = false>
__device__ __forceinline__ void run_consumer(const GemmParams& pa, const GemmParams& pb, RingCursor& cur) {
  constexpr bool kTwo = kLayerB != 0;
  const GemmSmem<Cfg> sm;
  const int ctid = ptx::thread_idx();
  const int wg = ctid / 128 - 1;  // weight rows [64 wg, 64 wg + 64) of the CTA tile
  const int wq = ctid / 32 % 4;  // warp within the warpgroup: rows 16 wq .. 16 wq + 15
  const int clane = ctid % 32;
  ConsumerCtx<kMaxN, Cfg::kRows, Cfg::kStages, kPerK32> ctx;
  ctx.ring = sm.ring;
  ctx.lut = reinterpret_cast<const uint8_t*>(sm.lut);
  ctx.rg = wg * 4 + wq;
  ctx.row_a = consumer_row_a(ctid);
  ctx.lane = clane;
  ctx.t = clane % 4;
  int item = blockIdx.x;
  int taken = 0;  // items taken from the queue
  // Cfg::kEpilogueWarp: L1 tiles handed to the epilogue warp, and whether its loop still runs
  // (stopped at the CTA's first L2 item, or after its last item).
  int handoffs = 0;
  bool handing = Cfg::kEpilogueWarp;
  auto stop_handoffs = [&] {
    if (!handing) return;
    handing = false;
    l1_stop_handoff(pa, GemmSmem<Cfg>().handoff[handoffs % 2], (handoffs / 2) & 1);
  };
  // One instantiation of the mainloop and epilogue per (layer, token tile), each with its layer's
  // parameters known at compile time (kernel parameter space: read as constants, where a pointer
  // chosen at run time held two registers across the mainloop and made every field a load).
  auto run = [&](auto layer_c, int local) {
    constexpr int L = decltype(layer_c)::value;
    const GemmParams& p = kTwo && L == kLayerB ? pb : pa;
    ctx.p = &p;
    const WorkItem item_wi =
        decode_item<kMaxN, Cfg::kRows, kBlock>(local, *GemmSmem<Cfg>().sched, row_blocks<Cfg::kRows, kPartial>(p));
    const bool steps = step_part(item_wi.valid);
    for (int part = 0; part < item_parts<kMaxN, kBlock>(item_wi); ++part) {
      const WorkItem wi = item_part<kMaxN, kBlock>(item_wi, part);
      if (kMaxN == kSmallTile || serial_tile(kMaxN, Cfg::kRows) || wi.tile == kMaxN)
        run_item<kMaxN, L, Cfg, kMaxN, kPerK32, Act, kDebug>(ctx, cur, wi, steps, taken, handoffs);
      else
        run_item<kSmallTile, L, Cfg, kMaxN, kPerK32, Act, kDebug>(ctx, cur, wi, steps, taken, handoffs);
    }
  };
  while (item < launch_items<Cfg::kRows, kTwo, kPartial>(*GemmSmem<Cfg>().sched, pa, pb)) {
    const int na = layer_items<Cfg::kRows, kPartial>(*GemmSmem<Cfg>().sched, pa);  // the branch is uniform
    if (!kTwo || item < na) {
      run(std::integral_constant<int, kLayerA>{}, item);
    } else {
      stop_handoffs();
      run(std::integral_constant<int, (kTwo ? kLayerB : kLayerA)>{}, item - na);
    }
    item = next_posted(*GemmSmem<Cfg>().queue, taken++);
    if (kTwo && item >= launch_items<Cfg::kRows, kTwo, kPartial>(*GemmSmem<Cfg>().sched, pa, pb)) {  // the CTA's last
      stop_handoffs();
      __syncwarp();
      if (ptx::thread_idx() % 32 == 0) ptx::mbar_arrive(GemmSmem<Cfg>().done);
    }
  }
}

// The fused narrow engine's epilogue warp (producer warp 2): D6 of every L1 tile the consumers hand
// it (l1_stage_handoff), in their order, until the `stop`. A CTA without items gets no handoff, not
// even the stop.
template <typename Cfg, typename Act, bool kPartial>
__device__ __forceinline__ void run_epilogue_warp(const GemmParams& pa, const GemmParams& pb) {
  const GemmSmem<Cfg> sm;
  if (static_cast<int>(blockIdx.x) >= launch_items<Cfg::kRows, true, kPartial>(*sm.sched, pa, pb)) return;
  const int lane = threadIdx.x % 32;
  for (int n = 0;; ++n) {
    L1Handoff& h = sm.handoff[n % 2];
    ptx::mbar_wait(&h.full, (n / 2) & 1, kWaitFull, -1, pa.err);
    if (h.stop) break;
    const WorkItem wi = h.wi;
    prefill_l1_out<Act, false, Cfg::kWGs, 256, kSmallTile, 1>(pa, wi, ptx::smem_addr(h.tile), 0, lane);
    __syncwarp();
    count_l1_tiles<Cfg::kWGs, kSmallTile>(pa, wi, lane);
    if (wi.last) timeline::item_stamp_at(h.tl_item, kTlItemWritten, 32);
    ptx::mbar_arrive(&h.empty);
  }
}

// The standalone kernel body; kernel/gemm/instantiate.cu.in wraps it in one extern "C" __global__
// per specialisation (p must be the kernel's __grid_constant__ parameter: the TMA reads its
// descriptor).
template <int kLayer, int kMaxN, bool kPerK32, typename Act, bool kDebug, int kWGs>
__device__ __forceinline__ void gemm_sm90_body(const GemmParams& p) {
  using Cfg = GemmConfig<kLayer, kMaxN, kPerK32, kWGs>;
  gemm_setup<Cfg, kPerK32>(p.err);
  if (threadIdx.x < 32)
    build_schedule<kMaxN>(
        *GemmSmem<Cfg>().sched, p.num_experts, [&](int e) { return __ldg(p.expert_offsets + e); },
        [&](int e) { return __ldg(p.expert_rows + e); });
  __syncthreads();

  // Each role reads what it needs after its setmaxnreg: a value held across it is spilled.
  RingCursor cur;
  if (threadIdx.x / 32 < 4) {
    ptx::setmaxnreg_dec<Cfg::kProducerRegs>();
    const GemmSmem<Cfg> sm;
    run_producer<kMaxN, Cfg::kRows, Cfg::kStages, kPerK32, false>(p, p, sm.ring, *sm.sched, cur, sm.queue);
    return;
  }
  ptx::setmaxnreg_inc<Cfg::kConsumerRegs>();
  run_consumer<Cfg, kMaxN, kPerK32, Act, kDebug, kLayer>(p, p, cur);
}

}  // namespace megamoe
