// Host-side launch of the Hopper-path backward; included only by the instantiation files.
#pragma once

#include <cuda_runtime_api.h>

#include "flash_cutlass/common/launch.h"
#include "flash_cutlass/fwd_api.h"
#include "flash_cutlass/sm90/bwd_kernel.h"

namespace flash_cutlass::sm90 {

// The sm80 path's preprocess, the Hopper main kernel (dK, dV, dQ by atomics), the sm80 path's
// postprocess. Deterministic dQ is the sm80 path's (the host routes those calls there).
template <int kHeadDim, DType kDType, bool kLocal>
cudaError_t run_bwd(BwdParams const& params, cudaStream_t stream) {
  using Element = typename ElementOf<kDType>::type;
  using Traits = BwdKernelTraits<kHeadDim, Element>;
  if (params.deterministic) return cudaErrorNotSupported;
  const int64_t batch_heads = int64_t(params.batch) * params.heads;
  const int64_t row_threads = batch_heads * params.seqlen_q * sm80::kThreadsPerRow<kHeadDim>;
  const int64_t prepost_ctas = (row_threads + sm80::kPrePostThreads - 1) / sm80::kPrePostThreads;
  cudaError_t status = launch_kernel(&sm80::flash_bwd_preprocess_sm80<kHeadDim, Element>, prepost_ctas,
                                     sm80::kPrePostThreads, 0, params, stream);
  if (status != cudaSuccess) return status;
  const int64_t num_n_blocks = (params.seqlen_k + Traits::kBlockN - 1) / Traits::kBlockN;
  status = launch_kernel(&flash_bwd_sm90<Traits, kLocal>, num_n_blocks * batch_heads, Traits::kThreads,
                         Traits::kSmemBytes, params, stream);
  if (status != cudaSuccess) return status;
  return launch_kernel(&sm80::flash_bwd_postprocess_sm80<kHeadDim, Element>, prepost_ctas, sm80::kPrePostThreads, 0,
                       params, stream);
}

}  // namespace flash_cutlass::sm90
