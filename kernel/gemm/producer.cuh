// The producer warpgroup of the grouped GEMM: fills the ring of pipeline stages (BK = 128) that the
// consumers drain.
//   warp 0, lane 0: 2-D TMA of the activation tile (the item's token tile x 128 B, 128-byte
//                   swizzle: 8-row boxes for tiles up to 32 tokens, 64-row boxes above), 1-D bulk
//                   copies of the packed FP4 weights and their scale bytes; in the fused narrow
//                   engine's ring (StageRing::kSplitIssue) the weights only, and warp 3's lane 0
//                   the rest (issue_token_side);
//   warps 1 .. 3:   the activation scales of the stage as fp32, in the order the consumers read
//                   them (see StageRing::scale_index), so a consumer promotes with one fp32 FMA
//                   per accumulator and no scale arithmetic (one to three warps, by the tile; the
//                   exact prefill ring takes a token's four k32 bytes as one word instead,
//                   kRawScaleWords, or for an item that folds its weight scales the four fp32
//                   scales with the expert base, in the stage's weight slot: Ring::fold_scales).
// A stage's full barrier expects 1 + 32 kScaleWarps arrivals (the TMA thread's expect_tx, every
// lane of the scale warps; kSplitIssue: and the token side's expect_tx) plus the transaction bytes
// (in the fused narrow engine, for an item of at most two tokens, without the activation tile's: it
// lands on the stage's x_full barrier, which the scale warp waits on before it builds the step
// tiles; StageRing); the empty barrier is released by every consumer thread. Every thread that
// wrote or read a stage's scales arrives itself, so its arrive releases its own accesses. One lane
// arriving after __syncwarp is ordered as well, but compute-sanitizer's racecheck credits an arrive
// with the arriving thread's accesses only and reported the other 31 lanes' as hazards
// (kernel/probes/warp_publish.cu; bench/NOTES.md v28: none on any target since). Either way it is
// one SYNCS.ARRIVE a warp; the time did not move.
#pragma once

#include <cstdint>

#include "../common/ptx.cuh"
#include "../common/timeline.cuh"
#include "../common/ue8m0.cuh"
#include "contract.cuh"
#include "scheduler.cuh"

namespace megamoe {

// Where stage s of each producer-filled buffer lives, for a CTA of kRows weight rows and token
// tiles up to kMaxN. kPerK32: the exact mode's four scales per token and stage (else one).
template <int kMaxN, int kRows, bool kPerK32>
struct StageRing {
  // Step-major token columns (scheduler.cuh step_columns): the stage's x slot holds the TMA's token
  // tile (kXTile, as without them: the parts of an item of more than two tokens read it) and then
  // four step tiles of kStepTile bytes, the B operand of an item of at most two, which the scale
  // warp fills from it (stage_step_part).
  static constexpr bool kSteps = step_columns(kMaxN, kRows, kPerK32);
  static constexpr int kXTile = kMaxN * kBlockK;  // e4m3 activations, 128B swizzled
  static constexpr int kStepTile = 8 * 32;  // 8 columns x 32 B, K-major, no swizzle
  static constexpr int kX = kXTile + (kSteps ? 4 * kStepTile : 0);
  static constexpr int kW = kRows * kBlockK / 2;  // packed FP4, kernel layout
  static constexpr int kWsf = kRows * 4;  // weight scale bytes [row][4]
  static constexpr int kSxWords = (kPerK32 ? 4 : 1) * kMaxN;  // fp32 activation scales
  static constexpr int kSx = kSxWords * 4;
  static constexpr int kStage = kX + kW + kWsf + kSx;
  // Warps that stage the token scales (warps 1 .. kScaleWarps of the producer warpgroup): enough
  // that a lane holds at most three tokens' scale words within the producer's 40 registers.
  static constexpr int kScaleWarps = kMaxN <= 32 ? 1 : kMaxN <= 64 ? 2 : 3;
  // The fused narrow engine's ring (kSteps) is filled by two issuing threads: the TMA thread copies
  // the weights, and waits for no gate (they do not depend on the tokens); warp 3's lane 0 the
  // token side (the item's gate, then each stage's activation tile and weight scale bytes:
  // issue_token_side). One thread issuing both, each stage's copies and each item's gate were in
  // series (a stage trace, bench/NOTES.md v60: the TMA thread paced the ring); split, T = 8 / 64 on
  // an H100 with half the weight bytes copied (an H200-like ratio of stream to work) took 10 / 25 us
  // less.
  static constexpr bool kSplitIssue = kSteps;
  // The TMA thread's expect_tx, every lane of the scale warps (kSplitIssue: and the token side's).
  static constexpr int kFullArrivals = 1 + 32 * kScaleWarps + (kSplitIssue ? 1 : 0);
  static constexpr bool kRawScaleWords = false;  // the scales as fp32 (the prefill ring's k32: bytes)
  static_assert(kX % 1024 == 0 && kW % 1024 == 0, "swizzle atoms and bulk copies stay aligned");

  // The fp32 scale of token `tok` (k32 step `ks`) of an item with token tile `tile`: chunk c of
  // cw = min(tile, 64) tokens, then the wgmma accumulator thread t = (tok % 8) / 2 that owns it,
  // then its column pair (j, h). Consumer thread t of chunk c reads its cw/4 scales contiguously.
  __device__ __forceinline__ static int scale_index(int tok, int ks, int tile) {
    // The four-warpgroup serial kernel's one mainloop reads every item in its largest tile's
    // layout. (The wide tile's chunks are 64 wide anyway; written as a constant there, ptxas hoists
    // each token's place out of the stage loop and the 40-register scale warps spill.)
    const int cw = narrow_serial(kMaxN, kRows) ? kMaxN : chunk_width(tile);
    const int c = tok / cw;
    const int r = tok - c * cw;
    return ks * kMaxN + c * cw + ((r & 7) >> 1) * (cw >> 2) + (r >> 3) * 2 + (r & 1);
  }

  uint8_t* x;
  uint8_t* w;
  uint8_t* wsf;
  float* sx;
  uint64_t* full;
  uint64_t* empty;
  // kSteps: the barrier of stage `stage`'s token tile (the scale warp waits for it), after the empty
  // ones. Found from them, not held: a pointer more in the ring made every fused narrow kernel spill
  // (the consumers' copy of the ring held it across their mainloops).
  template <int kStages>
  __device__ __forceinline__ uint64_t* x_full(int stage) const {
    return empty + kStages + stage;
  }

  // kSteps: step tile s of stage `stage`, two 8 x 16 B core matrices (K bytes 0-15, then 16-31),
  // 128 B apart; column 2s + j of tile s is token j's 32 bytes of step s, every other column zero.
  __device__ __forceinline__ uint8_t* step_tile(int stage, int s) const {
    return x + stage * kX + kXTile + s * kStepTile;
  }
};

// The fp32 scale 2^e of an integer exponent, saturated: 0 under 2^-149, 2^127 above (the fast
// mode's promotion scale; see gemm_sm90.cuh).
__device__ __forceinline__ float exp2_sat(int e) {
  return e < -149 ? 0.0f : exp2i(e > 127 ? 127 : e);
}

// A position in the stage ring: the stage a role fills (producer) or drains (consumers) next. Each
// role keeps its own; a fused launch carries it from one layer's items to the next.
struct RingCursor {
  int stage = 0;
  uint32_t phase = 0;

  template <int kStages>
  __device__ __forceinline__ void advance() {
    if (++stage == kStages) {
      stage = 0;
      phase ^= 1;
    }
  }
};

// The scale warp of step-major columns (scheduler.cuh step_columns), an item of at most kStepTokens
// tokens (step_part): for each stage, once the TMA's token tile is in (x_full), lane
// 4j + s (of 0-7) copies token j's 32 bytes of k32 step s from it (row j, 128-byte swizzle) into
// column 2s + j of step tile s, and writes the pair's fp32 scale at sx[2s + j], where consumer
// thread t reads step t's (a float2). A missing token (j >= valid) gets scale 0; its column holds
// whatever row the TMA brought, whose products reach only that column's accumulators, which no
// epilogue stores. The tokens' scale words (a stage's four k32 bytes each) are loaded 16 stages at a
// time, lane 16 t + i holding token t's word of stage 16 (kb / 16) + i, and each stage's word is
// shuffled from its lane: a word loaded a stage ahead (as stage_token_scales' are) sat in flight
// across the proxy fence below, a MEMBAR in SASS, which orders the thread's earlier loads. Measured
// on an H100 (bench/NOTES.md v59): 1.5 / 2.5 us less at T = 1 / 8; the skeleton without weights or
// math did not move: read as the load's latency under the weights' stream (not measured apart).
template <int kStages, typename Ring>
__device__ __forceinline__ void stage_step_part(const GemmParams& p, const Ring& r, const WorkItem& wi, RingCursor& cur,
                                                int lane, const uint32_t* words, int words_per_row, int num_kb) {
  static_assert(kStepTokens == 2, "16 stages of two tokens' words a warp");
  const int j = lane / 4, s = lane % 4;
  const bool mine = lane < 4 * kStepTokens && j < wi.valid;
  uint32_t held = 0u;
  for (int kb = 0; kb < num_kb; ++kb) {
    if (kb % 16 == 0) {
      const int t = lane / 16, k = kb + lane % 16;
      held = t < wi.valid && k < num_kb ? __ldcg(words + (wi.row0 + t) * words_per_row + k) : 0u;
    }
    const uint32_t word = __shfl_sync(0xFFFFFFFFu, held, 16 * j + kb % 16);
    ptx::mbar_wait(&r.empty[cur.stage], cur.phase ^ 1, kWaitEmpty, cur.stage, p.err);
    // (A timeout here reports the full barrier's wait word, with the stage: x_full has none of its own.)
    ptx::mbar_wait(r.template x_full<kStages>(cur.stage), cur.phase, kWaitFull, cur.stage, p.err);
    if (lane < 4 * kStepTokens) {
      const uint8_t* row = r.x + cur.stage * Ring::kX + j * kBlockK;
      uint8_t* tile = r.step_tile(cur.stage, s);
#pragma unroll
      for (int c = 0; c < 2; ++c)
        *reinterpret_cast<uint4*>(tile + c * 128 + (2 * s + j) * 16) =
            *reinterpret_cast<const uint4*>(row + ((2 * s + c) ^ j) * 16);
      r.sx[cur.stage * Ring::kSxWords + 2 * s + j] = mine ? ue8m0_byte_to_float(word, s) : 0.0f;
    }
    ptx::fence_proxy_async_smem();  // the tiles' generic writes before the wgmmas' async reads
    ptx::mbar_arrive(&r.full[cur.stage]);  // every lane (producer.cuh's top)
    cur.advance<kStages>();
  }
}

// Warps 1 .. kScaleWarps of the producer warpgroup: the stages' fp32 token scales, at
// Ring::scale_index (the ring of gemm_sm90.cuh or of the prefill kernel, whose consumers read them in
// their own orders). warp / lane: the caller's. The items are layer pa's, or with kTwo pa's then
// pb's (the fused kernel: scheduler.cuh launch_items).
// The items come from the TMA thread's queue (scheduler.cuh, the dynamic order).
// kPartial: a layer's last block of kRows rows may be partial (the narrow engine: scheduler.cuh row_blocks).
// kBlock: the schedule's token block, when wider than kMaxN (the fused narrow engine: item_part).
template <int kMaxN, int kRows, int kStages, bool kPerK32, typename Ring, bool kTwo = false, bool kPartial = false,
          int kBlock = kMaxN>
__device__ __forceinline__ void stage_token_scales(const GemmParams& pa, const GemmParams& pb, const Ring& r,
                                                   const Schedule& sched, RingCursor& cur, int warp, int lane,
                                                   ItemQueue& queue) {
  using R = Ring;
  const int num_items = launch_items<kRows, kTwo, kPartial>(sched, pa, pb);
  // Lane l of scale warp w owns tokens 32 (w - 1) + l + 32 kScaleWarps m. One 4-byte word of
  // scale bytes serves four stages (k128: one byte per K128 block; K % 512 == 0), loaded when its
  // first stage comes; or one stage (k32: the four K32 groups), loaded a stage ahead so its
  // latency hides behind the ring. A token's place in the stage's scales (scale_index) is
  // recomputed per stage rather than held.
  constexpr int kStride = 32 * R::kScaleWarps;
  constexpr int kM = (kMaxN + kStride - 1) / kStride;
  const int t0 = 32 * (warp - 1) + lane;
  if constexpr (R::kSteps) {
    // The step tiles' columns that no token fills stay zero: written once here (the dispatch used
    // this shared memory as its scratch), before the first stage's arrival, whose full barrier the
    // consumers wait on (the proxy fence: the wgmmas read through the async proxy). Lanes 8-31 zero
    // chunks that lanes 0-7 fill later: the item loop's __syncwarp orders the two.
    static_assert(R::kScaleWarps == 1, "one scale warp builds the step tiles");
    for (int i = lane; i < kStages * 4 * R::kStepTile / 16; i += 32)
      *reinterpret_cast<uint4*>(r.step_tile(i / (4 * R::kStepTile / 16), 0) + i % (4 * R::kStepTile / 16) * 16) =
          make_uint4(0u, 0u, 0u, 0u);
    ptx::fence_proxy_async_smem();
  }
  for (int item = blockIdx.x; item < num_items; item = take_item(queue, warp)) {
    int local = item;
    const GemmParams& p = item_layer<kRows, kTwo, kPartial>(local, sched, pa, pb);
    const int num_kb = p.k / kBlockK;
    const int words_per_row = kPerK32 ? num_kb : num_kb / 4;
    const uint32_t* words = reinterpret_cast<const uint32_t*>(p.x_sf);
    const WorkItem item_wi = decode_item<kMaxN, kRows, kBlock>(local, sched, row_blocks<kRows, kPartial>(p));
    // The scales arrive with the rows: the same gate as the TMA thread's. L2 loads (ld.cg) below:
    // in the fused kernel other SMs write them.
    if (lane == 0) wait_token_block(p, item_wi);
    __syncwarp();
    for (int part = 0; part < item_parts<kMaxN, kBlock>(item_wi); ++part) {
      const WorkItem wi = item_part<kMaxN, kBlock>(item_wi, part);
      if constexpr (R::kSteps) {
        if (step_part(item_wi.valid)) {
          stage_step_part<kStages>(p, r, wi, cur, lane, words, words_per_row, num_kb);
          continue;
        }
      }
      // k128: the expert's base folds the weight rows' common scale into the token scale.
      const int bias = kPerK32 ? 0 : static_cast<int>(__ldg(p.w_expert_base + wi.expert)) - 260;
      // The exact prefill ring's folded items: their fp32 k32 scales times 2^(B_e - 127 - kLutHeadroom)
      // (the ring's fold_scales; the other items' as raw words).
      bool fold = false;
      float fold_base = 0.0f;
      if constexpr (R::kRawScaleWords) {
        fold = R::folded(p, wi);
        if (fold) fold_base = exp2i(static_cast<int>(__ldg(p.w_expert_base + wi.expert)) - 127 - kLutHeadroom);
      }
      // Word w of token tok: words[(row0 + tok) * words_per_row + w] (32-bit index: P * K / 128 < 2^31).
      const int first = (wi.row0 + t0) * words_per_row;
      if constexpr (R::kRawScaleWords) {
        if (fold) {
          // The folded items' fp32 k32 scales, [token][k32 step] (Ring::fold_scales), in a loop of
          // their own: straight-line, a token's four as one 16-byte store, the token's next word
          // loaded once this stage's is converted (one word a token held: the producer's 56
          // registers hold them). A token past the valid ones: 2^-127 (its word 0) times 0, +0.
          // In per-token branches with a select a value, and a second word a token held (spilled),
          // this loop held three consumer warpgroups back (bench/NOTES.md v45, v46).
          const uint32_t* src = words + first;
          const int step = kStride * words_per_row;
          uint32_t w[kM];
#pragma unroll
          for (int m = 0; m < kM; ++m) w[m] = t0 + kStride * m < wi.valid ? __ldcg(src + m * step) : 0u;
          for (int kb = 0; kb < num_kb; ++kb) {
            ptx::mbar_wait(&r.empty[cur.stage], cur.phase ^ 1, kWaitEmpty, cur.stage, p.err);
            float4* fs = reinterpret_cast<float4*>(r.fold_scales(cur.stage));
#pragma unroll
            for (int m = 0; m < kM; ++m) {
              const int tok = t0 + kStride * m;
              const bool valid = tok < wi.valid;
              const float base = valid ? fold_base : 0.0f;
              fs[tok] = make_float4(
                  __fmul_rn(ue8m0_byte_to_float(w[m], 0), base), __fmul_rn(ue8m0_byte_to_float(w[m], 1), base),
                  __fmul_rn(ue8m0_byte_to_float(w[m], 2), base), __fmul_rn(ue8m0_byte_to_float(w[m], 3), base));
              w[m] = valid && kb + 1 < num_kb ? __ldcg(src + m * step + kb + 1) : 0u;
            }
            // The folded scales lie where a later stage's bulk copy may write (an item that does
            // not fold): the async proxy's write must come after these.
            ptx::fence_proxy_async_smem();
            ptx::mbar_arrive(&r.full[cur.stage]);  // every lane: its own scales (see the top)
            cur.advance<kStages>();
          }
          continue;
        }
      }
      uint32_t word[kM], nxt[kM];
#pragma unroll
      for (int m = 0; m < kM; ++m)
        nxt[m] = kPerK32 && t0 + kStride * m < wi.valid ? __ldcg(words + first + kStride * m * words_per_row) : 0u;
      for (int kb = 0; kb < num_kb; ++kb) {
#pragma unroll
        for (int m = 0; m < kM; ++m) {
          const bool valid = t0 + kStride * m < wi.valid;
          if constexpr (kPerK32) {
            word[m] = nxt[m];
            if (valid && kb + 1 < num_kb) nxt[m] = __ldcg(words + first + kStride * m * words_per_row + kb + 1);
          } else if (kb % 4 == 0) {
            word[m] = valid ? __ldcg(words + first + kStride * m * words_per_row + kb / 4) : 0u;
          }
        }
        ptx::mbar_wait(&r.empty[cur.stage], cur.phase ^ 1, kWaitEmpty, cur.stage, p.err);
        float* sx = r.sx + cur.stage * R::kSxWords;
#pragma unroll
        for (int m = 0; m < kM; ++m) {
          const int tok = t0 + kStride * m;
          if (tok < wi.tile) {
            const bool valid = tok < wi.valid;
            const int idx = R::scale_index(tok, 0, wi.tile);
            if constexpr (R::kRawScaleWords) {  // the four k32 bytes of the token as one word
              reinterpret_cast<uint32_t*>(sx)[idx] = valid ? word[m] : 0u;
            } else if constexpr (kPerK32) {
#pragma unroll
              for (int ks = 0; ks < 4; ++ks) sx[idx + ks * kMaxN] = valid ? ue8m0_byte_to_float(word[m], ks) : 0.0f;
            } else {
              sx[idx] = valid ? exp2_sat(static_cast<int>((word[m] >> (8 * (kb & 3))) & 0xFFu) + bias) : 0.0f;
            }
          }
        }
        ptx::mbar_arrive(&r.full[cur.stage]);  // every lane: its own scales (see the top)
        cur.advance<kStages>();
      }
    }
  }
}

// The copies of an item part's stages, one definition for the threads that issue them (the TMA
// thread, and in a kSplitIssue ring the token side): its weights and their scale bytes (K block kb
// at kb times a block's stride), and its token tile's boxes (8 rows for the small tiles, 64 for the
// chunked ones: only the tile's rows move). rows: the block's weight rows, kRows or what a partial
// last block has; its weights and scale bytes are copied for those only.
template <int kRows, bool kPartial>
struct PartCopies {
  const uint8_t* w;  // K block 0's weights: [expert][kb][n_rows / 16][1 KB], the block's kRows / 16
  const uint8_t* wsf;  // K block 0's scale bytes: [expert][kb][n_rows][4]
  const CUtensorMap* tmap;
  int box, boxes, rows;

  __device__ __forceinline__ PartCopies(const GemmParams& p, const WorkItem& wi, int num_kb) {
    w = p.w + ((static_cast<int64_t>(wi.expert) * num_kb) * (p.n_rows / 16) + wi.n_block * (kRows / 16)) * 1024;
    wsf = p.w_sf + (static_cast<int64_t>(wi.expert) * num_kb * p.n_rows + wi.n_block * kRows) * 4;
    const bool wide = wi.tile >= kChunkN;
    box = wide ? kChunkN : 8;
    boxes = wi.tile / box;
    tmap = wide ? &p.tmap_x64 : &p.tmap_x8;
    rows = kPartial ? min(kRows, p.n_rows - wi.n_block * kRows) : kRows;
  }
  __device__ __forceinline__ int weight_bytes() const {
    return rows * (kBlockK / 2);
  }
  __device__ __forceinline__ int scale_bytes() const {
    return rows * 4;
  }
  template <typename Ring>
  __device__ __forceinline__ void weights(const GemmParams& p, const Ring& r, int stage, int kb) const {
    ptx::bulk_g2s(r.w + stage * Ring::kW, w + static_cast<int64_t>(kb) * p.n_rows * 64, weight_bytes(), &r.full[stage]);
  }
  template <typename Ring>
  __device__ __forceinline__ void scales(const GemmParams& p, const Ring& r, int stage, int kb) const {
    ptx::bulk_g2s(r.wsf + stage * Ring::kWsf, wsf + static_cast<int64_t>(kb) * p.n_rows * 4, scale_bytes(),
                  &r.full[stage]);
  }
  template <typename Ring>
  __device__ __forceinline__ void token_tile(const Ring& r, int stage, int kb, int row0, uint64_t* bar) const {
    for (int b = 0; b < boxes; ++b)
      ptx::tma_load_2d(r.x + stage * Ring::kX + b * box * kBlockK, tmap, kb * kBlockK, row0 + b * box, bar);
  }
};

// Ring::kSplitIssue: warp 3 fills each stage's token side, its lane 0 issuing: after the item's gate
// (the pull's rows, or the L1 tiles of an L2 item; the timeline's `gated` stamp), each stage's
// activation tile (onto x_full for a step part, whose step tiles the scale warp builds from it; else
// onto full) and weight scale bytes (onto full), once the stage is empty. The items come from the
// TMA thread's queue, as the scale warp's do. The timeline's item stamps are this thread's (taken,
// gated, issued: in that order here; the TMA thread, which waits for no gate, may issue an item's
// weights before its gate opens).
template <int kMaxN, int kRows, int kStages, typename Ring, bool kTwo, bool kPartial, int kBlock>
__device__ __forceinline__ void issue_token_side(const GemmParams& pa, const GemmParams& pb, const Ring& r,
                                                 const Schedule& sched, RingCursor& cur, int lane, ItemQueue& queue) {
  const int num_items = launch_items<kRows, kTwo, kPartial>(sched, pa, pb);
  for (int item = blockIdx.x; item < num_items; item = take_item(queue, 3)) {
    if (lane == 0) {
      int local = item;
      const GemmParams& p = item_layer<kRows, kTwo, kPartial>(local, sched, pa, pb);
      const int num_kb = p.k / kBlockK;
      const WorkItem item_wi = decode_item<kMaxN, kRows, kBlock>(local, sched, row_blocks<kRows, kPartial>(p));
      timeline::item_take(kTwo && &p == &pb ? 2 : 1, local);
      wait_token_block(p, item_wi);
      timeline::item_stamp(kTlItemGated);
      const bool steps = step_part(item_wi.valid);
      const int parts = item_parts<kMaxN, kBlock>(item_wi);
      for (int part = 0; part < parts; ++part) {
        const WorkItem wi = item_part<kMaxN, kBlock>(item_wi, part);
        const PartCopies<kRows, kPartial> src(p, wi, num_kb);
        for (int kb = 0; kb < num_kb; ++kb) {
          const int stage = cur.stage;
          ptx::mbar_wait(&r.empty[stage], cur.phase ^ 1, kWaitEmpty, stage, p.err);
          // A fuller part's tile lands on the full barrier, and x_full gets a plain arrival, so that
          // each of its phases is one use of the stage.
          uint64_t* x_bar = steps ? r.template x_full<kStages>(stage) : &r.full[stage];
          ptx::mbar_arrive_expect_tx(r.template x_full<kStages>(stage), steps ? wi.tile * kBlockK : 0);
          ptx::mbar_arrive_expect_tx(&r.full[stage], (steps ? 0 : wi.tile * kBlockK) + src.scale_bytes());
          src.token_tile(r, stage, kb, wi.row0, x_bar);
          src.scales(p, r, stage, kb);
          cur.advance<kStages>();
        }
      }
      timeline::item_stamp(kTlItemIssued);
    }
    __syncwarp();
  }
}

// The producer warpgroup's part of a launch's items (blocks of kRows weight rows): layer pa's, or
// with kTwo pa's then pb's (the fused kernel). The TMA thread claims the items in the dynamic order
// (scheduler.cuh; the counter is pa's item_counter) and posts them to `queue` for the scale warps
// and the consumers.
// kBlock, kPartial: as run_consumer's (gemm_sm90.cuh); a partial block's weights and scale bytes are
// copied for its rows only (the other warpgroups compute on what the stage held, and store nothing).
template <int kMaxN, int kRows, int kStages, bool kPerK32, bool kTwo, int kBlock = kMaxN, bool kPartial = false>
__device__ __forceinline__ void run_producer(const GemmParams& pa, const GemmParams& pb,
                                             const StageRing<kMaxN, kRows, kPerK32>& r, const Schedule& sched,
                                             RingCursor& cur, ItemQueue* queue) {
  using R = StageRing<kMaxN, kRows, kPerK32>;
  static_assert(!R::kSplitIssue || (R::kScaleWarps == 1 && kTwo), "warp 3 is free (warp 2: the fused epilogue warp)");
  const int warp = (threadIdx.x / 32) % 4;
  const int lane = threadIdx.x % 32;
  if (warp == 0 && lane == 0) {
    ptx::prefetch_tma_desc(&pa.tmap_x8);
    ptx::prefetch_tma_desc(&pa.tmap_x64);
    if constexpr (kTwo) {
      ptx::prefetch_tma_desc(&pb.tmap_x8);
      ptx::prefetch_tma_desc(&pb.tmap_x64);
    }
    const int num_items = launch_items<kRows, kTwo, kPartial>(sched, pa, pb);
    int item = blockIdx.x;  // every role's first item; the TMA thread posts the later ones
    while (item < num_items) {
      int local = item;
      const GemmParams& p = item_layer<kRows, kTwo, kPartial>(local, sched, pa, pb);
      const int num_kb = p.k / kBlockK;
      const WorkItem item_wi = decode_item<kMaxN, kRows, kBlock>(local, sched, row_blocks<kRows, kPartial>(p));
      if constexpr (!R::kSplitIssue) {  // (kSplitIssue: the token side's gate and item stamps)
        timeline::item_take(kTwo && &p == &pb ? 2 : 1, local);
        wait_token_block(p, item_wi);
        timeline::item_stamp(kTlItemGated);
      }
      const int parts = item_parts<kMaxN, kBlock>(item_wi);
      for (int part = 0; part < parts; ++part) {
        const WorkItem wi = item_part<kMaxN, kBlock>(item_wi, part);
        const PartCopies<kRows, kPartial> src(p, wi, num_kb);
        for (int kb = 0; kb < num_kb; ++kb) {
          if (part == parts - 1 && kb == (num_kb > kClaimAhead ? num_kb - kClaimAhead : 0))
            post_item(*queue, claim_item(pa.item_counter));  // past the end: the roles' end
          const int stage = cur.stage;
          ptx::mbar_wait(&r.empty[stage], cur.phase ^ 1, kWaitEmpty, stage, p.err);
          if constexpr (R::kSplitIssue) {  // the weights only: issue_token_side fills the rest
            ptx::mbar_arrive_expect_tx(&r.full[stage], src.weight_bytes());
          } else {
            ptx::mbar_arrive_expect_tx(&r.full[stage], wi.tile * kBlockK + src.weight_bytes() + src.scale_bytes());
            src.token_tile(r, stage, kb, wi.row0, &r.full[stage]);
          }
          src.weights(p, r, stage, kb);
          if constexpr (!R::kSplitIssue) src.scales(p, r, stage, kb);
          cur.advance<kStages>();
        }
      }
      if constexpr (!R::kSplitIssue) timeline::item_stamp(kTlItemIssued);
      item = last_posted(*queue);
    }
    timeline::stamp(kTlIssued);
    retire_claims(pa.item_counter);
  } else if (R::kSplitIssue && warp == 3) {
    issue_token_side<kMaxN, kRows, kStages, R, kTwo, kPartial, kBlock>(pa, pb, r, sched, cur, lane, *queue);
  } else if (warp >= 1 && warp <= R::kScaleWarps) {
    stage_token_scales<kMaxN, kRows, kStages, kPerK32, R, kTwo, kPartial, kBlock>(pa, pb, r, sched, cur, warp, lane,
                                                                                  *queue);
  }
}

}  // namespace megamoe
