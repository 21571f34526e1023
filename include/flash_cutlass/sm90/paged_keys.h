// Where a paged forward's keys and values lie (FwdParams::paged_block_table): a sequence's key
// through its block-table row, and where one box of a K/V stage goes in shared memory.
#pragma once

#include <cute/tensor.hpp>

#include "flash_cutlass/params.h"

namespace flash_cutlass::sm90 {

// The cache row of key `key` (below the sequence's length, so within its block-table row) of the
// variable-length call's sequence `sequence` (2 b: batch b's), its page clamped into the cache.
__device__ __forceinline__ int paged_key_row(FwdParams const& params, int sequence, int key) {
  const int* table = params.paged_block_table + int64_t(sequence >> 1) * params.paged_block_table_stride;
  const int page = min(max(table[key / params.paged_page_size], 0), params.paged_pages - 1);
  return page * params.paged_page_size + key % params.paged_page_size;
}

// The element offset, in a K/V stage layout tiled from GMMA's swizzle atoms (8 rows of one swizzle
// span each, stacked down a stage), of the atom whose first element is (row, col, stage): the
// origin of one TMA box of whole atoms. An atom's origin is aligned to the atom's bytes, so the
// swizzle leaves it in place and TMA's own swizzle of the box (by address bits) lays it out as the
// atoms do.
template <class SwizzledLayout>
__host__ __device__ constexpr int box_origin(SwizzledLayout layout, int row, int col, int stage) {
  return int(cute::get_nonswizzle_portion(layout)(row, col, stage));
}

}  // namespace flash_cutlass::sm90
