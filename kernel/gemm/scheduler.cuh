// Static persistent schedule of the grouped GEMM: work items (expert, N block of weight rows,
// token block), token block innermost so that CTAs running at the same time share weight tiles in
// L2. Every role of a CTA (producer, scale warp, consumers) walks the same items.
//
// The token tile is chosen per work item, not per launch: an expert's tokens are cut into blocks
// of kMaxN, and a block with at most kSmallTile valid rows runs at that small tile. So an expert
// with 3 tokens costs an 8-token item even when another expert of the same launch has 100. Only
// two tiles per kernel: each is its own instantiation of the mainloop and epilogue, and with a
// third ptxas runs out of registers (measured: spills and serialised wgmmas).
#pragma once

#include <cstdint>

#include "../common/ptx.cuh"
#include "contract.cuh"

namespace megamoe {

struct WorkItem {
  int expert;
  int n_block;     // block of weight rows (the CTA's tile height)
  int row0;        // first pool row of the token block
  int valid;       // valid pool rows in the token block (1..kMaxN)
  int tile;        // token tile of the item: kSmallTile or kMaxN (pick_tile)
};

// The token tile of an item with `valid` rows: kSmallTile when it holds them, else kMaxN.
template <int kMaxN>
__device__ __forceinline__ int pick_tile(int valid) {
  return valid <= kSmallTile ? kSmallTile : kMaxN;
}

// Shared-memory tables of the schedule: s_prefix[E + 1] (first item of each expert) and
// s_nblk[E] (token blocks of each expert). Called by one thread before the CTA's first barrier.
template <int kMaxN>
__device__ __forceinline__ void build_schedule(const GemmParams& p, int n_row_blocks, int* s_prefix, int* s_nblk) {
  int acc = 0;
  for (int e = 0; e < p.num_experts; ++e) {
    const int nb = (__ldg(p.num_tokens + e) + kMaxN - 1) / kMaxN;
    s_prefix[e] = acc;
    s_nblk[e] = nb;
    acc += nb * n_row_blocks;
  }
  s_prefix[p.num_experts] = acc;
}

template <int kMaxN>
__device__ __forceinline__ WorkItem decode_item(int item, const int* s_prefix, const int* s_nblk, const GemmParams& p) {
  // Binary search for the expert whose item range holds `item`.
  int lo = 0, hi = p.num_experts - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) >> 1;
    if (s_prefix[mid] <= item)
      lo = mid;
    else
      hi = mid - 1;
  }
  WorkItem w;
  w.expert = lo;
  const int local = item - s_prefix[lo];
  const int nb = s_nblk[lo];
  w.n_block = local / nb;
  const int tb = local - w.n_block * nb;
  w.row0 = __ldg(p.expert_offsets + lo) + tb * kMaxN;
  w.valid = min(kMaxN, __ldg(p.num_tokens + lo) - tb * kMaxN);
  w.tile = pick_tile<kMaxN>(w.valid);
  return w;
}

// Fused kernel: wait until every pool block under the token block has all its rows (counters count
// the valid rows of each pool block; blocks start at expert starts). Standalone launches pass no
// counters. Ends with a proxy fence: the rows were written by other CTAs' generic stores and are
// read next by TMA.
__device__ __forceinline__ void wait_token_block(const GemmParams& p, const WorkItem& wi) {
  if (p.arrival == nullptr) return;
  const int blk = p.arrival_block;
  const int end = __ldg(p.expert_offsets + wi.expert) + __ldg(p.num_tokens + wi.expert);
  for (int b = wi.row0 / blk; b <= (wi.row0 + wi.valid - 1) / blk; ++b) {
    const int need = min(blk, end - b * blk);
    const long long start = clock64();
    while (ptx::ld_acquire_gpu(p.arrival + b) < need) {
      if (clock64() - start > ptx::kSpinTimeoutCycles)
        ptx::report_trap(p.err, kWaitArrival, b, need, ptx::ld_acquire_gpu(p.arrival + b));
    }
  }
  ptx::fence_proxy_async_global();
}

}  // namespace megamoe
