// SM90 grouped GEMM, fast mode, with the FP4 decode in a warpgroup of its own ("transform"):
// the weights are decoded once per stage into shared memory as E4M3 and both wgmma operands come
// from shared memory (SS form). Same operands, layouts, schedule, epilogues and numerics as the
// fast mode of gemm_sm90.cuh (decode_fast_fragments, one promotion per K128); what changes is who
// does the work.
//
// Why: in the register-operand kernel every consumer thread decodes its own A fragments between
// its wgmma batches, so the decode (about 100 instructions per thread per stage) sits on the
// consumers' critical path and the tensor core idles while it runs (ncu: tensor pipe 17 % active,
// issue- and latency-bound; bench/NOTES.md). Here a transform warpgroup decodes the CTA's whole
// 128 x 128 weight tile of a stage, once for all BN tokens, while the consumers only issue
// wgmmas and promote, as in an FP8 block-scaled GEMM.
//
// 512 threads:
//   warpgroup 0, producer  (kernel/gemm/producer.cuh): TMA of the activations, bulk copies of the
//                          packed weights and scales, cp.async of the activation scales;
//   warpgroup 1, transform: waits for a stage's bytes (full barrier), decodes the packed FP4 tile
//                          with the scaled LUTs into the stage's A tile (E4M3, K-major, 128-byte
//                          swizzle: the layout a TMA would write), fences the generic-proxy stores
//                          for the async proxy and arrives on the stage's ready barrier;
//   warpgroups 2-3, consumers: 64 weight rows each; wait for ready, four k32 SS wgmmas into a
//                          fresh accumulator, promote it into the fp32 result with the row and
//                          token K128 scales, release the stage (empty barrier), and run the
//                          layer's epilogue after the last stage.
// The A tile of a stage is rewritten only after the producer refilled the stage, which it does
// only after the consumers released it, so one ring of stages orders all three roles.
#pragma once

#include <cstdint>

#include "../common/ptx.cuh"
#include "../epilogue/epilogue.cuh"
#include "fp4_decode.cuh"
#include "params.cuh"
#include "producer.cuh"
#include "promotion.cuh"
#include "scheduler.cuh"
#include "wgmma_fp8_ss.cuh"

namespace megamoe {

constexpr int kThreadsSS = 512;

template <int BN>
struct SmemLayoutSS {
  static constexpr int kRows = 128;                    // weight rows per CTA (2 consumer warpgroups)
  using Ring = StageRing<BN, kRows>;
  static constexpr int kA = kRows * kBlockK;           // decoded E4M3 weights, 128B swizzled
  static constexpr int kStage = Ring::kX + kA + Ring::kW + Ring::kWsf + Ring::kXsf;
};

// Byte offset of the 4-byte word (row, k .. k + 3) in a K-major tile of 128-byte rows stored with
// the 128-byte swizzle: the 16-byte chunk index k / 16 is XORed with row % 8 (tile 1024-aligned).
__device__ __forceinline__ uint32_t sw128_offset(int row, int k) {
  return static_cast<uint32_t>(row * 128 + ((((k >> 4) ^ row) & 7) << 4) + (k & 15));
}

// Dynamic shared memory of gemm_sm90_ss_body (bytes), including the 1024-byte alignment slack.
template <int kLayer, int BN, int kStages>
__host__ __device__ constexpr int gemm_ss_smem_bytes() {
  constexpr int kEpiPerWg = kEpilogueBytes<kLayer, BN>;
  return 1024 + kStages * SmemLayoutSS<BN>::kStage + 2 * kEpiPerWg + 3 * kStages * 8 + kLutEntries * 8 +
         (2 * kMaxExperts + 1) * 4;
}

template <int kLayer, int BN, int kStages, bool kFastSilu, bool kDebug>
__device__ __forceinline__ void gemm_sm90_ss_body(const GemmParams& p) {
  using L = SmemLayoutSS<BN>;
  using R = typename L::Ring;
  constexpr int kBlockRows = L::kRows;
  constexpr int kAcc = BN / 2;
  static_assert(BN % 8 == 0 && BN >= 8 && BN <= 128, "token tile");
  // setmaxnreg redistributes the launch allocation (512 x 128): producer and transform give up
  // what the consumers gain.
  constexpr int kProducerRegs = 56;
  constexpr int kTransformRegs = 104;
  constexpr int kConsumerRegs = 176;
  static_assert(128 * (kProducerRegs + kTransformRegs) + 256 * kConsumerRegs <= 65536, "register budget");

  extern __shared__ __align__(1024) uint8_t smem_raw[];
  uint8_t* smem = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t(1023));
  R ring;
  ring.x = smem;                                                  // [kStages][BN * 128]
  uint8_t* s_a = ring.x + kStages * R::kX;                        // [kStages][128 * 128]
  ring.w = s_a + kStages * L::kA;                                 // [kStages][128 * 64]
  ring.wsf = ring.w + kStages * R::kW;                            // [kStages][128 * 4]
  ring.xsf = reinterpret_cast<uint32_t*>(ring.wsf + kStages * R::kWsf);  // [kStages][BN]
  uint8_t* s_epi = reinterpret_cast<uint8_t*>(ring.xsf + kStages * BN);
  constexpr int kEpiPerWg = kEpilogueBytes<kLayer, BN>;
  ring.full = reinterpret_cast<uint64_t*>(s_epi + 2 * kEpiPerWg);
  ring.empty = ring.full + kStages;
  uint64_t* s_ready = ring.empty + kStages;                       // A tile of the stage decoded
  uint2* s_lut = reinterpret_cast<uint2*>(s_ready + kStages);
  int* s_prefix = reinterpret_cast<int*>(s_lut + kLutEntries);
  int* s_nblk = s_prefix + kMaxExperts + 1;

  const int tid = threadIdx.x;
  const int warp = tid / 32;
  const int lane = tid % 32;
  const int g = lane / 4;
  const int t = lane % 4;
  const int num_kb = static_cast<int>(p.k / kBlockK);
  const int n_row_blocks = static_cast<int>(p.n_rows / kBlockRows);

  if (tid >= 32 && tid < 32 + kLutEntries) init_scaled_lut(s_lut, tid - 32);
  if (tid == 0) {
    // The host sizes the launch from its own copy of this layout (megamoe/gemm.py smem_bytes).
    constexpr int kLayoutBytes = gemm_ss_smem_bytes<kLayer, BN, kStages>();
    if (ptx::dynamic_smem_size() < static_cast<uint32_t>(kLayoutBytes))
      ptx::report_trap(p.err, ptx::kLayoutCheck, 0, kLayoutBytes, static_cast<int>(ptx::dynamic_smem_size()));
    for (int s = 0; s < kStages; ++s) {
      ptx::mbar_init(&ring.full[s], 1 + 32);   // TMA thread (expect_tx) + scale warp
      ptx::mbar_init(&s_ready[s], 4);          // one arrive per transform warp
      ptx::mbar_init(&ring.empty[s], 8);       // one arrive per consumer warp
    }
    ptx::fence_mbar_init();
    build_schedule<BN>(p, n_row_blocks, s_prefix, s_nblk);
  }
  __syncthreads();
  const int num_items = s_prefix[p.num_experts];
  int stage = 0;
  uint32_t phase = 0;

  if (warp < 4) {
    ptx::setmaxnreg_dec<kProducerRegs>();
    run_producer<BN, kBlockRows, kStages, false>(p, ring, s_prefix, s_nblk, num_items);
  } else if (warp < 8) {
    // ------------------------------------------------------------------ transform warpgroup
    ptx::setmaxnreg_dec<kTransformRegs>();
    const int tw = warp - 4;     // 16-row groups tw and tw + 4 of the 128-row tile
    for (int item = blockIdx.x; item < num_items; item += gridDim.x) {
      for (int kb = 0; kb < num_kb; ++kb) {
        ptx::mbar_wait(&ring.full[stage], phase, ptx::kWaitFull, stage, p.err);
        const uint32_t a_tile = ptx::smem_addr(s_a + stage * L::kA);
#pragma unroll
        for (int half = 0; half < 2; ++half) {
          const int rg = tw + 4 * half;
          const int row = rg * 16 + g;
          const uint8_t* wsf = ring.wsf + stage * R::kWsf;
          const uint32_t sf_a = *reinterpret_cast<const uint32_t*>(wsf + row * 4);
          const uint32_t sf_b = *reinterpret_cast<const uint32_t*>(wsf + (row + 8) * 4);
          uint32_t a[4][4];
          uint32_t ma, mb;
          decode_fast_fragments(ring.w + stage * R::kW + rg * 1024, lane, sf_a, sf_b, s_lut, a, ma, mb);
          // a[ks][0] / [1]: rows row / row + 8, k = 32 ks + 4 t; a[ks][2] / [3]: k + 16. A warp's
          // 32 stores of one register land in 32 distinct banks (chunk ^ g spans 8 chunks).
#pragma unroll
          for (int ks = 0; ks < 4; ++ks) {
            const int k = 32 * ks + 4 * t;
            ptx::st_shared_u32(a_tile + sw128_offset(row, k), a[ks][0]);
            ptx::st_shared_u32(a_tile + sw128_offset(row + 8, k), a[ks][1]);
            ptx::st_shared_u32(a_tile + sw128_offset(row, k + 16), a[ks][2]);
            ptx::st_shared_u32(a_tile + sw128_offset(row + 8, k + 16), a[ks][3]);
          }
        }
        ptx::fence_proxy_async_smem();   // the consumers' wgmmas read the tile through the async proxy
        __syncwarp();
        if (lane == 0) ptx::mbar_arrive(&s_ready[stage]);
        if (++stage == kStages) { stage = 0; phase ^= 1; }
      }
    }
  } else {
    // ------------------------------------------------------------------ consumer warpgroups
    ptx::setmaxnreg_inc<kConsumerRegs>();
    const int wg = warp / 4 - 2;       // weight rows [64 wg, 64 wg + 64) of the CTA tile
    const int row_a = wg * 64 + (warp % 4) * 16 + g;   // this thread's rows: row_a and row_a + 8
    uint8_t* s_epi_wg = s_epi + wg * kEpiPerWg;
    float acc[kAcc];
    float tmp[kAcc];
    for (int item = blockIdx.x; item < num_items; item += gridDim.x) {
      const WorkItem wi = decode_item<BN>(item, s_prefix, s_nblk, p);
#pragma unroll
      for (int i = 0; i < kAcc; ++i) acc[i] = 0.0f;
      for (int kb = 0; kb < num_kb; ++kb) {
        // The full barrier has completed before ready did; waiting on it too (one try_wait) makes
        // the producer's scale bytes visible to this thread directly rather than through the
        // transform warps' arrival.
        ptx::mbar_wait(&ring.full[stage], phase, ptx::kWaitFull, stage, p.err);
        ptx::mbar_wait(&s_ready[stage], phase, ptx::kWaitReady, stage, p.err);
        const uint64_t desc_a = ptx::smem_desc_sw128(s_a + stage * L::kA + wg * 64 * kBlockK);
        const uint64_t desc_b = ptx::smem_desc_sw128(ring.x + stage * R::kX);
        ptx::wgmma_fence();
#pragma unroll
        for (int ks = 0; ks < 4; ++ks)
          WgmmaSS<BN>::mma(tmp, desc_a + static_cast<uint64_t>((ks * 32) >> 4),
                           desc_b + static_cast<uint64_t>((ks * 32) >> 4), ks > 0 ? 1 : 0);
        ptx::wgmma_commit();
        ptx::wgmma_wait<0>();
#pragma unroll
        for (int i = 0; i < kAcc; ++i) ptx::fence_operand(tmp[i]);
        // Promotion (kernel/gemm/promotion.cuh), scales straight from the stage.
        const uint8_t* wsf = ring.wsf + stage * R::kWsf;
        const uint32_t sf_a = *reinterpret_cast<const uint32_t*>(wsf + row_a * 4);
        const uint32_t sf_b = *reinterpret_cast<const uint32_t*>(wsf + (row_a + 8) * 4);
        const int rba = row_scale_bits(sf_a);
        const int rbb = row_scale_bits(sf_b);
        promote_k128<BN>(acc, tmp, ring.xsf + stage * BN, t, kb, rba, rbb);
        // Pin the FMAs before the next wgmma issue (else ptxas keeps a copy of tmp and serialises
        // the wgmmas, C7514).
#pragma unroll
        for (int i = 0; i < kAcc; ++i) ptx::fence_operand(acc[i]);
        __syncwarp();
        if (lane == 0) ptx::mbar_arrive(&ring.empty[stage]);
        if (++stage == kStages) { stage = 0; phase ^= 1; }
      }
      layer_epilogue<kLayer, BN, kBlockRows, kFastSilu, kDebug>(p, wi, acc, s_epi_wg, wg);
    }
  }
}


}  // namespace megamoe
