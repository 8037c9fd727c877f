// What the tensor core gives the GEMM core's wgmma forms: FP8 m64nNk32 wgmmas issued by the
// consumer warpgroups of one CTA per SM in groups of four (one K128 block), each group waited for
// before the next (the wide tile's serial schedule), with nothing else to do but, optionally,
// promote each group's products with one FFMA per accumulator (the fast mode's promotion; without
// it the groups accumulate). The rows of N 8 and 16 are the exact mode's narrow tiles: what the
// tensor core gives the narrow engine (8 tokens, two consumer warpgroups, or three) whatever its
// warps do around the wgmmas. Prints the rate per SM clock of each variant against the dense peak
// (1024 FP8 multiply-adds per clock per SM sub-partition, 4096 per SM).
//
//   wgmma_rate            (built and run by python -m bench.wgmma_rate)
//
// Variants: RS (A from registers, as the GEMM core decodes its FP4 weights into) or SS (both
// operands in shared memory, as a plain FP8 GEMM), the width N, the consumer warpgroups. The
// operands are fixed bytes (E4M3 values near 1): the rate does not depend on them.
#include <cstdint>
#include <cstdio>
#include <cstdlib>

#include "../common/ptx.cuh"
#include "../gemm/wgmma_fp8_rs.cuh"
#include "../gemm/wgmma_fp8_ss.cuh"
#include "probe_timing.h"

using namespace megamoe;

template <bool kRS, int N, bool kPromote>
__device__ __forceinline__ void group(float (&d)[N / 2], uint32_t a, uint32_t a_lo, uint32_t b_lo) {
  ptx::wgmma_fence();
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    const uint64_t db = ptx::smem_desc_sw128_from_lo(b_lo + 2 * k);
    // With a promotion each group starts afresh (as the GEMM core's); without one it accumulates
    // onto the last, so that no group's products are dead (ptxas drops wgmmas whose results
    // nothing reads: the first version of this probe reported 3x the peak).
    const int scale_d = kPromote ? k : 1;
    if constexpr (kRS) {
      if (kPromote && k == 0)
        WgmmaRS<N>::mma_overwrite(d, a, a ^ 1u, a ^ 2u, a ^ 3u, db);
      else
        WgmmaRS<N>::mma(d, a, a ^ 1u, a ^ 2u, a ^ 3u, db, scale_d);
    } else {
      WgmmaSS<N>::mma(d, ptx::smem_desc_sw128_from_lo(a_lo + 2 * k), db, scale_d);
    }
  }
  ptx::wgmma_commit();
}

template <bool kRS, int N, bool kPromote>
__global__ void __launch_bounds__(384, 1) rate_kernel(int iters, long long* cycles, float* sink) {
  extern __shared__ __align__(1024) uint8_t smem[];
  const int tid = threadIdx.x;
  const int wg = tid / 128;
  uint8_t* b_tile = smem;                         // [N][128] bytes, shared by the warpgroups
  uint8_t* a_tile = smem + N * 128 + wg * 8192;   // [64][128] bytes per warpgroup (SS)
  uint32_t* words = reinterpret_cast<uint32_t*>(smem);
  const int n_words = (N * 128 + blockDim.x / 128 * 8192) / 4;
  for (int i = tid; i < n_words; i += blockDim.x) words[i] = 0x38383838u ^ ((i * 0x01010101u) & 0x07070707u);
  ptx::fence_proxy_async_smem();
  __syncthreads();
  const uint32_t a = 0x38383838u ^ (tid & 7u);
  const uint32_t a_lo = ptx::smem_desc_sw128_lo(a_tile);
  const uint32_t b_lo = ptx::smem_desc_sw128_lo(b_tile);
  const float scale = 1.0f + (tid & 3) * 0x1p-10f;
  float tmp[N / 2];
#pragma unroll
  for (int i = 0; i < N / 2; ++i) tmp[i] = 0.0f;
  float res[kPromote ? N / 2 : 1];
#pragma unroll
  for (int i = 0; i < (kPromote ? N / 2 : 1); ++i) res[i] = 0.0f;
  auto promote = [&](float (&t)[N / 2]) {
    if constexpr (kPromote) {
#pragma unroll
      for (int i = 0; i < N / 2; ++i) ptx::fence_operand(t[i]);
#pragma unroll
      for (int i = 0; i < N / 2; ++i) res[i] = __fmaf_rn(t[i], scale, res[i]);
#pragma unroll
      for (int i = 0; i < N / 2; ++i) ptx::fence_operand(res[i]);
    }
  };
  const long long t0 = clock64();
  for (int it = 0; it < iters; ++it) {
    group<kRS, N, kPromote>(tmp, a, a_lo, b_lo);
    ptx::wgmma_wait<0>();
    promote(tmp);
  }
  const long long t1 = clock64();
  float s = 0.0f;
#pragma unroll
  for (int i = 0; i < N / 2; ++i) s += tmp[i];
#pragma unroll
  for (int i = 0; i < (kPromote ? N / 2 : 1); ++i) s += res[i];
  if (s == 1.2345f) sink[tid] = s;   // keeps the products live; never true for these operands
  if (tid == 0) cycles[blockIdx.x] = t1 - t0;
}

template <bool kRS, int N, bool kPromote>
static void run(int wgs, const ProbeBuffers& b) {
  auto kernel = rate_kernel<kRS, N, kPromote>;
  const int smem = N * 128 + wgs * 8192;
  probe_check(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem), "cudaFuncSetAttribute");
  const int iters = 4000 * 256 / N;
  const ProbeTime t = probe_time([&] { kernel<<<b.sms, 128 * wgs, smem>>>(iters, b.cycles, b.sink); }, b.cycles, b.sms);
  std::printf("%-4s %4d %4d %-8s", kRS ? "RS" : "SS", N, wgs, kPromote ? "FFMA" : "-");
  print_rate(static_cast<double>(wgs) * iters * 4 * 64 * N * 32, t, b.sms);
}

int main() {
  const ProbeBuffers b = probe_buffers();
  std::printf("%-4s %4s %4s %-8s", "form", "N", "wgs", "promote");
  print_rate_header();
  run<true, 64, false>(2, b);
  run<true, 64, true>(2, b);
  run<true, 128, false>(1, b);
  run<true, 128, false>(2, b);
  run<true, 128, true>(2, b);
  run<true, 256, false>(2, b);
  run<false, 128, false>(2, b);
  run<false, 128, true>(2, b);
  run<false, 256, false>(2, b);
  run<true, 8, false>(2, b);
  run<true, 8, true>(2, b);
  run<true, 8, false>(3, b);
  run<true, 8, true>(3, b);
  run<true, 16, false>(2, b);
  run<true, 8, false>(1, b);
  run<true, 8, true>(1, b);
  run<true, 16, false>(3, b);
  run<true, 32, false>(3, b);
  return 0;
}
