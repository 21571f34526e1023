// Host-only check that Fp32TileOffsets (include/flash_cutlass/sm90/fp32_tile_offsets.h) gives cute's
// offsets of a 128-byte-swizzled fp32 tile for every element of every consumer thread of the
// Hopper backward's wgmma accumulators staged in one: dQ at head dims 64/128 (64- and 128-row
// query blocks, one tile of every column) and in the head-split layout at 256, where each
// warpgroup stages its half of the columns (a 64 x 128 tile, the thread's columns less 128 per
// warpgroup); and a GQA call's dK/dV tile (bwd_epilogue.h), 128 keys x 64/128 with the warpgroups
// along the keys, 64 keys x 192/256 with them along the head dim. Build and run:
//   nvcc -std=c++17 -I<cutlass>/include -Iinclude tools/check_dq_offsets.cu -o /tmp/check && /tmp/check
// It prints the mismatches per configuration (all 0 when the closed form holds). Then
// store_fp32_tile's stores of the dQ tiles: every element where cute's layout puts it, and the
// shared-memory wavefronts of each warp's 64-bit store above one a half-warp (0 without bank
// conflicts). Exits 1 on any mismatch or excess wavefront (tests/test_dq_offsets.py runs it).
#include <cute/tensor.hpp>
#include <cute/atom/mma_traits_sm90_gmma.hpp>
#include <cstdio>
#include <vector>
#include "flash_cutlass/sm90/fp32_tile_offsets.h"
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
// store_fp32_tile on the dQ tiles: returns misplaced elements, and counts in `excess` the wavefronts
// above one per half-warp and store.
template <int kBlockM, int kHeadDim, bool kHalves = false>
int run_store(int& excess) {
  constexpr int kBlockN = kHalves ? 64 : 128;
  constexpr int kTileColumns = kHalves ? kHeadDim / 2 : kHeadDim;
  using TileQ = Shape<Int<kBlockM>, Int<kHeadDim>>;
  using PerWG = Shape<Int<kBlockM>, Int<kHeadDim / 2>, Int<kBlockN>>;
  using Mma = decltype(make_tiled_mma(GMMA::ss_op_selector<Elem, Elem, float, PerWG, GMMA::Major::MN, GMMA::Major::MN>(),
                                      Layout<Shape<_1, _2, _1>>{}));
  using L = decltype(tile_to_shape(GMMA::Layout_K_SW128_Atom<float>{}, Shape<Int<kBlockM>, Int<kTileColumns>>{}));
  constexpr int kElements = kBlockM * kTileColumns;
  alignas(1024) static float tile[kElements];
  // Offsets through a shared-memory tensor: the atom's swizzle is defined on its 16-bit units, so
  // L{}(r, c) alone is not an fp32 element's offset.
  auto stile = make_tensor(make_smem_ptr(tile), L{});
  auto offset_of = [&](int r, int c) { return int(&stile(r, c) - tile); };
  Mma mma;
  int bad = 0;
  excess = 0;
  // offsets[thread][store]: where each 64-bit store of a thread went.
  std::vector<std::vector<int>> offsets(256);
  for (int t = 0; t < 256; ++t) {
    auto thr = mma.get_thread_slice(t);
    auto coords = thr.partition_C(make_identity_tensor(TileQ{}));
    auto acc = partition_fragment_C(mma, TileQ{});
    const int column_shift = kHalves ? (t / 128) * kTileColumns : 0;
    for (int i = 0; i < size(acc); ++i) acc(i) = float(get<0>(coords(i)) * 1024 + get<1>(coords(i)) - column_shift);
    for (int i = 0; i < kElements; ++i) tile[i] = -1.f;
    flash_cutlass::sm90::store_fp32_tile<kBlockM>(tile, acc, coords, column_shift);
    for (int i = 0; i < size(acc); ++i) {
      const int r = get<0>(coords(i)), c = get<1>(coords(i)) - column_shift;
      if (tile[offset_of(r, c)] != float(r * 1024 + c)) ++bad;
    }
    // Store i / 2 writes element i ^ 4 f (store_fp32_tile's permutation f of the column blocks):
    // where that element sits is the store's offset.
    const int f = flash_cutlass::sm90::fp32_tile_store_permutation(get<0>(coords(0)));
    offsets[t].resize(size(acc) / 2);
    for (int i = 0; i < size(acc); i += 2) {
      const int j = i ^ (4 * f);
      const int r = get<0>(coords(j)), c = get<1>(coords(j)) - column_shift;
      offsets[t][i / 2] = offset_of(r, c);
    }
  }
  for (int warp = 0; warp < 8; ++warp) {
    for (size_t s = 0; s < offsets[0].size(); ++s) {
      for (int half = 0; half < 2; ++half) {
        int words_in_bank[32][16], count[32] = {};
        for (int lane = half * 16; lane < half * 16 + 16; ++lane) {
          const int offset = offsets[warp * 32 + lane][s];
          for (int w = 0; w < 2; ++w) {
            const int word = offset + w, bank = word % 32;
            bool seen = false;
            for (int k = 0; k < count[bank]; ++k) seen |= words_in_bank[bank][k] == word;
            if (!seen) words_in_bank[bank][count[bank]++] = word;
          }
        }
        int wavefronts = 0;
        for (int b = 0; b < 32; ++b) wavefronts = count[b] > wavefronts ? count[b] : wavefronts;
        excess += wavefronts - 1;
      }
    }
  }
  return bad;
}

int main() {
  int e0, e1, e2, e3, e4;
  const int b0 = run_store<64, 64>(e0), b1 = run_store<64, 128>(e1), b2 = run_store<128, 64>(e2),
            b3 = run_store<64, 256, true>(e3), b4 = run_store<64, 192, true>(e4);
  printf("store_fp32_tile misplaced / excess wavefronts: 64x64 %d / %d, 64x128 %d / %d, 128x64 %d / %d, "
         "64x256 in halves %d / %d, 64x192 in halves %d / %d\n", b0, e0, b1, e1, b2, e2, b3, e3, b4, e4);
  const int q[5] = {run<64, 64>(), run<64, 128>(), run<128, 64>(), run<128, 128>(), run<64, 256, true>()};
  printf("dQ: 64x64 %d 64x128 %d 128x64 %d 128x128 %d 64x256 in halves %d\n", q[0], q[1], q[2], q[3], q[4]);
  const int kv[4] = {run<128, 64, false, true>(), run<128, 128, false, true>(), run<64, 192>(), run<64, 256>()};
  printf("dK/dV: 128x64 %d 128x128 %d 64x192 %d 64x256 %d\n", kv[0], kv[1], kv[2], kv[3]);
  int failures = b0 + b1 + b2 + b3 + b4 + e0 + e1 + e2 + e3 + e4;
  for (int v : q) failures += v;
  for (int v : kv) failures += v;
  return failures == 0 ? 0 : 1;
}
