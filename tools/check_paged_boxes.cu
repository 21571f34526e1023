// Host-only check of where the Hopper forward's producer puts a paged cache's TMA boxes
// (include/flash_cutlass/sm90/fwd_producer.h, load_tile_paged): for every head dim's K/V stage
// layout, each element (row, col, stage) sits at box_origin of its box (kPagedBoxRows rows, one
// swizzle span of columns) plus its place in the box's own layout (SmemLayoutKVBox, the layout its
// TMA descriptor writes), the origins aligned to whole swizzle atoms, and both layouts share one
// swizzle. Build and run:
//   nvcc -std=c++17 --expt-relaxed-constexpr -I<cutlass>/include -Iinclude tools/check_paged_boxes.cu -o /tmp/check && /tmp/check
// Prints the misplaced elements per head dim (all 0 when the boxes land where the consumers read)
// and exits 1 on any (tests/test_layout_checks.py runs it).
#include <cstdio>
#include <type_traits>

#include "flash_cutlass/sm90/paged_keys.h"
#include "flash_cutlass/sm90/tile_config.h"

using namespace flash_cutlass;
using namespace flash_cutlass::sm90;

template <int kHeadDim>
int misplaced_elements() {
  using Sizes = FwdTileSizes<kHeadDim>;
  using Traits = FwdTraitsFor<kHeadDim, cutlass::bfloat16_t>;
  const auto stage = cute::get_nonswizzle_portion(typename Traits::SmemLayoutKV{});
  const auto box = cute::get_nonswizzle_portion(typename Traits::SmemLayoutKVBox{});
  constexpr int kColumns = Traits::kAtomColumns;
  int misplaced = 0;
  for (int s = 0; s < Sizes::kStages; ++s) {
    for (int r = 0; r < Sizes::kBlockN; ++r) {
      for (int c = 0; c < kHeadDim; ++c) {
        const int origin = box_origin(typename Traits::SmemLayoutKV{}, r / kPagedBoxRows * kPagedBoxRows,
                                      c / kColumns * kColumns, s);
        const bool aligned = origin % (8 * kColumns) == 0;
        if (!aligned || int(stage(r, c, s)) != origin + int(box(r % kPagedBoxRows, c % kColumns))) ++misplaced;
      }
    }
  }
  using StageSwizzle = decltype(cute::get_swizzle_portion(typename Traits::SmemLayoutKV{}));
  using BoxSwizzle = decltype(cute::get_swizzle_portion(typename Traits::SmemLayoutKVBox{}));
  if (!std::is_same_v<StageSwizzle, BoxSwizzle>) ++misplaced;
  std::printf("head dim %3d: %d boxes a stage, misplaced elements %d\n", kHeadDim, Traits::kPagedBoxes, misplaced);
  return misplaced;
}

int main() {
  const int misplaced = misplaced_elements<64>() + misplaced_elements<96>() + misplaced_elements<128>() +
                        misplaced_elements<192>() + misplaced_elements<256>();
  return misplaced == 0 ? 0 : 1;
}
