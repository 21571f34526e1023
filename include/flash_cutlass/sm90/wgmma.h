// Warpgroup MMA helpers of the Hopper path: one call issues a whole tile GEMM as wgmma
// instructions (the caller waits), and the accumulator re-layouts the softmax needs.
#pragma once

#include <type_traits>

#include <cute/tensor.hpp>

namespace flash_cutlass::sm90 {

// Issues acc (+)= A * B over every k-block as wgmma instructions and does not wait: several GEMMs
// go out back to back, and warpgroup_wait<0>() waits for all of them. A is either shared-memory
// descriptors or registers (then it is fenced like the accumulator); B always comes from shared
// memory. kZeroInit overwrites acc instead of adding to it. acc (and register A) must not be
// touched before the wait.
template <bool kZeroInit, class TiledMma, class FragA, class FragB, class Acc>
__device__ __forceinline__ void issue_gemm_wgmma(TiledMma& tiled_mma, FragA const& frag_a, FragB const& frag_b,
                                                 Acc& acc) {
  using namespace cute;
  constexpr bool kRegisterA =
      !std::is_base_of_v<GMMA::DescriptorIterator, typename TiledMma::FrgTypeA>;
  if constexpr (kRegisterA) warpgroup_fence_operand(const_cast<FragA&>(frag_a));
  warpgroup_fence_operand(acc);
  warpgroup_arrive();
  tiled_mma.accumulate_ = kZeroInit ? GMMA::ScaleOut::Zero : GMMA::ScaleOut::One;
  CUTE_UNROLL
  for (int k = 0; k < size<2>(frag_a); ++k) {
    gemm(tiled_mma, frag_a(_, _, k), frag_b(_, _, k), acc);
    tiled_mma.accumulate_ = GMMA::ScaleOut::One;
  }
  warpgroup_commit_batch();
}

// wgmma.wait_group N after the instructions that compute `after_a` and `after_b` (sums of
// exponentials: +0, positive, +inf or the GPU's canonical NaN, never with the sign bit set). ptxas
// schedules a wait as early as a latency gap allows (it has no inputs), which made a warpgroup wait
// for its P V before the softmax's exponentials instead of after them. A branch on the two values
// that is never taken (it would trap) ends the basic block before the wait, so the wait cannot rise
// above them; the wait itself stays unconditional, as ptxas needs to keep the wgmma pipelined.
template <int N>
__device__ __forceinline__ void warpgroup_wait_after(float after_a, float after_b) {
  unsigned bits;
  // Opaque to the compiler, so that it cannot fold the test from what it knows of the values.
  asm("or.b32 %0, %1, %2;" : "=r"(bits) : "r"(__float_as_uint(after_a)), "r"(__float_as_uint(after_b)));
  if (__any_sync(0xffffffffu, bits >> 31)) __trap();
  cute::warpgroup_wait<N>();
}

// A wgmma accumulator is laid out ((2 cols, 2 rows, N/8 col groups), MMA_M, MMA_N). Softmax wants
// (rows, cols) = ((2, MMA_M), (2, N/8, MMA_N)), so that a row is one index.
template <class Layout>
__host__ __device__ constexpr auto acc_layout_rows_cols(Layout acc) {
  using namespace cute;
  static_assert(decltype(rank<0>(acc))::value == 3);
  return make_layout(make_layout(get<0, 1>(acc), get<1>(acc)),
                     make_layout(get<0, 0>(acc), get<0, 2>(acc), get<2>(acc)));
}

template <class Tensor>
__host__ __device__ auto as_rows_cols(Tensor&& t) {
  return cute::make_tensor(t.data(), acc_layout_rows_cols(t.layout()));
}

// The registers of a 64xN fp16/bf16 accumulator are exactly those of the A operand of a
// 64 x (K = N) register-sourced wgmma: ((2, 2, N/8), MMA_M, 1) -> ((2, 2, 2), MMA_M, N/16).
template <class Layout>
__host__ __device__ constexpr auto acc_layout_as_operand_a(Layout acc) {
  using namespace cute;
  static_assert(decltype(size<2>(acc))::value == 1);
  auto col_groups = logical_divide(get<0, 2>(acc), Shape<_2>{});  // ((2, N/16))
  return make_layout(make_layout(get<0, 0>(acc), get<0, 1>(acc), get<0, 0>(col_groups)), get<1>(acc),
                     get<0, 1>(col_groups));
}

}  // namespace flash_cutlass::sm90
