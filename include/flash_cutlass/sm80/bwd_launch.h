// Host-side launch of the sm80-path backward kernels; included only by the instantiation files.
#pragma once

#include <cuda_runtime_api.h>

#include "flash_cutlass/common/bwd_stages.h"
#include "flash_cutlass/common/launch.h"
#include "flash_cutlass/sm80/bwd_kernel.h"

namespace flash_cutlass::sm80 {

// The main kernel (dK, dV, and dQ by atomics), or with params.deterministic, a second kernel that
// sums dQ over the key blocks in a fixed order instead, between the preprocess and postprocess; on
// the tiles of tier params.sm80_tile_tier (sm80/bwd_kernel.h, BwdTilesOf).
template <int kHeadDim, DType kDType, MaskKind kMaskKind, Extension kExtension>
cudaError_t run_bwd(BwdParams const& params, cudaStream_t stream) {
  using Element = typename ElementOf<kDType>::type;
  static_assert(kSm80TileTiers == 3, "one type a tier");
  return launch_with_tiles<BwdTraitsOfTier<kHeadDim, 0, Element>, BwdTraitsOfTier<kHeadDim, 1, Element>,
                           BwdTraitsOfTier<kHeadDim, 2, Element>>(
      params.sm80_tile_tier, [&](auto tiles) {
        using Traits = typename decltype(tiles)::type;
        return run_bwd_stages<kHeadDim, Element>(params, stream, [&]() {
          const int64_t batch_heads = int64_t(params.batch) * params.heads;
          const int64_t num_n_blocks = (params.seqlen_k + Traits::kBlockN - 1) / Traits::kBlockN;
          if (!params.deterministic) {
            return launch_kernel(&flash_bwd_sm80<Traits, kMaskKind, kExtension, true>, num_n_blocks * batch_heads,
                                 Traits::kThreads, Traits::kSmemBytes, params, stream);
          }
          cudaError_t status = launch_kernel(&flash_bwd_sm80<Traits, kMaskKind, kExtension, false>,
                                             num_n_blocks * batch_heads, Traits::kThreads, Traits::kSmemBytes, params,
                                             stream);
          if (status != cudaSuccess) return status;
          const int64_t num_m_blocks = (params.seqlen_q + Traits::kBlockM - 1) / Traits::kBlockM;
          return launch_kernel(&flash_bwd_dq_sm80<Traits, kMaskKind, kExtension>, num_m_blocks * batch_heads,
                               Traits::kThreads, Traits::kSmemBytesDq, params, stream);
        });
      });
}

}  // namespace flash_cutlass::sm80
