// Everything the sm80-path forward kernel derives from (head dim, tile sizes, warps, dtype):
// MMA, shared-memory layouts, copies and the shared-memory size; the tile shapes the backward's
// traits (bwd_kernel.h) share.
#pragma once

#include <type_traits>

#include <cute/tensor.hpp>
#include <cutlass/numeric_types.h>

namespace flash_cutlass::sm80 {

// Row-major tile whose rows are padded by 16 bytes: consecutive rows start 4 banks apart, so
// the 8 row addresses of one ldmatrix, and a warp's 16-byte cp.async stores, hit distinct banks.
// The one place to try a swizzled layout instead.
template <int kRows, int kCols>
using PaddedRowMajor = cute::Layout<cute::Shape<cute::Int<kRows>, cute::Int<kCols>>,
                                    cute::Stride<cute::Int<kCols + 8>, cute::_1>>;

// The tiles of a kernel with kBlockM query rows and kBlockN keys per step: Q, O and dQ (kBlockM x
// kHeadDim), K, V, dK and dV (kBlockN x kHeadDim), S, P, dP and dS (kBlockM x kBlockN).
template <int kBlockM, int kBlockN, int kHeadDim>
struct TileShapes {
  using TileQ = cute::Shape<cute::Int<kBlockM>, cute::Int<kHeadDim>>;
  using TileKV = cute::Shape<cute::Int<kBlockN>, cute::Int<kHeadDim>>;
  using TileS = cute::Shape<cute::Int<kBlockM>, cute::Int<kBlockN>>;
};

template <int kHeadDim_, int kBlockM_, int kBlockN_, int kWarps_, class Element_>
struct FwdKernelTraits : TileShapes<kBlockM_, kBlockN_, kHeadDim_> {
  using Element = Element_;
  static_assert(std::is_same_v<Element, cutlass::half_t> || std::is_same_v<Element, cutlass::bfloat16_t>);

  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kBlockM = kBlockM_;
  static constexpr int kBlockN = kBlockN_;
  static constexpr int kWarps = kWarps_;
  static constexpr int kThreads = kWarps * 32;

  static_assert(kHeadDim % 32 == 0 && kHeadDim <= 256);
  // Warps split the query rows; each warp owns whole rows (row reductions stay in a quad).
  static_assert(kBlockM % (16 * kWarps) == 0);
  static_assert(kBlockN % 16 == 0);

  using MmaOp = std::conditional_t<std::is_same_v<Element, cutlass::half_t>,
                                   cute::SM80_16x8x16_F32F16F16F32_TN,
                                   cute::SM80_16x8x16_F32BF16BF16F32_TN>;
  // N tile of 16 = two n8 atoms per warp, so B operands load with ldmatrix.x4.
  using TiledMma = cute::TiledMMA<cute::MMA_Atom<MmaOp>,
                                  cute::Layout<cute::Shape<cute::Int<kWarps>, cute::_1, cute::_1>>,
                                  cute::Tile<cute::Int<16 * kWarps>, cute::_16, cute::_16>>;

  using SmemLayoutQ = PaddedRowMajor<kBlockM, kHeadDim>;
  using SmemLayoutKV = PaddedRowMajor<kBlockN, kHeadDim>;  // one K and one V buffer
  // The same V storage seen as V^T (head_dim, kBlockN): the B operand of P.V.
  using SmemLayoutVt = decltype(cute::select<1, 0>(SmemLayoutKV{}));
  using SmemLayoutO = SmemLayoutQ;  // O is staged in Q's storage for the epilogue

  using SmemCopyAtom = cute::Copy_Atom<cute::SM75_U32x4_LDSM_N, Element>;
  using SmemCopyAtomTransposed = cute::Copy_Atom<cute::SM75_U16x8_LDSM_T, Element>;
  using SmemCopyAtomO = cute::Copy_Atom<cute::AutoVectorizingCopyWithAssumedAlignment<32>, Element>;

  // Global <-> shared: 16 bytes (8 elements) per thread per copy. Four threads cover 32 columns
  // (64 contiguous bytes of a row) and repeat across the head dim, so a thread's copies in a row
  // sit at compile-time offsets from one row address: few 64-bit addresses stay live in the loop.
  static constexpr int kGmemElemsPerCopy = 16 / sizeof(Element);
  static constexpr int kGmemColsPerPass = 32;
  static constexpr int kGmemThreadsPerRow = kGmemColsPerPass / kGmemElemsPerCopy;
  static_assert(kThreads % kGmemThreadsPerRow == 0);
  static constexpr int kGmemRowsPerPass = kThreads / kGmemThreadsPerRow;
  static_assert(kBlockM % kGmemRowsPerPass == 0 && kBlockN % kGmemRowsPerPass == 0);
  using GmemThreadLayout = cute::Layout<cute::Shape<cute::Int<kGmemRowsPerPass>, cute::Int<kGmemThreadsPerRow>>,
                                        cute::Stride<cute::Int<kGmemThreadsPerRow>, cute::_1>>;
  using GmemValueLayout = cute::Layout<cute::Shape<cute::_1, cute::Int<kGmemElemsPerCopy>>>;
  using GmemTiledCopyQKV = decltype(cute::make_tiled_copy(
      cute::Copy_Atom<cute::SM80_CP_ASYNC_CACHEGLOBAL_ZFILL<cute::uint128_t>, Element>{},
      GmemThreadLayout{}, GmemValueLayout{}));
  using GmemTiledCopyO = decltype(cute::make_tiled_copy(
      cute::Copy_Atom<cute::UniversalCopy<cute::uint128_t>, Element>{}, GmemThreadLayout{}, GmemValueLayout{}));

  static constexpr int kSmemElemsQ = cute::cosize_v<SmemLayoutQ>;
  static constexpr int kSmemElemsKV = cute::cosize_v<SmemLayoutKV>;
  static constexpr int kSmemBytes = (kSmemElemsQ + 2 * kSmemElemsKV) * int(sizeof(Element));
  static_assert(kSmemBytes <= 227 * 1024, "tile does not fit in shared memory");
};

// Tile sizes per head dim. Up to head dim 128, 4 warps own 32 query rows each and two CTAs share
// a Hopper SM (registers bound it: the S and O accumulators stay in fp32). Head dims 32 and 64
// run 128x128 tiles: against 128x64 they measured 4-11% faster on the H200 despite spilling
// (docs/PERFORMANCE.md, v3). Head dims 192 and 256 use 8 warps of 16 rows, one CTA per SM.
template <int kHeadDim>
struct FwdTileSizes;
template <> struct FwdTileSizes<32>  { static constexpr int kBlockM = 128, kBlockN = 128, kWarps = 4; };
template <> struct FwdTileSizes<64>  { static constexpr int kBlockM = 128, kBlockN = 128, kWarps = 4; };
template <> struct FwdTileSizes<96>  { static constexpr int kBlockM = 128, kBlockN = 64,  kWarps = 4; };
template <> struct FwdTileSizes<128> { static constexpr int kBlockM = 128, kBlockN = 64,  kWarps = 4; };
template <> struct FwdTileSizes<192> { static constexpr int kBlockM = 128, kBlockN = 64,  kWarps = 8; };
template <> struct FwdTileSizes<256> { static constexpr int kBlockM = 128, kBlockN = 64,  kWarps = 8; };

template <int kHeadDim, class Element>
using FwdTraitsFor = FwdKernelTraits<kHeadDim, FwdTileSizes<kHeadDim>::kBlockM, FwdTileSizes<kHeadDim>::kBlockN,
                                     FwdTileSizes<kHeadDim>::kWarps, Element>;

// The tiles of tier kTier (FwdParams::sm80_tile_tier): 0 FwdTraitsFor; 1, for GPUs that allow a
// block 99 KiB of shared memory (sm_86, sm_89, sm_120) where FwdTraitsFor's exceed it (head dims 192
// and 256), 64 query rows of 4 warps. void where a head dim has no such tier.
template <int kHeadDim, int kTier, class Element>
struct FwdTierTraitsSelect {
  using type = void;
};
template <int kHeadDim, class Element>
struct FwdTierTraitsSelect<kHeadDim, 0, Element> { using type = FwdTraitsFor<kHeadDim, Element>; };
template <class Element>
struct FwdTierTraitsSelect<192, 1, Element> { using type = FwdKernelTraits<192, 64, 64, 4, Element>; };
template <class Element>
struct FwdTierTraitsSelect<256, 1, Element> { using type = FwdKernelTraits<256, 64, 64, 4, Element>; };
template <int kHeadDim, int kTier, class Element>
using FwdTraitsOfTier = typename FwdTierTraitsSelect<kHeadDim, kTier, Element>::type;

}  // namespace flash_cutlass::sm80
