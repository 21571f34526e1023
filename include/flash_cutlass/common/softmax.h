// Online softmax over key tiles, one query row per fragment row, all in fp32.
#pragma once

#include <cmath>
#include <utility>
#include <cute/tensor.hpp>

#include "flash_cutlass/common/utils.h"

namespace flash_cutlass {

// The exponents of a row of scores s (in score units), P = exp2(s * scale - offset): one FFMA per
// score.
struct ScoreExponent {
  float scale;
  float offset;
};

// A row's exponents against its maximum m are s * scale_log2 - m * scale_log2, scale_log2 being
// softmax_scale (or the soft cap) times log2(e): one FFMA per score against the rounded product m *
// scale_log2. The FFMA's product is exact, so the exponents are off by that product's rounding
// alone, the same for the whole row: up to 2^-25 |m * scale_log2|, a factor common to the row's P
// that cancels in O but stays in the LSE. Past |m * scale_log2| = 2^27 (softmax_scale 1e30, ALiBi
// slopes of 1e30, q and k of 3e17 in bf16) that factor would pass 2^4, P past fp16's range under
// the lazy rescale's bound of 2^8; from 2^31 on exp2 overflows (then inf * 0 = NaN) or flushes the
// row to 0; and m * scale_log2 itself can overflow where m * softmax_scale does not. So a row whose
// maximum reaches exact_max = 2^24 / scale_log2 (where the factor is still 2^(1/2) at most, and the
// LSE the backward recomputes P from is off by 0.35 or less) has m subtracted from its scores
// first, in a branch that only a tile holding such a row (or one at -inf, which it leaves) enters:
// s - m is exact near m (Sterbenz) and rounded relative to itself elsewhere, so
// (s - m) * scale_log2 - 0 is the exact exponent to fp32's rounding, P = 1 at the maximum, and
// nothing overflows that fp32 attention keeps finite. A row whose maximum crosses exact_max keeps
// the terms of its earlier tiles as the usual form gave them (times the correction between the
// maxima). An infinite maximum gives the same P either way (0, and NaN for the infinite scores); a
// NaN one never takes the branch: both propagate as before.
constexpr int kExactMaxLog2 = 24;

// The backward's exponent of a query row, from the forward's log-sum-exp lse (natural units; +inf
// for a row that sees no key, whose P is then 0) and the unit of the row's scores, score_unit
// (softmax_scale, or the soft cap: lse_score_unit). Normally scale = exp2_scale and offset =
// lse * log2(e), rounded: the FFMA carries that rounding and lse's own into every exponent of the
// row, about 2 ulps of the offset, a factor 2^(+-2) on P at |offset| = 2^24 that overflows exp2
// (inf, then NaN gradients) not far above. From 2^24 on, where one ulp of lse is a whole e-fold or
// more, the row takes scale = score_unit 2^c and offset = lse 2^c, c = 16 - floor(log2 |lse|), both
// exact (powers of two): P = exp2(2^c (s score_unit - lse)) at the row's maximum is within 2^-7
// (0.55%) of the forward's, given the forward's score there, and about 0.2% more from the forward's
// LSE, exact to 0.35 from 2^24 on (kExactMaxLog2); a score recomputed with a relative error r moves
// that exponent by 2^16 r. The cost: a score at relative distance g below the maximum gets about
// 2^(-2^16 g) for exp(-g |lse|), so that the scores within 10^-4 of the maximum keep a share of P
// they do not have, and ties at the maximum get P = 1 each instead of 1/n.
constexpr float kLseExactLog2 = 24.f;

__device__ __forceinline__ ScoreExponent probability_exponent(float lse, float exp2_scale, float score_unit) {
  const float lse_log2 = lse * float(M_LOG2E);
  // 2^(16 - e) for |lse| in [2^e, 2^(e + 1)): the exponent field 16 - e + 127 = 270 - (lse's field),
  // a normal number where the form applies (|lse| > 2^23).
  const float power = __uint_as_float(0x87000000u - (__float_as_uint(lse) & 0x7F800000u));
  const bool exact = fabsf(lse_log2) >= float(1 << int(kLseExactLog2)) && fabsf(lse) != INFINITY;
  return {exact ? score_unit * power : exp2_scale, exact ? lse * power : lse_log2};
}

// An attention sink (a logit in natural units that joins the row's softmax and attends to no value;
// -inf: none) folded into a finished row's log-sum-exp: lse becomes log(exp(lse) + exp(sink)).
// Returns the factor exp(lse - lse') = 1 / (1 + exp(sink - lse)) that rescales the row's normalized
// output (0 for a row that saw no key, whose lse becomes the sink's). NaN in lse or the sink stays
// NaN in both (fmaxf alone would drop it; |lse - sink| keeps it), and the factor does not inherit
// the rounding of lse' (relative error about exp(sink - lse') ulp, not ulp(lse')).
__device__ __forceinline__ float fold_sink(float& lse, float sink) {
  if (sink == -INFINITY) return 1.f;
  const float factor = lse == -INFINITY ? 0.f : 1.f / (1.f + __expf(sink - lse));
  lse = fmaxf(lse, sink) + log1pf(__expf(-fabsf(lse - sink)));
  return factor;
}

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
  float exact_max;   // 2^24 / scale_log2: from this |m| on, a row's scores have m subtracted first

  __device__ explicit OnlineSoftmax(float exp2_scale)
      : scale_log2(exp2_scale), exact_max(float(1 << kExactMaxLog2) / exp2_scale) {}

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
    float prev_max[kRows], new_max[kRows], max_scaled[kRows];
    CUTE_UNROLL
    for (int r = 0; r < kRows; ++r) {
      prev_max[r] = kFirstTile ? -INFINITY : row_max[r];
      new_max[r] = quad_max(fmaxf(prev_max[r], thread_row_max(s, r)));
    }
    offsets_against(s, new_max, max_scaled);
    CUTE_UNROLL
    for (int r = 0; r < kRows; ++r) move_row<kFirstTile>(s, r, prev_max[r], new_max[r], true, max_scaled[r], correction);
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
    float prev_max[kRows], new_max[kRows], max_scaled[kRows];
    CUTE_UNROLL
    for (int r = 0; r < kRows; ++r) {
      prev_max[r] = row_max[r];
      new_max[r] = rescale_o ? fmaxf(prev_max[r], tile_max[r]) : prev_max[r];
    }
    offsets_against(s, new_max, max_scaled);
    CUTE_UNROLL
    for (int r = 0; r < kRows; ++r) move_row<false>(s, r, prev_max[r], new_max[r], rescale_o, max_scaled[r], correction);
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
    // A row still at -inf keeps the offset -inf here: P = +inf fails the test.
    float max_scaled[kRows];
    offsets_against<false>(s, row_max, max_scaled);
    bool within = true;
    CUTE_UNROLL
    for (int r = 0; r < kRows; ++r) {
      tile_sum[r] = exponentiate_row(s, r, max_scaled[r]);
      within &= !votes[r] || tile_sum[r] <= kMaxGrowth;
    }
    return within;
  }

  __device__ __forceinline__ void add_tile_sums(float const (&tile_sum)[kRows]) {
    CUTE_UNROLL
    for (int r = 0; r < kRows; ++r) row_sum[r] += tile_sum[r];
  }

  // Row r's maximum set to new_max (from prev_max), the row exponentiated against it (max_scaled,
  // from offsets_against) and added to l, which is first rescaled by correction[r]: 1 for the first tile or when the maximum stays
  // (`moved` false, known without an exponential).
  template <bool kFirstTile, class TensorS>
  __device__ __forceinline__ void move_row(TensorS& s, int r, float prev_max, float new_max, bool moved,
                                           float max_scaled, float (&correction)[kRows]) {
    row_max[r] = new_max;
    correction[r] = kFirstTile || !moved || new_max == -INFINITY ? 1.f : exp2f((prev_max - new_max) * scale_log2);
    const float tile_sum = exponentiate_row(s, r, max_scaled);
    row_sum[r] = kFirstTile ? tile_sum : moved ? row_sum[r] * correction[r] + tile_sum : row_sum[r] + tile_sum;
  }

  // Each row's offset against its maximum m[r] for exponentiate_row: m[r] * scale_log2 (with
  // kEmptyToZero, 0 for a row whose every key is masked so far, m = -inf, so that its P is exactly 0
  // instead of exp2(-inf + inf) = NaN); or, where |m[r]| reaches exact_max (kExactMaxLog2), 0 after
  // m[r] has been subtracted from the row's scores, in a branch that only a tile holding such a row
  // (or a row at -inf) enters.
  template <bool kEmptyToZero = true, class TensorS>
  __device__ __forceinline__ void offsets_against(TensorS& s, float const (&m)[kRows], float (&max_scaled)[kRows]) const {
    float largest = 0.f;  // of |m|; a NaN m leaves it (fmaxf) and keeps the usual form
    CUTE_UNROLL
    for (int r = 0; r < kRows; ++r) {
      max_scaled[r] = kEmptyToZero && m[r] == -INFINITY ? 0.f : m[r] * scale_log2;
      largest = fmaxf(largest, fabsf(m[r]));
    }
    if (__any_sync(0xffffffffu, largest >= exact_max)) {
      CUTE_UNROLL
      for (int r = 0; r < kRows; ++r) {
        if (fabsf(m[r]) >= exact_max && m[r] != -INFINITY) {
          CUTE_UNROLL
          for (int c = 0; c < cute::size<1>(s); ++c) s(r, c) -= m[r];
          max_scaled[r] = 0.f;
        }
      }
    }
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

  // Normalizes o by l and returns, per row, lse = scale * m + log(l) (natural log), with the
  // row's attention sink folded in (fold_sink; -inf: none). A row that attended to no key gets
  // o = 0 and lse = -inf (the sink, with one).
  template <class TensorO>
  __device__ __forceinline__ void finalize(TensorO& o, float softmax_scale, float (&lse)[kRows],
                                           float sink = -INFINITY) {
    using namespace cute;
    CUTE_UNROLL
    for (int r = 0; r < kRows; ++r) {
      const float sum = quad_sum(row_sum[r]);
      const bool empty = sum == 0.f;
      lse[r] = empty ? -INFINITY : row_max[r] * softmax_scale + __logf(sum);
      const float factor = fold_sink(lse[r], sink);
      const float inv_sum = empty ? 0.f : factor / sum;
      CUTE_UNROLL
      for (int c = 0; c < size<1>(o); ++c) o(r, c) *= inv_sum;
    }
  }
};

}  // namespace flash_cutlass
