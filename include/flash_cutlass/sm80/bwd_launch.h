// Host-side launch of the sm80-path backward kernel; included only by the instantiation files.
#pragma once

#include <cuda_runtime_api.h>

#include "flash_cutlass/sm80/bwd_kernel.h"

namespace flash_cutlass::sm80 {

template <class Traits>
cudaError_t launch_bwd(void (*kernel)(BwdParams), int64_t num_ctas, BwdParams const& params, cudaStream_t stream) {
  constexpr int kSmemBytes = Traits::kSmemBytes;
  if constexpr (kSmemBytes > 48 * 1024) {
    const cudaError_t status =
        cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmemBytes);
    if (status != cudaSuccess) return status;
  }
  if (num_ctas > 0x7fffffff) return cudaErrorInvalidConfiguration;
  kernel<<<dim3(static_cast<unsigned>(num_ctas)), Traits::kThreads, kSmemBytes, stream>>>(params);
  return cudaGetLastError();
}

// With params.deterministic, dQ comes from a second kernel that sums over key blocks in a fixed
// order; otherwise the main kernel adds it with atomics.
template <int kHeadDim, DType kDType, bool kCausal>
cudaError_t run_bwd(BwdParams const& params, cudaStream_t stream) {
  using Element = typename ElementOf<kDType>::type;
  using Traits = BwdTraitsFor<kHeadDim, Element>;
  const int64_t batch_heads = int64_t(params.batch) * params.heads;
  const int64_t num_n_blocks = (params.seqlen_k + Traits::kBlockN - 1) / Traits::kBlockN;
  if (!params.deterministic) {
    return launch_bwd<Traits>(&flash_bwd_sm80<Traits, kCausal, true>, num_n_blocks * batch_heads, params, stream);
  }
  const cudaError_t status =
      launch_bwd<Traits>(&flash_bwd_sm80<Traits, kCausal, false>, num_n_blocks * batch_heads, params, stream);
  if (status != cudaSuccess) return status;
  const int64_t num_m_blocks = (params.seqlen_q + Traits::kBlockM - 1) / Traits::kBlockM;
  return launch_bwd<Traits>(&flash_bwd_dq_sm80<Traits, kCausal>, num_m_blocks * batch_heads, params, stream);
}

}  // namespace flash_cutlass::sm80
