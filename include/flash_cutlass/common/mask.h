// Which keys a query row may attend to, as a small policy applied to a score tile.
#pragma once

#include <cmath>
#include <cute/tensor.hpp>

#include "flash_cutlass/params.h"

namespace flash_cutlass {

// Keys past seqlen_k are always masked. With d = seqlen_k - seqlen_q, the diagonal aligned to the
// bottom-right corner of the score matrix (FlashAttention-2's convention), query row i attends key j
//   kCausal: when j <= i + d, so the last query sees every key;
//   kLocal:  when i + d - window_left <= j <= i + d + window_right (a sliding window; causal with a
//            window is (window_left, 0)). The host stores an unbounded side as
//            max(seqlen_q, seqlen_k), which reaches past every key.
template <MaskKind kKind>
struct KeyMask {
  static constexpr bool kLocal = kKind == MaskKind::kLocal;
  int seqlen_q;
  int seqlen_k;
  int window_left;
  int window_right;

  // The first key query row `row` may attend to (0 but with kLocal; may be >= key_limit).
  __host__ __device__ __forceinline__ int key_begin(int row) const {
    return kLocal ? max(0, row + seqlen_k - seqlen_q - window_left) : 0;
  }

  // One past the last key query row `row` may attend to (may be <= 0).
  __host__ __device__ __forceinline__ int key_limit(int row) const {
    if constexpr (kKind == MaskKind::kCausal) return min(seqlen_k, row + 1 + seqlen_k - seqlen_q);
    if constexpr (kLocal) return min(seqlen_k, row + 1 + seqlen_k - seqlen_q + window_right);
    return seqlen_k;
  }

  // s: a score tile as (rows, cols); coords: the same view of an identity tensor, giving each
  // element's (row, col) inside the tile; the tile starts at (row_start, col_start).
  template <class TensorS, class TensorC>
  __device__ __forceinline__ void apply(TensorS& s, TensorC const& coords, int row_start, int col_start) const {
    using namespace cute;
    CUTE_UNROLL
    for (int r = 0; r < size<0>(s); ++r) {
      const int row = row_start + get<0>(coords(r, 0));
      const int limit = key_limit(row) - col_start;
      const int begin = key_begin(row) - col_start;
      CUTE_UNROLL
      for (int c = 0; c < size<1>(s); ++c) {
        const int col = get<1>(coords(r, c));
        if (col >= limit || (kLocal && col < begin)) s(r, c) = -INFINITY;
      }
    }
  }

  // Whether the tile of rows [row_start, row_start + block_m) and keys [key_start, key_start +
  // block_n) holds any masked score (rows past seqlen_q count as their neighbours would).
  __device__ __forceinline__ bool tile_needs_mask(int row_start, int block_m, int key_start, int block_n) const {
    const bool key_tail = key_start + block_n > seqlen_k;
    if constexpr (kKind == MaskKind::kCausal) return key_tail || key_start + block_n > key_limit(row_start);
    if constexpr (kLocal) {
      return key_tail || key_start + block_n > key_limit(row_start) || key_start < key_begin(row_start + block_m - 1);
    }
    return key_tail;
  }
};

// The mask of a sequence of seqlen_q queries and seqlen_k keys under params' window.
template <MaskKind kKind>
__device__ __forceinline__ KeyMask<kKind> key_mask_of(FwdParams const& params, int seqlen_q, int seqlen_k) {
  return {seqlen_q, seqlen_k, params.window_left, params.window_right};
}

}  // namespace flash_cutlass
