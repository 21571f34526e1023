// Small CuTe helpers shared by the kernels: fragment re-layouts, type conversion, quad reductions.
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/array.h>
#include <cutlass/numeric_conversion.h>
#include <cutlass/numeric_types.h>

#include "flash_cutlass/params.h"

namespace flash_cutlass {

template <DType kDType> struct ElementOf;
template <> struct ElementOf<DType::kFloat16> { using type = cutlass::half_t; };
template <> struct ElementOf<DType::kBFloat16> { using type = cutlass::bfloat16_t; };

// The accumulator of an SM80 16x8 MMA is laid out ((2 cols, 2 rows), MMA_M, MMA_N).
// Softmax wants it as (rows, cols) = ((2, MMA_M), (2, MMA_N)), so that a row is one index.
template <class Layout>
__host__ __device__ constexpr auto acc_layout_rows_cols(Layout acc) {
  using namespace cute;
  static_assert(decltype(rank(acc))::value == 3);
  auto split = logical_divide(acc, Shape<_2>{});  // ((2, 2), MMA_M, MMA_N)
  return make_layout(make_layout(get<0, 1>(split), get<1>(split)),
                     make_layout(get<0, 0>(split), get<2>(split)));
}

template <class Engine, class Layout>
__host__ __device__ auto as_rows_cols(cute::Tensor<Engine, Layout>&& t) {
  return cute::make_tensor(t.data(), acc_layout_rows_cols(t.layout()));
}
template <class Engine, class Layout>
__host__ __device__ auto as_rows_cols(cute::Tensor<Engine, Layout>& t) {
  return cute::make_tensor(t.data(), acc_layout_rows_cols(t.layout()));
}

// Two neighbouring 16x8 accumulator tiles along N are exactly the registers of one 16x16
// A operand of the next m16n8k16 MMA: ((2, 2), MMA_M, MMA_N) -> ((2, 2, 2), MMA_M, MMA_N / 2).
template <class Layout>
__host__ __device__ constexpr auto acc_layout_as_operand_a(Layout acc) {
  using namespace cute;
  static_assert(decltype(rank(acc))::value == 3);
  static_assert(decltype(size<2>(acc))::value % 2 == 0);
  auto split = logical_divide(acc, Shape<Underscore, Underscore, _2>{});  // ((2,2), MMA_M, (2, MMA_N/2))
  return make_layout(make_layout(get<0>(split), get<2, 0>(split)), get<1>(split), get<2, 1>(split));
}

// Converts a register fragment to another element type, pairwise where the hardware allows.
template <class To, class Engine, class Layout>
__device__ __forceinline__ auto convert_fragment(cute::Tensor<Engine, Layout> const& src) {
  using From = typename Engine::value_type;
  constexpr int kSize = decltype(cute::size(src))::value;
  static_assert(decltype(cute::cosize(Layout{}))::value == kSize, "fragment must be compact");
  auto dst = cute::make_tensor<To>(src.layout());
  cutlass::NumericArrayConverter<To, From, kSize> convert;
  *reinterpret_cast<cutlass::Array<To, kSize>*>(dst.data()) =
      convert(*reinterpret_cast<cutlass::Array<From, kSize> const*>(src.data()));
  return dst;
}

// The four threads of a quad hold one accumulator row between them.
__device__ __forceinline__ float quad_max(float x) {
  x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 2));
  return fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 1));
}
__device__ __forceinline__ float quad_sum(float x) {
  x += __shfl_xor_sync(0xffffffffu, x, 2);
  return x + __shfl_xor_sync(0xffffffffu, x, 1);
}

}  // namespace flash_cutlass
