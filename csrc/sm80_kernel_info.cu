// Facts about the sm80-path kernels that the host checks before a launch.
#include <type_traits>
#include <utility>

#include "flash_cutlass/dispatch.h"
#include "flash_cutlass/common/launch.h"
#include "flash_cutlass/fwd_api.h"
#include "flash_cutlass/sm80/bwd_kernel.h"
#include "flash_cutlass/sm80/kernel_traits.h"

namespace flash_cutlass::sm80 {

// Shared memory depends on the element size only, and fp16 and bf16 have the same. The sm80
// path's head dims are the build's (both directions have the same list, or the backward none).
template <template <int, int, class> class TraitsOfTier>
int smem_bytes_of(int kernel_hdim, int tier) {
  int bytes = 0;
  detail::with_value(compiled::Sm80ForwardHeadDims{}, kernel_hdim, [&](auto hdim) {
    [&]<int... kTiers>(std::integer_sequence<int, kTiers...>) {
      ((tier == kTiers ? [&] {
         using Traits = TraitsOfTier<decltype(hdim)::value, kTiers, cutlass::half_t>;
         if constexpr (!std::is_void_v<Traits>) bytes = Traits::kSmemBytes;
       }()
                       : void()),
       ...);
    }(std::make_integer_sequence<int, kSm80TileTiers>{});
    return cudaSuccess;
  });
  return bytes;
}

int smem_bytes(Direction direction, int kernel_hdim, int tier) {
  return direction == Direction::kForward ? smem_bytes_of<FwdTraitsOfTier>(kernel_hdim, tier)
                                          : smem_bytes_of<BwdTraitsOfTier>(kernel_hdim, tier);
}

}  // namespace flash_cutlass::sm80
