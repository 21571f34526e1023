// The named barriers of the Hopper-path kernels and the helpers that sync, arrive and vote on them.
// Barrier 0 is __syncthreads; the ids below are the ones a kernel's roles use among themselves
// while the others run on.
#pragma once

#include <cstdint>

namespace flash_cutlass::sm90 {

enum class FwdBarrier : int {
  // The ping-pong's turns: consumer c waits on kPingPong + c (1 to 3).
  kPingPong = 1,
  // Every consumer thread, around the epilogue's shared-memory tile of O.
  kConsumers = 4,
  // bar.red.and over the 128 threads of consumer c: kWarpgroupVote + c (5 to 7).
  kWarpgroupVote = 5,
};

enum class BwdBarrier : int {
  // Every consumer thread: both warpgroups' dS^T of a query block is in shared memory.
  kDsReady = 1,
  // The consumers and the dQ warp: a query block's dQ is in shared memory (kDqFull), and the dQ
  // warp's TMA reduce-add has read it, so the next one may be written (kDqEmpty). In the head-split
  // layout the warpgroups stage their halves in turn, each with its own pair: kDqFull + 2 w and
  // kDqEmpty + 2 w for warpgroup w.
  kDqFull = 2,
  kDqEmpty = 3,
  // Every consumer thread, around the epilogue's shared-memory tiles of dK and dV (ids 4 and 5
  // are the head-split layout's second kDqFull / kDqEmpty).
  kConsumers = 6,
  // The head-split layout's warpgroup 0 (which computes S^T and P^T) has stored a query block's
  // P^T, which warpgroup 1 (which computes dP^T) reads for dS^T: 128 arrivals and 128 syncs.
  kPReady = 7,
};

// bar.sync / bar.arrive with the id (a FwdBarrier or a BwdBarrier) as an immediate.
template <auto kId, int kOffset, int kThreads>
__device__ __forceinline__ void named_barrier_sync() {
  asm volatile("bar.sync %0, %1;" ::"n"(int(kId) + kOffset), "n"(kThreads) : "memory");
}

template <auto kId, int kOffset, int kThreads>
__device__ __forceinline__ void named_barrier_arrive() {
  asm volatile("bar.arrive %0, %1;" ::"n"(int(kId) + kOffset), "n"(kThreads) : "memory");
}

// The consumer warpgroups' ping-pong (FlashAttention-3's), round robin: barrier kPingPong + c for
// consumer c, each completed by c's own 128 threads syncing and the previous consumer's 128
// arriving; consumer c hands the turn to c + 1, the last one to consumer 0. A warpgroup issues its
// GEMMs only on its turn and hands the turn over right after issuing, so the tensor cores run one
// warpgroup's GEMMs while the others compute their softmax.
constexpr int kPingPongThreads = 256;

// Two consumers: the barrier ids as immediates (a computed id costs the head-dim-256 kernel
// registers and spills). Three: computed ids (immediates behind branches spill more in the
// head-dim-64 causal kernel: 40 B instead of 8).
template <int kConsumers>
__device__ __forceinline__ void wait_for_turn(int consumer) {
  static_assert(kConsumers == 2 || kConsumers == 3);
  if constexpr (kConsumers == 2) {
    if (consumer == 0) {
      named_barrier_sync<FwdBarrier::kPingPong, 0, kPingPongThreads>();
    } else {
      named_barrier_sync<FwdBarrier::kPingPong, 1, kPingPongThreads>();
    }
  } else {
    asm volatile("bar.sync %0, %1;" ::"r"(int(FwdBarrier::kPingPong) + consumer), "n"(kPingPongThreads) : "memory");
  }
}

template <int kConsumers>
__device__ __forceinline__ void hand_over_turn(int consumer) {
  static_assert(kConsumers == 2 || kConsumers == 3);
  if constexpr (kConsumers == 2) {
    if (consumer == 0) {
      named_barrier_arrive<FwdBarrier::kPingPong, 1, kPingPongThreads>();
    } else {
      named_barrier_arrive<FwdBarrier::kPingPong, 0, kPingPongThreads>();
    }
  } else {
    const int next = consumer + 1 == kConsumers ? 0 : consumer + 1;
    asm volatile("bar.arrive %0, %1;" ::"r"(int(FwdBarrier::kPingPong) + next), "n"(kPingPongThreads) : "memory");
  }
}

// Whether `predicate` holds for every thread of consumer warpgroup `consumer` (bar.red.and over its
// 128 threads, barriers kWarpgroupVote + consumer). The ids as immediates with two consumers, as
// for the ping-pong.
template <int kConsumers>
__device__ __forceinline__ bool all_of_warpgroup(int consumer, bool predicate) {
  static_assert(kConsumers == 2 || kConsumers == 3);
  constexpr int kFirst = int(FwdBarrier::kWarpgroupVote);
  uint32_t all;
  if (kConsumers == 2 && consumer == 0) {
    asm volatile("{\n .reg .pred p, q;\n setp.ne.u32 p, %1, 0;\n bar.red.and.pred q, %2, 128, p;\n selp.u32 %0, 1, 0, q;\n}"
                 : "=r"(all) : "r"(uint32_t(predicate)), "n"(kFirst) : "memory");
  } else if (kConsumers == 2) {
    asm volatile("{\n .reg .pred p, q;\n setp.ne.u32 p, %1, 0;\n bar.red.and.pred q, %2, 128, p;\n selp.u32 %0, 1, 0, q;\n}"
                 : "=r"(all) : "r"(uint32_t(predicate)), "n"(kFirst + 1) : "memory");
  } else {
    asm volatile("{\n .reg .pred p, q;\n setp.ne.u32 p, %1, 0;\n bar.red.and.pred q, %2, 128, p;\n selp.u32 %0, 1, 0, q;\n}"
                 : "=r"(all) : "r"(uint32_t(predicate)), "r"(kFirst + consumer) : "memory");
  }
  return all != 0;
}

// Every consumer thread, around the epilogue's shared-memory tile of O.
template <int kConsumerThreads>
__device__ __forceinline__ void sync_consumers() {
  named_barrier_sync<FwdBarrier::kConsumers, 0, kConsumerThreads>();
}

}  // namespace flash_cutlass::sm90
