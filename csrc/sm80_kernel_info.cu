// Facts about the sm80-path kernels that the host checks before a launch.
#include "flash_cutlass/fwd_api.h"
#include "flash_cutlass/sm80/bwd_kernel.h"
#include "flash_cutlass/sm80/kernel_traits.h"

namespace flash_cutlass::sm80 {

// Shared memory depends on the element size only, and fp16 and bf16 have the same.
template <template <int, class> class TraitsFor>
int smem_bytes_of(int kernel_hdim) {
  switch (kernel_hdim) {
    case 32: return TraitsFor<32, cutlass::half_t>::kSmemBytes;
    case 64: return TraitsFor<64, cutlass::half_t>::kSmemBytes;
    case 96: return TraitsFor<96, cutlass::half_t>::kSmemBytes;
    case 128: return TraitsFor<128, cutlass::half_t>::kSmemBytes;
    case 192: return TraitsFor<192, cutlass::half_t>::kSmemBytes;
    case 256: return TraitsFor<256, cutlass::half_t>::kSmemBytes;
    default: return 0;
  }
}

int fwd_smem_bytes(int kernel_hdim) { return smem_bytes_of<FwdTraitsFor>(kernel_hdim); }
int bwd_smem_bytes(int kernel_hdim) { return smem_bytes_of<BwdTraitsFor>(kernel_hdim); }

}  // namespace flash_cutlass::sm80
