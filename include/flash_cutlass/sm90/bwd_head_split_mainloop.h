// The consumers of the Hopper-path backward past head dim 128 (BwdHeadSplitKernelTraits): two
// warpgroups walk the query blocks that see their CTA's 64 keys. Per query block:
//   S^T = K Q^T, then dP^T = V dO^T          (each warpgroup half of the queries)
//   P^T, dS^T as in bwd_mainloop.h           (registers), then to shared memory in the inputs' dtype
//   dV^T += dO^T P, dK^T += Q^T dS           (each warpgroup half of the head dim, both operands
//                                            in shared memory: P and dS of both warpgroups)
//   dQ = dS K                                (each warpgroup half of the head dim)
// and each warpgroup adds its half of the block's dQ to dq_accum with 8-byte atomics.
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>

#include "flash_cutlass/common/block_info.h"
#include "flash_cutlass/common/bwd_key_block.h"
#include "flash_cutlass/common/dropout.h"
#include "flash_cutlass/common/mask.h"
#include "flash_cutlass/common/score_mods.h"
#include "flash_cutlass/params.h"
#include "flash_cutlass/sm90/barriers.h"
#include "flash_cutlass/sm90/bwd_mainloop.h"
#include "flash_cutlass/sm90/wgmma.h"

namespace flash_cutlass::sm90 {

// consumer_idx: the thread's index among the consumer threads.
template <class Traits, MaskKind kMaskKind, Extension kExtension>
__device__ __forceinline__ void consume_query_blocks_head_split(
    BwdParams const& params, KeyBlockWork<Traits::kBlockM, Traits::kBlockN, kMaskKind> const& work,
    typename Traits::SharedStorage& storage, int consumer_idx) {
  using namespace cute;
  static_assert(Traits::kHeadSplit);
  constexpr bool kExtended = kExtension != Extension::kNone;
  constexpr bool kDropout = kExtension == Extension::kDropout;
  constexpr int kHeadDim = Traits::kHeadDim;
  using Element = typename Traits::Element;
  using TileQ = typename Traits::TileQ;
  using TileKVt = typename Traits::TileKVt;
  using TileSt = typename Traits::TileSt;

  const ScoreMods<kExtended> score_mods = score_mods_of<kExtended>(params, work.tile.batch, work.tile.head,
                                                                   work.sequence.seqlen_q, work.sequence.seqlen_k);
  const Dropout<kDropout> dropout = dropout_of<kDropout>(params, work.tile.batch, work.tile.head);

  Tensor sQ = make_tensor(make_smem_ptr(storage.q.data()), typename Traits::SmemLayoutQ{});
  Tensor sQt = make_tensor(make_smem_ptr(storage.q.data()), typename Traits::SmemLayoutQt{});
  Tensor sdO = make_tensor(make_smem_ptr(storage.dout.data()), typename Traits::SmemLayoutQ{});
  Tensor sdOt = make_tensor(make_smem_ptr(storage.dout.data()), typename Traits::SmemLayoutQt{});
  Tensor sK = make_tensor(make_smem_ptr(storage.k.data()), typename Traits::SmemLayoutKV{});
  Tensor sKt = make_tensor(make_smem_ptr(storage.k.data()), typename Traits::SmemLayoutKt{});
  Tensor sV = make_tensor(make_smem_ptr(storage.v.data()), typename Traits::SmemLayoutKV{});
  Tensor sPt = make_tensor(make_smem_ptr(storage.pt.data()), typename Traits::SmemLayoutPt{});
  Tensor sdSt = make_tensor(make_smem_ptr(storage.ds.data()), typename Traits::SmemLayoutPt{});
  Tensor sdS = make_tensor(make_smem_ptr(storage.ds.data()), typename Traits::SmemLayoutdS{});

  typename Traits::TiledMmaSdP mma_sdp;
  typename Traits::TiledMmadKVt mma_dkv;
  typename Traits::TiledMmadQ mma_dq;
  auto thr_sdp = mma_sdp.get_thread_slice(consumer_idx);
  auto thr_dkv = mma_dkv.get_thread_slice(consumer_idx);
  auto thr_dq = mma_dq.get_thread_slice(consumer_idx);
  Tensor tSrK = thr_sdp.partition_fragment_A(sK);       // descriptors
  Tensor tSrQ = thr_sdp.partition_fragment_B(sQ);       // (MMA, MMA_N, MMA_K, stage)
  Tensor tdPrV = thr_sdp.partition_fragment_A(sV);
  Tensor tdPrdO = thr_sdp.partition_fragment_B(sdO);
  Tensor tdVrdOt = thr_dkv.partition_fragment_A(sdOt);  // (MMA, MMA_M, MMA_K, stage)
  Tensor tdVrPt = thr_dkv.partition_fragment_B(sPt);    // (MMA, MMA_N, MMA_K, buffer)
  Tensor tdKrQt = thr_dkv.partition_fragment_A(sQt);
  Tensor tdKrdSt = thr_dkv.partition_fragment_B(sdSt);
  Tensor tdQrdS = thr_dq.partition_fragment_A(sdS);     // (MMA, MMA_M, MMA_K, buffer)
  Tensor tdQrKt = thr_dq.partition_fragment_B(sKt);
  auto smem_tiled_copy_pt = make_tiled_copy_C(typename Traits::SmemCopyAtomPt{}, mma_sdp);
  auto smem_thr_copy_pt = smem_tiled_copy_pt.get_thread_slice(consumer_idx);
  Tensor tPsPt = smem_thr_copy_pt.partition_D(sPt);     // (CPY, CPY_M, CPY_N, buffer)
  Tensor tdSsdSt = smem_thr_copy_pt.partition_D(sdSt);

  Tensor acc_dkt = partition_fragment_C(mma_dkv, TileKVt{});
  Tensor acc_dvt = partition_fragment_C(mma_dkv, TileKVt{});
  clear(acc_dkt);
  clear(acc_dvt);
  // (key, query) of every S^T accumulator element inside its tile; (query, column) of dQ's.
  Tensor tScS = as_rows_cols(thr_sdp.partition_C(make_identity_tensor(TileSt{})));
  Tensor tdQcdQ = thr_dq.partition_C(make_identity_tensor(TileQ{}));
  float* dq_accum = query_row_buffers<kHeadDim>(params, work.sequence, work.tile.head).dq_accum;

  if (work.m_block_begin < work.m_block_end) storage.kv_full.wait(0);
  for (int m_block = work.m_block_begin; m_block < work.m_block_end; ++m_block) {
    const int step = m_block - work.m_block_begin;
    const int stage = step % Traits::kStages;
    const int buffer = step & 1;
    const int row_start = m_block * Traits::kBlockM;
    storage.query_full[stage].wait((step / Traits::kStages) & 1);

    Tensor acc_s = partition_fragment_C(mma_sdp, TileSt{});
    Tensor acc_dp = partition_fragment_C(mma_sdp, TileSt{});
    issue_gemm_wgmma<true>(mma_sdp, tSrK, tSrQ(_, _, _, stage), acc_s);
    issue_gemm_wgmma<true>(mma_sdp, tdPrV, tdPrdO(_, _, _, stage), acc_dp);
    Tensor st = as_rows_cols(acc_s);
    Tensor dpt = as_rows_cols(acc_dp);
    const float* lse_log2 = storage.lse_log2[stage];
    const float* dsum = storage.dsum[stage];
    const bool needs_mask = work.mask.tile_needs_mask(row_start, Traits::kBlockM, work.key_start, Traits::kBlockN);
    if constexpr (kExtended) {
      warpgroup_wait<0>();
      warpgroup_fence_operand(acc_s);
      warpgroup_fence_operand(acc_dp);
      if (needs_mask) {
        extended_probabilities_and_ds_transposed<true>(st, dpt, tScS, work.key_start, row_start, work.mask,
                                                       score_mods, dropout, params.exp2_scale, lse_log2, dsum);
      } else {
        extended_probabilities_and_ds_transposed<false>(st, dpt, tScS, work.key_start, row_start, work.mask,
                                                        score_mods, dropout, params.exp2_scale, lse_log2, dsum);
      }
    } else {
      warpgroup_wait<1>();
      warpgroup_fence_operand(acc_s);
      if (needs_mask) {
        probabilities_transposed<true>(st, tScS, work.key_start, row_start, work.mask, params.exp2_scale, lse_log2);
      } else {
        probabilities_transposed<false>(st, tScS, work.key_start, row_start, work.mask, params.exp2_scale, lse_log2);
      }
      warpgroup_wait<0>();
      warpgroup_fence_operand(acc_dp);
      ds_transposed(st, dpt, tScS, dsum);
    }
    // This warpgroup's queries of P^T and dS^T to shared memory. The buffer's previous contents
    // (two steps back) were read by GEMMs that both warpgroups waited for before the last barrier.
    Tensor pt = convert_fragment<Element>(acc_s);
    copy(smem_tiled_copy_pt, smem_thr_copy_pt.retile_S(pt), tPsPt(_, _, _, buffer));
    Tensor dst = convert_fragment<Element>(acc_dp);
    copy(smem_tiled_copy_pt, smem_thr_copy_pt.retile_S(dst), tdSsdSt(_, _, _, buffer));
    cutlass::arch::fence_view_async_shared();
    named_barrier_sync<BwdBarrier::kDsReady, 0, Traits::kConsumerThreads>();

    issue_gemm_wgmma<false>(mma_dkv, tdVrdOt(_, _, _, stage), tdVrPt(_, _, _, buffer), acc_dvt);
    issue_gemm_wgmma<false>(mma_dkv, tdKrQt(_, _, _, stage), tdKrdSt(_, _, _, buffer), acc_dkt);
    Tensor acc_dq = partition_fragment_C(mma_dq, TileQ{});
    issue_gemm_wgmma<true>(mma_dq, tdQrdS(_, _, _, buffer), tdQrKt, acc_dq);
    warpgroup_wait<1>();
    warpgroup_fence_operand(acc_dvt);
    warpgroup_fence_operand(acc_dkt);
    // This thread's GEMMs are done with the stage's Q and dO (dQ reads dS and K only).
    storage.query_empty[stage].arrive();
    warpgroup_wait<0>();
    warpgroup_fence_operand(acc_dq);

    // Rows past the sequence are not added (in a variable-length call they are the next one's).
    const int rows_left = work.sequence.seqlen_q - row_start;
    float* dq_block = dq_accum + int64_t(row_start) * kHeadDim;
    CUTE_UNROLL
    for (int i = 0; i < size(acc_dq); i += 2) {
      const int row = get<0>(tdQcdQ(i));
      if (row < rows_left) {
        atomicAdd(reinterpret_cast<float2*>(dq_block + row * kHeadDim + get<1>(tdQcdQ(i))),
                  make_float2(acc_dq(i), acc_dq(i + 1)));
      }
    }
  }

  Tensor tKVtc = thr_dkv.partition_C(make_identity_tensor(TileKVt{}));
  store_dk_dv<Element, kHeadDim, Traits::kBlockM, Traits::kBlockN, kMaskKind, true>(
      params, work, work.sequence.seqlen_k - work.key_start, acc_dkt, acc_dvt, tKVtc);
}

}  // namespace flash_cutlass::sm90
