// The dispatch half of the fused kernel (SPEC D1-D4), run by every thread of every CTA before the
// GEMM roles split:
//   stage     (R > 1) this rank's x, x_sf and routing weights into its workspace, where the owners
//             of its experts read them;
//   count     D1 / D2 / D3: CTA b scans the routing for experts b, b + G, ... in token order, so each
//             (expert, source) list is ascending t * K + k, written into the owner's workspace with
//             the count;
//   layout    after every rank's CTAs posted: the pool layout (D4 offsets, BLOCK_M aligned) and the
//             GEMM schedule, computed by every CTA from the receive counts;
//   (local)   with one rank and at most kLocalDispatchEntries routing entries, every CTA counts every
//             expert itself instead (count_locally), and the layout follows without a dispatch counter;
//   pull      D4: one warp per routed pair copies the row, its scales, its routing weight and its
//             metadata into the pool, then adds 1 to the arrival counter of the row's pool block
//             (the L1 TMA waits on those counters).
// Pool order is deterministic: expert-major, then source rank, then t * K + k (as the reference).
// Workspace elements are addressed through the generated accessors (../gemm/contract.cuh, from
// megamoe/jit/contract.py WORKSPACE): ws_<region>_index with the sizes this code holds in registers
// (read from FusedParams again inside a loop that stores, they are loads the compiler keeps: other
// machine code) or into a peer's copy, ws_<region>(fp, ...) where it holds none.
#pragma once

#include <cstdint>

#include "../common/ptx.cuh"
#include "../common/rebase.cuh"
#include "../gemm/contract.cuh"
#include "../gemm/scheduler.cuh"
#include "sync.cuh"

namespace megamoe {

// Grid-strided copy of n 4-byte words, 16 bytes at a time where both ends are 16-byte aligned (a
// caller's row slice of topk_weights need not be).
__device__ __forceinline__ void copy_words(uint32_t* dst, const uint32_t* src, int64_t n) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t tid = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const bool vec = ((reinterpret_cast<uintptr_t>(src) | reinterpret_cast<uintptr_t>(dst)) & 15u) == 0;
  const int64_t n4 = vec ? n / 4 : 0;
  for (int64_t i = tid; i < n4; i += stride) reinterpret_cast<uint4*>(dst)[i] = reinterpret_cast<const uint4*>(src)[i];
  for (int64_t i = n4 * 4 + tid; i < n; i += stride) dst[i] = src[i];
}

// R > 1: this rank's inputs into its workspace (peers cannot read a plain allocation). x_sf's
// T * H / 32 bytes are whole words only where H is a multiple of 128: the rest byte by byte.
__device__ __forceinline__ void stage_inputs(const FusedParams& fp) {
  if (fp.num_ranks == 1) return;
  const int64_t t = fp.num_tokens;
  copy_words(reinterpret_cast<uint32_t*>(fp.ws_stage_x), reinterpret_cast<const uint32_t*>(fp.x), t * fp.hidden / 4);
  const int64_t sf_bytes = t * fp.hidden / 32;
  copy_words(reinterpret_cast<uint32_t*>(fp.ws_stage_x_sf), reinterpret_cast<const uint32_t*>(fp.x_sf), sf_bytes / 4);
  const int64_t tid = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (tid < sf_bytes % 4) fp.ws_stage_x_sf[sf_bytes / 4 * 4 + tid] = fp.x_sf[sf_bytes / 4 * 4 + tid];
  copy_words(reinterpret_cast<uint32_t*>(fp.ws_stage_weights), reinterpret_cast<const uint32_t*>(fp.topk_weights),
             t * fp.top_k);
}

// D1-D3 for the experts of this CTA. Warp w scans its own segment of consecutive entries (ceil(T K /
// warps), whole chunks of 32), a chunk a load (32 consecutive entries: coalesced), kCountAhead
// chunks in flight, and a chunk's ballot gives its hits. One scan of the block's per-warp counts
// places every warp's hits, ascending in t * K + k: lane c keeps the ballots of chunks c and 32 + c,
// so the hits of a segment's first 64 chunks are placed without reading them again (each chunk's
// at the warp's sum of the earlier chunks' counts); a longer segment's later chunks are read again.
// From the CTAs' entry to the dispatch counter at gpt-oss T = 4096: 7.4 us; a run of consecutive
// entries a thread (uncoalesced: a warp's load touched 32 lines), read twice, eight entries in
// flight: 20 us; one entry a thread a chunk, each chunk placed by two barriers: 36 us
// (bench/NOTES.md v40, v43, v45). scratch: blockDim / 32 ints of shared memory.
constexpr int kCountAhead = 16;

__device__ __forceinline__ void count_and_list(const FusedParams& fp, int* scratch) {
  const int lane = threadIdx.x % 32;
  const int warp = threadIdx.x / 32;
  const int nwarps = blockDim.x / 32;
  const int n = fp.num_tokens * fp.top_k;
  const int seg = ((n + nwarps - 1) / nwarps + 31) / 32 * 32;
  const int w0 = min(n, warp * seg);
  const int w1 = min(n, w0 + seg);
  const int chunks = (w1 - w0 + 31) / 32;
  const uint32_t below = (1u << lane) - 1;   // the lanes before this one
  for (int e = blockIdx.x; e < fp.num_experts; e += gridDim.x) {
    const int owner = e / fp.local_experts;
    const int le = e - owner * fp.local_experts;
    int* list =
        peer_ptr(fp, owner, fp.ws_source_lists) + ws_source_lists_index(le, fp.rank, 0, fp.num_ranks, fp.max_tokens);
    // Chunks c .. c + kCountAhead - 1, all loaded before any is tested; past the segment an entry
    // reads as -1, no expert.
    auto ahead = [&](int c, int64_t (&v)[kCountAhead]) {
#pragma unroll
      for (int i = 0; i < kCountAhead; ++i) {
        const int j = w0 + 32 * (c + i) + lane;
        v[i] = j < w1 ? __ldg(fp.topk_idx + j) : -1;
      }
    };
    int hits = 0;              // the warp's
    uint32_t m0 = 0, m1 = 0;   // the ballots of chunks lane and 32 + lane
    for (int c = 0; c < chunks; c += kCountAhead) {
      int64_t v[kCountAhead];
      ahead(c, v);
#pragma unroll
      for (int i = 0; i < kCountAhead; ++i) {
        const uint32_t b = __ballot_sync(0xFFFFFFFFu, v[i] == e);
        hits += __popc(b);
        if (c + i == lane) m0 = b;
        if (c + i == 32 + lane) m1 = b;
      }
    }
    if (lane == 0) scratch[warp] = hits;
    __syncthreads();
    int at = 0;   // the warp's first place in the list
    int total = 0;
    for (int w = 0; w < nwarps; ++w) {
      const int c = scratch[w];
      at += w < warp ? c : 0;
      total += c;
    }
    const int n0 = __popc(m0), n1 = __popc(m1);
    const int x0 = warp_inclusive_sum(n0) - n0;   // hits of chunks 0 .. lane - 1
    const int all0 = __shfl_sync(0xFFFFFFFFu, x0 + n0, 31);
    const int x1 = all0 + warp_inclusive_sum(n1) - n1;   // of chunks 0 .. 32 + lane - 1
    int q = at + x0;
    for (uint32_t m = m0; m != 0; m &= m - 1) list[q++] = w0 + 32 * lane + __ffs(m) - 1;   // t * K + k
    q = at + x1;
    for (uint32_t m = m1; m != 0; m &= m - 1) list[q++] = w0 + 32 * (32 + lane) + __ffs(m) - 1;
    q = at + __shfl_sync(0xFFFFFFFFu, x1 + n1, 31);   // past the first 64 chunks' hits
    for (int c = 64; c < chunks; c += kCountAhead) {   // segments of more than 64 chunks
      int64_t v[kCountAhead];
      ahead(c, v);
#pragma unroll
      for (int i = 0; i < kCountAhead; ++i) {
        const uint32_t b = __ballot_sync(0xFFFFFFFFu, v[i] == e);
        if (v[i] == e) list[q + __popc(b & below)] = w0 + 32 * (c + i) + lane;
        q += __popc(b);
      }
    }
    if (threadIdx.x == 0) {
      fp.ws_send_counts[e] = total;
      peer_ptr(fp, owner, fp.ws_recv_counts)[ws_recv_counts_index(fp.rank, le, fp.local_experts)] = total;
    }
    __syncthreads();   // scratch is rewritten by the next expert
  }
}

// Shared-memory tables of the pull, beside the GEMM schedule: for (local expert e, source s) in
// e-major order, the first pair index (pair_prefix, [E_l R + 1]) and the first pool row (row_start).
struct PullTables {
  int* pair_prefix;
  int* row_start;
};

// The dispatch of one rank with at most kLocalDispatchEntries routing entries (local_dispatch): every
// CTA counts every expert itself, where count_and_list has CTA b count experts b, b + G, ... and
// publish them, and every CTA waits on the dispatch counter before it reads them (a round of
// release, one of acquire and one of the counts' loads; `posted` at 4.2 us of gpt-oss T = 8 on the
// H200, bench/NOTES.md v47). Thread i takes routing entry i and expert i: the entry's place in its
// expert's list (the earlier entries of that expert: ascending t K + k, as count_and_list's lists)
// and the expert's count, both by one pass over the entries in shared memory. CTA 0 writes what
// count_and_list would (D1-D3's lists and counts), which nothing in this launch reads.
struct LocalDispatch {
  int* expert;   // [kLocalDispatchEntries] topk_idx of entry i (negative: none)
  int* place;    // [kLocalDispatchEntries] entry i's index in its expert's list
  int* count;    // [kMaxExperts] entries of expert e
  int* list;     // [kLocalDispatchEntries] pair j of the pull's e-major order: its entry (place_locally)
};

__device__ __forceinline__ bool local_dispatch(const FusedParams& fp) {
  return fp.num_ranks == 1 && fp.num_tokens * fp.top_k <= kLocalDispatchEntries;
}

__device__ __forceinline__ void count_locally(const FusedParams& fp, LocalDispatch d) {
  const int n = fp.num_tokens * fp.top_k;
  const int i = threadIdx.x;
  if (i < n) {
    const int64_t v = fp.topk_idx[i];
    d.expert[i] = v >= 0 && v < fp.local_experts ? static_cast<int>(v) : -1;   // as count_and_list: no list
  }
  __syncthreads();
  if (i >= n && i >= fp.num_experts) return;
  const int e = i < n ? d.expert[i] : -1;
  int place = 0, count = 0;
  for (int j = 0; j < n; ++j) {
    const int v = d.expert[j];   // the same word in every thread: a broadcast
    place += (v == e) & (j < i);
    count += v == i;
  }
  if (i < n && e >= 0) {
    d.place[i] = place;
    if (blockIdx.x == 0) fp.ws_source_lists[ws_source_lists_index(e, 0, place, 1, fp.max_tokens)] = i;
  }
  if (i < fp.num_experts) {
    d.count[i] = count;
    if (blockIdx.x == 0) {
      fp.ws_send_counts[i] = count;
      fp.ws_recv_counts[ws_recv_counts_index(0, i, fp.local_experts)] = count;
    }
  }
}

// After the layout (pair_prefix): the pull's entry of every pair, by entry.
__device__ __forceinline__ void place_locally(const FusedParams& fp, LocalDispatch d, const int* pair_prefix) {
  const int i = threadIdx.x;
  if (i < fp.num_tokens * fp.top_k) {
    const int e = d.expert[i];
    if (e >= 0) d.list[pair_prefix[e] + d.place[i]] = i;
  }
}

// After every rank posted: the pool layout from the receive counts (read with plain loads: the
// peers' writes are ordered by the CTA's acquire and the warp's barrier), or from the CTA's own
// (`local`: count_locally's, one rank). All 32 lanes of one warp,
// lane l taking local experts l, l + 32, ...: one round of memory latency per 32 experts (one
// thread reading the counts one after another took 6.6 us at 32 experts, bench/NOTES.md v22). The warp then
// builds the GEMM schedule from the layout (build_schedule).
__device__ __forceinline__ void build_layout(const FusedParams& fp, Schedule& sched, PullTables t, const int* local) {
  const int lane = threadIdx.x % 32;
  const int el = fp.local_experts;
  const int R = fp.num_ranks;
  auto received = [&](int s, int e) { return local ? local[e] : fp.ws_recv_counts[ws_recv_counts_index(s, e, el)]; };
  int rows = 0, pairs = 0;   // the pool rows and pairs of the experts of earlier rounds
  for (int e0 = 0; e0 < el; e0 += 32) {
    const int e = e0 + lane;
    const bool mine = e < el;
    int total = 0;
    for (int s = 0; s < R; ++s) total += mine ? received(s, e) : 0;
    const int padded = (total + fp.block_m - 1) / fp.block_m * fp.block_m;
    const int rows_incl = warp_inclusive_sum(padded);
    const int pairs_incl = warp_inclusive_sum(total);
    if (mine) {
      const int row = rows + rows_incl - padded;
      int pair = pairs + pairs_incl - total;
      for (int s = 0; s < R; ++s) {
        t.pair_prefix[e * R + s] = pair;
        t.row_start[e * R + s] = row + pair - (pairs + pairs_incl - total);
        pair += received(s, e);
      }
      sched.offset[e] = row;
      sched.count[e] = total;
      if (blockIdx.x == 0) {   // D2 totals and D4 offsets, for the dumps and the next stages' readers
        fp.ws_recv_totals[e] = total;
        fp.ws_expert_offsets[e] = row;
      }
    }
    rows += __shfl_sync(0xFFFFFFFFu, rows_incl, 31);
    pairs += __shfl_sync(0xFFFFFFFFu, pairs_incl, 31);
  }
  if (lane == 0) {
    t.pair_prefix[el * R] = pairs;
    if (blockIdx.x == 0) fp.ws_expert_offsets[el] = rows;
  }
}

// The pull's loads in flight a lane: kPullBatch 16-byte vectors of a row (a row of H = 7168 in two
// rounds; 16 a batch made the fast swap-AB kernel spill 1200 bytes, and T = 1 slower), and
// kPullSfWords words of the row's padded scale bytes (all of them up to H_pad = 8192).
constexpr int kPullBatch = 8;
constexpr int kPullSfWords = 2;

// Pair j of the pull's e-major (expert, source, list) order, found by a binary search over
// pair_prefix: its source rank, its pool row, and the index of its source-list entry.
struct PullPair {
  int s;
  int64_t row;
  int64_t list;
};
__device__ __forceinline__ PullPair pull_pair(const FusedParams& fp, const PullTables t, int j) {
  const int R = fp.num_ranks;
  int lo = 0, hi = fp.local_experts * R - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) >> 1;
    if (t.pair_prefix[mid] <= j)
      lo = mid;
    else
      hi = mid - 1;
  }
  const int e = lo / R;
  const int s = lo - e * R;
  const int i = j - t.pair_prefix[lo];
  return {s, t.row_start[lo] + i, ws_source_lists_index(e, s, i, R, fp.max_tokens)};
}

// Word w of a pool row's scale bytes (H_pad / 32 of them: the source's H / 32, then zero bytes,
// which L1 multiplies by zero codes). Where H is a multiple of 128 the source's words are whole;
// otherwise (SPEC §8's 2880) its rows are not word-aligned and the word is loaded byte by byte.
__device__ __forceinline__ uint32_t pull_sf_word(const uint8_t* src_sf, int w, int n_bytes, bool whole_words) {
  if (whole_words) return reinterpret_cast<const uint32_t*>(src_sf)[w];
  uint32_t word = 0;
#pragma unroll
  for (int b = 0; b < 4; ++b)
    if (4 * w + b < n_bytes) word |= static_cast<uint32_t>(src_sf[4 * w + b]) << (8 * b);
  return word;
}

// D4: warp w of the grid pulls pairs w, w + warps, ... of the e-major (expert, source, list) order.
// kRebase (the fast mode): the row is also written rebased per 128 channels (rebase_k128), L1's
// operand; the pool itself stays the canonical byte copy that D4 checks. Where H is not a multiple
// of 128 (SPEC §8; the exact mode), the pool's rows are H_pad long (contract.padded_k): the pull
// writes their padding as zero codes and zero scale bytes.
// One round of memory latency a pair: the next pair's source-list entry is loaded while this one's
// row moves, and the row's payload, scale bytes and routing weight are all loaded before any is
// stored. The warp's arrivals are added after its last pair, one release a lane: a release a pair
// (a membar that waits for the pair's stores) and the scale bytes copied one at a time after the
// payload made a pair ~5 rounds, and the pull 37 us of gpt-oss T = 4096 (bench/NOTES.md v45). The
// GEMM starts after the CTA's whole pull anyway (the caller's barrier).
// local: place_locally's entries by pair (one rank), else nullptr (the source lists).
template <bool kRebase>
__device__ __forceinline__ void pull_rows(const FusedParams& fp, const PullTables t, const int* local) {
  const int lane = threadIdx.x % 32;
  const int gwarp = (blockIdx.x * blockDim.x + threadIdx.x) / 32;
  const int nwarps = gridDim.x * blockDim.x / 32;
  const int K = fp.top_k;
  const int H = fp.hidden;
  const int H_pad = fp.hidden_pad;
  const int total = t.pair_prefix[fp.local_experts * fp.num_ranks];
  const bool whole_words = kRebase || H == H_pad;   // H / 32 scale bytes are whole words (the fast mode's H: of 512)
  auto entry_of = [&](int j) { return local ? local[j] : fp.ws_source_lists[pull_pair(fp, t, j).list]; };
  int entry_next = gwarp < total ? entry_of(gwarp) : 0;
  for (int j = gwarp; j < total; j += nwarps) {
    const PullPair pp = pull_pair(fp, t, j);
    const int entry = entry_next;
    if (j + nwarps < total) entry_next = entry_of(j + nwarps);
    const int s = pp.s;
    const int64_t row = pp.row;
    const int tok = entry / K;
    const int k = entry - tok * K;
    // The source's rows: its own inputs when it is this rank, else its staged copy (the same layout,
    // [T_max, H] and its scales, entry = t * K + k into the routing weights).
    const uint8_t* sx = s == fp.rank ? fp.x : peer_ptr(fp, s, fp.ws_stage_x);
    const uint8_t* ssf = s == fp.rank ? fp.x_sf : peer_ptr(fp, s, fp.ws_stage_x_sf);
    const float* sw = s == fp.rank ? fp.topk_weights : peer_ptr(fp, s, fp.ws_stage_weights);
    const uint4* src = reinterpret_cast<const uint4*>(sx + ws_stage_x_index(tok, 0, H));
    uint4* dst = reinterpret_cast<uint4*>(fp.ws_pool_x + ws_pool_x_index(row, 0, H_pad));
    const uint8_t* src_sf = ssf + ws_stage_x_sf_index(tok, 0, H);
    uint32_t* dst_sf = reinterpret_cast<uint32_t*>(fp.ws_pool_x_sf + ws_pool_x_sf_index(row, 0, H_pad));
    const int sf_bytes = H / 32, sf_words = H_pad / 128;
    // Loaded with the first batch, stored after it: the routing weight, the row's scale words.
    const float route = lane == 0 ? sw[entry] : 0.0f;
    uint32_t row_sf[kPullSfWords];
#pragma unroll
    for (int b = 0; b < kPullSfWords; ++b)
      if (lane + 32 * b < sf_words) row_sf[b] = pull_sf_word(src_sf, lane + 32 * b, sf_bytes, whole_words);
    // A lane loads kPullBatch vectors before it stores any: the loads of a batch are in flight
    // together. (One vector at a time, a row of 7168 bytes took 14 rounds of memory latency, 12 us:
    // the pull was the L1 gates' critical path at decode sizes, bench/NOTES.md v22.)
    const int nv = H / 16;
    for (int v0 = lane; v0 < nv; v0 += 32 * kPullBatch) {
      uint4 x[kPullBatch];
      uint32_t sf[kPullBatch];
#pragma unroll
      for (int b = 0; b < kPullBatch; ++b) {
        const int v = v0 + 32 * b;
        if (v < nv) {
          x[b] = src[v];
          if constexpr (kRebase) sf[b] = reinterpret_cast<const uint32_t*>(src_sf)[v / 8];
        }
      }
#pragma unroll
      for (int b = 0; b < kPullBatch; ++b) {
        const int v = v0 + 32 * b;
        if (v < nv) {
          dst[v] = x[b];
          if constexpr (kRebase) {  // vector v: 16 payload bytes of group v / 2, 128-block v / 8
            const uint32_t smax = max_byte4(sf[b]);
            const int d = static_cast<int>(smax - ((sf[b] >> (8 * ((v / 2) % 4))) & 0xFFu));
            reinterpret_cast<uint4*>(fp.ws_pool_x128 + ws_pool_x128_index(row, 0, H))[v] = rebase_e4m3x16(x[b], d);
            if (v % 8 == 0) fp.ws_pool_sf128[ws_pool_sf128_index(row, v / 8, H)] = static_cast<uint8_t>(smax);
          }
        }
      }
    }
    for (int v = nv + lane; v < H_pad / 16; v += 32) dst[v] = make_uint4(0, 0, 0, 0);   // the padding's codes
#pragma unroll
    for (int b = 0; b < kPullSfWords; ++b)
      if (lane + 32 * b < sf_words) dst_sf[lane + 32 * b] = row_sf[b];
    for (int w = lane + 32 * kPullSfWords; w < sf_words; w += 32)
      dst_sf[w] = pull_sf_word(src_sf, w, sf_bytes, whole_words);
    if (lane == 0) {
      fp.ws_pool_weights[row] = route;
      ws_pool_meta(fp, row, 0) = s;
      ws_pool_meta(fp, row, 1) = tok;
      ws_pool_meta(fp, row, 2) = k;
      fp.ws_dst_rows[row] = (s * K + k) * fp.max_tokens + tok;
    }
  }
  // The arrivals of the warp's pairs, lane l taking its pairs l, l + 32, ...: each lane's release
  // covers every lane's stores (the warp's barrier before it).
  __syncwarp();
  for (int j = gwarp + lane * nwarps; j < total; j += 32 * nwarps) {
    const int64_t row = pull_pair(fp, t, j).row;
    ptx::red_release_gpu_add(fp.ws_arrivals + row / fp.block_m, 1);
  }
}

}  // namespace megamoe
