// Kernel parameters of the SM90 grouped GEMM, passed by value as one __grid_constant__ struct.
// megamoe/gemm.py (_pack_params) packs the same layout; keep the two in step: the static_asserts
// below pin every offset.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cuda.h>

namespace megamoe {

struct GemmParams {  // 128-byte aligned (CUtensorMap is)
  CUtensorMap tmap_x;         // activations [P, K] e4m3, box {128 B, BN rows}, 128-byte swizzle
  const uint8_t* w;           // weights, kernel layout (megamoe/jit/layout.py)
  const uint8_t* w_sf;        // weight scale bytes, kernel layout
  const uint8_t* x_sf;        // activation scale bytes [P, K/32] (UE8M0)
  const int* expert_offsets;  // [E+1] first pool row of each expert (BLOCK_M aligned)
  const int* num_tokens;      // [E] valid rows of each expert
  const float* w_route;       // L1: [P] routing weight of each pool row
  void* out;                  // L1: l2_acts e4m3 [P, I]; L2: combine rows bf16 [*, H]
  uint8_t* out_sf;            // L1: l2_sf [P, I/32]
  const int* dst_rows;        // L2: [P] combine row (k*T + t) of each pool row, < 0 = none
  float* dump;                // debug build: fp32 accumulators, canonical channel order
  const int* arrival;         // per pool block arrival counters, nullptr = all arrived
  int64_t num_experts;
  int64_t num_pool_rows;      // P
  int64_t k;                  // reduction length: H (L1) or I (L2)
  int64_t n_rows;             // weight rows: 2I (L1) or H (L2)
  int64_t arrival_block;      // pool rows per arrival counter
  float clamp_value;          // bf16-representable clamp c (L1), used when has_clamp
  int32_t has_clamp;
  int* err;                   // timeout record (host-mapped), nullptr = trap without a record
};

static_assert(offsetof(GemmParams, w) == 128, "param layout");
static_assert(offsetof(GemmParams, arrival) == 208, "param layout");
static_assert(offsetof(GemmParams, num_experts) == 216, "param layout");
static_assert(offsetof(GemmParams, arrival_block) == 248, "param layout");
static_assert(offsetof(GemmParams, clamp_value) == 256, "param layout");
static_assert(offsetof(GemmParams, err) == 264, "param layout");
static_assert(sizeof(GemmParams) == 384, "param layout");

}  // namespace megamoe
