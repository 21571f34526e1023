// Per-sequence TMA descriptors for V in a variable-length Hopper forward. TMA fills a tile's rows
// past the tensor's extent with zeros, but in a packed batch the rows past a sequence are the next
// sequence's: P is 0 on them, yet 0 * NaN = NaN would reach this sequence's outputs. A copy of V's
// descriptor per sequence, its base moved so that the tensor's extent ends where the sequence
// ends, makes those rows zeros at no cost to the consumers (K needs none: masked scores are
// replaced by -inf, whatever they were).
#pragma once

#include <cstdint>

#include <cute/arch/copy_sm90_desc.hpp>

#include "flash_cutlass/common/block_info.h"
#include "flash_cutlass/params.h"
#include "flash_cutlass/sm90/paged_keys.h"
#include "flash_cutlass/sm90/tma_views.h"

namespace flash_cutlass::sm90 {

// One TMA descriptor (128 bytes) per sequence in params.sequence_descriptors.
inline constexpr int kSequenceDescriptorBytes = int(sizeof(cute::TmaDescriptor));

// The row of V's per-sequence descriptor at which the sequence's key 0 sits: the descriptor spans
// the view's rows (tma_extents) ending at the sequence's last key, so keys past the sequence lie
// past its extent. Over a paged cache only the keys of the last key's page are where this puts
// them (paged_keys.h; the producer reads the rest through the cache's own descriptor).
template <bool kPagedKV>
__device__ __forceinline__ int value_row_origin(FwdParams const& params, Sequence const& sequence) {
  return tma_extents<kPagedKV>(params).rows_k - sequence.seqlen_k;
}

// One thread per sequence: copies value_descriptor (built over the packed V, or over a paged cache
// with boxes of kPagedBoxRows rows) into the sequence's slot and moves its base address so that
// the extent ends past the sequence's last key (sequence_rows: the lengths the forward kernel
// derives). The address may lie before V's allocation; TMA reads only the extent's rows up to the
// sequence's last key, the sequence's own (packed) or its last page's (paged).
template <class Element>
__global__ void shift_value_descriptors(const __grid_constant__ cute::TmaDescriptor value_descriptor,
                                        const __grid_constant__ FwdParams params) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  const int batch = int(blockIdx.x * blockDim.x + threadIdx.x);
  if (batch >= params.batch) return;
  const SequenceRows rows = sequence_rows(params.cu_seqlens_k, batch, params.total_k, params.seqlen_k);
  auto* descriptor = static_cast<cute::TmaDescriptor*>(params.sequence_descriptors) + batch;
  *descriptor = value_descriptor;
  // The row past the sequence's last key: in the packed V, or in its last page of a paged cache
  // (sequences without keys or queries load none: their descriptors stay V's).
  const bool paged = params.paged_block_table != nullptr;
  if (!paged || (rows.length > 0 && batch % 2 == 0)) {
    const int64_t end_row =
        paged ? int64_t(paged_key_row(params, batch, rows.length - 1)) + 1 : int64_t(rows.start) + rows.length;
    const int64_t first_row = end_row - (paged ? tma_extents<true>(params) : tma_extents(params)).rows_k;
    const auto* base = static_cast<Element const*>(params.v) + first_row * params.v_row_stride;
    cute::tma_descriptor_replace_addr_in_global_mem(descriptor, base);
  }
  cute::tma_descriptor_fence_release();
#endif  // Other targets get an empty body: the host launches this kernel only on sm_90.
}

}  // namespace flash_cutlass::sm90
