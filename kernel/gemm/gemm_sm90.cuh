// SM90 grouped GEMM: FP8 (E4M3, per-32 UE8M0) activations x FP4 (E2M1, per-32 UE8M0) weights,
// fp32 accumulation, with the fused L1 (SwiGLU + requant, SPEC D6) or L2 (bf16 combine rows, D8)
// epilogue.
//
// Orientation (swap-AB): weight rows are the wgmma M dimension (64 per consumer warpgroup, 128 per
// CTA), pool rows (tokens) are the wgmma N dimension (BN = 8..128 as used; the wrappers go to 256). The weights travel packed (FP4)
// into shared memory and are decoded to E4M3 in registers (prmt byte lookup), so they are the
// register (A) operand of an RS wgmma; the activations are the shared-memory (B) operand, K-major,
// written by a 2-D TMA with the 128-byte swizzle.
//
// Warp specialisation: 128 x (1 + kWGs) threads. Warpgroup 0 is the producer (kernel/gemm/
// producer.cuh: warp 0 lane 0 issues the TMA / bulk copies, warp 1 stages the activation scale
// words); warpgroups 1 .. kWGs are consumers, each owning 64 of the CTA's 64 x kWGs weight rows
// (kWGs = 2, or 4 for the 8-token tile). Stages are handed over through full / empty mbarriers.
//
// Work: persistent CTAs walk a static schedule of (expert, N block of 128 weight rows, token block
// of BN pool rows) items, token block innermost so CTAs running at the same time share weight tiles
// in L2. A token block can be gated by an arrival counter (fused kernel); standalone launches pass
// none (all rows present). Epilogue outputs go through plain pointers, so a caller may point them
// into a peer's buffer.
//
// Promotion (kPromoteK32, the exact mode): every k32 wgmma writes a fresh accumulator which is
// added into the fp32 result with both UE8M0 scales (final += acc * (2^sw * 2^sx)). In the fast mode
// (kPromoteK32 = false) the weight scale is folded into the decode LUT relative to the largest
// group of the (row, K128) block and the four k32 products of a K128 block accumulate in the tensor
// core; see the comment at the fast-mode promotion below.
#pragma once

#include <cstdint>
#include <type_traits>
#include <cuda_bf16.h>

#include "../common/ptx.cuh"
#include "../common/ue8m0.cuh"
#include "../epilogue/epilogue.cuh"
#include "fp4_decode.cuh"
#include "params.cuh"
#include "producer.cuh"
#include "promotion.cuh"
#include "scheduler.cuh"
#include "wgmma_fp8_rs.cuh"

namespace megamoe {

// A CTA has one producer warpgroup and kWGs consumer warpgroups (2, or 4 for small token tiles,
// where more warps hide the per-stage latency); each consumer owns 64 weight rows.
template <int kWGs>
__host__ __device__ constexpr int threads_for() { return 128 * (1 + kWGs); }

template <int BN, int kWGs>
struct SmemLayout {
  static constexpr int kRows = 64 * kWGs;              // weight rows per CTA
  using Ring = StageRing<BN, kRows>;
  static constexpr int kStage = Ring::kX + Ring::kW + Ring::kWsf + Ring::kXsf;
};

// Dynamic shared memory the kernel needs (bytes), including the 1024-byte alignment slack.
template <int kLayer, int BN, int kStages, int kWGs>
__host__ __device__ constexpr int gemm_smem_bytes() {
  using L = SmemLayout<BN, kWGs>;
  constexpr int kEpiPerWg = kEpilogueBytes<kLayer, BN>;
  return 1024 + kStages * L::kStage + kWGs * kEpiPerWg + 2 * kStages * 8 + kLutEntries * 8 +
         (2 * kMaxExperts + 1) * 4;
}

// The kernel body; kernel/gemm/instantiate.cu.in wraps it in one extern "C" __global__ per
// specialisation (p must be the kernel's __grid_constant__ parameter: the TMA reads its descriptor).
template <int kLayer, int BN, int kStages, bool kPromoteK32, bool kFastSilu, bool kDebug, int kWGs>
__device__ __forceinline__ void gemm_sm90_body(const GemmParams& p) {
  static_assert(kWGs == 2 || kWGs == 4, "consumer warpgroups");
  using L = SmemLayout<BN, kWGs>;
  constexpr int kBlockRows = L::kRows;
  // setmaxnreg moves registers inside the CTA's launch allocation (threads x launch count): what
  // the consumers gain, the producer must give up. 2 WGs: 384 x 168 -> 128 x 56 + 256 x 224;
  // 4 WGs: 640 x 96 -> 128 x 40 + 512 x 104 (<= 61440).
  // Fast mode, BN = 128: the split-N pipelined mainloop.
  constexpr bool kSplitN = !kPromoteK32 && BN == 128 && kWGs == 2;
  constexpr int kProducerRegs = kWGs == 2 ? 56 : 40;
  constexpr int kConsumerRegs = kWGs == 2 ? 224 : 104;
  constexpr int kLaunchRegs = (65536 / threads_for<kWGs>()) / 8 * 8;   // what ptxas allocates (compile gate)
  static_assert(128 * kProducerRegs + 128 * kWGs * kConsumerRegs <= threads_for<kWGs>() * kLaunchRegs,
                "setmaxnreg budget exceeds the launch allocation");
  using Mma = WgmmaRS<BN>;
  constexpr int kAcc = BN / 2;
  static_assert(BN % 8 == 0 && BN >= 8 && BN <= 256, "token tile");

  extern __shared__ __align__(1024) uint8_t smem_raw[];
  // Align the dynamic base to 1024 bytes (128-byte swizzle atoms).
  uint8_t* smem = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t(1023));
  typename L::Ring ring;
  ring.x = smem;                                          // [kStages][BN*128]
  ring.w = ring.x + kStages * L::Ring::kX;                // [kStages][rows*64]
  ring.wsf = ring.w + kStages * L::Ring::kW;              // [kStages][rows*4]
  ring.xsf = reinterpret_cast<uint32_t*>(ring.wsf + kStages * L::Ring::kWsf);  // [kStages][BN]
  uint8_t* s_epi = reinterpret_cast<uint8_t*>(ring.xsf + kStages * BN);
  constexpr int kEpiPerWg = kEpilogueBytes<kLayer, BN>;
  ring.full = reinterpret_cast<uint64_t*>(s_epi + kWGs * kEpiPerWg);
  ring.empty = ring.full + kStages;
  uint2* s_lut = reinterpret_cast<uint2*>(ring.empty + kStages);   // fast mode: scaled FP4 LUTs
  int* s_prefix = reinterpret_cast<int*>(s_lut + kLutEntries);     // [E+1] item prefix
  int* s_nblk = s_prefix + kMaxExperts + 1;                        // [E] token blocks per expert
  const uint8_t* s_x = ring.x;
  const uint8_t* s_w = ring.w;
  const uint8_t* s_wsf = ring.wsf;
  const uint32_t* s_xsf = ring.xsf;
  uint64_t* s_full = ring.full;
  uint64_t* s_empty = ring.empty;

  const int tid = threadIdx.x;
  const int warp = tid / 32;
  const int lane = tid % 32;
  const int num_kb = static_cast<int>(p.k / kBlockK);
  const int n_row_blocks = static_cast<int>(p.n_rows / kBlockRows);

  if (!kPromoteK32 && tid >= 32 && tid < 32 + kLutEntries) init_scaled_lut(s_lut, tid - 32);
  if (tid == 0) {
    // The host sizes the launch from its own copy of this layout (megamoe/gemm.py smem_bytes).
    constexpr int kLayoutBytes = gemm_smem_bytes<kLayer, BN, kStages, kWGs>();
    if (ptx::dynamic_smem_size() < static_cast<uint32_t>(kLayoutBytes))
      ptx::report_trap(p.err, ptx::kLayoutCheck, 0, kLayoutBytes, static_cast<int>(ptx::dynamic_smem_size()));
    for (int s = 0; s < kStages; ++s) {
      ptx::mbar_init(&s_full[s], 1 + 32);  // producer thread (expect_tx) + scale warp
      ptx::mbar_init(&s_empty[s], 4 * kWGs);  // one arrive per consumer warp
    }
    ptx::fence_mbar_init();
    build_schedule<BN>(p, n_row_blocks, s_prefix, s_nblk);
  }
  __syncthreads();
  const int num_items = s_prefix[p.num_experts];

  if (warp < 4) {
    ptx::setmaxnreg_dec<kProducerRegs>();
    run_producer<BN, kBlockRows, kStages, kPromoteK32>(p, ring, s_prefix, s_nblk, num_items);
  } else {
    // ------------------------------------------------------------------ consumer warpgroups
    ptx::setmaxnreg_inc<kConsumerRegs>();
    const int wg = warp / 4 - 1;       // weight rows [64 wg, 64 wg + 64) of the CTA tile
    const int wq = (tid / 32) % 4;     // warp within the warpgroup: rows 16 wq .. 16 wq + 15
    const int g = lane / 4;
    const int t = lane % 4;
    const int rg = wg * 4 + wq;        // 16-row group within the CTA tile
    const int row_a = rg * 16 + g;     // local rows of this thread: row_a and row_a + 8
    uint8_t* s_epi_wg = s_epi + wg * kEpiPerWg;

    // kSets k32 products are in flight per wgmma batch (one accumulator set each): one wait per
    // batch instead of one per k32 step, bounded by the register budget.
    constexpr int kSets = !kPromoteK32 ? 1 : kAcc <= (kWGs == 2 ? 16 : 4) ? 4 : (kAcc <= 32 ? 2 : 1);
    float acc[kAcc];
    float tmp[kSets][kAcc];
    int stage = 0;
    uint32_t phase = 0;

    for (int item = blockIdx.x; item < num_items; item += gridDim.x) {
      const WorkItem wi = decode_item<BN>(item, s_prefix, s_nblk, p);
#pragma unroll
      for (int i = 0; i < kAcc; ++i) acc[i] = 0.0f;

      if constexpr (kSplitN) {
        // Split-N pipelined fast mainloop (BN = 128). The four k32 wgmmas of a stage run as two
        // N = 64 halves that share one decoded A fragment (the FP4 decode is paid once per 128
        // tokens). Pipeline over halves: half 0 of stage kb is promoted while half 1 runs in the
        // tensor core, half 1 while half 0 of kb + 1 runs. Registers: acc 64 + half products
        // 2 x 32 + A fragments 16 (a second A buffer, to decode kb + 1 while kb runs, spills).
        using Mma64 = WgmmaRS<64>;
        float ht[2][32];          // K128 products of token half 0 / 1
        uint32_t pa[4][4];        // decoded A fragments of one stage
        int prb[2][2];            // (smax - 127) << 23 of rows row_a / row_a + 8, per buffer
        int pstage[2];
        auto decode = [&](auto cur_c) {
          constexpr int cur = decltype(cur_c)::value;
          ptx::mbar_wait(&s_full[stage], phase, ptx::kWaitFull, stage, p.err);
          const uint32_t sf_a = *reinterpret_cast<const uint32_t*>(s_wsf + stage * L::Ring::kWsf + row_a * 4);
          const uint32_t sf_b = *reinterpret_cast<const uint32_t*>(s_wsf + stage * L::Ring::kWsf + (row_a + 8) * 4);
          uint32_t ma, mb;
          decode_fast_fragments(s_w + stage * L::Ring::kW + rg * 1024, lane, sf_a, sf_b, s_lut, pa, ma, mb);
          prb[cur][0] = static_cast<int>(ma << 23) - (127 << 23);
          prb[cur][1] = static_cast<int>(mb << 23) - (127 << 23);
          pstage[cur] = stage;
          if (++stage == kStages) { stage = 0; phase ^= 1; }
        };
        auto mma = [&](auto cur_c, auto h_c) {
          constexpr int cur = decltype(cur_c)::value;
          constexpr int h = decltype(h_c)::value;
          // Token rows 64 h .. 64 h + 63 of the stage's tile: 8 swizzle atoms (1024 B) further on.
          const uint64_t desc0 = ptx::smem_desc_sw128(s_x + pstage[cur] * L::Ring::kX + h * 64 * kBlockK);
          ptx::wgmma_fence();
#pragma unroll
          for (int ks = 0; ks < 4; ++ks)
            Mma64::mma(ht[h], pa[ks][0], pa[ks][1], pa[ks][2], pa[ks][3],
                       desc0 + static_cast<uint64_t>((ks * 32) >> 4), ks > 0 ? 1 : 0);
          ptx::wgmma_commit();
        };
        // Promotion of half h of stage kb (its wgmmas complete); after half 1 the stage is released.
        auto promote = [&](auto cur_c, auto h_c, int kb) {
          constexpr int cur = decltype(cur_c)::value;
          constexpr int h = decltype(h_c)::value;
#pragma unroll
          for (int i = 0; i < 32; ++i) ptx::fence_operand(ht[h][i]);
          promote_k128<64>(acc + 32 * h, ht[h], s_xsf + pstage[cur] * BN + 64 * h, t, kb, prb[cur][0], prb[cur][1]);
          // Pin the FMAs before the next wgmma issue: otherwise the compiler sinks them past it,
          // keeps a copy of the in-flight accumulators, and ptxas serialises the wgmmas (C7514).
#pragma unroll
          for (int i = 0; i < 32; ++i) ptx::fence_operand(acc[32 * h + i]);
          if constexpr (h == 1) {
            __syncwarp();
            if (lane == 0) ptx::mbar_arrive(&s_empty[pstage[cur]]);
          }
        };
        using C0 = std::integral_constant<int, 0>;
        using C1 = std::integral_constant<int, 1>;
        using Yes = std::true_type;
        using No = std::false_type;
        // One stage: on entry both halves of kb are in flight; on exit both halves of kb + 1 (if any).
        // The A fragments are single-buffered (register budget): stage kb + 1 is decoded once
        // both halves of kb are complete, while the other consumer warpgroup keeps the tensor core
        // busy; half 1 of kb is promoted while half 0 of kb + 1 runs.
        auto step = [&](auto cur_c, auto nxt_c, int kb, auto more_c) {
          constexpr bool more = decltype(more_c)::value;
          ptx::wgmma_wait<1>();
          promote(cur_c, C0{}, kb);
          ptx::wgmma_wait<0>();
#pragma unroll
          for (int ks = 0; ks < 4; ++ks)
#pragma unroll
            for (int i = 0; i < 4; ++i) ptx::fence_operand(pa[ks][i]);
          if constexpr (more) {
            decode(nxt_c);
            mma(nxt_c, C0{});
          }
          promote(cur_c, C1{}, kb);
          if constexpr (more) mma(nxt_c, C1{});
        };
        decode(C0{});
        mma(C0{}, C0{});
        mma(C0{}, C1{});
        int kb = 0;
        for (; kb + 2 < num_kb; kb += 2) {
          step(C0{}, C1{}, kb, Yes{});
          step(C1{}, C0{}, kb + 1, Yes{});
        }
        if (kb + 1 < num_kb) {
          step(C0{}, C1{}, kb, Yes{});
          step(C1{}, C0{}, kb + 1, No{});
        } else {
          step(C0{}, C1{}, kb, No{});
        }
      } else
      if constexpr (!kPromoteK32 && BN <= 64 && kWGs == 2) {
        // Pipelined fast mainloop: stage kb's four wgmmas run in the tensor core while stage kb-1
        // is retired (stage released, promoted); accumulators and A fragments double-buffered.
        float ptmp[2][kAcc];
        uint32_t pa[2][4][4];
        float pfa[2], pfb[2];
        int pstage[2];
        auto issue = [&](auto cur_c, int kb) {
          constexpr int cur = decltype(cur_c)::value;
          ptx::mbar_wait(&s_full[stage], phase, ptx::kWaitFull, stage, p.err);
          const uint32_t sf_a = *reinterpret_cast<const uint32_t*>(s_wsf + stage * L::Ring::kWsf + row_a * 4);
          const uint32_t sf_b = *reinterpret_cast<const uint32_t*>(s_wsf + stage * L::Ring::kWsf + (row_a + 8) * 4);
          uint32_t ma, mb;
          decode_fast_fragments(s_w + stage * L::Ring::kW + rg * 1024, lane, sf_a, sf_b, s_lut, pa[cur], ma, mb);
          pfa[cur] = __int_as_float(static_cast<int>(ma << 23));  // bits (smax << 23), see retire
          pfb[cur] = __int_as_float(static_cast<int>(mb << 23));
          const uint64_t desc0 = ptx::smem_desc_sw128(s_x + stage * L::Ring::kX);
          ptx::wgmma_fence();
#pragma unroll
          for (int ks = 0; ks < 4; ++ks)
            Mma::mma(ptmp[cur], pa[cur][ks][0], pa[cur][ks][1], pa[cur][ks][2], pa[cur][ks][3],
                     desc0 + static_cast<uint64_t>((ks * 32) >> 4), ks > 0 ? 1 : 0);
          ptx::wgmma_commit();
          pstage[cur] = stage;
          if (++stage == kStages) { stage = 0; phase ^= 1; }
        };
        auto retire = [&](auto cur_c, int kb) {
          constexpr int cur = decltype(cur_c)::value;
#pragma unroll
          for (int i = 0; i < kAcc; ++i) ptx::fence_operand(ptmp[cur][i]);
#pragma unroll
          for (int ks = 0; ks < 4; ++ks)
#pragma unroll
            for (int i = 0; i < 4; ++i) ptx::fence_operand(pa[cur][ks][i]);
          // Token scales straight from the stage (released only after this read).
          promote_k128<BN>(acc, ptmp[cur], s_xsf + pstage[cur] * BN, t, kb, __float_as_int(pfa[cur]) - (127 << 23),
                           __float_as_int(pfb[cur]) - (127 << 23));
          __syncwarp();
          if (lane == 0) ptx::mbar_arrive(&s_empty[pstage[cur]]);
        };
        using C0 = std::integral_constant<int, 0>;
        using C1 = std::integral_constant<int, 1>;
        issue(C0{}, 0);
        int kb = 1;
        for (; kb + 1 < num_kb; kb += 2) {
          issue(C1{}, kb);
          ptx::wgmma_wait<1>();
          retire(C0{}, kb - 1);
          issue(C0{}, kb + 1);
          ptx::wgmma_wait<1>();
          retire(C1{}, kb);
        }
        if (kb < num_kb) {
          issue(C1{}, kb);
          ptx::wgmma_wait<1>();
          retire(C0{}, kb - 1);
          ptx::wgmma_wait<0>();
          retire(C1{}, kb);
        } else {
          ptx::wgmma_wait<0>();
          retire(C0{}, kb - 1);
        }
      } else
      for (int kb = 0; kb < num_kb; ++kb) {
        ptx::mbar_wait(&s_full[stage], phase, ptx::kWaitFull, stage, p.err);
        const uint8_t* sw = s_w + stage * L::Ring::kW + rg * 1024 + lane * 16;
        const uint4 wv0 = *reinterpret_cast<const uint4*>(sw);
        const uint4 wv1 = *reinterpret_cast<const uint4*>(sw + 512);
        const uint32_t sf_a = *reinterpret_cast<const uint32_t*>(s_wsf + stage * L::Ring::kWsf + row_a * 4);
        const uint32_t sf_b = *reinterpret_cast<const uint32_t*>(s_wsf + stage * L::Ring::kWsf + (row_a + 8) * 4);
        const uint32_t* xsf = s_xsf + stage * BN;
        uint32_t xw[BN / 4];  // scale words of this thread's token columns 8j + 2t + h
#pragma unroll
        for (int j = 0; j < BN / 8; ++j) {
          const uint2 v = *reinterpret_cast<const uint2*>(xsf + 8 * j + 2 * t);
          xw[2 * j] = v.x;
          xw[2 * j + 1] = v.y;
        }
        const uint64_t desc0 = ptx::smem_desc_sw128(s_x + stage * L::Ring::kX);
        if constexpr (!kPromoteK32) {
          // Fast mode: the weight scales enter the decode LUT relative to the largest group of the
          // (row, K128) block, the four k32 products accumulate in the tensor core, and one fp32
          // promotion per K128 applies 2^(smax-127) (row) x 2^(sx-127) (token, rebased per K128).
          uint32_t a[4][4];
          uint32_t ma, mb;
          decode_fast_fragments(s_w + stage * L::Ring::kW + rg * 1024, lane, sf_a, sf_b, s_lut, a, ma, mb);
          ptx::wgmma_fence();
#pragma unroll
          for (int ks = 0; ks < 4; ++ks)
            Mma::mma(tmp[0], a[ks][0], a[ks][1], a[ks][2], a[ks][3],
                     desc0 + static_cast<uint64_t>((ks * 32) >> 4), ks > 0 ? 1 : 0);
          ptx::wgmma_commit();
          ptx::wgmma_wait<0>();
#pragma unroll
          for (int i = 0; i < kAcc; ++i) ptx::fence_operand(tmp[0][i]);
#pragma unroll
          for (int ks = 0; ks < 4; ++ks)
#pragma unroll
            for (int i = 0; i < 4; ++i) ptx::fence_operand(a[ks][i]);
          __syncwarp();
          if (lane == 0) ptx::mbar_arrive(&s_empty[stage]);
          const float fa = ue8m0_to_float(ma);
          const float fb = ue8m0_to_float(mb);
#pragma unroll
          for (int j = 0; j < BN / 8; ++j) {
            const float sx0 = ue8m0_to_float((xw[2 * j] >> (8 * (kb & 3))) & 0xFFu);
            const float sx1 = ue8m0_to_float((xw[2 * j + 1] >> (8 * (kb & 3))) & 0xFFu);
            acc[4 * j + 0] = __fmaf_rn(tmp[0][4 * j + 0], __fmul_rn(fa, sx0), acc[4 * j + 0]);
            acc[4 * j + 1] = __fmaf_rn(tmp[0][4 * j + 1], __fmul_rn(fa, sx1), acc[4 * j + 1]);
            acc[4 * j + 2] = __fmaf_rn(tmp[0][4 * j + 2], __fmul_rn(fb, sx0), acc[4 * j + 2]);
            acc[4 * j + 3] = __fmaf_rn(tmp[0][4 * j + 3], __fmul_rn(fb, sx1), acc[4 * j + 3]);
          }
        } else {
          // With one accumulator set (BN = 128) the k32 loop stays rolled to bound register use.
          constexpr int kUnrollK = kSets == 1 ? 1 : 4;
  #pragma unroll kUnrollK
          for (int ks0 = 0; ks0 < 4; ks0 += kSets) {
            uint32_t a[kSets][4];
  #pragma unroll
            for (int s = 0; s < kSets; ++s) {
              const int ks = ks0 + s;
              const uint32_t w0 = ks == 0 ? wv0.x : ks == 1 ? wv0.z : ks == 2 ? wv1.x : wv1.z;
              const uint32_t w1 = ks == 0 ? wv0.y : ks == 1 ? wv0.w : ks == 2 ? wv1.y : wv1.w;
              decode_fp4x8(w0, kFp4LutLo, kFp4LutHi, a[s][0], a[s][1]);
              decode_fp4x8(w1, kFp4LutLo, kFp4LutHi, a[s][2], a[s][3]);
            }
            ptx::wgmma_fence();
  #pragma unroll
            for (int s = 0; s < kSets; ++s)
              Mma::mma(tmp[s], a[s][0], a[s][1], a[s][2], a[s][3],
                       desc0 + static_cast<uint64_t>(((ks0 + s) * 32) >> 4), 0);
            ptx::wgmma_commit();
            ptx::wgmma_wait<0>();
  #pragma unroll
            for (int s = 0; s < kSets; ++s) {
  #pragma unroll
              for (int i = 0; i < kAcc; ++i) ptx::fence_operand(tmp[s][i]);
  #pragma unroll
              for (int i = 0; i < 4; ++i) ptx::fence_operand(a[s][i]);
            }
            if (ks0 + kSets == 4) {
              // Every smem read of this stage is done (operands in registers, wgmmas complete).
              __syncwarp();
              if (lane == 0) ptx::mbar_arrive(&s_empty[stage]);
            }
            // Exact promotion: both scales per k32 group, applied in fp32.
  #pragma unroll
            for (int s = 0; s < kSets; ++s) {
              const int ks = ks0 + s;
              const float swa = ue8m0_to_float((sf_a >> (8 * ks)) & 0xFFu);
              const float swb = ue8m0_to_float((sf_b >> (8 * ks)) & 0xFFu);
  #pragma unroll
              for (int j = 0; j < BN / 8; ++j) {
                const float sx0 = ue8m0_to_float((xw[2 * j] >> (8 * ks)) & 0xFFu);
                const float sx1 = ue8m0_to_float((xw[2 * j + 1] >> (8 * ks)) & 0xFFu);
                acc[4 * j + 0] = __fmaf_rn(tmp[s][4 * j + 0], __fmul_rn(swa, sx0), acc[4 * j + 0]);
                acc[4 * j + 1] = __fmaf_rn(tmp[s][4 * j + 1], __fmul_rn(swa, sx1), acc[4 * j + 1]);
                acc[4 * j + 2] = __fmaf_rn(tmp[s][4 * j + 2], __fmul_rn(swb, sx0), acc[4 * j + 2]);
                acc[4 * j + 3] = __fmaf_rn(tmp[s][4 * j + 3], __fmul_rn(swb, sx1), acc[4 * j + 3]);
              }
            }
          }
        }
        if (++stage == kStages) { stage = 0; phase ^= 1; }
      }

      // ---------------------------------------------------------------- epilogues
      layer_epilogue<kLayer, BN, kBlockRows, kFastSilu, kDebug>(p, wi, acc, s_epi_wg, wg);
    }
  }
}


}  // namespace megamoe
