// The closed form of a 128-byte-swizzled fp32 tile's offsets for a thread's wgmma accumulator
// elements: the Hopper backward stages dQ in such a tile for the dQ warp's TMA reduce-add
// (bwd_mainloop.h), and a GQA call's dK and dV for theirs (bwd_epilogue.h).
#pragma once

#include <cute/tensor.hpp>

namespace flash_cutlass::sm90 {

// Where a thread's accumulator elements go in a 128-byte-swizzled fp32 tile of kBlockM rows (atoms
// of 8 rows x 32 floats, column-major over the tile): element (row, col) sits at
//   (col / 32) kBlockM 32 + (row / 8) 256 + (row % 8) 32 + 4 (((col % 32) / 4) ^ (row % 8)) + col % 4.
// A thread's elements are (row0 + dr, col0 + dc) with dr, dc multiples of 8 known at compile time
// and col0 % 32 < 8 (the wgmma C layout), so the XOR splits over disjoint bits: every offset is a
// per-thread base plus an immediate plus one of four per-thread terms 4 ((2 jj) ^ (row0 & 6)),
// jj = (dc % 32) / 8. Computed from cute's layout instead, ptxas kept one address register per
// store (16 at head dim 128). tools/check_dq_offsets.cu checks this form against cute's.
template <int kBlockM>
struct Fp32TileOffsets {
  int base;
  int row_bits;  // (row0 % 8) & 6

  CUTE_HOST_DEVICE Fp32TileOffsets(int row0, int col0)
      : base((col0 / 32) * (kBlockM * 32) + (row0 / 8) * 256 + (row0 % 8) * 32 + (col0 % 4) +
             4 * ((((col0 % 32) / 4) & 1) ^ (row0 % 8 & 1))),
        row_bits(row0 % 8 & 6) {}

  // dr, dc: the element's distance from (row0, col0), multiples of 8.
  CUTE_HOST_DEVICE int operator()(int dr, int dc) const { return with_xor_bits(dr, dc, row_bits); }

  // The same with the 16-byte unit's XOR term taken from `xor_bits` instead of row_bits
  // (store_fp32_tile's permuted column blocks).
  CUTE_HOST_DEVICE int with_xor_bits(int dr, int dc, int xor_bits) const {
    return base + (dc / 32) * (kBlockM * 32) + (dr / 8) * 256 + 4 * ((2 * ((dc % 32) / 8)) ^ xor_bits);
  }
};

// store_fp32_tile's permutation f of the column blocks of row `row` (below).
CUTE_HOST_DEVICE int fp32_tile_store_permutation(int row) {
  const int r = row % 8;
  return (r & 3) ^ (r >> 1);
}

// Stores a thread's fp32 wgmma accumulator fragment into a 128-byte-swizzled fp32 tile of kBlockM
// rows, 64 bits a store, without bank conflicts. `coords`: each element's (row, column) in the tile
// less `col_offset`. A warp's 64-bit store of one 8-column block (8 rows of 32 bytes) goes a
// half-warp (4 rows) at a time, and in this swizzle rows r and r ^ 1 put the same block on the same
// two 16-byte units: 2-way conflicts. So within each 32-column chunk, the store that writes block k
// of the others writes block k ^ f in row r (f = (r & 3) ^ (r >> 1), r = row % 8): the 16-byte
// unit pair it lands on is then k ^ (r & 3), distinct over a half-warp's rows. The values follow
// by two selects per element.
template <int kBlockM, class Acc, class Coords>
CUTE_HOST_DEVICE void store_fp32_tile(float* tile, Acc const& acc, Coords const& coords, int col_offset) {
  using namespace cute;
  // wgmma's C fragment: ((2 columns, 2 rows 8 apart, column blocks of 8), MMA_M, MMA_N), so that an
  // element's column block within its 32-column chunk is bits 2-3 of its index.
  static_assert(decltype(rank(shape<0>(acc)))::value == 3 && decltype(size<0, 0>(acc))::value == 2 &&
                decltype(size<0, 1>(acc))::value == 2 && decltype(size<0, 2>(acc))::value % 4 == 0);
  const int row0 = get<0>(coords(0)), col0 = get<1>(coords(0)) - col_offset;
  const Fp32TileOffsets<kBlockM> offset_of(row0, col0);
  const int f = fp32_tile_store_permutation(row0);
  // The slot of block k stores block k ^ f: its XOR term 4 ((2 (k ^ f)) ^ row_bits).
  const int permuted_bits = offset_of.row_bits ^ (2 * f);
  constexpr int kElements = decltype(size(acc))::value;
  float swapped[kElements], permuted[kElements];
  CUTE_UNROLL
  for (int i = 0; i < kElements; ++i) swapped[i] = (f & 1) ? acc(i ^ 4) : acc(i);
  CUTE_UNROLL
  for (int i = 0; i < kElements; ++i) permuted[i] = (f & 2) ? swapped[i ^ 8] : swapped[i];
  CUTE_UNROLL
  for (int i = 0; i < kElements; i += 2) {
    const int offset = offset_of.with_xor_bits(get<0>(coords(i)) - row0, get<1>(coords(i)) - get<1>(coords(0)),
                                               permuted_bits);
    *reinterpret_cast<float2*>(tile + offset) = make_float2(permuted[i], permuted[i + 1]);
  }
}

}  // namespace flash_cutlass::sm90
