// Facts about the sm80-path kernels that the host checks before a launch.
#include <type_traits>

#include "flash_cutlass/dispatch.h"
#include "flash_cutlass/fwd_api.h"
#include "flash_cutlass/sm80/bwd_kernel.h"
#include "flash_cutlass/sm80/kernel_traits.h"

namespace flash_cutlass::sm80 {

// Shared memory depends on the element size only, and fp16 and bf16 have the same.
template <template <int, int, class> class TraitsOfTier, int kHeadDim, int kTier = 0>
int tier_smem_bytes(int tier) {
  if constexpr (kTier < kSm80TileTiers) {
    using Traits = TraitsOfTier<kHeadDim, kTier, cutlass::half_t>;
    if (tier == kTier) {
      if constexpr (std::is_void_v<Traits>) {
        return 0;
      } else {
        return Traits::kSmemBytes;
      }
    }
    return tier_smem_bytes<TraitsOfTier, kHeadDim, kTier + 1>(tier);
  } else {
    return 0;
  }
}

// The sm80 path's head dims are the build's (both directions have the same list, or the backward
// none).
template <template <int, int, class> class TraitsOfTier>
int smem_bytes_of(int kernel_hdim, int tier) {
  int bytes = 0;
  detail::with_value(compiled::Sm80ForwardHeadDims{}, kernel_hdim, [&](auto hdim) {
    bytes = tier_smem_bytes<TraitsOfTier, decltype(hdim)::value>(tier);
    return cudaSuccess;
  });
  return bytes;
}

int smem_bytes(Direction direction, int kernel_hdim, int tier) {
  return direction == Direction::kForward ? smem_bytes_of<FwdTraitsOfTier>(kernel_hdim, tier)
                                          : smem_bytes_of<BwdTraitsOfTier>(kernel_hdim, tier);
}

}  // namespace flash_cutlass::sm80
