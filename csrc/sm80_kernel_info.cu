// Facts about the sm80-path kernels that the host checks before a launch.
#include <type_traits>

#include "flash_cutlass/dispatch.h"
#include "flash_cutlass/fwd_api.h"
#include "flash_cutlass/sm80/bwd_kernel.h"
#include "flash_cutlass/sm80/kernel_traits.h"

namespace flash_cutlass::sm80 {

// Shared memory depends on the element size only, and fp16 and bf16 have the same. The sm80
// path's head dims are the build's (both directions have the same list, or the backward none).
template <template <int, class> class TraitsFor>
int smem_bytes_of(int kernel_hdim) {
  int bytes = 0;
  detail::with_value(compiled::Sm80ForwardHeadDims{}, kernel_hdim, [&](auto hdim) {
    bytes = TraitsFor<decltype(hdim)::value, cutlass::half_t>::kSmemBytes;
    return cudaSuccess;
  });
  return bytes;
}

int fwd_smem_bytes(int kernel_hdim) { return smem_bytes_of<FwdTraitsFor>(kernel_hdim); }
int bwd_smem_bytes(int kernel_hdim) { return smem_bytes_of<BwdTraitsFor>(kernel_hdim); }

// The same of the tiles for smaller shared memories; 0 where a head dim has none (void).
template <template <int, class> class TraitsFor>
int compact_smem_bytes_of(int kernel_hdim) {
  int bytes = 0;
  detail::with_value(compiled::Sm80ForwardHeadDims{}, kernel_hdim, [&](auto hdim) {
    using Compact = TraitsFor<decltype(hdim)::value, cutlass::half_t>;
    if constexpr (!std::is_void_v<Compact>) bytes = Compact::kSmemBytes;
    return cudaSuccess;
  });
  return bytes;
}

int fwd_compact_smem_bytes(int kernel_hdim) { return compact_smem_bytes_of<FwdCompactTraitsFor>(kernel_hdim); }
int bwd_compact_smem_bytes(int kernel_hdim) { return compact_smem_bytes_of<BwdCompactTraitsFor>(kernel_hdim); }

}  // namespace flash_cutlass::sm80
