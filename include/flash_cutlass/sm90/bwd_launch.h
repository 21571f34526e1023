// Host-side launch of the Hopper-path backward: builds the TMA descriptors of Q, dO, K, V and the
// dQ accumulator from the call's pointers and strides; included only by the instantiation files.
#pragma once

#include <algorithm>
#include <cstdint>

#include <cuda_runtime_api.h>

#include "flash_cutlass/common/bwd_stages.h"
#include "flash_cutlass/common/launch.h"
#include "flash_cutlass/fwd_api.h"
#include "flash_cutlass/select.h"
#include "flash_cutlass/sm90/bwd_kernel.h"
#include "flash_cutlass/sm90/tma_views.h"

namespace flash_cutlass::sm90 {

// The preprocess, the Hopper main kernel (dK, dV; dQ by TMA reduce-add, in key-block order when
// deterministic), the postprocess (common/bwd_stages.h).
template <int kHeadDim, DType kDType, MaskKind kMaskKind, Extension kExtension>
cudaError_t run_bwd(BwdParams const& call, cudaStream_t stream) {
  using namespace cute;
  using Element = typename ElementOf<kDType>::type;
  using Traits = BwdTraitsFor<kHeadDim, Element>;
  if (call.deterministic && call.dq_turns == nullptr) return cudaErrorInvalidValue;
  // dQ's first store: in fixed-length calls only (a variable-length tail block's store would
  // overwrite the next sequence's first rows), its counters per query block of this kernel's rows.
  if (call.dq_first_store && (call.cu_seqlens_q != nullptr || dq_block_counts(call) == nullptr)) {
    return cudaErrorInvalidValue;
  }
  BwdParams params = call;
  params.dq_block_rows = Traits::kBlockM;
  const TmaExtents extents = tma_extents(params);
  // An operand's TMA view: (rows, head_dim, heads, batch) with its strides.
  auto operand = [&](const void* base, int rows, int heads, int64_t row_stride, int64_t head_stride,
                     int64_t batch_stride) {
    return gmem_tensor<Traits>(static_cast<Element const*>(base), rows, params.head_dim, heads, extents.batch,
                               row_stride, head_stride, batch_stride);
  };
  const auto q = operand(params.q, extents.rows_q, params.heads, params.q_row_stride, params.q_head_stride,
                         params.q_batch_stride);
  const auto dout = operand(params.dout, extents.rows_q, params.heads, params.dout_row_stride,
                            params.dout_head_stride, params.dout_batch_stride);
  const auto k = operand(params.k, extents.rows_k, params.heads_k, params.k_row_stride, params.k_head_stride,
                         params.k_batch_stride);
  const auto v = operand(params.v, extents.rows_k, params.heads_k, params.v_row_stride, params.v_head_stride,
                         params.v_batch_stride);
  using TileQ = typename Traits::TileQ;
  using TileKV = typename Traits::TileKV;
  const auto smem_q_stage = take<0, 2>(typename Traits::SmemLayoutQ{});
  const auto tma_q = make_tma_copy(SM90_TMA_LOAD{}, q, smem_q_stage, TileQ{}, _1{});
  const auto tma_dout = make_tma_copy(SM90_TMA_LOAD{}, dout, smem_q_stage, TileQ{}, _1{});
  const auto tma_k = make_tma_copy(SM90_TMA_LOAD{}, k, typename Traits::SmemLayoutKV{}, TileKV{}, _1{});
  const auto tma_v = make_tma_copy(SM90_TMA_LOAD{}, v, typename Traits::SmemLayoutKV{}, TileKV{}, _1{});
  // dq_accum: (batch, heads, seqlen_q, kHeadDim), or (heads, total_q, kHeadDim) in a variable-length call.
  const bool varlen = params.cu_seqlens_q != nullptr;
  const int64_t dq_head_stride = int64_t(extents.rows_q) * kHeadDim;
  const auto dq_accum = gmem_tensor<Traits>(params.dq_accum, extents.rows_q, kHeadDim, params.heads, extents.batch,
                                            int64_t(kHeadDim), dq_head_stride,
                                            varlen ? int64_t(0) : dq_head_stride * params.heads);
  // The grid's walk (tile_scheduler.h): for calls without a mask or score modifications, rotated
  // walks of whole heads (deterministic calls of at most kMaxRotatedKeyBlocks key blocks) or a
  // persistent walk (non-deterministic ones at head dim 64); otherwise one CTA per tile. (A
  // persistent grid for causal calls, tiles in pairs, with dK/dV stored from registers, measured
  // within +-1% at 1k and -2 to -3% at 16k: not taken.)
  const int64_t num_n_blocks = (params.seqlen_k + Traits::kBlockN - 1) / Traits::kBlockN;
  static_assert(Traits::kBlockN == sm90_backward_key_block(kHeadDim), "select.h's rule reads the key block");
  // A tile walks query_heads_per_key_tile query heads (GQA: tile_scheduler.h), a divisor of the group.
  const int query_heads = params.query_heads_per_key_tile;
  if (query_heads < 1 || params.heads % params.heads_k != 0 || (params.heads / params.heads_k) % query_heads != 0) {
    return cudaErrorInvalidValue;
  }
  const int64_t items = int64_t(params.batch) * (params.heads / query_heads) * num_n_blocks;
  if (items > 0x7fffffff) return cudaErrorInvalidConfiguration;  // tiles are numbered in 32 bits
  // dK and dV by TMA where the call writes them in the inputs' dtype (bwd_epilogue.h), shaped like K
  // and V. Otherwise the descriptors are built over K and V, never used.
  const bool store_dkv_with_tma = params.dk != nullptr;
  auto output = [&](void* written, const void* unused, int64_t unused_row_stride, int64_t unused_head_stride,
                    int64_t unused_batch_stride) {
    if (store_dkv_with_tma) {
      return gmem_tensor<Traits>(static_cast<Element*>(written), extents.rows_k, params.head_dim, params.heads_k,
                                 extents.batch, params.dkv_row_stride, params.dkv_head_stride, params.dkv_batch_stride);
    }
    return gmem_tensor<Traits>(static_cast<Element*>(const_cast<void*>(unused)), extents.rows_k, params.head_dim,
                               params.heads_k, extents.batch, unused_row_stride, unused_head_stride,
                               unused_batch_stride);
  };
  // A GQA call's dK and dV added to their K/V head's fp32 accumulators by TMA where the atomics
  // path would add them ((rows, kHeadDim, heads_k): bwd_epilogue.h). Otherwise built over dq_accum.
  const int64_t accum_rows = key_accum_rows(params);
  const bool add_dkv_with_tma = Traits::kAddsDkvWithTma && params.dk == nullptr && params.dk_accum != nullptr &&
                                params.dkv_accum_heads == params.heads_k && accum_rows <= 0x7fffffff;
  auto accumulator = [&](float* accum) {
    if (!add_dkv_with_tma) return dq_accum;
    return gmem_tensor<Traits>(accum, int(accum_rows), kHeadDim, params.heads_k, 1,
                               int64_t(params.heads_k) * kHeadDim, int64_t(kHeadDim), int64_t(0));
  };
  // The persistent walks' stores of dK/dV rows through held query stages (kPersistentEpilogue):
  // built only for the traits that have that epilogue (the others never read them).
  auto store_rows = [&](auto const& gmem) {
    if constexpr (Traits::kPersistentEpilogue) {
      return make_tma_copy(SM90_TMA_STORE{}, gmem, smem_q_stage, TileQ{}, _1{});
    } else {
      return typename Traits::TmaStoreQRows{};
    }
  };
  const BwdKernelParams<Traits> kernel_params{
      params,
      tma_q,
      tma_dout,
      tma_k,
      tma_v,
      make_tma_copy(SM90_TMA_REDUCE_ADD{}, dq_accum, typename Traits::SmemLayoutdQ{}, typename Traits::TileDq{}, _1{}),
      make_tma_copy(SM90_TMA_STORE{}, dq_accum, typename Traits::SmemLayoutdQ{}, typename Traits::TileDq{}, _1{}),
      make_tma_copy(SM90_TMA_STORE{},
                    output(params.dk, params.k, params.k_row_stride, params.k_head_stride, params.k_batch_stride),
                    typename Traits::SmemLayoutKV{}, TileKV{}, _1{}),
      make_tma_copy(SM90_TMA_STORE{},
                    output(params.dv, params.v, params.v_row_stride, params.v_head_stride, params.v_batch_stride),
                    typename Traits::SmemLayoutKV{}, TileKV{}, _1{}),
      store_rows(output(params.dk, params.k, params.k_row_stride, params.k_head_stride, params.k_batch_stride)),
      store_rows(output(params.dv, params.v, params.v_row_stride, params.v_head_stride, params.v_batch_stride)),
      store_dkv_with_tma,
      make_tma_copy(SM90_TMA_REDUCE_ADD{}, accumulator(params.dk_accum), typename Traits::SmemLayoutAccumHalf{},
                    typename Traits::TileAccumHalf{}, _1{}),
      make_tma_copy(SM90_TMA_REDUCE_ADD{}, accumulator(params.dv_accum), typename Traits::SmemLayoutAccumHalf{},
                    typename Traits::TileAccumHalf{}, _1{}),
      add_dkv_with_tma};
  return run_bwd_stages<kHeadDim, Element>(params, stream, [&]() {
    if constexpr (kMaskKind == MaskKind::kNone && kExtension == Extension::kNone) {
      int sms = 0;
      const cudaError_t sm_status = multiprocessor_count(&sms);
      if (sm_status != cudaSuccess) return sm_status;
      const int64_t num_m_blocks = (params.seqlen_q + Traits::kBlockM - 1) / Traits::kBlockM;
      // Measured (H200, bf16) against the launch order: 8-64 key blocks 4-33% faster, 128 blocks
      // (head dim 128 at 16k) 20% slower: the chain of turns around a ring of 128 CTAs, each
      // waiting for the one before's reduction, has no slack left.
      constexpr int64_t kMaxRotatedKeyBlocks = 64;
      if (params.deterministic && !varlen && num_n_blocks <= num_m_blocks &&
          num_n_blocks <= std::min<int64_t>(sms, kMaxRotatedKeyBlocks)) {
        // A rotated walk's CTAs wait on each other: launched together or not at all (SMs taken by
        // other work, MPS); then one CTA per tile.
        const cudaError_t status = launch_cooperative_kernel(&flash_bwd_sm90<Traits, kMaskKind, kExtension, true>,
                                                             int(std::min<int64_t>(items, sms / num_n_blocks * num_n_blocks)),
                                                             Traits::kThreads, Traits::kSmemBytes, kernel_params, stream);
        if (status != cudaErrorCooperativeLaunchTooLarge) return status;
        (void)cudaGetLastError();
      }
      // Head dim 64 (kPersistentEpilogue): a persistent walk, dK/dV going out through the last query
      // stages while the next tile's K and V load (bwd_epilogue.h), where the walk would store them
      // by TMA (not GQA's accumulators) and has as many blocks as it holds stages.
      if constexpr (Traits::kPersistentEpilogue) {
        if (!params.deterministic && !varlen && store_dkv_with_tma && num_m_blocks >= Traits::kHeldStages) {
          return launch_kernel(&flash_bwd_sm90<Traits, kMaskKind, kExtension, true>, std::min<int64_t>(items, sms),
                               Traits::kThreads, Traits::kSmemBytes, kernel_params, stream);
        }
      }
    }
    return launch_kernel(&flash_bwd_sm90<Traits, kMaskKind, kExtension, false>, items, Traits::kThreads,
                         Traits::kSmemBytes, kernel_params, stream);
  });
}

}  // namespace flash_cutlass::sm90
