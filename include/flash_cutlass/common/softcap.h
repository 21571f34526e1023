// tanh soft-capping of the attention scores (FlashAttention-2's `softcap`):
//   score = softcap * tanh(softmax_scale * q.k / softcap).
// The kernels keep q.k in the S accumulator; with a soft cap, apply_softcap replaces it by
// t = tanh(q.k * softcap_input_scale) before any mask, and the softmax exponentiates softcap * t
// (the host sets softmax_scale_log2 = softcap * log2(e) for those calls). The gradient of a score
// with respect to q.k is then softmax_scale * (1 - t^2).
#pragma once

#include <cute/tensor.hpp>

namespace flash_cutlass {

// tanh by the hardware approximation (MUFU.TANH, relative error about 2^-11).
__device__ __forceinline__ float tanh_approx(float x) {
  float y;
  asm("tanh.approx.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

template <class TensorS>
__device__ __forceinline__ void apply_softcap(TensorS& s, float input_scale) {
  CUTE_UNROLL
  for (int i = 0; i < cute::size(s); ++i) s(i) = tanh_approx(s(i) * input_scale);
}

// The factor d(softcap * t) / d(softcap * x) = 1 - t^2 of a soft-capped score t; 0 for a masked
// score (t = -inf), whose probability is 0 too.
__device__ __forceinline__ float softcap_derivative(float t) { return 1.f - fminf(t * t, 1.f); }

}  // namespace flash_cutlass
