// Host-side launch of the sm80-path backward kernels; included only by the instantiation files.
#pragma once

#include <cuda_runtime_api.h>

#include "flash_cutlass/common/launch.h"
#include "flash_cutlass/sm80/bwd_kernel.h"

namespace flash_cutlass::sm80 {

// Preprocess (D, dq_accum zeroed), the main kernel (dK, dV, and dQ by atomics), with
// params.deterministic a second kernel that sums dQ over the key blocks in a fixed order instead,
// then the postprocess (dQ scaled and converted).
template <int kHeadDim, DType kDType, bool kLocal>
cudaError_t run_bwd(BwdParams const& params, cudaStream_t stream) {
  using Element = typename ElementOf<kDType>::type;
  using Traits = BwdTraitsFor<kHeadDim, Element>;
  const int64_t batch_heads = int64_t(params.batch) * params.heads;
  const int64_t row_threads = batch_heads * params.seqlen_q * kThreadsPerRow<kHeadDim>;
  const int64_t prepost_ctas = (row_threads + kPrePostThreads - 1) / kPrePostThreads;
  cudaError_t status = launch_kernel(&flash_bwd_preprocess_sm80<kHeadDim, Element>, prepost_ctas, kPrePostThreads,
                                     0, params, stream);
  if (status != cudaSuccess) return status;
  const int64_t num_n_blocks = (params.seqlen_k + Traits::kBlockN - 1) / Traits::kBlockN;
  if (!params.deterministic) {
    status = launch_kernel(&flash_bwd_sm80<Traits, kLocal, true>, num_n_blocks * batch_heads, Traits::kThreads,
                           Traits::kSmemBytes, params, stream);
  } else {
    status = launch_kernel(&flash_bwd_sm80<Traits, kLocal, false>, num_n_blocks * batch_heads, Traits::kThreads,
                           Traits::kSmemBytes, params, stream);
    if (status != cudaSuccess) return status;
    const int64_t num_m_blocks = (params.seqlen_q + Traits::kBlockM - 1) / Traits::kBlockM;
    status = launch_kernel(&flash_bwd_dq_sm80<Traits, kLocal>, num_m_blocks * batch_heads, Traits::kThreads,
                           Traits::kSmemBytesDq, params, stream);
  }
  if (status != cudaSuccess) return status;
  return launch_kernel(&flash_bwd_postprocess_sm80<kHeadDim, Element>, prepost_ctas, kPrePostThreads, 0, params,
                       stream);
}

}  // namespace flash_cutlass::sm80
