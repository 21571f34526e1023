// Host-side launch of the Hopper-path backward; included only by the instantiation files.
#pragma once

#include <cuda_runtime_api.h>

#include "flash_cutlass/common/bwd_stages.h"
#include "flash_cutlass/common/launch.h"
#include "flash_cutlass/fwd_api.h"
#include "flash_cutlass/sm90/bwd_kernel.h"

namespace flash_cutlass::sm90 {

// The preprocess, the Hopper main kernel (dK, dV, dQ by atomics), the postprocess
// (common/bwd_stages.h). Deterministic dQ is the sm80 path's (the host routes those calls there).
template <int kHeadDim, DType kDType, MaskKind kMaskKind, Extension kExtension>
cudaError_t run_bwd(BwdParams const& params, cudaStream_t stream) {
  using Element = typename ElementOf<kDType>::type;
  using Traits = BwdKernelTraits<kHeadDim, Element>;
  if (params.deterministic) return cudaErrorNotSupported;
  return run_bwd_stages<kHeadDim, Element>(params, stream, [&]() {
    const int64_t num_n_blocks = (params.seqlen_k + Traits::kBlockN - 1) / Traits::kBlockN;
    return launch_kernel(&flash_bwd_sm90<Traits, kMaskKind, kExtension>, num_n_blocks * int64_t(params.batch) * params.heads,
                         Traits::kThreads, Traits::kSmemBytes, params, stream);
  });
}

}  // namespace flash_cutlass::sm90
