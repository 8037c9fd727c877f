// The layer's activation as a policy the kernels take (`typename Act`): SPEC §3's SwiGLU
// (`Swiglu<kFast>`) or §8's gpt-oss variant (`SwigluOai<kFast>`: its clamped glu, `(up + 1)`, the
// bias b1 added before D6's bf16 rounding and the routing-weighted b2 at D8). The instantiation
// units name one (megamoe/jit/build.py activation_policy); the epilogues ask it what to compute,
// and the plain SwiGLU's code is what it was (`if constexpr (Act::kOai)` around every addition).
//
// Each policy: kFastMath (which table's device function, silu.cuh), kOai, and
//   routed(gf, uf, wr, bound, p): D6 steps 2-4 from the bf16-rounded gate and up of a valid token.
// The bias adds are the epilogues' (they know the row's channel and the token's weight):
//   D6 step 1 (§8): g = bf16(acc_gate + b1_gate), u = bf16(acc_up + b1_up) (bias_or_neg_zero);
//   D8 (§8):        o = acc2 + fp32(w_route · b2[h]) (routed_bias), then bf16.
// Both engines run both policies (the prefill engine adds the biases in prefill_rows.cuh).
#pragma once

#include <cstdint>

#include "../gemm/contract.cuh"
#include "silu.cuh"

namespace megamoe {

// D6's clamp as one bound: c where the layer clamps, else +inf, under which the clamp's selects
// leave every value (NaN and the infinities included) as it is. So the policies' routed has no
// branch and the epilogues' SwiGLUs interleave (with the branch, each SiLU's chain ran alone: ncu
// put 12 % of the prefill kernel's consumer samples in its epilogue). The gpt-oss variant clamps
// always, at bf16(limit) (the host sets has_clamp and clamp_value).
__device__ __forceinline__ float clamp_bound(const GemmParams& p) {
  return p.has_clamp != 0 ? p.clamp_value : __int_as_float(0x7F800000);
}

// SPEC §3 D6 steps 2-4: the optional clamp (NaN-propagating min / clamp in bf16: values and c are
// bf16-representable), SiLU of the gate, times up, times the token's routing weight wr.
template <bool kFast>
struct Swiglu {
  static constexpr bool kFastMath = kFast;
  static constexpr bool kOai = false;
  __device__ static __forceinline__ float routed(float gf, float uf, float wr, float bound, const GemmParams&) {
    gf = gf > bound ? bound : gf;
    uf = uf > bound ? bound : uf;
    uf = uf < -bound ? -bound : uf;
    return __fmul_rn(__fmul_rn(silu<kFast>(gf), uf), wr);
  }
};

// SPEC §8 D6 steps 2-4: the same clamp at bf16(limit), the glu factor of the gate (alpha =
// p.alpha, fp32), then ((up + 1) · glu) · wr: one add and two multiplies, each RN, no FMA.
template <bool kFast>
struct SwigluOai {
  static constexpr bool kFastMath = kFast;
  static constexpr bool kOai = true;
  __device__ static __forceinline__ float routed(float gf, float uf, float wr, float bound, const GemmParams& p) {
    gf = gf > bound ? bound : gf;
    uf = uf > bound ? bound : uf;
    uf = uf < -bound ? -bound : uf;
    return __fmul_rn(__fmul_rn(__fadd_rn(uf, 1.0f), glu_oai<kFast>(gf, p.alpha)), wr);
  }
};

// The bias (§8) of weight row `row` of expert e as its bf16 bits, or 0x8000 (-0.0) without one: x +
// (-0.0) is x for every x (-0.0 and NaN included), so "no bias" is the same add with no branch
// around it. A caller that loads the bits before a loop widens them after it (<< 16): widened where
// they are loaded, their first use waits for the load there (ncu, bench/NOTES.md v47).
__device__ __forceinline__ uint32_t bias_bits(const GemmParams& p, int expert, int64_t row) {
  return p.bias != nullptr ? p.bias[static_cast<int64_t>(expert) * p.n_out + row] : 0x8000u;
}

// bias_bits as fp32 (b1: D6 step 1; b2: D8). The -0.0 written out, not widened from 0x8000: the
// form the epilogues' machine code was measured with (bench.sass_identity).
__device__ __forceinline__ float bias_or_neg_zero(const GemmParams& p, int expert, int64_t row) {
  return p.bias != nullptr ? __uint_as_float(bias_bits(p, expert, row) << 16) : -0.0f;
}

// D8's term (§8): fp32(w_route · b2[h]) for b = bias_or_neg_zero's b2[h], one RN multiply; -0.0
// without b2 (the product of a negative weight and -0.0 would be +0.0, which the add does not keep
// as the identity).
__device__ __forceinline__ float routed_bias(const GemmParams& p, float wr, float b) {
  return p.bias != nullptr ? __fmul_rn(wr, b) : -0.0f;
}

}  // namespace megamoe
