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
#include "flash_cutlass/common/kvcache.h"
#include "flash_cutlass/params.h"

namespace flash_cutlass::sm90 {

// One TMA descriptor (128 bytes) per sequence in params.sequence_descriptors.
inline constexpr int kSequenceDescriptorBytes = int(sizeof(cute::TmaDescriptor));

// The row of V's per-sequence descriptor at which the sequence's key 0 sits: the descriptor spans
// total_k rows ending at the sequence's last key, so keys past the sequence lie past its extent.
__device__ __forceinline__ int value_row_origin(FwdParams const& params, Sequence const& sequence) {
  return int(params.total_k) - sequence.seqlen_k;
}

// One thread per sequence: copies value_descriptor (built over the packed V) into the sequence's
// slot and moves its base address to row start + length - total_k, the rows of sequence_rows (the
// lengths the forward kernel derives). The address may lie before V's allocation; TMA reads only
// the rows of the extent's last `length` rows, the sequence's own. Paged V (params.block_table;
// value_descriptor built over the pages' rows): the extent ends at the page row of the sequence's
// last key instead, for the key block that holds it (fwd_producer.h, load_paged_tile).
template <class Element>
__global__ void shift_value_descriptors(const __grid_constant__ cute::TmaDescriptor value_descriptor,
                                        const __grid_constant__ FwdParams params) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  const int batch = int(blockIdx.x * blockDim.x + threadIdx.x);
  if (batch >= params.batch) return;
  const SequenceRows rows = sequence_rows(params.cu_seqlens_k, batch, params.total_k, params.seqlen_k);
  auto* descriptor = static_cast<cute::TmaDescriptor*>(params.sequence_descriptors) + batch;
  *descriptor = value_descriptor;
  int64_t first_row = int64_t(rows.start) + rows.length - params.total_k;
  if (params.block_table != nullptr) {
    const int64_t page_rows = int64_t(params.num_pages) * params.page_size;
    first_row = rows.length > 0 ? paged_keys(params, batch).row_of(rows.length - 1) + 1 - page_rows : 0;
  }
  const auto* base = static_cast<Element const*>(params.v) + first_row * params.v_row_stride;
  cute::tma_descriptor_replace_addr_in_global_mem(descriptor, base);
  cute::tma_descriptor_fence_release();
#endif  // Other targets get an empty body: the host launches this kernel only on sm_90.
}

}  // namespace flash_cutlass::sm90
