// Zeroing rows of a tile that TMA left in shared memory in one of GMMA's swizzled layouts:
// the rows a variable-length call reads past a sequence's end. There TMA reads the next sequence,
// whose values (a NaN or an Inf) must not reach this one through a GEMM's 0 * x.
#pragma once

#include <cute/tensor.hpp>

namespace flash_cutlass::sm90 {

// Zeroes rows [first_row, end_row) of the (rows, kColumns[, stage]) tile at `tile`, laid out by
// `layout` (one of GMMA's K-major swizzled layouts), the kThreads callers (thread_idx in
// [0, kThreads)) sharing its 16-byte units. The swizzle permutes the 16-byte units of a row's
// segments (128, 64 or 32 bytes, the swizzle's span) among themselves, so zeroing each segment's
// units at their unswizzled places zeroes the row. `stage` completes the coordinate for a layout
// with a third mode.
template <int kColumns, int kThreads, class Element, class SwizzledLayout, class... Stage>
__device__ __forceinline__ void zero_tile_rows(Element* tile, SwizzledLayout layout, int first_row, int end_row,
                                               int thread_idx, Stage... stage) {
  using Swizzle = decltype(cute::get_swizzle_portion(layout));  // on byte offsets
  constexpr int kUnitElems = (1 << Swizzle::num_base) / int(sizeof(Element));
  constexpr int kSegmentElems = kUnitElems << Swizzle::num_bits;
  constexpr int kUnitsPerSegment = kSegmentElems / kUnitElems;
  constexpr int kUnitsPerRow = kColumns / kUnitElems;
  static_assert(kUnitElems * int(sizeof(Element)) == 16, "16-byte swizzle units");
  static_assert(kColumns % kSegmentElems == 0, "rows of whole swizzle segments");
  const auto unswizzled = cute::get_nonswizzle_portion(layout);
  for (int unit = thread_idx; unit < (end_row - first_row) * kUnitsPerRow; unit += kThreads) {
    const int row = first_row + unit / kUnitsPerRow;
    const int unit_in_row = unit % kUnitsPerRow;
    const int segment_start = int(unswizzled(row, (unit_in_row / kUnitsPerSegment) * kSegmentElems, stage...));
    *reinterpret_cast<uint4*>(tile + segment_start + (unit_in_row % kUnitsPerSegment) * kUnitElems) =
        make_uint4(0, 0, 0, 0);
  }
}

}  // namespace flash_cutlass::sm90
