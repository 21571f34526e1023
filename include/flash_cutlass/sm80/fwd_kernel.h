// The sm80-path forward kernel: one CTA computes one (query block, head, batch) tile of
// out = softmax(scale * Q K^T) V and its log-sum-exp, streaming K and V tiles with cp.async into
// padded shared memory, each load overlapping the computation on the other buffer.
#pragma once

#include <cmath>

#include <cute/tensor.hpp>

#include "flash_cutlass/common/block_info.h"
#include "flash_cutlass/common/copy.h"
#include "flash_cutlass/common/dropout.h"
#include "flash_cutlass/common/mask.h"
#include "flash_cutlass/common/score_mods.h"
#include "flash_cutlass/common/softmax.h"
#include "flash_cutlass/common/utils.h"
#include "flash_cutlass/compiled_head_dims.h"
#include "flash_cutlass/params.h"
#include "flash_cutlass/sm80/gemm.h"
#include "flash_cutlass/sm80/kernel_traits.h"

namespace flash_cutlass::sm80 {

template <class Traits, MaskKind kMaskKind, Extension kExtension>
__device__ __forceinline__ void fwd_query_block(FwdParams const& params, char* smem, int m_block, int batch,
                                                int head) {
  using namespace cute;
  constexpr bool kExtended = carries_score_mods(kExtension);
  constexpr bool kDropout = carries_dropout(kExtension);
  using Element = typename Traits::Element;
  constexpr int kBlockM = Traits::kBlockM;
  constexpr int kBlockN = Traits::kBlockN;
  constexpr int kHeadDim = Traits::kHeadDim;

  const int tidx = threadIdx.x;
  const int head_k = kv_head_of(head, params);
  const Sequence sequence = sequence_of(params, batch);
  // In a variable-length call, the query blocks past this sequence's end have nothing to do.
  if (m_block * kBlockM >= sequence.seqlen_q) return;
  const int rows_left_q = sequence.seqlen_q - m_block * kBlockM;
  const KeyMask<kMaskKind> mask = key_mask_of<kMaskKind>(params, sequence.seqlen_q, sequence.seqlen_k);
  const ScoreMods<kExtended> score_mods =
      score_mods_of<kExtended>(params, batch, head, sequence.seqlen_q, sequence.seqlen_k);
  const Dropout<kDropout> dropout = dropout_of<kDropout>(params, batch, head);
  const KeyBlockRange key_blocks = key_block_range<kBlockM, kBlockN>(mask, m_block);

  // Global views of this (sequence, head): (seqlen, kHeadDim); columns past head_dim are predicated.
  Tensor mQ = head_matrix<Element, kHeadDim>(params.q, sequence.q_offset(params.q_batch_stride, params.q_row_stride),
                                             head, params.q_head_stride, sequence.seqlen_q, params.q_row_stride);
  Tensor mK = head_matrix<Element, kHeadDim>(params.k, sequence.k_offset(params.k_batch_stride, params.k_row_stride),
                                             head_k, params.k_head_stride, sequence.seqlen_k, params.k_row_stride);
  Tensor mV = head_matrix<Element, kHeadDim>(params.v, sequence.k_offset(params.v_batch_stride, params.v_row_stride),
                                             head_k, params.v_head_stride, sequence.seqlen_k, params.v_row_stride);
  Tensor mO = head_matrix<Element, kHeadDim>(params.out,
                                             sequence.q_offset(params.out_batch_stride, params.out_row_stride), head,
                                             params.out_head_stride, sequence.seqlen_q, params.out_row_stride);
  Tensor gQ = local_tile(mQ, typename Traits::TileQ{}, make_coord(m_block, 0));  // (kBlockM, kHeadDim)
  Tensor gK = local_tile(mK, typename Traits::TileKV{}, make_coord(_, 0));       // (kBlockN, kHeadDim, n_blocks)
  Tensor gV = local_tile(mV, typename Traits::TileKV{}, make_coord(_, 0));
  Tensor gO = local_tile(mO, typename Traits::TileQ{}, make_coord(m_block, 0));
  float* lse_row = params.lse + query_stats_index(params, sequence, head) + m_block * kBlockM;

  Element* smem_q = reinterpret_cast<Element*>(smem);
  Element* smem_k = smem_q + Traits::kSmemElemsQ;
  Element* smem_v = smem_k + Traits::kSmemElemsKV;
  Tensor sQ = make_tensor(make_smem_ptr(smem_q), typename Traits::SmemLayoutQ{});
  Tensor sK = make_tensor(make_smem_ptr(smem_k), typename Traits::SmemLayoutKV{});
  Tensor sV = make_tensor(make_smem_ptr(smem_v), typename Traits::SmemLayoutKV{});
  Tensor sVt = make_tensor(make_smem_ptr(smem_v), typename Traits::SmemLayoutVt{});

  // Global -> shared copies, with the coordinates that predicate tails.
  typename Traits::GmemTiledCopyQKV gmem_tiled_copy;
  auto gmem_thr_copy = gmem_tiled_copy.get_thread_slice(tidx);
  Tensor tQgQ = gmem_thr_copy.partition_S(gQ);
  Tensor tQsQ = gmem_thr_copy.partition_D(sQ);
  Tensor tKgK = gmem_thr_copy.partition_S(gK);  // (CPY, CPY_N, CPY_K, n_blocks)
  Tensor tKsK = gmem_thr_copy.partition_D(sK);  // (CPY, CPY_N, CPY_K)
  Tensor tVgV = gmem_thr_copy.partition_S(gV);
  Tensor tVsV = gmem_thr_copy.partition_D(sV);
  Tensor tQcQ = gmem_thr_copy.partition_S(make_identity_tensor(typename Traits::TileQ{}));
  Tensor tKVcKV = gmem_thr_copy.partition_S(make_identity_tensor(typename Traits::TileKV{}));
  // A thread's columns are the same in every tile of Q, K, V and O.
  Tensor col_ok = columns_below(tQcQ, params.head_dim);

  typename Traits::TiledMma tiled_mma;
  auto thr_mma = tiled_mma.get_thread_slice(tidx);
  Tensor tSrQ = thr_mma.partition_fragment_A(sQ);
  Tensor tSrK = thr_mma.partition_fragment_B(sK);
  Tensor tOrVt = thr_mma.partition_fragment_B(sVt);
  Tensor acc_o = partition_fragment_C(tiled_mma, typename Traits::TileQ{});
  clear(acc_o);

  auto smem_tiled_copy_q = make_tiled_copy_A(typename Traits::SmemCopyAtom{}, tiled_mma);
  auto smem_thr_copy_q = smem_tiled_copy_q.get_thread_slice(tidx);
  Tensor tSsQ = smem_thr_copy_q.partition_S(sQ);
  auto smem_tiled_copy_k = make_tiled_copy_B(typename Traits::SmemCopyAtom{}, tiled_mma);
  auto smem_thr_copy_k = smem_tiled_copy_k.get_thread_slice(tidx);
  Tensor tSsK = smem_thr_copy_k.partition_S(sK);
  auto smem_tiled_copy_v = make_tiled_copy_B(typename Traits::SmemCopyAtomTransposed{}, tiled_mma);
  auto smem_thr_copy_v = smem_tiled_copy_v.get_thread_slice(tidx);
  Tensor tOsVt = smem_thr_copy_v.partition_S(sVt);

  // Each fragment row of S and O is one query row; (row, col) of every element inside a tile.
  Tensor tScS = as_rows_cols(thr_mma.partition_C(make_identity_tensor(typename Traits::TileS{})));
  Tensor tOcO = as_rows_cols(thr_mma.partition_C(make_identity_tensor(typename Traits::TileQ{})));
  constexpr int kRowsPerThread = decltype(size<0>(tOcO))::value;
  Tensor acc_o_rc = as_rows_cols(acc_o);

  if (key_blocks.end > key_blocks.begin) {
    const int last = key_blocks.end - 1;
    const int rows_left_k = sequence.seqlen_k - last * kBlockN;
    // Only the last key block can be partial; it is the first one processed.
    OnlineSoftmax<kRowsPerThread> softmax(params.exp2_scale);
    // One K and one V buffer, refilled in turn: V of tile n streams in during S = Q K^T, and K of
    // tile n-1 during the softmax and P V of tile n. (Measured against two K/V stages, which keep a
    // whole tile in flight: the single buffers leave more of the SM's memory to the L1 cache,
    // where the register spills live, and ran 2-8% faster on the H200; docs/PERFORMANCE.md.)
    auto load_k = [&](int n_block, auto check_rows) __attribute__((always_inline)) {
      copy_tile_async<decltype(check_rows)::value>(gmem_tiled_copy, tKgK(_, _, _, n_block), tKsK, tKVcKV, col_ok,
                                                   rows_left_k);
    };
    auto load_v = [&](int n_block, auto check_rows) __attribute__((always_inline)) {
      copy_tile_async<decltype(check_rows)::value>(gmem_tiled_copy, tVgV(_, _, _, n_block), tVsV, tKVcKV, col_ok,
                                                   rows_left_k);
    };
    // Prologue: Q and the first K tile in one cp.async group, the first V tile in the next.
    copy_tile_async<true>(gmem_tiled_copy, tQgQ, tQsQ, tQcQ, col_ok, rows_left_q);
    load_k(last, cute::true_type{});
    cp_async_fence();
    load_v(last, cute::true_type{});
    cp_async_fence();

    // One key tile: S = Q K^T, the mask (for `masked` tiles), online softmax, O += P V.
    auto process_tile = [&](int n_block, auto first_tile, auto masked) __attribute__((always_inline)) {
      Tensor acc_s = partition_fragment_C(tiled_mma, typename Traits::TileS{});
      clear(acc_s);
      if constexpr (decltype(first_tile)::value) {
        cp_async_wait<1>();  // Q and K have landed; V may still be in flight
        __syncthreads();
      } else {
        cp_async_wait<0>();  // K of this tile has landed
        __syncthreads();     // ... for every thread, and every warp is done reading the V buffer
        load_v(n_block, cute::false_type{});
        cp_async_fence();
      }
      gemm_smem_smem(tiled_mma, acc_s, tSrQ, tSrK, tSsQ, tSsK, smem_tiled_copy_q, smem_thr_copy_q,
                     smem_tiled_copy_k, smem_thr_copy_k);
      Tensor s = as_rows_cols(acc_s);
      if constexpr (kExtended) {
        score_mods.cap(s);
        score_mods.add_bias(s, tScS, m_block * kBlockM, n_block * kBlockN);
      }
      if constexpr (decltype(masked)::value) mask.apply(s, tScS, m_block * kBlockM, n_block * kBlockN);
      cp_async_wait<0>();  // V of this tile has landed
      __syncthreads();     // ... for every thread, and every warp is done reading the K buffer
      if (n_block > key_blocks.begin) load_k(n_block - 1, cute::false_type{});
      cp_async_fence();
      softmax.template update<decltype(first_tile)::value>(s, acc_o_rc);
      if constexpr (kDropout) dropout.apply(s, tScS, m_block * kBlockM, n_block * kBlockN);
      // P goes straight from the S accumulator into the A operand registers of P.V.
      Tensor p = convert_fragment<Element>(acc_s);
      Tensor tOrP = make_tensor(p.data(), acc_layout_as_operand_a(p.layout()));
      gemm_regs_smem(tiled_mma, acc_o, tOrP, tOrVt, tOsVt, smem_tiled_copy_v, smem_thr_copy_v);
    };
    // Key blocks run from the last to the first: the ones that need a mask (the seqlen_k tail,
    // the diagonal) come first, then a loop free of masking; with a window, one loop that masks the
    // tiles on the window's edges (one masked and one unmasked copy of the tile step, as without it).
    // The Hopper forward walks the same order; a helper shared by both, taking the step as a
    // lambda, changed this kernel's register allocation and spills, so each kernel spells it out.
    process_tile(last, cute::true_type{}, cute::true_type{});
    if constexpr (kMaskKind == MaskKind::kLocal) {
      for (int n_block = last - 1; n_block >= key_blocks.begin; --n_block) {
        if (n_block >= key_blocks.unmasked_end || n_block < key_blocks.unmasked_begin) {
          process_tile(n_block, cute::false_type{}, cute::true_type{});
        } else {
          process_tile(n_block, cute::false_type{}, cute::false_type{});
        }
      }
    } else {
      int n_block = last - 1;
      for (; n_block >= key_blocks.unmasked_end; --n_block) process_tile(n_block, cute::false_type{}, cute::true_type{});
      for (; n_block >= 0; --n_block) process_tile(n_block, cute::false_type{}, cute::false_type{});
    }

    float lse[kRowsPerThread];
    softmax.finalize(acc_o_rc, lse_score_unit<kExtended>(params), lse, sink_of(params, head));
    if constexpr (kDropout) {
      CUTE_UNROLL
      for (int i = 0; i < size(acc_o_rc); ++i) acc_o_rc(i) *= dropout.keep_scale;
    }
    CUTE_UNROLL
    for (int r = 0; r < kRowsPerThread; ++r) {
      const int row = get<0>(tOcO(r, 0));
      if (get<1>(tOcO(r, 0)) == 0 && row < rows_left_q) lse_row[row] = lse[r];
    }
  } else {
    // No row of this block sees any key (a causal mask or window with seqlen_q > seqlen_k). O stays 0,
    // lse is -inf (the sink, with one).
    const float sink = sink_of(params, head);
    CUTE_UNROLL
    for (int r = 0; r < kRowsPerThread; ++r) {
      const int row = get<0>(tOcO(r, 0));
      if (get<1>(tOcO(r, 0)) == 0 && row < rows_left_q) lse_row[row] = sink;
    }
  }

  // Epilogue: O -> shared (Q's storage) -> 16-byte coalesced global stores.
  Tensor o = convert_fragment<Element>(acc_o);
  Tensor sO = make_tensor(sQ.data(), typename Traits::SmemLayoutO{});
  auto smem_tiled_copy_o = make_tiled_copy_C(typename Traits::SmemCopyAtomO{}, tiled_mma);
  auto smem_thr_copy_o = smem_tiled_copy_o.get_thread_slice(tidx);
  __syncthreads();  // all reads of sQ are done
  copy(smem_tiled_copy_o, smem_thr_copy_o.retile_S(o), smem_thr_copy_o.partition_D(sO));
  __syncthreads();

  typename Traits::GmemTiledCopyO gmem_tiled_copy_o;
  auto gmem_thr_copy_o = gmem_tiled_copy_o.get_thread_slice(tidx);
  Tensor tOsO = gmem_thr_copy_o.partition_S(sO);
  Tensor tOgO = gmem_thr_copy_o.partition_D(gO);
  Tensor tOrO = make_tensor<Element>(shape(tOgO));
  copy(gmem_tiled_copy_o, tOsO, tOrO);
  store_tile(gmem_tiled_copy_o, tOrO, tOgO, tQcQ, col_ok, rows_left_q);
}

// Grid: one CTA per (query block, head, batch), flattened into x: each (head, batch)'s query blocks
// from the last to the first, and with a causal mask longest first across bands of (head, batch)
// pairs (block_info.h), so that the CTAs the hardware starts last are the shortest (+1-5% at head
// dims 64 and 128, 2k-8k, on the H200). A trap in the compilation passes that leave its head dim
// out (sm80_head_dim_in_this_pass: the sm_90a code at the Hopper path's head dims).
template <class Traits, MaskKind kMaskKind, Extension kExtension>
__global__ void __launch_bounds__(Traits::kThreads, 1) flash_fwd_sm80(__grid_constant__ const FwdParams params) {
  if constexpr (sm80_head_dim_in_this_pass<Direction::kForward, Traits::kHeadDim>()) {
    extern __shared__ __align__(128) char smem[];
    record_philox_state<carries_dropout(kExtension)>(params);
    const QueryTile tile = kMaskKind == MaskKind::kCausal
                               ? longest_first_query_tile_of_this_cta<Traits::kBlockM>(params)
                               : query_tile_of_this_cta<Traits::kBlockM>(params);
    fwd_query_block<Traits, kMaskKind, kExtension>(params, smem, tile.m_block, tile.batch, tile.head);
  } else {
    __trap();  // left out of this pass: csrc/flash_api.cpp refuses its calls before any launch
  }
}

}  // namespace flash_cutlass::sm80
