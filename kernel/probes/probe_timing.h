// Host side shared by the rate probes (wgmma_rate.cu, prefill_rate.cu, exact_rate.cu, ...): the
// error check, their source data (probe_upload), one timed launch after a warm-up (the launch's
// time and the mean of the CTAs' clock64 spans), and the rate columns every probe prints after its
// own.
#pragma once

#include <cstdint>
#include <cstdio>
#include <cstdlib>

#include <cuda_runtime.h>

inline void probe_check(cudaError_t e, const char* what) {
  if (e != cudaSuccess) {
    std::fprintf(stderr, "probe: %s failed: %s\n", what, cudaGetErrorString(e));
    std::exit(1);
  }
}

// The probes' source data: a device copy of `bytes` bytes that fill(host, rnd) writes on the host,
// rnd() drawing 24 pseudo-random bits (an LCG, so every run gets the same bytes).
template <typename Fill>
uint8_t* probe_upload(size_t bytes, Fill fill) {
  uint8_t* host = static_cast<uint8_t*>(std::malloc(bytes));
  uint32_t x = 12345u;
  auto rnd = [&] {
    x = x * 1664525u + 1013904223u;
    return x >> 8;
  };
  fill(host, rnd);
  uint8_t* dev;
  probe_check(cudaMalloc(&dev, bytes), "cudaMalloc");
  probe_check(cudaMemcpy(dev, host, bytes, cudaMemcpyHostToDevice), "cudaMemcpy");
  std::free(host);
  return dev;
}

struct ProbeTime {
  double ms;            // the timed launch, by events
  double mean_cycles;   // the CTAs' own spans (clock64), averaged
};

// launch(): one launch of the probe's kernel, which writes each CTA's span to cycles[blockIdx.x].
template <typename Launch>
ProbeTime probe_time(Launch launch, const long long* cycles, int sms) {
  cudaEvent_t e0, e1;
  probe_check(cudaEventCreate(&e0), "cudaEventCreate");
  probe_check(cudaEventCreate(&e1), "cudaEventCreate");
  launch();   // warm-up
  probe_check(cudaEventRecord(e0), "cudaEventRecord");
  launch();
  probe_check(cudaEventRecord(e1), "cudaEventRecord");
  probe_check(cudaEventSynchronize(e1), "launch");
  float ms = 0.0f;
  probe_check(cudaEventElapsedTime(&ms, e0, e1), "cudaEventElapsedTime");
  probe_check(cudaEventDestroy(e0), "cudaEventDestroy");
  probe_check(cudaEventDestroy(e1), "cudaEventDestroy");
  long long* host = static_cast<long long*>(std::malloc(sizeof(long long) * sms));
  probe_check(cudaMemcpy(host, cycles, sizeof(long long) * sms, cudaMemcpyDeviceToHost), "cudaMemcpy");
  double mean = 0.0;
  for (int i = 0; i < sms; ++i) mean += static_cast<double>(host[i]) / sms;
  std::free(host);
  return {ms, mean};
}

// What a probe's launches share: the SM count, each CTA's span (cycles[blockIdx.x]), a sink for
// values kept live, and a zeroed trap record (mbar_wait's).
struct ProbeBuffers {
  int sms = 0;
  long long* cycles = nullptr;
  float* sink = nullptr;
  int* err = nullptr;
};

inline ProbeBuffers probe_buffers() {
  ProbeBuffers b;
  probe_check(cudaDeviceGetAttribute(&b.sms, cudaDevAttrMultiProcessorCount, 0), "cudaDeviceGetAttribute");
  probe_check(cudaMalloc(&b.cycles, sizeof(long long) * b.sms), "cudaMalloc");
  probe_check(cudaMalloc(&b.sink, sizeof(float) * 512), "cudaMalloc");
  probe_check(cudaMalloc(&b.err, sizeof(int) * 8), "cudaMalloc");
  probe_check(cudaMemset(b.err, 0, sizeof(int) * 8), "cudaMemset");
  return b;
}

// A consumer thread's end of the timed loop (t0: its clock64 at the start): the CTA's span by
// consumer thread 0, and the accumulators summed into a sink that is never written for the probes'
// operands, so that their products stay live.
template <int A, int B>
__device__ __forceinline__ void probe_end(const float (&acc)[A][B], long long t0, float* sink, long long* cycles,
                                          int ctid) {
  const long long t1 = clock64();
  float sum = 0.0f;
#pragma unroll
  for (int a = 0; a < A; ++a)
#pragma unroll
    for (int i = 0; i < B; ++i) sum += acc[a][i];
  if (sum == 1.2345f) sink[ctid] = sum;
  if (ctid == 0) cycles[blockIdx.x] = t1 - t0;
}

// MAC/clk/SM, % of the dense FP8 peak per clock (4096), TFLOP/s over all SMs, SM clock (GHz), for
// `macs` multiply-adds per CTA.
inline void print_rate(double macs, const ProbeTime& t, int sms) {
  const double per_clk = macs / t.mean_cycles;
  std::printf(" %10.0f %7.1f %10.1f %7.2f\n", per_clk, 100.0 * per_clk / 4096.0,
              2.0 * macs * sms / (t.ms * 1e-3) / 1e12, t.mean_cycles / (t.ms * 1e6));
}

// The header's columns (after the probe's own).
inline void print_rate_header() {
  std::printf(" %10s %7s %10s %7s\n", "MAC/clk/SM", "% peak", "TFLOP/s", "GHz");
}
