// The consumers of the Hopper-path backward past head dim 128 (BwdHeadSplitKernelTraits): two
// warpgroups walk the query blocks that see their CTA's 64 keys. Per query block:
//   S^T = K Q^T, then dP^T = V dO^T          (each warpgroup half of the queries)
//   P^T, dS^T as in bwd_mainloop.h           (registers), then to shared memory in the inputs' dtype
//   dV^T += dO^T P, dK^T += Q^T dS           (each warpgroup half of the head dim, both operands
//                                            in shared memory: P and dS of both warpgroups)
//   dQ = dS K                                (each warpgroup half of the head dim)
// and each warpgroup adds its half of the block's dQ to dq_accum with 8-byte atomics while the
// tensor cores run dV^T and dK^T (in a deterministic call, once the block's turn has come:
// ordered_reduce.h, keep_dq_turns in bwd_producer.h).
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
#include "flash_cutlass/sm90/ordered_reduce.h"
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

  auto [sQ, sQt, sdO, sdOt, sK, sKt, sV, sdSt, sdS] = smem_operands<Traits>(storage);
  Tensor sPt = make_tensor(make_smem_ptr(storage.pt.data()), typename Traits::SmemLayoutdSt{});

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
  auto smem_tiled_copy_pt = make_tiled_copy_C(typename Traits::SmemCopyAtomdS{}, mma_sdp);
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
  const int dq_row0 = get<0>(tdQcdQ(0)), dq_col0 = get<1>(tdQcdQ(0));
  // Deterministic calls: the atomics of a block wait for its turn, which warp 1 keeps
  // (keep_dq_turns); the GEMMs before them do not.
  // The same condition as warp 1's (DqTurns: a deterministic call, with its counters).
  const bool ordered = bool(DqTurns<Traits::kBlockM, Traits::kBlockN, kMaskKind>(params, work));
  constexpr int kTurnThreads = Traits::kConsumerThreads + 32;

  if (work.m_block_begin < work.m_block_end) storage.pipeline.kv_full.wait(0);
  for (int m_block = work.m_block_begin; m_block < work.m_block_end; ++m_block) {
    const int step = m_block - work.m_block_begin;
    const int stage = step % Traits::kStages;
    const int buffer = step & 1;
    const int row_start = m_block * Traits::kBlockM;
    storage.pipeline.query_full[stage].wait((step / Traits::kStages) & 1);

    Tensor acc_s = partition_fragment_C(mma_sdp, TileSt{});
    Tensor acc_dp = partition_fragment_C(mma_sdp, TileSt{});
    probabilities_and_ds_of_block(mma_sdp, tSrK, tSrQ(_, _, _, stage), tdPrV, tdPrdO(_, _, _, stage), acc_s, acc_dp,
                                  tScS, params, work, score_mods, dropout, row_start,
                                  query_exponents(storage.pipeline, stage, params), storage.pipeline.dsum[stage]);
    // This warpgroup's queries of P^T and dS^T to shared memory. The buffer's previous contents
    // (two steps back) were read by GEMMs that both warpgroups waited for before the last barrier.
    Tensor pt = convert_fragment<Element>(acc_s);
    copy(smem_tiled_copy_pt, smem_thr_copy_pt.retile_S(pt), tPsPt(_, _, _, buffer));
    Tensor dst = convert_fragment<Element>(acc_dp);
    copy(smem_tiled_copy_pt, smem_thr_copy_pt.retile_S(dst), tdSsdSt(_, _, _, buffer));
    cutlass::arch::fence_view_async_shared();
    named_barrier_sync<BwdBarrier::kDsReady, 0, Traits::kConsumerThreads>();

    // dQ first: its atomics then run while the tensor cores compute dV^T and dK^T.
    Tensor acc_dq = partition_fragment_C(mma_dq, TileQ{});
    issue_gemm_wgmma<true>(mma_dq, tdQrdS(_, _, _, buffer), tdQrKt, acc_dq);
    issue_gemm_wgmma<false>(mma_dkv, tdVrdOt(_, _, _, stage), tdVrPt(_, _, _, buffer), acc_dvt);
    issue_gemm_wgmma<false>(mma_dkv, tdKrQt(_, _, _, stage), tdKrdSt(_, _, _, buffer), acc_dkt);
    warpgroup_wait<2>();
    warpgroup_fence_operand(acc_dq);
    if (ordered) named_barrier_sync<BwdBarrier::kDqTurn, 0, kTurnThreads>();
    // Rows past the sequence are not added (in a variable-length call they are the next one's).
    // An element's distance from the thread's first is known at compile time: its address is a
    // base plus an immediate.
    const int rows_left = work.sequence.seqlen_q - row_start - dq_row0;
    float* dq_thread = dq_accum + int64_t(row_start + dq_row0) * kHeadDim + dq_col0;
    CUTE_UNROLL
    for (int i = 0; i < size(acc_dq); i += 2) {
      const int dr = get<0>(tdQcdQ(i)) - dq_row0;
      if (dr < rows_left) {
        atomicAdd(reinterpret_cast<float2*>(dq_thread + dr * kHeadDim + (get<1>(tdQcdQ(i)) - dq_col0)),
                  make_float2(acc_dq(i), acc_dq(i + 1)));
      }
    }
    // Every thread's atomics come before warp 1's release through the barrier (no per-thread
    // fence: one would make ptxas return every atomic's value, the usual calls' too).
    if (ordered) named_barrier_arrive<BwdBarrier::kDqAdded, 0, kTurnThreads>();
    warpgroup_wait<0>();
    warpgroup_fence_operand(acc_dvt);
    warpgroup_fence_operand(acc_dkt);
    // This thread's GEMMs are done with the stage's Q and dO.
    storage.pipeline.query_empty[stage].arrive();
  }

  Tensor tKVtc = thr_dkv.partition_C(make_identity_tensor(TileKVt{}));
  store_dk_dv<Element, kHeadDim, Traits::kBlockM, Traits::kBlockN, kMaskKind, true>(
      params, work, work.sequence.seqlen_k - work.key_start, acc_dkt, acc_dvt, tKVtc);
}

}  // namespace flash_cutlass::sm90
