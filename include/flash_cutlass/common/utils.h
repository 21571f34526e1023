// Small CuTe helpers shared by the kernels: global views of one head, fragment re-layouts, type
// conversion, quad reductions.
#pragma once

#include <type_traits>

#include <cute/tensor.hpp>
#include <cutlass/array.h>
#include <cutlass/numeric_conversion.h>
#include <cutlass/numeric_types.h>

#include "flash_cutlass/params.h"

namespace flash_cutlass {

template <DType kDType> struct ElementOf;
template <> struct ElementOf<DType::kFloat16> { using type = cutlass::half_t; };
template <> struct ElementOf<DType::kBFloat16> { using type = cutlass::bfloat16_t; };

// The K/V head that query head `head` reads (GQA: heads / heads_k query heads share one).
__device__ __forceinline__ int kv_head_of(int head, FwdParams const& params) {
  return head / (params.heads / params.heads_k);
}

// The (rows, kHeadDim) matrix of one (sequence, head) of a (batch, seqlen, heads, head_dim) or
// packed (total, heads, head_dim) tensor in global memory: the sequence's first row at element
// `offset` (Sequence::q_offset / k_offset), rows row_stride apart, columns contiguous.
template <class Element, int kHeadDim, class Pointer>
__device__ __forceinline__ auto head_matrix(Pointer base, int64_t offset, int head, int64_t head_stride, int rows,
                                            int64_t row_stride) {
  using namespace cute;
  using Value = std::conditional_t<std::is_const_v<std::remove_pointer_t<Pointer>>, Element const, Element>;
  return make_tensor(make_gmem_ptr(static_cast<Value*>(base) + offset + head * head_stride),
                     make_shape(rows, Int<kHeadDim>{}), make_stride(row_stride, _1{}));
}

// Which columns of a thread's global copies (coords: the copy's partition of an identity tile,
// (CPY, CPY_M, CPY_K)) lie below head_dim; the same for every row and every tile of that width.
template <class Coords>
__device__ __forceinline__ auto columns_below(Coords const& coords, int head_dim) {
  using namespace cute;
  Tensor ok = make_tensor<bool>(make_shape(size<2>(coords)));
  CUTE_UNROLL
  for (int k = 0; k < size(ok); ++k) ok(k) = get<1>(coords(0, 0, k)) < head_dim;
  return ok;
}

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
