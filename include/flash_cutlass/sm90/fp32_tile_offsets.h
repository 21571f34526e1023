// The closed form of a 128-byte-swizzled fp32 tile's offsets for a thread's wgmma accumulator
// elements: the Hopper backward stages dQ in such a tile for the dQ warp's TMA reduce-add
// (bwd_mainloop.h), and a GQA call's dK and dV for theirs (bwd_epilogue.h).
#pragma once

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

  __device__ __forceinline__ Fp32TileOffsets(int row0, int col0)
      : base((col0 / 32) * (kBlockM * 32) + (row0 / 8) * 256 + (row0 % 8) * 32 + (col0 % 4) +
             4 * ((((col0 % 32) / 4) & 1) ^ (row0 % 8 & 1))),
        row_bits(row0 % 8 & 6) {}

  // dr, dc: the element's distance from (row0, col0), multiples of 8.
  __device__ __forceinline__ int operator()(int dr, int dc) const {
    return base + (dc / 32) * (kBlockM * 32) + (dr / 8) * 256 + 4 * ((2 * ((dc % 32) / 8)) ^ row_bits);
  }
};

}  // namespace flash_cutlass::sm90
