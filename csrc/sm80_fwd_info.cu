// Facts about the sm80-path forward kernels that the host checks before a launch.
#include "flash_cutlass/fwd_api.h"
#include "flash_cutlass/sm80/kernel_traits.h"

namespace flash_cutlass::sm80 {

int fwd_smem_bytes(int kernel_hdim) {
  // Shared memory depends on the element size only, and fp16 and bf16 have the same.
  switch (kernel_hdim) {
    case 32: return FwdTraitsFor<32, cutlass::half_t>::kSmemBytes;
    case 64: return FwdTraitsFor<64, cutlass::half_t>::kSmemBytes;
    case 96: return FwdTraitsFor<96, cutlass::half_t>::kSmemBytes;
    case 128: return FwdTraitsFor<128, cutlass::half_t>::kSmemBytes;
    case 192: return FwdTraitsFor<192, cutlass::half_t>::kSmemBytes;
    case 256: return FwdTraitsFor<256, cutlass::half_t>::kSmemBytes;
    default: return 0;
  }
}

}  // namespace flash_cutlass::sm80
