// The consumer mainloop of one work item: one warpgroup's 64 weight rows x the item's token tile N,
// over all K blocks, scheduled so that the tensor core has this warpgroup's (or the other
// warpgroup's) next wgmma group while the warps promote, release and decode.
//
// Work is cut into wgmma groups. In the fast mode (promotion k128) a group is one N-chunk (cw =
// min(N, 64) tokens) of one K block: its four k32 wgmmas accumulate in the tensor core and the
// group is promoted once, so a K block has G = C groups, C = N / cw. Two schedules, by the
// registers the tile leaves:
//   pipelined (tiles up to 128): groups are issued in order into two temporaries (tmp[q % 2]);
//     the decoded A fragments of two K blocks are held (a[kb % 2]).
//     Step q retires group q - 2 (wait until only group q - 1 is in flight, wgmma.wait_group 1;
//     promote tmp[q % 2], one FFMA per accumulator; after the last group of a K block release its
//     stage, one empty-barrier arrival per thread) and issues group q. The A fragments of K block
//     kb + 1 are decoded right before kb + 1's issue (G = 1), or at group 1 of kb, after its
//     issue, while groups (kb, 0) and (kb, 1) run (the 128-token tile). The only wait<0> is the
//     item's last.
//   serial (one temporary and one A buffer, as the registers leave): each group is issued, waited
//     for and promoted before the next, while the other warpgroups' groups keep the tensor core
//     busy; K block kb + 1 is decoded after kb's last group. Two users:
//     the wide tile (256, two warpgroups; 128 accumulators): a group is a pair of chunks
//       (m64n128k32); the item's rows fill `tile / 64` of the C chunks and only the pairs that
//       hold them are computed;
//     the four-warpgroup tiles 16 .. 64 (104 registers a thread): one group per K block, as wide
//       as the item's tile (8, 16, 32 or 64 tokens: pick_tile), so one mainloop serves every item
//       (a second instantiation beside it made ptxas serialise the wgmmas, C7512).
// The fast mode loads a group's token scales before waiting for it (the wide tile: 8 of them, a
// quarter of its pair, as registers allow), so their shared-memory latency hides under the wait
// (after it, every promotion FFMA waited for them: the loop's largest stall, ncu).
// In the exact mode (k32: tiles 8 .. 64, one chunk) every k32 step is promoted with its weight rows'
// and tokens' scales, in schedules of its own: mainloop_k32 (every k32 step a group) and, in kernels
// whose tiles are all 8 or 16 tokens, mainloop_k32_narrow (a K block's four steps one group); the
// fused narrow engine's items of at most two tokens run mainloop_k32_steps (its four steps
// accumulated into one m64n8 group over step-major token columns).
#pragma once

#include <cstdint>
#include <type_traits>

#include "../common/ptx.cuh"
#include "../common/ue8m0.cuh"
#include "contract.cuh"
#include "fp4_decode.cuh"
#include "producer.cuh"
#include "promotion.cuh"
#include "wgmma_fp8_rs.cuh"

namespace megamoe {

// The first W elements of an array, as an array (the whole array itself when W == M).
template <int W, typename T, int M>
__device__ __forceinline__ auto prefix(T (&a)[M]) -> T (&)[W] {
  static_assert(W <= M, "prefix");
  if constexpr (W == M)
    return a;
  else
    return *reinterpret_cast<T(*)[W]>(a);
}

template <int I, int End, typename F>
__device__ __forceinline__ void static_for(F&& f) {
  if constexpr (I < End) {
    f(std::integral_constant<int, I>{});
    static_for<I + 1, End>(f);
  }
}

// Everything a consumer thread needs about the CTA's shared memory and its own place in the tile.
template <int kMaxN, int kRows, int kStages, bool kPerK32>
struct ConsumerCtx {
  using Ring = StageRing<kMaxN, kRows, kPerK32>;
  Ring ring;
  const uint8_t* lut;   // the fast mode's scaled tables (kLutEntries x 8 bytes)
  const GemmParams* p;
  int rg;               // the warp's 16-row group in the CTA tile
  int row_a;            // the thread's rows: row_a and row_a + 8 of the CTA tile (consumer_row_a)
  int lane;
  int t;                // lane % 4: the thread's token columns 8j + 2t + h (mainloop_k32_steps: its k32 step)
};

// The first of the two weight rows of the CTA tile that consumer thread `ctid` (128 .. : the
// consumer warpgroups follow the producer's) holds in every accumulator fragment: its warp's
// 16-row group times 16, plus its lane's g = lane / 4 (the other is that + 8).
__device__ __forceinline__ int consumer_row_a(int ctid) {
  return (ctid - 128) / 32 * 16 + ctid % 32 / 4;
}

// The exact mode's schedule (promotion k32; tiles 8 .. 64, one chunk): every k32 step is a wgmma
// group of its own, issued into two temporaries (tmp[s % 2]: four steps a K block, so every K
// block's steps take the same temporaries) and retired two steps later. Step s of K block kb
// retires group (kb, s - 2) (for s < 2: (kb - 1, s + 2), and after (kb - 1, 3) it releases that
// K block's stage), then issues (kb, s). The A fragments of two K blocks are held (a[kb % 2]); K
// block kb + 1 is decoded at step 1 of kb, after its issue, while (kb, 0) and (kb, 1) run.
// The loop body is two K blocks, so that every buffer index is a compile-time one, and the loop
// leaves after either of them (an odd count: the K tail of sizes in multiples of 32). Its only
// branches are uniform: the first K block's two retires, the wait for a next K block, the exits,
// and at 32 tokens and more the promotions' (k_nonzero, below) and the whole decode of a next K
// block. At 8 and 16 tokens the decode runs after the last K block too, from that block's stage
// (still held; its values unused), so that it shares a basic block with the steps after it and
// ptxas interleaves its loads and table lookups with them (at 32 and 64 tokens that spilled 3.6 KB
// in the fused kernel). The last two groups are retired after the loop, from the buffer it left
// in. (Before, every step of a loop over two K blocks was guarded by its index, 8-10 instructions
// a step. Instructions a K block and consumer warp, bench.sass_stage, at 8 tokens: 251.5, this
// loop 215, with ue8m0_byte_to_float's promotion scales 201.5, with lut_lo below 187.5, with the
// decode out of its branch 188; at 64 tokens 502.5 -> 428.5.)
template <int N, int kMaxN, int kRows, int kStages>
__device__ __forceinline__ void mainloop_k32(const ConsumerCtx<kMaxN, kRows, kStages, true>& ctx, RingCursor& cur,
                                             int num_kb, float (&acc)[N / 2]) {
  using Ring = StageRing<kMaxN, kRows, true>;
  static_assert(N <= kChunkN && N % 8 == 0, "the exact mode's tiles are one chunk");
  uint32_t a[2][4][4];   // decoded A fragments of two K blocks
  float tmp[2][N / 2];   // products of the two groups in flight
  int bstage[2];         // ring stage of the K block in each buffer
  uint32_t xdesc[2];     // low descriptor word of that stage's activation tile
  uint32_t wsf_a[2], wsf_b[2];   // its scale bytes of rows row_a / row_a + 8
#pragma unroll
  for (int i = 0; i < N / 2; ++i) acc[i] = 0.0f;
  // The decode table's low word, as a value ptxas cannot prove constant (row_a < 256, so the or adds
  // nothing): kept as a constant, it lived in a uniform register and every PRMT took a copy of it
  // into a vector register first (16 instructions a K block, 8 % of the loop).
  const uint32_t lut_lo = kFp4LutLo | static_cast<uint32_t>(ctx.row_a) >> 30;

  // K block (the next stage in ring order) into buffer b: wait for it, take the rows' scale words
  // and the stage's descriptor word (the same for every thread: broadcast, so that it lives in a
  // uniform register next to the wgmma), decode its four k32 steps. With `more` false there is no
  // next K block: the same from the other buffer's stage, without the wait or the ring's advance.
  auto decode = [&](auto b_c, bool more) {
    constexpr int b = decltype(b_c)::value;
    if (more) ptx::mbar_wait(&ctx.ring.full[cur.stage], cur.phase, kWaitFull, cur.stage, ctx.p->err);
    const int st = more ? cur.stage : bstage[1 - b];
    bstage[b] = st;
    const uint8_t* wsf = ctx.ring.wsf + st * Ring::kWsf;
    wsf_a[b] = *reinterpret_cast<const uint32_t*>(wsf + ctx.row_a * 4);
    wsf_b[b] = *reinterpret_cast<const uint32_t*>(wsf + (ctx.row_a + 8) * 4);
    xdesc[b] = __shfl_sync(0xFFFFFFFFu, ptx::smem_desc_sw128_lo(ctx.ring.x + st * Ring::kX), 0);
    if (more) cur.advance<kStages>();
    const uint8_t* w_frag = ctx.ring.w + st * Ring::kW + ctx.rg * 1024;
    decode_stage_plain(w_frag, ctx.lane, a[b], lut_lo);
  };
  auto issue = [&](auto b_c, auto s_c) {
    constexpr int b = decltype(b_c)::value;
    constexpr int s = decltype(s_c)::value;
    ptx::wgmma_fence();
    WgmmaRS<N>::mma_overwrite(tmp[s % 2], a[b][s][0], a[b][s][1], a[b][s][2], a[b][s][3],
                              ptx::smem_desc_sw128_from_lo(xdesc[b] + s * 2));
    ptx::wgmma_commit();
  };
  // Group (K block of stage `stage`, step s) into the result, its scale words wa / wb; `last`: no
  // group after it is in flight.
  // At 32 tokens and more each promotion sits in a branch of its own, on a condition that always
  // holds but that ptxas cannot see through (K > 0: a scheduling barrier, not a check; were ptxas
  // to prove it, only the spills below would come back). In one basic block with the next issue,
  // ptxas sank the promotion past that issue and interleaved it with the next one (their products
  // live together): 120 bytes of spills in the standalone 64-token kernel, 1 KB in the fused one.
  // (A branch around the wait too leaves a path where a temporary is overwritten in flight, and
  // ptxas serialised the whole pipeline: C7511.)
  const bool k_nonzero = ctx.p->k != 0;
  auto retire_at = [&](auto s_c, int stage, uint32_t wa, uint32_t wb, bool last) {
    constexpr int s = decltype(s_c)::value;
    if (last)
      ptx::wgmma_wait<0>();
    else
      ptx::wgmma_wait<1>();
    // The scales after the wait: the fused kernel's consumers, which hold both layers' loops, have
    // no registers for them across it (292 bytes of spills).
    float sx[N / 4];
    load_token_scales<N>(ctx.ring.sx + stage * Ring::kSxWords + s * kMaxN, ctx.t, sx);
#pragma unroll
    for (int i = 0; i < N / 2; ++i) ptx::fence_operand(tmp[s % 2][i]);
    if (N < 32 || k_nonzero)
      promote_k32<N>(acc, tmp[s % 2], sx, ue8m0_byte_to_float(wa, s), ue8m0_byte_to_float(wb, s));
    // Pin the FMAs before the next wgmma issue: otherwise the compiler may sink them past it, keep
    // a copy of the in-flight accumulators, and ptxas serialises the wgmmas (C7514).
#pragma unroll
    for (int i = 0; i < N / 2; ++i) ptx::fence_operand(acc[i]);
  };
  auto retire = [&](auto b_c, auto s_c) {
    constexpr int b = decltype(b_c)::value;
    retire_at(s_c, bstage[b], wsf_a[b], wsf_b[b], false);
    if constexpr (decltype(s_c)::value == 3) ptx::mbar_arrive(&ctx.ring.empty[bstage[b]]);   // (producer.cuh)
  };
  using B0 = std::integral_constant<int, 0>;
  using B1 = std::integral_constant<int, 1>;
  using S0 = std::integral_constant<int, 0>;
  using S1 = std::integral_constant<int, 1>;
  using S2 = std::integral_constant<int, 2>;
  using S3 = std::integral_constant<int, 3>;

  // K block kb in buffer b (the other buffer holds kb - 1, and takes kb + 1).
  auto block = [&](auto b_c, int kb) {
    constexpr int b = decltype(b_c)::value;
    using O = std::integral_constant<int, 1 - b>;
    if (b == 1 || kb > 0) retire(O{}, S2{});
    issue(b_c, S0{});
    if (b == 1 || kb > 0) retire(O{}, S3{});
    issue(b_c, S1{});
    if constexpr (N < 32)
      decode(O{}, kb + 1 < num_kb);
    else if (kb + 1 < num_kb)
      decode(O{}, true);
    retire(b_c, S0{});
    issue(b_c, S2{});
    retire(b_c, S1{});
    issue(b_c, S3{});
  };
  decode(B0{}, true);
  int kb = 0;
  for (;; kb += 2) {
    block(B0{}, kb);
    if (kb + 1 == num_kb) break;
    block(B1{}, kb + 1);
    if (kb + 2 == num_kb) break;
  }
  // The last K block's steps 2 and 3: in buffer 0 after an exit at an odd count, else buffer 1.
  const bool odd = num_kb % 2 == 1;
  const int st = odd ? bstage[0] : bstage[1];
  const uint32_t wa = odd ? wsf_a[0] : wsf_a[1];
  const uint32_t wb = odd ? wsf_b[0] : wsf_b[1];
  retire_at(S2{}, st, wa, wb, false);
  retire_at(S3{}, st, wa, wb, true);
  ptx::mbar_arrive(&ctx.ring.empty[st]);
}

// The narrow loops' next K block: wait for the ring's next stage, note it (bstage), and take the
// thread's rows' scale words from it (rows row_a and row_a + 8); returns the stage.
template <typename Ctx>
__device__ __forceinline__ int take_stage(const Ctx& ctx, const RingCursor& cur, int& bstage, uint32_t& wsf_a,
                                          uint32_t& wsf_b) {
  ptx::mbar_wait(&ctx.ring.full[cur.stage], cur.phase, kWaitFull, cur.stage, ctx.p->err);
  const int st = cur.stage;
  bstage = st;
  const uint8_t* wsf = ctx.ring.wsf + st * Ctx::Ring::kWsf;
  wsf_a = *reinterpret_cast<const uint32_t*>(wsf + ctx.row_a * 4);
  wsf_b = *reinterpret_cast<const uint32_t*>(wsf + (ctx.row_a + 8) * 4);
  return st;
}

// The narrow loops' driver (mainloop_k32_narrow, mainloop_k32_steps): K block kb into buffer kb % 2,
// start(b) waiting for its stage and issuing its group, finish(b, pending) promoting it with
// `pending` groups (the next block's) still in flight. The loop body is two K blocks, so that every
// buffer index is a compile-time one; it leaves after either (an odd count: the K tail of sizes in
// multiples of 32), and the last K block is in buffer 0 after an exit at an odd count, else 1.
template <typename Start, typename Finish>
__device__ __forceinline__ void two_buffer_loop(int num_kb, Start& start, Finish& finish) {
  using B0 = std::integral_constant<int, 0>;
  using B1 = std::integral_constant<int, 1>;
  using P0 = std::integral_constant<int, 0>;
  using P1 = std::integral_constant<int, 1>;
  start(B0{});
  int kb = 1;
  for (;; kb += 2) {
    if (kb == num_kb) break;
    start(B1{});
    finish(B0{}, P1{});
    if (kb + 1 == num_kb) break;
    start(B0{});
    finish(B1{}, P1{});
  }
  if (kb == num_kb)
    finish(B0{}, P0{});
  else
    finish(B1{}, P0{});
}

// The exact mode's schedule at 8 and 16 tokens (mainloop_k32 above: the wider tiles). A K block's
// four k32 steps are issued back to back into four temporaries of their own, as one wgmma group,
// and the block is retired (wait_group 1, its four products promoted in order, its stage released)
// only after the next K block is decoded and issued: a K block's wgmmas run while the warp decodes
// the next one and promotes the previous one, where in mainloop_k32 each k32 step's wgmma was waited
// for two steps after its issue (four wgmma waits a K block per warp, each on a group just
// issued: at 8 tokens a tensor-core latency per two steps, far under the tensor rate). Two
// buffers (a[kb % 2], tmp[kb % 2]: 32 + 4 N registers); K block kb + 1 is decoded into the buffer
// of kb - 1 once kb - 1 is retired. Promotions per accumulator in k order, with the same scales:
// the same bits as mainloop_k32.
template <int N, int kMaxN, int kRows, int kStages>
__device__ __forceinline__ void mainloop_k32_narrow(const ConsumerCtx<kMaxN, kRows, kStages, true>& ctx,
                                                    RingCursor& cur, int num_kb, float (&acc)[N / 2]) {
  using Ring = StageRing<kMaxN, kRows, true>;
  static_assert(N <= 16 && N % 8 == 0, "the narrow tiles");
  uint32_t a[2][4][4];      // decoded A fragments of two K blocks
  float tmp[2][4][N / 2];   // their products, one temporary per k32 step
  int bstage[2];            // ring stage of the K block in each buffer
  uint32_t wsf_a[2], wsf_b[2];   // its scale bytes of rows row_a / row_a + 8
#pragma unroll
  for (int i = 0; i < N / 2; ++i) acc[i] = 0.0f;
  const uint32_t lut_lo = kFp4LutLo | static_cast<uint32_t>(ctx.row_a) >> 30;   // (mainloop_k32 says why)

  // The next K block of the ring into buffer b: wait for its stage, take the rows' scale words,
  // decode its four k32 steps and issue them (one group).
  auto start = [&](auto b_c) {
    constexpr int b = decltype(b_c)::value;
    const int st = take_stage(ctx, cur, bstage[b], wsf_a[b], wsf_b[b]);
    // The same for every thread: broadcast, so that it lives in a uniform register next to the wgmma.
    const uint32_t xdesc = __shfl_sync(0xFFFFFFFFu, ptx::smem_desc_sw128_lo(ctx.ring.x + st * Ring::kX), 0);
    cur.advance<kStages>();
    decode_stage_plain(ctx.ring.w + st * Ring::kW + ctx.rg * 1024, ctx.lane, a[b], lut_lo);
    ptx::wgmma_fence();
    static_for<0, 4>([&](auto s_c) {
      constexpr int s = decltype(s_c)::value;
      WgmmaRS<N>::mma_overwrite(tmp[b][s], a[b][s][0], a[b][s][1], a[b][s][2], a[b][s][3],
                                ptx::smem_desc_sw128_from_lo(xdesc + s * 2));
    });
    ptx::wgmma_commit();
  };
  // The K block in buffer b into the result, `pending` groups (the next block's) left in flight.
  // Its token scales are loaded before the wait, so that their latency hides under it.
  auto finish = [&](auto b_c, auto pending_c) {
    constexpr int b = decltype(b_c)::value;
    float sx[4][N / 4];
    static_for<0, 4>([&](auto s_c) {
      constexpr int s = decltype(s_c)::value;
      load_token_scales<N>(ctx.ring.sx + bstage[b] * Ring::kSxWords + s * kMaxN, ctx.t, sx[s]);
    });
    ptx::wgmma_wait<decltype(pending_c)::value>();
    static_for<0, 4>([&](auto s_c) {
      constexpr int s = decltype(s_c)::value;
#pragma unroll
      for (int i = 0; i < N / 2; ++i) ptx::fence_operand(tmp[b][s][i]);
      promote_k32<N>(acc, tmp[b][s], sx[s], ue8m0_byte_to_float(wsf_a[b], s), ue8m0_byte_to_float(wsf_b[b], s));
    });
    // Pin the FMAs before the next wgmma issue (mainloop_k32 says why).
#pragma unroll
    for (int i = 0; i < N / 2; ++i) ptx::fence_operand(acc[i]);
    ptx::mbar_arrive(&ctx.ring.empty[bstage[b]]);   // every thread: its own reads (producer.cuh)
  };
  two_buffer_loop(num_kb, start, finish);
}

// The fused narrow engine's items of at most two tokens (scheduler.cuh step_part; any other part
// runs mainloop_k32_narrow over the TMA's token tile), in step-major token columns (its ring's step
// tiles: producer.cuh StageRing::step_tile, built by the scale warp). A K block's four wgmmas, one
// per k32 step s, read step tile s, whose only nonzero columns are 2s and 2s + 1 (tokens 0 and 1 of
// the part): accumulated into one m64n8 group, column 2s + j holds step s's product of token j
// (steps other than s add products of zeros, which leave it as it is: bench.step_columns checks that
// on the GPU). So thread t holds step t of both tokens, rows g and g + 8 (element 2r + h: row g + 8r,
// token h), and promotes 4 products a K block with its step's scales, where mainloop_k32_narrow's
// thread promotes 16 (its tokens 2t, 2t + 1 of every step; of two valid tokens, only t = 0's are
// real). Each thread sums its step's promoted products over K; after the loop the four steps' sums
// are added (t ^ 1, then t ^ 2: for t = 0, (s0 + s1) + (s2 + s3)) and left in thread t = 0's
// fragment, tokens 0 and 1 in mainloop_k32_narrow's layout (the other threads' tokens 2-7: zero).
// The order of the sum differs from mainloop_k32_narrow's (one k32 step after the other): D5 is
// checked against the fp64 bound (SPEC §4), and exactly on grid-snapped inputs, where every order
// gives the same bits. The pipeline is mainloop_k32_narrow's: one K block's group in flight while
// the next is decoded and issued.
template <int N, int kMaxN, int kRows, int kStages>
__device__ __forceinline__ void mainloop_k32_steps(const ConsumerCtx<kMaxN, kRows, kStages, true>& ctx, RingCursor& cur,
                                                   int num_kb, float (&acc)[N / 2]) {
  using Ring = StageRing<kMaxN, kRows, true>;
  static_assert(N == 8 && Ring::kSteps, "the step-major columns of the 8-wide narrow tile");
  uint32_t a[2][4][4];   // decoded A fragments of two K blocks
  float tmp[2][4];       // their products: one group a K block
  int bstage[2];
  uint32_t wsf_a[2], wsf_b[2];
#pragma unroll
  for (int i = 0; i < 4; ++i) acc[i] = 0.0f;
  const uint32_t lut_lo = kFp4LutLo | static_cast<uint32_t>(ctx.row_a) >> 30;   // (mainloop_k32 says why)
  // The step tiles' descriptors (no swizzle): the two core matrices 128 bytes apart along K, one
  // 8-row group (its stride unused). Tile s's low word is tile 0's plus s kStepTile / 16 (no carry
  // out of the address field).
  auto step_desc = [&](uint32_t lo0, int s) {
    return ptx::smem_desc_none_from_lo(lo0 + s * (Ring::kStepTile >> 4), 256);
  };
  auto start = [&](auto b_c) {
    constexpr int b = decltype(b_c)::value;
    const int st = take_stage(ctx, cur, bstage[b], wsf_a[b], wsf_b[b]);
    // The same for every thread: broadcast, so that it lives in a uniform register next to the wgmma.
    const uint32_t lo0 = __shfl_sync(0xFFFFFFFFu, ptx::smem_desc_none_lo(ctx.ring.step_tile(st, 0), 128), 0);
    cur.advance<kStages>();
    decode_stage_plain(ctx.ring.w + st * Ring::kW + ctx.rg * 1024, ctx.lane, a[b], lut_lo);
    ptx::wgmma_fence();
    WgmmaRS<8>::mma_overwrite(tmp[b], a[b][0][0], a[b][0][1], a[b][0][2], a[b][0][3], step_desc(lo0, 0));
    static_for<1, 4>([&](auto s_c) {
      constexpr int s = decltype(s_c)::value;
      WgmmaRS<8>::mma(tmp[b], a[b][s][0], a[b][s][1], a[b][s][2], a[b][s][3], step_desc(lo0, s), 1);
    });
    ptx::wgmma_commit();
  };
  // The K block in buffer b into the thread's step sums, `pending` groups left in flight; its token
  // scales (tokens 0 and 1 of step t) loaded before the wait.
  auto finish = [&](auto b_c, auto pending_c) {
    constexpr int b = decltype(b_c)::value;
    const float2 sx = *reinterpret_cast<const float2*>(ctx.ring.sx + bstage[b] * Ring::kSxWords + 2 * ctx.t);
    ptx::wgmma_wait<decltype(pending_c)::value>();
#pragma unroll
    for (int i = 0; i < 4; ++i) ptx::fence_operand(tmp[b][i]);
    const float swa = ue8m0_byte_to_float(wsf_a[b], ctx.t), swb = ue8m0_byte_to_float(wsf_b[b], ctx.t);
    acc[0] = promote_k32_one(acc[0], tmp[b][0], swa, sx.x);
    acc[1] = promote_k32_one(acc[1], tmp[b][1], swa, sx.y);
    acc[2] = promote_k32_one(acc[2], tmp[b][2], swb, sx.x);
    acc[3] = promote_k32_one(acc[3], tmp[b][3], swb, sx.y);
#pragma unroll
    for (int i = 0; i < 4; ++i) ptx::fence_operand(acc[i]);
    ptx::mbar_arrive(&ctx.ring.empty[bstage[b]]);   // every thread: its own reads (producer.cuh)
  };
  two_buffer_loop(num_kb, start, finish);
  // The four steps' sums, into thread t = 0's fragment.
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    acc[i] = __fadd_rn(acc[i], __shfl_xor_sync(0xFFFFFFFFu, acc[i], 1));
    acc[i] = __fadd_rn(acc[i], __shfl_xor_sync(0xFFFFFFFFu, acc[i], 2));
    if (ctx.t != 0) acc[i] = 0.0f;
  }
}

// The fast mode's schedules (above).
template <int N, int kMaxN, int kRows, int kStages>
__device__ __forceinline__ void mainloop_k128(const ConsumerCtx<kMaxN, kRows, kStages, false>& ctx, RingCursor& cur,
                                              int num_kb, int tile, float (&acc)[N / 2]) {
  using Ring = StageRing<kMaxN, kRows, false>;
  constexpr int CW = chunk_width(N);
  constexpr int C = N / CW;
  constexpr int G = C;
  // Temporaries (groups in flight): two, except where the registers leave one (the serial
  // schedule below, serial_tile): the wide tile (128 accumulators) and, with four consumer
  // warpgroups (104 registers a thread), the tiles above 8 tokens.
  constexpr int T = serial_tile(N, kRows) ? 1 : 2;
  static_assert(N % CW == 0 && CW % 8 == 0, "token tile");
  // Chunks per wgmma group: the wide tile's serial group is a pair of chunks (one m64n128k32 per
  // k32 step): twice the tensor work per issue, wait and promotion round trip of a 64-token group.
  constexpr int P = T == 1 && C >= 2 ? 2 : 1;
  constexpr int GW = P * CW;   // tokens per wgmma group
  static_assert(C % P == 0, "the serial schedule runs pairs of chunks");

  uint32_t a[2][4][4];          // decoded A fragments of two K blocks (the serial schedule: one)
  float tmp[T][GW / 2];         // products of the groups in flight
  int bstage[2];                // ring stage of the K block in each A buffer
  uint32_t xdesc[2];            // low descriptor word of that stage's activation tile (pipelined schedule)
  uint32_t wsf_a[2], wsf_b[2];  // the K block's LUT offsets of rows row_a / row_a + 8
#pragma unroll
  for (int i = 0; i < N / 2; ++i) acc[i] = 0.0f;

  // The decode of one K block's A fragments into buffer b: wait for its stage, take the rows'
  // LUT offsets, decode all four k32 steps through their scaled tables.
  auto decode = [&](auto b_c) {
    constexpr int b = decltype(b_c)::value;
    ptx::mbar_wait(&ctx.ring.full[cur.stage], cur.phase, kWaitFull, cur.stage, ctx.p->err);
    bstage[b] = cur.stage;
    const uint8_t* wsf = ctx.ring.wsf + cur.stage * Ring::kWsf;
    wsf_a[b] = *reinterpret_cast<const uint32_t*>(wsf + ctx.row_a * 4);
    wsf_b[b] = *reinterpret_cast<const uint32_t*>(wsf + (ctx.row_a + 8) * 4);
    // The descriptor of a stage is the same for every thread: computed once per warp and
    // broadcast, so it lives in uniform registers next to the wgmma.
    if constexpr (T == 2)
      xdesc[b] = __shfl_sync(0xFFFFFFFFu, ptx::smem_desc_sw128_lo(ctx.ring.x + cur.stage * Ring::kX), 0);
    cur.advance<kStages>();
    const uint8_t* w_frag = ctx.ring.w + bstage[b] * Ring::kW + ctx.rg * 1024;
    decode_stage_scaled(w_frag, ctx.lane, wsf_a[b], wsf_b[b], ctx.lut, a[b]);
  };

  // Group gi of a K block: its first chunk (the chunk, or in the serial schedule the pair of chunks
  // 2 gi, 2 gi + 1).
  auto first_chunk = [](int gi) { return P * gi; };

  // W: the tokens of the group's wgmmas: GW, or in the four-warpgroup serial kernels the item's
  // tile (8 .. 64), a prefix of the temporary.
  auto issue = [&](auto gi_c, auto tt_c, auto b_c, auto w_c) {
    constexpr int W = decltype(w_c)::value;
    float (&d)[W / 2] = prefix<W / 2>(tmp[decltype(tt_c)::value]);
    constexpr int gi = decltype(gi_c)::value;
    constexpr int tt = decltype(tt_c)::value;
    constexpr int b = decltype(b_c)::value;
    constexpr int c = first_chunk(gi);
    // Chunk c starts c * 64 token rows (c * 8 swizzle atoms) into the tile; k32 step ks 32 bytes
    // into each 128-byte row.
    // The stage's descriptor word: kept from the decode in the pipelined schedule (broadcast there,
    // so ptxas holds it in a uniform register); recomputed from the stage index in the serial one,
    // whose decode sits in a branch: the broadcast word lands in a vector register there and every
    // wgmma pays two R2UR for it (30 instructions per stage more, bench.sass_stage).
    const uint32_t stage_lo = T == 1 ? ptx::smem_desc_sw128_lo(ctx.ring.x + bstage[b] * Ring::kX) : xdesc[b];
    const uint32_t lo = stage_lo + c * (CW * kBlockK >> 4);
    ptx::wgmma_fence();
#pragma unroll
    for (int ks = 0; ks < 4; ++ks) {
      const uint64_t desc = ptx::smem_desc_sw128_from_lo(lo + ks * 2);
      if (ks == 0)
        WgmmaRS<W>::mma_overwrite(d, a[b][ks][0], a[b][ks][1], a[b][ks][2], a[b][ks][3], desc);
      else
        WgmmaRS<W>::mma(d, a[b][ks][0], a[b][ks][1], a[b][ks][2], a[b][ks][3], desc, 1);
    }
    ptx::wgmma_commit();
  };

  // Where the token scales of chunk first_chunk(gi) + h of group gi of the K block in buffer b
  // start (h: the serial schedule's second chunk of the pair); load_token_scales reads them. They
  // are loaded before the wait for the group where registers allow, so that their shared-memory
  // latency hides under it (loaded after it, every promotion FMA waited for them: measured as the
  // loop's largest stall).
  using Scales = float[CW / 4];
  auto scales_of = [&](auto gi_c, auto h_c, auto b_c) -> const float* {
    constexpr int gi = decltype(gi_c)::value;
    constexpr int c = first_chunk(gi) + decltype(h_c)::value;
    return ctx.ring.sx + bstage[decltype(b_c)::value] * Ring::kSxWords + c * CW;
  };

  // Chunk first_chunk(gi) + h of group gi's products (temporary tt) into the result; W: the
  // chunk's first W tokens (as issue's).
  auto promote = [&](auto gi_c, auto h_c, auto tt_c, const Scales& s, auto w_c) {
    constexpr int W = decltype(w_c)::value;
    constexpr int gi = decltype(gi_c)::value;
    constexpr int h = decltype(h_c)::value;
    constexpr int tt = decltype(tt_c)::value;
    constexpr int c = first_chunk(gi) + h;
    float* prod = tmp[tt] + h * (CW / 2);
#pragma unroll
    for (int i = 0; i < W / 2; ++i) ptx::fence_operand(prod[i]);
    promote_k128<W>(acc + c * (CW / 2), prod, prefix<W / 4>(s));
    // Pin the FMAs before the next wgmma issue: otherwise the compiler may sink them past it, keep
    // a copy of the in-flight accumulators, and ptxas serialises the wgmmas (C7514).
#pragma unroll
    for (int i = 0; i < W / 2; ++i) ptx::fence_operand(acc[c * (CW / 2) + i]);
  };

  auto release = [&](auto b_c) {
    constexpr int b = decltype(b_c)::value;
    ptx::mbar_arrive(&ctx.ring.empty[bstage[b]]);   // every thread: its own reads (producer.cuh)
  };

  if constexpr (T == 1) {
    // Serial schedule (one temporary; fast mode). The wide tile: each group, a pair of chunks, is
    // issued, waited for and promoted before the next; the other warpgroup's groups run in the
    // tensor core meanwhile. The item has `chunks` (1 .. C) chunks: an item is
    // charged the pairs its rows fill, not the whole tile (with an odd count, the last pair's
    // second chunk computes on shared memory the producer did not fill this time: columns nobody
    // reads). The A fragments have one buffer (128 accumulators and a 64-register temporary leave
    // no second): K block kb + 1 is decoded after kb's last group. (Groups of one chunk with the
    // decode in halves under them ran at the same speed with 24 % more instructions; bench/NOTES.md
    // v11.)
    using B0 = std::integral_constant<int, 0>;
    using H1 = std::integral_constant<int, 1>;
    using CWc = std::integral_constant<int, CW>;
    // One chunk (the four-warpgroup kernels): the group is as wide as the item's tile (W tokens),
    // its scales all loaded before the wait.
    auto group = [&](auto w_c) {
      constexpr int W = decltype(w_c)::value;
      constexpr int kVecs = W < 16 ? 1 : W / 16;
      issue(B0{}, B0{}, B0{}, w_c);
      Scales s;
      load_token_scales<CW, 0, kVecs>(scales_of(B0{}, B0{}, B0{}), ctx.t, s);
      ptx::wgmma_wait<0>();
      promote(B0{}, B0{}, B0{}, s, w_c);
    };
    // The K-block loop at one width: the width is chosen once per item.
    auto single = [&](auto w_c) {
      for (int kb = 0; kb < num_kb; ++kb) {
        group(w_c);
        release(B0{});
        if (kb + 1 < num_kb) decode(B0{});
      }
    };
    decode(B0{});
    if constexpr (P == 1) {
      static_assert(C == 1, "the serial schedule's single-chunk tile");
      if (tile <= 8)
        single(std::integral_constant<int, 8>{});
      else if (tile <= 16)
        single(std::integral_constant<int, (N < 16 ? N : 16)>{});
      else if (tile <= 32)
        single(std::integral_constant<int, (N < 32 ? N : 32)>{});
      else
        single(std::integral_constant<int, N>{});
    } else {
      const int chunks = tile / CW;
      for (int kb = 0; kb < num_kb; ++kb) {
        static_for<0, C / 2>([&](auto g_c) {
          if (decltype(g_c)::value == 0 || 2 * decltype(g_c)::value < chunks) {
            issue(g_c, B0{}, B0{}, std::integral_constant<int, GW>{});
            // Half the first chunk's scales before the wait: all of them made the L1 epilogue
            // spill (12-48 bytes; the 64-register temporary has their registers).
            Scales s;
            load_token_scales<CW, 0, CW / 32>(scales_of(g_c, B0{}, B0{}), ctx.t, s);
            ptx::wgmma_wait<0>();
            load_token_scales<CW, CW / 32>(scales_of(g_c, B0{}, B0{}), ctx.t, s);
            promote(g_c, B0{}, B0{}, s, CWc{});
            load_token_scales<CW>(scales_of(g_c, H1{}, B0{}), ctx.t, s);
            promote(g_c, H1{}, B0{}, s, CWc{});
          }
        });
        release(B0{});
        if (kb + 1 < num_kb) decode(B0{});
      }
    }
  } else {
    // Pipelined schedule (two temporaries): step q retires group q - 2 (same temporary) and issues
    // group q. The loop runs whole cycles of two K blocks (2 G steps), so every decode, issue and
    // promotion has compile-time buffer indices (unguarded, total is a multiple of 2 G: the fast
    // mode's K % 512 == 0). Its steps have no runtime branch but the first cycle's retires of
    // groups that do not exist and, at G >= 2, the decode past the last K block; the last two
    // groups are retired after the loop.
    // (Branch-free steps let ptxas schedule a step's decode loads across its promotion. The guards
    // they replace cost 6-7 instructions per stage, bench.sass_stage.) Only one group per K block
    // (G == 1: the tiles up to 64) runs so; with two (kGuarded: the 128-token tile; branch-free,
    // ptxas spilled 1.4 KB) the loop runs two steps further, each step under its guards, which also
    // bound its scheduling.
    // (A prologue that issued wgmmas would make ptxas give the loop's A fragments registers of
    // their own.)
    constexpr bool kGuarded = G >= 2;
    const int total = num_kb * G;
    using H0 = std::integral_constant<int, 0>;
    auto retire = [&](auto u_c, bool last) {
      constexpr int u = decltype(u_c)::value;          // position of the retiring step's group q
      constexpr int pu = (u + 2 * G - 2) % (2 * G);    // position of group q - 2
      using Gi = std::integral_constant<int, pu % G>;
      using B = std::integral_constant<int, pu / G>;
      Scales s;
      load_token_scales<CW>(scales_of(Gi{}, H0{}, B{}), ctx.t, s);
      if (last)
        ptx::wgmma_wait<0>();
      else
        ptx::wgmma_wait<1>();
      promote(Gi{}, H0{}, std::integral_constant<int, u % 2>{}, s, std::integral_constant<int, CW>{});
      if constexpr (pu % G == G - 1) release(B{});
    };
    if constexpr (G >= 2) decode(std::integral_constant<int, 0>{});
    for (int q0 = 0; q0 < (kGuarded ? total + 2 : total); q0 += 2 * G) {
      static_for<0, 2 * G>([&](auto u_c) {
        constexpr int u = decltype(u_c)::value;   // position of group q = q0 + u in the cycle
        constexpr int b = u / G;
        constexpr int gi = u % G;
        const int q = q0 + u;
        if ((u >= 2 || q0 > 0) && (!kGuarded || q - 2 < total)) retire(u_c, kGuarded && q - 1 >= total);
        if (!kGuarded || q < total) {
          // A(kb) is decoded into a[kb % 2] once the groups of kb - 2 are retired: with one group
          // per K block, right before its issue; otherwise at group 1 of kb - 1, after that
          // group's issue, while two of this warpgroup's groups run.
          if constexpr (G == 1) decode(std::integral_constant<int, b>{});
          issue(std::integral_constant<int, gi>{}, std::integral_constant<int, u % 2>{},
                std::integral_constant<int, b>{}, std::integral_constant<int, GW>{});
          if constexpr (G >= 2 && gi == 1) {
            if (q < total - G) decode(std::integral_constant<int, 1 - b>{});
          }
        }
      });
    }
    if constexpr (!kGuarded) {
      retire(std::integral_constant<int, 0>{}, false);
      retire(std::integral_constant<int, 1>{}, true);
    }
  }
}

// One work item of one consumer warpgroup, in its promotion's schedule (steps: the item's step_part,
// which chooses the step-major columns where the ring has them).
template <int N, int kMaxN, int kRows, int kStages, bool kPerK32>
__device__ __forceinline__ void mainloop(const ConsumerCtx<kMaxN, kRows, kStages, kPerK32>& ctx, RingCursor& cur,
                                         int num_kb, int tile, bool steps, float (&acc)[N / 2]) {
  // The narrow schedule only in kernels whose tiles are all narrow: beside the 64-token loop (the
  // fused swap-AB engine, the 64-token kernels) it made ptxas serialise every wgmma or spill in
  // the wide loop (C7512, 80-1800 bytes, as the variants moved its register allocation).
  if constexpr (StageRing<kMaxN, kRows, kPerK32>::kSteps) {
    if (steps)
      mainloop_k32_steps<N>(ctx, cur, num_kb, acc);
    else
      mainloop_k32_narrow<N>(ctx, cur, num_kb, acc);
  } else if constexpr (kPerK32 && kMaxN <= 16) {
    mainloop_k32_narrow<N>(ctx, cur, num_kb, acc);
  } else if constexpr (kPerK32) {
    mainloop_k32<N>(ctx, cur, num_kb, acc);
  } else {
    mainloop_k128<N>(ctx, cur, num_kb, tile, acc);
  }
  // Everything is complete already (the last group waited with wait<0>); this tells ptxas so, which
  // it cannot prove across the loop's runtime branches (without it, it inserts a wait of its own
  // in the epilogue's divergent code and serialises the wgmmas: C7518).
  ptx::wgmma_wait<0>();
}

}  // namespace megamoe
