// Online softmax over key tiles, one query row per fragment row, all in fp32.
#pragma once

#include <cmath>
#include <utility>
#include <cute/tensor.hpp>

#include "flash_cutlass/common/utils.h"

namespace flash_cutlass {

// Keeps, for each of the kRows rows a thread owns, the running maximum m of the raw scores
// and this thread's part of the running sum l of exp(scale * (s - m)). The quad's parts of l
// are added only once, in finalize(): rescaling is per row, so the parts stay consistent.
// kMaxChains: a row's maximum and sum run as up to this many interleaved chains of FMNMX / FADD
// (thread_row_max, exponentiate_row); ptxas keeps the single chain the source writes, in which each
// instruction waits out the one before.
template <int kRows, int kMaxChains = 1>
struct OnlineSoftmax {
  float row_max[kRows];
  float row_sum[kRows];
  float scale_log2;  // softmax scale * log2(e), > 0

  __device__ explicit OnlineSoftmax(float exp2_scale) : scale_log2(exp2_scale) {}

  // s: one score tile as (rows, cols), replaced by P = exp(scale * (s - m_new)).
  // o: the output accumulator as (rows, cols), rescaled to the new maximum.
  template <bool kFirstTile, class TensorS, class TensorO>
  __device__ __forceinline__ void update(TensorS& s, TensorO& o) {
    float correction[kRows];
    update_scores<kFirstTile>(s, correction);
    if constexpr (!kFirstTile) rescale(o, correction);
  }

  // update() in two halves, for a caller that keeps o busy (an in-flight P V) meanwhile:
  // update_scores does everything but rescaling o and returns each row's factor in `correction`
  // (1 for the first tile); rescale(o, correction) applies it later.
  template <bool kFirstTile, class TensorS>
  __device__ __forceinline__ void update_scores(TensorS& s, float (&correction)[kRows]) {
    using namespace cute;
    static_assert(decltype(size<0>(s))::value == kRows);
    CUTE_UNROLL
    for (int r = 0; r < kRows; ++r) {
      const float prev_max = kFirstTile ? -INFINITY : row_max[r];
      const float new_max = quad_max(fmaxf(prev_max, thread_row_max(s, r)));
      move_row<kFirstTile>(s, r, prev_max, new_max, true, correction);
    }
  }

  // update_scores for a tile after the first that keeps each row's maximum while no score of the
  // tile exceeds it by more than kMaxGrowthLog2 after scaling (FlashAttention-4's conditional
  // rescaling): P then stays <= 2^kMaxGrowthLog2, and neither l nor o needs a rescale. Once a row
  // of the warp grows past that, every row of the warp takes its new maximum as in update_scores.
  // Only the rows with `votes` set take part (the others' maxima still move when the warp's do).
  // Returns whether o must be rescaled with `correction`; the same for the whole warp, so the
  // caller's branch around rescale() does not diverge.
  static constexpr float kMaxGrowthLog2 = 8.f;

  template <class TensorS>
  __device__ __forceinline__ bool update_scores_lazily(TensorS& s, float (&correction)[kRows], bool const (&votes)[kRows]) {
    using namespace cute;
    static_assert(decltype(size<0>(s))::value == kRows);
    float tile_max[kRows];
    bool grows = false;
    CUTE_UNROLL
    for (int r = 0; r < kRows; ++r) {
      tile_max[r] = quad_max(thread_row_max(s, r));
      // False for -inf - -inf (NaN): a row that has seen no key yet and sees none here stays at -inf.
      grows |= votes[r] && (tile_max[r] - row_max[r]) * scale_log2 > kMaxGrowthLog2;
    }
    const bool rescale_o = __any_sync(0xffffffffu, grows);
    CUTE_UNROLL
    for (int r = 0; r < kRows; ++r) {
      const float prev_max = row_max[r];
      move_row<false>(s, r, prev_max, rescale_o ? fmaxf(prev_max, tile_max[r]) : prev_max, rescale_o, correction);
    }
    return rescale_o;
  }

  // A tile after the first, exponentiated before its maxima are known: every row against the maximum
  // it keeps from the tiles before, this thread's part of each row's sum in `tile_sum`
  // (add_tile_sums keeps them). Returns whether each of this thread's rows with `votes` set stayed
  // within the lazy bound, every P <= 2^kMaxGrowthLog2, tested on the row's sum (which bounds each
  // of its P; NaN or +inf, as from a row still at -inf, fails). Where that holds for a whole
  // warpgroup, the tile's P is what update_scores_lazily would have computed. Where it does not, the
  // caller scores the tile again and moves the maxima (update_scores): the sum bounds P loosely, and
  // a maximum kept stale would fail the next tiles' test too. The row maxima (FMNMX and shuffles,
  // then a vote) leave the path to the exponentials.
  static constexpr float kMaxGrowth = float(1 << int(kMaxGrowthLog2));  // 2^kMaxGrowthLog2

  template <class TensorS>
  __device__ __forceinline__ bool exponentiate_against_kept_max(TensorS& s, float (&tile_sum)[kRows],
                                                                bool const (&votes)[kRows]) const {
    using namespace cute;
    static_assert(decltype(size<0>(s))::value == kRows);
    bool within = true;
    CUTE_UNROLL
    for (int r = 0; r < kRows; ++r) {
      tile_sum[r] = exponentiate_row(s, r, row_max[r] * scale_log2);
      within &= !votes[r] || tile_sum[r] <= kMaxGrowth;
    }
    return within;
  }

  __device__ __forceinline__ void add_tile_sums(float const (&tile_sum)[kRows]) {
    CUTE_UNROLL
    for (int r = 0; r < kRows; ++r) row_sum[r] += tile_sum[r];
  }

  // Row r's maximum set to new_max (from prev_max), the row exponentiated against it and added to
  // l, which is first rescaled by correction[r]: 1 for the first tile or when the maximum stays
  // (`moved` false, known without an exponential).
  template <bool kFirstTile, class TensorS>
  __device__ __forceinline__ void move_row(TensorS& s, int r, float prev_max, float new_max, bool moved,
                                           float (&correction)[kRows]) {
    row_max[r] = new_max;
    // A row with every key masked so far keeps m = -inf; exponentiate against 0 so that
    // its P is exactly 0 instead of exp(-inf + inf) = NaN.
    const float max_scaled = new_max == -INFINITY ? 0.f : new_max * scale_log2;
    correction[r] = kFirstTile || !moved || new_max == -INFINITY ? 1.f : exp2f((prev_max - new_max) * scale_log2);
    const float tile_sum = exponentiate_row(s, r, max_scaled);
    row_sum[r] = kFirstTile ? tile_sum : moved ? row_sum[r] * correction[r] + tile_sum : row_sum[r] + tile_sum;
  }

  // The number of chains for a row of TensorS: the largest power of 2 up to kMaxChains that
  // divides the row's length, so that the chains combine as a tree.
  template <class TensorS>
  static constexpr int kChains = [] {
    constexpr int kCols = decltype(cute::size<1>(std::declval<TensorS&>()))::value;
    int chains = 1;
    while (chains * 2 <= kMaxChains && kCols % (chains * 2) == 0) chains *= 2;
    return chains;
  }();

  // The parts of a row combined as a tree.
  template <int kParts, class Op>
  __device__ __forceinline__ static float combine(float (&part)[kParts], Op op) {
    CUTE_UNROLL
    for (int stride = kParts / 2; stride > 0; stride /= 2) {
      CUTE_UNROLL
      for (int i = 0; i < stride; ++i) part[i] = op(part[i], part[i + stride]);
    }
    return part[0];
  }

  // This thread's part of row r of s: its maximum.
  template <class TensorS>
  __device__ __forceinline__ static float thread_row_max(TensorS const& s, int r) {
    constexpr int kParts = kChains<TensorS>;
    float part[kParts];
    CUTE_UNROLL
    for (int c = 0; c < cute::size<1>(s); ++c) part[c % kParts] = c < kParts ? s(r, c) : fmaxf(part[c % kParts], s(r, c));
    return combine(part, [](float a, float b) { return fmaxf(a, b); });
  }

  // Row r of s replaced by exp2(scale * s - max_scaled); returns the row's sum (this thread's part).
  template <class TensorS>
  __device__ __forceinline__ float exponentiate_row(TensorS& s, int r, float max_scaled) const {
    constexpr int kParts = kChains<TensorS>;
    float part[kParts];
    CUTE_UNROLL
    for (int c = 0; c < cute::size<1>(s); ++c) {
      s(r, c) = exp2f(s(r, c) * scale_log2 - max_scaled);
      part[c % kParts] = c < kParts ? s(r, c) : part[c % kParts] + s(r, c);
    }
    return combine(part, [](float a, float b) { return a + b; });
  }

  template <class TensorO>
  __device__ __forceinline__ static void rescale(TensorO& o, float const (&correction)[kRows]) {
    using namespace cute;
    CUTE_UNROLL
    for (int r = 0; r < kRows; ++r) {
      CUTE_UNROLL
      for (int c = 0; c < size<1>(o); ++c) o(r, c) *= correction[r];
    }
  }

  // Normalizes o by l and returns, per row, lse = scale * m + log(l) (natural log).
  // A row that attended to no key gets o = 0 and lse = -inf.
  template <class TensorO>
  __device__ __forceinline__ void finalize(TensorO& o, float softmax_scale, float (&lse)[kRows]) {
    using namespace cute;
    CUTE_UNROLL
    for (int r = 0; r < kRows; ++r) {
      const float sum = quad_sum(row_sum[r]);
      const bool empty = sum == 0.f;
      const float inv_sum = empty ? 0.f : 1.f / sum;
      lse[r] = empty ? -INFINITY : row_max[r] * softmax_scale + __logf(sum);
      CUTE_UNROLL
      for (int c = 0; c < size<1>(o); ++c) o(r, c) *= inv_sum;
    }
  }
};

}  // namespace flash_cutlass
