// Host-side launch of the sm80-path forward kernel; included only by the instantiation files.
#pragma once

#include <cuda_runtime_api.h>

#include "flash_cutlass/common/launch.h"
#include "flash_cutlass/fwd_api.h"
#include "flash_cutlass/sm80/fwd_kernel.h"

namespace flash_cutlass::sm80 {

// The tiles of tier params.sm80_tile_tier (sm80/kernel_traits.h, FwdTraitsOfTier).
template <int kHeadDim, DType kDType, MaskKind kMaskKind, Extension kExtension>
cudaError_t run_fwd(FwdParams const& params, cudaStream_t stream) {
  using Element = typename ElementOf<kDType>::type;
  static_assert(kSm80TileTiers == 3, "one type a tier");
  return launch_with_tiles<FwdTraitsOfTier<kHeadDim, 0, Element>, FwdTraitsOfTier<kHeadDim, 1, Element>,
                           FwdTraitsOfTier<kHeadDim, 2, Element>>(
      params.sm80_tile_tier, [&](auto tiles) {
        using Traits = typename decltype(tiles)::type;
        return launch_kernel(&flash_fwd_sm80<Traits, kMaskKind, kExtension>, num_query_tiles<Traits::kBlockM>(params),
                             Traits::kThreads, Traits::kSmemBytes, params, stream);
      });
}

}  // namespace flash_cutlass::sm80
