// The consumer warpgroups of the Hopper-path forward, one tile at a time: S = Q K^T over the tile's
// key blocks (from the last to the first, the order the producer loads them in), the online softmax
// in registers, O += P V, the warpgroups taking turns at the tensor cores (barriers.h: the
// ping-pong), then O, normalized and in the inputs' dtype, and the log-sum-exp handed to the
// epilogue (fwd_epilogue.h), which stores them.
//
// O's conversion to the inputs' dtype stays here rather than in the epilogue: there, ptxas assigned
// the log-sum-exp's registers in another order at head dims 64 and 256 (the same instructions), and
// this split keeps the machine code of every kernel unchanged.
#pragma once

#include <cmath>
#include <utility>

#include <cute/tensor.hpp>

#include "flash_cutlass/common/block_info.h"
#include "flash_cutlass/common/dropout.h"
#include "flash_cutlass/common/mask.h"
#include "flash_cutlass/common/score_mods.h"
#include "flash_cutlass/common/softmax.h"
#include "flash_cutlass/common/utils.h"
#include "flash_cutlass/params.h"
#include "flash_cutlass/sm90/barriers.h"
#include "flash_cutlass/sm90/tile_config.h"
#include "flash_cutlass/sm90/tile_scheduler.h"
#include "flash_cutlass/sm90/timeline.h"
#include "flash_cutlass/sm90/wgmma.h"

namespace flash_cutlass::sm90 {

// One consumer warpgroup's work on one tile. The state that lives across tiles (the MMAs and their
// shared-memory fragments, O's accumulator, the K/V pipeline's read stage, the count of Q tiles
// consumed, the timeline) is the kernel's; FwdConsumer refers to it.
template <class Traits, MaskKind kMaskKind, Extension kExtension, class SmemQ, class FragQ, class FragK, class FragVt,
          class AccO, class AccORowsCols, class CoordsS>
struct FwdConsumer {
  using Element = typename Traits::Element;
  using PipelineKV = typename Traits::PipelineKV;
  using TileShape = typename Traits::TileShape;
  static constexpr int kBlockM = Traits::kBlockM;
  static constexpr int kBlockN = Traits::kBlockN;
  static constexpr bool kExtended = carries_score_mods(kExtension);
  static constexpr bool kDropout = carries_dropout(kExtension);
  // S = Q K^T with Q from registers (tile_config.h).
  static constexpr bool kQInRegisters =
      Traits::kQInRegisters || (kMaskKind == MaskKind::kCausal && Traits::kQInRegistersWhenCausal);
  static constexpr int kRowsPerThread = decltype(cute::size<0>(std::declval<AccORowsCols&>()))::value;

  FwdParams const& params_;
  Timeline& timeline_;
  int const& warpgroup_;
  AccO& acc_o_;
  typename Traits::SharedStorage& storage_;
  int& q_loads_;
  typename Traits::TiledMmaQK& mma_qk_;
  CoordsS& tScS_;
  int const& consumer_idx_;
  SmemQ& sQ_;
  FragK& tSrK_;
  typename PipelineKV::PipelineState& state_;
  FragQ& tSrQ_;
  PipelineKV& pipeline_k_;
  PipelineKV& pipeline_v_;
  typename Traits::TiledMmaPV& mma_pv_;
  FragVt& tOrVt_;
  AccORowsCols& acc_o_rc_;

  // The tile's O and log-sum-exp go to epilogue.store_tile (fwd_epilogue.h).
  template <class Epilogue>
  __device__ __forceinline__ void compute_tile(QueryTile tile, Epilogue& epilogue) {
    using namespace cute;
    // Local names for the kernel's objects: the lambdas below capture the objects themselves, as
    // they did when this body was a lambda of the kernel. Reaching them through `this` instead
    // adds a load to every capture and changed the machine code (registers, order). The steps that
    // close over the tile's state (softmax, mask, P's registers, the stage tokens) stay lambdas for
    // that reason: as member functions, even stamp_step and test_next_stages changed the uniform
    // registers of the kernels built with FLASH_CUTLASS_TIMELINE.
    auto& params = params_;
    auto& timeline = timeline_;
    auto& warpgroup = warpgroup_;
    auto& acc_o = acc_o_;
    auto& storage = storage_;
    auto& q_loads = q_loads_;
    auto& mma_qk = mma_qk_;
    auto& tScS = tScS_;
    auto& consumer_idx = consumer_idx_;
    auto& sQ = sQ_;
    auto& tSrK = tSrK_;
    auto& state = state_;
    auto& tSrQ = tSrQ_;
    auto& pipeline_k = pipeline_k_;
    auto& pipeline_v = pipeline_v_;
    auto& mma_pv = mma_pv_;
    auto& tOrVt = tOrVt_;
    auto& acc_o_rc = acc_o_rc_;
    const auto work = tile_work<kBlockM, kBlockN, kMaskKind>(params, tile);
    if (!work.in_sequence()) return;
    timeline.stamp(warpgroup, kTileStart);
    const int m_block = work.tile.m_block, head = work.tile.head, batch = work.tile.batch;
    const Sequence& sequence = work.sequence;
    const KeyMask<kMaskKind>& mask = work.mask;
    const KeyBlockRange& key_blocks = work.key_blocks;
    float lse[kRowsPerThread];
    clear(acc_o);
    const float sink = sink_of(params, head);  // loaded here: its latency stays out of the epilogue

    if (work.has_keys()) {
      const ScoreMods<kExtended> score_mods =
          score_mods_of<kExtended>(params, batch, head, sequence.seqlen_q, sequence.seqlen_k);
      const Dropout<kDropout> dropout = dropout_of<kDropout>(params, batch, head);
      OnlineSoftmax<kRowsPerThread, Traits::kSoftmaxChains> softmax(params.exp2_scale);
      storage.q_full.wait(q_loads & 1);
      timeline.stamp(warpgroup, kQArrived);
      // `state`: the K/V stage of the key tile being scored.
      // Intra-warpgroup overlap: the scores of tile n (S = Q K^T, then the softmax) run while the
      // tensor cores do P V of tile n+1 (the one scored before; key blocks run from the last down).
      // P lives in its own registers and O is rescaled only once that P V is done. ptxas would
      // place a plain wait for P V before the softmax's exponentials (a wait has no inputs, so it
      // fills the first latency gap); warpgroup_wait_after keeps it after them where the registers
      // allow (Traits::kSoftmaxOverlapsPV). The warpgroups' ping-pong below overlaps one
      // warpgroup's softmax with the others' GEMMs regardless.
      Tensor acc_s = partition_fragment_C(mma_qk, select<0, 1>(TileShape{}));
      Tensor p = make_tensor<Element>(acc_s.layout());
      Tensor tOrP = make_tensor(p.data(), acc_layout_as_operand_a(p.layout()));
      float correction[kRowsPerThread];
      bool rescale_o = false;  // whether the tile just scored moved a row maximum of this warp (the lazy rescale)
      // Rows past the sequence (zeros from TMA, or the next packed sequence's queries) do not vote
      // on the warp's rescale, so that a sequence's bits do not depend on what follows it.
      bool row_in_sequence[kRowsPerThread];
      CUTE_UNROLL
      for (int r = 0; r < kRowsPerThread; ++r) {
        row_in_sequence[r] = m_block * kBlockM + get<0>(tScS(r, 0)) < sequence.seqlen_q;
      }
      const int consumer = warpgroup - 1;
      constexpr int kConsumers = Traits::kConsumerWarpgroups;
      if (consumer == kConsumers - 1) hand_over_turn<kConsumers>(consumer);  // consumer 0 issues first
      // kQInRegisters: this warpgroup's Q rows, copied once per tile from shared memory
      // (ldmatrix) into the A fragment of the register-sourced S = Q K^T.
      typename Traits::TiledMmaQKRegisterQ mma_qk_register_q;
      auto thr_qk_register_q = mma_qk_register_q.get_thread_slice(consumer_idx);
      Tensor tSrQ_registers = thr_qk_register_q.partition_fragment_A(sQ);
      if constexpr (kQInRegisters) {
        auto copy_q = make_tiled_copy_A(Copy_Atom<SM75_U32x4_LDSM_N, Element>{}, mma_qk_register_q);
        auto thr_copy_q = copy_q.get_thread_slice(consumer_idx);
        copy(copy_q, thr_copy_q.partition_S(sQ), thr_copy_q.retile_D(tSrQ_registers));
      }
      // The wgmma of S = Q K^T for one key tile, issued (the caller waits for it).
      auto issue_scores = [&]() __attribute__((always_inline)) {
        if constexpr (kQInRegisters) {
          issue_gemm_wgmma<true>(mma_qk_register_q, tSrQ_registers, tSrK(_, _, _, state.index()), acc_s);
        } else {
          issue_gemm_wgmma<true>(mma_qk, tSrQ, tSrK(_, _, _, state.index()), acc_s);
        }
      };
      // Once S has landed in `scores` (acc_s, or the half block's; `coords` its tScS): the score
      // options, the mask (for `masked` tiles), the softmax but O's rescale, and dropout, in place.
      auto softmax_scores = [&](auto& scores, auto const& coords, int n_block, auto first_tile, auto masked)
                                __attribute__((always_inline)) {
        warpgroup_fence_operand(scores);
        Tensor s = as_rows_cols(scores);
        constexpr bool kAheadOfMax = Traits::kExponentiatesAheadOfMax && !decltype(first_tile)::value &&
                                     !decltype(masked)::value;
        // Ahead of the maximum, K's stage stays until the tile is known not to be scored again.
        if constexpr (!kAheadOfMax) pipeline_k.consumer_release(state);
        prepare_scores<decltype(masked)::value>(score_mods, mask, s, coords, m_block * kBlockM, n_block * kBlockN);
        if constexpr (decltype(first_tile)::value) {
          softmax.template update_scores<true>(s, correction);
        } else if constexpr (kAheadOfMax) {
          float tile_sum[kRowsPerThread];
          const bool kept = all_of_warpgroup<kConsumers>(
              consumer, softmax.exponentiate_against_kept_max(s, tile_sum, row_in_sequence));
          if (kept) {
            softmax.add_tile_sums(tile_sum);
            rescale_o = false;
          } else {
            // A row of the warpgroup outgrew its kept maximum (or its P is not finite): the scores
            // again, every maximum moved.
            issue_scores();
            warpgroup_wait<0>();
            warpgroup_fence_operand(scores);
            prepare_scores<false>(score_mods, mask, s, coords, m_block * kBlockM, n_block * kBlockN);
            softmax.template update_scores<false>(s, correction);
            rescale_o = true;
          }
          pipeline_k.consumer_release(state);
        } else {
          rescale_o = softmax.update_scores_lazily(s, correction, row_in_sequence);
        }
        if constexpr (kDropout) dropout.apply(s, coords, m_block * kBlockM, n_block * kBlockN);
        warpgroup_fence_operand(scores);
      };
      // Whether the next step's K and V stages have landed, tested (mbarrier test_wait, which does
      // not block) at the end of a softmax so that the test's latency hides behind the wait for P V
      // there; a stage found ready skips its wait at the next step's start
      // (Traits::kTestsNextStagesEarly).
      cutlass::ConsumerToken next_k_ready{cutlass::BarrierStatus::WaitAgain};
      cutlass::ConsumerToken next_v_ready{cutlass::BarrierStatus::WaitAgain};
      auto test_next_stages = [&]() __attribute__((always_inline)) {
        if constexpr (Traits::kTestsNextStagesEarly) {
          typename PipelineKV::PipelineState next_k = state;
          ++next_k;
          next_k_ready = pipeline_k.consumer_test_wait(next_k);
          next_v_ready = pipeline_v.consumer_test_wait(state);
        }
      };
      // The timeline's probed step (timeline.h; compiled out without FLASH_CUTLASS_TIMELINE).
      auto stamp_step = [&](bool probed, int event) __attribute__((always_inline)) {
        if (probed) timeline.stamp(warpgroup, event);
      };
      // One steady-state step: tile n_block is scored while P V of the tile before it runs.
      auto process_tile = [&](int n_block, auto masked) __attribute__((always_inline)) {
        const bool probed = n_block == key_blocks.end - kProbedKeyBlockFromEnd;
        stamp_step(probed, kStepStart);
        typename PipelineKV::PipelineState state_v = state;  // the stage of the tile scored before
        ++state;
        pipeline_k.consumer_wait(state, next_k_ready);
        pipeline_v.consumer_wait(state_v, next_v_ready);
        stamp_step(probed, kStepStagesReady);
        wait_for_turn<kConsumers>(consumer);
        stamp_step(probed, kStepTurnTaken);
        issue_scores();
        issue_gemm_wgmma<false>(mma_pv, tOrP, tOrVt(_, _, _, state_v.index()), acc_o);
        hand_over_turn<kConsumers>(consumer);
        stamp_step(probed, kStepGemmsIssued);
        warpgroup_wait<1>();  // S of this tile
        stamp_step(probed, kStepScoresLanded);
        softmax_scores(acc_s, tScS, n_block, cute::false_type{}, masked);
        test_next_stages();
        stamp_step(probed, kStepSoftmaxDone);
        // P V of the tile before
        if constexpr (Traits::kSoftmaxOverlapsPV) {
          warpgroup_wait_after<0>(softmax.row_sum[0], softmax.row_sum[kRowsPerThread - 1]);
        } else {
          warpgroup_wait<0>();
        }
        stamp_step(probed, kStepPVLanded);
        warpgroup_fence_operand(acc_o);
        warpgroup_fence_operand(tOrP);
        pipeline_v.consumer_release(state_v);
        if (rescale_o) softmax.rescale(acc_o_rc, correction);
        store_probabilities(p, acc_s);
        stamp_step(probed, kStepDone);
      };
      // Key blocks run from the last to the first: the ones that need a mask (the seqlen_k tail,
      // the diagonal) come first, then a loop free of masking; with a window, one loop that masks the
      // tiles on the window's edges (one masked and one unmasked copy of the tile step, as without it).
      // The producer loads the same blocks in the same order.
      // With a causal mask, the first key blocks visited (the last ones) can lie past the diagonal
      // for all of this warpgroup's rows while the tile's later rows see them: the warpgroup
      // takes its turns for them and releases their stages without computing them
      // (Traits::kSkipsKeyBlocksPastDiagonal). It keeps at least one key block, which starts its
      // softmax.
      constexpr int kRowsPerWarpgroup = kBlockM / kConsumers;
      // One past the last key any row of this warpgroup sees.
      const int warpgroup_key_limit = mask.key_limit(m_block * kBlockM + kRowsPerWarpgroup * (consumer + 1) - 1);
      int skipped_blocks = 0;
      if constexpr (kMaskKind == MaskKind::kCausal && Traits::kSkipsKeyBlocksPastDiagonal) {
        const int warpgroup_end = (max(0, warpgroup_key_limit) + kBlockN - 1) / kBlockN;
        skipped_blocks = max(0, min(key_blocks.end - warpgroup_end, key_blocks.end - 1 - key_blocks.begin));
      }
      skip_key_blocks(skipped_blocks, consumer);
      const int last = key_blocks.end - 1 - skipped_blocks;
      // The first block visited starts the softmax. With Traits::kHalvesFirstKeyBlock and a causal
      // mask it is scored on its first half of keys only where this warpgroup's rows see none of the
      // second half (the diagonal block of the first 64 rows of a 128-row tile); its P V then
      // multiplies the second half of the stage's V by P = 0, as a masked block would. The key
      // blocks' whole visit is compiled once per case: with a branch around the first block alone,
      // ptxas gave every steady loop 13-15 more instructions (2 or fewer this way).
      pipeline_k.consumer_wait(state);
      // Q's shared memory is free once its last reader has completed: the first key block's
      // S = Q K^T with kQInRegisters (the half block's reads it there), else the last one's.
      // The producer then brings the next tile's Q while this one finishes.
      auto release_q = [&]() __attribute__((always_inline)) { storage.q_empty.arrive(); };
      auto visit_key_blocks = [&](auto half) __attribute__((always_inline)) {
        if constexpr (decltype(half)::value) {
          // A shared-memory descriptor does not depend on N: the half GEMM reads the first rows of
          // the full block's K through its descriptors.
          typename Traits::TiledMmaQKHalf mma_qk_half;
          auto thr_qk_half = mma_qk_half.get_thread_slice(consumer_idx);
          Tensor tScS_half = as_rows_cols(
              thr_qk_half.partition_C(make_identity_tensor(select<0, 1>(typename Traits::TileShapeHalf{}))));
          // The half block's scores in the first half of acc_s's registers (its first column groups).
          Tensor acc_s_half = make_tensor(
              acc_s.data(), partition_fragment_C(mma_qk_half, select<0, 1>(typename Traits::TileShapeHalf{})).layout());
          wait_for_turn<kConsumers>(consumer);
          issue_gemm_wgmma<true>(mma_qk_half, tSrQ, tSrK(_, _, _, state.index()), acc_s_half);
          hand_over_turn<kConsumers>(consumer);
          warpgroup_wait<0>();
          timeline.stamp(warpgroup, kFirstScoresLanded);
          if constexpr (kQInRegisters) release_q();
          softmax_scores(acc_s_half, tScS_half, last, cute::true_type{}, cute::true_type{});
          store_probabilities(p, acc_s_half);
        } else {
          wait_for_turn<kConsumers>(consumer);
          issue_scores();
          hand_over_turn<kConsumers>(consumer);
          warpgroup_wait<0>();
          timeline.stamp(warpgroup, kFirstScoresLanded);
          if constexpr (kQInRegisters) release_q();
          // Without a mask only a seqlen_k tail needs one: a first block before it runs unmasked
          // (+1% at head dim 128 and 2k keys, +2% at 8k on the H200).
          if (kMaskKind == MaskKind::kNone && last < key_blocks.unmasked_end) {
            softmax_scores(acc_s, tScS, last, cute::true_type{}, cute::false_type{});
          } else {
            softmax_scores(acc_s, tScS, last, cute::true_type{}, cute::true_type{});
          }
          store_probabilities(p, acc_s);
        }
        test_next_stages();
        timeline.stamp(warpgroup, kFirstBlockDone);
        if constexpr (kMaskKind == MaskKind::kLocal) {
          for (int n_block = last - 1; n_block >= key_blocks.begin; --n_block) {
            if (n_block >= key_blocks.unmasked_end || n_block < key_blocks.unmasked_begin) {
              process_tile(n_block, cute::true_type{});
            } else {
              process_tile(n_block, cute::false_type{});
            }
          }
        } else {
          int n_block = last - 1;
          for (; n_block >= key_blocks.unmasked_end; --n_block) process_tile(n_block, cute::true_type{});
          for (; n_block >= 0; --n_block) process_tile(n_block, cute::false_type{});
        }
      };
      if constexpr (Traits::kHalvesFirstKeyBlock && kMaskKind == MaskKind::kCausal) {
        if (warpgroup_key_limit <= last * kBlockN + Traits::kHalfBlockN) {
          visit_key_blocks(cute::true_type{});
        } else {
          visit_key_blocks(cute::false_type{});
        }
      } else {
        visit_key_blocks(cute::false_type{});
      }
      if constexpr (!kQInRegisters) release_q();
      // P V of the last tile scored.
      pipeline_v.consumer_wait(state, next_v_ready);
      wait_for_turn<kConsumers>(consumer);
      issue_gemm_wgmma<false>(mma_pv, tOrP, tOrVt(_, _, _, state.index()), acc_o);
      hand_over_turn<kConsumers>(consumer);
      warpgroup_wait<0>();
      warpgroup_fence_operand(acc_o);
      timeline.stamp(warpgroup, kLastPVLanded);
      pipeline_v.consumer_release(state);
      // The last consumer's last hand-over has no turn of consumer 0 left to meet: take it here, so
      // that no barrier is left half-arrived. (The last consumer arrives again only in its next tile,
      // after the epilogue's sync of the consumers, which consumer 0 reaches after this wait.)
      if (consumer == 0) wait_for_turn<kConsumers>(consumer);
      ++state;
      ++q_loads;
      softmax.finalize(acc_o_rc, lse_score_unit<kExtended>(params), lse, sink);
      if constexpr (kDropout) {
        CUTE_UNROLL
        for (int i = 0; i < size(acc_o_rc); ++i) acc_o_rc(i) *= dropout.keep_scale;
      }
    } else {
      // No row of this block sees any key (a causal mask or window with seqlen_q > seqlen_k). O stays
      // 0, lse is -inf (the sink, with one).
      CUTE_UNROLL
      for (int r = 0; r < kRowsPerThread; ++r) lse[r] = sink;
    }

    timeline.stamp(warpgroup, kFinalized);
    Tensor o = convert_fragment<Element>(acc_o);
    epilogue.store_tile(work, o, lse);
  }

  // Takes this warpgroup's turns for `count` key blocks and releases their stages without computing
  // them (the causal blocks past the diagonal for all of its rows).
  __device__ __forceinline__ void skip_key_blocks(int count, int consumer) {
    for (int skipped = 0; skipped < count; ++skipped) {
      pipeline_k_.consumer_wait(state_);
      pipeline_v_.consumer_wait(state_);
      wait_for_turn<Traits::kConsumerWarpgroups>(consumer);
      hand_over_turn<Traits::kConsumerWarpgroups>(consumer);
      pipeline_k_.consumer_release(state_);
      pipeline_v_.consumer_release(state_);
      ++state_;
    }
  }

  // P of the tile just scored, in the inputs' dtype. A half block's scores are the first half of P's
  // registers (an accumulator's values run over its column groups last); the rest is 0.
  template <class P, class Scores>
  __device__ __forceinline__ static void store_probabilities(P& p, Scores const& scores) {
    constexpr int kScored = decltype(cute::size(scores))::value;
    constexpr int kSize = decltype(cute::size(p))::value;
    static_assert(kSize % kScored == 0);
    *reinterpret_cast<cutlass::Array<Element, kScored>*>(p.data()) =
        *reinterpret_cast<cutlass::Array<Element, kScored> const*>(convert_fragment<Element>(scores).data());
    if constexpr (kScored < kSize) {
      reinterpret_cast<cutlass::Array<Element, kSize - kScored>*>(p.data() + kScored)->clear();
    }
  }
};

}  // namespace flash_cutlass::sm90
