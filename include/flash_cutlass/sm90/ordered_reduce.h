// Reductions into global memory in a fixed order across CTAs, for the deterministic Hopper backward:
// the CTAs that add to one accumulator tile take turns, kept in an int32 counter in global memory
// (zeroed before the kernel). A CTA waits until the counter equals its place in the order, adds
// (with TMA's reduce-add, waiting for that reduction to complete and not only for its shared-memory
// source to be read), and passes the turn on by incrementing the counter. The CTAs of earlier
// turns are never waiting on later ones (the grid launches them first and each walks its tiles in
// one direction; rotated walks run a head's key blocks at once, each CTA taking its heads in the
// same order), so the chain cannot deadlock. With dQ's first store the first turn stores instead
// of adding. Below it, dQ's first store in calls that are not deterministic, which orders only each
// block's first arrival before the others.
#pragma once

#include "flash_cutlass/common/block_info.h"
#include "flash_cutlass/params.h"

namespace flash_cutlass::sm90 {

// Polls *counter until done(value) holds; the acquire orders the writes released before that value,
// then the proxy fence the TMA unit's (async proxy) reductions and stores among them, before this
// thread's next bulk copy. A value that never comes (a place counted wrong, a CTA the GPU never
// ran) would hang the device: past about a minute of polling the kernel traps instead, which the
// host reports as a launch failure.
template <class Done>
__device__ __forceinline__ void poll_until(const int* counter, Done&& done) {
  constexpr unsigned kMaxPolls = 1u << 26;  // of at least 1 us each (the load and the back-off)
  for (unsigned polls = 0;; ++polls) {
    int current;
    asm volatile("ld.acquire.gpu.global.b32 %0, [%1];" : "=r"(current) : "l"(counter) : "memory");
    if (done(current)) break;
    if (polls == kMaxPolls) __trap();
    __nanosleep(128);
  }
  asm volatile("fence.proxy.async.global;" ::: "memory");
}

// Polls until *turn == place: the reductions of earlier turns come before this thread's next one.
__device__ __forceinline__ void wait_for_turn(const int* turn, int place) {
  poll_until(turn, [place](int current) { return current == place; });
}

// After this thread's committed bulk copies (reductions, stores): waits for them to complete in
// global memory, then adds `value` to *counter with release semantics (every write this thread
// has made, or has seen ordered before this point, comes before it).
__device__ __forceinline__ void release_add_after_bulk_copies(int* counter, int value) {
  asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
  asm volatile("fence.proxy.async.global;" ::: "memory");
  asm volatile("red.release.gpu.global.add.s32 [%0], %1;" ::"l"(counter), "r"(value) : "memory");
}

// Passes the turn on once this thread's reductions are complete.
__device__ __forceinline__ void pass_turn_after_reductions(int* turn) { release_add_after_bulk_copies(turn, 1); }

// One int32 counter per query head and query block of kBlockM rows of a batch entry: `base` holds
// (batch, heads, ceil(seqlen_q / kBlockM)) of them (params.seqlen_q bounds every sequence), or is
// null where the call keeps none.
template <int kBlockM>
struct QueryBlockCounters {
  int* counters = nullptr;  // of the batch entry's query head 0
  int m_blocks = 0;         // counters a query head

  __device__ QueryBlockCounters(int* base, BwdParams const& params, int batch) {
    if (base == nullptr) return;
    m_blocks = (params.seqlen_q + kBlockM - 1) / kBlockM;
    counters = base + int64_t(batch) * params.heads * m_blocks;
  }

  __device__ explicit operator bool() const { return counters != nullptr; }

  // The counter of query head `head`'s m_block.
  __device__ __forceinline__ int* counter(int head, int m_block) const {
    return counters + int64_t(head) * m_blocks + m_block;
  }
};

// A deterministic call's turn counters of this CTA's sequence, one per query head and query block
// of kBlockM rows (params.dq_turns; null in other calls), and the place of the CTA's key block in
// each (the same for every query head a GQA walk takes: each head's adders are the same key
// blocks, in the same order). In order: the key blocks take turns last first, as they are walked (key_tile_at,
// sm90/tile_scheduler.h). Rotated walks (no mask, every key block adds to every query block): in
// the order they reach the block, key block n at step (m - rotation(n)) mod m_blocks.
template <int kBlockM, int kBlockN, MaskKind kMaskKind>
struct DqTurns {
  QueryBlockCounters<kBlockM> counters;
  int key_blocks = 0;  // of the sequence
  bool rotated = false;

  __device__ DqTurns(BwdParams const& params, KeyBlockWork<kBlockM, kBlockN, kMaskKind> const& work,
                     bool rotated_walk)
      : counters(params.deterministic ? params.dq_turns : nullptr, params, work.tile.batch) {
    key_blocks = (work.sequence.seqlen_k + kBlockN - 1) / kBlockN;
    rotated = rotated_walk;
  }

  __device__ explicit operator bool() const { return bool(counters); }

  // The turn counter of query head `head`'s m_block.
  __device__ __forceinline__ int* counter(int head, int m_block) const { return counters.counter(head, m_block); }

  // This CTA's place at m_block; every lane of a warp calls it.
  __device__ __forceinline__ int place(KeyBlockWork<kBlockM, kBlockN, kMaskKind> const& work, int m_block,
                                       int lane) const {
    if (!rotated) return later_key_blocks<kBlockM, kBlockN>(work.mask, work.tile.n_block, key_blocks, m_block, lane);
    return rotated_walk_place(work.tile.n_block, m_block - work.m_block_begin, work.num_m_blocks(), key_blocks);
  }
};

// dQ's first store (BwdParams::dq_first_store) in calls that are not deterministic (deterministic
// ones store at their first turn): the preprocess leaves dq_accum unwritten, and the first CTA to
// reach a query block stores its dQ tile there while the others add theirs. Each block's counter
// (params.dq_arrivals, zeroed by the preprocess) counts the arrivals; the first adds kDqStored once
// its store has completed, and the others wait for that bit before adding. None waits on a later
// arrival, so the waits cannot deadlock; walks whose key blocks would all reach a block at once
// start at rotated blocks (sm90/tile_scheduler.h), so that the first arrival at a block is usually a
// step ahead of the others.
inline constexpr int kDqStored = 1 << 30;

template <int kBlockM>
struct DqArrivals {
  QueryBlockCounters<kBlockM> counters;

  __device__ DqArrivals(BwdParams const& params, int batch) : counters(params.dq_arrivals, params, batch) {}

  __device__ explicit operator bool() const { return bool(counters); }

  // Counts this CTA's arrival at query head `head`'s m_block; true for the first. The others return
  // once the first's store has completed, ordered before their reduce-add: an arrival that finds
  // kDqStored already set acquires it with the atomic (and orders the TMA unit's reduce-add after it
  // by the proxy fence), one that does not polls for it.
  __device__ __forceinline__ bool arrive_first_or_wait_for_store(int head, int m_block) const {
    int* counter = counters.counter(head, m_block);
    int arrived;
    asm volatile("atom.acquire.gpu.global.add.s32 %0, [%1], 1;" : "=r"(arrived) : "l"(counter) : "memory");
    if (arrived == 0) return true;
    if ((arrived & kDqStored) == 0) {
      poll_until(counter, [](int current) { return (current & kDqStored) != 0; });
    } else {
      asm volatile("fence.proxy.async.global;" ::: "memory");
    }
    return false;
  }

  // After the first arrival's committed stores: releases the block to the others once complete.
  __device__ __forceinline__ void mark_stored(int head, int m_block) const {
    release_add_after_bulk_copies(counters.counter(head, m_block), kDqStored);
  }
};

}  // namespace flash_cutlass::sm90
