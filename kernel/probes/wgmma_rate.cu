// What the tensor core gives the GEMM core's wgmma forms: FP8 m64nNk32 wgmmas issued by the
// consumer warpgroups of one CTA per SM in groups of four (one K128 block), each group waited for
// before the next (the wide tile's serial schedule), with nothing else to do but, optionally,
// promote each group's products with one FFMA per accumulator (the fast mode's promotion; without
// it the groups accumulate). Prints the rate per SM clock of each variant against the dense peak
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
__global__ void __launch_bounds__(256, 1) rate_kernel(int iters, long long* cycles, float* sink) {
  extern __shared__ __align__(1024) uint8_t smem[];
  const int tid = threadIdx.x;
  const int wg = tid / 128;
  uint8_t* b_tile = smem;                         // [N][128] bytes, shared by the warpgroups
  uint8_t* a_tile = smem + N * 128 + wg * 8192;   // [64][128] bytes per warpgroup (SS)
  uint32_t* words = reinterpret_cast<uint32_t*>(smem);
  const int n_words = (N * 128 + 2 * 8192) / 4;
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

static void check(cudaError_t err, const char* what) {
  if (err != cudaSuccess) {
    std::fprintf(stderr, "wgmma_rate: %s failed: %s\n", what, cudaGetErrorString(err));
    std::exit(1);
  }
}

template <bool kRS, int N, bool kPromote>
static void run(int wgs, int sms, long long* cycles, float* sink) {
  auto kernel = rate_kernel<kRS, N, kPromote>;
  const int smem = N * 128 + 2 * 8192;
  check(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem), "cudaFuncSetAttribute");
  const int iters = 4000 * 256 / N;
  cudaEvent_t e0, e1;
  check(cudaEventCreate(&e0), "cudaEventCreate");
  check(cudaEventCreate(&e1), "cudaEventCreate");
  kernel<<<sms, 128 * wgs, smem>>>(iters, cycles, sink);   // warm-up
  check(cudaEventRecord(e0), "cudaEventRecord");
  kernel<<<sms, 128 * wgs, smem>>>(iters, cycles, sink);
  check(cudaEventRecord(e1), "cudaEventRecord");
  check(cudaEventSynchronize(e1), "launch");
  float ms = 0.0f;
  check(cudaEventElapsedTime(&ms, e0, e1), "cudaEventElapsedTime");
  long long* host = static_cast<long long*>(std::malloc(sizeof(long long) * sms));
  check(cudaMemcpy(host, cycles, sizeof(long long) * sms, cudaMemcpyDeviceToHost), "cudaMemcpy");
  double mean = 0.0;
  for (int i = 0; i < sms; ++i) mean += static_cast<double>(host[i]) / sms;
  std::free(host);
  const double macs = static_cast<double>(wgs) * iters * 4 * 64 * N * 32;
  const double per_clk = macs / mean;
  std::printf("%-4s %4d %4d %-8s %10.0f %7.1f %10.1f %7.2f\n", kRS ? "RS" : "SS", N, wgs, kPromote ? "FFMA" : "-",
              per_clk, 100.0 * per_clk / 4096.0, 2.0 * macs * sms / (ms * 1e-3) / 1e12, mean / (ms * 1e6));
}

int main() {
  int sms = 0;
  check(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0), "cudaDeviceGetAttribute");
  long long* cycles;
  float* sink;
  check(cudaMalloc(&cycles, sizeof(long long) * sms), "cudaMalloc");
  check(cudaMalloc(&sink, sizeof(float) * 256), "cudaMalloc");
  std::printf("%-4s %4s %4s %-8s %10s %7s %10s %7s\n", "form", "N", "wgs", "promote", "MAC/clk/SM", "% peak", "TFLOP/s",
              "GHz");
  run<true, 64, false>(2, sms, cycles, sink);
  run<true, 64, true>(2, sms, cycles, sink);
  run<true, 128, false>(1, sms, cycles, sink);
  run<true, 128, false>(2, sms, cycles, sink);
  run<true, 128, true>(2, sms, cycles, sink);
  run<true, 256, false>(2, sms, cycles, sink);
  run<false, 128, false>(2, sms, cycles, sink);
  run<false, 128, true>(2, sms, cycles, sink);
  run<false, 256, false>(2, sms, cycles, sink);
  return 0;
}
