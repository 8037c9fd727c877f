// The activations of the L1 epilogue: SiLU (SPEC §3, D6 step 3) and gpt-oss's glu factor (§8,
// D6 step 3).
//
// This is the single definition of each function the kernel computes. The CPU reference cannot
// reproduce ex2.approx / rcp.approx / expf bit for bit, so kernel/probes/silu_tables.cu runs
// *these* functions over all 65 536 bf16 inputs and the resulting tables ship with the reference
// (reference/tables/). Any change here must regenerate the tables (`python -m megamoe.silu_probe`;
// test_the_activation_tables_regenerate_bit_for_bit in tests/gpu/test_reference_gpu.py fails until it does).
//
// Every operation is written with an explicit rounding intrinsic so that no compiler flag
// (-fmad, --use_fast_math) can contract or approximate it differently from the probe.
#pragma once

namespace megamoe {

__device__ __forceinline__ float ex2_approx_ftz(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

__device__ __forceinline__ float rcp_approx_ftz(float x) {
  float y;
  asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// log2(e) rounded to fp32 (0x3FB8AA3B).
constexpr float kLog2e = 1.4426950408889634f;

// silu(g) = g * sigmoid(g).
//   fast:    g * rcp.approx.ftz(1 + ex2.approx.ftz(-g * log2 e))
//   precise: g / (1 + expf(-g))          (IEEE division, CUDA's accurate expf)
template <bool kFastMath>
__device__ __forceinline__ float silu(float g) {
  if constexpr (kFastMath) {
    const float e = ex2_approx_ftz(__fmul_rn(-g, kLog2e));
    return __fmul_rn(g, rcp_approx_ftz(__fadd_rn(1.0f, e)));
  } else {
    return __fdiv_rn(g, __fadd_rn(1.0f, expf(-g)));
  }
}

// gpt-oss's glu factor g * sigmoid(alpha g), with z = alpha * g one RN multiply (alpha: fp32).
//   fast:    g * rcp.approx.ftz(1 + ex2.approx.ftz(-z * log2 e))
//   precise: g / (1 + expf(-z))          (IEEE division, CUDA's accurate expf)
// At alpha = 1, z = g exactly and this is silu<kFastMath>(g) bit for bit.
template <bool kFastMath>
__device__ __forceinline__ float glu_oai(float g, float alpha) {
  const float z = __fmul_rn(alpha, g);
  if constexpr (kFastMath) {
    const float e = ex2_approx_ftz(__fmul_rn(-z, kLog2e));
    return __fmul_rn(g, rcp_approx_ftz(__fadd_rn(1.0f, e)));
  } else {
    return __fdiv_rn(g, __fadd_rn(1.0f, expf(-z)));
  }
}

}  // namespace megamoe
