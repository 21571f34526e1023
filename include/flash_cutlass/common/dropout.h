// Dropout on the attention probabilities in the dropout instantiation (Extension::kDropout): each probability
// P[i][j] of (batch, head) is kept with probability 1 - p and dropped (set to 0) otherwise; kept
// ones are scaled by 1 / (1 - p) on their way into O = P V (the softmax's row sums and the LSE are
// those of the undropped P).
//
// The keep bit of (row i, key j) is a pure function of (seed, offset, batch, head, i, j), so every
// kernel (either path, either direction, any tile shape) and the CPU reference
// (flash_cutlass.reference.dropout_keep_mask) draw the same mask. One Philox4x32-10 call serves a
// 2 x 2 block of the score matrix:
//   counter = (j / 2, i / 2, batch * heads + head, offset / 4), key = (seed low, seed high),
//   the output word 2 * (i % 2) + (j % 2) belongs to (i, j), and (i, j) is kept iff that word is
//   >= drop_threshold = floor(p * 2^32).
// A call uses the one stream offset / 4; a call drawing from a generator advances its offset by 4
// (csrc/flash_api.cpp), so calls never share counters.
// Every accumulator layout here holds such blocks in pairs of elements: neighbouring columns of one
// row in S (mma.sync and wgmma C layouts), neighbouring rows of one column in S^T (the Hopper
// backward); a pair costs one Philox call.
#pragma once

#include <cstdint>
#include <cute/tensor.hpp>

#include "flash_cutlass/params.h"

namespace flash_cutlass {

// Philox4x32 with 10 rounds (Salmon, Moraes, Dror, Shaw: "Parallel random numbers: as easy as
// 1, 2, 3", SC 2011).
__device__ __forceinline__ uint4 philox4x32_10(uint4 counter, uint2 key) {
  constexpr uint32_t kMultiplier0 = 0xD2511F53u;
  constexpr uint32_t kMultiplier1 = 0xCD9E8D57u;
  constexpr uint32_t kKeyStep0 = 0x9E3779B9u;
  constexpr uint32_t kKeyStep1 = 0xBB67AE85u;
  CUTE_UNROLL
  for (int round = 0; round < 10; ++round) {
    const uint32_t hi0 = __umulhi(kMultiplier0, counter.x);
    const uint32_t lo0 = kMultiplier0 * counter.x;
    const uint32_t hi1 = __umulhi(kMultiplier1, counter.z);
    const uint32_t lo1 = kMultiplier1 * counter.z;
    counter = make_uint4(hi1 ^ counter.y ^ key.x, lo1, hi0 ^ counter.w ^ key.y, lo0);
    key.x += kKeyStep0;
    key.y += kKeyStep1;
  }
  return counter;
}

template <bool kEnabled>
struct Dropout {};

template <>
struct Dropout<true> {
  uint2 key;
  uint32_t stream;          // offset / 4
  uint32_t batch_head;      // batch * heads + head
  uint32_t drop_threshold;  // floor(p * 2^32)
  float keep_scale;         // 1 / (1 - p)

  // The Philox words of the 2 x 2 block holding (row, col).
  __device__ __forceinline__ uint4 block_bits(int row, int col) const {
    return philox4x32_10(make_uint4(uint32_t(col) >> 1, uint32_t(row) >> 1, batch_head, stream), key);
  }

  // Keep bits of (row, col) and (row, col + 1), col even.
  __device__ __forceinline__ void keep_col_pair(int row, int col, bool& keep0, bool& keep1) const {
    const uint4 bits = block_bits(row, col);
    keep0 = ((row & 1) ? bits.z : bits.x) >= drop_threshold;
    keep1 = ((row & 1) ? bits.w : bits.y) >= drop_threshold;
  }

  // Keep bits of (row, col) and (row + 1, col), row even.
  __device__ __forceinline__ void keep_row_pair(int row, int col, bool& keep0, bool& keep1) const {
    const uint4 bits = block_bits(row, col);
    keep0 = ((col & 1) ? bits.y : bits.x) >= drop_threshold;
    keep1 = ((col & 1) ? bits.w : bits.z) >= drop_threshold;
  }

  // In place on a probability tile p (rows, cols) in the S layout starting at (row_start,
  // col_start): dropped entries become 0 (the kept ones are scaled later, on O).
  template <class TensorP, class TensorC>
  __device__ __forceinline__ void apply(TensorP& p, TensorC const& coords, int row_start, int col_start) const {
    using namespace cute;
    static_assert(decltype(size<1>(p))::value % 2 == 0, "columns come in pairs");
    CUTE_UNROLL
    for (int r = 0; r < size<0>(p); ++r) {
      CUTE_UNROLL
      for (int c = 0; c < size<1>(p); c += 2) {
        bool keep0, keep1;
        keep_col_pair(row_start + get<0>(coords(r, c)), col_start + get<1>(coords(r, c)), keep0, keep1);
        if (!keep0) p(r, c) = 0.f;
        if (!keep1) p(r, c + 1) = 0.f;
      }
    }
  }
};

struct PhiloxSeedOffset {
  uint64_t seed;
  uint64_t offset;
};

// The call's Philox (seed, offset), as PyTorch's at::cuda::philox::unpack reads an
// at::PhiloxCudaState: the values in params, or, where the host passed pointers (CUDA graph
// capture, or a state kept on the device), the seed and the offset plus the intra-graph offset
// read from device memory.
__device__ __forceinline__ PhiloxSeedOffset philox_seed_offset(FwdParams const& params) {
  if (params.philox_seed_ptr != nullptr) {
    return {uint64_t(*params.philox_seed_ptr), uint64_t(*params.philox_offset_ptr) + params.philox_offset_intragraph};
  }
  return {params.philox_seed, params.philox_offset};
}

// The dropout of (batch, head) from params; an empty policy without kDropout.
template <bool kDropout>
__device__ __forceinline__ Dropout<kDropout> dropout_of(FwdParams const& params, int batch, int head) {
  if constexpr (kDropout) {
    const PhiloxSeedOffset state = philox_seed_offset(params);
    return {make_uint2(uint32_t(state.seed), uint32_t(state.seed >> 32)), uint32_t(state.offset >> 2),
            uint32_t(batch * params.heads + head), params.dropout_threshold, params.dropout_keep_scale};
  } else {
    return {};
  }
}

// A forward whose state the host drew from a generator (params.philox_state_out set) hands the
// (seed, offset) it used to the backward: one thread of the grid's first CTA writes them. Under
// CUDA graph capture each replay writes its own.
template <bool kDropout>
__device__ __forceinline__ void record_philox_state(FwdParams const& params) {
  if constexpr (kDropout) {
    if (params.philox_state_out != nullptr && threadIdx.x == 0 && blockIdx.x == 0 && blockIdx.y == 0 &&
        blockIdx.z == 0) {
      const PhiloxSeedOffset state = philox_seed_offset(params);
      params.philox_state_out[0] = int64_t(state.seed);
      params.philox_state_out[1] = int64_t(state.offset);
    }
  }
}

}  // namespace flash_cutlass
