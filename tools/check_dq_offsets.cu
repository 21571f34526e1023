// Host-only check that Fp32TileOffsets (include/flash_cutlass/sm90/fp32_tile_offsets.h) gives cute's
// offsets of a 128-byte-swizzled fp32 tile for every element of every consumer thread of the
// Hopper backward's wgmma accumulators staged in one: dQ at head dims 64/128 (64- and 128-row
// query blocks, one tile of every column) and in the head-split layout at 256, where each
// warpgroup stages its half of the columns (a 64 x 128 tile, the thread's columns less 128 per
// warpgroup); and a GQA call's dK/dV tile (bwd_epilogue.h), 128 keys x 64/128 with the warpgroups
// along the keys, 64 keys x 192/256 with them along the head dim. Build and run:
//   nvcc -std=c++17 -I<cutlass>/include tools/check_dq_offsets.cu -o /tmp/check && /tmp/check
// It prints the mismatches per configuration (all 0 when the closed form holds).
#include <cute/tensor.hpp>
#include <cute/atom/mma_traits_sm90_gmma.hpp>
#include <cstdio>
using namespace cute;
using Elem = cutlass::bfloat16_t;

// kHalves: the staged tile holds one warpgroup's half of the columns (the head-split layout).
// kAlongRows: the two warpgroups split the rows (the dK/dV MMA of head dims 64/128), else the columns.
template <int kBlockM, int kHeadDim, bool kHalves = false, bool kAlongRows = false>
int run() {
  constexpr int kBlockN = kHalves ? 64 : 128;
  constexpr int kTileColumns = kHalves ? kHeadDim / 2 : kHeadDim;
  using TileQ = Shape<Int<kBlockM>, Int<kHeadDim>>;
  using PerWG = std::conditional_t<kAlongRows, Shape<Int<kBlockM / 2>, Int<kHeadDim>, Int<kBlockN>>,
                                   Shape<Int<kBlockM>, Int<kHeadDim / 2>, Int<kBlockN>>>;
  using Warpgroups = std::conditional_t<kAlongRows, Layout<Shape<_2, _1, _1>>, Layout<Shape<_1, _2, _1>>>;
  using Mma = decltype(make_tiled_mma(GMMA::ss_op_selector<Elem, Elem, float, PerWG, GMMA::Major::MN, GMMA::Major::MN>(),
                                      Warpgroups{}));
  using L = decltype(tile_to_shape(GMMA::Layout_K_SW128_Atom<float>{}, Shape<Int<kBlockM>, Int<kTileColumns>>{}));
  alignas(1024) static float buf[kBlockM * kTileColumns];
  auto sdq = make_tensor(make_smem_ptr(buf), L{});
  Mma mma;
  int bad = 0;
  for (int t = 0; t < 256; ++t) {
    auto thr = mma.get_thread_slice(t);
    auto coords = thr.partition_C(make_identity_tensor(TileQ{}));
    const int column_shift = kHalves ? (t / 128) * kTileColumns : 0;
    const int rb = get<0>(coords(0)), cb = get<1>(coords(0)) - column_shift;
    const int r8 = rb % 8;
    const int base = (cb / 32) * (kBlockM * 32) + (rb / 8) * 256 + r8 * 32 + (cb % 4) + 4 * ((((cb % 32) / 4) & 1) ^ (r8 & 1));
    for (int i = 0; i < size(coords); i += 2) {
      const int r = get<0>(coords(i)), c = get<1>(coords(i)) - column_shift;
      const int dr = r - rb, dc = c - cb;
      const int jj = (dc % 32) / 8;
      const int off = base + (dc / 32) * (kBlockM * 32) + (dr / 8) * 256 + 4 * ((2 * jj) ^ (r8 & 6));
      const int want = int(&sdq(r, c) - buf);
      if (off != want || dr % 8 || dc % 8 || (cb % 32) >= 8) { if (bad < 3) printf("t %d i %d r %d c %d off %d want %d\n", t, i, r, c, off, want); ++bad; }
    }
  }
  return bad;
}
int main() {
  printf("dQ: 64x64 %d 64x128 %d 128x64 %d 128x128 %d 64x256 in halves %d\n", run<64, 64>(), run<64, 128>(),
         run<128, 64>(), run<128, 128>(), run<64, 256, true>());
  printf("dK/dV: 128x64 %d 128x128 %d 64x192 %d 64x256 %d\n", run<128, 64, false, true>(), run<128, 128, false, true>(),
         run<64, 192>(), run<64, 256>());
}
