// Programmatic dependent launch (sm_90+), device side: a kernel launched with
// launch_after_previous (common/launch.h) may start while the kernel before it in the stream still
// runs, and waits here before it reads what that kernel writes; a kernel lets the next one start
// launching once every CTA of it has called allow_next_grid. Both are no-ops on older GPUs and in
// launches without the attribute.
#pragma once

namespace flash_cutlass {

// Returns once the previous grid in the stream has completed and its memory operations are visible.
__device__ __forceinline__ void wait_for_previous_grid() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

// The next grid in the stream, if launched with launch_after_previous, may begin launching.
__device__ __forceinline__ void allow_next_grid() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

}  // namespace flash_cutlass
