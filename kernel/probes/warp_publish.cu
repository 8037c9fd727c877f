// What compute-sanitizer's racecheck can see of a warp that publishes shared memory through one
// lane's mbarrier arrive, against every lane arriving for its own accesses (what the kernels do
// since bench/NOTES.md v28: the scale warps after writing a stage's scales, kernel/gemm/producer.cuh
// stage_token_scales, and the consumers after reading them; before, one lane arrived after
// __syncwarp, and racecheck reported tens of thousands of hazards on every kernel path).
//
//   warp_publish <mode>      0: RAW, lane 0 arrives after __syncwarp
//                            1: RAW, every lane arrives (count 32)       (the kernels' pattern)
//                            2: WAR, lane 0 arrives after __syncwarp
//                            3: WAR, every lane arrives (count 32)       (the kernels' pattern)
//
// All four are ordered by the PTX memory model: __syncwarp orders the lanes' accesses before lane
// 0's arrive, which releases at CTA scope; the waiter's try_wait acquires. Run under
// `compute-sanitizer --tool racecheck` by `python -m bench.sanitize --probe`. On the H200 it reported
// hazards in mode 0 only (124), none in 1, 2, 3 (bench/NOTES.md v26): for writes, racecheck credits
// an arrive with the arriving thread's own accesses only. Mode 2's silence does not carry over to
// the kernels: their consumers' one-lane release drew WAR reports in the prefill paths (v26, v28),
// where ptxas compiled the __syncwarp to a NOP (here it stays a WARPSYNC.ALL). The probe checks its
// result too (exit 1 on a wrong value).
#include <cstdint>
#include <cstdio>
#include <cstdlib>

#include "../common/ptx.cuh"

namespace ptx = megamoe::ptx;

__global__ void publish(int mode, float* out) {
  __shared__ alignas(8) uint64_t bar;
  __shared__ float buf[32];
  const int lane = threadIdx.x % 32;
  const bool every_lane = mode == 1 || mode == 3;
  if (threadIdx.x == 0) {
    ptx::mbar_init(&bar, every_lane ? 32 : 1);
    ptx::fence_mbar_init();
  }
  if (mode >= 2) buf[lane] = -1.0f;   // WAR: the reader warp's value, written before the barrier
  __syncthreads();
  const bool first_warp = threadIdx.x < 32;
  // RAW: warp 0 writes, warp 1 waits and reads. WAR: warp 0 reads, warp 1 waits and writes.
  if (first_warp) {
    if (mode < 2)
      buf[lane] = 1.5f * lane;
    else
      out[lane] = buf[lane];
    __syncwarp();
    if (every_lane || lane == 0) ptx::mbar_arrive(&bar);
  } else {
    while (!ptx::mbar_try_wait(&bar, 0)) {
    }
    if (mode < 2)
      out[lane] = buf[lane];
    else
      buf[lane] = 2.5f * lane;
  }
}

int main(int argc, char** argv) {
  const int mode = argc == 2 ? std::atoi(argv[1]) : -1;
  if (mode < 0 || mode > 3) {
    std::fprintf(stderr, "usage: warp_publish <mode 0-3>\n");
    return 2;
  }
  float* out;
  float host[32];
  if (cudaMalloc(&out, sizeof host) != cudaSuccess) return 1;
  publish<<<1, 64>>>(mode, out);
  if (cudaMemcpy(host, out, sizeof host, cudaMemcpyDeviceToHost) != cudaSuccess) {
    std::fprintf(stderr, "warp_publish: %s\n", cudaGetErrorString(cudaGetLastError()));
    return 1;
  }
  for (int i = 0; i < 32; ++i) {
    const float want = mode < 2 ? 1.5f * i : -1.0f;
    if (host[i] != want) {
      std::fprintf(stderr, "warp_publish: mode %d lane %d read %g, expected %g\n", mode, i, host[i], want);
      return 1;
    }
  }
  std::printf("warp_publish: mode %d ok\n", mode);
  return 0;
}
