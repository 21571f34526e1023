// Host-side launch of the Hopper-path forward kernel: builds the TMA descriptors from the call's
// pointers and strides, then launches. Included only by the sm90 instantiation files.
#pragma once

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdint>

#include "flash_cutlass/common/launch.h"
#include "flash_cutlass/compiled.h"
#include "flash_cutlass/fwd_api.h"
#include "flash_cutlass/select.h"
#include "flash_cutlass/sm90/fwd_kernel.h"
#include "flash_cutlass/sm90/sequence_descriptors.h"

namespace flash_cutlass::sm90 {

// The launch for one set of kernel traits (tile sizes, stages, schedule).
template <class Traits, MaskKind kMaskKind, Extension kExtension>
cudaError_t run_fwd_with_traits(FwdParams const& params, cudaStream_t stream) {
  using namespace cute;
  using Element = typename Traits::Element;
  using TileShape = typename Traits::TileShape;

  const TmaExtents extents = tma_extents(params);
  const auto q = gmem_tensor<Traits>(static_cast<Element const*>(params.q), extents.rows_q, params.head_dim, params.heads, extents.batch,
                                     params.q_row_stride, params.q_head_stride, params.q_batch_stride);
  const auto k = gmem_tensor<Traits>(static_cast<Element const*>(params.k), extents.rows_k, params.head_dim, params.heads_k, extents.batch,
                                     params.k_row_stride, params.k_head_stride, params.k_batch_stride);
  const auto v = gmem_tensor<Traits>(static_cast<Element const*>(params.v), extents.rows_k, params.head_dim, params.heads_k, extents.batch,
                                     params.v_row_stride, params.v_head_stride, params.v_batch_stride);
  // O through a TMA store: not in a variable-length call (a tile's rows past its sequence belong to
  // the next one, which a store bounded by the packed tensor would overwrite), and only where TMA
  // can address out (16-byte aligned base and strides).
  const int64_t element_bytes = int64_t(sizeof(Element));
  const bool store_o_with_tma =
      Traits::kTmaStoreO && params.cu_seqlens_q == nullptr &&
      reinterpret_cast<uintptr_t>(params.out) % 16 == 0 && (params.out_row_stride * element_bytes) % 16 == 0 &&
      (params.out_head_stride * element_bytes) % 16 == 0 && (params.out_batch_stride * element_bytes) % 16 == 0;
  // Without it the descriptor is built over q (which TMA already reads) and never used.
  const auto out = store_o_with_tma
                       ? gmem_tensor<Traits>(static_cast<Element*>(params.out), extents.rows_q, params.head_dim, params.heads, extents.batch,
                                                 params.out_row_stride, params.out_head_stride, params.out_batch_stride)
                       : gmem_tensor<Traits>(static_cast<Element*>(const_cast<void*>(params.q)), extents.rows_q, params.head_dim, params.heads, extents.batch,
                                                 params.q_row_stride, params.q_head_stride, params.q_batch_stride);
  FwdKernelParams<Traits> kernel_params{
      params,
      make_tma_copy(SM90_TMA_LOAD{}, q, typename Traits::SmemLayoutQ{}, select<0, 2>(TileShape{}), _1{}),
      make_tma_copy(SM90_TMA_LOAD{}, k, take<0, 2>(typename Traits::SmemLayoutKV{}), select<1, 2>(TileShape{}), _1{}),
      make_tma_copy(SM90_TMA_LOAD{}, v, take<0, 2>(typename Traits::SmemLayoutKV{}), select<1, 2>(TileShape{}), _1{}),
      make_tma_copy(SM90_TMA_STORE{}, out, typename Traits::SmemLayoutQ{}, select<0, 2>(TileShape{}), _1{}),
      store_o_with_tma,
      PersistentWork{},
  };

  // Paged K and V (params.h, block_table; chunked prefill over a paged KV cache): a variable-length
  // causal call without score options over pages of a multiple of the key blocks, in a kernel of its
  // own (fwd_producer.h, load_paged_tile), which builds without the KV-cache kernels leave out.
  constexpr bool kPagedKernel =
      compiled::kKVCache && kMaskKind == MaskKind::kCausal && kExtension == Extension::kNone;
  const bool paged = params.block_table != nullptr;
  if (paged && (!kPagedKernel || params.cu_seqlens_k == nullptr || params.page_size <= 0 ||
                params.page_size % Traits::kBlockN != 0)) {
    return cudaErrorInvalidValue;
  }

  // A persistent grid (tile_config.h, per head dim): CTAs take tiles in turn, causal ones in pairs
  // whose costs add up to about the same and the pairs' last waves as single tiles (block_info.h:
  // the causal tail), one CTA per SM, each CTA's producer loading its next tile while the consumers
  // finish the current one. In a variable-length call the tiles' costs differ with their
  // sequences: one CTA per pair (or tile), balanced by the hardware. Fewer pairs than SMs (a small
  // batch, or chunked prefill's few query blocks over a long cache, where the tiles cost about the
  // same): every tile single, up to one CTA an SM (a variable-length call: one CTA a tile), so that
  // the pairs leave no SM idle. Otherwise one CTA per tile.
  int64_t num_ctas = num_query_tiles<Traits::kBlockM>(params);
  if (num_ctas > 0x7fffffff) return cudaErrorInvalidConfiguration;  // tiles are numbered in 32 bits
  if constexpr (Traits::kPersistent) {
    constexpr bool kInPairs = persistent_tiles_in_pairs<kMaskKind>();
    num_ctas = persistent_items<Traits::kBlockM, kInPairs>(params);  // tiles, or pairs of causal tiles
    int sms = 0;
    const cudaError_t status = multiprocessor_count(&sms);
    if (status != cudaSuccess) return status;
    if (kInPairs && num_ctas < sms) {
      // In a variable-length call one CTA per tile: its tiles include the empty ones of shorter
      // sequences (chunked prefill in place: as many as real ones), which dealt out among the SMs
      // would leave some CTAs two real tiles.
      const int64_t tiles = num_query_tiles<Traits::kBlockM>(params);
      num_ctas = params.cu_seqlens_q != nullptr ? tiles : std::min<int64_t>(tiles, sms);
    } else if (params.cu_seqlens_q == nullptr && num_ctas > sms) {
      num_ctas = sms;
    }
    kernel_params.persistent_work = persistent_work_of<Traits::kBlockM, kInPairs>(params, num_ctas);
  }
  if (params.cu_seqlens_k != nullptr) {
    // V's per-sequence descriptors (sequence_descriptors.h), in stream order before the kernel.
    if (params.sequence_descriptors == nullptr) return cudaErrorInvalidValue;
    constexpr int kSequencesPerCta = 128;
    shift_value_descriptors<Element><<<(params.batch + kSequencesPerCta - 1) / kSequencesPerCta, kSequencesPerCta, 0,
                                       stream>>>(*kernel_params.tma_v.get_tma_descriptor(), params);
    const cudaError_t status = cudaGetLastError();
    if (status != cudaSuccess) return status;
  }
  if constexpr (kPagedKernel) {
    if (paged) {
      return launch_kernel(&flash_fwd_sm90<Traits, kMaskKind, kExtension, true>, num_ctas, Traits::kThreads,
                           Traits::kSmemBytes, kernel_params, stream);
    }
  }
  return launch_kernel(&flash_fwd_sm90<Traits, kMaskKind, kExtension>, num_ctas, Traits::kThreads, Traits::kSmemBytes,
                       kernel_params, stream);
}

// The launch for a head dim and dtype: its traits from FwdTileSizes, or FwdWideTileSizes where
// select.h says the call runs them.
template <int kHeadDim, DType kDType, MaskKind kMaskKind, Extension kExtension>
cudaError_t run_fwd(FwdParams const& params, cudaStream_t stream) {
  using Element = typename ElementOf<kDType>::type;
  using Narrow = FwdTraitsFor<kHeadDim, Element>;
  if constexpr (sm90_forward_has_wide_tiles(FwdWideTileSizes<kHeadDim>::kAvailable, kMaskKind, kExtension)) {
    using Wide = FwdTraitsFor<kHeadDim, Element, FwdWideTileSizes<kHeadDim>>;
    if constexpr (kMaskKind == MaskKind::kCausal) {
      if (!sm90_causal_forward_uses_wide_tiles(params.seqlen_q)) {
        return run_fwd_with_traits<Narrow, kMaskKind, kExtension>(params, stream);
      }
    }
    return run_fwd_with_traits<Wide, kMaskKind, kExtension>(params, stream);
  } else {
    return run_fwd_with_traits<Narrow, kMaskKind, kExtension>(params, stream);
  }
}

}  // namespace flash_cutlass::sm90
