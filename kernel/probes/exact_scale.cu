// Does the tensor core's k32 sum keep its bits when the weights' values are scaled by 2^-6, as the
// exact mode's E4M3 words decode them (bench/NOTES.md v65)? Every product of an E4M3 activation and
// a decoded FP4 weight is exact either way, so the sums are the table decode's x 2^-6 bit for bit
// exactly when the tensor core's summation is invariant under a power-of-two scale of its operands.
// The gpt-oss layer's y moved in some bits with the E4M3 words (one H100): this probe says whether
// the tensor core is where they moved, on random and special operands.
//
//   exact_scale          (built and run by python -m bench.exact_scale)
//
// A trial: one warpgroup's four k32 steps of 64 weight rows and 8 tokens, each an m64n8k32 wgmma
// overwriting its accumulator (the exact mainloops' form), once with the table decode's bytes and
// once with the E4M3 words' of the same codes; the second's sums x 2^6 (exact_decode_unscale's
// multiply) are compared with the first's, bit for bit. One row a kind of activation operand:
// the comparisons (64 x 8 sums x 4 steps a trial), how many differ, how many of those only in a
// NaN's payload or a zero's sign, and the first other difference. Exit status 1 when any differs in
// another way.
#include <cstdint>

#include "../common/ptx.cuh"
#include "../gemm/wgmma_fp8_rs.cuh"
#include "probe_operands.h"

using namespace megamoe;

__global__ void __launch_bounds__(128, 1) exact_scale_kernel(Tally tally) {
  __shared__ __align__(1024) uint8_t x_tile[8 * 128];   // 8 tokens x 128 B, 128-byte swizzle
  const int tid = threadIdx.x;
  for (int kind = 0; kind < kKinds; ++kind) {
    for (int trial = 0; trial < kTrials; ++trial) {
      const uint32_t seed = mix((blockIdx.x * kKinds + kind) * kTrials + trial + 1);
      uint8_t xb[8];
      write_token_tile(x_tile, tid, kind, seed, xb);
      ptx::fence_proxy_async_smem();
      __syncthreads();

      // The same codes through both decodes: table[s][q] (the values), words[s][q] (x 2^-6).
      uint32_t table[4][4] = {}, words[4][4] = {};
      for_weight_bytes(seed, tid, [&](int s, int q, int b, uint32_t r) {
        table[s][q] |= static_cast<uint32_t>(fp4_byte(kind, r, 0)) << (8 * b);
        words[s][q] |= static_cast<uint32_t>(fp4_byte(kind, r, 1)) << (8 * b);
      });

      float want[4][4], got[4][4];
      const uint32_t lo = ptx::smem_desc_sw128_lo(x_tile);
      ptx::wgmma_fence();
#pragma unroll
      for (int s = 0; s < 4; ++s) {
        const uint64_t desc = ptx::smem_desc_sw128_from_lo(lo + s * 2);
        WgmmaRS<8>::mma_overwrite(want[s], table[s][0], table[s][1], table[s][2], table[s][3], desc);
        WgmmaRS<8>::mma_overwrite(got[s], words[s][0], words[s][1], words[s][2], words[s][3], desc);
      }
      ptx::wgmma_commit();
      ptx::wgmma_wait<0>();
#pragma unroll
      for (int s = 0; s < 4; ++s) {
#pragma unroll
        for (int i = 0; i < 4; ++i) got[s][i] = __fmul_rn(got[s][i], 64.0f);
        tally.add(kind, trial, got[s], want[s]);
      }
      __syncthreads();   // the tile is rewritten by the next trial
    }
  }
}

int main() {
  return run_tally(exact_scale_kernel, "table decode");
}
