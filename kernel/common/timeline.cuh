// The fused kernel's timeline build: %globaltimer stamps of each CTA's phases and of its items, for
// finding where a call's time goes (bench/NOTES.md v22 did it with a build that was not kept). The build
// is megamoe/jit/build.py FusedSpec(timeline=True), which defines MEGAMOE_TIMELINE; the stamps land in the
// cubin's array megamoe_timeline (one row per CTA, its layout in contract.cuh: kTl*, kTimeline*), read back
// by megamoe/timeline.py after the call. In every other build each function here is empty and its
// arguments are plain values, so no instruction of a call is left in the release and debug kernels;
// passing the consumers' item number to run_item moved ptxas's register choice in 26 of them (the same
// instructions otherwise: bench/NOTES.md v36).
//
// Between calls only the item counts are cleared (at each CTA's entry): a module's globals start at zero,
// and a call writes its engine's phases, so a row holds the last call's stamps, and those of an earlier
// call for the phases this one skipped (the predecode's, on a layer made with predecoded=True, which
// shares the cubin): megamoe/timeline.py takes a stamp before the CTA's entry as not stamped.
#pragma once

#include <cstdint>

#include "../gemm/contract.cuh"
#include "ptx.cuh"

#ifdef MEGAMOE_TIMELINE
extern "C" {
__device__ unsigned long long megamoe_timeline[megamoe::kTimelineCtas * megamoe::kTimelineStride];
}
#endif

namespace megamoe::timeline {

// Phase `phase` of this CTA, stamped by the calling thread.
__device__ __forceinline__ void stamp(int phase) {
#ifdef MEGAMOE_TIMELINE
  if (blockIdx.x < kTimelineCtas)
    megamoe_timeline[blockIdx.x * kTimelineStride + phase] = static_cast<unsigned long long>(ptx::global_ns());
#endif
}

// Phase `phase` of this CTA, where every thread of the CTA passes: stamped by thread 0. The entry's
// also zeroes the CTA's item count (item_stamp).
__device__ __forceinline__ void cta_stamp(int phase) {
#ifdef MEGAMOE_TIMELINE
  if (threadIdx.x == 0) {
    stamp(phase);
    if (phase == kTlEntry && blockIdx.x < kTimelineCtas) megamoe_timeline[blockIdx.x * kTimelineStride + kTlPhases] = 0;
  }
#endif
}

// The TMA thread's items, in the order it takes them: the n-th item's tag and stamps, n its count so far,
// which is kept in the row (the count word, zeroed at the CTA's entry) rather than in a register: the
// producer's roles have 56 (a register count made ptxas spill the prefill engine's kernels).
#ifdef MEGAMOE_TIMELINE
__device__ __forceinline__ unsigned long long* row() {
  return megamoe_timeline + blockIdx.x * kTimelineStride;
}
// Item n's words in the row: its tag, then its stamps.
__device__ __forceinline__ unsigned long long* item_words(unsigned long long n) {
  return row() + kTlPhases + 1 + n * kTimelineItemWords;
}
#endif

// The next item: layer `layer` (1, 2), its index `index` among that layer's items.
__device__ __forceinline__ void item_take(int layer, int index) {
#ifdef MEGAMOE_TIMELINE
  if (blockIdx.x >= kTimelineCtas) return;
  const unsigned long long n = row()[kTlPhases];
  if (n < kTimelineItems) {
    unsigned long long* item = item_words(n);
    item[0] = static_cast<unsigned long long>(layer) << kTimelineItemTag | static_cast<unsigned>(index);
    item[1 + kTlItemTaken] = static_cast<unsigned long long>(ptx::global_ns());
  }
#endif
}

// Stamp `which` (kTlItem*) of the item taken last; kTlItemIssued, its last, also counts it.
__device__ __forceinline__ void item_stamp(int which) {
#ifdef MEGAMOE_TIMELINE
  if (blockIdx.x < kTimelineCtas) {
    const unsigned long long n = row()[kTlPhases];
    if (n < kTimelineItems) item_words(n)[1 + which] = ptx::global_ns();
    if (which == kTlItemIssued) row()[kTlPhases] = n + 1;
  }
#endif
}

// Stamp `which` (kTlItemComputed, kTlItemWritten) of the CTA's n-th item, by the threads of the
// roles after the TMA thread (consumers, epilogue warps) whose threadIdx.x is a multiple of `every`
// (128: each warpgroup's first, 32: each warp's first). Those roles run the items in the TMA thread's
// order and count them. Several threads stamp one word: the latest wins (an earlier call's stamp in
// it is older). Every argument is a plain value, so that in the other builds nothing is left of a
// call (ptx::thread_idx() is volatile: it is read here, in the timeline build only).
__device__ __forceinline__ void item_stamp_at(int n, int which, int every) {
#ifdef MEGAMOE_TIMELINE
  if (blockIdx.x < kTimelineCtas && n < kTimelineItems && threadIdx.x % every == 0)
    atomicMax(item_words(static_cast<unsigned long long>(n)) + 1 + which,
              static_cast<unsigned long long>(ptx::global_ns()));
#endif
}

// The prefill engine's consumers at an item's start: kTlItemReady once its first stage (the ring's
// full barrier `full` at `parity`) has landed. The timeline build waits for it here, where the
// mainloop's own wait would pass it; the other builds wait only in the mainloop.
__device__ __forceinline__ void item_stamp_ready(int n, uint64_t* full, uint32_t parity, int* err) {
#ifdef MEGAMOE_TIMELINE
  ptx::mbar_wait(full, parity, kWaitFull, -1, err);
  item_stamp_at(n, kTlItemReady, 128);
#endif
}

}  // namespace megamoe::timeline
