// The consumers of the Hopper-path backward past head dim 128 (BwdHeadSplitKernelTraits): two
// warpgroups walk the query blocks that see their CTA's 64 keys. Per query block:
//   S^T = K Q^T and P^T                      (warpgroup 0, the whole tile; P^T to shared memory)
//   dP^T = V dO^T and dS^T                   (warpgroup 1, the whole tile, from P^T read back in
//                                            the inputs' dtype; dS^T to shared memory)
//   (the soft-cap, ALiBi and dropout kernels: each warpgroup both for half of the queries, as in
//   bwd_mainloop.h, since they need a score and its dP at once)
//   dV += P^T dO                             (each warpgroup half of the head dim, both operands
//                                            in shared memory: P^T of both warpgroups; dO's stage
//                                            is released once it is done)
//   dQ = dS K                                (each warpgroup half of the head dim)
//   dK += dS^T Q                             (as dV)
// and each warpgroup stages its half of the block's dQ in shared memory while dK runs, warpgroup
// 0 first, for the dQ warp's TMA reduce-add (write_dq in bwd_producer.h).
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
#include "flash_cutlass/sm90/bwd_epilogue.h"
#include "flash_cutlass/sm90/bwd_kernel_params.h"
#include "flash_cutlass/sm90/fp32_tile_offsets.h"
#include "flash_cutlass/sm90/bwd_mainloop.h"
#include "flash_cutlass/sm90/bwd_producer.h"
#include "flash_cutlass/sm90/tile_scheduler.h"
#include "flash_cutlass/sm90/wgmma.h"

namespace flash_cutlass::sm90 {

// consumer_idx: the thread's index among the consumer threads. dK and dV go out as in
// consume_query_blocks (bwd_mainloop.h).
template <class Traits, MaskKind kMaskKind, Extension kExtension, bool kRotatedWalk>
__device__ __forceinline__ void consume_query_blocks_head_split(
    BwdKernelParams<Traits> const& kernel_params, KeyBlockWork<Traits::kBlockM, Traits::kBlockN, kMaskKind> const& work,
    KeyWalkPosition const& position, typename Traits::SharedStorage& storage, int consumer_idx) {
  using namespace cute;
  BwdParams const& params = kernel_params.call;
  static_assert(Traits::kHeadSplit);
  static_assert(Traits::kSeparatedO, "dO's own barriers (dout_full, dout_empty) are waited on below");
  constexpr bool kExtended = kExtension != Extension::kNone;
  constexpr bool kDropout = kExtension == Extension::kDropout;
  constexpr int kHeadDim = Traits::kHeadDim;
  using Element = typename Traits::Element;
  using TileQ = typename Traits::TileQ;
  using TileKV = typename Traits::TileKV;
  using TileSt = typename Traits::TileSt;

  // The extended kernels' tiles take one query head (BwdParams::query_heads_per_key_tile is 1 there).
  const ScoreMods<kExtended> score_mods = score_mods_of<kExtended>(params, work.tile.batch, work.tile.head,
                                                                   work.sequence.seqlen_q, work.sequence.seqlen_k);
  const Dropout<kDropout> dropout = dropout_of<kDropout>(params, work.tile.batch, work.tile.head);

  auto [sQ, sQt, sdO, sdOt, sK, sKt, sV, sdSt, sdS] = smem_operands<Traits>(storage);
  Tensor sPt = make_tensor(make_smem_ptr(storage.pt.data()), typename Traits::SmemLayoutdSt{});

  typename Traits::TiledMmaSdP mma_sdp;
  typename Traits::TiledMmadKV mma_dkv;
  typename Traits::TiledMmadQ mma_dq;
  auto thr_sdp = mma_sdp.get_thread_slice(consumer_idx);
  auto thr_dkv = mma_dkv.get_thread_slice(consumer_idx);
  auto thr_dq = mma_dq.get_thread_slice(consumer_idx);
  Tensor tSrK = thr_sdp.partition_fragment_A(sK);       // descriptors
  Tensor tSrQ = thr_sdp.partition_fragment_B(sQ);       // (MMA, MMA_N, MMA_K, stage)
  Tensor tdPrV = thr_sdp.partition_fragment_A(sV);
  Tensor tdPrdO = thr_sdp.partition_fragment_B(sdO);
  Tensor tdVrPt = thr_dkv.partition_fragment_A(sPt);    // (MMA, MMA_M, MMA_K, buffer)
  Tensor tdVrdOt = thr_dkv.partition_fragment_B(sdOt);  // (MMA, MMA_N, MMA_K, stage)
  Tensor tdKrdSt = thr_dkv.partition_fragment_A(sdSt);
  Tensor tdKrQt = thr_dkv.partition_fragment_B(sQt);
  Tensor tdQrdS = thr_dq.partition_fragment_A(sdS);     // (MMA, MMA_M, MMA_K, buffer)
  Tensor tdQrKt = thr_dq.partition_fragment_B(sKt);
  auto smem_tiled_copy_pt = make_tiled_copy_C(typename Traits::SmemCopyAtomdS{}, mma_sdp);
  auto smem_thr_copy_pt = smem_tiled_copy_pt.get_thread_slice(consumer_idx);
  Tensor tPsPt = smem_thr_copy_pt.partition_D(sPt);     // (CPY, CPY_M, CPY_N, buffer)
  Tensor tdSsdSt = smem_thr_copy_pt.partition_D(sdSt);

  Tensor acc_dk = partition_fragment_C(mma_dkv, TileKV{});
  Tensor acc_dv = partition_fragment_C(mma_dkv, TileKV{});
  clear(acc_dk);
  clear(acc_dv);
  // (key, query) of every S^T accumulator element inside its tile; (query, column) of dQ's.
  Tensor tScS = as_rows_cols(thr_sdp.partition_C(make_identity_tensor(TileSt{})));
  Tensor tdQcdQ = thr_dq.partition_C(make_identity_tensor(TileQ{}));
  // This warpgroup's half of dQ in the staging tile: its columns less the half's first.
  const int warpgroup = consumer_idx / 128;
  static_assert(std::is_same_v<typename Traits::SmemLayoutdQ,
                               decltype(tile_to_shape(GMMA::Layout_K_SW128_Atom<float>{}, typename Traits::TileDq{}))>,
                "Fp32TileOffsets is the closed form of this layout");
  float* sdq = storage.dq.data();
  constexpr int kDqThreads = Traits::dq_staging_threads(kExtended) + 32;  // a warpgroup and the dQ warp

  // Without score modifications or dropout, S^T by warpgroup 0 and dP^T by warpgroup 1, each the
  // whole tile (TiledMmaSdPByRole); warpgroup 1 reads P^T back for dS^T. The extended kernels need
  // a score and its dP at once per element and keep the split by queries.
  constexpr bool kByRole = !kExtended;
  typename Traits::TiledMmaSdPByRole mma_role;
  const int warpgroup_thread = consumer_idx % 128;
  auto thr_role = mma_role.get_thread_slice(warpgroup_thread);
  auto store_pt_role = make_tiled_copy_C(typename Traits::SmemCopyAtomdS{}, mma_role);
  auto thr_store_pt_role = store_pt_role.get_thread_slice(warpgroup_thread);
  auto load_pt_role = make_tiled_copy_C(typename Traits::SmemLoadAtomPt{}, mma_role);
  auto thr_load_pt_role = load_pt_role.get_thread_slice(warpgroup_thread);

  // V lands once in a CTA's walk (its one tile) where it comes after the first Q and dO; warpgroup
  // 0's GEMMs (S^T, dV, dQ, dK) never read it.
  const bool v_later = loads_v_after_first_query<kRotatedWalk, Traits>(params, work);
  if (work.m_block_begin < work.m_block_end) storage.pipeline.kv_full.wait(position.key_tiles & 1);
  for (int i = 0; i < work.num_steps(); ++i) {
    const int m_block = work.m_block_of_step(i);
    const int step = position.steps + i;  // of the CTA's walk
    const int stage = step % Traits::kStages;
    const int dout_stage = step % Traits::kStagesdO;
    const int buffer = step & 1;
    const int row_start = m_block * Traits::kBlockM;
    storage.pipeline.query_full[stage].wait((step / Traits::kStages) & 1);

    auto wait_for_dout = [&] { storage.pipeline.dout_full[dout_stage].wait((step / Traits::kStagesdO) & 1); };
    // Before dP^T = V dO^T.
    auto wait_before_dp = [&] {
      wait_for_dout();
      if (v_later && i == 0) storage.pipeline.v_full.wait(0);
    };
    // P^T and dS^T of the block to shared memory (both warpgroups read all of them), then dV first
    // (dO's stage then goes back to the loader), dQ, and dK, under which dQ is staged. A buffer's
    // previous contents (two steps back) were read by GEMMs that both warpgroups waited for before
    // the last kDsReady barrier.
    if constexpr (kByRole) {
      if (warpgroup == 0) {
        Tensor acc_s = partition_fragment_C(mma_role, TileSt{});
        issue_gemm_wgmma<true>(mma_role, thr_role.partition_fragment_A(sK), thr_role.partition_fragment_B(sQ)(_, _, _, stage),
                               acc_s);
        warpgroup_wait<0>();
        warpgroup_fence_operand(acc_s);
        Tensor st = as_rows_cols(acc_s);
        Tensor coords = as_rows_cols(thr_role.partition_C(make_identity_tensor(TileSt{})));
        probabilities_of_block(st, coords, work, row_start, query_exponents(storage.pipeline, stage, params));
        Tensor pt = convert_fragment<Element>(acc_s);
        copy(store_pt_role, thr_store_pt_role.retile_S(pt), thr_store_pt_role.partition_D(sPt)(_, _, _, buffer));
        cutlass::arch::fence_view_async_shared();
        named_barrier_arrive<BwdBarrier::kPReady, 0, Traits::kConsumerThreads>();
        wait_for_dout();
        issue_gemm_wgmma<false>(mma_dkv, tdVrPt(_, _, _, buffer), tdVrdOt(_, _, _, dout_stage), acc_dv);
      } else {
        wait_before_dp();
        Tensor acc_dp = partition_fragment_C(mma_role, TileSt{});
        issue_gemm_wgmma<true>(mma_role, thr_role.partition_fragment_A(sV),
                               thr_role.partition_fragment_B(sdO)(_, _, _, dout_stage), acc_dp);
        warpgroup_wait<0>();
        warpgroup_fence_operand(acc_dp);
        named_barrier_sync<BwdBarrier::kPReady, 0, Traits::kConsumerThreads>();
        // dV needs only P^T: it runs while this warpgroup forms dS^T.
        issue_gemm_wgmma<false>(mma_dkv, tdVrPt(_, _, _, buffer), tdVrdOt(_, _, _, dout_stage), acc_dv);
        Tensor pt = make_fragment_like<Element>(acc_dp);
        copy(load_pt_role, thr_load_pt_role.partition_S(sPt)(_, _, _, buffer), thr_load_pt_role.retile_D(pt));
        Tensor pt_float = convert_fragment<float>(pt);
        Tensor dpt = as_rows_cols(acc_dp);
        ds_transposed(as_rows_cols(pt_float), dpt, as_rows_cols(thr_role.partition_C(make_identity_tensor(TileSt{}))),
                      storage.pipeline.dsum[stage]);
        Tensor dst = convert_fragment<Element>(acc_dp);
        copy(store_pt_role, thr_store_pt_role.retile_S(dst), thr_store_pt_role.partition_D(sdSt)(_, _, _, buffer));
        cutlass::arch::fence_view_async_shared();
      }
      named_barrier_sync<BwdBarrier::kDsReady, 0, Traits::kConsumerThreads>();
    } else {
      Tensor acc_s = partition_fragment_C(mma_sdp, TileSt{});
      Tensor acc_dp = partition_fragment_C(mma_sdp, TileSt{});
      probabilities_and_ds_of_block(mma_sdp, tSrK, tSrQ(_, _, _, stage), tdPrV, tdPrdO(_, _, _, dout_stage), acc_s,
                                    acc_dp, tScS, params, work, score_mods, dropout, row_start,
                                    query_exponents(storage.pipeline, stage, params), storage.pipeline.dsum[stage],
                                    wait_before_dp);
      // This warpgroup's queries of P^T and dS^T.
      Tensor pt = convert_fragment<Element>(acc_s);
      copy(smem_tiled_copy_pt, smem_thr_copy_pt.retile_S(pt), tPsPt(_, _, _, buffer));
      Tensor dst = convert_fragment<Element>(acc_dp);
      copy(smem_tiled_copy_pt, smem_thr_copy_pt.retile_S(dst), tdSsdSt(_, _, _, buffer));
      cutlass::arch::fence_view_async_shared();
      named_barrier_sync<BwdBarrier::kDsReady, 0, Traits::kConsumerThreads>();
      issue_gemm_wgmma<false>(mma_dkv, tdVrPt(_, _, _, buffer), tdVrdOt(_, _, _, dout_stage), acc_dv);
    }
    Tensor acc_dq = partition_fragment_C(mma_dq, TileQ{});
    issue_gemm_wgmma<true>(mma_dq, tdQrdS(_, _, _, buffer), tdQrKt, acc_dq);
    issue_gemm_wgmma<false>(mma_dkv, tdKrdSt(_, _, _, buffer), tdKrQt(_, _, _, stage), acc_dk);
    warpgroup_wait<1>();
    warpgroup_fence_operand(acc_dv);
    warpgroup_fence_operand(acc_dq);
    storage.pipeline.dout_empty[dout_stage].arrive();

    // The staging tile is free: warpgroup 0 waits for the dQ warp to have read the block before's
    // second half, warpgroup 1 for this block's first. Immediate barrier ids (a computed one costs
    // registers).
    if (warpgroup == 0) {
      if (step > 0) named_barrier_sync<BwdBarrier::kDqEmpty, 0, kDqThreads>();
    } else {
      named_barrier_sync<BwdBarrier::kDqEmpty, 2, kDqThreads>();
    }
    store_fp32_tile<Traits::kBlockM>(sdq, acc_dq, tdQcdQ, warpgroup * (kHeadDim / Traits::kConsumerWarpgroups));
    cutlass::arch::fence_view_async_shared();
    if (warpgroup == 0) {
      named_barrier_arrive<BwdBarrier::kDqFull, 0, kDqThreads>();
    } else {
      named_barrier_arrive<BwdBarrier::kDqFull, 2, kDqThreads>();
    }
    warpgroup_wait<0>();
    warpgroup_fence_operand(acc_dk);
    // This thread's GEMMs are done with the stage's Q.
    storage.pipeline.query_empty[stage].arrive();
  }

  // The loader may bring the next tile's K and V while dK and dV go out.
  if (work.m_block_begin < work.m_block_end) storage.pipeline.kv_empty.arrive();
  // The epilogue stages dK and dV in K's and V's tiles: warpgroup 0 too sees V's load complete
  // first (long done by now).
  if (v_later && warpgroup == 0 && work.m_block_begin < work.m_block_end) storage.pipeline.v_full.wait(0);
  write_dk_dv<Traits, kRotatedWalk>(kernel_params, work, position, acc_dk, acc_dv, mma_dkv, storage, consumer_idx);
}

}  // namespace flash_cutlass::sm90
