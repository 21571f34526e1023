// Copies both kernel paths' backward (and the sm80 path's forward) use between global memory,
// shared memory and registers: cp.async tile loads with zero fill, and row-wise stores and atomic
// adds of MMA accumulators.
#pragma once

#include <cstdint>

#include <cute/tensor.hpp>
#include <cutlass/array.h>
#include <cutlass/numeric_conversion.h>

namespace flash_cutlass {

// Global -> shared copy of one tile with 16-byte cp.async. Columns past the real head dim
// (col_ok false) and, with kCheckRows, rows at or past `rows_left` are zero-filled by the same
// cp.async (source size 0) instead: V rows must never hold NaN garbage, since 0 * NaN would leak
// into O. One instruction per copy either way: no separate shared-memory stores of zeros.
template <bool kCheckRows, class TiledCopy, class Src, class Dst, class Coords, class ColOk>
__device__ __forceinline__ void copy_tile_async(TiledCopy const& tiled_copy, Src const& src, Dst&& dst,
                                                Coords const& coords, ColOk const& col_ok, int rows_left) {
  using namespace cute;
  CUTE_UNROLL
  for (int m = 0; m < size<1>(src); ++m) {
    const bool row_ok = !kCheckRows || get<0>(coords(0, m, 0)) < rows_left;
    CUTE_UNROLL
    for (int k = 0; k < size<2>(src); ++k) {
      copy(tiled_copy.with(row_ok && col_ok(k)), src(_, m, k), dst(_, m, k));
    }
  }
}

// Register -> global copy of one tile; rows at or past rows_left and masked columns are skipped.
template <class TiledCopy, class Src, class Dst, class Coords, class ColOk>
__device__ __forceinline__ void store_tile(TiledCopy const& tiled_copy, Src const& src, Dst&& dst,
                                           Coords const& coords, ColOk const& col_ok, int rows_left) {
  using namespace cute;
  CUTE_UNROLL
  for (int m = 0; m < size<1>(src); ++m) {
    if (get<0>(coords(0, m, 0)) < rows_left) {
      CUTE_UNROLL
      for (int k = 0; k < size<2>(src); ++k) {
        if (col_ok(k)) copy(tiled_copy, src(_, m, k), dst(_, m, k));
      }
    }
  }
}

// Copies 4 bytes from global to shared memory with cp.async; with src_bytes 0, writes zero.
__device__ __forceinline__ void cp_async_4(float* smem, const float* gmem, int src_bytes) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(cute::cast_smem_ptr_to_uint(smem)),
               "l"(gmem), "r"(src_bytes));
}

// Copies 16 bytes from global to shared memory with cp.async, bypassing L1 (streamed data); with
// `valid` false, writes 16 zero bytes and reads nothing (gmem must still be a valid address).
__device__ __forceinline__ void cp_async_16(void* smem, const void* gmem, bool valid) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(cute::cast_smem_ptr_to_uint(smem)),
               "l"(gmem), "r"(valid ? 16 : 0));
}

// Adds each pair of neighbouring fp32 columns of acc (tiled MMA C layout: values 2i and 2i+1 of a
// thread are adjacent columns of one row) into dst[row * row_stride + col] with atomics; rows at
// or past rows_left are skipped.
template <class Acc, class Coords>
__device__ __forceinline__ void atomic_add_rows(float* dst, int64_t row_stride, Acc const& acc, Coords const& coords,
                                                int rows_left) {
  using namespace cute;
  CUTE_UNROLL
  for (int i = 0; i < size(acc); i += 2) {
    const int row = get<0>(coords(i));
    if (row < rows_left) {
      float* p = dst + int64_t(row) * row_stride + get<1>(coords(i));
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
      atomicAdd(reinterpret_cast<float2*>(p), make_float2(acc(i), acc(i + 1)));
#else
      atomicAdd(p, acc(i));
      atomicAdd(p + 1, acc(i + 1));
#endif
    }
  }
}

// Stores acc * scale (pairs of neighbouring columns, as above) as To into
// dst[row * row_stride + col] for rows below rows_left and columns below cols.
template <class To, class Acc, class Coords>
__device__ __forceinline__ void store_rows(To* dst, int64_t row_stride, Acc const& acc, float scale,
                                           Coords const& coords, int rows_left, int cols) {
  using namespace cute;
  CUTE_UNROLL
  for (int i = 0; i < size(acc); i += 2) {
    const int row = get<0>(coords(i));
    const int col = get<1>(coords(i));
    if (row < rows_left && col < cols) {
      cutlass::Array<float, 2> pair;
      pair[0] = acc(i) * scale;
      pair[1] = acc(i + 1) * scale;
      *reinterpret_cast<cutlass::Array<To, 2>*>(dst + int64_t(row) * row_stride + col) =
          cutlass::NumericArrayConverter<To, float, 2>{}(pair);
    }
  }
}

}  // namespace flash_cutlass
