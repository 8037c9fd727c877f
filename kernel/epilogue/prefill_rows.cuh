// The layers' epilogues in the prefill kernel (gemm_sm90_prefill.cuh: tokens as rows of the
// accumulator), and L1's in the fused narrow engine (gemm_sm90.cuh's swap-AB roles at token tile 8),
// in two parts so that the tensor cores do not wait for them:
//   prefill_stage_tile   the consumers, right after an item's mainloop: the rows' factors
//                        (scaled tables), the debug dumps, and the tile rounded to bf16 into a staging
//                        buffer in shared memory; then the consumers go on to the next item;
//   l1_stage_handoff     the narrow engine's consumers: the same for their L1 tile (8 tokens x
//                        the CTA's weight rows, the swap-AB fragment), into one of two L1Handoff
//                        buffers (used in turn), with the item part it holds;
//   prefill_l1_out /     the producer warpgroup's two epilogue warps, during the next item's
//   prefill_l2_out       mainloop: D6 (SwiGLU with the routing weight, requant) or D8 (bf16 rows to
//                        their combine rows) from the staged tile, in 8- and 16-byte stores (the
//                        narrow engine: prefill_l1_out, by one warp).
// The arithmetic is D6's and D8's as in l1_swiglu_requant.cuh and l2_combine_rows.cuh (the
// activation policy's routed, requant_scale_byte, bias_or_neg_zero's -0.0: one definition); SPEC
// §8's biases are added before the staging's rounding. D6 step 1 (gate and up, biased, rounded to
// bf16) is the staging itself, and D8 is bf16 of the same value as the swap-AB epilogue's: staging
// loses nothing either layer reads.
// (With the whole epilogue in the consumers, it took 12 % of their time, ncu, with the tensor cores
// idle; in the narrow engine an L1 item's epilogue was 3.4 of its 11.5 µs, bench/NOTES.md v37.)
//
// Consumer fragment: thread (warpgroup wg, warp wq, lane g * 4 + t) holds acc[h][4j + 2r + c] =
// token 64 wg + 16 wq + g + 8r of the tile, weight row 128 h + 8j + 2t + c of its rows (PrefillShape:
// the fast mode's 256, the exact mode's 128). Rows interleave gate and up with granularity 8: 16-row
// block b of the tile holds the gate rows of channels 8b .. 8b + 7 of the tile's rows / 2, then
// their up rows.
//
// Staging: [tokens][rows] bf16, 2 rows bytes a token; 16-byte chunk c (rows 8c .. 8c + 7) of token
// tok at chunk c ^ (tok % 8), so the consumers' 4-byte stores (8 tokens a store) and the L2 epilogue
// warps' 16-byte loads spread over all banks; the L1 epilogue warps' gate (and up) loads take every
// other chunk of a token, two ways to a bank (these warps are off the tensor cores' path).
#pragma once

#include <cstdint>
#include <cuda_bf16.h>
#include <type_traits>

#include "../common/ptx.cuh"
#include "../common/rebase.cuh"
#include "../common/ue8m0.cuh"
#include "../gemm/contract.cuh"
#include "../gemm/scheduler.cuh"
#include "l1_swiglu_requant.cuh"
#include "l2_combine_rows.cuh"

namespace megamoe {

template <bool kPerK32>
constexpr int kPrefillStagingBytes = PrefillShape<kPerK32>::kTokens * PrefillShape<kPerK32>::kRows * 2;

// kRows: the staging's rows a token (the narrow engine's L1Handoff: 256).
template <int kRows = 256>
__device__ __forceinline__ uint32_t prefill_staging_addr(uint32_t staging, int tok, int chunk) {
  return staging + tok * (2 * kRows) + ((chunk ^ (tok & 7)) << 4);
}

// One L1 tile of the narrow engine on its way from the consumers to the epilogue warp: the staged
// tile (prefill_staging_addr's layout, kSmallTile tokens, up to 256 weight rows), the item part it
// is, and the barriers: full (every consumer thread), empty (the warp's 32 lanes). A buffer with
// `stop` set ends the warp's loop (the CTA's L1 items are done).
struct alignas(16) L1Handoff {   // 16: the second buffer's tile takes 16-byte loads
  uint8_t tile[kSmallTile * 512];
  WorkItem wi;
  int tl_item;   // the item's number among the CTA's (the timeline build's stamp)
  int stop;
  uint64_t full;
  uint64_t empty;
};

// The L1 channel of a narrow-engine consumer thread (wg, wq, g, t) in its item's tile: 32 wg + 8 wq
// + g of the tile's kRows / 2, whose gate and up it holds for tokens 2t, 2t + 1 (the fragment of
// l1_swiglu_requant.cuh at N = 8), and whether its group is below I (l1_epilogue's `real`: the
// padding group past I is never stored). Its gate and up rows are chunks 8 wg + 2 wq and + 1 of
// the staging, prefill_l1_out's group wg.
template <int kRows>
__device__ __forceinline__ int64_t handoff_channel(const GemmParams& p, const WorkItem& wi, bool& real) {
  const int ctid = ptx::thread_idx() - 128;  // re-read where needed: held across the mainloop it spills
  const int64_t ch0 = static_cast<int64_t>(wi.n_block) * (kRows / 2) + ctid / 128 * 32;
  real = ch0 < p.n_out / 2;
  return ch0 + ctid % 128 / 32 * 8 + ctid % 32 / 4;
}

// SPEC §8's b1 of the thread's gate and up channel as raw bf16 bits (bias_bits: 0x8000, -0.0, without
// b1; 0 and never added where the group is not real), loaded before the item's mainloop, so that
// their latency hides under it (after it, the loads stalled every consumer warp at each item's end:
// ncu, NOTES v37), and widened by l1_stage_handoff after it: widened here, the loads' first use came
// before the mainloop, and every item began with a load's latency under the weight stream
// (bench/NOTES.md v60).
template <int kRows>
__device__ __forceinline__ uint2 handoff_bias(const GemmParams& p, const WorkItem& wi) {
  bool real;
  const int64_t ch = handoff_channel<kRows>(p, wi, real);
  if (!real) return make_uint2(0u, 0u);
  return make_uint2(bias_bits(p, wi.expert, ch), bias_bits(p, wi.expert, p.n_out / 2 + ch));
}

// The narrow engine's consumers after an L1 item part's mainloop: D5's dump (debug), SPEC §8's b1
// (Act::kOai: bias, handoff_bias's), the bf16 rounding of D6 step 1 (as l1_epilogue: the same
// bits), then the tile into buffer h once the epilogue warp released it (parity: that of the
// buffer's use) and one arrival a thread; the first consumer thread also writes the item part.
template <int kRows, typename Act, bool kDebug>
__device__ __forceinline__ void l1_stage_handoff(const GemmParams& p, const WorkItem& wi, const float (&acc)[4],
                                                 uint2 bias_raw, L1Handoff& h, uint32_t parity, int tl_item) {
  const int ctid = ptx::thread_idx() - 128;
  const int wg = ctid / 128;
  const int wq = ctid % 128 / 32;
  const int g = ctid % 32 / 4;
  const int t = ctid % 4;
  const int64_t inter = p.n_out / 2;
  bool real;
  const int64_t ch = handoff_channel<kRows>(p, wi, real);
  if constexpr (kDebug) {
#pragma unroll
    for (int c = 0; c < 2; ++c) {
      const int tok = 2 * t + c;
      if (tok < wi.valid && real) {
        p.dump[(wi.row0 + tok) * 2 * inter + ch] = acc[c];
        p.dump[(wi.row0 + tok) * 2 * inter + inter + ch] = acc[2 + c];
      }
    }
  }
  ptx::fence_operand(bias_raw.x);   // the loads' first use: after the mainloop (handoff_bias)
  ptx::fence_operand(bias_raw.y);
  const float2 bias = make_float2(__uint_as_float(bias_raw.x << 16), __uint_as_float(bias_raw.y << 16));
  ptx::mbar_wait(&h.empty, parity ^ 1, kWaitEmpty, -1, p.err);
  const uint32_t tile = ptx::smem_addr(h.tile);
#pragma unroll
  for (int c = 0; c < 2; ++c) {
    float gate = acc[c], up = acc[2 + c];
    if constexpr (Act::kOai) {
      gate = __fadd_rn(gate, bias.x);
      up = __fadd_rn(up, bias.y);
    }
    const __nv_bfloat16 gb = __float2bfloat16_rn(gate), ub = __float2bfloat16_rn(up);
    ptx::st_shared_u16(prefill_staging_addr(tile, 2 * t + c, 8 * wg + 2 * wq) + 2 * g,
                       *reinterpret_cast<const uint16_t*>(&gb));
    ptx::st_shared_u16(prefill_staging_addr(tile, 2 * t + c, 8 * wg + 2 * wq + 1) + 2 * g,
                       *reinterpret_cast<const uint16_t*>(&ub));
  }
  if (ctid == 0) {
    h.wi = wi;
    h.tl_item = tl_item;
    h.stop = 0;
  }
  ptx::mbar_arrive(&h.full);
}

// The consumers' last use of buffer h in a launch: `stop` for its epilogue warp.
__device__ __forceinline__ void l1_stop_handoff(const GemmParams& p, L1Handoff& h, uint32_t parity) {
  ptx::mbar_wait(&h.empty, parity ^ 1, kWaitEmpty, -1, p.err);
  if (ptx::thread_idx() == 128) h.stop = 1;
  ptx::mbar_arrive(&h.full);
}

// What prefill_stage_tile reads of the weights besides the tile, per item: copied into shared memory
// by the consumers' cp.async at the item's start (prefill_item_fetch), so that it has landed when
// their mainloop ends. Loaded after the mainloop, its round trips (the row factors', then the
// biases') were a tenth of an item's time (bench/NOTES.md v39). Static weight data only: the routing
// weights are written by this launch's pull, and a copy issued before the item's first stage has
// passed would not be ordered after the gate that makes them visible. Layout (bytes, for a tile of
// kRows weight rows):
//   [0, kRows)            the tile's row-base bytes (kRowFactors; 0 past the layer's rows)
//   [kRows, 3 kRows)      SPEC §8's bias of the tile's columns, bf16: L1 the tile's kRows / 2 gate
//                         channels, then its up channels; L2 its kRows rows (0 past the real ones)
//   [3 kRows, 3 kRows + 4) the 4-byte word of w_expert_base that holds the expert's byte (kRowFactors;
//                         the tensor is zero-padded to whole words: megamoe/jit/layout.py)
template <int kRows>
struct PrefillItemData {
  static constexpr int kBias = kRows, kBase = 3 * kRows;
  static constexpr int kRowChunks = kRows / 16, kBiasChunks = kRows / 8;   // 16-byte copies
};
// The largest tile's (256 rows), rounded to 16 bytes: what follows stays aligned.
constexpr int kPrefillItemBytes = (PrefillItemData<256>::kBase + 4 + 15) / 16 * 16;
// The consumers' barrier before they read it (every consumer thread; ids 1-4 serve other roles'
// barriers).
constexpr int kPrefillItemBarrier = 5;

// The copies of item `wi`'s data into `item` (kPrefillItemBytes of shared memory), by the first
// consumer threads (one chunk each: the row bytes', the bias columns', the expert's word), each one
// cp.async group (every thread commits one, empty or not). A chunk past the layer's rows copies
// nothing and writes zeros.
template <typename Act, bool kRowFactors, bool kPerK32>
__device__ __forceinline__ void prefill_item_fetch(const GemmParams& p, const WorkItem& wi, int layer, uint32_t item) {
  constexpr int kRows = PrefillShape<kPerK32>::kRows;
  using D = PrefillItemData<kRows>;
  const int ctid = ptx::thread_idx() - 128;
  const int64_t row_tile = static_cast<int64_t>(wi.n_block) * kRows;
  if (kRowFactors && ctid < D::kRowChunks) {
    const bool ok = row_tile + 16 * ctid < p.n_rows;   // n_rows: a multiple of 128
    ptx::cp_async_16(item + 16 * ctid,
                     p.w_row_base + static_cast<int64_t>(wi.expert) * p.n_rows + (ok ? row_tile + 16 * ctid : 0),
                     ok ? 16u : 0u);
  }
  if (Act::kOai && ctid >= D::kRowChunks && ctid < D::kRowChunks + D::kBiasChunks && p.bias != nullptr) {
    const int c = ctid - D::kRowChunks;   // 8 columns a chunk (n_out and I: multiples of 32)
    const int64_t inter = p.n_out / 2;
    int64_t col;
    bool ok;
    if (layer == 1) {
      constexpr int kHalf = D::kBiasChunks / 2;   // the gate channels' chunks, then the up channels'
      const int64_t ch = static_cast<int64_t>(wi.n_block) * (kRows / 2) + 8 * (c % kHalf);
      col = (c / kHalf) * inter + ch;
      ok = ch < inter;
    } else {
      col = row_tile + 8 * c;
      ok = col < p.n_out;
    }
    ptx::cp_async_16(item + D::kBias + 16 * c, p.bias + static_cast<int64_t>(wi.expert) * p.n_out + (ok ? col : 0),
                     ok ? 16u : 0u);
  }
  if (kRowFactors && ctid == D::kRowChunks + D::kBiasChunks)
    ptx::cp_async_4(item + D::kBase, p.w_expert_base + (wi.expert & ~3));
  ptx::cp_async_commit();
}

// The consumers' part: the row factors 2^(B_r - B_e) <= 1 where the mainloop used the scaled
// tables (kRowFactors: the fast mode, the exact mode's folded items; static weight data, here per
// column), the debug dumps (the fp32 values D5 / D7 compare), SPEC §8's biases (Act::kOai: b1 at D6
// step 1, fp32(w_route · b2) at D8, both before the staging's bf16 rounding, as the swap-AB
// epilogues add them), then the tile into the staging buffer once the epilogue warps have released
// it (epi_empty, parity phase ^ 1), and one arrival per thread on epi_full.
// layer (1 or 2) picks the debug dump's layout and the bias's form: one instantiation serves the
// fused kernel's two layers (a second beside it made ptxas spill the exact mode's mainloops).
// The rows past the layer's real outputs (2I's channels past I, H's padding rows) are dumped and
// biased nowhere, and the epilogue warps store none.
template <typename Act, bool kDebug, bool kRowFactors, bool kPerK32>
__device__ __forceinline__ void prefill_stage_tile(const GemmParams& p, const WorkItem& wi,
                                                   float (&acc)[PrefillShape<kPerK32>::kHalves][64], uint32_t staging,
                                                   uint64_t* epi_empty, uint64_t* epi_full, uint32_t phase, int layer,
                                                   uint32_t item) {
  using Shape = PrefillShape<kPerK32>;
  using D = PrefillItemData<Shape::kRows>;
  constexpr int kHalves = Shape::kHalves;
  const int ctid = ptx::thread_idx() - 128;  // re-read: held across the mainloop it is spilled
  const int wtid = ctid % 128;
  const int t = wtid % 4;
  const int tok0 = 64 * (ctid / 128) + 16 * (wtid / 32) + (wtid % 32) / 4;
  const int row_tile = wi.n_block * Shape::kRows;  // the tile's first weight row of the layout
  // The item's data (prefill_item_fetch): every consumer thread's copies landed, then all of them.
  ptx::cp_async_wait<0>();
  ptx::named_barrier(kPrefillItemBarrier, Shape::kConsumers);
  if constexpr (kRowFactors) {
    const int expert_base = static_cast<int>(ptx::ld_shared_u32(item + D::kBase) >> (8 * (wi.expert & 3)) & 0xFFu);
#pragma unroll
    for (int h = 0; h < kHalves; ++h) {
#pragma unroll
      for (int j = 0; j < 16; ++j) {
        // Rows past the layout were copied as zeros (no row: never stored).
        const uint32_t pair = ptx::ld_shared_u16(item + 128 * h + 8 * j + 2 * t);
        const float f0 = exp2i(static_cast<int>(pair & 0xFFu) - expert_base);
        const float f1 = exp2i(static_cast<int>(pair >> 8) - expert_base);
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          acc[h][4 * j + 2 * r] = __fmul_rn(acc[h][4 * j + 2 * r], f0);
          acc[h][4 * j + 2 * r + 1] = __fmul_rn(acc[h][4 * j + 2 * r + 1], f1);
        }
      }
    }
  }
  // Column (h, j, c) of the thread's: L1 channel ch1 of the layer (gate rows at even j, up rows at
  // odd j: D5 as [row][gate | up]), L2 hidden row h2.
  const int64_t inter = p.n_out / 2;
  auto ch1 = [&](int h, int j, int c) -> int64_t {
    return static_cast<int64_t>(wi.n_block) * (Shape::kRows / 2) + 64 * h + 8 * (j / 2) + 2 * t + c;
  };
  auto h2 = [&](int h, int j, int c) -> int64_t { return row_tile + 128 * h + 8 * j + 2 * t + c; };
  if constexpr (kDebug) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int tok = tok0 + 8 * r;
      if (tok >= wi.valid) continue;
      const int64_t row = wi.row0 + tok;
#pragma unroll
      for (int h = 0; h < kHalves; ++h)
#pragma unroll
        for (int j = 0; j < 16; ++j)
#pragma unroll
          for (int c = 0; c < 2; ++c) {
            const float v = acc[h][4 * j + 2 * r + c];
            if (layer == 1) {
              if (ch1(h, j, c) < inter) p.dump[row * 2 * inter + (j % 2) * inter + ch1(h, j, c)] = v;
            } else if (h2(h, j, c) < p.n_out) {  // D7 as [row][hidden]
              p.dump[row * p.n_out + h2(h, j, c)] = v;
            }
          }
    }
  }
  if constexpr (Act::kOai) {
    // The bias pair of the thread's two columns 2t, 2t + 1 (adjacent in b1 and in b2: one 4-byte
    // load), or two -0.0 where there is none (bias_or_neg_zero's identity: x + -0.0 is x); L2's
    // routing weights of the thread's two tokens (plain loads: the pull wrote them, as l1_epilogue's).
    float wr[2];
#pragma unroll
    for (int r = 0; r < 2; ++r)
      wr[r] = layer == 2 && tok0 + 8 * r < wi.valid ? p.w_route[wi.row0 + tok0 + 8 * r] : 0.0f;
    // All the thread's pairs from the item's copy (prefill_item_fetch), a column that is not real then given
    // the -0.0 pair (its copy holds zeros). The layer is chosen once, outside the loads: chosen per
    // column, it made a branch of each (bench/NOTES.md v39).
    uint32_t pairs[kHalves][16];
    const uint16_t* bias = p.bias;
    auto load_pairs = [&](auto layer_c) {
      constexpr int kL = decltype(layer_c)::value;
#pragma unroll
      for (int h = 0; h < kHalves; ++h)
#pragma unroll
        for (int j = 0; j < 16; ++j) {
          // The column's pair in the item's bias copy: L1 gate channels then up channels, L2 rows.
          const int k = kL == 1 ? (j % 2) * (Shape::kRows / 2) + 64 * h + 8 * (j / 2) + 2 * t : 128 * h + 8 * j + 2 * t;
          pairs[h][j] = ptx::ld_shared_u32(item + D::kBias + 2 * k);
        }
#pragma unroll
      for (int h = 0; h < kHalves; ++h)
#pragma unroll
        for (int j = 0; j < 16; ++j)
          if (!(kL == 1 ? ch1(h, j, 0) < inter : h2(h, j, 0) < p.n_out)) pairs[h][j] = 0x80008000u;
    };
    if (bias == nullptr) {
#pragma unroll
      for (int h = 0; h < kHalves; ++h)
#pragma unroll
        for (int j = 0; j < 16; ++j) pairs[h][j] = 0x80008000u;
    } else if (layer == 1) {
      load_pairs(std::integral_constant<int, 1>{});
    } else {
      load_pairs(std::integral_constant<int, 2>{});
    }
    // The term added: L1 b1 itself; L2 routed_bias's fp32(w_route · b2), or without b2 -0.0, which
    // is then b itself (the -0.0 pair). One select per term on the thread's flag `plain`: chosen per
    // term by layer and by bias, each term took a branch of its own.
    const bool plain = layer == 1 || bias == nullptr;
#pragma unroll
    for (int h = 0; h < kHalves; ++h)
#pragma unroll
      for (int j = 0; j < 16; ++j) {
        const float b[2] = {__uint_as_float(pairs[h][j] << 16), __uint_as_float(pairs[h][j] & 0xFFFF0000u)};
#pragma unroll
        for (int r = 0; r < 2; ++r)
#pragma unroll
          for (int c = 0; c < 2; ++c) {
            const float term = plain ? b[c] : __fmul_rn(wr[r], b[c]);
            acc[h][4 * j + 2 * r + c] = __fadd_rn(acc[h][4 * j + 2 * r + c], term);
          }
      }
  }
  ptx::mbar_wait(epi_empty, phase ^ 1, kWaitEmpty, -1, p.err);
#pragma unroll
  for (int r = 0; r < 2; ++r)
#pragma unroll
    for (int h = 0; h < kHalves; ++h)
#pragma unroll
      for (int j = 0; j < 16; ++j) {
        const __nv_bfloat162 v = __floats2bfloat162_rn(acc[h][4 * j + 2 * r], acc[h][4 * j + 2 * r + 1]);
        ptx::st_shared_u32(prefill_staging_addr<Shape::kRows>(staging, tok0 + 8 * r, 16 * h + j) + 4 * t,
                           *reinterpret_cast<const uint32_t*>(&v));
      }
  ptx::mbar_arrive(epi_full);
}

__device__ __forceinline__ float bf16_lo(uint32_t w) {
  return __uint_as_float(w << 16);
}
__device__ __forceinline__ float bf16_hi(uint32_t w) {
  return __uint_as_float(w & 0xFFFF0000u);
}

// D6 from the staged tile (kRows staged rows a token; the item's kGroups groups of 32 channels, its
// 64 kGroups weight rows, at its start), by epilogue warp ew of kWarps, which take the tile's kTokens tokens in
// turns, a step each (so that both have work whatever the item's valid rows; the narrow engine's one
// warp takes each whole item part, ew = 0). Per step a warp takes kPer tokens; lane l: token
// l / kLanes of the step, the 32-channel group (l % kLanes) / 4, its 8 channels l % 4 (the group's
// maximum over four lanes: two shuffles), stored as 8 bytes (a token's 32 kGroups bytes by 4 kGroups
// lanes) and, by its first lane, the group's scale byte.
// kRebase (the fused kernel's fast mode: an item's 128 channels are one K128 block of L2): the warp
// also writes them rebased per 128 channels (rebase_k128: the largest of the token's four scale
// bytes, two more shuffles), L2's operand. The fused kernel's L1-completion count follows once every
// warp has written the item (count_l1_tiles).
template <typename Act, bool kRebase, int kGroups, int kRows, int kTokens, int kWarps>
__device__ __forceinline__ void prefill_l1_out(const GemmParams& p, const WorkItem& wi, uint32_t staging, int ew,
                                               int lane) {
  static_assert(kGroups <= 4 && 32 * kGroups <= kRows / 2 && (!kRebase || kGroups == 4),
                "a token's groups are one 16-lane half's");
  constexpr int kLanes = kGroups <= 2 ? 8 : 16;   // a token's lanes, 4 a group
  constexpr int kPer = 32 / kLanes;                // tokens a step
  constexpr int kSteps = (kTokens + kPer * kWarps - 1) / (kPer * kWarps);   // a warp's
  constexpr int kSlots = (kSteps * kPer + 31) / 32;                         // its routing weights, 32 a register
  const int64_t inter = p.n_out / 2;
  const int64_t ld = p.out_stride;  // the intermediate's row stride: I padded to K blocks
  const int64_t n_sf = ld / 32;
  const int64_t ch_cta = static_cast<int64_t>(wi.n_block) * (32 * kGroups);  // the tile's first channel
  const float bound = clamp_bound(p);
  const int grp = (lane % kLanes) / 4;
  const int q = lane % 4;
  const int gate_chunk = 2 * (4 * grp + q);  // its 8 channels' gate rows (their up rows: the next)
  // The routing weights of the warp's tokens (its u-th: step u / kPer, token u % kPer of it), lane l
  // holding u = l + 32 i; taken by shuffle. Plain (coherent) loads, as in l1_epilogue.
  auto token_of = [&](int u) { return ((u / kPer) * kWarps + ew) * kPer + u % kPer; };
  float wr[kSlots];
#pragma unroll
  for (int i = 0; i < kSlots; ++i) {
    const int tok = token_of(32 * i + lane);
    wr[i] = tok < wi.valid ? p.w_route[wi.row0 + tok] : 0.0f;
  }
  uint8_t* out = reinterpret_cast<uint8_t*>(p.out);
#pragma unroll 1
  for (int step = 0; step < kSteps; ++step) {
    if ((step * kWarps + ew) * kPer >= wi.valid) break;  // the same for the whole warp
    const int u = step * kPer + lane / kLanes;            // the lane's token among the warp's
    float wr_u = 0.0f;
#pragma unroll
    for (int i = 0; i < kSlots; ++i) {   // a step's tokens are in one slot: kPer divides 32
      const float w = __shfl_sync(0xFFFFFFFFu, wr[i], u % 32);
      if (i == step * kPer / 32) wr_u = w;
    }
    const int tok = token_of(u);
    const uint4 g = ptx::ld_shared_v4(prefill_staging_addr<kRows>(staging, tok, gate_chunk));
    const uint4 up = ptx::ld_shared_v4(prefill_staging_addr<kRows>(staging, tok, gate_chunk + 1));
    const uint32_t gw[4] = {g.x, g.y, g.z, g.w};
    const uint32_t uw[4] = {up.x, up.y, up.z, up.w};
    float a[8];
    float m = 0.0f;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      // A token past the item's valid ones computes what its staged values and wr = 0 give; its
      // group maximum (these four lanes) and its bytes are never used.
      a[2 * i] = Act::routed(bf16_lo(gw[i]), bf16_lo(uw[i]), wr_u, bound, p);
      a[2 * i + 1] = Act::routed(bf16_hi(gw[i]), bf16_hi(uw[i]), wr_u, bound, p);
      m = fmaxf(m, fmaxf(fabsf(a[2 * i]), fabsf(a[2 * i + 1])));  // fmaxf drops NaN
    }
    m = fmaxf(m, __shfl_xor_sync(0xFFFFFFFFu, m, 1));
    m = fmaxf(m, __shfl_xor_sync(0xFFFFFFFFu, m, 2));
    const int byte = requant_scale_byte(m);
    const float mult = exp2i(127 - byte);  // 2^-e, e = byte - 127
    uint32_t qw[2];
#pragma unroll
    for (int i = 0; i < 2; ++i)
      qw[i] = static_cast<uint32_t>(ptx::cvt_e4m3x2(__fmul_rn(a[4 * i], mult), __fmul_rn(a[4 * i + 1], mult))) |
              static_cast<uint32_t>(ptx::cvt_e4m3x2(__fmul_rn(a[4 * i + 2], mult), __fmul_rn(a[4 * i + 3], mult)))
                  << 16;
    // Only the tile's 32-channel groups below I (the layer's last tile may hold padding past it,
    // SPEC §8's sizes in multiples of 32): the others are computed and never stored, and the
    // intermediate's padding stays the workspace's zeros. (The fast mode's rebase below has no such
    // guard: its H and I are multiples of 512, every tile whole.)
    if (tok < wi.valid && grp < kGroups && ch_cta + 32 * grp < inter) {
      const int64_t row = wi.row0 + tok;
      *reinterpret_cast<uint2*>(out + row * ld + ch_cta + 32 * grp + 8 * q) = make_uint2(qw[0], qw[1]);
      if (q == 0) p.out_sf[row * n_sf + (ch_cta + 32 * grp) / 32] = static_cast<uint8_t>(byte);
    }
    if constexpr (kRebase) {  // lanes l ^ 4, l ^ 8 hold the token's other groups
      int smax = max(byte, __shfl_xor_sync(0xFFFFFFFFu, byte, 4));
      smax = max(smax, __shfl_xor_sync(0xFFFFFFFFu, smax, 8));
      const int d = smax - byte;
      const float mult = d > 149 ? 0.0f : exp2i(-d);
      uint32_t rw[2];
#pragma unroll
      for (int i = 0; i < 2; ++i)
        rw[i] = d == 0 ? qw[i]
                       : rebase_e4m3x2(qw[i] & 0xFFFFu, mult) |
                             (static_cast<uint32_t>(rebase_e4m3x2(qw[i] >> 16, mult)) << 16);
      if (tok < wi.valid) {
        const int64_t row = wi.row0 + tok;
        *reinterpret_cast<uint2*>(p.rebase_x + row * inter + ch_cta + 32 * grp + 8 * q) = make_uint2(rw[0], rw[1]);
        if (grp == 0 && q == 0) p.rebase_sf[row * (inter / 128) + wi.n_block] = static_cast<uint8_t>(smax);
      }
    }
  }
}

// The fused kernel, once every epilogue warp has written L1 item `wi` (kTokens tokens, kGroups groups
// of 32 channels: the caller's __syncwarp or barrier orders their stores before this), by one warp:
// the L1-completion counter of each of its 64-row pool blocks with rows (contract FUSED_BLOCK_M)
// counts the tile's groups (those below I in the layer's last tile), as the swap-AB epilogue counts
// them; an item in parts (item_part) counts at its last. After a proxy fence: the L2 TMA reads what
// was written. The release is cumulative over the writes the barrier ordered.
template <int kGroups, int kTokens>
__device__ __forceinline__ void count_l1_tiles(const GemmParams& p, const WorkItem& wi, int lane) {
  constexpr int kBlocks = (kTokens + 63) / 64;
  if (lane < kBlocks && 64 * lane < wi.valid && wi.last) {
    const int64_t ch_cta = static_cast<int64_t>(wi.n_block) * (32 * kGroups);
    const int64_t below_i = (p.n_out / 2 - ch_cta) / 32;   // computed here, not held across the loop
    const int groups = below_i < kGroups ? static_cast<int>(below_i) : kGroups;
    ptx::fence_proxy_async_global();
    ptx::red_release_gpu_add(p.signal + (wi.row0 + 64 * lane) / p.arrival_block, groups);
  }
}

// D8 from the staged tile (kRows columns a token), by epilogue warp ew of kWarps, which take its
// tokens in turns of kPer: a token's 2 kRows bytes by 16-byte lanes, to its combine row.
template <int kRows, int kTokens, int kWarps>
__device__ __forceinline__ void prefill_l2_out(const GemmParams& p, const WorkItem& wi, uint32_t staging, int ew,
                                               int lane) {
  constexpr int kLanes = kRows / 8;   // a token's lanes
  constexpr int kPer = 32 / kLanes;   // tokens a step
  constexpr int kSteps = (kTokens + kPer * kWarps - 1) / (kPer * kWarps);
  constexpr int kSlots = (kSteps * kPer + 31) / 32;
  const int64_t col = static_cast<int64_t>(wi.n_block) * kRows + 8 * (lane % kLanes);
  // The combine rows of the warp's tokens and their buffers (combine_buffer: with peer_offsets, the
  // row's rank's copy), found once a token (as prefill_l1_out's routing weights) and taken by
  // shuffle. Found once a step, the peer offset's load was a round trip a step behind each store
  // (the L2 items' epilogue ~26 us at gpt-oss T = 4096, NOTES v46). Plain loads, as in l2_epilogue
  // (the fused kernel's dispatch writes dst_rows).
  auto token_of = [&](int u) { return ((u / kPer) * kWarps + ew) * kPer + u % kPer; };
  int rows[kSlots];
  uint64_t bufs[kSlots];
#pragma unroll
  for (int i = 0; i < kSlots; ++i) {
    const int tok = token_of(32 * i + lane);
    rows[i] = tok < wi.valid ? p.dst_rows[wi.row0 + tok] : -1;
    bufs[i] = rows[i] < 0 ? 0 : reinterpret_cast<uint64_t>(combine_buffer(p, rows[i]));
  }
  // A step's tokens are one slot's (kPer divides 32): the slots in turn, so that the slot is known.
#pragma unroll
  for (int i = 0; i < kSlots; ++i) {
#pragma unroll 1
    for (int step = i * 32 / kPer; step < min(kSteps, (i + 1) * 32 / kPer); ++step) {
      if ((step * kWarps + ew) * kPer >= wi.valid) return;  // the same for the whole warp
      const int u = step * kPer + lane / kLanes;
      const int row = __shfl_sync(0xFFFFFFFFu, rows[i], u % 32);
      const uint64_t buf = static_cast<uint64_t>(__shfl_sync(0xFFFFFFFFu, static_cast<uint32_t>(bufs[i]), u % 32)) |
                           static_cast<uint64_t>(__shfl_sync(0xFFFFFFFFu, static_cast<uint32_t>(bufs[i] >> 32), u % 32))
                               << 32;
      // H's padding rows past n_out (H a multiple of 32: a lane's 8 are all in or all out).
      if (row < 0 || col >= p.n_out) continue;
      __nv_bfloat16* dst = reinterpret_cast<__nv_bfloat16*>(buf);
      const uint4 v = ptx::ld_shared_v4(prefill_staging_addr<kRows>(staging, token_of(u), lane % kLanes));
      *reinterpret_cast<uint4*>(dst + static_cast<int64_t>(row) * p.out_stride + col) = v;
    }
  }
}

}  // namespace megamoe
