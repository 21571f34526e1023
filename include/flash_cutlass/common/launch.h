// Host-side launch of a kernel that takes its parameters by value, on a 1-D grid.
#pragma once

#include <cstdint>
#include <type_traits>
#include <utility>

#include <cuda_runtime_api.h>

namespace flash_cutlass {

// Raises the kernel's dynamic shared memory limit where it needs more than the default 48 KiB.
template <class Params>
cudaError_t allow_dynamic_smem(void (*kernel)(Params), int smem_bytes) {
  if (smem_bytes <= 48 * 1024) return cudaSuccess;
  return cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem_bytes);
}

// Raises the shared memory limit (allow_dynamic_smem), refuses grids past 2^31 - 1 CTAs, and
// launches.
template <class Params>
cudaError_t launch_kernel(void (*kernel)(Params), int64_t num_ctas, int threads, int smem_bytes,
                          Params const& params, cudaStream_t stream) {
  const cudaError_t status = allow_dynamic_smem(kernel, smem_bytes);
  if (status != cudaSuccess) return status;
  if (num_ctas > 0x7fffffff) return cudaErrorInvalidConfiguration;
  kernel<<<dim3(static_cast<unsigned>(num_ctas)), threads, smem_bytes, stream>>>(params);
  return cudaGetLastError();
}

// The same as a cooperative launch: every CTA resident at once, or cudaErrorCooperativeLaunchTooLarge
// without launching (the grid waits on itself: sm90/tile_scheduler.h, the rotated walks).
template <class Params>
cudaError_t launch_cooperative_kernel(void (*kernel)(Params), int num_ctas, int threads, int smem_bytes,
                                      Params const& params, cudaStream_t stream) {
  const cudaError_t status = allow_dynamic_smem(kernel, smem_bytes);
  if (status != cudaSuccess) return status;
  void* args[] = {const_cast<Params*>(&params)};
  return cudaLaunchCooperativeKernel(reinterpret_cast<const void*>(kernel), dim3(unsigned(num_ctas)), dim3(threads),
                                     args, size_t(smem_bytes), stream);
}

// Launches kernel(args...) on `grid`; with `after_previous` (a GPU of compute capability 9.0 or
// more) as a programmatic dependent launch: it may start while the previous kernel in the stream
// still runs, and must call wait_for_previous_grid() (common/grid_dependency.h) before it reads
// what that kernel writes. Captured into CUDA graphs as a programmatic edge.
template <class... Params, class... Args>
cudaError_t launch_after_previous(void (*kernel)(Params...), dim3 grid, int threads, int smem_bytes,
                                  cudaStream_t stream, bool after_previous, Args const&... args) {
  cudaLaunchConfig_t config = {};
  config.gridDim = grid;
  config.blockDim = dim3(unsigned(threads));
  config.dynamicSmemBytes = size_t(smem_bytes);
  config.stream = stream;
  cudaLaunchAttribute attribute;
  if (after_previous) {
    attribute.id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attribute.val.programmaticStreamSerializationAllowed = 1;
    config.attrs = &attribute;
    config.numAttrs = 1;
  }
  return cudaLaunchKernelEx(&config, kernel, args...);
}

// The current device's number of SMs: the size of a persistent grid.
inline cudaError_t multiprocessor_count(int* count) {
  int device = 0;
  const cudaError_t status = cudaGetDevice(&device);
  if (status != cudaSuccess) return status;
  return cudaDeviceGetAttribute(count, cudaDevAttrMultiProcessorCount, device);
}

// A kernel's tile configuration as a value: launch(TilesOf<Traits>{}) reads TilesOf::type.
template <class Traits>
struct TilesOf {
  using type = Traits;
};

// launch(TilesOf<Tiers...[tier]>{}): the sm80 path's tiles of one tier. A tier is void where a head
// dim has none, and the host never picks it there (cudaErrorInvalidConfiguration if it did).
template <class Tier, class... Smaller, class Launch>
cudaError_t launch_with_tiles(int tier, Launch&& launch) {
  if (tier == 0) {
    if constexpr (!std::is_void_v<Tier>) return launch(TilesOf<Tier>{});
    return cudaErrorInvalidConfiguration;
  }
  if constexpr (sizeof...(Smaller) > 0) {
    return launch_with_tiles<Smaller...>(tier - 1, std::forward<Launch>(launch));
  } else {
    return cudaErrorInvalidConfiguration;
  }
}

}  // namespace flash_cutlass
