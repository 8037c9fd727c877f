// Can the narrow engine take a K block's four k32 products from one accumulating group of four
// wgmmas (bench/NOTES.md v50, "step-major token columns")? The B operand's 8 columns are (k32 step
// s, token j) of two tokens: column 2s + j holds token j's 32 activations of step s in step s's K
// range and zeros in the other three, so each accumulator column receives its own step's products
// and three zero sums. That equals today's form (four wgmmas, each overwriting its own accumulator
// with one step's products over the 128-byte swizzled token tile) only if the tensor core leaves an
// accumulator's bits alone when it adds a zero sum to it, and if the step tiles' descriptor (K-major,
// no swizzle) is right: this probe checks both, bit for bit, on random and special operands.
//
//   step_columns          (built and run by python -m bench.step_columns)
//
// One row a kind of operand: the comparisons (the 8 x 64 products of two tokens a trial, 4 steps),
// how many differ, how many of those differ only in a NaN's payload or a zero's sign, and the first
// that differs. Exit status 1 when any differs in another way.
#include <cstdint>
#include <cstdio>
#include <cstdlib>

#include "../common/ptx.cuh"
#include "../gemm/wgmma_fp8_rs.cuh"
#include "probe_timing.h"

using namespace megamoe;

constexpr int kTrials = 64;   // per CTA and kind
constexpr int kKinds = 6;
const char* const kKindNames[kKinds] = {"finite", "any byte (NaN too)", "sparse",
                                        "near 1", "zero x, negative w", "wide range"};

// The E4M3 bytes the FP4 decode gives (E2M1 magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6), as the weights.
__constant__ uint8_t kFp4AsE4m3[8] = {0x00, 0x30, 0x38, 0x3C, 0x40, 0x44, 0x48, 0x4C};

__device__ __forceinline__ uint32_t mix(uint32_t x) {
  x ^= x >> 16;
  x *= 0x7feb352du;
  x ^= x >> 15;
  x *= 0x846ca68bu;
  x ^= x >> 16;
  return x;
}

// One activation byte of kind `kind` from random bits r.
__device__ __forceinline__ uint8_t x_byte(int kind, uint32_t r) {
  const uint8_t b = r & 0xFF;
  switch (kind) {
    case 0:
      return (b & 0x7F) == 0x7F ? static_cast<uint8_t>(b ^ 1) : b;   // every finite E4M3
    case 1:
      return b;                                                     // NaN (0x7F / 0xFF) too
    case 2:
      return (r >> 8) % 8 == 0 ? static_cast<uint8_t>((b & 0x7F) == 0x7F ? b ^ 1 : b) : 0;
    case 3:
      return static_cast<uint8_t>(0x30 + b % 0x19) | (r & 0x100 ? 0x80 : 0);   // 0.5 .. 3.25
    case 4:
      return 0;
    default:
      return (r >> 8) % 2 ? static_cast<uint8_t>(0x7E | (b & 0x80))
                          : static_cast<uint8_t>(b & 0x87);   // ±448, subnormals
  }
}

__device__ __forceinline__ uint8_t w_byte(int kind, uint32_t r) {
  const uint8_t m = kFp4AsE4m3[r & 7];
  return kind == 4 ? static_cast<uint8_t>(m | 0x80) : static_cast<uint8_t>(m | (r & 8 ? 0x80 : 0));
}

// counts[kind]: {compared, differ, differ in a NaN payload or a zero's sign only}; first[kind]: the
// first difference {trial, lane, element, got, want} (trial -1: none).
__global__ void __launch_bounds__(128, 1) step_columns_kernel(unsigned long long* counts, int* first) {
  __shared__ __align__(1024) uint8_t x_ref[8 * 128];   // today's token tile: 8 tokens x 128 B, 128-byte swizzle
  __shared__ __align__(256) uint8_t steps[4 * 256];    // tile s: 8 rows x 32 B as two core matrices
  const int tid = threadIdx.x;
  const int lane = tid % 32;
  const int t = lane % 4;
  for (int kind = 0; kind < kKinds; ++kind) {
    for (int trial = 0; trial < kTrials; ++trial) {
      const uint32_t seed = mix((blockIdx.x * kKinds + kind) * kTrials + trial + 1);
      // The token tile: thread i writes bytes 8i .. 8i + 7 (token i / 16, bytes 8 (i % 16) ..).
      uint8_t xb[8];
      const int tok = tid / 16, k0 = (tid % 16) * 8;
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        xb[i] = x_byte(kind, mix(seed ^ (tid * 8 + i) * 0x9E3779B9u));
        const int k = k0 + i;
        x_ref[tok * 128 + (((k / 16) ^ (tok % 8)) * 16) + k % 16] = xb[i];
      }
      // The step tiles: zero, then row 2s + j of tile s is token j's bytes 32 s .. 32 s + 31 (core
      // matrix c = bytes 16 c .. of the 32, at 128 c; its row at 16 (2s + j)).
      for (int i = tid; i < 4 * 256; i += 128) steps[i] = 0;
      __syncthreads();
      if (tok < 2) {
#pragma unroll
        for (int i = 0; i < 8; ++i) {
          const int k = k0 + i, s = k / 32, c = (k % 32) / 16;
          steps[s * 256 + c * 128 + (2 * s + tok) * 16 + k % 16] = xb[i];
        }
      }
      ptx::fence_proxy_async_smem();
      __syncthreads();

      uint32_t a[4][4];
#pragma unroll
      for (int s = 0; s < 4; ++s)
#pragma unroll
        for (int q = 0; q < 4; ++q) {
          uint32_t w = 0;
#pragma unroll
          for (int b = 0; b < 4; ++b)
            w |= static_cast<uint32_t>(w_byte(kind, mix(seed + 0x51ED27u * (tid * 64 + s * 16 + q * 4 + b))))
                 << (8 * b);
          a[s][q] = w;
        }

      float ref[4][4], d[4];
      const uint32_t ref_lo = ptx::smem_desc_sw128_lo(x_ref);
      ptx::wgmma_fence();
#pragma unroll
      for (int s = 0; s < 4; ++s)
        WgmmaRS<8>::mma_overwrite(ref[s], a[s][0], a[s][1], a[s][2], a[s][3],
                                  ptx::smem_desc_sw128_from_lo(ref_lo + s * 2));
      ptx::wgmma_commit();
      ptx::wgmma_wait<0>();
      ptx::wgmma_fence();
      // Step tile s: two core matrices 128 bytes apart along K, one 8-row group.
      auto step_desc = [&](int s) {
        return ptx::smem_desc_none_from_lo(ptx::smem_desc_none_lo(steps + s * 256, 128), 256);
      };
      WgmmaRS<8>::mma_overwrite(d, a[0][0], a[0][1], a[0][2], a[0][3], step_desc(0));
#pragma unroll
      for (int s = 1; s < 4; ++s) WgmmaRS<8>::mma(d, a[s][0], a[s][1], a[s][2], a[s][3], step_desc(s), 1);
      ptx::wgmma_commit();
      ptx::wgmma_wait<0>();

      // Element 2r + h of lane (g, t) is row g + 8r, column 2t + h: here step t, token h; in today's
      // form tokens 0 and 1 are lane (g, 0)'s, element 2r + h of step s's accumulator.
      unsigned long long differ = 0, benign = 0;
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        float want = 0.0f;
#pragma unroll
        for (int s = 0; s < 4; ++s) {
          const float v = __shfl_sync(0xFFFFFFFFu, ref[s][i], lane & ~3);
          if (s == t) want = v;
        }
        const uint32_t gb = __float_as_uint(d[i]), wb = __float_as_uint(want);
        if (gb != wb) {
          ++differ;
          const bool nan_pair = d[i] != d[i] && want != want;
          const bool zero_pair = (gb | wb) << 1 == 0;
          if (nan_pair || zero_pair) {
            ++benign;
          } else if (atomicCAS(first + kind * 5, -1, trial) == -1) {
            first[kind * 5 + 1] = blockIdx.x * 128 + tid;
            first[kind * 5 + 2] = i;
            first[kind * 5 + 3] = static_cast<int>(gb);
            first[kind * 5 + 4] = static_cast<int>(wb);
          }
        }
      }
      atomicAdd(counts + kind * 3, 4ull);
      if (differ) atomicAdd(counts + kind * 3 + 1, differ);
      if (benign) atomicAdd(counts + kind * 3 + 2, benign);
      __syncthreads();   // the tiles are rewritten by the next trial
    }
  }
}

int main() {
  const ProbeBuffers b = probe_buffers();
  unsigned long long* counts;
  int* first;
  probe_check(cudaMalloc(&counts, sizeof(unsigned long long) * kKinds * 3), "cudaMalloc");
  probe_check(cudaMemset(counts, 0, sizeof(unsigned long long) * kKinds * 3), "cudaMemset");
  probe_check(cudaMalloc(&first, sizeof(int) * kKinds * 5), "cudaMalloc");
  probe_check(cudaMemset(first, 0xFF, sizeof(int) * kKinds * 5), "cudaMemset");
  step_columns_kernel<<<b.sms, 128>>>(counts, first);
  probe_check(cudaDeviceSynchronize(), "step_columns_kernel");
  unsigned long long hc[kKinds * 3];
  int hf[kKinds * 5];
  probe_check(cudaMemcpy(hc, counts, sizeof(hc), cudaMemcpyDeviceToHost), "cudaMemcpy");
  probe_check(cudaMemcpy(hf, first, sizeof(hf), cudaMemcpyDeviceToHost), "cudaMemcpy");
  std::printf("%-20s %10s %8s %12s  %s\n", "operands", "compared", "differ", "NaN/±0 only", "first other difference");
  int bad = 0;
  for (int k = 0; k < kKinds; ++k) {
    std::printf("%-20s %10llu %8llu %12llu  ", kKindNames[k], hc[k * 3], hc[k * 3 + 1], hc[k * 3 + 2]);
    if (hf[k * 5] < 0) {
      std::printf("-\n");
    } else {
      bad = 1;
      std::printf("trial %d thread %d element %d: 0x%08x, today's form 0x%08x\n", hf[k * 5], hf[k * 5 + 1],
                  hf[k * 5 + 2], static_cast<uint32_t>(hf[k * 5 + 3]), static_cast<uint32_t>(hf[k * 5 + 4]));
    }
  }
  return bad;
}
