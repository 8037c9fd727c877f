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

#include "../common/ptx.cuh"
#include "../gemm/wgmma_fp8_rs.cuh"
#include "probe_operands.h"

using namespace megamoe;

__global__ void __launch_bounds__(128, 1) step_columns_kernel(Tally tally) {
  __shared__ __align__(1024) uint8_t x_ref[8 * 128];   // today's token tile: 8 tokens x 128 B, 128-byte swizzle
  __shared__ __align__(256) uint8_t steps[4 * 256];    // tile s: 8 rows x 32 B as two core matrices
  const int tid = threadIdx.x;
  const int lane = tid % 32;
  const int t = lane % 4;
  for (int kind = 0; kind < kKinds; ++kind) {
    for (int trial = 0; trial < kTrials; ++trial) {
      const uint32_t seed = mix((blockIdx.x * kKinds + kind) * kTrials + trial + 1);
      uint8_t xb[8];
      write_token_tile(x_ref, tid, kind, seed, xb);
      const int tok = tid / 16, k0 = (tid % 16) * 8;
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

      // The weights: the table decode's bytes.
      uint32_t a[4][4] = {};
      for_weight_bytes(seed, tid, [&](int s, int q, int b, uint32_t r) {
        a[s][q] |= static_cast<uint32_t>(fp4_byte(kind, r, 0)) << (8 * b);
      });

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
      float want[4];
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        want[i] = 0.0f;
#pragma unroll
        for (int s = 0; s < 4; ++s) {
          const float v = __shfl_sync(0xFFFFFFFFu, ref[s][i], lane & ~3);
          if (s == t) want[i] = v;
        }
      }
      tally.add(kind, trial, d, want);
      __syncthreads();   // the tiles are rewritten by the next trial
    }
  }
}

int main() {
  return run_tally(step_columns_kernel, "today's form");
}
