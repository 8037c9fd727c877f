// PTX helpers for SM90 (sm_90a): mbarriers, bulk / tensor copies (TMA), wgmma plumbing, fences,
// named barriers and bounded spin-waits. Everything here is a thin, explicit wrapper around one
// PTX instruction so that the mainloop reads like the hardware pipeline it drives.
#pragma once

#include <cstdint>
#include <cuda.h>

#include "../gemm/contract.cuh"

namespace megamoe {
namespace ptx {

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// One byte into shared memory through its 32-bit shared-window address (a plain store through a
// pointer the compiler cannot place in shared memory becomes a 64-bit generic store).
__device__ __forceinline__ void st_shared_u8(uint32_t addr, uint32_t v) {
  asm volatile("st.shared.u8 [%0], %1;" ::"r"(addr), "r"(v) : "memory");
}
__device__ __forceinline__ void st_shared_u16(uint32_t addr, uint16_t v) {
  asm volatile("st.shared.u16 [%0], %1;" ::"r"(addr), "h"(v) : "memory");
}
// threadIdx.x, read again where it is used: a value held across setmaxnreg is spilled by ptxas, and
// the compiler would otherwise reuse one read of threadIdx.x for the whole kernel.
__device__ __forceinline__ int thread_idx() {
  int v;
  asm volatile("mov.u32 %0, %%tid.x;" : "=r"(v));
  return v;
}
// Dynamic shared memory of the launch (bytes), to check the host's size against the kernel's layout.
__device__ __forceinline__ uint32_t dynamic_smem_size() {
  uint32_t v;
  asm("mov.u32 %0, %%dynamic_smem_size;" : "=r"(v));
  return v;
}
__device__ __forceinline__ void st_shared_u32(uint32_t addr, uint32_t v) {
  asm volatile("st.shared.u32 [%0], %1;" ::"r"(addr), "r"(v) : "memory");
}
__device__ __forceinline__ uint32_t ld_shared_u32(uint32_t addr) {
  uint32_t v;
  asm volatile("ld.shared.u32 %0, [%1];" : "=r"(v) : "r"(addr) : "memory");
  return v;
}
__device__ __forceinline__ uint32_t ld_shared_u16(uint32_t addr) {
  uint16_t v;
  asm volatile("ld.shared.u16 %0, [%1];" : "=h"(v) : "r"(addr) : "memory");
  return v;
}
__device__ __forceinline__ uint4 ld_shared_v4(uint32_t addr) {
  uint4 v;
  asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "r"(addr)
               : "memory");
  return v;
}

// ---------------------------------------------------------------------------------------------
// mbarrier
// ---------------------------------------------------------------------------------------------
__device__ __forceinline__ void mbar_init(uint64_t* bar, uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_addr(bar)), "r"(count));
}

// Makes mbarrier initialisation visible to the async proxy (TMA) and the other threads.
__device__ __forceinline__ void fence_mbar_init() {
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
}

// One lane of the (converged) warp: elect.sync, no read of %tid or %laneid (an S2R whose latency
// stalled the prefill mainloop's arrive, ncu: 2 % of its stall samples).
__device__ __forceinline__ bool elect_one() {
  uint32_t elected;
  asm volatile("{\n .reg .pred p;\n elect.sync _|p, 0xffffffff;\n selp.u32 %0, 1, 0, p;\n}" : "=r"(elected));
  return elected != 0;
}

// The mbarrier helpers take a 32-bit shared-window address (the *_at forms) or a pointer into shared
// memory: a barrier indexed through a generic pointer keeps the window's base in a register.
__device__ __forceinline__ void mbar_arrive_at(uint32_t bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(bar) : "memory");
}
__device__ __forceinline__ void mbar_arrive(uint64_t* bar) {
  mbar_arrive_at(smem_addr(bar));
}

__device__ __forceinline__ void mbar_arrive_expect_tx(uint64_t* bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_addr(bar)), "r"(bytes) : "memory");
}

__device__ __forceinline__ bool mbar_try_wait_at(uint32_t bar, uint32_t parity) {
  uint32_t ok;
  asm volatile(
      "{\n"
      ".reg .pred p;\n"
      "mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
      "selp.u32 %0, 1, 0, p;\n"
      "}\n"
      : "=r"(ok)
      : "r"(bar), "r"(parity)
      : "memory");
  return ok != 0;
}
__device__ __forceinline__ bool mbar_try_wait(uint64_t* bar, uint32_t parity) {
  return mbar_try_wait_at(smem_addr(bar), parity);
}

// Spin-waits have a timeout (SPEC §5: a hung GPU is never the result of bad input). On expiry the
// waiter claims the record `rec` (report_trap: a TrapRecord, contract.cuh, in host-mapped pinned
// memory, still readable by the host after the trap), writes its fields, marks it complete and
// traps; only the first waiter to expire writes, so the record is never a mix of two. The wait
// that is the root cause when a count never comes (dispatch, arrival, predecode) expires first;
// the waits behind it wait longer, so that the record names the count that never came: the L1
// completion wait (an L2 tile's CTA can reach it before the L1 tile's CTA reaches its arrival
// wait: H200, R = 2, equal timeouts named it for a withheld arrival), then the L2 completion wait
// (a CTA without tiles enters it first), the pipeline's mbarriers last (a barrier that never
// completes is no input's doing: in the fused kernel the L2 completion wait then names it). The
// counters' waits count wall-clock time (%globaltimer), so that their seconds hold whatever the SM
// clock runs at (10 s of cycles at 2 GHz took 13.4 s to the error beside other processes). No
// printf: a call inside the consumer loop would make ptxas serialise the wgmma pipeline and save
// registers around it.
constexpr long long kCounterTimeoutNs = 10ll * 1000 * 1000 * 1000;                   // dispatch, arrival, predecode
constexpr long long kL1DoneTimeoutNs = kCounterTimeoutNs + 1500ll * 1000 * 1000;     // L1 completion
constexpr long long kLastWaitTimeoutNs = kCounterTimeoutNs + 3000ll * 1000 * 1000;   // L2 completion
constexpr long long kBarrierTimeoutCycles = 40ll * 1000 * 1000 * 1000;               // mbarriers: ~20 s at 2 GHz

__device__ __forceinline__ long long global_ns() {
  long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}
// What a record names (`what`) is one of the codes of kernel/gemm/contract.cuh (WaitKind).

constexpr long long kRecordGraceCycles = 20ll * 1000 * 1000;  // ~10 ms: the claimant writes, fences, traps

__device__ __forceinline__ void report_trap(int* rec, int what, int index, int expected, int observed) {
  if (rec != nullptr) {
    TrapRecord* r = reinterpret_cast<TrapRecord*>(rec);
    if (atomicCAS(&r->state, 0, 2) == 0) {   // 2 = claimed, being written
      r->what = what;
      r->block = blockIdx.x;
      r->index = index;
      r->expected = expected;
      r->observed = observed;
      r->thread = threadIdx.x;
      __threadfence_system();
      atomicExch(&r->state, 1);
      __threadfence_system();
    } else {
      // Another waiter claimed the record: its trap ends this thread too. Trapping at once would end
      // the kernel before the claimant's writes leave the GPU (records seen half written or lost).
      const long long start = clock64();
      while (clock64() - start < kRecordGraceCycles) __nanosleep(1024);
    }
  }
  __trap();
}

__device__ __forceinline__ void mbar_wait(uint64_t* bar, uint32_t parity, int what, int index, int* rec) {
  if (mbar_try_wait(bar, parity)) return;
  const long long start = clock64();
  while (!mbar_try_wait(bar, parity)) {
    if (clock64() - start > kBarrierTimeoutCycles) report_trap(rec, what, index, (int)parity, -1);
  }
}

// ---------------------------------------------------------------------------------------------
// Bulk copies (TMA): 1-D bulk and 2-D tensor, completing on an mbarrier with a byte count.
// ---------------------------------------------------------------------------------------------
__device__ __forceinline__ void bulk_g2s(void* smem_dst, const void* gmem_src, uint32_t bytes, uint64_t* bar) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(
                   smem_addr(smem_dst)),
               "l"(gmem_src), "r"(bytes), "r"(smem_addr(bar))
               : "memory");
}

__device__ __forceinline__ void tma_load_2d(void* smem_dst, const CUtensorMap* map, int32_t c0, int32_t c1,
                                            uint64_t* bar) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, "
      "%3}], [%4];" ::"r"(smem_addr(smem_dst)),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(c0), "r"(c1), "r"(smem_addr(bar))
      : "memory");
}

// 4-byte asynchronous global->shared copy (LDGSTS). Completed by this thread's cp_async_wait.
__device__ __forceinline__ void cp_async_4(uint32_t smem_dst, const void* gmem_src) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4;" ::"r"(smem_dst), "l"(gmem_src) : "memory");
}

// 8-byte asynchronous global->shared copy (LDGSTS). Completed by this thread's cp_async_wait.
__device__ __forceinline__ void cp_async_8(uint32_t smem_dst, const void* gmem_src) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 8;" ::"r"(smem_dst), "l"(gmem_src) : "memory");
}

// 16-byte asynchronous global->shared copy through L2 (LDGSTS.BYPASS); src_bytes = 0 writes zeros and
// reads nothing. Completed by this thread's cp_async_wait (commit groups).
__device__ __forceinline__ void cp_async_16(uint32_t smem_dst, const void* gmem_src, uint32_t src_bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(smem_dst), "l"(gmem_src), "r"(src_bytes)
               : "memory");
}

__device__ __forceinline__ void cp_async_commit() {
  asm volatile("cp.async.commit_group;" ::: "memory");
}

// Until at most N of this thread's committed groups are in flight.
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory");
}

// Arrive on an mbarrier once this thread's prior cp.async copies have landed (the arrival counts
// against the barrier's expected count: .noinc).
__device__ __forceinline__ void cp_async_mbar_arrive(uint64_t* bar) {
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];" ::"r"(smem_addr(bar)) : "memory");
}

__device__ __forceinline__ void prefetch_tma_desc(const CUtensorMap* map) {
  asm volatile("prefetch.tensormap [%0];" ::"l"(reinterpret_cast<uint64_t>(map)) : "memory");
}

// Generic-proxy writes to shared memory that the async proxy (wgmma / TMA store) reads next.
__device__ __forceinline__ void fence_proxy_async_smem() {
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
}

// ---------------------------------------------------------------------------------------------
// Named barriers (one per consumer warpgroup; id 0 is __syncthreads).
// ---------------------------------------------------------------------------------------------
__device__ __forceinline__ void named_barrier(uint32_t id, uint32_t threads) {
  asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(threads) : "memory");
}

// ---------------------------------------------------------------------------------------------
// wgmma plumbing
// ---------------------------------------------------------------------------------------------
__device__ __forceinline__ void wgmma_fence() {
  asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
}
__device__ __forceinline__ void wgmma_commit() {
  asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
}
template <int N>
__device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(N) : "memory");
}
// Keeps the compiler from moving accumulator register accesses across wgmma boundaries.
__device__ __forceinline__ void fence_operand(float& x) {
  asm volatile("" : "+f"(x)::"memory");
}
__device__ __forceinline__ void fence_operand(uint32_t& x) {
  asm volatile("" : "+r"(x)::"memory");
}

// Shared-memory matrix descriptor for a K-major operand stored with the 128-byte swizzle (the
// layout a 2-D TMA with CU_TENSOR_MAP_SWIZZLE_128B writes): rows of 128 bytes, 8-row core groups
// 1024 bytes apart (SBO), leading byte offset unused, base 1024-byte aligned. The low word holds the
// start address (>> 4, bits 0-13) and the leading byte offset (bits 16-29); the high word is the
// same for every such operand, so a mainloop keeps only low words and advances them (+2 per 32
// bytes of K: no carry out of the address field for a tile inside shared memory).
__device__ __forceinline__ uint32_t smem_desc_sw128_lo(const void* smem_ptr) {
  return ((smem_addr(smem_ptr) & 0x3FFFFu) >> 4) | (static_cast<uint32_t>(16 >> 4) << 16);
}
__device__ __forceinline__ uint64_t smem_desc_sw128_from_lo(uint32_t lo) {
  constexpr uint32_t kHi = (1024 >> 4) | (1u << 30);   // stride byte offset; layout type 1 = SWIZZLE_128B
  return (static_cast<uint64_t>(kHi) << 32) | lo;
}

// The same for a K-major operand without swizzle (layout type 0): 8-row core matrices of 16-byte
// rows (128 bytes each), `lbo` bytes between the core matrices of a row group along K (the leading
// byte offset, in the low word), `sbo` between row groups (the stride byte offset). Split as the
// 128-byte swizzle's pair, so that a loop advances the low word by 16-byte units.
__device__ __forceinline__ uint32_t smem_desc_none_lo(const void* smem_ptr, uint32_t lbo) {
  return ((smem_addr(smem_ptr) & 0x3FFFFu) >> 4) | ((lbo >> 4) << 16);
}
__device__ __forceinline__ uint64_t smem_desc_none_from_lo(uint32_t lo, uint32_t sbo) {
  return (static_cast<uint64_t>(sbo >> 4) << 32) | lo;
}

// ---------------------------------------------------------------------------------------------
// Register-count control for warp specialisation.
// ---------------------------------------------------------------------------------------------
template <uint32_t kRegs>
__device__ __forceinline__ void setmaxnreg_inc() {
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" ::"n"(kRegs));
}
template <uint32_t kRegs>
__device__ __forceinline__ void setmaxnreg_dec() {
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" ::"n"(kRegs));
}

// ---------------------------------------------------------------------------------------------
// Global-memory flags (arrival counters of the fused kernel).
// ---------------------------------------------------------------------------------------------
__device__ __forceinline__ int ld_acquire_gpu(const int* p) {
  int v;
  asm volatile("ld.acquire.gpu.global.b32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ int ld_relaxed_gpu(const int* p) {
  int v;
  asm volatile("ld.relaxed.gpu.global.b32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}
// System scope: counters that other GPUs (or other processes on this GPU) raise through symmetric
// memory (SPEC §6).
__device__ __forceinline__ int ld_acquire_sys(const int* p) {
  int v;
  asm volatile("ld.acquire.sys.global.b32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ int ld_relaxed_sys(const int* p) {
  int v;
  asm volatile("ld.relaxed.sys.global.b32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}
// One thread's fetch-and-add (atomicAdd from one active lane is warp-aggregated by the compiler:
// a vote, a shuffle and registers the 40-register producer warps do not have).
__device__ __forceinline__ int atom_relaxed_gpu_add(int* p, int v) {
  int old;
  asm volatile("atom.relaxed.gpu.global.add.s32 %0, [%1], %2;" : "=r"(old) : "l"(p), "r"(v) : "memory");
  return old;
}
__device__ __forceinline__ int atom_acq_rel_gpu_add(int* p, int v) {
  int old;
  asm volatile("atom.acq_rel.gpu.global.add.s32 %0, [%1], %2;" : "=r"(old) : "l"(p), "r"(v) : "memory");
  return old;
}
// A release RMW at gpu scope: the semantics of fence.acq_rel.gpu before a relaxed add, cumulative
// over the writes this thread observed (those of its CTA before a barrier it passed). No fence
// before it: a __threadfence() (fence.sc.gpu: MEMBAR.SC.GPU and an L1 invalidation) orders nothing
// more for a counter that publishes data, and it was the second of two membars on the exact mode's
// consumers at every L1 tile (ncu, bench/NOTES.md v37).
__device__ __forceinline__ void red_release_gpu_add(int* p, int v) {
  asm volatile("red.release.gpu.global.add.s32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}
__device__ __forceinline__ void red_release_sys_add(int* p, int v) {
  asm volatile("red.release.sys.global.add.s32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}
// Makes this thread's earlier writes, and those it observed (a CTA barrier before it), visible at
// system scope before its next write: the release half of a CTA's publication.
__device__ __forceinline__ void fence_acq_rel_sys() {
  asm volatile("fence.acq_rel.sys;" ::: "memory");
}
__device__ __forceinline__ void fence_proxy_async_global() {
  asm volatile("fence.proxy.async.global;" ::: "memory");
}

// Byte permute: d = bytes of {b:a} selected by the low 16 bits of sel (4 nibbles).
__device__ __forceinline__ uint32_t prmt(uint32_t a, uint32_t b, uint32_t sel) {
  uint32_t d;
  asm("prmt.b32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(sel));
  return d;
}

// fp32 pair -> two e4m3 bytes (RNE, saturating to +-448, NaN -> 0x7F): lo byte from lo.
__device__ __forceinline__ uint16_t cvt_e4m3x2(float lo, float hi) {
  uint16_t d;
  asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(d) : "f"(hi), "f"(lo));
  return d;
}

}  // namespace ptx
}  // namespace megamoe
