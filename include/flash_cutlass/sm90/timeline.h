// The Hopper forward's developer timeline, one policy type picked here: NoTimeline, whose calls
// compile to nothing (the default), or, built with FLASH_CUTLASS_TIMELINE=1, ClockTimeline: the
// first thread of the producer and of each consumer warpgroup writes clock64() at fixed points of
// every tile into a __device__ buffer of FwdTimeline's shape, which the host reads and clears after
// a call (flash_cutlass._C.forward_timeline; tools/timeline.py prints where a tile's cycles go).
// The kernel's pieces call stamp / value / next_tile on a `Timeline` and never test the macro.
#pragma once

#include <cuda_runtime_api.h>

#include "flash_cutlass/fwd_api.h"

namespace flash_cutlass::sm90 {

// A consumer warpgroup's events in a tile, in order, and the producer's (warpgroup 0), two of
// which are values rather than clocks. Events 8-15 time one steady-state step of the tile's key
// loop, the one that scores key block kProbedKeyBlockFromEnd from the end of the tile's range
// (when the warpgroup visits it as a step: the tile has that many key blocks and the warpgroup did
// not skip it or start with it); they fall between kFirstBlockDone and kLastPVLanded.
enum TimelineEvent : int {
  kTileStart = 0,          // the tile's work is known
  kQArrived = 1,           // Q has landed in shared memory
  kFirstScoresLanded = 2,  // S = Q K^T of the first key block visited
  kFirstBlockDone = 3,     // its softmax and P: the other key blocks start
  kLastPVLanded = 4,       // the tile's last P V
  kFinalized = 5,          // O scaled by 1 / l, the log-sum-exp computed
  kOStaged = 6,            // O in shared memory and the consumers synced (TMA-store epilogue only)
  kOStoreIssued = 7,       // O's TMA store issued (TMA-store epilogue only)
  kStepStart = 8,          // the probed step: before the waits for its K and V stages
  kStepStagesReady = 9,    // both stages landed
  kStepTurnTaken = 10,     // the ping-pong's turn: this warpgroup may issue
  kStepGemmsIssued = 11,   // S = Q K^T and the block before's P V issued, the turn handed over
  kStepScoresLanded = 12,  // S landed
  kStepSoftmaxDone = 13,   // the softmax (and the next stages' test) done
  kStepPVLanded = 14,      // the block before's P V landed
  kStepDone = 15,          // O rescaled if needed, P stored: the next step may start
  kLoadStart = 0,          // producer: the tile's work is known
  kFirstKStageAcquired = 1,
  kQBufferFree = 2,
  kLoadsIssued = 3,
  kKeyBlocks = 4,          // producer, a value: the key blocks the tile visits
  kQueryBlock = 5,         // producer, a value: the tile's query block
};
inline constexpr int kProbedKeyBlockFromEnd = 4;

// The default: every call is empty and inlined, so the kernels carry no trace of the timeline.
class NoTimeline {
 public:
  __device__ explicit NoTimeline(bool) {}
  __device__ void stamp(int, int) const {}
  __device__ void value(int, int, long long) const {}
  __device__ void next_tile() {}
};

#ifdef FLASH_CUTLASS_TIMELINE
namespace {  // one buffer per instantiation file, read by that file's read_fwd_timeline
__device__ unsigned long long fwd_timeline_buffer[FwdTimeline::kEntries];
}

// Where a recording thread writes: its CTA, its tile step (advanced by next_tile), a warpgroup and
// an event. CTAs and steps past FwdTimeline's shape are not recorded. The step's slots are found
// once a tile, so that a stamp is a test, a clock read and a store.
class ClockTimeline {
 public:
  __device__ explicit ClockTimeline(bool recorder) : recorder_(recorder) { find_slots(); }
  __device__ void stamp(int warpgroup, int event) const { record(warpgroup, event, clock64()); }
  __device__ void value(int warpgroup, int event, long long value) const { record(warpgroup, event, value); }
  __device__ void next_tile() {
    ++step_;
    find_slots();
  }

 private:
  __device__ void find_slots() {
    const bool recorded = recorder_ && int(blockIdx.x) < FwdTimeline::kCtas && step_ < FwdTimeline::kSteps;
    slots_ = recorded ? fwd_timeline_buffer + (int(blockIdx.x) * FwdTimeline::kSteps + step_) *
                                                  FwdTimeline::kWarpgroups * FwdTimeline::kEvents
                      : nullptr;
  }
  __device__ void record(int warpgroup, int event, long long value) const {
    if (slots_ != nullptr) slots_[warpgroup * FwdTimeline::kEvents + event] = static_cast<unsigned long long>(value);
  }
  bool recorder_;
  int step_ = 0;
  unsigned long long* slots_ = nullptr;
};

// Copies this file's buffer (the calls of its head dim since the last read) to host, then clears it.
template <int kHeadDim>
cudaError_t read_fwd_timeline(unsigned long long* host) {
  cudaError_t status = cudaMemcpyFromSymbol(host, fwd_timeline_buffer, sizeof(fwd_timeline_buffer));
  if (status != cudaSuccess) return status;
  void* device = nullptr;
  status = cudaGetSymbolAddress(&device, fwd_timeline_buffer);
  if (status != cudaSuccess) return status;
  return cudaMemset(device, 0, sizeof(fwd_timeline_buffer));
}

using Timeline = ClockTimeline;
#else
using Timeline = NoTimeline;
#endif

}  // namespace flash_cutlass::sm90
