// What the exact mode's prefill loop could reach in other shapes: the prefill engine's orientation
// (tokens as wgmma M, 64 a consumer warpgroup, the predecoded E4M3 weight tile as the shared-memory
// B operand), each k32 product promoted on its own with one FFMA per accumulator by the token's
// fp32 k32 scale (the folded items' promotion, gemm_sm90_prefill.cuh prefill_mainloop_scaled).
//
//   exact_rate            (built and run by python -m bench.exact_rate)
//
// Why: the fused prefill loop runs at about a quarter of the tensor rate at gpt-oss T = 4096, and
// ncu put its stalls on the wgmma -> wait -> promote chain of each warpgroup (bench/NOTES.md v37),
// where the fast mode's K128 promotion (four wgmmas a wait) ran at 88 % in v14's probe. This probe
// times the steady state of a long K loop, one CTA per SM, stages brought by bulk copies from
// L2-resident buffers (prefill_rate.cu's harness, "before" form), for loop shapes the fused kernel
// could take:
//   kWGs    consumer warpgroups (64 tokens each; the CTA tile's M is 64 kWGs),
//   kRows   weight rows of the CTA tile (each warpgroup computes all of them),
//   kStepN  weight rows of one wgmma (its N): a group is one k32 wgmma of kStepN rows,
//   kDepth  temporaries of kStepN / 2 registers: group j + kDepth - 1 is issued before group j is
//           waited for (wait<kDepth - 1>) and promoted, so kDepth - 1 groups stay in flight across
//           a promotion (1: the fused loop's chain),
//   kPromo  kK32 (each group promoted, the exact mode), kWaitOnly (each group waited for, an eighth of its
//           FFMAs: the chain's latency without the promotion's issue), kK128 (four k32 wgmmas a group, one promotion: the fast mode).
//   kBusy   producer warps (of warps 1-3) that run an L1-epilogue-like loop (shared loads, the clamped
//           SwiGLU's FP32 and MUFU work, a group maximum) for as long as the consumers compute, as the
//           fused kernel's two epilogue warps do in the issue slots of the same four schedulers
//           (bench/NOTES.md v44: three consumer warpgroups lost in the layer what they gained here).
// Prints MAC/clk/SM against the dense FP8 peak (4096), TFLOP/s and the SM clock.
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <type_traits>

#include "../common/ptx.cuh"
#include "../epilogue/prefill_rows.cuh"
#include "../gemm/contract.cuh"
#include "../gemm/mainloop.cuh"
#include "../gemm/wgmma_fp8_ss.cuh"
#include "probe_timing.h"

using namespace megamoe;

namespace {

constexpr int kSrcSlots = 16;  // distinct source stages in global memory (L2-resident)
constexpr int kSmemMax = 227 * 1024;

enum Promo { kK32, kWaitOnly, kK128 };

template <int kWGs, int kRows, int kMaxStages = 8>
struct Layout {
  static constexpr int kM = 64 * kWGs;  // tokens per CTA tile
  static constexpr int kX = kM * kBlockK;  // activations, 128-byte swizzle (A operand)
  static constexpr int kB = kRows * kBlockK;  // E4M3 weights, 128-byte swizzle (B operand)
  static constexpr int kSx = 4 * kM * 4;  // fp32 token scales [k32 step][token]
  static constexpr int kStage = (kX + kB + kSx + 1023) / 1024 * 1024;
  static constexpr int kCopy = kX + kB + kSx;  // one source stage: x | B | sx
  static constexpr int kFixed = 2 * 8 * 8 + 16;  // up to 8 stages x 2 barriers, the consumers' end flag
  static constexpr int kStagesFit = (kSmemMax - kFixed) / kStage;
  static constexpr int kStages = kStagesFit < kMaxStages ? kStagesFit : kMaxStages;
  static constexpr int kSmem = kStages * kStage + kFixed;
  static constexpr int kThreads = 128 * (1 + kWGs);
  static constexpr uint32_t kSideRegs = 40;
  static constexpr uint32_t kConsumerRegs =
      ((kThreads * ((65536 / kThreads) / 8 * 8) - 128 * kSideRegs) / (128 * kWGs)) / 8 * 8;
  static_assert(kStages >= 2, "stage ring");
};

// The busy warps' loop (kBusy): until the consumers' end flag, rounds of 8 values a lane from shared
// memory (the ring's first stage, whatever it holds) through the clamped SwiGLU with its routing
// weight and a maximum over four lanes, as prefill_l1_out does per token (its requantization aside).
__device__ __forceinline__ void busy_epilogue(const uint8_t* smem, const volatile int* done, float* sink, int lane) {
  float m = 0.0f;
  uint32_t off = 16u * lane;
  while (*done == 0) {
#pragma unroll 1
    for (int r = 0; r < 32; ++r) {
      const uint4 g = ptx::ld_shared_v4(ptx::smem_addr(smem) + off);
      const uint4 u = ptx::ld_shared_v4(ptx::smem_addr(smem) + off + 512);
      const uint32_t gw[4] = {g.x, g.y, g.z, g.w}, uw[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        const float gate = fminf(i % 2 ? bf16_hi(gw[i / 2]) : bf16_lo(gw[i / 2]), 7.0f);
        const float up = fminf(fmaxf(i % 2 ? bf16_hi(uw[i / 2]) : bf16_lo(uw[i / 2]), -7.0f), 7.0f);
        const float glu = __fdividef(gate, 1.0f + __expf(-1.702f * gate));
        m = fmaxf(m, fabsf(__fmul_rn(__fmul_rn(glu, up + 1.0f), 0.25f)));
      }
      m = fmaxf(m, __shfl_xor_sync(0xFFFFFFFFu, m, 1));
      m = fmaxf(m, __shfl_xor_sync(0xFFFFFFFFu, m, 2));
      off = (off + 1024u) & 0x3FFFu;
    }
  }
  if (m == 1.2345f) sink[lane] = m;
}

template <int kWGs, int kRows, int kStepN, int kDepth, Promo kPromo, int kMaxStages, int kBusy>
__global__ void __launch_bounds__(Layout<kWGs, kRows>::kThreads, 1)
    exact_kernel(int items, int num_kb, const uint8_t* src, long long* cycles, float* sink, int* err) {
  using L = Layout<kWGs, kRows, kMaxStages>;
  constexpr int S = L::kStages;
  constexpr int kParts = kRows / kStepN;  // wgmmas of one k32 step
  constexpr int kPerGroup = kPromo == kK128 ? 4 : 1;  // k32 wgmmas a group
  constexpr int kGroups = kParts * 4 / kPerGroup;  // groups a K block
  constexpr int kAcc = kStepN / 2;  // registers of one group's product
  static_assert(kGroups % kDepth == 0, "a K block's groups cycle through the temporaries");
  extern __shared__ __align__(1024) uint8_t smem[];
  uint64_t* full = reinterpret_cast<uint64_t*>(smem + S * L::kStage);
  uint64_t* empty = full + S;
  volatile int* done = reinterpret_cast<volatile int*>(empty + 8);
  const int tid = threadIdx.x;
  if (tid == 0) {
    for (int s = 0; s < S; ++s) {
      ptx::mbar_init(&full[s], 1);
      ptx::mbar_init(&empty[s], 4 * kWGs);
    }
    *done = 0;
    ptx::fence_mbar_init();
  }
  __syncthreads();

  if (tid < 128) {
    ptx::setmaxnreg_dec<L::kSideRegs>();
    if (tid == 0) {
      int stage = 0;
      uint32_t phase = 0;
      for (int kb = 0; kb < items * num_kb; ++kb) {
        ptx::mbar_wait(&empty[stage], phase ^ 1, kWaitEmpty, stage, err);
        ptx::mbar_arrive_expect_tx(&full[stage], L::kCopy);
        const uint8_t* from = src + static_cast<int64_t>(kb % kSrcSlots) * L::kCopy;
        ptx::bulk_g2s(smem + stage * L::kStage, from, L::kCopy, &full[stage]);
        if (++stage == S) {
          stage = 0;
          phase ^= 1;
        }
      }
    } else if (tid >= 32 * (4 - kBusy)) {
      busy_epilogue(smem, done, sink, tid % 32);
    }
    return;
  }
  ptx::setmaxnreg_inc<L::kConsumerRegs>();
  const int ctid = ptx::thread_idx() - 128;
  const int wg = ctid / 128;  // tokens 64 wg .. 64 wg + 63 of the tile
  const int wq = ctid / 32 % 4;  // rows 16 wq .. of the warpgroup's 64 tokens
  const int lane = ctid % 32;
  const int row = 64 * wg + 16 * wq + lane / 4;
  const bool k_nonzero = num_kb != 0;  // always: a scheduling barrier, as in the fused loop

  float acc[kParts][kAcc];
#pragma unroll
  for (int q = 0; q < kParts; ++q)
#pragma unroll
    for (int i = 0; i < kAcc; ++i) acc[q][i] = 0.0f;
  float tmp[kDepth][kAcc];

  // Group g of the K block in stage s into tmp[slot]: part g / (4 / kPerGroup), its k32 steps.
  auto issue = [&](int s, int g, float (&d)[kAcc]) {
    const uint8_t* st = smem + s * L::kStage;
    const uint32_t a_lo = __shfl_sync(0xFFFFFFFFu, ptx::smem_desc_sw128_lo(st + 64 * wg * kBlockK), 0);
    const uint32_t b_lo = __shfl_sync(0xFFFFFFFFu, ptx::smem_desc_sw128_lo(st + L::kX), 0);
    const int part = g / (4 / kPerGroup);
    ptx::wgmma_fence();
#pragma unroll
    for (int w = 0; w < kPerGroup; ++w) {
      const int ks = kPromo == kK128 ? w : g % 4;
      const uint64_t da = ptx::smem_desc_sw128_from_lo(a_lo + 2 * ks);
      const uint64_t db = ptx::smem_desc_sw128_from_lo(b_lo + part * (kStepN * kBlockK >> 4) + 2 * ks);
      if (w == 0)
        WgmmaSS<kStepN>::mma_overwrite(d, da, db);
      else
        WgmmaSS<kStepN>::mma(d, da, db, 1);
    }
    ptx::wgmma_commit();
  };

  // Group g of the K block in stage s: wait until at most kLeft groups issued after it are in
  // flight, then promote it. In a branch that always runs but that ptxas cannot remove: it ends the
  // block, so the next issue is not hoisted above this promotion (which would need another
  // temporary).
  auto retire = [&](auto left, int s, auto g_c) {
    constexpr int kLeft = decltype(left)::value;
    constexpr int g = decltype(g_c)::value;
    const float* sx = reinterpret_cast<const float*>(smem + s * L::kStage + L::kX + L::kB) + row;
    const int ks = kPromo == kK128 ? 0 : g % 4;
    const float a0 = sx[ks * L::kM];
    const float a1 = sx[ks * L::kM + 8];
    (void)a1;
    ptx::wgmma_wait<kLeft>();
    float (&d)[kAcc] = tmp[g % kDepth];
#pragma unroll
    for (int i = 0; i < kAcc; ++i) ptx::fence_operand(d[i]);
    constexpr int q = g / (4 / kPerGroup);
    if (k_nonzero) {
      if constexpr (kPromo != kWaitOnly) {
#pragma unroll
        for (int i = 0; i < kAcc; ++i) acc[q][i] = __fmaf_rn(d[i], (i & 2) ? a1 : a0, acc[q][i]);
      } else {  // an eighth of the promotion, so the products are not dead
#pragma unroll
        for (int i = 0; i < kAcc; i += 8) acc[q][i] = __fmaf_rn(d[i], a0, acc[q][i]);
      }
    }
#pragma unroll
    for (int i = 0; i < kAcc; ++i) ptx::fence_operand(acc[q][i]);
  };
  using Left = std::integral_constant<int, kDepth - 1>;
  // Issues the K block's groups in order; after each, retires the group kDepth - 1 before it (this
  // K block's, or the previous one's in stage `prev`, whose stage is then released).
  auto k_block = [&](int s, int prev, bool release_prev) {
    static_for<0, kGroups>([&](auto g_c) {
      constexpr int g = decltype(g_c)::value;
      issue(s, g, tmp[g % kDepth]);
      constexpr int r = g - (kDepth - 1);
      if constexpr (r >= 0) {
        retire(Left{}, s, std::integral_constant<int, r>{});
      } else {
        retire(Left{}, prev, std::integral_constant<int, kGroups + r>{});
        if (r == -1 && release_prev && lane == 0) ptx::mbar_arrive(&empty[prev]);
      }
    });
  };
  // The last K block's groups still in flight after the loop, waits counting down to 0.
  auto tail = [&](int s) {
    static_for<0, kDepth - 1>([&](auto i_c) {
      constexpr int i = decltype(i_c)::value;
      retire(std::integral_constant<int, kDepth - 2 - i>{}, s,
             std::integral_constant<int, kGroups - (kDepth - 1) + i>{});
    });
    if (kDepth > 1 && lane == 0) ptx::mbar_arrive(&empty[s]);
  };

  int stage = 0, prev = 0;
  uint32_t phase = 0;
  auto advance = [&] {
    if (kDepth == 1 && lane == 0) ptx::mbar_arrive(&empty[stage]);
    prev = stage;
    if (++stage == S) {
      stage = 0;
      phase ^= 1;
    }
  };
  const long long t0 = clock64();
  for (int item = 0; item < items; ++item) {
    // Before an item's first K block, its last kDepth - 1 groups once more, so that every K block
    // retires the same: the probe's accumulators take them twice (timing only).
    ptx::mbar_wait(&full[stage], phase, kWaitFull, stage, err);
    static_for<0, kDepth - 1>([&](auto g_c) {
      constexpr int g = kGroups - (kDepth - 1) + decltype(g_c)::value;
      issue(stage, g, tmp[g % kDepth]);
    });
    for (int kb = 0; kb < num_kb; ++kb) {
      ptx::mbar_wait(&full[stage], phase, kWaitFull, stage, err);
      k_block(stage, prev, kb > 0);
      advance();
    }
    tail(prev);
    if (item + 1 == items) {
      // The end is inside the loop: ptxas gives the setmaxnreg budget only to a region that ends
      // with the loop (code after it made it fall back to the launch's registers and spill).
      probe_end(acc, t0, sink, cycles, ctid);
      if (kBusy > 0 && ctid == 0) *done = 1;
    }
  }
}

// Source stages: E4M3 activations and weights near 1, token scales near 1.
template <typename L>
uint8_t* make_source() {
  return probe_upload(static_cast<size_t>(kSrcSlots) * L::kCopy, [](uint8_t* host, auto& rnd) {
    for (int s = 0; s < kSrcSlots; ++s) {
      uint8_t* p = host + static_cast<size_t>(s) * L::kCopy;
      for (int i = 0; i < L::kX + L::kB; ++i) p[i] = static_cast<uint8_t>(0x30 + rnd() % 16);
      float* sx = reinterpret_cast<float*>(p + L::kX + L::kB);
      for (int i = 0; i < 4 * L::kM; ++i) sx[i] = 1.0f + static_cast<float>(rnd() % 64) * 0x1p-10f;
    }
  });
}

template <int kWGs, int kRows, int kStepN, int kDepth, Promo kPromo, int kMaxStages = 8, int kBusy = 0>
void run(const ProbeBuffers& b) {
  using L = Layout<kWGs, kRows, kMaxStages>;
  auto kernel = exact_kernel<kWGs, kRows, kStepN, kDepth, kPromo, kMaxStages, kBusy>;
  probe_check(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, L::kSmem),
              "cudaFuncSetAttribute");
  uint8_t* src = make_source<L>();
  // Items of 23 K blocks (gpt-oss's K = 2880), about the same work per variant.
  const int num_kb = 23;
  const int items = (1 << 21) / (kWGs * kRows / 64) / num_kb;
  const ProbeTime t = probe_time(
      [&] { kernel<<<b.sms, L::kThreads, L::kSmem>>>(items, num_kb, src, b.cycles, b.sink, b.err); }, b.cycles, b.sms);
  probe_check(cudaFree(src), "cudaFree");
  std::printf("%4d %5d %5d %5d %6d %-9s %4d", L::kM, kRows, kStepN, kDepth, L::kStages,
              kPromo == kK32        ? "k32"
              : kPromo == kWaitOnly ? "wait-only"
                                    : "k128",
              kBusy);
  print_rate(static_cast<double>(items) * num_kb * L::kM * kRows * kBlockK, t, b.sms);
}

}  // namespace

int main() {
  const ProbeBuffers b = probe_buffers();
  std::printf("%4s %5s %5s %5s %6s %-9s %4s", "M", "rows", "N", "depth", "stages", "promote", "busy");
  print_rate_header();
  // The fused prefill engine's tile (128 tokens x 256 rows): the fast mode's loop, the exact one
  // as it is, its chain without the FFMAs, and the exact one with smaller wgmmas, pipelined.
  run<2, 256, 128, 1, kK128>(b);
  run<2, 256, 128, 1, kK32>(b);
  run<2, 256, 128, 1, kWaitOnly>(b);
  // The fused kernel's ring: three stages beside its 64 KB staging buffer (and two).
  run<2, 256, 128, 1, kK32, 3>(b);
  run<2, 256, 128, 1, kK32, 2>(b);
  run<2, 256, 64, 1, kK32>(b);
  run<2, 256, 64, 2, kK32>(b);
  // Half the rows: room for a second temporary of 64 registers, or four of 32.
  run<2, 128, 128, 1, kK32>(b);
  run<2, 128, 128, 2, kK32>(b);
  run<2, 128, 64, 2, kK32>(b);
  run<2, 128, 64, 4, kK32>(b);
  // Three consumer warpgroups (192 tokens x 128 rows, 152 registers a thread).
  run<3, 128, 128, 1, kK32>(b);
  run<3, 128, 64, 1, kK32>(b);
  run<3, 128, 64, 2, kK32>(b);
  // Both tiles at the fused kernel's ring depth (3 and 4 stages) with its two epilogue warps' kind of
  // work beside the consumers (kBusy 2), and with one.
  run<2, 256, 128, 1, kK32, 3, 2>(b);
  run<3, 128, 128, 1, kK32, 4, 2>(b);
  run<2, 256, 128, 1, kK32, 3, 1>(b);
  run<3, 128, 128, 1, kK32, 4, 1>(b);
  return 0;
}
