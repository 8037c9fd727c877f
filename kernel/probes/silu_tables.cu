// Writes the 65 536-entry activation tables by running the kernel's own device functions
// (kernel/epilogue/silu.cuh) on every bf16 bit pattern: SiLU (SPEC §3 D6 step 3) and gpt-oss's glu
// factor at one alpha (§8 D6 step 3), each fast and precise.
//
//   silu_tables <silu_fast.bin> <silu_precise.bin> <alpha: fp32 bits, hex> <glu_fast.bin> <glu_precise.bin>
//
// Each file is 65 536 little-endian fp32 values; entry i is f(bf16 bits i). Built by
// megamoe.silu_probe with the kernel's own nvcc flags (megamoe/jit/flags.py), so the probe rounds
// exactly as the kernel does.
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "../epilogue/silu.cuh"

constexpr int kN = 65536;

__global__ void tables_kernel(float* out, float alpha) {
  const uint32_t i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= static_cast<uint32_t>(kN)) return;
  const float g = __uint_as_float(i << 16);  // bf16 -> fp32 is exact: the bits move up
  out[0 * kN + i] = megamoe::silu<true>(g);
  out[1 * kN + i] = megamoe::silu<false>(g);
  out[2 * kN + i] = megamoe::glu_oai<true>(g, alpha);
  out[3 * kN + i] = megamoe::glu_oai<false>(g, alpha);
}

static void check(cudaError_t err, const char* what) {
  if (err != cudaSuccess) {
    std::fprintf(stderr, "silu_tables: %s failed: %s\n", what, cudaGetErrorString(err));
    std::exit(1);
  }
}

static void write_table(const char* path, const float* table) {
  FILE* f = std::fopen(path, "wb");
  if (f == nullptr || std::fwrite(table, sizeof(float), kN, f) != static_cast<size_t>(kN)) {
    std::fprintf(stderr, "silu_tables: cannot write %s\n", path);
    std::exit(1);
  }
  std::fclose(f);
}

int main(int argc, char** argv) {
  if (argc != 6) {
    std::fprintf(stderr, "usage: %s <silu_fast.bin> <silu_precise.bin> <alpha bits> <glu_fast.bin> <glu_precise.bin>\n",
                 argv[0]);
    return 2;
  }
  char* end = nullptr;
  const uint32_t bits = static_cast<uint32_t>(std::strtoul(argv[3], &end, 16));
  if (end == argv[3] || *end != '\0') {
    std::fprintf(stderr, "silu_tables: alpha must be fp32 bits in hex, got %s\n", argv[3]);
    return 2;
  }
  float alpha;
  std::memcpy(&alpha, &bits, sizeof alpha);
  float* d_out = nullptr;
  check(cudaMalloc(&d_out, 4 * kN * sizeof(float)), "cudaMalloc");
  tables_kernel<<<kN / 256, 256>>>(d_out, alpha);
  check(cudaGetLastError(), "launch");
  check(cudaDeviceSynchronize(), "kernel");
  std::vector<float> out(4 * kN);
  check(cudaMemcpy(out.data(), d_out, out.size() * sizeof(float), cudaMemcpyDeviceToHost), "copy");
  const char* paths[4] = {argv[1], argv[2], argv[4], argv[5]};
  for (int t = 0; t < 4; ++t) write_table(paths[t], out.data() + t * kN);
  std::printf("silu_tables: wrote %s, %s, %s and %s\n", paths[0], paths[1], paths[2], paths[3]);
  return 0;
}
