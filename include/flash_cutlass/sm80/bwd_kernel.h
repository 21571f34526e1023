// The sm80-path backward kernels.
//
// flash_bwd_sm80: one CTA per (key block, head, batch) keeps its K and V tiles in shared memory
//   and walks the query blocks that see them, recomputing P from Q, K and the forward's
//   log-sum-exp:
//     dV += P^T dO,  dP = dO V^T,  dS = P * (dP - D),  dK += dS^T Q,  dQ += dS K (fp32 atomics).
//   dK and dV stay in registers for the whole walk; the next query block's Q, LSE and D are
//   loaded while the current one is computed (two buffers), and its dO once the current dO has
//   been read.
// flash_bwd_dq_sm80 (deterministic mode): dQ from a CTA per query block walking the key blocks in
//   order, instead of the atomics.
// The preprocess (D = rowsum(dO * O), dq_accum zeroed) and postprocess (dQ = softmax_scale *
// dq_accum) around them are both paths': common/bwd_stages.h. No score matrix ever reaches global
// memory.
#pragma once

#include <cmath>
#include <type_traits>

#include <cute/tensor.hpp>

#include "flash_cutlass/common/block_info.h"
#include "flash_cutlass/common/bwd_key_block.h"
#include "flash_cutlass/common/copy.h"
#include "flash_cutlass/common/dropout.h"
#include "flash_cutlass/common/mask.h"
#include "flash_cutlass/common/score_mods.h"
#include "flash_cutlass/common/softmax.h"
#include "flash_cutlass/common/utils.h"
#include "flash_cutlass/compiled.h"
#include "flash_cutlass/compiled_head_dims.h"
#include "flash_cutlass/params.h"
#include "flash_cutlass/sm80/gemm.h"
#include "flash_cutlass/sm80/kernel_traits.h"

namespace flash_cutlass::sm80 {

// A TiledMMA of kWarpsM x (kWarps / kWarpsM) warps, each warp 16 x kWarpN per step (kWarpN 16: two
// n8 atoms, whose B operand loads with ldmatrix.x4; 8: one, with ldmatrix.x2).
template <class MmaOp, int kWarps, int kWarpsM, int kWarpN = 16>
using WarpGridMma = cute::TiledMMA<cute::MMA_Atom<MmaOp>,
                                   cute::Layout<cute::Shape<cute::Int<kWarpsM>, cute::Int<kWarps / kWarpsM>, cute::_1>>,
                                   cute::Tile<cute::Int<16 * kWarpsM>, cute::Int<kWarpN * (kWarps / kWarpsM)>, cute::_16>>;

// kBlockM query rows per step of the walk, kBlockN keys per CTA, 8 warps. Each GEMM has its own
// warp grid: kWarpsMSdP warps along the query rows of S and dP, kWarpsNdKV along the keys of dK
// and dV, kWarpsMdQ along the query rows of dQ (the other warps split the second dimension).
// kQBuffers: 2 loads the next query block's Q (with its LSE and D) while this one is computed; 1
// (the tiles for smaller shared memories) loads it once this block's dK has read Q, under dQ.
template <int kHeadDim_, int kBlockM_, int kBlockN_, int kWarpsMSdP, int kWarpsNdKV, int kWarpsMdQ, class Element_,
          int kQBuffers_ = 2>
struct BwdKernelTraits : TileShapes<kBlockM_, kBlockN_, kHeadDim_> {
  using Element = Element_;
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kBlockM = kBlockM_;
  static constexpr int kBlockN = kBlockN_;
  static constexpr int kQBuffers = kQBuffers_;
  static_assert(kQBuffers == 1 || kQBuffers == 2);
  static constexpr int kWarps = 8;
  static constexpr int kThreads = kWarps * 32;
  // S and dP: 16 keys a warp, or 8 where the key block is narrower than 16 a warp (32 keys).
  static constexpr int kWarpNSdP = kBlockN >= 16 * (kWarps / kWarpsMSdP) ? 16 : 8;
  static_assert(kBlockM % (16 * kWarpsMSdP) == 0 && kBlockN % (kWarpNSdP * (kWarps / kWarpsMSdP)) == 0);
  static_assert(kBlockN % (16 * kWarpsNdKV) == 0 && kHeadDim % (16 * (kWarps / kWarpsNdKV)) == 0);
  static_assert(kBlockM % (16 * kWarpsMdQ) == 0 && kHeadDim % (16 * (kWarps / kWarpsMdQ)) == 0);

  using MmaOp = std::conditional_t<std::is_same_v<Element, cutlass::half_t>,
                                   cute::SM80_16x8x16_F32F16F16F32_TN,
                                   cute::SM80_16x8x16_F32BF16BF16F32_TN>;
  using TiledMmaSdP = WarpGridMma<MmaOp, kWarps, kWarpsMSdP, kWarpNSdP>;  // M = query rows, N = keys
  using TiledMmadKV = WarpGridMma<MmaOp, kWarps, kWarpsNdKV>;  // M = keys, N = head dim
  using TiledMmadQ = WarpGridMma<MmaOp, kWarps, kWarpsMdQ>;    // M = query rows, N = head dim

  using SmemLayoutQ = PaddedRowMajor<kBlockM, kHeadDim>;    // Q (two buffers) and dO
  using SmemLayoutKV = PaddedRowMajor<kBlockN, kHeadDim>;   // K and V
  using SmemLayoutP = PaddedRowMajor<kBlockM, kBlockN>;     // P and dS
  using SmemLayoutQt = decltype(cute::select<1, 0>(SmemLayoutQ{}));
  using SmemLayoutKt = decltype(cute::select<1, 0>(SmemLayoutKV{}));
  using SmemLayoutPt = decltype(cute::select<1, 0>(SmemLayoutP{}));

  using SmemCopyAtom = cute::Copy_Atom<cute::SM75_U32x4_LDSM_N, Element>;
  // K and V as the B operand of S and dP.
  using SmemCopyAtomSdPB =
      std::conditional_t<kWarpNSdP == 16, SmemCopyAtom, cute::Copy_Atom<cute::SM75_U32x2_LDSM_N, Element>>;
  using SmemCopyAtomTransposed = cute::Copy_Atom<cute::SM75_U16x8_LDSM_T, Element>;
  using SmemCopyAtomP = cute::Copy_Atom<cute::AutoVectorizingCopyWithAssumedAlignment<32>, Element>;

  // Global to shared memory: rows of 32 columns a pass (4 threads of 16 bytes each), or of 64 where a
  // pass of 64 rows would not divide a block's rows.
  static constexpr int kGmemElemsPerCopy = 16 / sizeof(Element);
  static constexpr int kGmemThreadsPerRow = (kBlockM % (kThreads / 4) == 0 && kBlockN % (kThreads / 4) == 0) ? 4 : 8;
  static_assert(kHeadDim % (kGmemThreadsPerRow * kGmemElemsPerCopy) == 0);
  static_assert(kBlockM % (kThreads / kGmemThreadsPerRow) == 0 && kBlockN % (kThreads / kGmemThreadsPerRow) == 0);
  static constexpr int kGmemRowsPerPass = kThreads / kGmemThreadsPerRow;
  using GmemTiledCopy = decltype(cute::make_tiled_copy(
      cute::Copy_Atom<cute::SM80_CP_ASYNC_CACHEGLOBAL_ZFILL<cute::uint128_t>, Element>{},
      cute::Layout<cute::Shape<cute::Int<kGmemRowsPerPass>, cute::Int<kGmemThreadsPerRow>>,
                   cute::Stride<cute::Int<kGmemThreadsPerRow>, cute::_1>>{},
      cute::Layout<cute::Shape<cute::_1, cute::Int<kGmemElemsPerCopy>>>{}));

  static constexpr int kSmemElemsQ = cute::cosize_v<SmemLayoutQ>;
  static constexpr int kSmemElemsKV = cute::cosize_v<SmemLayoutKV>;
  static constexpr int kSmemElemsP = cute::cosize_v<SmemLayoutP>;
  // Main kernel: the Q buffers, dO, K, V, P, dS, and a buffer of the query rows' LSE and D per Q
  // buffer.
  static constexpr int kSmemBytes =
      ((kQBuffers + 1) * kSmemElemsQ + 2 * kSmemElemsKV + 2 * kSmemElemsP) * int(sizeof(Element)) +
      kQBuffers * 2 * kBlockM * int(sizeof(float));
  // Deterministic dQ kernel: Q, dO, K, V, dS.
  static constexpr int kSmemBytesDq = (2 * kSmemElemsQ + 2 * kSmemElemsKV + kSmemElemsP) * int(sizeof(Element));
  static_assert(kSmemBytes <= 227 * 1024, "tile does not fit in shared memory");
};

// The tiles per head dim: (kBlockM, kBlockN, kWarpsMSdP, kWarpsNdKV, kWarpsMdQ, kQBuffers). The dK
// and dV accumulators (2 * kBlockN * kHeadDim / 256 registers per thread) and S and dP (2 * kBlockM
// * kBlockN / 256) must fit next to each other in 255 registers. Tier 0, the usual tiles, fit the
// shared memory of an A100 (163 KiB) up to head dim 192; tiers 1 and 2 are for GPUs that allow a
// block less (sm_86, sm_89 and sm_120: 99 KiB a block; the A100: 163 KiB), each tier smaller than
// the one before: every head dim has one within 99 KiB (256: tier 2, 32 x 32 tiles; its tier 1 is
// the A100's), and the host takes the first tier that fits the device (FwdParams::sm80_tile_tier).
template <int kBlockM_, int kBlockN_, int kWarpsMSdP_, int kWarpsNdKV_, int kWarpsMdQ_, int kQBuffers_ = 2>
struct BwdTiles {
  template <int kHeadDim, class Element>
  using Traits = BwdKernelTraits<kHeadDim, kBlockM_, kBlockN_, kWarpsMSdP_, kWarpsNdKV_, kWarpsMdQ_, Element,
                                 kQBuffers_>;
};
struct NoBwdTiles {
  template <int kHeadDim, class Element>
  using Traits = void;
};
template <int kHeadDim, int kTier>
struct BwdTilesOf : NoBwdTiles {};
template <> struct BwdTilesOf<32, 0>  : BwdTiles<128, 128, 4, 4, 4> {};
template <> struct BwdTilesOf<64, 0>  : BwdTiles<128, 128, 4, 4, 4> {};
template <> struct BwdTilesOf<96, 0>  : BwdTiles<64, 128, 2, 4, 4> {};
template <> struct BwdTilesOf<128, 0> : BwdTiles<64, 128, 2, 4, 2> {};
template <> struct BwdTilesOf<192, 0> : BwdTiles<64, 64, 4, 2, 2> {};
template <> struct BwdTilesOf<256, 0> : BwdTiles<64, 64, 4, 2, 2> {};
template <> struct BwdTilesOf<32, 1>  : BwdTiles<64, 128, 2, 4, 4> {};
template <> struct BwdTilesOf<64, 1>  : BwdTiles<64, 128, 2, 4, 4> {};
template <> struct BwdTilesOf<96, 1>  : BwdTiles<64, 64, 2, 4, 4> {};
template <> struct BwdTilesOf<128, 1> : BwdTiles<64, 64, 2, 4, 4, 1> {};
template <> struct BwdTilesOf<192, 1> : BwdTiles<32, 64, 2, 2, 2> {};
template <> struct BwdTilesOf<256, 1> : BwdTiles<64, 64, 4, 2, 2, 1> {};
template <> struct BwdTilesOf<256, 2> : BwdTiles<32, 32, 2, 2, 2> {};
// The traits of a head dim's tier; void where it has none.
template <int kHeadDim, int kTier, class Element>
using BwdTraitsOfTier = typename BwdTilesOf<kHeadDim, kTier>::template Traits<kHeadDim, Element>;
template <int kHeadDim, class Element>
using BwdTraitsFor = BwdTraitsOfTier<kHeadDim, 0, Element>;

// acc (fp32, in tiled_mma's C layout) -> a shared memory tile of Element, for a transposed reread.
template <class Traits, class TiledMma, class Acc, class Smem>
__device__ __forceinline__ void store_acc_to_smem(TiledMma const& tiled_mma, Acc const& acc, Smem& smem, int tidx) {
  using namespace cute;
  auto smem_tiled_copy = make_tiled_copy_C(typename Traits::SmemCopyAtomP{}, tiled_mma);
  auto smem_thr_copy = smem_tiled_copy.get_thread_slice(tidx);
  Tensor converted = convert_fragment<typename Traits::Element>(acc);
  copy(smem_tiled_copy, smem_thr_copy.retile_S(converted), smem_thr_copy.partition_D(smem));
}

// Per row of a (query block, key block) tile as (rows, cols), rows starting at row_start: the
// exponent of its P from the forward's log-sum-exp (probability_exponent, common/softmax.h), and D,
// read from lse[row - row_start] and dsum[row - row_start]. Rows past seqlen_q and rows that see no
// key (lse = -inf) get lse = +inf, so their P is 0.
template <int kRows>
struct RowStats {
  ScoreExponent exponent[kRows];
  float dsum[kRows];
};
template <class Coords>
__device__ __forceinline__ auto load_row_stats(Coords const& coords, int row_start, int seqlen_q, const float* lse,
                                               const float* dsum, float exp2_scale, float score_unit) {
  using namespace cute;
  constexpr int kRows = decltype(size<0>(coords))::value;
  RowStats<kRows> stats;
  CUTE_UNROLL
  for (int r = 0; r < kRows; ++r) {
    const int local_row = get<0>(coords(r, 0));
    const bool in_range = row_start + local_row < seqlen_q;
    const float row_lse = in_range ? lse[local_row] : INFINITY;
    stats.exponent[r] = probability_exponent(row_lse == -INFINITY ? INFINITY : row_lse, exp2_scale, score_unit);
    stats.dsum[r] = in_range ? dsum[local_row] : 0.f;
  }
  return stats;
}

// In place: S -> P = exp(scale * S - lse) and dP -> dS = P * (dP - D) (without the softmax scale).
// With kExtended, S holds the capped scores cap(q.k) (masked: -inf), P takes the ALiBi bias of
// each element (its (row, col) from coords, the tile starting at (row_start, col_start)), dS the
// soft cap's derivative (common/score_mods.h), and with dropout (common/dropout.h) S ends as the
// dropped and rescaled P that dV needs and dS = P * (dropped, rescaled dP - D).
template <bool kExtended, bool kDropout, class TensorS, class TensorDP, class Stats, class Coords>
__device__ __forceinline__ void probabilities_and_ds(TensorS& s, TensorDP& dp, Stats const& stats,
                                                     ScoreMods<kExtended> const& score_mods,
                                                     Dropout<kDropout> const& dropout,
                                                     Coords const& coords, int row_start, int col_start) {
  using namespace cute;
  if constexpr (kExtended) {
    CUTE_UNROLL
    for (int r = 0; r < size<0>(s); ++r) {
      CUTE_UNROLL
      for (int c = 0; c < size<1>(s); c += 2) {
        // Columns c and c + 1 of a row are neighbours (the mma.sync C layout).
        const int row = row_start + get<0>(coords(r, c));
        const int col = col_start + get<1>(coords(r, c));
        bool keep[2] = {true, true};
        if constexpr (kDropout) dropout.keep_col_pair(row, col, keep[0], keep[1]);
        CUTE_UNROLL
        for (int i = 0; i < 2; ++i) {
          const float score = s(r, c + i);
          const float p =
              exp2f((score + score_mods.bias(row, col + i)) * stats.exponent[r].scale - stats.exponent[r].offset);
          float dp_kept = dp(r, c + i);
          float p_kept = p;
          if constexpr (kDropout) {
            dp_kept = keep[i] ? dp_kept * dropout.keep_scale : 0.f;
            p_kept = keep[i] ? p * dropout.keep_scale : 0.f;
          }
          dp(r, c + i) = p * (dp_kept - stats.dsum[r]) * score_mods.derivative(score);
          s(r, c + i) = p_kept;
        }
      }
    }
  } else {
    CUTE_UNROLL
    for (int r = 0; r < size<0>(s); ++r) {
      CUTE_UNROLL
      for (int c = 0; c < size<1>(s); ++c) {
        s(r, c) = exp2f(s(r, c) * stats.exponent[r].scale - stats.exponent[r].offset);
        dp(r, c) = s(r, c) * (dp(r, c) - stats.dsum[r]);
      }
    }
  }
}

// Whether this compilation pass holds the code of the kernels on Traits' tiles: every pass but
// sm_90a's holds every tier; sm_90a's only tier 0 unless the build keeps the smaller ones
// (FLASH_CUTLASS_SM90_SMALL_TILES): a Hopper GPU picks them only where FLASH_CUTLASS_SMEM_PER_BLOCK
// says its blocks have less shared memory than they do, and csrc/flash_api.cpp refuses such a call
// to a build without them before any launch. sm_90a's holds a head dim at all only where
// sm80_head_dim_in_this_pass says so (compiled_head_dims.h).
template <class Traits>
constexpr bool compiles_tiles_here() {
  if constexpr (!sm80_head_dim_in_this_pass<Direction::kBackward, Traits::kHeadDim>()) {
    return false;
  }
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  return compiled::kSm80SmallTilesOnHopper ||
         std::is_same_v<Traits, BwdTraitsFor<Traits::kHeadDim, typename Traits::Element>>;
#else
  return true;
#endif
}

// The main kernel's CTA (below). kAccumulateDq: add dS K into dq_accum with atomics; without it
// (deterministic mode) dQ comes from flash_bwd_dq_sm80.
template <class Traits, MaskKind kMaskKind, Extension kExtension, bool kAccumulateDq>
__device__ __forceinline__ void bwd_key_block_sm80(BwdParams const& params) {
  using namespace cute;
  constexpr bool kExtended = carries_score_mods(kExtension);
  constexpr bool kDropout = carries_dropout(kExtension);
  using Element = typename Traits::Element;
  constexpr int kBlockM = Traits::kBlockM;
  constexpr int kBlockN = Traits::kBlockN;
  constexpr int kHeadDim = Traits::kHeadDim;

  const auto work = key_block_work_of_this_cta<kBlockM, kBlockN, kMaskKind>(params);
  if (!work.in_sequence()) return;
  const int head_k = kv_head_of(work.tile.head, params);
  const int tidx = threadIdx.x;
  const ScoreMods<kExtended> score_mods = score_mods_of<kExtended>(params, work.tile.batch, work.tile.head,
                                                                   work.sequence.seqlen_q, work.sequence.seqlen_k);
  const Dropout<kDropout> dropout = dropout_of<kDropout>(params, work.tile.batch, work.tile.head);
  const int rows_left_k = work.sequence.seqlen_k - work.key_start;

  const auto tiles = bwd_key_block_tiles<Element, kHeadDim>(params, work, head_k);
  const QueryRowBuffers query_rows = query_row_buffers<kHeadDim>(params, work.sequence, work.tile.head);

  extern __shared__ __align__(128) char smem[];
  Element* smem_q = reinterpret_cast<Element*>(smem);  // Traits::kQBuffers buffers
  Element* smem_do = smem_q + Traits::kQBuffers * Traits::kSmemElemsQ;
  Element* smem_k = smem_do + Traits::kSmemElemsQ;
  Element* smem_v = smem_k + Traits::kSmemElemsKV;
  Element* smem_p = smem_v + Traits::kSmemElemsKV;
  Element* smem_ds = smem_p + Traits::kSmemElemsP;
  float* smem_stats = reinterpret_cast<float*>(smem_ds + Traits::kSmemElemsP);  // [buffer][lse, D][kBlockM]
  Tensor sdO = make_tensor(make_smem_ptr(smem_do), typename Traits::SmemLayoutQ{});
  Tensor sdOt = make_tensor(make_smem_ptr(smem_do), typename Traits::SmemLayoutQt{});
  Tensor sK = make_tensor(make_smem_ptr(smem_k), typename Traits::SmemLayoutKV{});
  Tensor sKt = make_tensor(make_smem_ptr(smem_k), typename Traits::SmemLayoutKt{});
  Tensor sV = make_tensor(make_smem_ptr(smem_v), typename Traits::SmemLayoutKV{});
  Tensor sP = make_tensor(make_smem_ptr(smem_p), typename Traits::SmemLayoutP{});
  Tensor sPt = make_tensor(make_smem_ptr(smem_p), typename Traits::SmemLayoutPt{});
  Tensor sdS = make_tensor(make_smem_ptr(smem_ds), typename Traits::SmemLayoutP{});
  Tensor sdSt = make_tensor(make_smem_ptr(smem_ds), typename Traits::SmemLayoutPt{});
  auto sQ_buffer = [&](int buffer) {
    return make_tensor(make_smem_ptr(smem_q + buffer * Traits::kSmemElemsQ), typename Traits::SmemLayoutQ{});
  };
  auto sQt_buffer = [&](int buffer) {
    return make_tensor(make_smem_ptr(smem_q + buffer * Traits::kSmemElemsQ), typename Traits::SmemLayoutQt{});
  };

  typename Traits::GmemTiledCopy gmem_tiled_copy;
  auto gmem_thr_copy = gmem_tiled_copy.get_thread_slice(tidx);
  Tensor tQgQ = gmem_thr_copy.partition_S(tiles.q);
  Tensor tdOgdO = gmem_thr_copy.partition_S(tiles.dout);
  Tensor tdOsdO = gmem_thr_copy.partition_D(sdO);
  Tensor tKgK = gmem_thr_copy.partition_S(tiles.k);
  Tensor tKsK = gmem_thr_copy.partition_D(sK);
  Tensor tVgV = gmem_thr_copy.partition_S(tiles.v);
  Tensor tVsV = gmem_thr_copy.partition_D(sV);
  Tensor tQcQ = gmem_thr_copy.partition_S(make_identity_tensor(typename Traits::TileQ{}));
  Tensor tKVcKV = gmem_thr_copy.partition_S(make_identity_tensor(typename Traits::TileKV{}));
  Tensor col_ok = columns_below(tQcQ, params.head_dim);
  auto load_q = [&](int m_block, int buffer) {
    copy_tile_async<true>(gmem_tiled_copy, tQgQ(_, _, _, m_block), gmem_thr_copy.partition_D(sQ_buffer(buffer)),
                          tQcQ, col_ok, work.sequence.seqlen_q - m_block * kBlockM);
  };
  // The LSE and D of a query block's rows, rows past seqlen_q zero-filled.
  auto load_stats = [&](int m_block, int buffer) {
    if (tidx < 2 * kBlockM) {
      const int row = m_block * kBlockM + tidx % kBlockM;
      const float* src = (tidx < kBlockM ? query_rows.lse : query_rows.dsum) + min(row, work.sequence.seqlen_q - 1);
      cp_async_4(smem_stats + buffer * 2 * kBlockM + tidx, src, row < work.sequence.seqlen_q ? 4 : 0);
    }
  };
  auto load_do = [&](int m_block) {
    copy_tile_async<true>(gmem_tiled_copy, tdOgdO(_, _, _, m_block), tdOsdO, tQcQ, col_ok,
                          work.sequence.seqlen_q - m_block * kBlockM);
  };

  typename Traits::TiledMmaSdP mma_sdp;
  typename Traits::TiledMmadKV mma_dkv;
  typename Traits::TiledMmadQ mma_dq;
  auto thr_mma_sdp = mma_sdp.get_thread_slice(tidx);
  auto thr_mma_dkv = mma_dkv.get_thread_slice(tidx);
  auto thr_mma_dq = mma_dq.get_thread_slice(tidx);
  // S = Q K^T and dP = dO V^T: M = query rows.
  Tensor tSrQ = thr_mma_sdp.partition_fragment_A(sQ_buffer(0));
  Tensor tSrK = thr_mma_sdp.partition_fragment_B(sK);
  Tensor tdPrdO = thr_mma_sdp.partition_fragment_A(sdO);
  Tensor tdPrV = thr_mma_sdp.partition_fragment_B(sV);
  // dV = P^T dO and dK = dS^T Q: M = keys.
  Tensor tdVrPt = thr_mma_dkv.partition_fragment_A(sPt);
  Tensor tdVrdOt = thr_mma_dkv.partition_fragment_B(sdOt);
  Tensor tdKrdSt = thr_mma_dkv.partition_fragment_A(sdSt);
  Tensor tdKrQt = thr_mma_dkv.partition_fragment_B(sQt_buffer(0));
  // dQ = dS K: M = query rows, N = head dim.
  Tensor tdQrdS = thr_mma_dq.partition_fragment_A(sdS);
  Tensor tdQrKt = thr_mma_dq.partition_fragment_B(sKt);

  using Copy = typename Traits::SmemCopyAtom;
  using CopyTransposed = typename Traits::SmemCopyAtomTransposed;
  const auto copies_sdp = operand_copies<Copy, typename Traits::SmemCopyAtomSdPB>(mma_sdp, tidx);
  const auto copies_dkv = operand_copies<CopyTransposed, CopyTransposed>(mma_dkv, tidx);
  const auto copies_dq = operand_copies<Copy, CopyTransposed>(mma_dq, tidx);
  Tensor tSsK = copies_sdp.thread_b.partition_S(sK);
  Tensor tdPsdO = copies_sdp.thread_a.partition_S(sdO);
  Tensor tdPsV = copies_sdp.thread_b.partition_S(sV);
  Tensor tdVsPt = copies_dkv.thread_a.partition_S(sPt);
  Tensor tdVsdOt = copies_dkv.thread_b.partition_S(sdOt);
  Tensor tdKsdSt = copies_dkv.thread_a.partition_S(sdSt);
  Tensor tdQsdS = copies_dq.thread_a.partition_S(sdS);
  Tensor tdQsKt = copies_dq.thread_b.partition_S(sKt);

  Tensor acc_dk = partition_fragment_C(mma_dkv, typename Traits::TileKV{});
  Tensor acc_dv = partition_fragment_C(mma_dkv, typename Traits::TileKV{});
  clear(acc_dk);
  clear(acc_dv);
  Tensor tScS = as_rows_cols(thr_mma_sdp.partition_C(make_identity_tensor(typename Traits::TileS{})));
  Tensor tdQcdQ = thr_mma_dq.partition_C(make_identity_tensor(typename Traits::TileQ{}));
  const float score_unit = lse_score_unit<kExtended>(params);

  // K and V once, rows past seqlen_k zero-filled (0 * NaN must not reach dQ), with the first Q
  // and dO.
  copy_tile_async<true>(gmem_tiled_copy, tKgK, tKsK, tKVcKV, col_ok, rows_left_k);
  copy_tile_async<true>(gmem_tiled_copy, tVgV, tVsV, tKVcKV, col_ok, rows_left_k);
  if (work.m_block_begin < work.m_block_end) {
    load_q(work.m_block_begin, 0);
    load_stats(work.m_block_begin, 0);
    load_do(work.m_block_begin);
  }
  cp_async_fence();

  for (int m_block = work.m_block_begin; m_block < work.m_block_end; ++m_block) {
    const int buffer = Traits::kQBuffers == 2 ? (m_block - work.m_block_begin) & 1 : 0;
    const int row_start = m_block * kBlockM;
    // This block's Q and dO have landed, and every warp is done with the previous step's P, dS
    // and Q buffer: with two buffers the next Q goes into the other while this step computes.
    cp_async_wait<0>();
    __syncthreads();
    if (Traits::kQBuffers == 2 && m_block + 1 < work.m_block_end) {
      load_q(m_block + 1, buffer ^ 1);
      load_stats(m_block + 1, buffer ^ 1);
      cp_async_fence();
    }
    Tensor sQ = sQ_buffer(buffer);
    Tensor sQt = sQt_buffer(buffer);

    // P = exp(scale * S - lse), from the forward's log-sum-exp.
    Tensor acc_s = partition_fragment_C(mma_sdp, typename Traits::TileS{});
    clear(acc_s);
    gemm_smem_smem(mma_sdp, acc_s, tSrQ, tSrK, copies_sdp.thread_a.partition_S(sQ), tSsK, copies_sdp);
    Tensor s = as_rows_cols(acc_s);
    if constexpr (kExtended) score_mods.cap(s);
    if (work.mask.tile_needs_mask(row_start, kBlockM, work.key_start, kBlockN)) {
      work.mask.apply(s, tScS, row_start, work.key_start);
    }
    Tensor acc_dp = partition_fragment_C(mma_sdp, typename Traits::TileS{});
    clear(acc_dp);
    gemm_smem_smem(mma_sdp, acc_dp, tdPrdO, tdPrV, tdPsdO, tdPsV, copies_sdp);
    Tensor dp = as_rows_cols(acc_dp);
    const float* stats_buffer = smem_stats + buffer * 2 * kBlockM;
    const auto stats = load_row_stats(tScS, row_start, work.sequence.seqlen_q, stats_buffer, stats_buffer + kBlockM,
                                      params.exp2_scale, score_unit);
    probabilities_and_ds(s, dp, stats, score_mods, dropout, tScS, row_start, work.key_start);
    store_acc_to_smem<Traits>(mma_sdp, acc_s, sP, tidx);
    store_acc_to_smem<Traits>(mma_sdp, acc_dp, sdS, tidx);
    __syncthreads();

    gemm_smem_smem(mma_dkv, acc_dv, tdVrPt, tdVrdOt, tdVsPt, tdVsdOt, copies_dkv);
    // Every warp is done with this dO: load the next one.
    __syncthreads();
    if (m_block + 1 < work.m_block_end) {
      load_do(m_block + 1);
      cp_async_fence();
    }
    gemm_smem_smem(mma_dkv, acc_dk, tdKrdSt, tdKrQt, tdKsdSt, copies_dkv.thread_b.partition_S(sQt), copies_dkv);
    if constexpr (Traits::kQBuffers == 1) {
      // Every warp is done with this Q (and this block's LSE and D are in registers): the next
      // block's load under dQ.
      __syncthreads();
      if (m_block + 1 < work.m_block_end) {
        load_q(m_block + 1, 0);
        load_stats(m_block + 1, 0);
        cp_async_fence();
      }
    }
    if constexpr (kAccumulateDq) {
      Tensor acc_dq = partition_fragment_C(mma_dq, typename Traits::TileQ{});
      clear(acc_dq);
      gemm_smem_smem(mma_dq, acc_dq, tdQrdS, tdQrKt, tdQsdS, tdQsKt, copies_dq);
      atomic_add_rows(query_rows.dq_accum + int64_t(row_start) * kHeadDim, kHeadDim, acc_dq, tdQcdQ,
                      work.sequence.seqlen_q - row_start);
    }
  }

  Tensor tKVc = thr_mma_dkv.partition_C(make_identity_tensor(typename Traits::TileKV{}));
  store_dk_dv<Element, kHeadDim>(params, work, rows_left_k, acc_dk, acc_dv, tKVc);
}

template <class Traits, MaskKind kMaskKind, Extension kExtension, bool kAccumulateDq>
__global__ void __launch_bounds__(Traits::kThreads, 1) flash_bwd_sm80(__grid_constant__ const BwdParams params) {
  if constexpr (compiles_tiles_here<Traits>()) {
    bwd_key_block_sm80<Traits, kMaskKind, kExtension, kAccumulateDq>(params);
  } else {
    __trap();  // left out of this pass: csrc/flash_api.cpp refuses its calls before any launch
  }
}

// Deterministic dQ: one CTA per (query block, head, batch) keeps Q and dO in shared memory, walks
// the key blocks it sees in a fixed order and accumulates dQ = dS K in registers, then stores it
// (fp32, unscaled) into dq_accum without atomics.
template <class Traits, MaskKind kMaskKind, Extension kExtension>
__device__ __forceinline__ void bwd_dq_query_block_sm80(BwdParams const& params) {
  using namespace cute;
  constexpr bool kExtended = carries_score_mods(kExtension);
  constexpr bool kDropout = carries_dropout(kExtension);
  using Element = typename Traits::Element;
  constexpr int kBlockM = Traits::kBlockM;
  constexpr int kBlockN = Traits::kBlockN;
  constexpr int kHeadDim = Traits::kHeadDim;

  const int num_m_blocks = (params.seqlen_q + kBlockM - 1) / kBlockM;  // of the grid (max_seqlen_q in varlen)
  const int m_block = int(blockIdx.x % num_m_blocks);
  const int batch_head = int(blockIdx.x / num_m_blocks);
  const int head = batch_head % params.heads;
  const int batch = batch_head / params.heads;
  const int head_k = kv_head_of(head, params);
  const int tidx = threadIdx.x;
  const Sequence sequence = sequence_of(params, batch);
  const int row_start = m_block * kBlockM;
  // In a variable-length call, the query blocks past this sequence's end have nothing to do.
  if (row_start >= sequence.seqlen_q) return;
  const KeyMask<kMaskKind> mask = key_mask_of<kMaskKind>(params, sequence.seqlen_q, sequence.seqlen_k);
  const ScoreMods<kExtended> score_mods =
      score_mods_of<kExtended>(params, batch, head, sequence.seqlen_q, sequence.seqlen_k);
  const Dropout<kDropout> dropout = dropout_of<kDropout>(params, batch, head);
  const int rows_left_q = sequence.seqlen_q - row_start;
  const KeyBlockRange key_blocks = key_block_range<kBlockM, kBlockN>(mask, m_block);

  const auto operands = bwd_head_matrices<Element, kHeadDim>(params, sequence, head, head_k);
  Tensor gQ = local_tile(operands.q, typename Traits::TileQ{}, make_coord(m_block, 0));
  Tensor gdO = local_tile(operands.dout, typename Traits::TileQ{}, make_coord(m_block, 0));
  Tensor gK = local_tile(operands.k, typename Traits::TileKV{}, make_coord(_, 0));  // (kBlockN, kHeadDim, n_blocks)
  Tensor gV = local_tile(operands.v, typename Traits::TileKV{}, make_coord(_, 0));
  const int64_t row_offset = query_stats_index(params, sequence, head);

  extern __shared__ __align__(128) char smem[];
  Element* smem_q = reinterpret_cast<Element*>(smem);
  Element* smem_do = smem_q + Traits::kSmemElemsQ;
  Element* smem_k = smem_do + Traits::kSmemElemsQ;
  Element* smem_v = smem_k + Traits::kSmemElemsKV;
  Element* smem_ds = smem_v + Traits::kSmemElemsKV;
  Tensor sQ = make_tensor(make_smem_ptr(smem_q), typename Traits::SmemLayoutQ{});
  Tensor sdO = make_tensor(make_smem_ptr(smem_do), typename Traits::SmemLayoutQ{});
  Tensor sK = make_tensor(make_smem_ptr(smem_k), typename Traits::SmemLayoutKV{});
  Tensor sKt = make_tensor(make_smem_ptr(smem_k), typename Traits::SmemLayoutKt{});
  Tensor sV = make_tensor(make_smem_ptr(smem_v), typename Traits::SmemLayoutKV{});
  Tensor sdS = make_tensor(make_smem_ptr(smem_ds), typename Traits::SmemLayoutP{});

  typename Traits::GmemTiledCopy gmem_tiled_copy;
  auto gmem_thr_copy = gmem_tiled_copy.get_thread_slice(tidx);
  Tensor tQgQ = gmem_thr_copy.partition_S(gQ);
  Tensor tQsQ = gmem_thr_copy.partition_D(sQ);
  Tensor tdOgdO = gmem_thr_copy.partition_S(gdO);
  Tensor tdOsdO = gmem_thr_copy.partition_D(sdO);
  Tensor tKgK = gmem_thr_copy.partition_S(gK);  // (CPY, CPY_N, CPY_K, n_blocks)
  Tensor tKsK = gmem_thr_copy.partition_D(sK);
  Tensor tVgV = gmem_thr_copy.partition_S(gV);
  Tensor tVsV = gmem_thr_copy.partition_D(sV);
  Tensor tQcQ = gmem_thr_copy.partition_S(make_identity_tensor(typename Traits::TileQ{}));
  Tensor tKVcKV = gmem_thr_copy.partition_S(make_identity_tensor(typename Traits::TileKV{}));
  Tensor col_ok = columns_below(tQcQ, params.head_dim);

  typename Traits::TiledMmaSdP mma_sdp;
  typename Traits::TiledMmadQ mma_dq;
  auto thr_mma_sdp = mma_sdp.get_thread_slice(tidx);
  auto thr_mma_dq = mma_dq.get_thread_slice(tidx);
  Tensor tSrQ = thr_mma_sdp.partition_fragment_A(sQ);
  Tensor tSrK = thr_mma_sdp.partition_fragment_B(sK);
  Tensor tdPrdO = thr_mma_sdp.partition_fragment_A(sdO);
  Tensor tdPrV = thr_mma_sdp.partition_fragment_B(sV);
  Tensor tdQrdS = thr_mma_dq.partition_fragment_A(sdS);
  Tensor tdQrKt = thr_mma_dq.partition_fragment_B(sKt);
  using Copy = typename Traits::SmemCopyAtom;
  const auto copies_sdp = operand_copies<Copy, typename Traits::SmemCopyAtomSdPB>(mma_sdp, tidx);
  const auto copies_dq = operand_copies<Copy, typename Traits::SmemCopyAtomTransposed>(mma_dq, tidx);
  Tensor tSsQ = copies_sdp.thread_a.partition_S(sQ);
  Tensor tSsK = copies_sdp.thread_b.partition_S(sK);
  Tensor tdPsdO = copies_sdp.thread_a.partition_S(sdO);
  Tensor tdPsV = copies_sdp.thread_b.partition_S(sV);
  Tensor tdQsdS = copies_dq.thread_a.partition_S(sdS);
  Tensor tdQsKt = copies_dq.thread_b.partition_S(sKt);
  Tensor tScS = as_rows_cols(thr_mma_sdp.partition_C(make_identity_tensor(typename Traits::TileS{})));
  Tensor acc_dq = partition_fragment_C(mma_dq, typename Traits::TileQ{});
  clear(acc_dq);
  const auto stats = load_row_stats(tScS, row_start, sequence.seqlen_q, params.lse + row_offset + row_start,
                                    params.dsoftmax_sum + row_offset + row_start, params.exp2_scale,
                                    lse_score_unit<kExtended>(params));

  copy_tile_async<true>(gmem_tiled_copy, tQgQ, tQsQ, tQcQ, col_ok, rows_left_q);
  copy_tile_async<true>(gmem_tiled_copy, tdOgdO, tdOsdO, tQcQ, col_ok, rows_left_q);
  cp_async_fence();
  for (int n_block = key_blocks.begin; n_block < key_blocks.end; ++n_block) {
    // K and V of this block; the previous step's reads of them and of dS are done.
    __syncthreads();
    const int key_start = n_block * kBlockN;
    const int rows_left_k = sequence.seqlen_k - key_start;
    copy_tile_async<true>(gmem_tiled_copy, tKgK(_, _, _, n_block), tKsK, tKVcKV, col_ok, rows_left_k);
    copy_tile_async<true>(gmem_tiled_copy, tVgV(_, _, _, n_block), tVsV, tKVcKV, col_ok, rows_left_k);
    cp_async_fence();
    cp_async_wait<0>();
    __syncthreads();

    Tensor acc_s = partition_fragment_C(mma_sdp, typename Traits::TileS{});
    clear(acc_s);
    gemm_smem_smem(mma_sdp, acc_s, tSrQ, tSrK, tSsQ, tSsK, copies_sdp);
    Tensor s = as_rows_cols(acc_s);
    if constexpr (kExtended) score_mods.cap(s);
    if (mask.tile_needs_mask(row_start, kBlockM, key_start, kBlockN)) mask.apply(s, tScS, row_start, key_start);
    Tensor acc_dp = partition_fragment_C(mma_sdp, typename Traits::TileS{});
    clear(acc_dp);
    gemm_smem_smem(mma_sdp, acc_dp, tdPrdO, tdPrV, tdPsdO, tdPsV, copies_sdp);
    Tensor dp = as_rows_cols(acc_dp);
    probabilities_and_ds(s, dp, stats, score_mods, dropout, tScS, row_start, key_start);
    store_acc_to_smem<Traits>(mma_sdp, acc_dp, sdS, tidx);
    __syncthreads();
    gemm_smem_smem(mma_dq, acc_dq, tdQrdS, tdQrKt, tdQsdS, tdQsKt, copies_dq);
  }

  Tensor tdQcdQ = thr_mma_dq.partition_C(make_identity_tensor(typename Traits::TileQ{}));
  store_rows(params.dq_accum + (row_offset + row_start) * kHeadDim, kHeadDim, acc_dq, 1.f, tdQcdQ, rows_left_q,
             kHeadDim);
}

template <class Traits, MaskKind kMaskKind, Extension kExtension>
__global__ void __launch_bounds__(Traits::kThreads, 1) flash_bwd_dq_sm80(__grid_constant__ const BwdParams params) {
  if constexpr (compiles_tiles_here<Traits>()) {
    bwd_dq_query_block_sm80<Traits, kMaskKind, kExtension>(params);
  } else {
    __trap();  // left out of this pass: csrc/flash_api.cpp refuses its calls before any launch
  }
}

}  // namespace flash_cutlass::sm80
