// Cross-rank plumbing of the fused kernel: pointers into a peer's workspace, and the counters that
// CTAs of every rank raise and wait on (SPEC §6: release / acquire at system scope).
#pragma once

#include <cstdint>

#include "../common/ptx.cuh"
#include "../gemm/contract.cuh"

namespace megamoe {

// Rank r's copy of a region of this rank's workspace (symmetric memory: one per-rank byte offset).
template <typename T>
__device__ __forceinline__ T* peer_ptr(const FusedParams& fp, int r, T* local) {
  return reinterpret_cast<T*>(reinterpret_cast<char*>(local) + __ldg(fp.ws_peers + r));
}

// The calls made on this workspace before this one. Read where it is needed (not held across the
// GEMM roles' setmaxnreg): it changes only when this call's last CTA leaves.
__device__ __forceinline__ int call_epoch(const FusedParams& fp) {
  return *reinterpret_cast<volatile const int*>(fp.ws_epoch);
}

// The signal words of this call: parity epoch & 1. A peer's next call uses the other parity, so a
// peer that runs ahead never adds into words this call still waits on or clears.
__device__ __forceinline__ int* call_signals(const FusedParams& fp, int epoch) {
  return &ws_signals(fp, epoch & 1, 0);
}

// One thread per CTA, after a __syncthreads that follows the CTA's writes: publish them to every
// rank by adding 1 to word `word` of each rank's signals (release at system scope; the fence makes
// the whole CTA's writes, ordered before it by the barrier, part of the release). With one rank no
// peer reads the word: a gpu-scope release, cumulative over what the barrier ordered before it,
// without the fence.acq_rel.sys (measured: bench/NOTES.md v49).
__device__ __forceinline__ void signal_all_ranks(const FusedParams& fp, int* sig, int word) {
  if (fp.num_ranks == 1) {
    ptx::red_release_gpu_add(sig + word, 1);
    return;
  }
  ptx::fence_acq_rel_sys();
  for (int r = 0; r < fp.num_ranks; ++r) ptx::red_release_sys_add(peer_ptr(fp, r, sig + word), 1);
}

// One thread per CTA: wait until `counter` reaches `need` (relaxed spin, one acquire on success),
// or record the wait and trap (SPEC §5). sys: a counter other ranks' CTAs raise too (system scope),
// else one that only this rank's raise (gpu scope). One loop for both scopes: a loop a scope, in
// the launch's registers before the roles split, made the prefill kernels spill more.
__device__ __forceinline__ void wait_counter(const int* counter, int need, bool sys, int what, int index, int* err,
                                             long long timeout_ns = ptx::kCounterTimeoutNs) {
  auto relaxed = [&] { return sys ? ptx::ld_relaxed_sys(counter) : ptx::ld_relaxed_gpu(counter); };
  if (relaxed() < need) {
    const long long start = ptx::global_ns();
    while (relaxed() < need) {
      if (ptx::global_ns() - start > timeout_ns) ptx::report_trap(err, what, index, need, relaxed());
    }
  }
  (void)(sys ? ptx::ld_acquire_sys(counter) : ptx::ld_acquire_gpu(counter));
}

// One thread per CTA: wait until every CTA of every rank raised word `word` (signal_all_ranks), at
// the scope it was raised at.
__device__ __forceinline__ void wait_all_ranks(const FusedParams& fp, const int* sig, int word, int what,
                                               long long timeout_ns = ptx::kCounterTimeoutNs) {
  wait_counter(sig + word, fp.num_ranks * static_cast<int>(gridDim.x), fp.num_ranks > 1, what, fp.rank, fp.l1.err,
               timeout_ns);
}

}  // namespace megamoe
