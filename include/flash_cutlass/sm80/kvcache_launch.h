// Host-side launch of the KV-cache kernels (sm80/kvcache_kernel.h); included only by the
// instantiation files.
#pragma once

#include <algorithm>

#include <cuda_runtime_api.h>

#include "flash_cutlass/common/launch.h"
#include "flash_cutlass/common/per_device.h"
#include "flash_cutlass/common/utils.h"
#include "flash_cutlass/compiled_head_dims.h"
#include "flash_cutlass/fwd_api.h"
#include "flash_cutlass/sm80/kvcache_kernel.h"

namespace flash_cutlass::sm80 {

// The attention kernel of one pipeline depth and warp count, with what the host asks of it once per
// device.
template <int kHeadDim, int kStages, class Element, int kWarps = 4>
struct KVCacheKernel {
  using Traits = KVCacheTraits<kHeadDim, kStages, Element, false, kWarps>;

  // Raises the kernel's dynamic shared memory limit past the default 48 KiB on the current device,
  // `device`, on its first launch there (the attribute is per device and stays set).
  static cudaError_t prepare(int device) {
    if constexpr (Traits::kSmemBytes <= 48 * 1024) {
      return cudaSuccess;
    } else {
      static PerDeviceValue prepared;
      const int result = prepared.get(device, [] {
        const cudaError_t status = cudaFuncSetAttribute(&flash_kvcache_sm80<kHeadDim, kStages, Element, kWarps>,
                                                        cudaFuncAttributeMaxDynamicSharedMemorySize, Traits::kSmemBytes);
        return status == cudaSuccess ? 0 : -int(status);
      });
      return result < 0 ? cudaError_t(-result) : cudaSuccess;
    }
  }

  // CTAs one SM of `device` holds at once; 0 where that cannot be found.
  static int ctas_per_sm(int device) {
    static PerDeviceValue ctas;
    return std::max(ctas.get(device, [device] {
      int count = 0;
      if (prepare(device) != cudaSuccess ||
          cudaOccupancyMaxActiveBlocksPerMultiprocessor(&count, &flash_kvcache_sm80<kHeadDim, kStages, Element, kWarps>,
                                                        Traits::kThreads, Traits::kSmemBytes) != cudaSuccess) {
        return -1;
      }
      return count;
    }), 0);
  }

  // after_previous: a programmatic dependent launch (launch_after_previous).
  static cudaError_t launch(KVCacheParams const& params, int device, dim3 grid, cudaStream_t stream,
                            bool after_previous) {
    const cudaError_t status = prepare(device);
    if (status != cudaSuccess) return status;
    return launch_after_previous(&flash_kvcache_sm80<kHeadDim, kStages, Element, kWarps>, grid, Traits::kThreads,
                                 Traits::kSmemBytes, stream, after_previous, params);
  }
};

// The attention kernel with K and V by TMA (flash_kvcache_tma_sm90), for the calls it takes.
template <int kHeadDim, class Element>
struct KVCacheTmaKernel {
  using Traits = KVCacheTraits<kHeadDim, KVCacheStages<kHeadDim>::kStages, Element, true>;

  // Whether the call runs on it: a build with the sm_90a code, a compute capability 9.0 device (its
  // limit not capped: KVCacheDevice::smem_capped), a chunk's rows in one page (a contiguous cache's rows past its end are TMA's zeros), and the
  // caches' addresses and strides as TMA needs them (multiples of 16 bytes).
  static bool takes(KVCacheParams const& params, KVCacheDevice const& device) {
    if constexpr (!has_compiled_head_dims<Direction::kForward, KernelPath::kSm90>()) {
      return false;
    } else {
      const bool on_hopper = device.major == 9 && device.minor == 0 && !device.smem_capped;
      auto aligned = [](int64_t elements) { return elements * int64_t(sizeof(Element)) % 16 == 0; };
      auto pointer_aligned = [](const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; };
      return on_hopper && Traits::kSmemBytes <= device.smem_per_block && params.num_pages >= 1 &&
             (params.block_table == nullptr || params.page_size % Traits::kKeys == 0) &&
             pointer_aligned(params.k) && pointer_aligned(params.v) && aligned(params.head_dim) &&
             aligned(params.k_row_stride) && aligned(params.k_head_stride) && aligned(params.k_batch_stride) &&
             aligned(params.v_row_stride) && aligned(params.v_head_stride) && aligned(params.v_batch_stride);
    }
  }

  static cudaError_t launch(KVCacheParams const& params, int device, dim3 grid, cudaStream_t stream,
                            bool after_previous) {
    using namespace cute;
    static PerDeviceValue prepared;
    const int result = prepared.get(device, [] {
      const cudaError_t status = cudaFuncSetAttribute(
          &flash_kvcache_tma_sm90<kHeadDim, Traits::kStages, Element>, cudaFuncAttributeMaxDynamicSharedMemorySize,
          Traits::kSmemBytes);
      return status == cudaSuccess ? 0 : -int(status);
    });
    if (result < 0) return cudaError_t(-result);
    auto cache = [&](const void* base, int64_t page_stride, int64_t row_stride, int64_t head_stride) {
      return make_tensor(make_gmem_ptr(static_cast<Element const*>(base)),
                         typename Traits::GmemLayout{make_shape(params.page_size, params.head_dim, params.heads_k,
                                                                params.num_pages),
                                                     make_stride(row_stride, _1{}, head_stride, page_stride)});
    };
    const auto tma_k = make_tma_copy(SM90_TMA_LOAD{}, cache(params.k, params.k_batch_stride, params.k_row_stride,
                                                            params.k_head_stride),
                                     typename Traits::SmemLayoutKV{}, typename Traits::TileKV{}, _1{});
    const auto tma_v = make_tma_copy(SM90_TMA_LOAD{}, cache(params.v, params.v_batch_stride, params.v_row_stride,
                                                            params.v_head_stride),
                                     typename Traits::SmemLayoutKV{}, typename Traits::TileKV{}, _1{});
    return launch_after_previous(&flash_kvcache_tma_sm90<kHeadDim, Traits::kStages, Element>, grid, Traits::kThreads,
                                 Traits::kSmemBytes, stream, after_previous, params, tma_k, tma_v);
  }
};

// f(KVCacheKernel<...>{}) of the kernel that runs on `device`: the usual one (KVCacheStages'
// kStages, 4 warps) where its shared memory fits the device's per-block limit, else the compact one
// (kCompactStages, kCompactWarps; only where they differ is a second kernel compiled in).
template <int kHeadDim, class Element, class F>
decltype(auto) with_kvcache_kernel(KVCacheDevice const& device, F&& f) {
  using Stages = KVCacheStages<kHeadDim>;
  using Deep = KVCacheKernel<kHeadDim, Stages::kStages, Element>;
  if constexpr (Stages::kCompactStages != Stages::kStages || Stages::kCompactWarps != Deep::Traits::kWarps) {
    if (Deep::Traits::kSmemBytes > device.smem_per_block) {
      return f(KVCacheKernel<kHeadDim, Stages::kCompactStages, Element, Stages::kCompactWarps>{});
    }
  }
  return f(Deep{});
}

// The attention over the cache (params.num_splits CTAs per tile), then, with more than one split,
// the merge of their partial outputs. The append, if any, ran before (run_kvcache_append).
template <int kHeadDim, DType kDType>
cudaError_t run_kvcache(KVCacheParams const& params, KVCacheDevice const& device, cudaStream_t stream) {
  using Element = typename ElementOf<kDType>::type;
  const int64_t row_blocks = kvcache_row_blocks(params);
  const int64_t kv_heads = int64_t(params.batch) * params.heads_k;
  if (kv_heads > 0x7fffffff || row_blocks > 65535 || params.num_splits < 1 || params.num_splits > 65535) {
    return cudaErrorInvalidConfiguration;
  }
  const dim3 grid(unsigned(kv_heads), unsigned(row_blocks), unsigned(params.num_splits));
  // On Hopper both kernels launch while the kernel before them (the append, the attention) still
  // runs, and wait for it on the GPU (programmatic dependent launch): the launch gaps of a small
  // decoding call are a large part of it. Only where the GPU runs this build's sm_90 machine code:
  // the PTX (of the oldest arch) has no griddepcontrol to wait with.
  const bool after_previous = compiled::kSm90MachineCode && device.major == 9 && device.minor == 0;
  auto launch_cp_async = [&] {
    return with_kvcache_kernel<kHeadDim, Element>(
        device, [&](auto kernel) { return kernel.launch(params, device.index, grid, stream, after_previous); });
  };
  cudaError_t status = cudaSuccess;
  if constexpr (kHeadDim % 64 == 0) {  // the TMA kernel's head dims
    using Tma = KVCacheTmaKernel<kHeadDim, Element>;
    status = Tma::takes(params, device) ? Tma::launch(params, device.index, grid, stream, after_previous)
                                        : launch_cp_async();
  } else {
    status = launch_cp_async();
  }
  if (status != cudaSuccess || params.num_splits == 1) return status;
  const int64_t rows = int64_t(params.batch) * params.heads * params.seqlen_q;
  if (rows > 0x7fffffff) return cudaErrorInvalidConfiguration;
  return launch_after_previous(&flash_kvcache_combine_sm80<kHeadDim, Element>, dim3(unsigned(rows)),
                               combine_warps(params.num_splits) * 32, 0, stream, after_previous, params);
}

// CTAs of the attention kernel one SM of `device` holds at once (for the split heuristic, select.h).
template <int kHeadDim, DType kDType>
int kvcache_ctas_per_sm(KVCacheDevice const& device) {
  using Element = typename ElementOf<kDType>::type;
  return with_kvcache_kernel<kHeadDim, Element>(device, [&](auto kernel) { return kernel.ctas_per_sm(device.index); });
}

// Shared memory per CTA of the attention kernel that runs on `device` (fp16 and bf16 alike).
template <int kHeadDim>
int kvcache_smem_bytes_of(KVCacheDevice const& device) {
  return with_kvcache_kernel<kHeadDim, cutlass::half_t>(
      device, [](auto kernel) { return int(decltype(kernel)::Traits::kSmemBytes); });
}

// The append of the new keys and values (and the rotated queries with rotary).
template <DType kDType>
cudaError_t run_kvcache_append(KVCacheParams const& params, cudaStream_t stream) {
  using Element = typename ElementOf<kDType>::type;
  const int64_t rows = int64_t(params.batch) * params.seqlen_new * params.heads_k +
                       (params.rotary_cos != nullptr ? int64_t(params.batch) * params.seqlen_q * params.heads : 0);
  const int64_t threads = rows * (params.head_dim / 8);
  if (threads == 0) return cudaSuccess;
  const int64_t ctas = (threads + 127) / 128;
  if (ctas > 0x7fffffff) return cudaErrorInvalidConfiguration;
  flash_kvcache_append_sm80<Element><<<unsigned(ctas), 128, 0, stream>>>(params);
  return cudaGetLastError();
}

// The gather of every sequence's cache into packed, after the append (flash_kvcache_gather_sm80;
// the paged form only its lengths, one CTA per sequence), or the in-place form's lengths
// (flash_kvcache_sequences_sm80).
template <DType kDType>
cudaError_t run_kvcache_gather(KVCacheParams const& params, KVCachePacked const& packed, cudaStream_t stream) {
  using Element = typename ElementOf<kDType>::type;
  if (packed.form == KVCachePacked::Form::kInPlace) {
    flash_kvcache_sequences_sm80<Element><<<unsigned((params.batch + 127) / 128), 128, 0, stream>>>(params, packed);
    return cudaGetLastError();
  }
  const bool copies = packed.form == KVCachePacked::Form::kGathered;
  const int64_t row_blocks =
      copies ? std::max<int64_t>((int64_t(params.capacity) + kKVCacheGatherRows - 1) / kKVCacheGatherRows, 1) : 1;
  if (row_blocks > 0x7fffffff || params.batch > 65535 || params.heads_k > 65535) return cudaErrorInvalidConfiguration;
  const dim3 grid(unsigned(row_blocks), unsigned(params.batch), unsigned(copies ? params.heads_k : 1));
  flash_kvcache_gather_sm80<Element><<<grid, 128, 0, stream>>>(params, packed);
  return cudaGetLastError();
}

}  // namespace flash_cutlass::sm80
