// The Hopper bulk copy engine's reduce without a tensor map: contiguous bytes of shared memory
// added to global memory (cp.reduce.async.bulk, PTX ISA 8.0, sm_90). Completion is tracked per
// issuing thread with bulk groups: cute::tma_store_arrive() commits, cute::tma_store_wait<N>()
// waits until at most N of its groups still read shared memory.
#pragma once

#include <cstdint>

namespace flash_cutlass::sm90 {

// gmem[0 : bytes / 4) += smem[0 : bytes / 4) in fp32, asynchronously. Both addresses 16-byte
// aligned, bytes a multiple of 16; the shared memory written before it must be made visible to
// the async proxy (fence.proxy.async.shared::cta) and ordered before this thread (a barrier).
__device__ __forceinline__ void bulk_reduce_add(float* gmem, const float* smem, int bytes) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [%0], [%1], %2;\n" ::"l"(gmem),
               "r"(static_cast<uint32_t>(__cvta_generic_to_shared(smem))), "r"(bytes)
               : "memory");
#endif
}

}  // namespace flash_cutlass::sm90
