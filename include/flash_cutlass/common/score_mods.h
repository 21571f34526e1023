// The per-call options on the attention scores that the extended kernel instantiation
// (Extension::kScoreMods, and kDropout which adds dropout) applies: the tanh soft cap and ALiBi.
// Their switches and values are runtime parameters; the kernels of Extension::kNone carry none of
// this code (kExtended below: any extension).
//
// The kernels keep x = q.k in their S accumulators and exponentiate z * exp2_scale.
// The extended kernels take z = cap(x) + bias(row, col), where
//   cap(x) = tanh(x * softcap_input_scale) with a soft cap (the host sets softcap_input_scale =
//            softmax_scale / softcap and exp2_scale = softcap * log2(e), so the score is
//            softcap * tanh(softmax_scale * q.k / softcap)), x itself without one;
//   bias   = -slope * |row + seqlen_k - seqlen_q - col| / score_unit with ALiBi, score_unit being
//            softcap or softmax_scale, whichever the exponent multiplies by, so the score gets
//            -slope * distance (FlashAttention-2's ALiBi, bottom-right aligned); 0 without.
// The score's derivative with respect to softmax_scale * x is cap'(x): 1 - t^2 for t = cap(x)
// with a soft cap, 1 without.
#pragma once

#include <cmath>
#include <cute/tensor.hpp>

#include "flash_cutlass/params.h"

namespace flash_cutlass {

// tanh by the hardware approximation (MUFU.TANH, relative error about 2^-11).
__device__ __forceinline__ float tanh_approx(float x) {
  float y;
  asm("tanh.approx.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

template <bool kEnabled>
struct ScoreMods {};

template <>
struct ScoreMods<true> {
  float softcap_input_scale;  // 0: no soft cap
  float alibi_slope;          // in score units (see above); 0: no ALiBi
  int diagonal;               // seqlen_k - seqlen_q

  // In place on a score tile s (rows, cols): x -> cap(x).
  template <class TensorS>
  __device__ __forceinline__ void cap(TensorS& s) const {
    if (softcap_input_scale == 0.f) return;
    CUTE_UNROLL
    for (int i = 0; i < cute::size(s); ++i) s(i) = tanh_approx(s(i) * softcap_input_scale);
  }

  __device__ __forceinline__ float bias(int row, int col) const {
    return -alibi_slope * fabsf(float(row + diagonal - col));
  }

  // In place on a score tile s (rows, cols) starting at (row_start, col_start), coords giving each
  // element's (row, col) inside the tile: adds the ALiBi bias.
  template <class TensorS, class TensorC>
  __device__ __forceinline__ void add_bias(TensorS& s, TensorC const& coords, int row_start, int col_start) const {
    using namespace cute;
    if (alibi_slope == 0.f) return;
    CUTE_UNROLL
    for (int r = 0; r < size<0>(s); ++r) {
      CUTE_UNROLL
      for (int c = 0; c < size<1>(s); ++c) {
        s(r, c) += bias(row_start + get<0>(coords(r, c)), col_start + get<1>(coords(r, c)));
      }
    }
  }

  // cap'(x) given t = cap(x); 0 for a masked score (t = -inf), whose probability is 0 too.
  __device__ __forceinline__ float derivative(float t) const {
    return softcap_input_scale == 0.f ? 1.f : 1.f - fminf(t * t, 1.f);
  }
};

// The options of (batch, head) from params, for a sequence of seqlen_q queries and seqlen_k keys;
// an empty policy without kExtended.
template <bool kExtended>
__device__ __forceinline__ ScoreMods<kExtended> score_mods_of(FwdParams const& params, int batch, int head,
                                                              int seqlen_q, int seqlen_k) {
  if constexpr (kExtended) {
    const float slope =
        params.alibi_slopes == nullptr
            ? 0.f
            : params.alibi_slopes[int64_t(batch) * params.alibi_slopes_batch_stride + head] * params.alibi_slope_scale;
    return {params.softcap_input_scale, slope, seqlen_k - seqlen_q};
  } else {
    return {};
  }
}

// What the forward's softmax.finalize scales the running maximum by: softmax_scale, or the soft
// cap in the extended kernels when one is set.
template <bool kExtended>
__device__ __forceinline__ float lse_score_unit(FwdParams const& params) {
  if constexpr (kExtended) return params.softcap > 0.f ? params.softcap : params.softmax_scale;
  return params.softmax_scale;
}

// The attention sink of query head `head` (natural units), or -inf without sinks.
__device__ __forceinline__ float sink_of(FwdParams const& params, int head) {
  return params.sinks == nullptr ? -INFINITY : params.sinks[head];
}

// The forward's scores before the softmax, in place on one (rows, cols) tile whose element (0, 0)
// is score (row0, col0): the soft cap and ALiBi (kExtended), then the mask (kMasked: the tiles that
// need one). The sm80 forward spells the same steps out: through this helper, ptxas spills 96
// bytes more in its score-options kernel at head dim 128 (the Hopper kernels compile the same).
template <bool kMasked, bool kExtended, class Mask, class TensorS, class TensorC>
__device__ __forceinline__ void prepare_scores(ScoreMods<kExtended> const& score_mods, Mask const& mask, TensorS& s,
                                               TensorC const& coords, int row0, int col0) {
  if constexpr (kExtended) {
    score_mods.cap(s);
    score_mods.add_bias(s, coords, row0, col0);
  }
  if constexpr (kMasked) mask.apply(s, coords, row0, col0);
}

}  // namespace flash_cutlass
