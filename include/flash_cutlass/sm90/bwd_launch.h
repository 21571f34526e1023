// Host-side launch of the Hopper-path backward: builds the TMA descriptors of Q, dO, K, V and the
// dQ accumulator from the call's pointers and strides; included only by the instantiation files.
#pragma once

#include <algorithm>
#include <cstdint>

#include <cuda_runtime_api.h>

#include "flash_cutlass/common/bwd_stages.h"
#include "flash_cutlass/common/launch.h"
#include "flash_cutlass/fwd_api.h"
#include "flash_cutlass/sm90/bwd_kernel.h"
#include "flash_cutlass/sm90/tma_views.h"

namespace flash_cutlass::sm90 {

// The preprocess, the Hopper main kernel (dK, dV; dQ by TMA reduce-add, in key-block order when
// deterministic), the postprocess (common/bwd_stages.h).
template <int kHeadDim, DType kDType, MaskKind kMaskKind, Extension kExtension>
cudaError_t run_bwd(BwdParams const& params, cudaStream_t stream) {
  using namespace cute;
  using Element = typename ElementOf<kDType>::type;
  using Traits = BwdTraitsFor<kHeadDim, Element>;
  if (params.deterministic && params.dq_turns == nullptr) return cudaErrorInvalidValue;
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
  // The grid's walk (tile_scheduler.h): rotated walks of whole heads for deterministic calls
  // without a mask whose key blocks fit on the SMs; otherwise one CTA per tile. (A persistent
  // grid for the other calls, causal tiles in pairs, measured within +-1% at 1k and -2 to -3%
  // causal at 16k: off.)
  const int64_t num_n_blocks = (params.seqlen_k + Traits::kBlockN - 1) / Traits::kBlockN;
  const int64_t num_m_blocks = (params.seqlen_q + Traits::kBlockM - 1) / Traits::kBlockM;
  const int64_t batch_heads = int64_t(params.batch) * params.heads;
  int sms = 0;
  const cudaError_t sm_status = multiprocessor_count(&sms);
  if (sm_status != cudaSuccess) return sm_status;
  const bool rotated = params.deterministic && !varlen && kMaskKind == MaskKind::kNone &&
                       num_n_blocks <= num_m_blocks && num_n_blocks <= sms;
  constexpr bool persistent = false;
  const bool pairs = persistent && kMaskKind == MaskKind::kCausal;
  const int64_t items = pairs ? batch_heads * ((num_n_blocks + 1) / 2) : batch_heads * num_n_blocks;
  if (items > 0x7fffffff) return cudaErrorInvalidConfiguration;  // items are numbered in 32 bits
  int64_t num_ctas = items;
  if (persistent) num_ctas = std::min<int64_t>(items, sms);
  if (rotated) num_ctas = std::min<int64_t>(items, sms / num_n_blocks * num_n_blocks);  // whole heads
  BwdKernelParams<Traits> kernel_params{
      params, tma_q, tma_dout, tma_k, tma_v,
      make_tma_copy(SM90_TMA_REDUCE_ADD{}, dq_accum, typename Traits::SmemLayoutdQ{}, typename Traits::TileDq{}, _1{}),
      KeyTileWalk{int(items), pairs ? 1 : 0, rotated ? 1 : 0}};
  return run_bwd_stages<kHeadDim, Element>(params, stream, [&]() {
    const auto kernel = &flash_bwd_sm90<Traits, kMaskKind, kExtension>;
    if (rotated) {
      // A rotated walk's CTAs wait on each other: launched together or not at all (SMs taken by
      // other work, MPS); then in the launch order, one CTA per tile.
      const cudaError_t status = launch_cooperative_kernel(kernel, int(num_ctas), Traits::kThreads,
                                                           Traits::kSmemBytes, kernel_params, stream);
      if (status != cudaErrorCooperativeLaunchTooLarge) return status;
      (void)cudaGetLastError();
      kernel_params.walk = KeyTileWalk{int(items), 0, 0};
      num_ctas = items;
    }
    return launch_kernel(kernel, num_ctas, Traits::kThreads, Traits::kSmemBytes, kernel_params, stream);
  });
}

}  // namespace flash_cutlass::sm90
