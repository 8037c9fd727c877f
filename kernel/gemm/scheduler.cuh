// Persistent schedule of the grouped GEMM: work items (expert, N block of weight rows, token
// block), token block innermost so that CTAs running at the same time share weight tiles in L2.
// Every role of a CTA (producer, scale warps, consumers) walks the same items, in a static or a
// dynamic order (below, claim_item).
//
// The token tile is chosen per work item, not per launch: an expert's tokens are cut into blocks
// of kMaxN (the fused swap-AB engines: of a pool block, run in parts of kMaxN rows where wider:
// item_part), and a block with at most kSmallTile valid rows runs at that small tile. So an expert
// with 3 tokens costs an 8-token item even when another expert of the same launch has 100. Only
// two tiles per kernel: each is its own instantiation of the mainloop and epilogue, and with a
// third ptxas runs out of registers (measured: spills and serialised wgmmas). The serial kernels
// have one mainloop instead (mainloop.cuh's serial schedule): the wide kernel (kMaxN 256) charges
// an item per 64-token chunk (pick_tile: an item of r rows has ceil(r / 64) chunks), computed in
// pairs of chunks; the four-warpgroup kernels of tiles 16 .. 64 run an item of r rows as one wgmma
// group of 8, 16, 32 or 64 tokens, the smallest that holds them.
//
// The pool layout (each expert's first row and row count) is copied into shared memory once per
// CTA, before the roles split: in the fused kernel it is computed by the kernel itself, so nothing
// reads it from global memory through the read-only path.
#pragma once

#include <cstdint>

#include "../common/ptx.cuh"
#include "contract.cuh"

namespace megamoe {

struct WorkItem {
  int expert;
  int n_block;     // block of weight rows (the CTA's tile height)
  int row0;        // first pool row of the token block
  int valid;       // valid pool rows in the token block (1..kBlock; a part's: 1..kMaxN)
  int end;         // one past the expert's last valid pool row
  int tile;        // token tile of the item (pick_tile)
  bool last;       // the item's last part (item_part), which counts its L1 tiles
};

// The wgmma chunk of a token tile of n tokens: the whole tile up to kChunkN, else kChunkN. Its
// mainloop, its epilogue and the producer's scale layout cut the tile the same way.
__host__ __device__ constexpr int chunk_width(int n) {
  return n < kChunkN ? n : kChunkN;
}

// Tiles above this many tokens are wide: their kernels run every item at the largest tile's
// mainloop, charged only the 64-token chunks its rows fill (the serial schedule of mainloop.cuh).
constexpr int kWideTile = 2 * kChunkN;

// Whether a token tile of n tokens, in a CTA of `rows` weight rows, runs the serial schedule of
// mainloop.cuh (one temporary): the wide tile (its 128 accumulators), and the tiles above 8 with
// four consumer warpgroups (104 registers a thread). A kernel whose largest tile is serial runs
// every item at that one mainloop, charged what the item's rows fill: pick_tile.
__host__ __device__ constexpr bool serial_tile(int n, int rows) {
  return n > kWideTile || (rows > 2 * kRowsPerWg && n > kSmallTile);
}

// The four-warpgroup serial kernels (tiles 16 .. 64): their items are 8 .. 64 tokens wide, each in
// the largest tile's scale layout, and their registers hold nothing across the mainloop.
__host__ __device__ constexpr bool narrow_serial(int max_n, int rows) {
  return max_n <= kChunkN && serial_tile(max_n, rows);
}

// The fused narrow engine's step-major token columns (mainloop.cuh mainloop_k32_steps): an item of
// at most kStepTokens tokens (one part) runs with its wgmma's 8 columns as (k32 step s, token j),
// every part of a larger item as 8 tokens (mainloop_k32_narrow), its last one too: step columns for
// such remainders lost 2-4 us at gpt-oss T = 64 (bench/NOTES.md v51). Every role decides it alike,
// from the item's valid rows (step_part). The engine is the exact mode's 8-token tile of three warpgroups (no standalone
// kernel has that shape).
constexpr int kStepTokens = 2;
__host__ __device__ constexpr bool step_columns(int max_n, int rows, bool per_k32) {
  return per_k32 && max_n == kSmallTile && rows == 3 * kRowsPerWg;
}
__host__ __device__ constexpr bool step_part(int valid) {
  return valid <= kStepTokens;
}

// The token tile of an item with `valid` rows: kSmallTile when it holds them, else kMaxN. In a
// serial kernel, which has one mainloop: the wide tile's valid rows rounded up to whole chunks
// (its groups are pairs of chunks, computed where they hold rows); four warpgroups' rows rounded
// up to 8, 16, 32 or 64 (its group is a wgmma of that width).
template <int kMaxN, int kRows>
__device__ __forceinline__ int pick_tile(int valid) {
  if constexpr (kMaxN > kWideTile) return (valid + kChunkN - 1) / kChunkN * kChunkN;
  if constexpr (serial_tile(kMaxN, kRows)) {
    int tile = kSmallTile;
    while (tile < valid) tile *= 2;
    return tile;
  }
  return valid <= kSmallTile ? kSmallTile : kMaxN;
}

// The pool layout and the token blocks of each expert, in shared memory. One schedule serves every
// layer over the same pool: a layer with n_rb blocks of weight rows has n_rb items per token block.
struct Schedule {
  int tb_prefix[kMaxExperts + 1];  // first token block of each expert; [E] = all token blocks
  int offset[kMaxExperts];         // first pool row of each expert
  int count[kMaxExperts];          // valid pool rows of each expert
  int num_experts;

  __device__ __forceinline__ int num_items(int n_rb) const {
    return tb_prefix[num_experts] * n_rb;
  }
};

// Fills the schedule from the experts' first rows and row counts (any source: global memory for a
// standalone launch, the fused kernel's own dispatch). Called by all 32 lanes of one warp, before
// the CTA's first barrier: lane l takes experts l, l + 32, ..., all of whose loads are issued
// before the first is used (one round of memory latency for up to kMaxExperts experts, where one
// thread took a round per few experts), then the token blocks are prefix-summed with shuffles.
// The sum of v over lanes 0 .. this lane (all 32 lanes call it).
__device__ __forceinline__ int warp_inclusive_sum(int v) {
  const int lane = threadIdx.x % 32;
#pragma unroll
  for (int d = 1; d < 32; d <<= 1) {
    const int u = __shfl_up_sync(0xFFFFFFFFu, v, d);
    if (lane >= d) v += u;
  }
  return v;
}

template <int kMaxN, typename Offset, typename Count>
__device__ __forceinline__ void build_schedule(Schedule& s, int num_experts, Offset offset_of, Count count_of) {
  constexpr int kRounds = kMaxExperts / 32;
  const int lane = threadIdx.x % 32;
  int off[kRounds], n[kRounds];
#pragma unroll
  for (int r = 0; r < kRounds; ++r) {
    const int e = 32 * r + lane;
    off[r] = e < num_experts ? offset_of(e) : 0;
    n[r] = e < num_experts ? count_of(e) : 0;
  }
  int carry = 0;
#pragma unroll
  for (int r = 0; r < kRounds; ++r) {
    if (32 * r >= num_experts) break;
    const int e = 32 * r + lane;
    const int blocks = (n[r] + kMaxN - 1) / kMaxN;
    const int incl = warp_inclusive_sum(blocks);   // over the round's lanes
    if (e < num_experts) {
      s.tb_prefix[e] = carry + incl - blocks;
      s.offset[e] = off[r];
      s.count[e] = n[r];
    }
    carry += __shfl_sync(0xFFFFFFFFu, incl, 31);
  }
  if (lane == 0) {
    s.tb_prefix[num_experts] = carry;
    s.num_experts = num_experts;
  }
}

// Item `item` of a layer with n_rb blocks of weight rows: items of expert e are
// [tb_prefix[e] n_rb, tb_prefix[e + 1] n_rb), N block outer, token block inner. Token blocks of
// kBlock rows (the schedule's, build_schedule<kBlock>): the kernel's largest tile, or (the fused
// narrow engine) the pool block, run in parts of kMaxN rows (item_part).
template <int kMaxN, int kRows, int kBlock = kMaxN>
__device__ __forceinline__ WorkItem decode_item(int item, const Schedule& s, int n_rb) {
  int lo = 0, hi = s.num_experts - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) >> 1;
    if (s.tb_prefix[mid] * n_rb <= item)
      lo = mid;
    else
      hi = mid - 1;
  }
  WorkItem w;
  w.expert = lo;
  const int local = item - s.tb_prefix[lo] * n_rb;
  const int nb = s.tb_prefix[lo + 1] - s.tb_prefix[lo];
  w.n_block = local / nb;
  const int tb = local - w.n_block * nb;
  w.row0 = s.offset[lo] + tb * kBlock;
  w.valid = min(kBlock, s.count[lo] - tb * kBlock);
  w.end = s.offset[lo] + s.count[lo];
  w.tile = pick_tile<kMaxN, kRows>(kBlock == kMaxN ? w.valid : min(w.valid, kMaxN));
  w.last = true;
  return w;
}

// The parts of an item. A kernel whose token blocks are wider than its largest tile (the fused
// narrow engine: pool blocks of 64 rows, tile 8) runs an item of r rows as ceil(r / kMaxN) parts,
// each a whole pass over the item's K blocks (its weights streamed once a part) with an epilogue of
// its own; only the last part counts the item's L1 tiles, so a pool block's L1-completion count is
// the same for every engine. Every role walks the same parts. Elsewhere an item is one part.
template <int kMaxN, int kBlock>
__device__ __forceinline__ int item_parts(const WorkItem& wi) {
  if constexpr (kBlock == kMaxN)
    return 1;
  else
    return (wi.valid + kMaxN - 1) / kMaxN;
}

template <int kMaxN, int kBlock>
__device__ __forceinline__ WorkItem item_part(WorkItem wi, int j) {
  if constexpr (kBlock != kMaxN) {
    wi.last = j == item_parts<kMaxN, kBlock>(wi) - 1;
    wi.row0 += j * kMaxN;
    wi.valid = min(kMaxN, wi.valid - j * kMaxN);
  }
  return wi;
}

// The items of a launch: one layer's (a standalone GEMM), or the fused kernel's L1 items followed by
// its L2 items (kTwo), numbered [0, na) then [na, na + nb). One schedule serves both layers (the
// same pool), so an item's layer and its index there follow from the schedule alone; nothing about
// the split is held across a role's loop (the producer's roles have 40 registers).
//
// A layer's blocks of kRows weight rows: its rows are padded to whole 128-row tiles
// (megamoe/jit/layout.py padded_rows), so the blocks of the two-warpgroup kernels, and of the fast
// mode's four (its sizes are multiples of 512), are whole; the narrow engine's 192-row blocks
// (kPartial) may end in a partial block where a size is not a multiple of theirs (SPEC §8: 2880),
// whose rows past the layout are no row of it (the epilogues guard them). Its blocks are those that
// hold a row the epilogue writes (n_out): at L2 of 2880 rows the layout's 2944 would make a 16th
// block of padding rows only, an item that stores nothing.
template <int kRows, bool kPartial = false>
__host__ __device__ constexpr int row_blocks(const GemmParams& p) {
  return kPartial ? (p.n_out + kRows - 1) / kRows : p.n_rows / kRows;
}

template <int kRows, bool kPartial = false>
__device__ __forceinline__ int layer_items(const Schedule& s, const GemmParams& p) {
  return s.num_items(row_blocks<kRows, kPartial>(p));
}

template <int kRows, bool kTwo, bool kPartial = false>
__device__ __forceinline__ int launch_items(const Schedule& s, const GemmParams& pa, const GemmParams& pb) {
  return layer_items<kRows, kPartial>(s, pa) + (kTwo ? layer_items<kRows, kPartial>(s, pb) : 0);
}

// The layer of item `item` of the launch; `item` becomes its index among that layer's items.
template <int kRows, bool kTwo, bool kPartial = false>
__device__ __forceinline__ const GemmParams& item_layer(int& item, const Schedule& s, const GemmParams& pa,
                                                        const GemmParams& pb) {
  if constexpr (kTwo) {
    const int na = layer_items<kRows, kPartial>(s, pa);
    if (item >= na) {
      item -= na;
      return pb;
    }
  }
  return pa;
}

// The swap-AB and prefill kernels (standalone and fused) take their items in a dynamic order: a CTA's
// first item is blockIdx.x, each later one the next unclaimed item of a counter in global memory,
// claimed by the TMA thread while it issues the last stages of its current item. The static round
// robin (item += gridDim.x) gave a CTA its items whatever the speed of its
// earlier ones: at 8 tokens per expert an L1 item took 25-39 us by the SM (clock stamps, bench/NOTES.md
// v13b), so the CTAs ended between 88 and 130 us. The TMA thread posts each claimed item to the
// CTA's other roles (scale warps, consumers; the prefill kernel's epilogue warps too) through a small
// queue in shared memory, in order; an item index >= the launch's item count ends every role's loop.
//
// In the fused kernel the counter runs over L1 items, then L2 items (launch_items), which cannot
// deadlock: an L2 item waits only for L1 tiles, and when it is claimed every L1 item has been
// claimed before it, each by a CTA that runs it to its end (a CTA's TMA thread claims its next item
// only after its current one passed its gate, and an L1 item's gate waits only for the pull, which
// every CTA finished before its GEMM roles began). The first items (blockIdx.x) may be L2 items
// where the grid outnumbers the L1 items: those wait for L1 items that are other CTAs' first.
//
// What each role holds is set by its registers: the TMA thread and the scale warps (40 registers)
// keep their queue counts in shared memory; the consumers keep theirs in a register in place of the
// static order's item index and never wait on the queue (next_posted). Every queue address is a
// 32-bit shared-window address: a loop-invariant register of any kind (a generic base, a per-warp
// count address) held across the consumers' mainloop made ptxas spill the four-warpgroup and wide
// kernels (24-200 bytes).
// Posted and not yet taken by every role: at most ~3 in the swap-AB kernels (short items, deep ring).
// The prefill kernel's epilogue warps run up to an item behind its consumers: at items of 1-2 K
// blocks (not at a layer's K) its TMA thread then waits in post_item for them.
constexpr int kItemSlots = 4;

struct ItemQueue {
  uint64_t full[kItemSlots];    // the TMA thread's arrival: item[s] is written
  uint64_t empty[kItemSlots];   // one arrival per reading warp: item[s] is read
  int item[kItemSlots];
  int count[4];                 // items posted (warp 0, the TMA thread) or taken (warps 1 .. 3: the
                                // scale warps; the prefill kernel's scale warp and epilogue warps)
};

// The queue's bytes in shared memory, rounded to 16 (the kernels' layouts place what follows it).
constexpr int kItemQueueBytes = (static_cast<int>(sizeof(ItemQueue)) + 15) / 16 * 16;

// One thread of the CTA, before the barriers' init fence: the queue empty, each slot freed by one
// arrival of each of its `readers` warps.
__device__ __forceinline__ void init_item_queue(ItemQueue& q, int readers) {
  for (int s = 0; s < kItemSlots; ++s) {
    ptx::mbar_init(&q.full[s], 1);   // the TMA thread
    ptx::mbar_init(&q.empty[s], readers);
  }
  for (int w = 0; w < 4; ++w) q.count[w] = 0;
}

// Stages before the end of its current item at which the TMA thread claims the next one and posts
// it (at least 1: the consumers' no-wait read, next_posted, needs the post before the last stage's
// fill). The claim's round trip stalls the TMA thread once per item, while the ring holds the stages
// it filled before. A claim 4 stages ahead with the index held in a register, the round trip hidden,
// lost the Zipf routings' gain (bench/NOTES.md v19): an item claimed early is an item a faster CTA could have
// taken.
constexpr int kClaimAhead = 2;

// The TMA thread: the next item of the dynamic order.
__device__ __forceinline__ int claim_item(int* counter) {
  return static_cast<int>(gridDim.x) + ptx::atom_relaxed_gpu_add(counter, 1);
}

// The TMA thread, after its last claim: the last CTA of the launch to get here zeroes the counters
// for the next launch. Every claim of this launch is then done: a CTA counts itself here after its
// claim returned an item past the end, and the count's acq_rel chain orders every CTA's claims
// before the last one's reset.
__device__ __forceinline__ void retire_claims(int* counter) {
  if (ptx::atom_acq_rel_gpu_add(counter + 1, 1) == static_cast<int>(gridDim.x) - 1) {
    atomicExch(counter, 0);
    atomicExch(counter + 1, 0);
  }
}

// The TMA thread: its next item for the other roles (the CTA's second item is the first posted). It
// posts an item before it fills the last kClaimAhead stages of the item before it. (Its wait for a
// free slot has no timeout: the slot's readers are the consumers and scale warps, and the prefill
// kernel's epilogue warps, whose ring and staging waits have one.)
__device__ __forceinline__ void post_item(ItemQueue& q, int item) {
  const uint32_t count = ptx::smem_addr(&q.count[0]);
  const uint32_t n = ptx::ld_shared_u32(count);
  const uint32_t s = n % kItemSlots;
  while (!ptx::mbar_try_wait_at(ptx::smem_addr(&q.empty[0]) + 8 * s, ((n / kItemSlots) & 1) ^ 1)) {
  }
  ptx::st_shared_u32(ptx::smem_addr(&q.item[0]) + 4 * s, static_cast<uint32_t>(item));
  ptx::mbar_arrive_at(ptx::smem_addr(&q.full[0]) + 8 * s);
  ptx::st_shared_u32(count, n + 1);
}

// The TMA thread: the item it posted last (its slot is rewritten only by its own later posts), read
// back rather than held in a register.
__device__ __forceinline__ int last_posted(const ItemQueue& q) {
  const uint32_t n = ptx::ld_shared_u32(ptx::smem_addr(&q.count[0]));
  return static_cast<int>(ptx::ld_shared_u32(ptx::smem_addr(&q.item[0]) + 4 * ((n - 1) % kItemSlots)));
}

// One converged consumer warp, after the last stage of its current item: the n-th posted item. No
// wait: the TMA thread posted it before it filled that stage, whose full barrier the warp has passed
// (the TMA thread's arrival there releases the post, the warp's wait acquires it).
__device__ __forceinline__ int next_posted(ItemQueue& q, int n) {
  const uint32_t s = static_cast<uint32_t>(n) % kItemSlots;
  const int item = static_cast<int>(ptx::ld_shared_u32(ptx::smem_addr(&q.item[0]) + 4 * s));
  __syncwarp();
  if (ptx::elect_one()) ptx::mbar_arrive_at(ptx::smem_addr(&q.empty[0]) + 8 * s);
  return item;
}

// One converged scale warp (warp 1 .. 3 of the CTA), or one of the prefill kernel's epilogue warps
// (2, 3): its next posted item. The scale warps run ahead of the TMA thread (they wait for the
// consumers' releases only), so they wait for the post; the epilogue warps, behind the consumers,
// find it posted. (No timeout here: the TMA thread's own waits have one.)
__device__ __forceinline__ int take_item(ItemQueue& q, int warp) {
  const uint32_t count = ptx::smem_addr(&q.count[0]) + 4 * warp;
  __syncwarp();
  const uint32_t n = ptx::ld_shared_u32(count);
  const uint32_t s = n % kItemSlots;
  while (!ptx::mbar_try_wait_at(ptx::smem_addr(&q.full[0]) + 8 * s, (n / kItemSlots) & 1)) {
  }
  const int item = static_cast<int>(ptx::ld_shared_u32(ptx::smem_addr(&q.item[0]) + 4 * s));
  __syncwarp();
  if (ptx::elect_one()) {
    ptx::mbar_arrive_at(ptx::smem_addr(&q.empty[0]) + 8 * s);
    ptx::st_shared_u32(count, n + 1);
  }
  return item;
}

// Fused kernel: wait until every pool block under the token block is complete. L1 (arrival_need
// 0): the block's counter counts its pulled rows and must reach its valid rows (blocks start at
// expert starts). L2 (arrival_need > 0): the counter counts the block's finished L1 tiles and must
// reach arrival_need. Standalone launches pass no counters. One relaxed spin, then an acquire on
// success, then a proxy fence: the rows were written by other CTAs' generic stores and are read
// next by TMA.
__device__ __forceinline__ void wait_token_block(const GemmParams& p, const WorkItem& wi) {
  if (p.arrival == nullptr) return;
  const int blk = p.arrival_block;
  const int what = p.arrival_need > 0 ? kWaitL1Done : kWaitArrival;
  const long long timeout_ns = p.arrival_need > 0 ? ptx::kL1DoneTimeoutNs : ptx::kCounterTimeoutNs;
  for (int b = wi.row0 / blk; b <= (wi.row0 + wi.valid - 1) / blk; ++b) {
    const int need = p.arrival_need > 0 ? p.arrival_need : min(blk, wi.end - b * blk);
    if (ptx::ld_relaxed_gpu(p.arrival + b) < need) {
      const long long start = ptx::global_ns();
      while (ptx::ld_relaxed_gpu(p.arrival + b) < need) {
        if (ptx::global_ns() - start > timeout_ns)
          ptx::report_trap(p.err, what, b, need, ptx::ld_relaxed_gpu(p.arrival + b));
      }
    }
    (void)ptx::ld_acquire_gpu(p.arrival + b);
  }
  ptx::fence_proxy_async_global();
}

}  // namespace megamoe
