// Warp-level GEMM loops of the sm80 path: operands come from shared memory through ldmatrix
// (or already sit in registers), and the ldmatrix of k-slice k+1 is issued before the MMAs of k.
#pragma once

#include <cute/tensor.hpp>

namespace flash_cutlass::sm80 {

// acc += A * B with both operands in shared memory.
template <class TiledMma, class Acc, class FragA, class FragB, class SmemA, class SmemB,
          class CopyA, class ThrCopyA, class CopyB, class ThrCopyB>
__device__ __forceinline__ void gemm_smem_smem(TiledMma& tiled_mma, Acc& acc, FragA& frag_a, FragB& frag_b,
                                               SmemA const& smem_a, SmemB const& smem_b,
                                               CopyA const& copy_a, ThrCopyA const& thr_copy_a,
                                               CopyB const& copy_b, ThrCopyB const& thr_copy_b) {
  using namespace cute;
  Tensor frag_a_view = thr_copy_a.retile_D(frag_a);
  Tensor frag_b_view = thr_copy_b.retile_D(frag_b);
  constexpr int kSlices = decltype(size<2>(frag_a))::value;
  copy(copy_a, smem_a(_, _, 0), frag_a_view(_, _, 0));
  copy(copy_b, smem_b(_, _, 0), frag_b_view(_, _, 0));
  CUTE_UNROLL
  for (int k = 0; k < kSlices; ++k) {
    if (k + 1 < kSlices) {
      copy(copy_a, smem_a(_, _, k + 1), frag_a_view(_, _, k + 1));
      copy(copy_b, smem_b(_, _, k + 1), frag_b_view(_, _, k + 1));
    }
    gemm(tiled_mma, frag_a(_, _, k), frag_b(_, _, k), acc);
  }
}

// acc += A * B with A already in registers and B in shared memory.
template <class TiledMma, class Acc, class FragA, class FragB, class SmemB, class CopyB, class ThrCopyB>
__device__ __forceinline__ void gemm_regs_smem(TiledMma& tiled_mma, Acc& acc, FragA const& frag_a, FragB& frag_b,
                                               SmemB const& smem_b, CopyB const& copy_b,
                                               ThrCopyB const& thr_copy_b) {
  using namespace cute;
  Tensor frag_b_view = thr_copy_b.retile_D(frag_b);
  constexpr int kSlices = decltype(size<2>(frag_a))::value;
  copy(copy_b, smem_b(_, _, 0), frag_b_view(_, _, 0));
  CUTE_UNROLL
  for (int k = 0; k < kSlices; ++k) {
    if (k + 1 < kSlices) copy(copy_b, smem_b(_, _, k + 1), frag_b_view(_, _, k + 1));
    gemm(tiled_mma, frag_a(_, _, k), frag_b(_, _, k), acc);
  }
}

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

}  // namespace flash_cutlass::sm80
