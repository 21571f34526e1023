// Host-side launch of the sm80-path forward kernel; included only by the instantiation files.
#pragma once

#include <cuda_runtime_api.h>

#include "flash_cutlass/fwd_api.h"
#include "flash_cutlass/sm80/fwd_kernel.h"

namespace flash_cutlass::sm80 {

template <int kHeadDim, DType kDType, bool kCausal>
cudaError_t run_fwd(FwdParams const& params, cudaStream_t stream) {
  using Element = typename ElementOf<kDType>::type;
  using Traits = FwdTraitsFor<kHeadDim, Element>;
  auto* kernel = &flash_fwd_sm80<kHeadDim, Element, kCausal>;
  constexpr int kSmemBytes = Traits::kSmemBytes;
  if constexpr (kSmemBytes > 48 * 1024) {
    const cudaError_t status =
        cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmemBytes);
    if (status != cudaSuccess) return status;
  }
  const int64_t num_ctas = num_query_tiles<Traits::kBlockM>(params);
  if (num_ctas > 0x7fffffff) return cudaErrorInvalidConfiguration;
  kernel<<<dim3(static_cast<unsigned>(num_ctas)), Traits::kThreads, kSmemBytes, stream>>>(params);
  return cudaGetLastError();
}

}  // namespace flash_cutlass::sm80
