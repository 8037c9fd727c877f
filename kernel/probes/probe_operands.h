// The operands and the tally of the bit-for-bit wgmma probes (step_columns.cu, exact_scale.cu): kinds
// of activation bytes, FP4 weight codes as the decodes' E4M3 bytes, the 128-byte swizzled token tile
// of 8 tokens, and per kind of operand the comparisons, the differences, and the first that differs
// other than in a NaN's payload or a zero's sign.
#pragma once

#include <cstdint>
#include <cstdio>

#include "probe_timing.h"

constexpr int kTrials = 64;   // per CTA and kind
constexpr int kKinds = 6;
const char* const kKindNames[kKinds] = {"finite", "any byte (NaN too)", "sparse",
                                        "near 1", "zero x, negative w", "wide range"};

// The E4M3 bytes the FP4 decodes give for the E2M1 magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6: entries
// 0-7 the table words' (the values), 8-15 the exact mode's E4M3 words' (the values x 2^-6, 0.5 as
// the subnormal 2^-7).
__constant__ uint8_t kFp4AsE4m3[16] = {0x00, 0x30, 0x38, 0x3C, 0x40, 0x44, 0x48, 0x4C,
                                       0x00, 0x04, 0x08, 0x0C, 0x10, 0x14, 0x18, 0x1C};

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

// The decode's byte of an FP4 code (r's bits 0-2: magnitude, bit 3: sign; kind 4's are negative)
// from table `decode` (0: the table words', 1: the exact mode's E4M3 words').
__device__ __forceinline__ uint8_t fp4_byte(int kind, uint32_t r, int decode) {
  const uint8_t m = kFp4AsE4m3[8 * decode + (r & 7)];
  return kind == 4 || (r & 8) ? static_cast<uint8_t>(m | 0x80) : m;
}

// The random bits of thread tid's weight bytes: put(s, q, b, r) for byte b of register q of k32 step
// s of its wgmma A fragments, r drawn from seed (each probe makes its FP4 codes from r: fp4_byte).
template <typename Put>
__device__ __forceinline__ void for_weight_bytes(uint32_t seed, int tid, Put put) {
#pragma unroll
  for (int s = 0; s < 4; ++s)
#pragma unroll
    for (int q = 0; q < 4; ++q)
#pragma unroll
      for (int b = 0; b < 4; ++b) put(s, q, b, mix(seed + 0x51ED27u * (tid * 64 + s * 16 + q * 4 + b)));
}

// Thread tid's 8 bytes of the 128-byte swizzled token tile of 8 tokens (token tid / 16, bytes 8 (tid
// % 16) ..), kind `kind` from seed: written to tile, and returned in xb.
__device__ __forceinline__ void write_token_tile(uint8_t* tile, int tid, int kind, uint32_t seed, uint8_t (&xb)[8]) {
  const int tok = tid / 16, k0 = (tid % 16) * 8;
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    xb[i] = x_byte(kind, mix(seed ^ (tid * 8 + i) * 0x9E3779B9u));
    const int k = k0 + i;
    tile[tok * 128 + (((k / 16) ^ (tok % 8)) * 16) + k % 16] = xb[i];
  }
}

// counts[kind]: {compared, differ, differ in a NaN payload or a zero's sign only}; first[kind]: the
// first other difference {trial, thread, element, got, want} (trial -1: none).
struct Tally {
  unsigned long long* counts;
  int* first;

  // One thread's n comparisons of a trial, got[i] against want[i].
  template <int n>
  __device__ void add(int kind, int trial, const float (&got)[n], const float (&want)[n]) const {
    unsigned long long differ = 0, benign = 0;
#pragma unroll
    for (int i = 0; i < n; ++i) {
      const uint32_t gb = __float_as_uint(got[i]), wb = __float_as_uint(want[i]);
      if (gb == wb) continue;
      ++differ;
      const bool nan_pair = got[i] != got[i] && want[i] != want[i];
      const bool zero_pair = (gb | wb) << 1 == 0;
      if (nan_pair || zero_pair) {
        ++benign;
      } else if (atomicCAS(first + kind * 5, -1, trial) == -1) {
        first[kind * 5 + 1] = blockIdx.x * blockDim.x + threadIdx.x;
        first[kind * 5 + 2] = i;
        first[kind * 5 + 3] = static_cast<int>(gb);
        first[kind * 5 + 4] = static_cast<int>(wb);
      }
    }
    atomicAdd(counts + kind * 3, static_cast<unsigned long long>(n));
    if (differ) atomicAdd(counts + kind * 3 + 1, differ);
    if (benign) atomicAdd(counts + kind * 3 + 2, benign);
  }
};

// Runs kernel(tally) on every SM, 128 threads, and prints the table ("want" named by want_name).
// Returns 1 when any comparison differs other than in a NaN's payload or a zero's sign.
template <typename Kernel>
int run_tally(Kernel kernel, const char* want_name) {
  const ProbeBuffers b = probe_buffers();
  Tally t;
  probe_check(cudaMalloc(&t.counts, sizeof(unsigned long long) * kKinds * 3), "cudaMalloc");
  probe_check(cudaMemset(t.counts, 0, sizeof(unsigned long long) * kKinds * 3), "cudaMemset");
  probe_check(cudaMalloc(&t.first, sizeof(int) * kKinds * 5), "cudaMalloc");
  probe_check(cudaMemset(t.first, 0xFF, sizeof(int) * kKinds * 5), "cudaMemset");
  kernel<<<b.sms, 128>>>(t);
  probe_check(cudaDeviceSynchronize(), "probe kernel");
  unsigned long long hc[kKinds * 3];
  int hf[kKinds * 5];
  probe_check(cudaMemcpy(hc, t.counts, sizeof(hc), cudaMemcpyDeviceToHost), "cudaMemcpy");
  probe_check(cudaMemcpy(hf, t.first, sizeof(hf), cudaMemcpyDeviceToHost), "cudaMemcpy");
  std::printf("%-20s %10s %8s %12s  %s\n", "operands", "compared", "differ", "NaN/±0 only", "first other difference");
  int bad = 0;
  for (int k = 0; k < kKinds; ++k) {
    std::printf("%-20s %10llu %8llu %12llu  ", kKindNames[k], hc[k * 3], hc[k * 3 + 1], hc[k * 3 + 2]);
    if (hf[k * 5] < 0) {
      std::printf("-\n");
    } else {
      bad = 1;
      std::printf("trial %d thread %d element %d: 0x%08x, %s 0x%08x\n", hf[k * 5], hf[k * 5 + 1], hf[k * 5 + 2],
                  static_cast<uint32_t>(hf[k * 5 + 3]), want_name, static_cast<uint32_t>(hf[k * 5 + 4]));
    }
  }
  return bad;
}
