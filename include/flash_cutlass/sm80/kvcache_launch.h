// Host-side launch of the KV-cache kernels (sm80/kvcache_kernel.h); included only by the
// instantiation files.
#pragma once

#include <cuda_runtime_api.h>

#include "flash_cutlass/common/utils.h"
#include "flash_cutlass/fwd_api.h"
#include "flash_cutlass/sm80/kvcache_kernel.h"

namespace flash_cutlass::sm80 {

// The attention over the cache (params.num_splits CTAs per tile), then, with more than one split,
// the merge of their partial outputs. The append, if any, ran before (run_kvcache_append).
template <int kHeadDim, DType kDType>
cudaError_t run_kvcache(KVCacheParams const& params, cudaStream_t stream) {
  using Element = typename ElementOf<kDType>::type;
  using Traits = KVCacheTraitsFor<kHeadDim, Element>;
  const int64_t row_blocks = kvcache_row_blocks(params);
  const int64_t kv_heads = int64_t(params.batch) * params.heads_k;
  if (kv_heads > 0x7fffffff || row_blocks > 65535 || params.num_splits < 1 || params.num_splits > 65535) {
    return cudaErrorInvalidConfiguration;
  }
  auto kernel = &flash_kvcache_sm80<kHeadDim, Element>;
  if (Traits::kSmemBytes > 48 * 1024) {
    const cudaError_t status =
        cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, Traits::kSmemBytes);
    if (status != cudaSuccess) return status;
  }
  const dim3 grid(unsigned(kv_heads), unsigned(row_blocks), unsigned(params.num_splits));
  kernel<<<grid, Traits::kThreads, Traits::kSmemBytes, stream>>>(params);
  cudaError_t status = cudaGetLastError();
  if (status != cudaSuccess || params.num_splits == 1) return status;
  const int64_t rows = int64_t(params.batch) * params.heads * params.seqlen_q;
  const int64_t combine_ctas = (rows + 3) / 4;
  if (combine_ctas > 0x7fffffff) return cudaErrorInvalidConfiguration;
  flash_kvcache_combine_sm80<kHeadDim, Element><<<unsigned(combine_ctas), 128, 0, stream>>>(params);
  return cudaGetLastError();
}

// CTAs of the attention kernel one SM holds at once (for the split heuristic, select.h).
template <int kHeadDim, DType kDType>
int kvcache_ctas_per_sm() {
  using Element = typename ElementOf<kDType>::type;
  using Traits = KVCacheTraitsFor<kHeadDim, Element>;
  auto kernel = &flash_kvcache_sm80<kHeadDim, Element>;
  if (Traits::kSmemBytes > 48 * 1024 &&
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, Traits::kSmemBytes) != cudaSuccess) {
    return 0;
  }
  int ctas = 0;
  if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&ctas, kernel, Traits::kThreads, Traits::kSmemBytes) !=
      cudaSuccess) {
    return 0;
  }
  return ctas;
}

template <int kHeadDim>
int kvcache_smem_bytes_of() {
  return KVCacheTraitsFor<kHeadDim, cutlass::half_t>::kSmemBytes;
}

// The append of the new keys and values (and the rotated queries with rotary).
template <DType kDType>
cudaError_t run_kvcache_append(KVCacheParams const& params, cudaStream_t stream) {
  using Element = typename ElementOf<kDType>::type;
  const int64_t rows = int64_t(params.batch) * params.seqlen_new * params.heads_k +
                       (params.rotary_cos != nullptr ? int64_t(params.batch) * params.seqlen_q * params.heads : 0);
  const int64_t threads = rows * (params.head_dim / 8);
  if (threads == 0) return cudaSuccess;
  const int64_t ctas = (threads + 127) / 128;
  if (ctas > 0x7fffffff) return cudaErrorInvalidConfiguration;
  flash_kvcache_append_sm80<Element><<<unsigned(ctas), 128, 0, stream>>>(params);
  return cudaGetLastError();
}

}  // namespace flash_cutlass::sm80
