// What the main backward kernels of both paths read from and write to global memory for a CTA's
// key block (KeyBlockWork), so that the sm80 and the Hopper kernels agree on it by construction.
#pragma once

#include <cstdint>

#include <cute/tensor.hpp>

#include "flash_cutlass/common/block_info.h"
#include "flash_cutlass/common/copy.h"
#include "flash_cutlass/common/mask.h"
#include "flash_cutlass/common/utils.h"
#include "flash_cutlass/params.h"

namespace flash_cutlass {

// The (seqlen, kHeadDim) global views of one (sequence, head)'s Q and dO and of its K/V head's K
// and V; columns past head_dim are predicated by the copies.
template <class Matrix>
struct BwdHeadMatrices {
  Matrix q;
  Matrix dout;
  Matrix k;
  Matrix v;
};

template <class Element, int kHeadDim>
__device__ __forceinline__ auto bwd_head_matrices(BwdParams const& params, Sequence const& sequence, int head,
                                                  int head_k) {
  using Matrix = decltype(head_matrix<Element, kHeadDim>(params.q, int64_t(0), 0, int64_t(0), 0, int64_t(0)));
  return BwdHeadMatrices<Matrix>{
      head_matrix<Element, kHeadDim>(params.q, sequence.q_offset(params.q_batch_stride, params.q_row_stride), head,
                                     params.q_head_stride, sequence.seqlen_q, params.q_row_stride),
      head_matrix<Element, kHeadDim>(params.dout, sequence.q_offset(params.dout_batch_stride, params.dout_row_stride),
                                     head, params.dout_head_stride, sequence.seqlen_q, params.dout_row_stride),
      head_matrix<Element, kHeadDim>(params.k, sequence.k_offset(params.k_batch_stride, params.k_row_stride), head_k,
                                     params.k_head_stride, sequence.seqlen_k, params.k_row_stride),
      head_matrix<Element, kHeadDim>(params.v, sequence.k_offset(params.v_batch_stride, params.v_row_stride), head_k,
                                     params.v_head_stride, sequence.seqlen_k, params.v_row_stride)};
}

// The global tiles a main backward CTA reads: its (sequence, head)'s Q and dO in query blocks,
// (kBlockM, kHeadDim, m_blocks), and the K and V of its key block, (kBlockN, kHeadDim).
template <class QueryTiles, class KeyTile>
struct BwdKeyBlockTiles {
  QueryTiles q;
  QueryTiles dout;
  KeyTile k;
  KeyTile v;
};

template <class Element, int kHeadDim, int kBlockM, int kBlockN, MaskKind kMaskKind>
__device__ __forceinline__ auto bwd_key_block_tiles(BwdParams const& params,
                                                    KeyBlockWork<kBlockM, kBlockN, kMaskKind> const& work, int head_k) {
  using namespace cute;
  using TileQ = Shape<Int<kBlockM>, Int<kHeadDim>>;
  using TileKV = Shape<Int<kBlockN>, Int<kHeadDim>>;
  const auto matrices = bwd_head_matrices<Element, kHeadDim>(params, work.sequence, work.tile.head, head_k);
  using QueryTiles = decltype(local_tile(matrices.q, TileQ{}, make_coord(_, 0)));
  using KeyTile = decltype(local_tile(matrices.k, TileKV{}, make_coord(work.tile.n_block, 0)));
  return BwdKeyBlockTiles<QueryTiles, KeyTile>{local_tile(matrices.q, TileQ{}, make_coord(_, 0)),
                                               local_tile(matrices.dout, TileQ{}, make_coord(_, 0)),
                                               local_tile(matrices.k, TileKV{}, make_coord(work.tile.n_block, 0)),
                                               local_tile(matrices.v, TileKV{}, make_coord(work.tile.n_block, 0))};
}

// Where one (sequence, head)'s query 0 sits in the fp32 per-query buffers: its log-sum-exp, D and
// dQ accumulator rows. (Kept apart from BwdKeyBlockTiles: in one struct with the tiles, they
// changed the register allocation of the Hopper kernel.)
struct QueryRowBuffers {
  const float* lse;
  const float* dsum;
  float* dq_accum;
};

template <int kHeadDim>
__device__ __forceinline__ QueryRowBuffers query_row_buffers(BwdParams const& params, Sequence const& sequence,
                                                             int head) {
  const int64_t row_offset = query_stats_index(params, sequence, head);
  return {params.lse + row_offset, params.dsoftmax_sum + row_offset, params.dq_accum + row_offset * kHeadDim};
}

// dK (times the softmax scale) and dV of a key block: straight into dk and dv in the inputs' dtype
// (the Hopper kernels: at the K/V head, which their walks over a whole GQA group need; the sm80
// kernel only without GQA, at the head), or, with GQA, in fp32: per query head for the caller to
// sum over each group, or (kKvHeadAtomics: the Hopper kernels; the sm80 kernel spilled in its loop
// with the branch) added with atomics to the K/V head's (params.dkv_accum_heads). coords: each
// accumulator element's (key, column) inside the block.
template <class Element, int kHeadDim, int kBlockM, int kBlockN, MaskKind kMaskKind, bool kKvHeadAtomics = false,
          class Acc, class Coords>
__device__ __forceinline__ void store_dk_dv(BwdParams const& params,
                                            KeyBlockWork<kBlockM, kBlockN, kMaskKind> const& work, int rows_left_k,
                                            Acc const& acc_dk, Acc const& acc_dv, Coords const& coords) {
  const Sequence& sequence = work.sequence;
  const int head = work.tile.head;
  auto store = [&](auto* dst, int64_t row_stride, Acc const& acc, float scale, int cols) {
    store_rows(dst, row_stride, acc, scale, coords, rows_left_k, cols);
  };
  if (params.dk != nullptr) {
    const int64_t offset = sequence.k_offset(params.dkv_batch_stride, params.dkv_row_stride) +
                           int64_t(work.key_start) * params.dkv_row_stride +
                           int64_t(kKvHeadAtomics ? kv_head_of(head, params) : head) * params.dkv_head_stride;
    store(static_cast<Element*>(params.dk) + offset, params.dkv_row_stride, acc_dk, params.softmax_scale,
          params.head_dim);
    store(static_cast<Element*>(params.dv) + offset, params.dkv_row_stride, acc_dv, 1.f, params.head_dim);
  } else if (!kKvHeadAtomics || params.dkv_accum_heads != params.heads_k) {
    const int64_t row_stride = int64_t(params.heads) * kHeadDim;
    const int64_t offset = (key_accum_row(params, sequence) + work.key_start) * row_stride + int64_t(head) * kHeadDim;
    store(params.dk_accum + offset, row_stride, acc_dk, 1.f, kHeadDim);
    store(params.dv_accum + offset, row_stride, acc_dv, 1.f, kHeadDim);
  } else if constexpr (kKvHeadAtomics) {
    const int64_t row_stride = int64_t(params.heads_k) * kHeadDim;
    const int64_t offset = (key_accum_row(params, sequence) + work.key_start) * row_stride +
                           int64_t(kv_head_of(head, params)) * kHeadDim;
    atomic_add_rows(params.dk_accum + offset, row_stride, acc_dk, coords, rows_left_k);
    atomic_add_rows(params.dv_accum + offset, row_stride, acc_dv, coords, rows_left_k);
  }
}

}  // namespace flash_cutlass
