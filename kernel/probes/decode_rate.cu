// How fast a few SMs decode FP4 weights to the prefill kernel's E4M3 tiles when the rest of the
// GPU leaves HBM to them: the question behind overlapping the predecode pass with the prefill GEMM
// (bench/NOTES.md v17). If k SMs decode the layer at well over k/132 of the whole GPU's rate, SMs
// that decode while the others run the compute-bound GEMM hide most of the pass.
//
//   decode_rate          (built and run by python -m bench.decode_rate)
//
// Rows: the predecode pass as launched today (one warp per 16-row group, a grid over all groups,
// many CTAs per SM), then a persistent form: k CTAs of 12 warps (one per SM, the prefill kernel's
// thread count), each warp walking groups k * 12 apart with the packed bytes and LUT offsets of the
// next D groups already loaded into registers (D groups in flight per warp), decoding through the
// scaled tables into its 2 KB of shared memory and copying the group out as 16-byte vectors. Data:
// the DSV3 L1 slice (32 experts, K 7168, 4096 rows: 470 MB packed, 940 MB out).
// Last, "to smem": the persistent form without the copy out, on every SM: what warps that decode a
// streamed layer into shared memory tiles reach (a decode-rate bound for an engine whose decoder
// warps feed shared-memory wgmma operands, bench/NOTES.md v41), its GB/s the bytes read only.
#include <cstdint>
#include <cstdio>
#include <cstdlib>

#include "../common/ptx.cuh"
#include "../gemm/contract.cuh"
#include "../gemm/fp4_decode.cuh"
#include "../gemm/predecode.cuh"
#include "probe_timing.h"

using namespace megamoe;

namespace {

constexpr int kWarps = 12;
constexpr int kOneCtaSmem = 120 * 1024;   // more than half of an SM's shared memory: one CTA per SM

__global__ void __launch_bounds__(kPredecodeThreads)
    predecode_today(const __grid_constant__ GemmParams p, long long* cycles) {
  predecode_body<false>(p);
  (void)cycles;
}

// Group `grp`'s registers: lane's two 16-byte vectors of the packed block, its rows' LUT offsets.
struct GroupRegs {
  uint4 v0, v1;
  uint32_t off_a, off_b;
};

__device__ __forceinline__ void load_group(const GemmParams& p, int64_t grp, int lane, GroupRegs& r) {
  const uint8_t* w_frag = p.w + grp * 1024;
  r.v0 = __ldg(reinterpret_cast<const uint4*>(w_frag + lane * 16));
  r.v1 = __ldg(reinterpret_cast<const uint4*>(w_frag + 512 + lane * 16));
  const int64_t row0 = grp * 16 % p.n_rows;
  const int64_t ekb = grp * 16 / p.n_rows;
  const uint8_t* offs = p.w_sf + (ekb * p.n_rows + row0 + lane / 4) * 4;
  r.off_a = __ldg(reinterpret_cast<const uint32_t*>(offs));
  r.off_b = __ldg(reinterpret_cast<const uint32_t*>(offs + 32));
}

// decode_rows16_sw128's steps with the packed words already in registers.
__device__ __forceinline__ void decode_regs16(const GroupRegs& r, int lane, const uint8_t* s_lut, uint32_t dst) {
  const int g = lane / 4;
  const int t = lane % 4;
  const uint32_t words[8] = {r.v0.x, r.v0.y, r.v0.z, r.v0.w, r.v1.x, r.v1.y, r.v1.z, r.v1.w};
#pragma unroll
  for (int ks = 0; ks < 4; ++ks) {
    const uint2 la = *reinterpret_cast<const uint2*>(s_lut + ptx::prmt(r.off_a, 0u, 0x4440u | ks));
    const uint2 lb = *reinterpret_cast<const uint2*>(s_lut + ptx::prmt(r.off_b, 0u, 0x4440u | ks));
    uint32_t a[4];
    decode_fp4x8(words[2 * ks], la, lb, a[0], a[1]);
    decode_fp4x8(words[2 * ks + 1], la, lb, a[2], a[3]);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int chunk = 2 * ks + (i >> 1);
      ptx::st_shared_u32(dst + (i & 1) * 1024 + g * 128 + ((chunk ^ g) << 4) + 4 * t, a[i]);
    }
  }
}

template <int D, bool kCopyOut>
__global__ void __launch_bounds__(32 * kWarps, 1)
    decode_persistent(const __grid_constant__ GemmParams p, long long* cycles) {
  extern __shared__ __align__(1024) uint8_t smem[];
  uint8_t* stage = smem;
  uint8_t* lut = smem + kWarps * 2048;
  if (threadIdx.x < kLutEntries)
    reinterpret_cast<uint2*>(lut)[threadIdx.x] = make_uint2(scaled_lut_lo(threadIdx.x), scaled_lut_hi(threadIdx.x));
  __syncthreads();
  const long long t0 = clock64();
  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  const int64_t groups = static_cast<int64_t>(p.num_experts) * (p.k / kBlockK) * (p.n_rows / 16);
  const int64_t stride = static_cast<int64_t>(gridDim.x) * kWarps;
  uint8_t* mine = stage + warp * 2048;
  GroupRegs r[D];
  int64_t grp = static_cast<int64_t>(blockIdx.x) * kWarps + warp;
#pragma unroll
  for (int d = 0; d < D; ++d)
    if (grp + d * stride < groups) load_group(p, grp + d * stride, lane, r[d]);
  for (; grp < groups; grp += D * stride) {
#pragma unroll
    for (int d = 0; d < D; ++d) {
      const int64_t g = grp + d * stride;
      if (g >= groups) break;
      decode_regs16(r[d], lane, lut, ptx::smem_addr(mine));
      if constexpr (kCopyOut) {
        __syncwarp();
        const int64_t row0 = g * 16 % p.n_rows;
        const int64_t ekb = g * 16 / p.n_rows;
        uint8_t* dst = p.w_e4m3 + (ekb * (p.n_rows / 256) + row0 / 256) * (256 * kBlockK) + (row0 % 256) / 16 * 2048;
#pragma unroll
        for (int i = 0; i < 4; ++i)
          reinterpret_cast<uint4*>(dst)[lane + 32 * i] = reinterpret_cast<const uint4*>(mine)[lane + 32 * i];
      }
      __syncwarp();
      if (g + D * stride < groups) load_group(p, g + D * stride, lane, r[d]);
    }
  }
  __syncthreads();
  if (threadIdx.x == 0) cycles[blockIdx.x] = clock64() - t0;
}

uint8_t* alloc_fill(size_t bytes, int value) {
  uint8_t* dev = nullptr;
  probe_check(cudaMalloc(&dev, bytes), "cudaMalloc");
  probe_check(cudaMemset(dev, value, bytes), "cudaMemset");
  return dev;
}

void report(const char* name, int sms, int depth, const ProbeTime& t, double bytes, int experts) {
  const double gbs = bytes / (t.ms * 1e-3) / 1e9;
  std::printf("%-12s %4d %3d %9.1f %9.0f %9.1f %9.2f\n", name, sms, depth, t.ms * 1e3, gbs, gbs / sms,
              t.ms * 1e3 / experts);
}

template <int D, bool kCopyOut = true>
void run_persistent(const GemmParams& p, long long* cycles, int sms, double bytes) {
  auto kernel = decode_persistent<D, kCopyOut>;
  probe_check(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kOneCtaSmem),
              "cudaFuncSetAttribute");
  const ProbeTime t = probe_time([&] { kernel<<<sms, 32 * kWarps, kOneCtaSmem>>>(p, cycles); }, cycles, sms);
  probe_check(cudaGetLastError(), "launch");
  report(kCopyOut ? "persistent" : "to smem", sms, D, t, bytes, p.num_experts);
}

}  // namespace

int main() {
  int gpu_sms = 0;
  probe_check(cudaDeviceGetAttribute(&gpu_sms, cudaDevAttrMultiProcessorCount, 0), "cudaDeviceGetAttribute");
  const int experts = 32, k = 7168, rows = 4096;
  const size_t weights = static_cast<size_t>(experts) * k * rows;
  GemmParams p{};
  p.num_experts = experts;
  p.k = k;
  p.n_rows = rows;
  p.w = alloc_fill(weights / 2, 0x5a);
  p.w_sf = alloc_fill(weights / 32, 6 * 8);   // every group through table 6 (2^0)
  p.w_e4m3 = alloc_fill(weights, 0);
  long long* cycles = nullptr;
  probe_check(cudaMalloc(&cycles, sizeof(long long) * 4096), "cudaMalloc");
  const double in_bytes = weights / 2.0 + weights / 32.0;   // packed + offsets
  const double bytes = in_bytes + weights;                     // and the E4M3 bytes out
  std::printf("DSV3 L1 slice: %.0f MB in, %.0f MB out; %d SMs\n", in_bytes / 1e6, weights / 1e6, gpu_sms);
  std::printf("%-12s %4s %3s %9s %9s %9s %9s\n", "form", "SMs", "D", "us", "GB/s", "GB/s/SM", "us/expert");
  {
    const int groups = experts * (k / kBlockK) * (rows / 16);
    probe_check(cudaFuncSetAttribute(predecode_today, cudaFuncAttributeMaxDynamicSharedMemorySize, kPredecodeSmemBytes),
                "cudaFuncSetAttribute");
    const ProbeTime t = probe_time(
        [&] { predecode_today<<<groups / kPredecodeWarps, kPredecodeThreads, kPredecodeSmemBytes>>>(p, cycles); },
        cycles, 1);
    probe_check(cudaGetLastError(), "launch");
    report("today", gpu_sms, 0, t, bytes, experts);
  }
  for (int sms : {gpu_sms, gpu_sms / 2, gpu_sms / 4, 24, 16, 8}) {
    run_persistent<1>(p, cycles, sms, bytes);
    run_persistent<4>(p, cycles, sms, bytes);
    run_persistent<8>(p, cycles, sms, bytes);
  }
  run_persistent<4, false>(p, cycles, gpu_sms, in_bytes);
  run_persistent<8, false>(p, cycles, gpu_sms, in_bytes);
  return 0;
}
