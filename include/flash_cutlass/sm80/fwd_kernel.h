// The sm80-path forward kernel: one CTA computes one (query block, head, batch) tile of
// out = softmax(scale * Q K^T) V and its log-sum-exp, streaming K/V tiles through a
// double-buffered cp.async pipeline into padded shared memory.
#pragma once

#include <cmath>

#include <cute/tensor.hpp>

#include "flash_cutlass/common/block_info.h"
#include "flash_cutlass/common/mask.h"
#include "flash_cutlass/common/softmax.h"
#include "flash_cutlass/common/utils.h"
#include "flash_cutlass/params.h"
#include "flash_cutlass/sm80/gemm.h"
#include "flash_cutlass/sm80/kernel_traits.h"

namespace flash_cutlass::sm80 {

template <class Traits, bool kCausal>
__device__ __forceinline__ void fwd_query_block(FwdParams const& params, char* smem, int m_block, int batch,
                                                int head) {
  using namespace cute;
  using Element = typename Traits::Element;
  constexpr int kBlockM = Traits::kBlockM;
  constexpr int kBlockN = Traits::kBlockN;
  constexpr int kHeadDim = Traits::kHeadDim;
  using TileQ = Shape<Int<kBlockM>, Int<kHeadDim>>;
  using TileKV = Shape<Int<kBlockN>, Int<kHeadDim>>;
  using TileS = Shape<Int<kBlockM>, Int<kBlockN>>;

  const int tidx = threadIdx.x;
  const int head_k = head / (params.heads / params.heads_k);
  const int rows_left_q = params.seqlen_q - m_block * kBlockM;
  const KeyMask<kCausal> mask{params.seqlen_q, params.seqlen_k};
  const KeyBlockRange key_blocks = key_block_range<kBlockM, kBlockN>(mask, m_block);

  // Global views of this (batch, head): (seqlen, kHeadDim); columns past head_dim are predicated.
  auto gmem_matrix = [](auto const* base, int64_t batch_offset, int64_t head_offset, int rows, int64_t row_stride) {
    return make_tensor(make_gmem_ptr(static_cast<Element const*>(base) + batch_offset + head_offset),
                       make_shape(rows, Int<kHeadDim>{}), make_stride(row_stride, _1{}));
  };
  Tensor mQ = gmem_matrix(params.q, batch * params.q_batch_stride, head * params.q_head_stride,
                          params.seqlen_q, params.q_row_stride);
  Tensor mK = gmem_matrix(params.k, batch * params.k_batch_stride, head_k * params.k_head_stride,
                          params.seqlen_k, params.k_row_stride);
  Tensor mV = gmem_matrix(params.v, batch * params.v_batch_stride, head_k * params.v_head_stride,
                          params.seqlen_k, params.v_row_stride);
  Tensor mO = make_tensor(make_gmem_ptr(static_cast<Element*>(params.out) + batch * params.out_batch_stride +
                                        head * params.out_head_stride),
                          make_shape(params.seqlen_q, Int<kHeadDim>{}), make_stride(params.out_row_stride, _1{}));
  Tensor gQ = local_tile(mQ, TileQ{}, make_coord(m_block, 0));  // (kBlockM, kHeadDim)
  Tensor gK = local_tile(mK, TileKV{}, make_coord(_, 0));       // (kBlockN, kHeadDim, n_blocks)
  Tensor gV = local_tile(mV, TileKV{}, make_coord(_, 0));
  Tensor gO = local_tile(mO, TileQ{}, make_coord(m_block, 0));
  float* lse_row = params.lse + (int64_t(batch) * params.heads + head) * params.seqlen_q + m_block * kBlockM;

  Element* smem_q = reinterpret_cast<Element*>(smem);
  Element* smem_k = smem_q + Traits::kSmemElemsQ;
  Element* smem_v = smem_k + Traits::kSmemElemsKV;
  Tensor sQ = make_tensor(make_smem_ptr(smem_q), typename Traits::SmemLayoutQ{});
  Tensor sK = make_tensor(make_smem_ptr(smem_k), typename Traits::SmemLayoutKVStages{});
  Tensor sV = make_tensor(make_smem_ptr(smem_v), typename Traits::SmemLayoutKVStages{});
  Tensor sVt = make_tensor(make_smem_ptr(smem_v), typename Traits::SmemLayoutVtStages{});

  // Global -> shared copies, with the coordinates that predicate tails.
  typename Traits::GmemTiledCopyQKV gmem_tiled_copy;
  auto gmem_thr_copy = gmem_tiled_copy.get_thread_slice(tidx);
  Tensor tQgQ = gmem_thr_copy.partition_S(gQ);
  Tensor tQsQ = gmem_thr_copy.partition_D(sQ);
  Tensor tKgK = gmem_thr_copy.partition_S(gK);  // (CPY, CPY_N, CPY_K, n_blocks)
  Tensor tKsK = gmem_thr_copy.partition_D(sK);  // (CPY, CPY_N, CPY_K, kStages)
  Tensor tVgV = gmem_thr_copy.partition_S(gV);
  Tensor tVsV = gmem_thr_copy.partition_D(sV);
  Tensor tQcQ = gmem_thr_copy.partition_S(make_identity_tensor(TileQ{}));
  Tensor tKVcKV = gmem_thr_copy.partition_S(make_identity_tensor(TileKV{}));
  // A thread's columns are the same in every tile of Q, K, V and O.
  Tensor col_ok = make_tensor<bool>(make_shape(size<2>(tQsQ)));
  CUTE_UNROLL
  for (int k = 0; k < size(col_ok); ++k) col_ok(k) = get<1>(tQcQ(0, 0, k)) < params.head_dim;

  typename Traits::TiledMma tiled_mma;
  auto thr_mma = tiled_mma.get_thread_slice(tidx);
  Tensor tSrQ = thr_mma.partition_fragment_A(sQ);
  Tensor tSrK = thr_mma.partition_fragment_B(sK(_, _, 0));
  Tensor tOrVt = thr_mma.partition_fragment_B(sVt(_, _, 0));
  Tensor acc_o = partition_fragment_C(tiled_mma, TileQ{});
  clear(acc_o);

  auto smem_tiled_copy_q = make_tiled_copy_A(typename Traits::SmemCopyAtom{}, tiled_mma);
  auto smem_thr_copy_q = smem_tiled_copy_q.get_thread_slice(tidx);
  Tensor tSsQ = smem_thr_copy_q.partition_S(sQ);
  auto smem_tiled_copy_k = make_tiled_copy_B(typename Traits::SmemCopyAtom{}, tiled_mma);
  auto smem_thr_copy_k = smem_tiled_copy_k.get_thread_slice(tidx);
  Tensor tSsK = smem_thr_copy_k.partition_S(sK);  // (CPY, CPY_N, CPY_K, kStages)
  auto smem_tiled_copy_v = make_tiled_copy_B(typename Traits::SmemCopyAtomTransposed{}, tiled_mma);
  auto smem_thr_copy_v = smem_tiled_copy_v.get_thread_slice(tidx);
  Tensor tOsVt = smem_thr_copy_v.partition_S(sVt);

  // Each fragment row of S and O is one query row; (row, col) of every element inside a tile.
  Tensor tScS = as_rows_cols(thr_mma.partition_C(make_identity_tensor(TileS{})));
  Tensor tOcO = as_rows_cols(thr_mma.partition_C(make_identity_tensor(TileQ{})));
  constexpr int kRowsPerThread = decltype(size<0>(tOcO))::value;
  Tensor acc_o_rc = as_rows_cols(acc_o);

  if (key_blocks.end > 0) {
    const int last = key_blocks.end - 1;
    const int rows_left_k = params.seqlen_k - last * kBlockN;
    // Only the last key block can be partial, and it is loaded first, in the prologue.
    auto load_kv = [&](int n_block, int stage, auto check_rows) __attribute__((always_inline)) {
      constexpr bool kCheckRows = decltype(check_rows)::value;
      copy_tile_async<kCheckRows>(gmem_tiled_copy, tKgK(_, _, _, n_block), tKsK(_, _, _, stage), tKVcKV, col_ok,
                                  rows_left_k);
      copy_tile_async<kCheckRows>(gmem_tiled_copy, tVgV(_, _, _, n_block), tVsV(_, _, _, stage), tKVcKV, col_ok,
                                  rows_left_k);
    };

    // Prologue: Q and the first K/V tile in one cp.async group, the second K/V tile in the next.
    copy_tile_async<true>(gmem_tiled_copy, tQgQ, tQsQ, tQcQ, col_ok, rows_left_q);
    if (rows_left_k < kBlockN) {
      load_kv(last, 0, cute::true_type{});
    } else {
      load_kv(last, 0, cute::false_type{});
    }
    cp_async_fence();
    if (last >= 1) load_kv(last - 1, 1, cute::false_type{});
    cp_async_fence();

    OnlineSoftmax<kRowsPerThread> softmax(params.softmax_scale_log2);
    // One key tile: S = Q K^T, the mask (for `masked` tiles), online softmax, O += P V, then refill the
    // stage just consumed with the tile two steps ahead.
    // always_inline: a call that is not inlined would force the fragments it touches into local memory.
    auto process_tile = [&](int n_block, int stage, auto first_tile, auto masked) __attribute__((always_inline)) {
      cp_async_wait<1>();  // this tile's group has landed; the next one may still be in flight
      __syncthreads();
      Tensor acc_s = partition_fragment_C(tiled_mma, TileS{});
      clear(acc_s);
      gemm_smem_smem(tiled_mma, acc_s, tSrQ, tSrK, tSsQ, tSsK(_, _, _, stage), smem_tiled_copy_q, smem_thr_copy_q,
                     smem_tiled_copy_k, smem_thr_copy_k);
      Tensor s = as_rows_cols(acc_s);
      if constexpr (decltype(masked)::value) mask.apply(s, tScS, m_block * kBlockM, n_block * kBlockN);
      softmax.template update<decltype(first_tile)::value>(s, acc_o_rc);
      // P goes straight from the S accumulator into the A operand registers of P.V.
      Tensor p = convert_fragment<Element>(acc_s);
      Tensor tOrP = make_tensor(p.data(), acc_layout_as_operand_a(p.layout()));
      gemm_regs_smem(tiled_mma, acc_o, tOrP, tOrVt, tOsVt(_, _, _, stage), smem_tiled_copy_v, smem_thr_copy_v);
      __syncthreads();  // every warp is done with this stage before it is refilled
      if (n_block >= 2) load_kv(n_block - 2, stage, cute::false_type{});
      cp_async_fence();
    };
    // Key blocks run from the last to the first: the ones that need a mask (the seqlen_k tail,
    // the causal diagonal) come first, then a loop free of masking.
    process_tile(last, 0, cute::true_type{}, cute::true_type{});
    int n_block = last - 1;
    int stage = 1;
    for (; n_block >= key_blocks.unmasked_end; --n_block, stage ^= 1) {
      process_tile(n_block, stage, cute::false_type{}, cute::true_type{});
    }
    for (; n_block >= 0; --n_block, stage ^= 1) {
      process_tile(n_block, stage, cute::false_type{}, cute::false_type{});
    }

    float lse[kRowsPerThread];
    softmax.finalize(acc_o_rc, params.softmax_scale, lse);
    CUTE_UNROLL
    for (int r = 0; r < kRowsPerThread; ++r) {
      const int row = get<0>(tOcO(r, 0));
      if (get<1>(tOcO(r, 0)) == 0 && row < rows_left_q) lse_row[row] = lse[r];
    }
  } else {
    // Causal with seqlen_q > seqlen_k: no row of this block sees any key. O stays 0.
    CUTE_UNROLL
    for (int r = 0; r < kRowsPerThread; ++r) {
      const int row = get<0>(tOcO(r, 0));
      if (get<1>(tOcO(r, 0)) == 0 && row < rows_left_q) lse_row[row] = -INFINITY;
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

// Grid: one CTA per (query block, head, batch), flattened into x. Query blocks run from the last
// to the first so that, with causal masking, the longest blocks start first.
template <int kHeadDim, class Element, bool kCausal>
__global__ void __launch_bounds__(FwdTraitsFor<kHeadDim, Element>::kThreads, 1)
    flash_fwd_sm80(__grid_constant__ const FwdParams params) {
  using Traits = FwdTraitsFor<kHeadDim, Element>;
  extern __shared__ __align__(128) char smem[];
  const int num_m_blocks = (params.seqlen_q + Traits::kBlockM - 1) / Traits::kBlockM;
  const int m_block = num_m_blocks - 1 - int(blockIdx.x % num_m_blocks);
  const int batch_head = int(blockIdx.x / num_m_blocks);
  fwd_query_block<Traits, kCausal>(params, smem, m_block, batch_head / params.heads, batch_head % params.heads);
}

}  // namespace flash_cutlass::sm80
