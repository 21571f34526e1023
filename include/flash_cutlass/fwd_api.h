// Torch-free, kernel-free declarations of the forward and backward entry points: what the host file
// (csrc/flash_api.cpp) sees. Each instantiation lives in a file csrc/catalogue.py generates.
#pragma once

#include <cuda_runtime_api.h>

#include "flash_cutlass/compiled_head_dims.h"
#include "flash_cutlass/params.h"

namespace flash_cutlass {

// The shape of the Hopper forward's developer timeline (FLASH_CUTLASS_TIMELINE=1, sm90/timeline.h):
// one value per (CTA, tile step, warpgroup, event), for the first kCtas CTAs and kSteps tiles.
struct FwdTimeline {
  static constexpr int kCtas = 256;
  static constexpr int kSteps = 64;
  static constexpr int kWarpgroups = 4;
  static constexpr int kEvents = 16;
  static constexpr int kEntries = kCtas * kSteps * kWarpgroups * kEvents;
};

// What the KV-cache launches need of the device a call runs on (the current one), which the host
// caches per device: its index, SM count and per-block shared memory limit (the opt-in maximum).
struct KVCacheDevice {
  int index;
  int sm_count;
  int smem_per_block;
  int major;  // compute capability
  int minor;
  // smem_per_block is FLASH_CUTLASS_SMEM_PER_BLOCK's, below the GPU's own: the kernels of a GPU of
  // that limit run (not the Hopper-only KV-cache TMA kernel, which no such GPU has).
  bool smem_capped = false;
};

namespace sm90 {
template <int kHeadDim, DType kDType, MaskKind kMaskKind, Extension kExtension>
cudaError_t run_fwd(FwdParams const& params, cudaStream_t stream);

#ifdef FLASH_CUTLASS_TIMELINE
// Copies the timeline of head dim kHeadDim's kernels to host (FwdTimeline::kEntries values), then
// clears it.
template <int kHeadDim>
cudaError_t read_fwd_timeline(unsigned long long* host);
#endif

template <int kHeadDim, DType kDType, MaskKind kMaskKind, Extension kExtension>
cudaError_t run_bwd(BwdParams const& params, cudaStream_t stream);
}  // namespace sm90

namespace sm80 {
template <int kHeadDim, DType kDType, MaskKind kMaskKind, Extension kExtension>
cudaError_t run_fwd(FwdParams const& params, cudaStream_t stream);

template <int kHeadDim, DType kDType, MaskKind kMaskKind, Extension kExtension>
cudaError_t run_bwd(BwdParams const& params, cudaStream_t stream);

// The KV-cache kernels (sm80/kvcache_launch.h): the append of new tokens and the gather of the
// caches for the Hopper forward (one instantiation per dtype each), the attention over the cache
// with its split merge, and what the host asks of the latter before a launch.
template <DType kDType>
cudaError_t run_kvcache_append(KVCacheParams const& params, cudaStream_t stream);
template <DType kDType>
cudaError_t run_kvcache_gather(KVCacheParams const& params, KVCachePacked const& packed, cudaStream_t stream);
template <int kHeadDim, DType kDType>
cudaError_t run_kvcache(KVCacheParams const& params, KVCacheDevice const& device, cudaStream_t stream);
template <int kHeadDim, DType kDType>
int kvcache_ctas_per_sm(KVCacheDevice const& device);
template <int kHeadDim>
int kvcache_smem_bytes_of(KVCacheDevice const& device);

// Dynamic shared memory one CTA of the sm80 path's kernel of `direction` for `kernel_hdim` needs on
// the tiles of tier `tier` (FwdParams::sm80_tile_tier; the backward's: its main kernel, the largest
// of its kernels), in bytes; 0 where the head dim has no such tier.
int smem_bytes(Direction direction, int kernel_hdim, int tier);
}  // namespace sm80

}  // namespace flash_cutlass
