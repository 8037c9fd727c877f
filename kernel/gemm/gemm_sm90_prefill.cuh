// SM90 grouped GEMM for prefill sizes (both promotions): tokens as the wgmma M dimension, weights
// as N, both operands in shared memory, the weights already E4M3. This file is the kernel layer:
// shared-memory layout, roles, the item loop, and the two mainloops; the pieces are
//   predecode.cuh         the pass that decodes every weight once per call (w_e4m3),
//   scheduler.cuh         the work items (the same as gemm_sm90.cuh's at kMaxN 128, 256 rows),
//   producer.cuh          stage_token_scales (the scale warps, a linear scale layout here),
//   ../epilogue/prefill_rows.cuh  the layers' epilogues in this orientation (staged, then written
//                                 by the epilogue warps).
//
// Why a second orientation: in gemm_sm90.cuh (swap-AB) a token's fp32 scale varies along the
// accumulator's columns, so each consumer thread promotes with 32 scales per 128 tokens and K
// block, and the decode into registers sits in the same warps' chain (bench/NOTES.md v13). Here a
// token's scale lies on the accumulator rows: two per thread (and K block, or k32 step in the
// exact mode).
// Decoding FP4 into shared memory inside this loop costs more than half the tensor rate
// (bench/NOTES.md v14), so the weights are decoded once per call by the predecode pass and arrive
// here by bulk copy.
//
// CTA tile (PrefillShape, contract.py): tokens in consumer warpgroups of 64 (wgmma M) x weight rows
// in halves of 128 (one SS m64n128k32 wgmma each per k32 step; a 256-wide one would need a
// 128-register temporary beside the 128 accumulators; the exact mode's two-scale items: m64n64k32
// steps, below). Fast mode: 128 tokens (two warpgroups) x 256 rows. Exact mode: 192 tokens (three
// warpgroups) x 128 rows, so that three wgmma -> wait -> promote chains share the tensor core
// (bench/NOTES.md v39's probe: 47.1 % of the peak against 40.3 % for two chains of 128 x 256; the
// layer 4-6 % faster at gpt-oss T = 256-4096, v46). A warpgroup whose 64 tokens are all past the
// item's valid rows computes nothing in the fused kernel (prefill_pass_stages).
// Producer warpgroup: warp 0 lane 0 TMAs the activation tile (64-row boxes) and bulk-copies the
// weight tile (32 KB; exact 16 KB, 18 KB with its fp32 scales for the two-scale items); warp 1
// stages the token scales (producer.cuh: the fast mode's fp32 K128 scales and the exact mode's
// folded items' fp32 k32 scales, each with the expert base folded in, or the two-scale items' raw
// bytes); warps 2-3 are the epilogue warps: the consumers leave each item's tile in bf16 in a
// staging buffer and go on to the next item's mainloop while these two warps write the layer's
// output from it (prefill_rows.cuh). Registers 56 / 224 with two consumer warpgroups, 56 / 152
// with three (at 40 the scale and epilogue warps spilled). The staging buffer (64 KB; exact 48 KB)
// leaves room for 3 stages (exact: 4).
//
// Numerics are those of the swap-AB kernels (gemm_sm90.cuh). Fast mode (k128): the E4M3 weights are
// the bytes the scaled tables give, the four k32 products of a K block accumulate in the tensor
// core and are promoted with one FMA by the token's fp32 scale, and after the mainloop each row
// (here: column) is multiplied by 2^(B_r - B_e) <= 1. Exact mode (k32), every k32 product promoted
// with both of its per-32 scales, in one of two forms per item (its 256-row block's fold flag,
// megamoe/jit/layout.py fold_blocks):
//   folded (rows within 11 binades of their base): the fast mode's E4M3 bytes, whose table already
//     holds the weight's scale relative to its row, each k32 product promoted with one FMA by the
//     token's k32 scale times 2^(B_e - 133), then the row factors as in the fast mode: the same
//     bits as the two-scale form (prefill_mainloop_scaled says why; tested);
//   two-scale: the plain E2M1 values, each k32 product promoted with both scales
//     (promote_k32_one); the tile's fp32 weight scales come with its E4M3 bytes in the one bulk
//     copy, the tokens' scale bytes are staged raw (one 32-bit word of four k32 steps a token) and
//     converted by the consumers. Two FP32 instructions per accumulator and k32 step: 1.8x the
//     folded form's time (bench/NOTES.md v18).
#pragma once

#include <cstdint>
#include <type_traits>

#include "../common/ptx.cuh"
#include "../common/timeline.cuh"
#include "../common/ue8m0.cuh"
#include "../epilogue/prefill_rows.cuh"
#include "contract.cuh"
#include "predecode.cuh"
#include "producer.cuh"
#include "promotion.cuh"
#include "scheduler.cuh"
#include "wgmma_fp8_ss.cuh"

namespace megamoe {

// PrefillShape (tokens, rows, warpgroups) is in contract.cuh.
constexpr int kPrefillHalf = 128;

// The stage ring: activations | the predecoded weight tile (E4M3, 128-byte swizzle; the exact
// mode's slot holds its two-scale items' fp32 weight scales, or its folded items' token scales,
// fold_scales, after the bytes) | token scales, one word a token (linear: token tok at tok; the
// scale warp writes them through scale_index): fast mode the fp32 K128 scale, the exact mode's
// two-scale items the four k32 scale bytes as they are. The scale warp writes the item's tile
// (pick_tile: its valid rows rounded up to a power of two, or to 64 at 192 tokens; 0 past the valid
// ones: fp32 0, or bytes that the exact mode's consumers read as 2^-127); the consumers promote all
// the tile's tokens, so tokens past that tile take
// whatever an earlier stage left there: their accumulators are never written out (the epilogues
// store valid rows only).
template <bool kPerK32>
struct PrefillRing {
  using Shape = PrefillShape<kPerK32>;
  static constexpr int kX = Shape::kTokens * kBlockK;
  static constexpr int kBytes = Shape::kRows * kBlockK;             // the E4M3 bytes of a tile
  static constexpr int kFoldScales = 4 * Shape::kTokens * 4;        // fold_scales
  static constexpr int kSlot = Shape::kTile > kBytes + kFoldScales ? Shape::kTile : kBytes + kFoldScales;
  static constexpr int kW = kPerK32 ? (kSlot + 1023) / 1024 * 1024 : Shape::kTile;
  static constexpr int kSxWords = Shape::kTokens;
  static constexpr int kStage = kX + kW + kSxWords * 4;
  static constexpr int kScaleWarps = 1;   // warps 2-3 are the epilogue warps
  static constexpr int kFullArrivals = 1 + 32 * kScaleWarps;   // expect_tx + the scale warp's lanes
  static constexpr bool kRawScaleWords = kPerK32;   // stage_token_scales: the k32 bytes unconverted
  static constexpr bool kSteps = false;              // stage_token_scales: no step-major columns (StageRing)
  __device__ __forceinline__ static int scale_index(int tok, int, int) {
    return tok;
  }
  // Exact mode: an item whose block folds its weight scales (folded; layout.py fold_blocks) has the
  // E4M3 bytes only, so the weight slot is free after them; the scale warp writes the tokens' fp32
  // k32 scales (with the expert base) there, [tokens][4 k32 steps], and the consumers read them as
  // the fast mode reads its sx.
  __device__ __forceinline__ static bool folded(const GemmParams& p, const WorkItem& wi) {
    return __ldg(p.w_fold + wi.expert * prefill_blocks<kPerK32>(p) + wi.n_block) != 0;
  }
  __device__ __forceinline__ float* fold_scales(int stage) const {
    return reinterpret_cast<float*>(w + stage * kW + kBytes);
  }
  static_assert(!kPerK32 || kW - kBytes >= kFoldScales, "the folded scales fit the slot");

  uint8_t* x;
  uint8_t* w;
  float* sx;
  uint64_t* full;
  uint64_t* empty;
};

constexpr int kPrefillEpilogueWarps = 2;   // warps 2-3 of the producer warpgroup
constexpr int kPrefillEpilogueBarrier = 6;  // theirs (kPrefillItemBarrier is the consumers')

template <int kLayer, bool kPerK32>
struct PrefillConfig {
  using Ring = PrefillRing<kPerK32>;
  using Shape = PrefillShape<kPerK32>;
  static constexpr bool kExact = kPerK32;
  static constexpr int kThreads = 128 + Shape::kConsumers;
  static constexpr int kScheduleBytes = (static_cast<int>(sizeof(Schedule)) + 15) / 16 * 16;
  // The staging buffer, the item's data (prefill_item_fetch) and the staging's two barriers
  // (epi_full, epi_empty) beside the ring.
  static constexpr int kEpilogueBytes = kPrefillStagingBytes<kPerK32> + kPrefillItemBytes + 16;
  static constexpr int kStagesFit =
      (kSmemLimit - kScheduleBytes - kItemQueueBytes - kEpilogueBytes) / (Ring::kStage + 16);
  static constexpr int kStages = kStagesFit < kMaxStages ? kStagesFit : kMaxStages;
  static constexpr int kSmemBytes = kStages * (Ring::kStage + 16) + kEpilogueBytes + kScheduleBytes + kItemQueueBytes;
  static_assert(kStages >= 3, "the stage ring");
  static_assert(Ring::kX % 1024 == 0 && Ring::kW % 1024 == 0, "swizzle atoms stay aligned");
  static constexpr int kProducerRegs = 56;
  static constexpr int kConsumerRegs = Shape::kWgs == 2 ? 224 : 152;
  static_assert(128 * kProducerRegs + Shape::kConsumers * kConsumerRegs <= kThreads * ((65536 / kThreads) / 8 * 8),
                "setmaxnreg budget exceeds the launch allocation");
};

// Shared memory at compile-time offsets from dyn_smem (1024-byte aligned: no static shared memory).
extern __shared__ __align__(1024) uint8_t dyn_smem[];

template <typename Cfg>
struct PrefillSmem {
  using Ring = typename Cfg::Ring;
  Ring ring;
  uint8_t* staging;
  uint8_t* item;         // the item's data beside its tile (prefill_item_fetch)
  uint64_t* epi_full;    // every consumer thread's arrival: an item's tile is staged
  uint64_t* epi_empty;   // the epilogue warps' 64 arrivals: the staging buffer is free
  Schedule* sched;
  ItemQueue* queue;      // the dynamic order's (scheduler.cuh)

  __device__ __forceinline__ PrefillSmem() {
    constexpr int S = Cfg::kStages;
    ring.x = dyn_smem;                                                        // [S][tokens x 128]
    ring.w = ring.x + S * Ring::kX;                                           // [S][tile]
    staging = ring.w + S * Ring::kW;                                          // [tokens][rows] bf16
    item = staging + kPrefillStagingBytes<Cfg::kExact>;                      // kPrefillItemBytes
    ring.sx = reinterpret_cast<float*>(item + kPrefillItemBytes);             // [S][tokens]
    ring.full = reinterpret_cast<uint64_t*>(ring.sx + S * Ring::kSxWords);
    ring.empty = ring.full + S;
    epi_full = ring.empty + S;
    epi_empty = epi_full + 1;
    sched = reinterpret_cast<Schedule*>(epi_empty + 1);
    queue = reinterpret_cast<ItemQueue*>(reinterpret_cast<uint8_t*>(sched) + Cfg::kScheduleBytes);
  }
};

// The predecoded tile of (expert, K block, block of rows).
template <bool kPerK32>
__device__ __forceinline__ const uint8_t* prefill_weight_tile(const GemmParams& p, int expert, int kb, int n_block) {
  const int64_t tiles = (static_cast<int64_t>(expert) * (p.k / kBlockK) + kb) * prefill_blocks<kPerK32>(p) + n_block;
  return p.w_e4m3 + tiles * PrefillShape<kPerK32>::kTile;
}

// One item of one consumer warpgroup (tokens 64 wg .. 64 wg + 63 of the tile, all its rows):
// acc[h][4j + 2r + c] is token 16 wq + g + 8r of the warpgroup, weight row 128 h + 8j + 2t + c.
// The scaled tables' weights (the fast mode's E4M3 bytes, m x 2^(6 - d) for row base B_r and group
// byte B_r - d), per K block and half of 128 rows:
//   fast mode (kEachK32 false): four k32 wgmmas into one temporary, promoted once with the token's
//     staged fp32 K128 scale (the expert base folded in by the scale warp);
//   the exact mode's folded items (kEachK32): each k32 wgmma promoted on its own with the token's
//     per-32 scale times 2^(B_e - 127 - kLutHeadroom) (staged by the scale warp: fold_scales), one
//     FMA per accumulator. The rows' factors 2^(B_r - B_e) follow after the mainloop in both modes
//     (prefill_stage_tile). A folded k32 product is the two-scale promotion's times 2^(B_e - B_r)
//     (its 32 weights share one d, so the tensor core's sum scales by a power of two: measured so
//     for d <= 12, and the fold takes d <= 11, megamoe/jit/layout.py FOLD_BINADES), hence the same
//     bits wherever the folded scale 2^(s_x + B_e - 260), 2^(B_e - s_w - 6) times the two-scale
//     one, is at least 2^-149 and the folded accumulator stays finite.
// The promotion's register banks: an FFMA whose product (the wgmma's temporary, an aligned range)
// and accumulator registers have the same parity reads them from one of the register file's two
// banks. Where ptxas gives acc[i] the parity of tmp[i] (which build does is its allocator's choice:
// megamoe/jit/build.py SWAP_ACC_PAIRS names them, tests/test_compile_gate.py checks every build),
// MEGAMOE_SWAP_ACC_PAIRS keeps element i in acc[i ^ 1] during the loop, which flips it, and puts the
// pairs back at the end (renamed registers: no instruction).
#ifndef MEGAMOE_SWAP_ACC_PAIRS
#define MEGAMOE_SWAP_ACC_PAIRS 0
#endif
constexpr bool kSwapAccPairs = MEGAMOE_SWAP_ACC_PAIRS;

// k32: the layer's k32 steps that hold channels (GemmParams.k32_steps). Past them, in the last K block
// of a size that is not a multiple of 128, the layout's zero padding: the exact mode skips those
// steps (their products are +0, and acc + 0 is acc: acc is never -0), the fast mode's K is whole
// blocks.
template <typename Cfg, bool kEachK32>
__device__ __forceinline__ void prefill_mainloop_scaled(const GemmParams& p, int num_kb, int k32,
                                                        const typename Cfg::Ring& ring, RingCursor& cur, int wg,
                                                        int sx0, float (&acc)[Cfg::Shape::kHalves][kPrefillHalf / 2]) {
  using Ring = typename Cfg::Ring;
  constexpr int S = Cfg::kStages;
  float tmp[kPrefillHalf / 2];
  const bool k_nonzero = p.k != 0;   // always: a scheduling barrier (below)
  for (int kb = 0; kb < num_kb; ++kb) {
    const int s = cur.stage;
    // The same for the whole warpgroup: broadcast, so ptxas keeps the descriptors in uniform
    // registers beside the wgmma (from threadIdx they cost R2URs).
    const uint32_t a_lo =
        __shfl_sync(0xFFFFFFFFu, ptx::smem_desc_sw128_lo(ring.x + s * Ring::kX + wg * 64 * kBlockK), 0);
    const uint32_t b_lo = __shfl_sync(0xFFFFFFFFu, ptx::smem_desc_sw128_lo(ring.w + s * Ring::kW), 0);
    // The tokens' fp32 scales: fast mode one a token (K128), folded items four ([token][k32 step]).
    const float* sx = kEachK32 ? ring.fold_scales(s) + 4 * sx0 : ring.sx + s * Ring::kSxWords + sx0;
    const int steps = k32 - 4 * kb;   // this K block's steps that hold channels (above), 4 but in the last
#pragma unroll
    for (int h = 0; h < Cfg::Shape::kHalves; ++h) {
#pragma unroll
      for (int ks = 0; ks < 4; ++ks) {
        if (kEachK32 && ks > 0 && ks >= steps) continue;
        const bool first = kEachK32 || ks == 0;
        const bool last = kEachK32 || ks == 3;
        if (first) {
          // Before each group: the wait's branch ends the block, so ptxas cannot hoist this group's
          // wgmmas above the last one's promotion, which would need a second temporary (measured in
          // the prefill probe: 256 bytes of spills). The folded items' eight groups a K block take
          // that barrier from the promotion's branch instead (below): a wait on the phase the K
          // block's first group passed costs each group a SYNCS round trip before its issue.
          if (!kEachK32 || (h == 0 && ks == 0)) ptx::mbar_wait(&ring.full[s], cur.phase, kWaitFull, s, p.err);
          ptx::wgmma_fence();
        }
        const uint64_t da = ptx::smem_desc_sw128_from_lo(a_lo + 2 * ks);
        const uint64_t db = ptx::smem_desc_sw128_from_lo(b_lo + h * (kPrefillHalf * kBlockK >> 4) + 2 * ks);
        if (first)
          WgmmaSS<kPrefillHalf>::mma_overwrite(tmp, da, db);
        else
          WgmmaSS<kPrefillHalf>::mma(tmp, da, db, 1);
        if (!last) continue;
        ptx::wgmma_commit();
        const float a0 = sx[kEachK32 ? ks : 0];
        const float a1 = sx[kEachK32 ? 32 + ks : 8];   // token sx0 + 8
        ptx::wgmma_wait<0>();
#pragma unroll
        for (int i = 0; i < kPrefillHalf / 2; ++i) ptx::fence_operand(tmp[i]);
        // The folded items: in a branch that always runs (K > 0) but that ptxas cannot remove, which
        // ends the block as the fast mode's wait does.
        if (!kEachK32 || k_nonzero) {
#pragma unroll
          for (int i = 0; i < kPrefillHalf / 2; ++i) {
            const int a = kSwapAccPairs ? i ^ 1 : i;   // element i's register (above)
            acc[h][a] = __fmaf_rn(tmp[i], (i & 2) ? a1 : a0, acc[h][a]);
          }
        }
#pragma unroll
        for (int i = 0; i < kPrefillHalf / 2; ++i) ptx::fence_operand(acc[h][i]);
      }
    }
    // Release the stage: every thread arrives after its own reads of the scales (producer.cuh).
    ptx::mbar_arrive(&ring.empty[s]);
    cur.advance<S>();
  }
  if constexpr (kSwapAccPairs) {
#pragma unroll
    for (int h = 0; h < Cfg::Shape::kHalves; ++h)
#pragma unroll
      for (int i = 0; i < kPrefillHalf / 2; i += 2) {
        const float e = acc[h][i];
        acc[h][i] = acc[h][i + 1];
        acc[h][i + 1] = e;
      }
  }
}

// Exact mode: per K block and k32 step a wgmma of 64 rows for each 64 rows of the tile (rows 64 q ..
// 64 q + 63), each waited for and promoted with both per-32 scales (promote_k32_one: the scales'
// product, then one FMA): two FP32 instructions per accumulator and k32 step. One 32-register
// temporary; the other warpgroups' steps fill the tensor core meanwhile. Measured against it at
// 256-row tiles (bench/NOTES.md v17, DSV3 L1 2048, same call): the next step's wgmma in flight
// during this one's promotion (two temporaries: 236 bytes of spills) 12.1 ms against
// 11.0; steps of 32 rows with two temporaries (spill-free) 13.6 ms; 128-row steps spilled 850 bytes.
// The thread's two tokens' scale bytes are one word each per stage; its 16 rows' weight scales of a
// step are four 16-byte loads (predecode.cuh prefill_wsf_index), issued behind the step's wgmma.
struct PrefillK32Step {
  using Shape = PrefillShape<true>;
  static constexpr int kCols = 64;                      // weight rows per wgmma
  static constexpr int kParts = Shape::kRows / kCols;   // wgmmas per k32 step
  static constexpr int kSteps = 4 * kParts;             // per K block
  uint32_t a_lo, b_lo, wsf, word0, word1;
  float s0, s1;   // the thread's two tokens' scales of the current k32 step (token_scales)
  uint64_t* full;
  uint32_t phase;
  int stage;
  int* err;

  // Step i (k32 step i / kParts, rows kCols (i % kParts) ..) into d. Each after a wait on the stage's
  // full barrier (the first waits, the others pass at once): its branch ends the block, so ptxas
  // cannot hoist a step's wgmma above the last step's promotion (it did: 600 bytes of spills).
  __device__ __forceinline__ void issue(int i, float (&d)[kCols / 2]) const {
    ptx::mbar_wait(full, phase, kWaitFull, stage, err);
    ptx::wgmma_fence();
    WgmmaSS<kCols>::mma_overwrite(
        d, ptx::smem_desc_sw128_from_lo(a_lo + 2 * (i / kParts)),
        ptx::smem_desc_sw128_from_lo(b_lo + (i % kParts) * (kCols * kBlockK >> 4) + 2 * (i / kParts)));
    ptx::wgmma_commit();
  }

  // At the first step of k32 step ks: its token scales.
  __device__ __forceinline__ void token_scales(int ks) {
    s0 = ue8m0_byte_to_float(word0, ks);
    s1 = ue8m0_byte_to_float(word1, ks);
  }

  // Step i's weight scales of the thread's 16 rows: four vectors, loaded while its wgmma runs (after
  // the wait, their latency stalled the promotion: 16 % of the mainloop's samples, ncu).
  __device__ __forceinline__ void weight_scales(int i, uint4 (&w)[kCols / 16]) const {
    const int ks = i / kParts;
    const int row0 = kCols * (i % kParts);
#pragma unroll
    for (int v = 0; v < kCols / 16; ++v)
      w[v] = ptx::ld_shared_v4(wsf +
                               ((ks * Shape::kHalves + row0 / kPrefillHalf) * 8 + (row0 % kPrefillHalf) / 16 + v) * 64);
  }

  // Waits for step i (in d) and promotes it into acc with its weight scales w.
  __device__ __forceinline__ void promote(int i, float (&d)[kCols / 2], const uint4 (&w)[kCols / 16],
                                          float (&acc)[Shape::kHalves][kPrefillHalf / 2]) const {
    ptx::wgmma_wait<0>();
#pragma unroll
    for (int e = 0; e < kCols / 2; ++e) ptx::fence_operand(d[e]);
    const int row0 = kCols * (i % kParts);   // the step's first row of the tile
    const int h = row0 / kPrefillHalf, base = (row0 % kPrefillHalf) / 2;
#pragma unroll
    for (int v = 0; v < kCols / 16; ++v) {
      // Rows 8 j + 2 t + c of the half for j = row0 % 128 / 8 + 2 v + qq.
      const float sw[4] = {__uint_as_float(w[v].x), __uint_as_float(w[v].y), __uint_as_float(w[v].z),
                           __uint_as_float(w[v].w)};
#pragma unroll
      for (int qq = 0; qq < 2; ++qq)
#pragma unroll
        for (int r = 0; r < 2; ++r)
#pragma unroll
          for (int c = 0; c < 2; ++c) {
            const int e = 4 * (2 * v + qq) + 2 * r + c;
            acc[h][base + e] = promote_k32_one(acc[h][base + e], d[e], sw[2 * qq + c], r ? s1 : s0);
          }
    }
  }
};

// k32: as prefill_mainloop_scaled's.
template <typename Cfg>
__device__ __forceinline__ void prefill_mainloop_k32(const GemmParams& p, int num_kb, int k32,
                                                     const typename Cfg::Ring& ring, RingCursor& cur, int wg, int sx0,
                                                     float (&acc)[Cfg::Shape::kHalves][kPrefillHalf / 2]) {
  using Ring = typename Cfg::Ring;
  using Step = PrefillK32Step;
  constexpr int S = Cfg::kStages;
  const int t = ptx::thread_idx() % 4;
  float tmp[Step::kCols / 2];
  for (int kb = 0; kb < num_kb; ++kb) {
    const int s = cur.stage;
    Step st;
    st.a_lo = __shfl_sync(0xFFFFFFFFu, ptx::smem_desc_sw128_lo(ring.x + s * Ring::kX + wg * 64 * kBlockK), 0);
    st.b_lo = __shfl_sync(0xFFFFFFFFu, ptx::smem_desc_sw128_lo(ring.w + s * Ring::kW), 0);
    st.wsf = ptx::smem_addr(ring.w + s * Ring::kW + Ring::kBytes) + 16 * t;
    st.full = &ring.full[s];
    st.phase = cur.phase;
    st.stage = s;
    st.err = p.err;
    const uint32_t* words = reinterpret_cast<const uint32_t*>(ring.sx + s * Ring::kSxWords + sx0);
    ptx::mbar_wait(&ring.full[s], cur.phase, kWaitFull, s, p.err);
    st.word0 = words[0];
    st.word1 = words[8];
    const int steps = k32 - 4 * kb;   // (prefill_mainloop_scaled)
#pragma unroll
    for (int i = 0; i < Step::kSteps; ++i) {
      if (i >= Step::kParts && i / Step::kParts >= steps) break;
      if (i % Step::kParts == 0) st.token_scales(i / Step::kParts);
      uint4 w[Step::kCols / 16];
      st.issue(i, tmp);
      st.weight_scales(i, w);
      st.promote(i, tmp, w, acc);
    }
#pragma unroll
    for (int h = 0; h < Cfg::Shape::kHalves; ++h)
#pragma unroll
      for (int e = 0; e < kPrefillHalf / 2; ++e) ptx::fence_operand(acc[h][e]);
    // Release the stage: every thread arrives after its own reads of the scales (producer.cuh).
    ptx::mbar_arrive(&ring.empty[s]);
    cur.advance<S>();
  }
}

// A consumer warpgroup with no valid token in the item (64 wg >= wi.valid: an expert's last block)
// computes nothing (prefill_item's kIdle): it passes each stage once it has landed (its arrival on
// the empty barrier keeps the ring's count; waiting for the fill keeps it from arriving for a
// stage's next use early), and the TMA thread loads no rows for it. Its accumulators stay zero and
// are never stored.
template <typename Cfg>
__device__ __forceinline__ void prefill_pass_stages(const GemmParams& p, int num_kb, const typename Cfg::Ring& ring,
                                                    RingCursor& cur) {
  for (int kb = 0; kb < num_kb; ++kb) {
    ptx::mbar_wait(&ring.full[cur.stage], cur.phase, kWaitFull, cur.stage, p.err);
    ptx::mbar_arrive(&ring.empty[cur.stage]);
    cur.advance<Cfg::kStages>();
  }
}

// One item of the consumers: its mainloop, then its tile staged (with the rows' factors where the
// weights came through the scaled tables: kScaled, the fast mode and the exact mode's folded items).
// Each path holds its own accumulators: with one array across both of the exact mode's mainloops,
// ptxas spilled 2.4 KB. Item `item` of the launch is layer kLayerA's (pa), or with kLayerB (the
// fused kernel) kLayerB's (pb) past the first layer's items; the mainloop takes its K blocks and the
// trap record (pa's, the same in both: a constant) and nothing else of the layer, which is found
// again after it from the schedule: the layer's parameters, or its number, held across the exact
// mode's two-scale mainloop made ptxas spill there (664, then 336 bytes).
template <typename Cfg, typename Act, bool kDebug, bool kPerK32, bool kScaled, int kLayerA, int kLayerB,
          bool kIdle = false>
__device__ __forceinline__ void prefill_item(const GemmParams& pa, const GemmParams& pb, int item,
                                             const PrefillSmem<Cfg>& sm, RingCursor& cur, const WorkItem& wi, int wg,
                                             int sx0, uint32_t phase, int n) {
  constexpr bool kTwo = kLayerB != 0;
  using Shape = typename Cfg::Shape;
  float acc[Shape::kHalves][kPrefillHalf / 2];
#pragma unroll
  for (int h = 0; h < Shape::kHalves; ++h)
#pragma unroll
    for (int i = 0; i < kPrefillHalf / 2; ++i) acc[h][i] = 0.0f;
  {
    const bool second = kTwo && item >= layer_items<Shape::kRows>(*sm.sched, pa);
    const int num_kb = (second ? pb.k : pa.k) / kBlockK;
    const int k32 = second ? pb.k32_steps : pa.k32_steps;
    // Every consumer thread has read the previous item's data (its stage tile): then this one's.
    ptx::named_barrier(kPrefillItemBarrier, Shape::kConsumers);
    prefill_item_fetch<Act, kScaled, kPerK32>(second ? pb : pa, wi, second ? kLayerB : kLayerA,
                                              ptx::smem_addr(sm.item));
    timeline::item_stamp_ready(n, &sm.ring.full[cur.stage], cur.phase, pa.err);
    if constexpr (kIdle) {
      prefill_pass_stages<Cfg>(pa, num_kb, sm.ring, cur);
    } else if constexpr (kScaled) {
      prefill_mainloop_scaled<Cfg, kPerK32>(pa, num_kb, k32, sm.ring, cur, wg, sx0, acc);
    } else {
      prefill_mainloop_k32<Cfg>(pa, num_kb, k32, sm.ring, cur, wg, sx0, acc);
    }
  }
  timeline::item_stamp_at(n, kTlItemComputed, 128);   // n: the item's number among the CTA's
  const bool second = kTwo && item >= layer_items<Shape::kRows>(*sm.sched, pa);
  prefill_stage_tile<Act, kDebug, kScaled, kPerK32>(second ? pb : pa, wi, acc, ptx::smem_addr(sm.staging), sm.epi_empty,
                                                    sm.epi_full, phase, second ? kLayerB : kLayerA,
                                                    ptx::smem_addr(sm.item));
  timeline::item_stamp_at(n, kTlItemStaged, 128);
}

// Before the roles split: the layout check and the barriers (thread 0; the schedule is the caller's,
// the caller's __syncthreads publishes both).
template <typename Cfg>
__device__ __forceinline__ void prefill_setup(int* err) {
  using Ring = typename Cfg::Ring;
  const PrefillSmem<Cfg> sm;
  if (threadIdx.x == 0) {
    if (ptx::dynamic_smem_size() < static_cast<uint32_t>(Cfg::kSmemBytes) || (ptx::smem_addr(dyn_smem) & 1023u) != 0)
      ptx::report_trap(err, kLayoutCheck, static_cast<int>(ptx::smem_addr(dyn_smem) & 1023u), Cfg::kSmemBytes,
                       static_cast<int>(ptx::dynamic_smem_size()));
    for (int s = 0; s < Cfg::kStages; ++s) {
      ptx::mbar_init(&sm.ring.full[s], Ring::kFullArrivals);
      ptx::mbar_init(&sm.ring.empty[s], Cfg::Shape::kConsumers);   // every consumer thread (producer.cuh says why)
    }
    ptx::mbar_init(sm.epi_full, Cfg::Shape::kConsumers);
    ptx::mbar_init(sm.epi_empty, 32 * kPrefillEpilogueWarps);
    // The item queue's readers: the scale warp, the epilogue warps and the consumer warps.
    init_item_queue(*sm.queue, Ring::kScaleWarps + kPrefillEpilogueWarps + Cfg::Shape::kConsumers / 32);
    ptx::fence_mbar_init();
  }
}

// The roles over a launch's items, in the dynamic order (scheduler.cuh claim_item: a CTA's first
// item is blockIdx.x, its TMA thread claims each later one from pa's item_counter while it issues
// the current one's last kClaimAhead stages, and posts it to the queue, which the scale warp and the
// epilogue warps take from and the consumers read after the current item's last stage): layer
// kLayerA's (pa), or with kLayerB (the fused kernel) kLayerA's then kLayerB's (pb; scheduler.cuh
// launch_items). In the static round robin (item += gridDim.x) the CTAs' last items ended up to
// ~4 items apart (bench/NOTES.md v41: gpt-oss T = 4096, 1345-1485 us). Returns false in the
// consumers, which have nothing after their loop (setmaxnreg: run_consumer in gemm_sm90.cuh says
// why), and true in the producer warpgroup once each of its roles is done: its epilogue warps have
// written the CTA's last item when the caller's barrier over the warpgroup passes.
template <typename Cfg, typename Act, bool kDebug, bool kPerK32, int kLayerA, int kLayerB = 0>
__device__ __forceinline__ bool prefill_roles(const GemmParams& pa, const GemmParams& pb) {
  using Ring = typename Cfg::Ring;
  using Shape = typename Cfg::Shape;
  constexpr int S = Cfg::kStages;
  constexpr bool kTwo = kLayerB != 0;
  constexpr bool kFused = kTwo;   // the fused kernel's epilogues: L1 completion, the fast mode's rebase
  RingCursor cur;
  if (threadIdx.x < 128) {
    ptx::setmaxnreg_dec<Cfg::kProducerRegs>();
    const PrefillSmem<Cfg> sm;
    const int num_items = launch_items<Shape::kRows, kTwo>(*sm.sched, pa, pb);
    const int warp = threadIdx.x / 32;
    const int lane = threadIdx.x % 32;
    if (warp == 0 && lane == 0) {
      ptx::prefetch_tma_desc(&pa.tmap_x64);
      if constexpr (kTwo) ptx::prefetch_tma_desc(&pb.tmap_x64);
      int item = blockIdx.x;   // every role's first item; the TMA thread posts the later ones
      while (item < num_items) {
        int local = item;
        const GemmParams& p = item_layer<Shape::kRows, kTwo>(local, *sm.sched, pa, pb);
        const int num_kb = p.k / kBlockK;
        const WorkItem wi = decode_item<Shape::kTokens, Shape::kRows>(local, *sm.sched, prefill_blocks<kPerK32>(p));
        timeline::item_take(kTwo && &p == &pb ? 2 : 1, local);
        wait_token_block(p, wi);   // the fused kernel's gates; standalone, it returns at once
        timeline::item_stamp(kTlItemGated);
        // A folded exact-mode tile is its E4M3 bytes only: its fp32 scales were not written.
        const int w_bytes = kPerK32 && !Ring::folded(p, wi) ? Shape::kTile : Ring::kBytes;
        // The 64-row boxes of the warpgroups with valid rows (the fused kernel: prefill_pass_stages).
        const int boxes = kTwo ? min(Shape::kWgs, (wi.valid + kChunkN - 1) / kChunkN) : Shape::kWgs;
        for (int kb = 0; kb < num_kb; ++kb) {
          if (kb == (num_kb > kClaimAhead ? num_kb - kClaimAhead : 0))
            post_item(*sm.queue, claim_item(pa.item_counter));   // past the end: the roles' end
          const int s = cur.stage;
          ptx::mbar_wait(&sm.ring.empty[s], cur.phase ^ 1, kWaitEmpty, s, p.err);
          ptx::mbar_arrive_expect_tx(&sm.ring.full[s], boxes * kChunkN * kBlockK + w_bytes);
          // Every box a warpgroup computes: rows past the expert's (or the pool's: zeros) are computed,
          // never written.
          for (int b = 0; b < boxes; ++b)
            ptx::tma_load_2d(sm.ring.x + s * Ring::kX + b * kChunkN * kBlockK, &p.tmap_x64, kb * kBlockK,
                             wi.row0 + b * kChunkN, &sm.ring.full[s]);
          ptx::bulk_g2s(sm.ring.w + s * Ring::kW, prefill_weight_tile<kPerK32>(p, wi.expert, kb, wi.n_block), w_bytes,
                        &sm.ring.full[s]);
          cur.advance<S>();
        }
        timeline::item_stamp(kTlItemIssued);
        item = last_posted(*sm.queue);
      }
      timeline::stamp(kTlIssued);
      retire_claims(pa.item_counter);
    } else if (warp == 1) {
      stage_token_scales<Shape::kTokens, Shape::kRows, S, kPerK32, Ring, kTwo>(pa, pb, sm.ring, *sm.sched, cur, warp,
                                                                               lane, *sm.queue);
    } else if (warp >= 2) {
      const uint32_t staging = ptx::smem_addr(sm.staging);
      uint32_t phase = 0;
      int n = 0;   // the item's number among the CTA's (the timeline build's stamps)
      for (int item = blockIdx.x; item < num_items; item = take_item(*sm.queue, warp), ++n) {
        int local = item;
        const GemmParams& p = item_layer<Shape::kRows, kTwo>(local, *sm.sched, pa, pb);
        const bool second = kTwo && &p == &pb;
        const WorkItem wi = decode_item<Shape::kTokens, Shape::kRows>(local, *sm.sched, prefill_blocks<kPerK32>(p));
        ptx::mbar_wait(sm.epi_full, phase, kWaitFull, -1, p.err);
        constexpr int kGroups = Shape::kRows / 64;   // an L1 tile's 32-channel groups
        if ((second ? kLayerB : kLayerA) == 1) {
          prefill_l1_out<Act, kFused && !kPerK32, kGroups, Shape::kRows, Shape::kTokens, kPrefillEpilogueWarps>(
              p, wi, staging, warp - 2, lane);
          if constexpr (kFused) {
            // Both warps wrote the item's rows (they take its tokens in turns): then its count.
            ptx::named_barrier(kPrefillEpilogueBarrier, 32 * kPrefillEpilogueWarps);
            if (warp == 2) count_l1_tiles<kGroups, Shape::kTokens>(p, wi, lane);
          }
        } else {
          prefill_l2_out<Shape::kRows, Shape::kTokens, kPrefillEpilogueWarps>(p, wi, staging, warp - 2, lane);
        }
        timeline::item_stamp_at(n, kTlItemWritten, 32);
        ptx::mbar_arrive(sm.epi_empty);
        phase ^= 1;
      }
    }
    return true;
  }
  ptx::setmaxnreg_inc<Cfg::kConsumerRegs>();
  const PrefillSmem<Cfg> sm;
  const int ctid = ptx::thread_idx() - 128;
  const int wg = ctid / 128;
  const int num_items = launch_items<Shape::kRows, kTwo>(*sm.sched, pa, pb);
  // The warpgroup's first token row of the thread: 16 wq + g (the other is + 8).
  const int sx0 = 64 * wg + 16 * (ctid / 32 % 4) + ctid % 32 / 4;
  uint32_t phase = 0;
  int taken = 0;   // items read from the queue (the next item's number among the CTA's)
  for (int item = blockIdx.x; item < num_items; item = next_posted(*sm.queue, taken++)) {
    // One instantiation of each mainloop serves both layers (with one per layer, ptxas spilled the
    // exact mode's mainloops in the fused kernel: 664 bytes); the branches are uniform.
    const int na = layer_items<Shape::kRows>(*sm.sched, pa);
    const bool second = kTwo && item >= na;
    const GemmParams& p = second ? pb : pa;
    const WorkItem wi =
        decode_item<Shape::kTokens, Shape::kRows>(second ? item - na : item, *sm.sched, prefill_blocks<kPerK32>(p));
    if constexpr (kTwo) {
      // No valid token for this warpgroup: the plain staging, never stored. (The fused kernel only:
      // in the standalone exact kernel the fourth instantiation cost 8 bytes of spills.)
      if (64 * wg >= wi.valid) {
        prefill_item<Cfg, Act, kDebug, kPerK32, !kPerK32, kLayerA, kLayerB, true>(pa, pb, item, sm, cur, wi, wg, sx0,
                                                                                  phase, taken);
        phase ^= 1;
        continue;
      }
    }
    if constexpr (!kPerK32)
      prefill_item<Cfg, Act, kDebug, false, true, kLayerA, kLayerB>(pa, pb, item, sm, cur, wi, wg, sx0, phase, taken);
    else if (Ring::folded(p, wi))
      prefill_item<Cfg, Act, kDebug, true, true, kLayerA, kLayerB>(pa, pb, item, sm, cur, wi, wg, sx0, phase, taken);
    else
      prefill_item<Cfg, Act, kDebug, true, false, kLayerA, kLayerB>(pa, pb, item, sm, cur, wi, wg, sx0, phase, taken);
    phase ^= 1;
  }
  return false;
}

// The standalone kernel body; kernel/gemm/instantiate_prefill.cu.in wraps it in an extern "C"
// __global__.
template <int kLayer, typename Act, bool kDebug, bool kPerK32>
__device__ __forceinline__ void gemm_sm90_prefill_body(const GemmParams& p) {
  using Cfg = PrefillConfig<kLayer, kPerK32>;
  prefill_setup<Cfg>(p.err);
  if (threadIdx.x < 32)
    build_schedule<PrefillShape<kPerK32>::kTokens>(
        *PrefillSmem<Cfg>().sched, p.num_experts, [&](int e) { return __ldg(p.expert_offsets + e); },
        [&](int e) { return __ldg(p.expert_rows + e); });
  __syncthreads();
  prefill_roles<Cfg, Act, kDebug, kPerK32, kLayer>(p, p);
}

}  // namespace megamoe
