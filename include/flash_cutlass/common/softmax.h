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
// softmax_scale (or the soft cap) times log2(e): one FFMA per score against the rounded product. The
// FFMA subtracts that rounded product from the exact one, which shifts every exponent of the row
// alike by up to 2^-25 |m * scale_log2|, a factor common to the row's P that cancels in O (and stays
// in the LSE below its own rounding). Past |m * scale_log2| = 2^27 (softmax_scale 1e30, ALiBi
// slopes of 1e30, q and k of 3e17 in bf16) that factor would pass 2^4, P past fp16's range under the
// lazy rescale's bound of 2^8; from 2^31 on exp2 overflows (then inf * 0 = NaN) or flushes the row
// to 0; and m * scale_log2 can overflow where m * softmax_scale does not. So from |m| = exact_max =
// 2^27 / scale_log2 on, the row's exponents are taken exactly, as (s - m) scale with the power of two
// scale = 2^(26 - floor(log2 |m|)) <= scale_log2, for which m * scale is exact: P is exactly 1 at
// the maximum, at most 2^-8 one ulp below it (2^-4 where m is a power of two; never less than the
// exact P there), 2^-16 two ulps below, and so on. Scores above a kept maximum (the lazy rescale)
// get no larger an exponent than scale_log2 would give them, so its bound holds; the correction
// between tiles, exp2((m_old - m_new) scale_log2), stays (a maximum that grows there leaves the old
// tiles' terms at 2^-4 or less). An infinite maximum gives the same P either way (0, and NaN for the
// infinite scores); a NaN one keeps the usual form: both propagate as before.
constexpr int kExactMaxLog2 = 27;

// The exact form's scale, 2^(26 - e) for |m| in [2^e, 2^(e + 1)): the exponent field
// 26 - e + 127 = 280 - (m's field), a normal number for an m of that form (|m| > 2^-101).
__device__ __forceinline__ float exact_exponent_scale(float m) {
  return __uint_as_float(0x8C000000u - (__float_as_uint(m) & 0x7F800000u));
}

// The backward's exponent of a query row, from the forward's log-sum-exp lse (natural units; +inf
// for a row that sees no key, whose P is then 0) and the unit of the row's scores, score_unit
// (softmax_scale, or the soft cap: lse_score_unit). Normally scale = exp2_scale and offset =
// lse * log2(e), rounded: the FFMA carries that rounding and lse's own into every exponent of the
// row, about 2 ulps of the offset, a factor 2^(+-2) on P at |offset| = 2^24 that overflows exp2
// (inf, then NaN gradients) not far above. From 2^24 on, where one ulp of lse is a whole e-fold or
// more, the row takes scale = score_unit 2^c and offset = lse 2^c, c = 16 - floor(log2 |lse|), both
// exact (powers of two): P = exp2(2^c (s score_unit - lse)) is within 2^-7 (0.55%) of the
// forward's at the row's maximum and never above 1.0055, given the forward's score there (a score
// recomputed with a relative error r moves that exponent by 2^16 r). The cost: a score at relative
// distance g below the maximum gets about 2^(-2^16 g) for exp(-g |lse|), so that the scores within
// 10^-4 of the maximum keep a share of P they do not have, and ties at the maximum get P = 1 each
// instead of 1/n.
constexpr float kLseExactLog2 = 24.f;

__device__ __forceinline__ ScoreExponent probability_exponent(float lse, float exp2_scale, float score_unit) {
  const float lse_log2 = lse * float(M_LOG2E);
  // 2^(16 - e) for |lse| in [2^e, 2^(e + 1)): the exponent field 16 - e + 127 = 270 - (lse's field),
  // a normal number where the form applies (|lse| > 2^23).
  const float power = __uint_as_float(0x87000000u - (__float_as_uint(lse) & 0x7F800000u));
  const bool exact = fabsf(lse_log2) >= float(1 << int(kLseExactLog2)) && fabsf(lse) != INFINITY;
  return {exact ? score_unit * power : exp2_scale, exact ? lse * power : lse_log2};
}

// Keeps, for each of the kRows rows a thread owns, the running maximum m of the raw scores
// and this thread's part of the running sum l of exp(scale * (s - m)). The quad's parts of l
// are added only once, in finalize(): rescaling is per row, so the parts stay consistent.
// kMaxChains: a row's maximum and sum run as up to this many interleaved chains of FMNMX / FADD
// (thread_row_max, exponentiate_row); ptxas keeps the single chain the source writes, in which each
// instruction waits out the one before.
// kExactRowsInPlace: how a row whose maximum takes the exact form (exact_exponent_scale) gets it.
// false: a scale of its own, a few instructions a row and none a score (the Hopper forward; with
// the rewrite below, ptxas spilled 16 bytes at head dim 256 causal, where it spills none). true:
// its scores rewritten in place, two instructions a score in a branch that only a tile holding such
// a row takes, every row keeping scale_log2 (the sm80 forward at head dim 128: with a scale per row,
// ptxas spilled 60 bytes more in the score-options kernel; this way 76 fewer without a mask and
// causal, as many with score options, 64 more with dropout).
template <int kRows, int kMaxChains = 1, bool kExactRowsInPlace = false>
struct OnlineSoftmax {
  float row_max[kRows];
  float row_sum[kRows];
  float scale_log2;  // softmax scale * log2(e), > 0
  float exact_max;   // 2^27 / scale_log2: from this |m| on, a row takes the exact form (exact_exponent_scale)

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
    float prev_max[kRows], new_max[kRows];
    ScoreExponent exponent[kRows];
    CUTE_UNROLL
    for (int r = 0; r < kRows; ++r) {
      prev_max[r] = kFirstTile ? -INFINITY : row_max[r];
      new_max[r] = quad_max(fmaxf(prev_max[r], thread_row_max(s, r)));
    }
    row_exponents<true>(s, new_max, exponent);
    CUTE_UNROLL
    for (int r = 0; r < kRows; ++r) move_row<kFirstTile>(s, r, prev_max[r], new_max[r], true, exponent[r], correction);
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
    float prev_max[kRows], new_max[kRows];
    ScoreExponent exponent[kRows];
    CUTE_UNROLL
    for (int r = 0; r < kRows; ++r) {
      prev_max[r] = row_max[r];
      new_max[r] = rescale_o ? fmaxf(prev_max[r], tile_max[r]) : prev_max[r];
    }
    row_exponents<true>(s, new_max, exponent);
    CUTE_UNROLL
    for (int r = 0; r < kRows; ++r) move_row<false>(s, r, prev_max[r], new_max[r], rescale_o, exponent[r], correction);
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
    ScoreExponent exponent[kRows];
    row_exponents<false>(s, row_max, exponent);
    bool within = true;
    CUTE_UNROLL
    for (int r = 0; r < kRows; ++r) {
      tile_sum[r] = exponentiate_row(s, r, exponent[r]);
      within &= !votes[r] || tile_sum[r] <= kMaxGrowth;
    }
    return within;
  }

  __device__ __forceinline__ void add_tile_sums(float const (&tile_sum)[kRows]) {
    CUTE_UNROLL
    for (int r = 0; r < kRows; ++r) row_sum[r] += tile_sum[r];
  }

  // Each row's exponent against its maximum m[r]: scale_log2 and m[r] * scale_log2 (with
  // kEmptyToZero, 0 for a row whose every key is masked so far, m = -inf, so that its P is exactly 0
  // instead of exp2(-inf + inf) = NaN), or for a row of the exact form (exact_exponent_scale) that
  // form's scale and m[r] times it. With kExactRowsInPlace, such a row's scores are instead rewritten
  // to (s - m) scale / scale_log2 and its offset set to 0, so that every row keeps scale_log2.
  template <bool kEmptyToZero, class TensorS>
  __device__ __forceinline__ void row_exponents(TensorS& s, float const (&m)[kRows], ScoreExponent (&e)[kRows]) const {
    bool exact[kRows];
    bool any_exact = false;
    CUTE_UNROLL
    for (int r = 0; r < kRows; ++r) {
      // An m of -inf needs the usual form only where its scores are rewritten (-inf * scale + inf).
      exact[r] = fabsf(m[r]) >= exact_max && (!kExactRowsInPlace || m[r] != -INFINITY);
      any_exact |= exact[r];
      const float scale = !kExactRowsInPlace && exact[r] ? exact_exponent_scale(m[r]) : scale_log2;
      e[r] = {scale, kEmptyToZero && m[r] == -INFINITY ? 0.f : m[r] * scale};
    }
    if constexpr (kExactRowsInPlace) {
      if (any_exact) {
        const float inv_scale_log2 = 1.f / scale_log2;
        CUTE_UNROLL
        for (int r = 0; r < kRows; ++r) {
          // The other rows' scores stay as they are: (s * 1 - 0) * 1.
          const float scale = exact[r] ? exact_exponent_scale(m[r]) : 1.f;
          const float max_scaled = exact[r] ? m[r] * scale : 0.f;  // exact
          const float rescale = exact[r] ? inv_scale_log2 : 1.f;
          CUTE_UNROLL
          for (int c = 0; c < cute::size<1>(s); ++c) s(r, c) = (s(r, c) * scale - max_scaled) * rescale;
          if (exact[r]) e[r].offset = 0.f;
        }
      }
    }
  }

  // Row r's maximum set to new_max (from prev_max), the row exponentiated against it (exponent, from
  // row_exponents) and added to l, which is first rescaled by correction[r]: 1 for the first tile
  // or when the maximum stays (`moved` false, known without an exponential).
  template <bool kFirstTile, class TensorS>
  __device__ __forceinline__ void move_row(TensorS& s, int r, float prev_max, float new_max, bool moved,
                                           ScoreExponent exponent, float (&correction)[kRows]) {
    row_max[r] = new_max;
    correction[r] = kFirstTile || !moved || new_max == -INFINITY ? 1.f : exp2f((prev_max - new_max) * scale_log2);
    const float tile_sum = exponentiate_row(s, r, exponent);
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

  // Row r of s replaced by exp2(s * e.scale - e.offset); returns the row's sum (this thread's part).
  template <class TensorS>
  __device__ __forceinline__ float exponentiate_row(TensorS& s, int r, ScoreExponent e) const {
    constexpr int kParts = kChains<TensorS>;
    float part[kParts];
    CUTE_UNROLL
    for (int c = 0; c < cute::size<1>(s); ++c) {
      s(r, c) = exp2f(s(r, c) * e.scale - e.offset);
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
