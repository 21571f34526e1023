// Which keys a query row may attend to, as a small policy applied to a score tile.
#pragma once

#include <cmath>
#include <cute/tensor.hpp>

namespace flash_cutlass {

// Keys past seqlen_k are always masked. With kCausal, query row i attends key j only when
// j <= i + seqlen_k - seqlen_q: the diagonal is aligned to the bottom-right corner of the
// score matrix (FlashAttention-2's convention), so the last query sees every key.
template <bool kCausal>
struct KeyMask {
  int seqlen_q;
  int seqlen_k;

  // Number of leading keys query row `row` may attend to (may be <= 0).
  __device__ __forceinline__ int key_limit(int row) const {
    return kCausal ? min(seqlen_k, row + 1 + seqlen_k - seqlen_q) : seqlen_k;
  }

  // s: a score tile as (rows, cols); coords: the same view of an identity tensor, giving each
  // element's (row, col) inside the tile; the tile starts at (row_start, col_start).
  template <class TensorS, class TensorC>
  __device__ __forceinline__ void apply(TensorS& s, TensorC const& coords, int row_start, int col_start) const {
    using namespace cute;
    CUTE_UNROLL
    for (int r = 0; r < size<0>(s); ++r) {
      const int limit = key_limit(row_start + get<0>(coords(r, 0))) - col_start;
      CUTE_UNROLL
      for (int c = 0; c < size<1>(s); ++c) {
        if (get<1>(coords(r, c)) >= limit) s(r, c) = -INFINITY;
      }
    }
  }
};

}  // namespace flash_cutlass
