// What a non-swapped prefill kernel would reach: tokens as the wgmma M dimension (the activation
// tile is the shared-memory A operand, 64 tokens per consumer warpgroup), weight rows as N (the FP4
// weights decoded to E4M3 *in shared memory*, the B operand), so that a token's fp32 scale lies on
// the accumulator rows: two scales per thread and K block, one FFMA per accumulator. This is the
// orientation DeepGEMM uses on Hopper; the GEMM core today is swap-AB (weights decoded into the
// registers of an RS wgmma, tokens as N: 32 scales per thread and K block; bench/NOTES.md v13).
//
//   prefill_rate          (built and run by python -m bench.prefill_rate)
//
// One CTA per SM runs a long K loop in the steady state of such a kernel, with its real data paths:
//   producer warp 0, lane 0: per stage, bulk copies of the activation tile (M x 128 bytes), the
//     packed FP4 weights (kernel layout, rows x 64 bytes), their LUT offsets (rows x 4) and the
//     tokens' fp32 scales (M x 4) from small L2-resident buffers; full / empty mbarriers;
//   decoders: warps decode 16-row groups of a stage through the fast mode's scaled tables (the
//     steps of fp4_decode.cuh, the kernel's own decode) into the stage's B tile (128-byte swizzle,
//     conflict-free 4-byte stores), fence it for the async proxy and arrive on the stage's `ready`
//     barrier. Who decodes (Decoder): the consumer warps (the next stage, under their own
//     wgmmas), warps 1 .. 3 of the producer warpgroup, or those and a decode warpgroup;
//   consumers (two warpgroups, M = 128 tokens): SS m64n128k32 wgmmas, one 128-row half of the tile
//     per group, each group waited for and promoted with one FFMA per accumulator before the next.
// The decoded tile lives in the stage, so its reuse is ordered by the ring's empty barriers.
// Variants: weight rows per CTA (128 or 256), the decoder, and two ablations (no decode: the B
// tiles keep whatever they hold, a plain FP8 GEMM's traffic; no promotion: the wgmmas accumulate).
// (Three consumer warpgroups, 152 registers a thread, spilled in the decode: not a variant.)
// Prints MAC/clk/SM against the dense FP8 peak (4096), TFLOP/s and the SM clock. bench/NOTES.md v14.
#include <cstdint>
#include <cstdio>
#include <cstdlib>

#include "../common/ptx.cuh"
#include "../gemm/contract.cuh"
#include "../gemm/fp4_decode.cuh"
#include "../gemm/wgmma_fp8_ss.cuh"
#include "probe_timing.h"

using namespace megamoe;

namespace {

constexpr int kHalfRows = 128;   // weight rows per wgmma (N) and per promotion group
constexpr int kSrcSlots = 16;    // distinct source stages in global memory (L2-resident)
constexpr int kSmemMax = 227 * 1024;

// Where the stage's FP4 weights are decoded: nowhere (an ablation: the B tiles keep what they
// hold), by the consumer warps (the next stage's, under their own wgmmas), by warps 1 .. 3 of the
// producer warpgroup, or by those and a warpgroup of its own (seven warps; both of these at their
// own pace, as far ahead as the ring allows); or before the kernel (kPredecoded: a bulk copy
// brings the B tile as E4M3, as from a pass that decodes each weight once per call).
enum Decoder { kNoDecode, kConsumerDecode, kProducerDecode, kWarpgroupDecode, kPredecoded };

template <int kWGs, int kRows, Decoder kDecode>
struct Layout {
  static constexpr int kM = 64 * kWGs;            // tokens per CTA tile
  static constexpr int kX = kM * kBlockK;         // activations, 128-byte swizzle (A operand)
  static constexpr int kB = kRows * kBlockK;      // decoded weights, 128-byte swizzle (B operand)
  static constexpr int kW = kRows * kBlockK / 2;  // packed FP4, kernel layout
  static constexpr int kWsf = kRows * 4;          // LUT byte offsets [row][4]
  static constexpr int kSx = kM * 4;              // fp32 token scales
  static constexpr int kStage = (kX + kB + kW + kWsf + kSx + 1023) / 1024 * 1024;
  // One source stage in global memory: x | the weights (packed, or E4M3 when predecoded) | their
  // LUT offsets (not when predecoded) | sx; what the producer copies per stage.
  static constexpr bool kPre = kDecode == kPredecoded;
  static constexpr int kSrcW = kPre ? kB : kW;
  static constexpr int kSrcWsf = kPre ? 0 : kWsf;
  static constexpr int kCopy = kX + kSrcW + kSrcWsf + kSx;
  static constexpr int kFixed = kLutEntries * 8 + 3 * 8 * 8;   // tables + up to 8 stages x 3 barriers
  static constexpr int kStagesFit = (kSmemMax - kFixed) / kStage;
  static constexpr int kStages = kStagesFit < 8 ? kStagesFit : 8;
  static constexpr int kSmem = kStages * kStage + kFixed;
  // The warpgroups before the consumers: the producer's, and the decode warpgroup.
  static constexpr int kSideWGs = kDecode == kWarpgroupDecode ? 2 : 1;
  static constexpr int kThreads = 128 * (kSideWGs + kWGs);
  static constexpr int kDecodeWarps = kDecode == kWarpgroupDecode ? 7 : 3;
  // setmaxnreg: the side warpgroups give up what the consumers take: 40 registers, 56 where the
  // producer's warps decode, 48 with a decode warpgroup (the consumers keep 208).
  static constexpr uint32_t kSideRegs = kDecode == kProducerDecode ? 56 : kDecode == kWarpgroupDecode ? 48 : 40;
  static constexpr uint32_t kConsumerRegs =
      ((kThreads * ((65536 / kThreads) / 8 * 8) - 128 * kSideWGs * kSideRegs) / (128 * kWGs)) / 8 * 8;
  static_assert(kStages >= 2, "stage ring");
  // Within a stage: x | B | w | wsf | sx.
  static constexpr int kOffB = kX;
  static constexpr int kOffW = kX + kB;
  static constexpr int kOffWsf = kOffW + kW;
  static constexpr int kOffSx = kOffWsf + kWsf;
};

// The 16-row groups rg0, rg0 + step, ... of a stage's packed weights into its B tile
// (fp4_decode.cuh's decode_rows16_sw128: the predecode pass's decode).
template <int kRows, typename L>
__device__ __forceinline__ void decode_rows(const uint8_t* st, const uint8_t* lut, int rg0, int step, int lane) {
  const uint32_t b_tile = ptx::smem_addr(st + L::kOffB);
#pragma unroll 1
  for (int rg = rg0; rg < kRows / 16; rg += step) {
    const int row_a = 16 * rg + lane / 4;
    const uint32_t off_a = *reinterpret_cast<const uint32_t*>(st + L::kOffWsf + row_a * 4);
    const uint32_t off_b = *reinterpret_cast<const uint32_t*>(st + L::kOffWsf + (row_a + 8) * 4);
    decode_rows16_sw128(st + L::kOffW + rg * 1024, lane, off_a, off_b, lut, b_tile + rg * 2048);
  }
  ptx::fence_proxy_async_smem();
}

template <int kWGs, int kRows, Decoder kDecode, bool kPromote>
__global__ void __launch_bounds__(Layout<kWGs, kRows, kDecode>::kThreads, 1)
    prefill_kernel(int num_kb, const uint8_t* src, long long* cycles, float* sink, int* err) {
  using L = Layout<kWGs, kRows, kDecode>;
  constexpr bool kSideDecode = kDecode == kProducerDecode || kDecode == kWarpgroupDecode;
  constexpr int kHalves = kRows / kHalfRows;
  constexpr int S = L::kStages;
  extern __shared__ __align__(1024) uint8_t smem[];
  uint8_t* lut = smem + S * L::kStage;
  uint64_t* full = reinterpret_cast<uint64_t*>(lut + kLutEntries * 8);
  uint64_t* empty = full + S;
  uint64_t* ready = empty + S;
  const int tid = threadIdx.x;
  if (tid == 0) {
    for (int s = 0; s < S; ++s) {
      ptx::mbar_init(&full[s], 1);
      ptx::mbar_init(&empty[s], 4 * kWGs);
      ptx::mbar_init(&ready[s], kSideDecode ? L::kDecodeWarps : 4 * kWGs);
    }
    ptx::fence_mbar_init();
  } else if (tid == 32) {
    for (int d = 0; d < kLutEntries; ++d)
      reinterpret_cast<uint2*>(lut)[d] = make_uint2(scaled_lut_lo(d), scaled_lut_hi(d));
  }
  __syncthreads();

  if (tid < 128 * L::kSideWGs) {
    ptx::setmaxnreg_dec<L::kSideRegs>();
    const int warp = tid / 32;
    int stage = 0;
    uint32_t phase = 0;
    if (tid == 0) {
      for (int kb = 0; kb < num_kb; ++kb) {
        ptx::mbar_wait(&empty[stage], phase ^ 1, kWaitEmpty, stage, err);
        ptx::mbar_arrive_expect_tx(&full[stage], L::kCopy);
        const uint8_t* from = src + static_cast<int64_t>(kb % kSrcSlots) * L::kCopy;
        uint8_t* to = smem + stage * L::kStage;
        if constexpr (L::kPre) {   // x | B, then sx
          ptx::bulk_g2s(to, from, L::kX + L::kB, &full[stage]);
          ptx::bulk_g2s(to + L::kOffSx, from + L::kX + L::kB, L::kSx, &full[stage]);
        } else {   // x, then w | wsf | sx
          ptx::bulk_g2s(to, from, L::kX, &full[stage]);
          ptx::bulk_g2s(to + L::kOffW, from + L::kX, L::kW + L::kWsf + L::kSx, &full[stage]);
        }
        if (++stage == S) {
          stage = 0;
          phase ^= 1;
        }
      }
    } else if (kSideDecode && warp >= 1) {
      const int lane = tid % 32;
      for (int kb = 0; kb < num_kb; ++kb) {
        ptx::mbar_wait(&full[stage], phase, kWaitFull, stage, err);
        decode_rows<kRows, L>(smem + stage * L::kStage, lut, warp - 1, L::kDecodeWarps, lane);
        __syncwarp();
        if (lane == 0) ptx::mbar_arrive(&ready[stage]);
        if (++stage == S) {
          stage = 0;
          phase ^= 1;
        }
      }
    }
    return;
  }
  ptx::setmaxnreg_inc<L::kConsumerRegs>();
  const int ctid = ptx::thread_idx() - 128 * L::kSideWGs;
  const int wg = ctid / 128;           // tokens 64 wg .. 64 wg + 63 of the tile
  const int wq = ctid / 32 % 4;        // rows 16 wq .. of the warpgroup's 64 tokens
  const int warp = ctid / 32;          // consumer warp: decodes row groups warp, warp + 4 kWGs, ...
  const int lane = ctid % 32;
  const int g = lane / 4;

  // Consumer decode of stage `s`: this warp's 16-row groups, into the stage's B tile, then `ready`.
  auto decode = [&](int s, uint32_t ph) {
    if constexpr (!kSideDecode) {
      ptx::mbar_wait(&full[s], ph, kWaitFull, s, err);
      if constexpr (kDecode == kConsumerDecode) decode_rows<kRows, L>(smem + s * L::kStage, lut, warp, 4 * kWGs, lane);
      __syncwarp();
      if (lane == 0) ptx::mbar_arrive(&ready[s]);
    }
  };

  float acc[kHalves][kHalfRows / 2];
#pragma unroll
  for (int h = 0; h < kHalves; ++h)
#pragma unroll
    for (int i = 0; i < kHalfRows / 2; ++i) acc[h][i] = 0.0f;
  float tmp[kHalfRows / 2];

  int stage = 0;
  uint32_t phase = 0;
  decode(0, 0);
  const long long t0 = clock64();
  for (int kb = 0; kb < num_kb; ++kb) {
    const int next = stage + 1 == S ? 0 : stage + 1;
    const uint32_t next_phase = stage + 1 == S ? phase ^ 1 : phase;
    const uint8_t* st = smem + stage * L::kStage;
    const float* sx = reinterpret_cast<const float*>(st + L::kOffSx) + 64 * wg + 16 * wq + g;
    // Broadcast from lane 0: the same for the whole warpgroup, so ptxas keeps it in a uniform
    // register beside the wgmma (from threadIdx, it is a vector register and costs R2URs).
    const uint32_t a_lo = __shfl_sync(0xFFFFFFFFu, ptx::smem_desc_sw128_lo(st + 64 * wg * kBlockK), 0);
    const uint32_t b_lo = ptx::smem_desc_sw128_lo(st + L::kOffB);
#pragma unroll
    for (int h = 0; h < kHalves; ++h) {
      float (&d)[kHalfRows / 2] = kPromote ? tmp : acc[h];
      // Before each half (after the first, a check that passes at once): the wait's branch ends
      // the block, so ptxas cannot hoist this half's wgmmas above the last half's promotion, which
      // would need a second temporary (it did, and spilled 256 bytes).
      ptx::mbar_wait(&ready[stage], phase, kWaitFull, stage, err);
      ptx::wgmma_fence();
#pragma unroll
      for (int ks = 0; ks < 4; ++ks) {
        const uint64_t da = ptx::smem_desc_sw128_from_lo(a_lo + 2 * ks);
        const uint64_t db = ptx::smem_desc_sw128_from_lo(b_lo + h * (kHalfRows * kBlockK >> 4) + 2 * ks);
        if (kPromote && ks == 0)
          WgmmaSS<kHalfRows>::mma_overwrite(d, da, db);
        else
          WgmmaSS<kHalfRows>::mma(d, da, db, 1);
      }
      ptx::wgmma_commit();
      if (h == 0 && kb + 1 < num_kb) decode(next, next_phase);
      float s0 = 0.0f, s1 = 0.0f;
      if constexpr (kPromote) {
        s0 = sx[0];
        s1 = sx[8];
      }
      ptx::wgmma_wait<0>();
      if constexpr (kPromote) {
#pragma unroll
        for (int i = 0; i < kHalfRows / 2; ++i) ptx::fence_operand(tmp[i]);
#pragma unroll
        for (int i = 0; i < kHalfRows / 2; ++i) acc[h][i] = __fmaf_rn(tmp[i], (i & 2) ? s1 : s0, acc[h][i]);
#pragma unroll
        for (int i = 0; i < kHalfRows / 2; ++i) ptx::fence_operand(acc[h][i]);
      }
    }
    __syncwarp();
    if (lane == 0) ptx::mbar_arrive(&empty[stage]);
    stage = next;
    phase = next_phase;
    // The end is inside the loop: ptxas gives the setmaxnreg budget only to a region that ends with
    // the loop (code after it made it fall back to the launch's registers and spill; gemm_sm90.cuh).
    if (kb + 1 == num_kb) probe_end(acc, t0, sink, cycles, ctid);
  }
}

// Source stages: E4M3 activations near 1, random FP4 codes, LUT offsets 8 d (d in 0 .. 13: rows
// spread over 14 binades, as the fast mode's tables allow), token scales near 1.
template <typename L>
uint8_t* make_source() {
  return probe_upload(static_cast<size_t>(kSrcSlots) * L::kCopy, [](uint8_t* host, auto& rnd) {
    for (int s = 0; s < kSrcSlots; ++s) {
      uint8_t* p = host + static_cast<size_t>(s) * L::kCopy;
      for (int i = 0; i < L::kX; ++i) p[i] = static_cast<uint8_t>(0x30 + rnd() % 16);
      for (int i = 0; i < L::kSrcW; ++i)
        p[L::kX + i] = static_cast<uint8_t>(L::kPre ? 0x30 + rnd() % 16 : rnd());   // E4M3 near 1 / FP4 codes
      for (int i = 0; i < L::kSrcWsf; ++i) p[L::kX + L::kSrcW + i] = static_cast<uint8_t>(8 * (rnd() % 14));
      float* sx = reinterpret_cast<float*>(p + L::kX + L::kSrcW + L::kSrcWsf);
      for (int i = 0; i < L::kM; ++i) sx[i] = 1.0f + static_cast<float>(rnd() % 64) * 0x1p-10f;
    }
  });
}

template <int kWGs, int kRows, Decoder kDecode, bool kPromote>
void run(const ProbeBuffers& b) {
  using L = Layout<kWGs, kRows, kDecode>;
  auto kernel = prefill_kernel<kWGs, kRows, kDecode, kPromote>;
  probe_check(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, L::kSmem),
              "cudaFuncSetAttribute");
  uint8_t* src = make_source<L>();
  const int num_kb = 1 << 20 >> (kRows / 128 + kWGs);   // about the same work per variant
  const ProbeTime t = probe_time(
      [&] { kernel<<<b.sms, L::kThreads, L::kSmem>>>(num_kb, src, b.cycles, b.sink, b.err); }, b.cycles, b.sms);
  probe_check(cudaFree(src), "cudaFree");
  std::printf("%4d %5d %6d %-9s %-8s", L::kM, kRows, L::kStages,
              kDecode == kNoDecode         ? "-"
              : kDecode == kConsumerDecode ? "consumer"
              : kDecode == kProducerDecode ? "producer"
              : kDecode == kPredecoded     ? "before"
                                           : "7 warps",
              kPromote ? "FFMA" : "-");
  print_rate(static_cast<double>(num_kb) * L::kM * kRows * kBlockK, t, b.sms);
}

}  // namespace

int main() {
  const ProbeBuffers b = probe_buffers();
  std::printf("%4s %5s %6s %-9s %-8s", "M", "rows", "stages", "decode", "promote");
  print_rate_header();
  run<2, 128, kConsumerDecode, true>(b);
  run<2, 128, kProducerDecode, true>(b);
  run<2, 128, kNoDecode, true>(b);
  run<2, 128, kPredecoded, true>(b);
  run<2, 256, kConsumerDecode, true>(b);
  run<2, 256, kProducerDecode, true>(b);
  run<2, 256, kNoDecode, true>(b);
  run<2, 256, kPredecoded, true>(b);
  run<2, 128, kWarpgroupDecode, true>(b);
  run<2, 256, kWarpgroupDecode, true>(b);
  run<2, 256, kProducerDecode, false>(b);
  return 0;
}
