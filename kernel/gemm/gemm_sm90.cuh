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
// the 128-byte swizzle.
//
// Warp specialisation: 128 x (1 + kWGs) threads. Warpgroup 0 is the producer; warpgroups 1 .. kWGs
// are consumers, each owning 64 of the CTA's 64 kWGs weight rows (kWGs = 2, or 4 when every item
// is an 8-token tile). Stages (BK = 128) are handed over through full / empty mbarriers.
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

#include "../common/ptx.cuh"
#include "../common/ue8m0.cuh"
#include "../epilogue/epilogue.cuh"
#include "contract.cuh"
#include "mainloop.cuh"
#include "producer.cuh"
#include "scheduler.cuh"

namespace megamoe {

// Everything about a specialisation that follows from its template arguments: tile, stage ring,
// register split and shared-memory layout. The host reads kSmemBytes from the cubin
// (megamoe_smem_bytes, kernel/gemm/instantiate.cu.in), so nothing here is mirrored in Python.
template <int kLayer, int kMaxN, bool kPerK32, int kWGs>
struct GemmConfig {
  static_assert(kWGs == 2 || kWGs == 4, "consumer warpgroups");
  static constexpr int kThreads = 128 * (1 + kWGs);
  static constexpr int kRows = kRowsPerWg * kWGs;   // weight rows per CTA
  using Ring = StageRing<kMaxN, kRows, kPerK32>;
  static constexpr int kEpiPerWg = kEpilogueBytes<kLayer, kMaxN>;
  // Besides the ring: the epilogue staging, the scaled tables, the schedule's tables.
  static constexpr int kFixedBytes = kWGs * kEpiPerWg + kLutEntries * 8 + (2 * kMaxExperts + 1) * 4;
  static constexpr int kStagesFit = (kSmemLimit - kFixedBytes) / (Ring::kStage + 16);
  static constexpr int kStages = kStagesFit < kMaxStages ? kStagesFit : kMaxStages;
  static constexpr int kSmemBytes = kStages * (Ring::kStage + 16) + kFixedBytes;
  static_assert(kStages >= 2, "the stage ring does not fit in shared memory");
  static_assert(kSmemBytes <= kSmemLimit, "shared memory");
  // setmaxnreg moves registers inside the CTA's launch allocation (threads x launch count): what
  // the consumers gain, the producer must give up. 2 WGs: 384 x 168 -> 128 x 56 + 256 x 224;
  // 4 WGs: 640 x 96 -> 128 x 40 + 512 x 104.
  static constexpr int kLaunchRegs = (65536 / kThreads) / 8 * 8;   // what ptxas allocates (compile gate)
  static constexpr int kProducerRegs = kWGs == 2 ? 56 : 40;
  static constexpr int kConsumerRegs = kWGs == 2 ? 224 : 104;
  static_assert(128 * kProducerRegs + 128 * kWGs * kConsumerRegs <= kThreads * kLaunchRegs,
                "setmaxnreg budget exceeds the launch allocation");
  static_assert(kWGs == 2 || kMaxN == kSmallTile, "four consumer warpgroups hold 8-token tiles only");
};

// One work item of one consumer warpgroup at token tile N: mainloop, the fast mode's row factors,
// epilogue.
template <int N, int kLayer, int kMaxN, bool kPerK32, bool kFastMath, bool kDebug, int kWGs, typename Ctx>
__device__ __forceinline__ void run_item(const Ctx& ctx, RingCursor& cur, const WorkItem& wi, uint8_t* s_epi_wg,
                                         int wg) {
  using Cfg = GemmConfig<kLayer, kMaxN, kPerK32, kWGs>;
  float acc[N / 2];
  mainloop<N, kMaxN, Cfg::kRows, Cfg::kStages, kPerK32>(ctx, cur, ctx.p->k / kBlockK, acc);
  if constexpr (!kPerK32) {
    // The rows' factors 2^(B_r - B_e) <= 1 (static weight data), read after the mainloop so that
    // nothing is held across it.
    const GemmParams& p = *ctx.p;
    const uint8_t* rb = p.w_row_base + static_cast<int64_t>(wi.expert) * p.n_rows + wi.n_block * Cfg::kRows;
    const int be = __ldg(p.w_expert_base + wi.expert);
    const float fa = exp2i(static_cast<int>(__ldg(rb + ctx.row_a)) - be);
    const float fb = exp2i(static_cast<int>(__ldg(rb + ctx.row_a + 8)) - be);
#pragma unroll
    for (int i = 0; i < N / 2; ++i) acc[i] = __fmul_rn(acc[i], (i & 2) ? fb : fa);
  }
  layer_epilogue<kLayer, N, Cfg::kRows, kFastMath, kDebug>(*ctx.p, wi, acc, s_epi_wg, wg);
}

// The kernel body; kernel/gemm/instantiate.cu.in wraps it in one extern "C" __global__ per
// specialisation (p must be the kernel's __grid_constant__ parameter: the TMA reads its descriptor).
template <int kLayer, int kMaxN, bool kPerK32, bool kFastMath, bool kDebug, int kWGs>
__device__ __forceinline__ void gemm_sm90_body(const GemmParams& p) {
  using Cfg = GemmConfig<kLayer, kMaxN, kPerK32, kWGs>;
  using Ring = typename Cfg::Ring;
  constexpr int kStages = Cfg::kStages;
  constexpr int kRows = Cfg::kRows;

  // The kernel has no static shared memory, so the dynamic array starts the CTA's window and is
  // 1024-byte aligned (the 128-byte swizzle atoms need it; checked below). Every buffer is at a
  // compile-time offset from it, so addresses are immediates, not registers.
  extern __shared__ __align__(1024) uint8_t smem[];
  Ring ring;
  ring.x = smem;                                                     // [kStages][kMaxN * 128]
  ring.w = ring.x + kStages * Ring::kX;                              // [kStages][rows * 64]
  ring.wsf = ring.w + kStages * Ring::kW;                            // [kStages][rows * 4]
  ring.sx = reinterpret_cast<float*>(ring.wsf + kStages * Ring::kWsf);   // [kStages][kSxWords]
  ring.full = reinterpret_cast<uint64_t*>(ring.sx + kStages * Ring::kSxWords);
  ring.empty = ring.full + kStages;
  uint8_t* s_epi = reinterpret_cast<uint8_t*>(ring.empty + kStages);      // [kWGs][kEpiPerWg]
  uint2* s_lut = reinterpret_cast<uint2*>(s_epi + kWGs * Cfg::kEpiPerWg);  // fast mode's scaled tables
  int* s_prefix = reinterpret_cast<int*>(s_lut + kLutEntries);       // [E + 1] first item of each expert
  int* s_nblk = s_prefix + kMaxExperts + 1;                          // [E] token blocks of each expert

  const int tid = threadIdx.x;
  const int warp = tid / 32;
  const int n_row_blocks = p.n_rows / kRows;

  if (tid == 0) {
    if (ptx::dynamic_smem_size() < static_cast<uint32_t>(Cfg::kSmemBytes) || (ptx::smem_addr(smem) & 1023u) != 0)
      ptx::report_trap(p.err, kLayoutCheck, static_cast<int>(ptx::smem_addr(smem) & 1023u), Cfg::kSmemBytes,
                       static_cast<int>(ptx::dynamic_smem_size()));
    for (int s = 0; s < kStages; ++s) {
      ptx::mbar_init(&ring.full[s], 2);          // the TMA thread (expect_tx) + the scale warp
      ptx::mbar_init(&ring.empty[s], 4 * kWGs);  // one arrive per consumer warp
    }
    ptx::fence_mbar_init();
    build_schedule<kMaxN>(p, n_row_blocks, s_prefix, s_nblk);
  } else if (tid == 32 && !kPerK32) {
#pragma unroll
    for (int d = 0; d < kLutEntries; ++d) s_lut[d] = make_uint2(scaled_lut_lo(d), scaled_lut_hi(d));
  }
  __syncthreads();

  // Each role reads what it needs after its setmaxnreg: a value held across it is spilled.
  if (warp < 4) {
    ptx::setmaxnreg_dec<Cfg::kProducerRegs>();
    run_producer<kMaxN, kRows, kStages, kPerK32>(p, ring, s_prefix, s_nblk, s_prefix[p.num_experts]);
    return;
  }
  ptx::setmaxnreg_inc<Cfg::kConsumerRegs>();
  const int ctid = ptx::thread_idx();
  const int wg = ctid / 128 - 1;     // weight rows [64 wg, 64 wg + 64) of the CTA tile
  const int wq = ctid / 32 % 4;      // warp within the warpgroup: rows 16 wq .. 16 wq + 15
  const int clane = ctid % 32;
  ConsumerCtx<kMaxN, kRows, kStages, kPerK32> ctx;
  ctx.ring = ring;
  ctx.lut = reinterpret_cast<const uint8_t*>(s_lut);
  ctx.p = &p;
  ctx.rg = wg * 4 + wq;
  ctx.row_a = ctx.rg * 16 + clane / 4;
  ctx.lane = clane;
  ctx.t = clane % 4;
  uint8_t* s_epi_wg = s_epi + wg * Cfg::kEpiPerWg;
  RingCursor cur;
  for (int item = blockIdx.x; item < s_prefix[p.num_experts]; item += gridDim.x) {
    const WorkItem wi = decode_item<kMaxN>(item, s_prefix, s_nblk, p);
    // One instantiation of the mainloop and epilogue per token tile; the branch is uniform.
    if (kMaxN == kSmallTile || wi.tile == kMaxN)
      run_item<kMaxN, kLayer, kMaxN, kPerK32, kFastMath, kDebug, kWGs>(ctx, cur, wi, s_epi_wg, wg);
    else
      run_item<kSmallTile, kLayer, kMaxN, kPerK32, kFastMath, kDebug, kWGs>(ctx, cur, wi, s_epi_wg, wg);
  }
}

}  // namespace megamoe
