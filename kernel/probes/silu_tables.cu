// Writes the two 65 536-entry SiLU tables of SPEC §3 D6 step 3 by running the kernel's own
// device function (kernel/epilogue/silu.cuh) on every bf16 bit pattern.
//
//   silu_tables <fast.bin> <precise.bin>
//
// Each file is 65 536 little-endian fp32 values; entry i is silu(bf16 bits i).
// Built by megamoe.silu_probe with the kernel's own nvcc flags (megamoe/jit/flags.py), so the probe
// rounds exactly as the kernel does.
#include <cstdio>
#include <cstdint>
#include <cstdlib>
#include <vector>

#include "../epilogue/silu.cuh"

__global__ void silu_tables_kernel(float* fast, float* precise) {
  const uint32_t i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= 65536u) return;
  const float g = __uint_as_float(i << 16);  // bf16 -> fp32 is exact: the bits move up
  fast[i] = megamoe::silu<true>(g);
  precise[i] = megamoe::silu<false>(g);
}

static void check(cudaError_t err, const char* what) {
  if (err != cudaSuccess) {
    std::fprintf(stderr, "silu_tables: %s failed: %s\n", what, cudaGetErrorString(err));
    std::exit(1);
  }
}

static void write_table(const char* path, const std::vector<float>& table) {
  FILE* f = std::fopen(path, "wb");
  if (f == nullptr || std::fwrite(table.data(), sizeof(float), table.size(), f) != table.size()) {
    std::fprintf(stderr, "silu_tables: cannot write %s\n", path);
    std::exit(1);
  }
  std::fclose(f);
}

int main(int argc, char** argv) {
  if (argc != 3) {
    std::fprintf(stderr, "usage: %s <fast.bin> <precise.bin>\n", argv[0]);
    return 2;
  }
  constexpr int kN = 65536;
  float* d_fast = nullptr;
  float* d_precise = nullptr;
  check(cudaMalloc(&d_fast, kN * sizeof(float)), "cudaMalloc");
  check(cudaMalloc(&d_precise, kN * sizeof(float)), "cudaMalloc");
  silu_tables_kernel<<<kN / 256, 256>>>(d_fast, d_precise);
  check(cudaGetLastError(), "launch");
  check(cudaDeviceSynchronize(), "kernel");
  std::vector<float> fast(kN), precise(kN);
  check(cudaMemcpy(fast.data(), d_fast, kN * sizeof(float), cudaMemcpyDeviceToHost), "copy");
  check(cudaMemcpy(precise.data(), d_precise, kN * sizeof(float), cudaMemcpyDeviceToHost), "copy");
  write_table(argv[1], fast);
  write_table(argv[2], precise);
  std::printf("silu_tables: wrote %s and %s\n", argv[1], argv[2]);
  return 0;
}
