// The consumers of the Hopper-path backward: two warpgroups of 64 keys each walk the query blocks
// that see their CTA's key block. Per query block (Q, dO, LSE and D from the loader's stage):
//   S^T = K Q^T, then dP^T = V dO^T          (wgmma, both operands in shared memory)
//   P^T = exp2(S^T scale - lse)              (while dP^T is still in the tensor cores; the scale and
//                                             the LSE's offset per query: probability_exponent)
//   dS^T = P^T (dP^T - D)                    (registers)
//   dV += P^T dO                             (wgmma, P^T straight from the accumulators)
//   dQ = dS K                                (wgmma from both warpgroups' dS^T in shared memory; at
//                                             head dim 64 without score mods or dropout the whole
//                                             block by one warpgroup, in turns)
//   dK += dS^T Q                             (wgmma, dS^T from the accumulators; at head dim 64
//                                             issued before dQ)
// and each block's dQ goes to shared memory (past head dim 64 while dK runs) for the dQ warp's TMA
// reduce-add (bwd_producer.h).
#pragma once

#include <cmath>
#include <type_traits>

#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>

#include "flash_cutlass/common/block_info.h"
#include "flash_cutlass/common/bwd_key_block.h"
#include "flash_cutlass/common/dropout.h"
#include "flash_cutlass/common/mask.h"
#include "flash_cutlass/common/score_mods.h"
#include "flash_cutlass/common/softmax.h"
#include "flash_cutlass/common/utils.h"
#include "flash_cutlass/params.h"
#include "flash_cutlass/sm90/barriers.h"
#include "flash_cutlass/sm90/bwd_epilogue.h"
#include "flash_cutlass/sm90/bwd_kernel_params.h"
#include "flash_cutlass/sm90/bwd_producer.h"
#include "flash_cutlass/sm90/fp32_tile_offsets.h"
#include "flash_cutlass/sm90/tile_scheduler.h"
#include "flash_cutlass/sm90/wgmma.h"

namespace flash_cutlass::sm90 {

// Where a query block's exponents of P come from (the statistics warp's stage, stage_query_statistics):
// per query an offset, and a scale that is the kernel's exp2_scale for every query unless the block
// holds a row of probability_exponent's exact form (exact_rows), which only extreme scores produce;
// the exponentials branch on that once a block, so that the usual blocks keep one scale in one
// register.
struct QueryExponents {
  const ScoreExponent* exponent;  // per query: its scale and offset
  float uniform_scale;
  bool exact_rows;

  template <bool kPerQueryScale>
  __device__ __forceinline__ ScoreExponent of(int local_query) const {
    if constexpr (kPerQueryScale) return exponent[local_query];
    else return {uniform_scale, exponent[local_query].offset};
  }
};

// The exponents of a stage's query block.
template <class PipelineStorage>
__device__ __forceinline__ QueryExponents query_exponents(PipelineStorage const& pipeline, int stage,
                                                          BwdParams const& params) {
  return {pipeline.exponent[stage], params.exp2_scale,
          pipeline.exact_rows[stage] != 0};
}

// In place on S^T as (keys, queries): P^T = exp2(scale S^T - offset), the queries' exponents from
// shared memory (offset +inf past the sequence: P = 0 there). With kApplyMask, keys past seqlen_k
// and keys outside a query's causal mask or window get P = 0.
template <bool kApplyMask, bool kPerQueryScale, MaskKind kMaskKind, class TensorS, class Coords>
__device__ __forceinline__ void probabilities_transposed(TensorS& st, Coords const& coords, int key_start, int row_start,
                                                         KeyMask<kMaskKind> const& mask,
                                                         QueryExponents const& exponents) {
  using namespace cute;
  CUTE_UNROLL
  for (int c = 0; c < size<1>(st); ++c) {
    const int local_query = get<1>(coords(0, c));
    const ScoreExponent e = exponents.of<kPerQueryScale>(local_query);
    const int query = row_start + local_query;
    const int key_begin = mask.key_begin(query);
    const int key_limit = mask.key_limit(query);
    CUTE_UNROLL
    for (int r = 0; r < size<0>(st); ++r) {
      float x = st(r, c) * e.scale - e.offset;
      if constexpr (kApplyMask) {
        const int key = key_start + get<0>(coords(r, c));
        if (key >= key_limit || (KeyMask<kMaskKind>::kLocal && key < key_begin)) x = -INFINITY;
      }
      st(r, c) = exp2f(x);
    }
  }
}

// In place on dP^T: dS^T = P^T (dP^T - D), D per query from shared memory (0 past the sequence).
template <class TensorP, class TensorDP, class Coords>
__device__ __forceinline__ void ds_transposed(TensorP const& pt, TensorDP& dpt, Coords const& coords,
                                              const float* dsum) {
  using namespace cute;
  CUTE_UNROLL
  for (int c = 0; c < size<1>(dpt); ++c) {
    const float row_dsum = dsum[get<1>(coords(0, c))];
    CUTE_UNROLL
    for (int r = 0; r < size<0>(dpt); ++r) dpt(r, c) = pt(r, c) * (dpt(r, c) - row_dsum);
  }
}

// Both at once for the extended kernels: the scores are capped and biased first, dS^T carries the
// cap's derivative (common/score_mods.h), and with dropout (common/dropout.h) P^T ends dropped and
// rescaled, as dV needs it, and dS^T = P^T (dropped, rescaled dP^T - D).
template <bool kApplyMask, bool kPerQueryScale, bool kDropout, MaskKind kMaskKind, class TensorS, class TensorDP,
          class Coords>
__device__ __forceinline__ void extended_probabilities_and_ds_transposed(
    TensorS& st, TensorDP& dpt, Coords const& coords, int key_start, int row_start, KeyMask<kMaskKind> const& mask,
    ScoreMods<true> const& score_mods, Dropout<kDropout> const& dropout, QueryExponents const& exponents,
    const float* dsum) {
  using namespace cute;
  CUTE_UNROLL
  for (int c = 0; c < size<1>(st); c += 2) {
    // Queries c and c + 1 are neighbours (the wgmma C layout of S^T), each with its own stats.
    ScoreExponent row_exponent[2];
    float row_dsum[2];
    int query[2], key_begin[2], key_limit[2];
    CUTE_UNROLL
    for (int i = 0; i < 2; ++i) {
      const int local_query = get<1>(coords(0, c + i));
      query[i] = row_start + local_query;
      row_exponent[i] = exponents.of<kPerQueryScale>(local_query);
      row_dsum[i] = dsum[local_query];
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
        float x = (score + score_mods.bias(query[i], key)) * row_exponent[i].scale - row_exponent[i].offset;
        if constexpr (kApplyMask) {
          if (key >= key_limit[i] || (KeyMask<kMaskKind>::kLocal && key < key_begin[i])) x = -INFINITY;
        }
        const float p = exp2f(x);
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
}

// The operands both consumer layouts read from shared memory, as tensors: Q and dO (and their
// head-dim-major views), K (and K^T), V, and dS^T (and dS).
template <class Traits>
__device__ __forceinline__ auto smem_operands(typename Traits::SharedStorage& storage) {
  using namespace cute;
  return cute::make_tuple(make_tensor(make_smem_ptr(storage.q.data()), typename Traits::SmemLayoutQ{}),
                          make_tensor(make_smem_ptr(storage.q.data()), typename Traits::SmemLayoutQt{}),
                          make_tensor(make_smem_ptr(storage.dout.data()), typename Traits::SmemLayoutdO{}),
                          make_tensor(make_smem_ptr(storage.dout.data()), typename Traits::SmemLayoutdOt{}),
                          make_tensor(make_smem_ptr(storage.k.data()), typename Traits::SmemLayoutKV{}),
                          make_tensor(make_smem_ptr(storage.k.data()), typename Traits::SmemLayoutKt{}),
                          make_tensor(make_smem_ptr(storage.v.data()), typename Traits::SmemLayoutKV{}),
                          make_tensor(make_smem_ptr(storage.ds.data()), typename Traits::SmemLayoutdSt{}),
                          make_tensor(make_smem_ptr(storage.ds.data()), typename Traits::SmemLayoutdS{}));
}

// f(apply_mask, per_query_scale) with both as compile-time bools (cute::true_type/false_type). With
// kMaskWithQueryScale, a block of per-query scales (rare: exact_rows) always takes the mask, which
// is then a no-op where the block needs none: three copies of the exponentials instead of four.
template <bool kMaskWithQueryScale, class F>
__device__ __forceinline__ void with_exponent_variant(bool apply_mask, bool per_query_scale, F&& f) {
  if (per_query_scale) {
    if (kMaskWithQueryScale || apply_mask) f(cute::true_type{}, cute::true_type{});
    else f(cute::false_type{}, cute::true_type{});
  } else {
    if (apply_mask) f(cute::true_type{}, cute::false_type{});
    else f(cute::false_type{}, cute::false_type{});
  }
}

// A query block's S^T (st, rows x columns view; coords: each element's (key, query) in the tile)
// turned in place into P^T, with the mask only where the block needs it. The 128-row blocks (head
// dim 64) keep three copies of the exponentials: with the fourth, ptxas left 28 local-memory
// stores and 26 loads in the consumer loop there (1 and 13 with three; +2-4% on an H100), while at
// 64 rows (head dim 128) three would add one.
template <int kBlockM, int kBlockN, MaskKind kMaskKind, class TensorS, class Coords>
__device__ __forceinline__ void probabilities_of_block(TensorS& st, Coords const& coords,
                                                       KeyBlockWork<kBlockM, kBlockN, kMaskKind> const& work,
                                                       int row_start, QueryExponents const& exponents) {
  const bool needs_mask = work.mask.tile_needs_mask(row_start, kBlockM, work.key_start, kBlockN);
  with_exponent_variant<(kBlockM >= 128)>(needs_mask, exponents.exact_rows, [&](auto apply_mask,
                                                                                  auto per_query_scale) {
    probabilities_transposed<decltype(apply_mask)::value, decltype(per_query_scale)::value>(
        st, coords, work.key_start, row_start, work.mask, exponents);
  });
}

// A query block's S^T = K Q^T and dP^T = V dO^T (both operands in shared memory), turned in place
// into P^T and dS^T: the exponentials while dP^T is still computed (the extended kernels, which
// need both at once, wait for both). Both consumer layouts run it on their part of the tile;
// wait_before_dp() runs between the two GEMMs' issue (dO's own barrier, where it has one, and V's
// in a walk's first block where V comes after the first Q and dO). Here dS^T is formed from the
// fp32 P^T (the 64 kernel once formed it from P^T rounded to the inputs' dtype, for fewer registers
// live across dP^T's wait: in bf16, dQ and dK went past FlashAttention-2's error rule on shapes of
// few keys a query).
template <MaskKind kMaskKind, int kBlockM, int kBlockN, class TiledMma, class FragK, class FragQ, class FragV,
          class FragdO, class Acc, class Coords, bool kExtended, bool kDropout, class WaitBeforeDp>
__device__ __forceinline__ void probabilities_and_ds_of_block(
    TiledMma& mma_sdp, FragK const& tSrK, FragQ const& tSrQ, FragV const& tdPrV, FragdO const& tdPrdO, Acc& acc_s,
    Acc& acc_dp, Coords const& tScS, BwdParams const& params, KeyBlockWork<kBlockM, kBlockN, kMaskKind> const& work,
    ScoreMods<kExtended> const& score_mods, Dropout<kDropout> const& dropout, int row_start,
    QueryExponents const& exponents, const float* dsum, WaitBeforeDp&& wait_before_dp) {
  using namespace cute;
  issue_gemm_wgmma<true>(mma_sdp, tSrK, tSrQ, acc_s);
  wait_before_dp();
  issue_gemm_wgmma<true>(mma_sdp, tdPrV, tdPrdO, acc_dp);
  Tensor st = as_rows_cols(acc_s);
  Tensor dpt = as_rows_cols(acc_dp);
  if constexpr (kExtended) {
    const bool needs_mask = work.mask.tile_needs_mask(row_start, kBlockM, work.key_start, kBlockN);
    warpgroup_wait<0>();
    warpgroup_fence_operand(acc_s);
    warpgroup_fence_operand(acc_dp);
    // Every query's own scale: a second copy of this larger loop for the usual blocks costs ptxas
    // more spills than the scale's loads do.
    if (needs_mask) {
      extended_probabilities_and_ds_transposed<true, true>(st, dpt, tScS, work.key_start, row_start, work.mask,
                                                           score_mods, dropout, exponents, dsum);
    } else {
      extended_probabilities_and_ds_transposed<false, true>(st, dpt, tScS, work.key_start, row_start, work.mask,
                                                            score_mods, dropout, exponents, dsum);
    }
  } else {
    warpgroup_wait<1>();
    warpgroup_fence_operand(acc_s);
    probabilities_of_block(st, tScS, work, row_start, exponents);
    warpgroup_wait<0>();
    warpgroup_fence_operand(acc_dp);
    ds_transposed(st, dpt, tScS, dsum);
  }
}

// The consumer warpgroups' whole walk over a CTA's query blocks, then dK and dV out (by TMA from
// K's and V's tiles where the call allows, bwd_epilogue.h; in persistent walks, whose next tile's K
// and V load while dK and dV go out, through the walk's last query stages, held for them).
// consumer_idx: the thread's index among the consumer threads.
template <class Traits, MaskKind kMaskKind, Extension kExtension, bool kRotatedWalk>
__device__ __forceinline__ void consume_query_blocks(BwdKernelParams<Traits> const& kernel_params,
                                                     KeyBlockWork<Traits::kBlockM, Traits::kBlockN, kMaskKind> const& work,
                                                     KeyWalkPosition const& position,
                                                     typename Traits::SharedStorage& storage, int consumer_idx) {
  using namespace cute;
  BwdParams const& params = kernel_params.call;
  constexpr bool kExtended = kExtension != Extension::kNone;
  constexpr bool kDropout = kExtension == Extension::kDropout;
  using Element = typename Traits::Element;
  using TileQ = typename Traits::TileQ;
  using TileKV = typename Traits::TileKV;
  using TileSt = typename Traits::TileSt;
  constexpr bool kDqInTurns = Traits::dq_in_turns(kExtended);
  constexpr int kDqThreads = Traits::dq_staging_threads(kExtended) + 32;  // with the dQ warp
  constexpr bool kDqUnderDk = Traits::kHeadDim > 64 && !kDqInTurns;
  static_assert(!(kDqUnderDk && kDqInTurns), "dQ in turns is written for dK issued before the dS barrier");

  // The extended kernels' tiles take one query head (BwdParams::query_heads_per_key_tile is 1 there).
  const ScoreMods<kExtended> score_mods = score_mods_of<kExtended>(params, work.tile.batch, work.tile.head,
                                                                   work.sequence.seqlen_q, work.sequence.seqlen_k);
  const Dropout<kDropout> dropout = dropout_of<kDropout>(params, work.tile.batch, work.tile.head);

  auto [sQ, sQt, sdO, sdOt, sK, sKt, sV, sdSt, sdS] = smem_operands<Traits>(storage);

  typename Traits::TiledMmaSdP mma_sdp;
  typename Traits::TiledMmadKV mma_dkv;
  typename Traits::template TiledMmadQFor<kExtended> mma_dq;
  const int warpgroup = consumer_idx / 128;
  auto thr_sdp = mma_sdp.get_thread_slice(consumer_idx);
  auto thr_dkv = mma_dkv.get_thread_slice(consumer_idx);
  auto thr_dq = mma_dq.get_thread_slice(kDqInTurns ? consumer_idx % 128 : consumer_idx);
  Tensor tSrK = thr_sdp.partition_fragment_A(sK);       // descriptors
  Tensor tSrQ = thr_sdp.partition_fragment_B(sQ);       // (MMA, MMA_N, MMA_K, stage)
  Tensor tdPrV = thr_sdp.partition_fragment_A(sV);
  Tensor tdPrdO = thr_sdp.partition_fragment_B(sdO);
  Tensor tdVrdOt = thr_dkv.partition_fragment_B(sdOt);  // (MMA, MMA_N, MMA_K, stage)
  Tensor tdKrQt = thr_dkv.partition_fragment_B(sQt);
  Tensor tdQrdS = thr_dq.partition_fragment_A(sdS);     // (MMA, MMA_M, MMA_K, dS buffer)
  Tensor tdQrKt = thr_dq.partition_fragment_B(sKt);
  auto smem_tiled_copy_ds = make_tiled_copy_C(typename Traits::SmemCopyAtomdS{}, mma_sdp);
  auto smem_thr_copy_ds = smem_tiled_copy_ds.get_thread_slice(consumer_idx);
  Tensor tdSsdS = smem_thr_copy_ds.partition_D(sdSt);   // (CPY, CPY_M, CPY_N, dS buffer)

  Tensor acc_dk = partition_fragment_C(mma_dkv, TileKV{});
  Tensor acc_dv = partition_fragment_C(mma_dkv, TileKV{});
  clear(acc_dk);
  clear(acc_dv);
  // (key, query) of every S^T accumulator element inside its tile.
  Tensor tScS = as_rows_cols(thr_sdp.partition_C(make_identity_tensor(TileSt{})));
  Tensor tdQcdQ = thr_dq.partition_C(make_identity_tensor(TileQ{}));
  static_assert(std::is_same_v<typename Traits::SmemLayoutdQ,
                               decltype(tile_to_shape(GMMA::Layout_K_SW128_Atom<float>{}, TileQ{}))>,
                "Fp32TileOffsets is the closed form of this layout");
  float* sdq = storage.dq.data();

  const bool holds_last_stages = kRotatedWalk && stages_dk_dv_in_query_stages(kernel_params, work);
  // V lands once in a CTA's walk (its one tile) where it comes after the first Q and dO.
  const bool v_later = loads_v_after_first_query<kRotatedWalk, Traits>(params, work);
  if (work.m_block_begin < work.m_block_end) storage.pipeline.kv_full.wait(position.key_tiles & 1);
  for (int i = 0; i < work.num_steps(); ++i) {
    const int m_block = work.m_block_of_step(i);
    const int step = position.steps + i;  // of the CTA's walk
    const int stage = step % Traits::kStages;
    const int ds_buffer = step & 1;
    const int row_start = m_block * Traits::kBlockM;
    storage.pipeline.query_full[stage].wait((step / Traits::kStages) & 1);
    auto wait_for_v = [&] {
      if (v_later && i == 0) storage.pipeline.v_full.wait(0);
    };

    Tensor acc_s = partition_fragment_C(mma_sdp, TileSt{});
    Tensor acc_dp = partition_fragment_C(mma_sdp, TileSt{});
    // P^T and dS^T in the inputs' dtype: the register A operands of dV and dK; dS^T also to shared
    // memory for dQ. P^T is rounded once dS^T is formed (rounding first, or into a fragment made
    // ahead, changes ptxas's schedule and measured 3-6% slower at 128).
    probabilities_and_ds_of_block(mma_sdp, tSrK, tSrQ(_, _, _, stage), tdPrV, tdPrdO(_, _, _, stage), acc_s, acc_dp,
                                  tScS, params, work, score_mods, dropout, row_start,
                                  query_exponents(storage.pipeline, stage, params), storage.pipeline.dsum[stage],
                                  wait_for_v);
    Tensor pt = convert_fragment<Element>(acc_s);
    Tensor tdVrPt = make_tensor(pt.data(), acc_layout_as_operand_a(pt.layout()));
    issue_gemm_wgmma<false>(mma_dkv, tdVrPt, tdVrdOt(_, _, _, stage), acc_dv);
    Tensor dst = convert_fragment<Element>(acc_dp);
    copy(smem_tiled_copy_ds, smem_thr_copy_ds.retile_S(dst), tdSsdS(_, _, _, ds_buffer));
    Tensor tdKrdSt = make_tensor(dst.data(), acc_layout_as_operand_a(dst.layout()));

    // dQ = dS K once both warpgroups' dS^T is in shared memory (dV, and at head dim 64 dK, run
    // meanwhile): the warpgroups each take half the head dim, or in turns by step the whole block
    // (Traits::dq_in_turns; the other runs on into the next block's S^T and dP^T). The other dS
    // buffer may still be read by the step before's dQ GEMM until its warpgroup reaches this
    // barrier. Past head dim 64 dK comes after dQ, and dQ goes to shared memory while dK runs
    // (+2-3% at 128, -2% at 64).
    if constexpr (!kDqUnderDk) issue_gemm_wgmma<false>(mma_dkv, tdKrdSt, tdKrQt(_, _, _, stage), acc_dk);
    cutlass::arch::fence_view_async_shared();
    named_barrier_sync<BwdBarrier::kDsReady, 0, Traits::kConsumerThreads>();
    auto release_stage = [&] {
      warpgroup_fence_operand(acc_dk);
      warpgroup_fence_operand(dst);
      // This thread's GEMMs are done with the stage's Q and dO (a persistent walk's last stages are
      // held for dK and dV: store_dk_dv_through_query_stages).
      if (!(holds_last_stages && i + Traits::kHeldStages >= work.num_steps())) {
        storage.pipeline.query_empty[stage].arrive();
      }
    };
    if (!kDqInTurns || (step & 1) == warpgroup) {
      Tensor acc_dq = partition_fragment_C(mma_dq, TileQ{});
      issue_gemm_wgmma<true>(mma_dq, tdQrdS(_, _, _, ds_buffer), tdQrKt, acc_dq);
      if constexpr (kDqUnderDk) {
        issue_gemm_wgmma<false>(mma_dkv, tdKrdSt, tdKrQt(_, _, _, stage), acc_dk);
        warpgroup_wait<1>();  // dV and dQ
      } else {
        warpgroup_wait<0>();
      }
      warpgroup_fence_operand(acc_dv);
      warpgroup_fence_operand(acc_dq);
      warpgroup_fence_operand(pt);
      if constexpr (!kDqUnderDk) release_stage();

      // The dQ warp has read the block before's dQ out of shared memory; this block's goes in.
      if (step > 0) named_barrier_sync<BwdBarrier::kDqEmpty, 0, kDqThreads>();
      store_fp32_tile<Traits::kBlockM>(sdq, acc_dq, tdQcdQ, 0);
      if constexpr (kDqUnderDk) {
        warpgroup_wait<0>();  // dK, under which dQ was stored
        release_stage();
      }
      cutlass::arch::fence_view_async_shared();
      named_barrier_arrive<BwdBarrier::kDqFull, 0, kDqThreads>();
    } else {
      warpgroup_wait<0>();  // dV and dK
      warpgroup_fence_operand(acc_dv);
      warpgroup_fence_operand(pt);
      release_stage();
    }
  }

  // The loader may bring the next tile's K and V while dK and dV go out.
  if (work.m_block_begin < work.m_block_end) storage.pipeline.kv_empty.arrive();
  write_dk_dv<Traits, kRotatedWalk>(kernel_params, work, position, acc_dk, acc_dv, mma_dkv, storage, consumer_idx);
}

}  // namespace flash_cutlass::sm90
