// Torch-free, kernel-free declarations of the forward and backward entry points: what the host file
// (csrc/flash_api.cpp) sees. Each instantiation lives in its own file under csrc/instantiations/.
#pragma once

#include <cuda_runtime_api.h>

#include "flash_cutlass/params.h"

namespace flash_cutlass {

namespace sm90 {
template <int kHeadDim, DType kDType, MaskKind kMaskKind, Extension kExtension>
cudaError_t run_fwd(FwdParams const& params, cudaStream_t stream);

template <int kHeadDim, DType kDType, MaskKind kMaskKind, Extension kExtension>
cudaError_t run_bwd(BwdParams const& params, cudaStream_t stream);
}  // namespace sm90

namespace sm80 {
template <int kHeadDim, DType kDType, MaskKind kMaskKind, Extension kExtension>
cudaError_t run_fwd(FwdParams const& params, cudaStream_t stream);

template <int kHeadDim, DType kDType, MaskKind kMaskKind, Extension kExtension>
cudaError_t run_bwd(BwdParams const& params, cudaStream_t stream);

// Dynamic shared memory one CTA of the forward kernel for `kernel_hdim` needs, in bytes.
int fwd_smem_bytes(int kernel_hdim);
// The same for the backward's main kernel (the largest of its kernels).
int bwd_smem_bytes(int kernel_hdim);
}  // namespace sm80

}  // namespace flash_cutlass
