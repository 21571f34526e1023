// The Hopper-path backward kernel (sm_90a): the sm80 path's algorithm with warpgroup MMAs.
//
// One CTA of two warpgroups per (key block of 128, head, batch) keeps K and V in shared memory
// and walks the query blocks (64 rows) that see them. Each warpgroup owns 64 keys:
//   S^T = K Q^T and dP^T = V dO^T   (wgmma, both operands in shared memory)
//   P^T = exp(scale S^T - lse), dS^T = P^T * (dP^T - D)   (registers; lse and D per column)
//   dV += P^T dO and dK += dS^T Q   (wgmma with P^T / dS^T straight from the accumulators)
//   dQ  = dS K                      (wgmma from dS^T stored in shared memory; fp32 atomics)
// Q, dO, LSE and D of the next query block load with cp.async while the current one is computed.
// The preprocess (D, dq_accum zeroed) and postprocess (dQ scaled, converted) are both paths'
// (common/bwd_stages.h), as are the tile copies and row stores (common/copy.h).
#pragma once

#include <cmath>
#include <type_traits>

#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>
#include <cutlass/numeric_types.h>

#include "flash_cutlass/common/block_info.h"
#include "flash_cutlass/common/bwd_key_block.h"
#include "flash_cutlass/common/copy.h"
#include "flash_cutlass/common/dropout.h"
#include "flash_cutlass/common/mask.h"
#include "flash_cutlass/common/score_mods.h"
#include "flash_cutlass/common/utils.h"
#include "flash_cutlass/params.h"
#include "flash_cutlass/sm90/bulk_copy.h"
#include "flash_cutlass/sm90/wgmma.h"

namespace flash_cutlass::sm90 {

template <int kHeadDim_, class Element_>
struct BwdKernelTraits {
  using Element = Element_;
  static_assert(std::is_same_v<Element, cutlass::half_t> || std::is_same_v<Element, cutlass::bfloat16_t>);
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kBlockM = 64;   // query rows per step of the walk
  static constexpr int kBlockN = 128;  // keys of a CTA: 64 per warpgroup
  static constexpr int kWarpgroups = kBlockN / 64;
  static constexpr int kThreads = 128 * kWarpgroups;
  static_assert(kHeadDim % 64 == 0 && kHeadDim <= 128, "rows of 128-byte swizzle atoms; registers");

  // S^T = K Q^T and dP^T = V dO^T: (keys, queries, head dim), the warpgroups split the keys.
  using TileShapeSdP = cute::Shape<cute::Int<kBlockN>, cute::Int<kBlockM>, cute::Int<kHeadDim>>;
  // dV = P^T dO and dK = dS^T Q: (keys, head dim, queries), A from registers.
  using TileShapedKV = cute::Shape<cute::Int<kBlockN>, cute::Int<kHeadDim>, cute::Int<kBlockM>>;
  // dQ = dS K: (queries, head dim, keys), the warpgroups split the head dim.
  using TileShapedQ = cute::Shape<cute::Int<kBlockM>, cute::Int<kHeadDim>, cute::Int<kBlockN>>;
  using TileShapedQPerWarpgroup = cute::Shape<cute::Int<kBlockM>, cute::Int<kHeadDim / kWarpgroups>, cute::Int<kBlockN>>;

  using TiledMmaSdP = decltype(cute::make_tiled_mma(
      cute::GMMA::ss_op_selector<Element, Element, float, TileShapeSdP>(),
      cute::Layout<cute::Shape<cute::Int<kWarpgroups>, cute::_1, cute::_1>>{}));
  using TiledMmadKV = decltype(cute::make_tiled_mma(
      cute::GMMA::rs_op_selector<Element, Element, float, TileShapedKV, cute::GMMA::Major::K,
                                 cute::GMMA::Major::MN>(),
      cute::Layout<cute::Shape<cute::Int<kWarpgroups>, cute::_1, cute::_1>>{}));
  using TiledMmadQ = decltype(cute::make_tiled_mma(
      cute::GMMA::ss_op_selector<Element, Element, float, TileShapedQPerWarpgroup, cute::GMMA::Major::MN,
                                 cute::GMMA::Major::MN>(),
      cute::Layout<cute::Shape<cute::_1, cute::Int<kWarpgroups>, cute::_1>>{}));

  // 128-byte-swizzled rows of 64 elements, the head dim (or, for dS^T, the queries) contiguous.
  using SmemAtom = cute::GMMA::Layout_K_SW128_Atom<Element>;
  // Q and dO: two buffers each (the next query block loads into the other).
  using SmemLayoutQ =
      decltype(cute::tile_to_shape(SmemAtom{}, cute::Shape<cute::Int<kBlockM>, cute::Int<kHeadDim>, cute::_2>{}));
  using SmemLayoutQt = decltype(cute::composition(
      SmemLayoutQ{}, cute::make_ordered_layout(cute::Shape<cute::Int<kHeadDim>, cute::Int<kBlockM>, cute::_2>{},
                                               cute::Step<cute::_2, cute::_1, cute::_3>{})));
  using SmemLayoutKV = decltype(cute::tile_to_shape(SmemAtom{}, cute::Shape<cute::Int<kBlockN>, cute::Int<kHeadDim>>{}));
  using SmemLayoutKt = decltype(cute::composition(
      SmemLayoutKV{}, cute::make_ordered_layout(cute::Shape<cute::Int<kHeadDim>, cute::Int<kBlockN>>{},
                                                cute::Step<cute::_2, cute::_1>{})));
  // dS^T (keys, queries), queries contiguous; seen as dS (queries, keys) it is the MN-major A of dQ.
  using SmemLayoutdSt = decltype(cute::tile_to_shape(SmemAtom{}, cute::Shape<cute::Int<kBlockN>, cute::Int<kBlockM>>{}));
  using SmemLayoutdS = decltype(cute::composition(
      SmemLayoutdSt{}, cute::make_ordered_layout(cute::Shape<cute::Int<kBlockM>, cute::Int<kBlockN>>{},
                                                 cute::Step<cute::_2, cute::_1>{})));
  using SmemCopyAtomdS = cute::Copy_Atom<cute::AutoVectorizingCopyWithAssumedAlignment<32>, Element>;

  // Global -> shared copies: 16 bytes per thread, rows of the tile spread over the CTA.
  static constexpr int kGmemElemsPerCopy = 16 / sizeof(Element);
  static constexpr int kGmemThreadsPerRow = 64 / kGmemElemsPerCopy;
  using GmemTiledCopy = decltype(cute::make_tiled_copy(
      cute::Copy_Atom<cute::SM80_CP_ASYNC_CACHEGLOBAL_ZFILL<cute::uint128_t>, Element>{},
      cute::Layout<cute::Shape<cute::Int<kThreads / kGmemThreadsPerRow>, cute::Int<kGmemThreadsPerRow>>,
                   cute::Stride<cute::Int<kGmemThreadsPerRow>, cute::_1>>{},
      cute::Layout<cute::Shape<cute::_1, cute::Int<kGmemElemsPerCopy>>>{}));

  struct SharedStorage {
    alignas(1024) cute::array_aligned<Element, cute::cosize_v<SmemLayoutQ>> q;
    alignas(1024) cute::array_aligned<Element, cute::cosize_v<SmemLayoutQ>> dout;
    alignas(1024) cute::array_aligned<Element, cute::cosize_v<SmemLayoutKV>> k;
    alignas(1024) cute::array_aligned<Element, cute::cosize_v<SmemLayoutKV>> v;
    alignas(1024) cute::array_aligned<Element, cute::cosize_v<SmemLayoutdSt>> ds;
    alignas(16) float stats[2][2][kBlockM];  // [buffer][lse, D][query row]
    // A query block's dQ (rows of kHeadDim), staged for the bulk reduce into dq_accum.
    alignas(128) cute::array_aligned<float, kBlockM * kHeadDim> dq;
  };
  static constexpr int kSmemBytes = int(sizeof(SharedStorage));
  static_assert(kSmemBytes <= 227 * 1024, "tile does not fit in shared memory");
};

// In place, on S^T and dP^T as (keys, queries): P^T = exp(scale S^T - lse) and
// dS^T = P^T (dP^T - D), the query's LSE (in log2 units) and D read from shared memory. With
// kApplyMask, keys past seqlen_k and keys outside a query's causal mask or window get P = 0 first.
// With kExtended, the scores are capped and biased first, dS^T carries the cap's derivative
// (common/score_mods.h), and with dropout (common/dropout.h) P^T ends dropped and rescaled, as dV
// needs it, and dS^T = P^T (dropped, rescaled dP^T - D).
template <bool kApplyMask, bool kExtended, bool kDropout, MaskKind kMaskKind, class TensorS, class TensorDP,
          class Coords>
__device__ __forceinline__ void probabilities_and_ds_transposed(TensorS& st, TensorDP& dpt, Coords const& coords,
                                                                int key_start, int row_start,
                                                                KeyMask<kMaskKind> const& mask,
                                                                ScoreMods<kExtended> const& score_mods,
                                                                Dropout<kDropout> const& dropout, float scale_log2,
                                                                const float* lse, const float* dsum) {
  using namespace cute;
  if constexpr (kExtended) {
    CUTE_UNROLL
    for (int c = 0; c < size<1>(st); c += 2) {
      // Queries c and c + 1 are neighbours (the wgmma C layout of S^T), each with its own stats.
      float row_lse[2], row_dsum[2];
      int query[2], key_begin[2], key_limit[2];
      CUTE_UNROLL
      for (int i = 0; i < 2; ++i) {
        const int local_query = get<1>(coords(0, c + i));
        query[i] = row_start + local_query;
        const float query_lse = query[i] < mask.seqlen_q ? lse[local_query] : INFINITY;
        row_lse[i] = (query_lse == -INFINITY ? INFINITY : query_lse) * float(M_LOG2E);
        row_dsum[i] = query[i] < mask.seqlen_q ? dsum[local_query] : 0.f;
        key_begin[i] = mask.key_begin(query[i]);
        key_limit[i] = mask.key_limit(query[i]);
      }
      CUTE_UNROLL
      for (int r = 0; r < size<0>(st); ++r) {
        const int key = key_start + get<0>(coords(r, c));
        bool keep[2] = {true, true};
        if constexpr (kDropout) dropout.keep_row_pair(query[0], key, keep[0], keep[1]);
        CUTE_UNROLL
        for (int i = 0; i < 2; ++i) {
          float score = st(r, c + i);
          if (score_mods.softcap_input_scale != 0.f) score = tanh_approx(score * score_mods.softcap_input_scale);
          float s = (score + score_mods.bias(query[i], key)) * scale_log2;
          if constexpr (kApplyMask) {
            if (key >= key_limit[i] || (KeyMask<kMaskKind>::kLocal && key < key_begin[i])) s = -INFINITY;
          }
          const float p = exp2f(s - row_lse[i]);
          float dp_kept = dpt(r, c + i);
          float p_kept = p;
          if constexpr (kDropout) {
            dp_kept = keep[i] ? dp_kept * dropout.keep_scale : 0.f;
            p_kept = keep[i] ? p * dropout.keep_scale : 0.f;
          }
          dpt(r, c + i) = p * (dp_kept - row_dsum[i]) * score_mods.derivative(score);
          st(r, c + i) = p_kept;
        }
      }
    }
  } else {
    CUTE_UNROLL
    for (int c = 0; c < size<1>(st); ++c) {
      const int local_query = get<1>(coords(0, c));
      const int query = row_start + local_query;
      float row_lse = query < mask.seqlen_q ? lse[local_query] : INFINITY;
      row_lse = (row_lse == -INFINITY ? INFINITY : row_lse) * float(M_LOG2E);
      const float row_dsum = query < mask.seqlen_q ? dsum[local_query] : 0.f;
      const int key_begin = mask.key_begin(query);
      const int key_limit = mask.key_limit(query);
      CUTE_UNROLL
      for (int r = 0; r < size<0>(st); ++r) {
        float s = st(r, c) * scale_log2;
        if constexpr (kApplyMask) {
          const int key = key_start + get<0>(coords(r, c));
          if (key >= key_limit || (KeyMask<kMaskKind>::kLocal && key < key_begin)) s = -INFINITY;
        }
        st(r, c) = exp2f(s - row_lse);
        dpt(r, c) = st(r, c) * (dpt(r, c) - row_dsum);
      }
    }
  }
}

template <class Traits, MaskKind kMaskKind, Extension kExtension>
__global__ void __launch_bounds__(Traits::kThreads, 1) flash_bwd_sm90(__grid_constant__ const BwdParams params) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using namespace cute;
  constexpr bool kExtended = kExtension != Extension::kNone;
  constexpr bool kDropout = kExtension == Extension::kDropout;
  using Element = typename Traits::Element;
  constexpr int kBlockM = Traits::kBlockM;
  constexpr int kBlockN = Traits::kBlockN;
  constexpr int kHeadDim = Traits::kHeadDim;
  using TileQ = Shape<Int<kBlockM>, Int<kHeadDim>>;
  using TileKV = Shape<Int<kBlockN>, Int<kHeadDim>>;
  using TileSt = Shape<Int<kBlockN>, Int<kBlockM>>;

  extern __shared__ char smem[];
  auto& storage = *reinterpret_cast<typename Traits::SharedStorage*>(smem);

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

  Tensor sQ = make_tensor(make_smem_ptr(storage.q.data()), typename Traits::SmemLayoutQ{});
  Tensor sQt = make_tensor(make_smem_ptr(storage.q.data()), typename Traits::SmemLayoutQt{});
  Tensor sdO = make_tensor(make_smem_ptr(storage.dout.data()), typename Traits::SmemLayoutQ{});
  Tensor sdOt = make_tensor(make_smem_ptr(storage.dout.data()), typename Traits::SmemLayoutQt{});
  Tensor sK = make_tensor(make_smem_ptr(storage.k.data()), typename Traits::SmemLayoutKV{});
  Tensor sKt = make_tensor(make_smem_ptr(storage.k.data()), typename Traits::SmemLayoutKt{});
  Tensor sV = make_tensor(make_smem_ptr(storage.v.data()), typename Traits::SmemLayoutKV{});
  Tensor sdSt = make_tensor(make_smem_ptr(storage.ds.data()), typename Traits::SmemLayoutdSt{});
  Tensor sdS = make_tensor(make_smem_ptr(storage.ds.data()), typename Traits::SmemLayoutdS{});

  typename Traits::GmemTiledCopy gmem_tiled_copy;
  auto gmem_thr_copy = gmem_tiled_copy.get_thread_slice(tidx);
  Tensor tQgQ = gmem_thr_copy.partition_S(tiles.q);  // (CPY, CPY_M, CPY_K, m_blocks)
  Tensor tQsQ = gmem_thr_copy.partition_D(sQ);       // (CPY, CPY_M, CPY_K, buffer)
  Tensor tdOgdO = gmem_thr_copy.partition_S(tiles.dout);
  Tensor tdOsdO = gmem_thr_copy.partition_D(sdO);
  Tensor tKgK = gmem_thr_copy.partition_S(tiles.k);
  Tensor tKsK = gmem_thr_copy.partition_D(sK);
  Tensor tVgV = gmem_thr_copy.partition_S(tiles.v);
  Tensor tVsV = gmem_thr_copy.partition_D(sV);
  Tensor tQcQ = gmem_thr_copy.partition_S(make_identity_tensor(TileQ{}));
  Tensor tKVcKV = gmem_thr_copy.partition_S(make_identity_tensor(TileKV{}));
  Tensor col_ok = columns_below(tQcQ, params.head_dim);
  // Q, dO, LSE and D of a query block into `buffer`; rows past seqlen_q zero-filled.
  auto load_query_block = [&](int m_block, int buffer) {
    const int rows_left = work.sequence.seqlen_q - m_block * kBlockM;
    copy_tile_async<true>(gmem_tiled_copy, tQgQ(_, _, _, m_block), tQsQ(_, _, _, buffer), tQcQ, col_ok,
                                rows_left);
    copy_tile_async<true>(gmem_tiled_copy, tdOgdO(_, _, _, m_block), tdOsdO(_, _, _, buffer), tQcQ, col_ok,
                                rows_left);
    if (tidx < 2 * kBlockM) {
      const int row = m_block * kBlockM + tidx % kBlockM;
      const float* src = (tidx < kBlockM ? query_rows.lse : query_rows.dsum) + min(row, work.sequence.seqlen_q - 1);
      cp_async_4(&storage.stats[buffer][tidx / kBlockM][tidx % kBlockM], src, row < work.sequence.seqlen_q ? 4 : 0);
    }
  };

  typename Traits::TiledMmaSdP mma_sdp;
  typename Traits::TiledMmadKV mma_dkv;
  typename Traits::TiledMmadQ mma_dq;
  auto thr_sdp = mma_sdp.get_thread_slice(tidx);
  auto thr_dkv = mma_dkv.get_thread_slice(tidx);
  auto thr_dq = mma_dq.get_thread_slice(tidx);
  Tensor tSrK = thr_sdp.partition_fragment_A(sK);      // descriptors
  Tensor tSrQ = thr_sdp.partition_fragment_B(sQ);      // (MMA, MMA_N, MMA_K, buffer)
  Tensor tdPrV = thr_sdp.partition_fragment_A(sV);
  Tensor tdPrdO = thr_sdp.partition_fragment_B(sdO);
  Tensor tdVrdOt = thr_dkv.partition_fragment_B(sdOt);  // (MMA, MMA_N, MMA_K, buffer)
  Tensor tdKrQt = thr_dkv.partition_fragment_B(sQt);
  Tensor tdQrdS = thr_dq.partition_fragment_A(sdS);
  Tensor tdQrKt = thr_dq.partition_fragment_B(sKt);
  auto smem_tiled_copy_ds = make_tiled_copy_C(typename Traits::SmemCopyAtomdS{}, mma_sdp);
  auto smem_thr_copy_ds = smem_tiled_copy_ds.get_thread_slice(tidx);
  Tensor tdSsdS = smem_thr_copy_ds.partition_D(sdSt);

  Tensor acc_dk = partition_fragment_C(mma_dkv, TileKV{});
  Tensor acc_dv = partition_fragment_C(mma_dkv, TileKV{});
  clear(acc_dk);
  clear(acc_dv);
  // (key, query) of every S^T accumulator element inside its tile.
  Tensor tScS = as_rows_cols(thr_sdp.partition_C(make_identity_tensor(TileSt{})));
  Tensor tdQcdQ = thr_dq.partition_C(make_identity_tensor(TileQ{}));

  // K and V once (rows past seqlen_k zero-filled), with the first query block.
  copy_tile_async<true>(gmem_tiled_copy, tKgK, tKsK, tKVcKV, col_ok, rows_left_k);
  copy_tile_async<true>(gmem_tiled_copy, tVgV, tVsV, tKVcKV, col_ok, rows_left_k);
  if (work.m_block_begin < work.m_block_end) load_query_block(work.m_block_begin, 0);
  cp_async_fence();

  // dQ leaves the math warps through shared memory: each thread stores its part of a query block's
  // dQ into storage.dq, and after the next CTA barrier one thread has the bulk copy engine add the
  // block's rows to dq_accum (fp32 reduce-add in L2), instead of every thread issuing atomics.
  float* sdq = storage.dq.data();
  auto reduce_dq = [&](int row_start) {
    if (tidx == 0) {
      const int rows = min(kBlockM, work.sequence.seqlen_q - row_start);
      bulk_reduce_add(query_rows.dq_accum + int64_t(row_start) * kHeadDim, sdq,
                      rows * kHeadDim * int(sizeof(float)));
      tma_store_arrive();
    }
  };

  for (int m_block = work.m_block_begin; m_block < work.m_block_end; ++m_block) {
    const int buffer = (m_block - work.m_block_begin) & 1;
    const int row_start = m_block * kBlockM;
    // This block's operands have landed (and are visible to wgmma's async proxy); every thread is
    // done with the previous step's dS and its buffers, so the next block loads into them; the
    // previous block's dQ is in shared memory, visible to the bulk copy engine.
    cp_async_wait<0>();
    cutlass::arch::fence_view_async_shared();
    __syncthreads();
    if (m_block > work.m_block_begin) reduce_dq(row_start - kBlockM);
    if (m_block + 1 < work.m_block_end) {
      load_query_block(m_block + 1, buffer ^ 1);
      cp_async_fence();
    }

    Tensor acc_s = partition_fragment_C(mma_sdp, TileSt{});
    Tensor acc_dp = partition_fragment_C(mma_sdp, TileSt{});
    issue_gemm_wgmma<true>(mma_sdp, tSrK, tSrQ(_, _, _, buffer), acc_s);
    issue_gemm_wgmma<true>(mma_sdp, tdPrV, tdPrdO(_, _, _, buffer), acc_dp);
    warpgroup_wait<0>();
    warpgroup_fence_operand(acc_s);
    warpgroup_fence_operand(acc_dp);
    Tensor st = as_rows_cols(acc_s);
    Tensor dpt = as_rows_cols(acc_dp);
    const float* lse = storage.stats[buffer][0];
    const float* dsum = storage.stats[buffer][1];
    if (work.mask.tile_needs_mask(row_start, kBlockM, work.key_start, kBlockN)) {
      probabilities_and_ds_transposed<true>(st, dpt, tScS, work.key_start, row_start, work.mask, score_mods,
                                            dropout, params.exp2_scale, lse, dsum);
    } else {
      probabilities_and_ds_transposed<false>(st, dpt, tScS, work.key_start, row_start, work.mask, score_mods,
                                             dropout, params.exp2_scale, lse, dsum);
    }
    // P^T and dS^T in the inputs' dtype: the register A operands of dV and dK; dS^T also to shared
    // memory for dQ.
    Tensor pt = convert_fragment<Element>(acc_s);
    Tensor dst = convert_fragment<Element>(acc_dp);
    copy(smem_tiled_copy_ds, smem_thr_copy_ds.retile_S(dst), tdSsdS);
    Tensor tdVrPt = make_tensor(pt.data(), acc_layout_as_operand_a(pt.layout()));
    Tensor tdKrdSt = make_tensor(dst.data(), acc_layout_as_operand_a(dst.layout()));
    issue_gemm_wgmma<false>(mma_dkv, tdVrPt, tdVrdOt(_, _, _, buffer), acc_dv);
    issue_gemm_wgmma<false>(mma_dkv, tdKrdSt, tdKrQt(_, _, _, buffer), acc_dk);

    // dQ = dS K once both warpgroups' dS^T is in shared memory (dV and dK run meanwhile); the
    // previous block's dQ reduce has read storage.dq.
    if (tidx == 0) tma_store_wait<0>();
    cutlass::arch::fence_view_async_shared();
    __syncthreads();
    Tensor acc_dq = partition_fragment_C(mma_dq, TileQ{});
    issue_gemm_wgmma<true>(mma_dq, tdQrdS, tdQrKt, acc_dq);
    warpgroup_wait<0>();
    warpgroup_fence_operand(acc_dv);
    warpgroup_fence_operand(acc_dk);
    warpgroup_fence_operand(acc_dq);
    warpgroup_fence_operand(pt);
    warpgroup_fence_operand(dst);
    CUTE_UNROLL
    for (int i = 0; i < size(acc_dq); i += 2) {
      const int row = get<0>(tdQcdQ(i)), col = get<1>(tdQcdQ(i));
      *reinterpret_cast<float2*>(sdq + row * kHeadDim + col) = make_float2(acc_dq(i), acc_dq(i + 1));
    }
  }
  if (work.m_block_begin < work.m_block_end) {
    cutlass::arch::fence_view_async_shared();
    __syncthreads();
    reduce_dq((work.m_block_end - 1) * kBlockM);
    if (tidx == 0) tma_store_wait<0>();  // storage.dq must outlive its last read
  }

  Tensor tKVc = thr_dkv.partition_C(make_identity_tensor(TileKV{}));
  store_dk_dv<Element, kHeadDim>(params, work, rows_left_k, acc_dk, acc_dv, tKVc);
#endif  // Other targets get an empty body: the host launches this kernel only on sm_90.
}

}  // namespace flash_cutlass::sm90
