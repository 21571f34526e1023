// Zeroing rows of a tile that TMA left in shared memory in one of GMMA's 128-byte-swizzled layouts:
// the rows a variable-length call reads past a sequence's end. There TMA reads the next sequence,
// whose values (a NaN or an Inf) must not reach this one through a GEMM's 0 * x.
#pragma once

#include <cute/tensor.hpp>

namespace flash_cutlass::sm90 {

// Zeroes rows [first_row, end_row) of the (rows, kColumns[, stage]) tile at `tile`, laid out by
// `layout` (rows of 128-byte segments, 128-byte swizzled), the kThreads callers (thread_idx in
// [0, kThreads)) sharing its 16-byte units. The swizzle permutes the 16-byte units of a 128-byte
// segment among themselves, so zeroing a row's segments at their unswizzled places zeroes the row.
// `stage` completes the coordinate for a layout with a third mode.
template <int kColumns, int kThreads, class Element, class SwizzledLayout, class... Stage>
__device__ __forceinline__ void zero_tile_rows(Element* tile, SwizzledLayout layout, int first_row, int end_row,
                                               int thread_idx, Stage... stage) {
  constexpr int kSegmentElems = 128 / int(sizeof(Element));
  constexpr int kUnitElems = 16 / int(sizeof(Element));
  constexpr int kUnitsPerSegment = kSegmentElems / kUnitElems;
  constexpr int kUnitsPerRow = kColumns / kUnitElems;
  static_assert(kColumns % kSegmentElems == 0, "rows of whole 128-byte segments");
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
